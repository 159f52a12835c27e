"""Speculative decoding for a request alone in the batch: the speculator, the draft model, acceptance rules, grammar-checked drafts."""
