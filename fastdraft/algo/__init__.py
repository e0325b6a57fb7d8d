"""GRPO / RLOO / DAPO maths: advantages, the policy loss and objective, the lossless gate, token
statistics."""
