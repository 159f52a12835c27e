"""The engine front of a server with several models: one object the HTTP layer holds as it holds an
Engine, answering each request from the engine of the model that request named.

The server binds a request to its model before any route runs (server/model_select.py: the body's
`model` is resolved, the model leased and loaded, `bind` called); from then on every attribute of this
front read in that request's task (and in the thread-pool calls and streams it starts, which copy its
context) is the bound engine's. Outside a request (the lifespan, /health, /metrics) the front answers
for the registry as a whole, or for the default model when it is loaded.
"""

from __future__ import annotations

import contextvars
from typing import Any

from ..config import Config
from ..engine.front import EngineFront
from ..errors import ShuttingDownError
from .registry import Lease, ModelRegistry

_BOUND: contextvars.ContextVar[tuple[Any, str] | None] = contextvars.ContextVar("mlx_kvserve_model", default=None)


def bind(lease: Lease, requested: str | None) -> contextvars.Token:
    """Serve the rest of this request (its task and what it starts) with `lease`'s engine. The model
    name replies carry is the id the client sent when it names this model (an alias too), else its id."""
    entry = lease.slot.entry
    name = requested if requested in (entry.name, *entry.aliases) else entry.name
    return _BOUND.set((lease.engine, name))


def unbind(token: contextvars.Token) -> None:
    _BOUND.reset(token)


class _Current:
    """An object whose attributes are those of the one `get()` returns at each access."""

    def __init__(self, get: Any):
        self._get = get

    def __getattr__(self, name: str) -> Any:
        return getattr(self._get(), name)


class RoutedEngine(EngineFront):
    """The server's EngineFront (engine/front.py) over several models (see the module docstring): each member
    is the bound engine's, named here one by one; the embedding members (server/embeddings.py) too."""

    def __init__(self, registry: ModelRegistry):
        self.registry = registry
        self._config = registry.config

    def _engine(self) -> Any:
        bound = _BOUND.get()
        if bound is not None:
            return bound[0]
        slot = self.registry.default
        engine = slot.engine
        if engine is None:
            raise ShuttingDownError(f"the default model {slot.entry.name!r} is not loaded")
        return engine

    @property
    def config(self) -> Config:
        return self._config

    # --- the bound engine's (the default model's outside a request) ----------------------------

    @property
    def model_path(self) -> Any:
        return self._engine().model_path

    @property
    def tokenizer(self) -> Any:
        return self._engine().tokenizer

    @property
    def vocab_size(self) -> int:
        return self._engine().vocab_size

    @property
    def vision(self) -> Any:
        return self._engine().vision

    @property
    def started_at(self) -> float:
        return self._engine().started_at

    @property
    def cache_enabled(self) -> bool:
        return self._engine().cache_enabled

    @property
    def cache_reason(self) -> str:
        return self._engine().cache_reason

    @property
    def leases_active(self) -> bool:
        return self._engine().leases_active

    @property
    def keeps_checkpoints(self) -> bool:
        return self._engine().keeps_checkpoints

    def router_view(self) -> Any:
        return self._engine().router_view()

    def block_hashes(self, tokens: list[int], principal: str = "") -> list[bytes]:
        return self._engine().block_hashes(tokens, principal)

    def chat_tokens(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        template_kwargs: dict[str, Any] | None = None,
        principal: str = "",
    ) -> list[int]:
        return self._engine().chat_tokens(messages, add_generation_prompt, tools, template_kwargs, principal)

    def chat_text(self, messages: list[dict[str, Any]], tools: list | None, template_kwargs: Any) -> str | None:
        return self._engine().chat_text(messages, tools, template_kwargs)

    def tokens_within(self, text: str, ids: list[int], chars: int, principal: str = "") -> int | None:
        return self._engine().tokens_within(text, ids, chars, principal)

    def text_tokens(self, prompt: str) -> list[int]:
        return self._engine().text_tokens(prompt)

    def check_schema(self, schema: dict[str, Any]) -> str:
        return self._engine().check_schema(schema)

    def call_grammar(self, prompt: list[int], spec: Any) -> str:
        return self._engine().call_grammar(prompt, spec)

    def submit(self, req: Any) -> None:
        self._engine().submit(req)

    def prefill(self, tokens: list[int], timeout: float | None = None, principal: str = "") -> None:
        self._engine().prefill(tokens, timeout, principal)

    def prompt_progress(self, req: Any) -> dict[str, int] | None:
        """None from an engine without prefill progress (a model's own process behind a proxy)."""
        read = getattr(self._engine(), "prompt_progress", None)
        return read(req) if callable(read) else None

    # --- a bound embedding model's (server/embeddings.py; a chat model has none of these) -------

    @property
    def is_embedding(self) -> bool:
        return getattr(self._engine(), "is_embedding", False)

    @property
    def dimensions(self) -> int:
        return self._engine().dimensions

    @property
    def min_dimensions(self) -> int:
        return self._engine().min_dimensions

    @property
    def normalize(self) -> bool:
        return self._engine().normalize

    def embed(self, inputs: list[list[int]]) -> Any:
        return self._engine().embed(inputs)

    @property
    def model_name(self) -> str:
        bound = _BOUND.get()
        return bound[1] if bound is not None else self.registry.default.entry.name

    @property
    def context_length(self) -> int:
        bound = _BOUND.get()
        engine = bound[0] if bound is not None else self.registry.default.engine
        return engine.context_length if engine is not None else 0

    def cache_admin(self) -> Any:
        """The bound engine's cache admin, looked up at each use (routes keep what this returns)."""
        return _Current(lambda: self._engine().cache_admin())

    # --- the registry as a whole (outside a request) ------------------------------------------

    def start(self) -> None:
        self.registry.start()

    def stop(self, timeout: float | None = None) -> None:
        self.registry.stop(timeout)

    def pin_files(self, paths: list[str]) -> None:
        """[cache] pin_on_start: pinned in the default model's cache (loaded for it)."""
        with self.registry.acquire(None) as lease:
            lease.engine.pin_files(paths)

    def _each(self) -> list[tuple[str, Any]]:
        bound = _BOUND.get()
        return [("", bound[0])] if bound is not None else self.registry.loaded_engines()

    @property
    def is_alive(self) -> bool:
        return all(engine.is_alive for _, engine in self._each())

    @property
    def failure(self) -> str:
        return "; ".join(f"{n}: {e.failure}" for n, e in self._each() if e.failure)

    def ssd_problem(self) -> str:
        return "; ".join(f"{n}: {p}" for n, e in self._each() if (p := e.ssd_problem()))

    @property
    def queue_depth(self) -> int:
        return sum(engine.queue_depth for _, engine in self._each())

    @property
    def is_busy(self) -> bool:
        return any(engine.is_busy for _, engine in self._each())

    def batch_stats(self) -> dict[str, Any]:
        """The loaded engines' batches: counts and work summed, rates from the sums."""
        if _BOUND.get() is not None:
            return self._engine().batch_stats()
        total: dict[str, Any] = {}
        for _, engine in self.registry.loaded_engines():
            for key, value in engine.batch_stats().items():
                if isinstance(value, (int, float)) and not key.endswith("_per_s"):
                    total[key] = total.get(key, 0) + value
                elif key == "prefilling":  # every model's prompts prefilling now, one list
                    total.setdefault(key, []).extend(value)
        keys = ("running", "waiting", "batch_size", "max_batch", "prefill_tokens", "prefill_s", "decode_tokens")
        for key in (*keys, "decode_s", "shared_prefix_waits"):
            total.setdefault(key, 0)
        for phase in ("prefill", "decode"):
            s = total[f"{phase}_s"]
            total[f"{phase}_tokens_per_s"] = round(total[f"{phase}_tokens"] / s, 1) if s else 0.0
        return total

    def cache_stats(self) -> dict[str, Any]:
        """Bound: that engine's. Else the default model's when loaded (what /metrics reads), with
        every loaded model's under "models"."""
        if _BOUND.get() is not None:
            return self._engine().cache_stats()
        loaded = self.registry.loaded_engines()
        default = self.registry.default.engine
        stats = dict(default.cache_stats()) if default is not None else {"enabled": False}
        stats["models"] = {name: engine.cache_stats() for name, engine in loaded}
        return stats

    def health(self) -> dict[str, Any]:
        """/health: the default model's fields when it is loaded, and every model's state and figures."""
        default = self.registry.default.engine
        body: dict[str, Any] = {"status": "ok", "model": self.registry.default.entry.name}
        if default is not None:
            body = default.health()
        described = self.registry.describe()
        loaded = dict(self.registry.loaded_engines())
        for row in described["models"]:
            engine = loaded.get(row["id"])
            if engine is not None:
                row["batch"] = engine.batch_stats()
                row["cache"] = engine.cache_stats()
                if getattr(engine, "memory_plan", None) is not None:  # in this process: its share of the plan
                    row["memory_plan"] = engine.memory_plan.describe()
        body.update(
            {
                "memory_plan": described["memory_plan"],  # the models' plan (the default's is its row's)
                "memory_budget_bytes": described["memory_budget_bytes"],
                "memory_used_bytes": described["memory_used_bytes"],
                "models": described["models"],
            }
            | {k: v for k, v in described.items() if k.startswith("ssd_")}  # the shared SSD budget, if any
        )
        return body
