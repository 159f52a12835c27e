"""mlx-kvserve: a local OpenAI-compatible LLM server whose KV cache outlives requests and restarts."""

__version__ = "0.1.0"
