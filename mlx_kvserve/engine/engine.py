"""The engine: a loaded model, its tokenizer and the worker thread that owns MLX.

The HTTP layer talks only to this class: it tokenizes prompts (thread-safe, no MLX) and submits
GenerationRequests; everything that touches MLX happens on the worker thread.
"""

from __future__ import annotations

import time
from typing import Any

from ..config import Config
from ..models.loader import LoadedModel
from .generate import Generator
from .request import GenerationRequest
from .worker import InferenceWorker


class Engine:
    def __init__(self, loaded: LoadedModel, config: Config):
        self.loaded = loaded
        self.config = config
        self.generator = Generator(loaded.model, loaded.tokenizer, config.generation.prefill_step_size)
        self.worker = InferenceWorker(self.generator, config.server.max_queue)
        self.started_at = time.time()

    @property
    def model_name(self) -> str:
        return self.loaded.name

    @property
    def context_length(self) -> int:
        return self.loaded.context_length

    def start(self) -> None:
        self.worker.start()

    def stop(self, timeout: float | None = None) -> None:
        self.worker.stop(timeout)

    def submit(self, req: GenerationRequest) -> None:
        self.worker.submit(req)

    def chat_tokens(self, messages: list[dict[str, str]]) -> list[int]:
        """Token ids of `messages` under the model's chat template, ready for the assistant turn."""
        return list(self.loaded.tokenizer.apply_chat_template(messages, add_generation_prompt=True))

    def text_tokens(self, prompt: str) -> list[int]:
        return list(self.loaded.tokenizer.encode(prompt))

    def cache_stats(self) -> dict[str, Any]:
        return {}

    def health(self) -> dict[str, Any]:
        return {
            "status": "ok",
            "model": self.model_name,
            "uptime_s": round(time.time() - self.started_at, 1),
            "queue_depth": self.worker.queue_depth,
            "busy": self.worker.is_busy,
            "context_length": self.context_length,
            "cache": self.cache_stats(),
        }
