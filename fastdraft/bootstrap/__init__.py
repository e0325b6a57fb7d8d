"""Bootstrap of the tiny CPU policy: its character tokenizer (model and trainer live elsewhere)."""
