"""Per-request sampling and constrained decoding (llguidance grammars for JSON schemas and tool calls)."""
