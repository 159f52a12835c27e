"""The engine's front of the block cache: lookup and assembly before prefill, registration after, SSD front prefill, warm start, admin, router view, message starts, the token memo."""
