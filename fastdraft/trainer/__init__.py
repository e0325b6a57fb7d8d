"""The online drafter trainer: losses over captured hidden states (losses.py)."""
