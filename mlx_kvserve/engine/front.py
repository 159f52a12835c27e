"""What the HTTP server may call on an engine: the `EngineFront` protocol.

Two classes implement it: `engine.Engine` (one model, in this process) and the several-models front
(registry/front.py `RoutedEngine`, which answers each request from the engine of the model it named). The
server's handlers are typed against this protocol, so a member the server starts to use is added here,
and a test (tests/engine/test_front.py) checks that both fronts have every member with a compatible
signature. Members read from any thread unless a docstring says otherwise; none touches MLX.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from ..config import Config
    from .cache.admin import CacheAdmin
    from .cache.router_view import RouterView
    from .request import GenerationRequest
    from .sampling.tool_grammar import CallGrammar


class EngineFront(Protocol):
    """A served model as the server sees it (see the module docstring)."""

    @property
    def config(self) -> Config: ...

    @property
    def model_name(self) -> str: ...

    @property
    def model_path(self) -> Any: ...

    @property
    def tokenizer(self) -> Any:
        """The model's tokenizer (thread-safe to encode and decode with)."""

    @property
    def context_length(self) -> int: ...

    @property
    def vocab_size(self) -> int: ...

    @property
    def vision(self) -> Any:
        """A vision-language model's image runtime (vision/runtime.py); None for a text model."""

    @property
    def started_at(self) -> float: ...

    # --- the cache -----------------------------------------------------------------------------
    @property
    def cache_enabled(self) -> bool: ...

    @property
    def cache_reason(self) -> str: ...

    @property
    def leases_active(self) -> bool: ...

    @property
    def keeps_checkpoints(self) -> bool: ...

    def cache_admin(self) -> CacheAdmin: ...

    def router_view(self) -> RouterView | None: ...

    def block_hashes(self, tokens: list[int], principal: str = "") -> list[bytes]: ...

    # --- prompts -------------------------------------------------------------------------------
    def chat_tokens(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        template_kwargs: dict[str, Any] | None = None,
        principal: str = "",
    ) -> list[int]: ...

    def chat_text(self, messages: list[dict[str, Any]], tools: list | None, template_kwargs: Any) -> str | None: ...

    def tokens_within(self, text: str, ids: list[int], chars: int, principal: str = "") -> int | None: ...

    def text_tokens(self, prompt: str) -> list[int]: ...

    def check_schema(self, schema: dict[str, Any]) -> str: ...

    def call_grammar(self, prompt: list[int], spec: CallGrammar) -> str: ...

    # --- generation ----------------------------------------------------------------------------
    def submit(self, req: GenerationRequest) -> None: ...

    def prefill(self, tokens: list[int], timeout: float | None = None, principal: str = "") -> None: ...

    def prompt_progress(self, req: GenerationRequest) -> dict[str, int] | None: ...

    def pin_files(self, paths: list[str]) -> None: ...

    # --- lifecycle and health ------------------------------------------------------------------
    def start(self) -> None: ...

    def stop(self, timeout: float | None = None) -> None: ...

    @property
    def is_alive(self) -> bool: ...

    @property
    def failure(self) -> str: ...

    @property
    def queue_depth(self) -> int: ...

    @property
    def is_busy(self) -> bool: ...

    def ssd_problem(self) -> str: ...

    def cache_stats(self) -> dict[str, Any]: ...

    def batch_stats(self) -> dict[str, Any]: ...

    def health(self) -> dict[str, Any]: ...
