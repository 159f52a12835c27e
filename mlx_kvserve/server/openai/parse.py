"""OpenAI request parsing (messages: server/messages.py; replies: server/openai/reply.py). Pure
functions: no I/O, no MLX.

Parsing raises ValidationError (422) for wrong types or values and InvalidRequestError (400)
for requests that cannot be served as asked; every message names the field.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

from ...engine.request import SamplingParams
from ...errors import InvalidRequestError, ValidationError
from ...formats import tool_calls as tl
from ..context_window import ContextLengthError, window
from ..effort import effort_kwargs, parse_effort
from ..keep_alive import parse_keep_alive
from ..messages import check_text, parse_messages, take_images
from . import tools
from .logprobs import LogprobRequest, parse_logprobs

MAX_STOP_STRINGS = 8
MAX_CHOICES = 16  # `n`: completions of one prompt (each a request in the batch; they share its prefill)
MAX_BIAS = 100.0  # logit_bias values, as OpenAI bounds them
MAX_PENALTY = 2.0  # presence_penalty / frequency_penalty, as OpenAI bounds them


@dataclass(frozen=True)
class Defaults:
    max_tokens: int
    temperature: float
    top_p: float


@dataclass(frozen=True)
class CompletionRequest:
    """A parsed chat or text completion request (the prompt is not tokenized yet)."""

    kind: str  # "chat" | "text"
    model: str | None
    messages: list[dict[str, Any]] | None
    prompt: str | list[int] | None
    max_tokens: int | None  # None: as many as the context allows, up to the server default
    temperature: float
    top_p: float
    seed: int | None
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    return_progress: bool = False  # llama.cpp's: prefill progress chunks before the first token
    return_block_hashes: bool = False
    tools: tl.ToolSpec | None = None
    template_kwargs: dict[str, Any] = field(default_factory=dict)  # chat_template_kwargs
    logprobs: LogprobRequest = LogprobRequest(False, 0)
    top_k: int = 0  # 0 = off
    min_p: float = 0.0  # 0 = off
    json_schema: dict[str, Any] | None = None  # response_format json_object / json_schema
    n: int = 1  # completions of the prompt (choices)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias), ids ascending
    # Prompt positions worth a checkpoint (hybrid / sliding-window models): where the prefixes that
    # Anthropic cache_control marks end (set by the messages route from its rendered cuts).
    checkpoint_at: tuple[int, ...] = ()
    speculative: str = ""  # kvserve.speculative: "auto" | "off" | "prompt_lookup" | "draft"; "" = the server's mode
    # Image parts of the messages, in order (each is IMAGE_MARK in its message's text): docs/vision.md.
    images: tuple[Any, ...] = ()

    def sampling(self, max_tokens: int, grammar: str | None = None, choice: int = 0) -> SamplingParams:
        """The sampling of choice `choice` (0..n-1): with a seed, choice i draws with seed + i, so
        the choices differ and each is reproducible."""
        return SamplingParams(
            max_tokens,
            self.temperature,
            self.top_p,
            None if self.seed is None else (self.seed + choice) % 2**64,
            self.stop,
            top_k=self.top_k,
            min_p=self.min_p,
            logprobs=self.logprobs.enabled,
            top_logprobs=self.logprobs.num_top,
            json_schema=None if grammar is not None else self.json_schema,  # the grammar holds the answer format
            grammar=grammar,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            logit_bias=self.logit_bias,
            speculative=self.speculative,
        )


def _field(body: dict[str, Any], name: str, kinds: tuple[type, ...], what: str, default: Any = None) -> Any:
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) and bool not in kinds or not isinstance(value, kinds):
        raise ValidationError(f"'{name}' must be {what}, got {type(value).__name__}", param=name)
    return value


def _number(
    body: dict[str, Any], name: str, default: float, low: float, high: float, field: str | None = None
) -> float:
    """body[name] as a float in [low, high]; ValidationError naming `field` (default: `name`)."""
    shown_name = name if field is None else f"{field}[{name!r}]"
    raw = body.get(name, default)
    if raw is None:
        raw = default
    if isinstance(raw, bool) or not isinstance(raw, int | float):
        raise ValidationError(f"'{shown_name}' must be a number, got {type(raw).__name__}", param=field or name)
    try:
        value = float(raw)
    except OverflowError:  # an integer beyond float range, e.g. 10**400
        value = math.inf if raw > 0 else -math.inf
    if not low <= value <= high:  # also false for inf (1e999 parses as inf) and NaN
        shown = value if math.isfinite(value) or isinstance(raw, float) else "an integer too large for a float"
        raise ValidationError(f"'{shown_name}' must be between {low} and {high}, got {shown}", param=field or name)
    return value


def _top_p(body: dict[str, Any], default: float) -> float:
    value = _number(body, "top_p", default, 0.0, 1.0)
    if value <= 0:
        raise ValidationError("'top_p' must be greater than 0", param="top_p")
    return value


def _parse_stop(body: dict[str, Any]) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise ValidationError("'stop' must be a non-empty string or an array of them", param="stop")
    if len(stop) > MAX_STOP_STRINGS:
        raise ValidationError(f"'stop' may hold at most {MAX_STOP_STRINGS} strings", param="stop")
    return tuple(stop)


def _parse_prompt(body: dict[str, Any]) -> str | list[int]:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise ValidationError("'prompt' must not be empty", param="prompt")
        return check_text(prompt, "prompt")
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return prompt
    raise ValidationError("'prompt' must be a non-empty string or an array of token ids", param="prompt")


def _parse_top_k(body: dict[str, Any]) -> int:
    top_k = _field(body, "top_k", (int,), "an integer", 0)
    if top_k < 0 or top_k > 2**31:
        raise ValidationError(f"'top_k' must be between 0 (off) and 2**31, got {top_k}", param="top_k")
    return top_k


def _parse_seed(body: dict[str, Any]) -> int | None:
    seed = _field(body, "seed", (int,), "an integer")
    if seed is not None and not 0 <= seed < 2**64:  # MLX's generator takes an unsigned 64-bit seed
        raise ValidationError(f"'seed' must be between 0 and 2**64 - 1, got {seed}", param="seed")
    return seed


def _parse_n(body: dict[str, Any]) -> int:
    n = _field(body, "n", (int,), "an integer", 1)
    if not 1 <= n <= MAX_CHOICES:
        raise ValidationError(f"'n' must be between 1 and {MAX_CHOICES}, got {n}", param="n")
    return n


def _parse_logit_bias(body: dict[str, Any]) -> tuple[tuple[int, float], ...]:
    """logit_bias: {"token id": bias}, ids as decimal strings, biases -100..100. ValidationError
    (422) naming the field for anything else; ids past the vocabulary: check_vocabulary."""
    bias = _field(body, "logit_bias", (dict,), "an object mapping token ids to numbers", {})
    pairs: dict[int, float] = {}
    for key in bias:
        if not (key.isascii() and key.isdigit() and len(key) <= 12):
            raise ValidationError(
                f"'logit_bias' keys must be token ids (non-negative integers), got {key!r}", param="logit_bias"
            )
        pairs[int(key)] = _number(bias, key, 0.0, -MAX_BIAS, MAX_BIAS, field="logit_bias")
    return tuple(sorted(pairs.items()))


# Accepted with no meaning here, as their values' types say: they are about a hosted service (storing
# the reply, its metadata, billing pools, who the caller is, the hosted prompt cache's routing and
# retention). The block cache needs no key: it matches the prompt itself.
ACCEPTED = {"store": bool, "metadata": dict, "service_tier": str, "user": str, "safety_identifier": str}
ACCEPTED |= {"prompt_cache_key": str, "prompt_cache_retention": str}
# Fields served as asked.
_FIELDS = {"model", "max_tokens", "temperature", "top_p", "n", "seed", "stop", "stream", "stream_options"}
_FIELDS |= {"kvserve", "max_completion_tokens", "top_k", "min_p", "logprobs", "response_format", *ACCEPTED}
_FIELDS |= {"presence_penalty", "frequency_penalty", "logit_bias"}
_FIELDS |= {"keep_alive"}  # Ollama's: how long the model stays loaded (server/keep_alive.py)
_FIELDS |= {"return_progress"}  # llama.cpp's: prefill progress chunks in a stream (server/openai/progress.py)
CHAT_FIELDS = _FIELDS | {"messages", "tools", "tool_choice", "parallel_tool_calls"}
CHAT_FIELDS |= {"chat_template_kwargs", "top_logprobs", "reasoning_effort"}
TEXT_FIELDS = _FIELDS | {"prompt"}
# Fields not served, accepted only at the value that asks for nothing.
_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "top_logprobs": (None, 0),  # completions take the count in `logprobs`
    "echo": (None, False),
    "best_of": (None, 1),
    "suffix": (None, ""),
}
# Keys the server sets itself; a request may not override them through chat_template_kwargs.
_RESERVED_TEMPLATE_KEYS = {"messages", "tools", "add_generation_prompt", "tokenize", "return_dict", "conversation"}


def _same(value: Any, neutral: Any) -> bool:
    return value == neutral and isinstance(value, bool) == isinstance(neutral, bool)  # False is not 0 here


def check_fields(body: dict[str, Any], allowed: set[str]) -> None:
    """InvalidRequestError (400) naming the first field this server would otherwise have to ignore:
    one it does not know, or one it does not serve (logprobs, response_format...) set to a value
    that asks for something. No field is dropped silently."""
    for name, value in body.items():
        if name in allowed or name in _NEUTRAL and any(_same(value, v) for v in _NEUTRAL[name]):
            continue
        what = "is not supported by this server" if name in _NEUTRAL else "is not a field this server knows"
        raise InvalidRequestError(f"'{name}' {what}", param=name, code="unsupported_field")


def _template_kwargs(body: dict[str, Any]) -> dict[str, Any]:
    """chat_template_kwargs, over what `reasoning_effort` sets (server/effort.py): an explicit
    variable wins."""
    kwargs = _field(body, "chat_template_kwargs", (dict,), "an object", {})
    if bad := sorted(k for k in kwargs if k in _RESERVED_TEMPLATE_KEYS):
        raise InvalidRequestError(
            f"'chat_template_kwargs' may not set {', '.join(bad)}: the server sets it", param="chat_template_kwargs"
        )
    return effort_kwargs(parse_effort(body.get("reasoning_effort"), "reasoning_effort")) | kwargs


def _check_accepted(body: dict[str, Any]) -> None:
    """ValidationError (422) for an accepted-only field of the wrong type (null is always fine)."""
    for name, kind in ACCEPTED.items():
        value = body.get(name)
        if value is not None and (not isinstance(value, kind) or isinstance(value, bool) != (kind is bool)):
            raise ValidationError(f"'{name}' must be {_TYPE_NAMES[kind]}", param=name)


_TYPE_NAMES = {bool: "a boolean", dict: "an object", str: "a string"}


MAX_SCHEMA_BYTES = 64 * 1024


def parse_response_format(body: dict[str, Any]) -> dict[str, Any] | None:
    """The JSON schema the completion must follow: None for {"type": "text"} (or no field), any
    JSON object for {"type": "json_object"}, the given schema for {"type": "json_schema",
    "json_schema": {"name", "schema", "strict"}}. ValidationError (422) for anything else."""
    fmt = _field(body, "response_format", (dict,), "an object")
    if fmt is None:
        return None
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "object"}
    if kind != "json_schema":
        raise ValidationError(
            "'response_format.type' must be 'text', 'json_object' or 'json_schema'", param="response_format"
        )
    spec = fmt.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
        raise ValidationError(
            "'response_format.json_schema' must be an object with a 'schema' object", param="response_format"
        )
    if not isinstance(spec.get("name", ""), str) or not isinstance(spec.get("strict", False), bool | None):
        raise ValidationError("'response_format.json_schema' has a bad 'name' or 'strict'", param="response_format")
    schema = spec.get("schema", {})
    if len(json.dumps(schema)) > MAX_SCHEMA_BYTES:
        raise ValidationError(f"the JSON schema is over {MAX_SCHEMA_BYTES} bytes", param="response_format")
    return schema or {"type": "object"}


def _parse_speculative(ext: dict[str, Any]) -> str:
    """kvserve.speculative: this request's speculative decoding mode ("" = the server's)."""
    mode = _field(ext, "speculative", (str,), "a string", "")
    if mode not in ("", "auto", "off", "prompt_lookup", "draft"):
        raise ValidationError(
            f"'kvserve.speculative' must be auto, off, prompt_lookup or draft, got {mode!r}",
            param="kvserve.speculative",
        )
    return mode


def parse_request(body: Any, kind: str, defaults: Defaults) -> CompletionRequest:
    """The request in `body`. The fields it serves are checked first (ValidationError naming a bad
    value), then any field it would have to ignore is an InvalidRequestError (see check_fields)."""
    if not isinstance(body, dict):
        raise ValidationError("request body must be a JSON object")
    n = _parse_n(body)
    max_tokens = _field(body, "max_completion_tokens", (int,), "an integer")
    if max_tokens is None:
        max_tokens = _field(body, "max_tokens", (int,), "an integer")
    if max_tokens is not None and max_tokens < 1:
        raise ValidationError(f"'max_tokens' must be at least 1, got {max_tokens}", param="max_tokens")
    _check_accepted(body)
    parse_keep_alive(body.get("keep_alive"))  # 422 for a malformed one, with or without [[models]]
    stream_options = _field(body, "stream_options", (dict,), "an object", {})
    ext = _field(body, "kvserve", (dict,), "an object", {})
    messages = parse_messages(body.get("messages")) if kind == "chat" else None
    req = CompletionRequest(
        kind=kind,
        model=_field(body, "model", (str,), "a string"),
        messages=messages,
        images=take_images(messages) if messages else (),
        prompt=_parse_prompt(body) if kind == "text" else None,
        max_tokens=max_tokens,
        temperature=_number(body, "temperature", defaults.temperature, 0.0, 2.0),
        top_p=_top_p(body, defaults.top_p),
        seed=_parse_seed(body),
        stop=_parse_stop(body),
        stream=_field(body, "stream", (bool,), "a boolean", False),
        include_usage=bool(_field(stream_options, "include_usage", (bool,), "a boolean", False)),
        return_progress=bool(_field(body, "return_progress", (bool,), "a boolean", False)),
        return_block_hashes=bool(_field(ext, "return_block_hashes", (bool,), "a boolean", False)),
        speculative=_parse_speculative(ext),
        tools=tools.parse_openai_tools(body) if kind == "chat" else None,
        template_kwargs=_template_kwargs(body) if kind == "chat" else {},
        logprobs=parse_logprobs(body, kind),
        top_k=_parse_top_k(body),
        min_p=_number(body, "min_p", 0.0, 0.0, 1.0),
        json_schema=parse_response_format(body),
        n=n,
        presence_penalty=_number(body, "presence_penalty", 0.0, -MAX_PENALTY, MAX_PENALTY),
        frequency_penalty=_number(body, "frequency_penalty", 0.0, -MAX_PENALTY, MAX_PENALTY),
        logit_bias=_parse_logit_bias(body),
    )
    check_fields(body, CHAT_FIELDS if kind == "chat" else TEXT_FIELDS)
    return req


def check_vocabulary(req: CompletionRequest, vocab_size: int) -> None:
    """ValidationError (422) when top_k is above the model's vocabulary or logit_bias names a token
    past it (0: unknown, not checked; the logit_bias processor then fails the request alone). top_k
    equal to the vocabulary keeps every token, as 0 does."""
    if vocab_size and req.top_k > vocab_size:
        raise ValidationError(
            f"'top_k' must be between 0 (off) and {vocab_size} (the model's vocabulary size), got {req.top_k}",
            param="top_k",
        )
    if vocab_size and req.logit_bias and req.logit_bias[-1][0] >= vocab_size:
        raise ValidationError(
            f"'logit_bias' names token {req.logit_bias[-1][0]}; the model's token ids are 0..{vocab_size - 1}",
            param="logit_bias",
        )


def completion_budget(
    req: CompletionRequest, num_prompt: int, context: int, default_max: int, max_completion: int = 0
) -> int:
    """How many tokens may be generated: max_tokens, lowered to the room the prompt leaves in the
    context (clients such as Claude Code ask for 32000 whatever the model). Raises
    ContextLengthError when the prompt alone fills the context (the server checks that before, in
    server/context_window.py), ValidationError when an explicit max_tokens is above the server's
    `max_completion` (0 = no limit but the context)."""
    room = context - num_prompt
    if room < 1:
        raise ContextLengthError(num_prompt, window(context), req.kind)
    if max_completion and req.max_tokens is not None and req.max_tokens > max_completion:
        raise ValidationError(
            f"'max_tokens' must be at most {max_completion} on this server (server.max_completion_tokens), "
            f"got {req.max_tokens}",
            param="max_tokens",
        )
    if req.max_tokens is None:
        return min(default_max, max_completion or default_max, room)
    return min(req.max_tokens, room)
