"""Configuration: frozen dataclasses, loaded from TOML, overridden by CLI flags, validated once.

Every key lives in exactly one section dataclass; `config.example.toml` documents each one.
Errors raise ConfigError naming the offending key as `section.key`.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, get_type_hints

from .api_keys import ApiKeys, is_key_text, key_overrides, load_api_keys  # noqa: F401 (their old home)
from .config_values import check as _check
from .config_values import coerce as _coerce
from .config_values import parse_bytes, tomllib  # noqa: F401 (parse_bytes: its old home)
from .errors import ConfigError


def default_home() -> Path:
    """Root of everything the server keeps on disk (`MLX_KVSERVE_HOME` overrides)."""
    if env := os.environ.get("MLX_KVSERVE_HOME"):
        return Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "mlx-kvserve"


def _default_model_dtype() -> str:
    # Linux CPU: MLX's float32 path is far faster than its quantized or half-precision ones.
    return "float32" if sys.platform.startswith("linux") else "keep"


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    max_queue: int = 16  # requests waiting for the worker; one more gets 429
    max_batch: int = 16  # requests decoding together (continuous batching); at most max_queue
    # Which waiting request starts next: "cached_first" (fewest uncached prompt tokens first; one
    # that later ones have passed for max_wait_s goes first) or "fifo" (arrival order). engine/batch/order.py.
    scheduling: str = "cached_first"
    max_wait_s: float = 5.0
    prefill_batch_size: int = 0  # long prompts prefilled together (short ones join past it); 0 = 1
    short_prefill_tokens: int = 0  # an uncached rest this short joins past prefill_batch_size; 0 = step / 4
    max_body_bytes: int = 4 * 1024 * 1024
    shutdown_timeout_s: float = 30.0  # how long in-flight requests may run after SIGTERM
    log_level: str = "info"
    max_concurrent: int = 0  # completion requests in flight (waiting + running); 0 = max_queue + 1
    max_concurrent_counts: int = 2  # /v1/messages/count_tokens running at once (on HTTP threads); more get 429
    max_prompt_tokens: int = 0  # 0 = only the model's context limits the prompt
    context_overflow: str = "error"  # a prompt past the context: "error" (agents compact) or "truncate" (old turns go)
    max_completion_tokens: int = 0  # 0 = only the context limits a request's max_tokens
    first_token_timeout_s: float = 0.0  # arrival to first token; 0 = none
    request_timeout_s: float = 0.0  # arrival to last token; 0 = none
    body_read_timeout_s: float = 30.0  # arrival to the body's last byte (else 408); read before a slot is taken
    fetch_image_urls: bool = False  # image parts may name http(s) URLs, fetched by the server (else data URLs only)
    fetch_private_urls: bool = False  # those URLs may name loopback and LAN addresses too (vision/fetch.py)
    # Secrets stay out of repr() so a logged config never shows them; see load_api_keys.
    api_key: str = field(default="", repr=False)  # "" = no key needed (unless api_key_file names one)
    api_key_file: str = ""
    admin_api_key: str = field(default="", repr=False)  # "" = /v1/cache/ needs what the rest needs
    admin_api_key_file: str = ""
    # Browsers (server/local_guard.py): Host names answered besides loopback and the bound address ("*" = any),
    # and the web pages (origins) that may call it, with CORS; allow_no_key: serve beyond loopback without a key.
    allowed_hosts: list[str] = field(default_factory=list)
    allowed_origins: list[str] = field(default_factory=list)
    allow_no_key: bool = False
    # Several models ([[models]], registry/registry.py): the weights (and KV in RAM) of loaded models stay
    # under this; the least recently used idle model is unloaded to make room. 0 = by the memory plan
    # (engine/memory/plan.py): half of the memory the arrays live in, within the working set.
    model_memory_bytes: int = 0
    model_keep_alive_s: float = 0.0  # an idle model is unloaded after this long; 0 = only for room
    # MLX keeps freed buffers for reuse up to this many bytes (engine/memory/device.py); 0 = by device:
    # a quarter of the GPU's own memory with CUDA (MLX's default there is 80% of it), MLX's own elsewhere.
    mlx_cache_limit_bytes: int = 0
    kv_batch_bytes: int = 0  # the KV of the requests in the batch together (engine/batch/kv_room.py); 0 = planned

    def in_flight_limit(self) -> int:
        """Completion requests that may be in flight before the next gets 429."""
        return self.max_concurrent or self.max_queue + 1

    def batch_limit(self) -> int:
        """Requests the engine runs together: max_batch, but never more than max_queue, so that a
        server told to queue one request (max_queue = 1) still serves one at a time."""
        return min(self.max_batch, self.max_queue)


@dataclass(frozen=True)
class ModelConfig:
    path: str = "default"  # "default", a Hugging Face repo id, an MLX folder or a .gguf file
    dtype: str = field(default_factory=_default_model_dtype)  # for .gguf conversion
    models_dir: str = ""  # where converted models are cached; "" = <home>/models
    served_name: str = ""  # id reported by /v1/models; "" = derived from path
    chat_template: str = ""  # a Jinja chat template file, or the template itself; "" = the tokenizer's own
    context_length: int = 0  # caps the context served (and told to clients); 0 = the model's own


@dataclass(frozen=True)
class GenerationConfig:
    max_tokens: int = 512  # default completion limit when the request names none
    temperature: float = 0.7
    top_p: float = 1.0
    prefill_step_size: int = 0  # 0 = by device: 2048 on a GPU, 512 on the CPU (engine/build.py)
    prefill_step_shared: bool = True  # prompts prefilling together share a step's tokens (batch_generator.py)
    # On the CPU, attention with its softmax in NumPy ("numpy", where it wins: cpu/attention.py) or MLX's
    # own ("mlx"); the NumPy path takes a causal chunk's queries in blocks of `cpu_attention_rows` (0: none).
    cpu_attention_rows: int = 128
    cpu_attention_softmax: str = "numpy"


@dataclass(frozen=True)
class SpeculativeConfig:
    # Speculative decoding for a request decoding alone (engine/speculative/speculator.py): "prompt_lookup"
    # drafts from the prompt and output (n-gram lookup), "draft" with draft_model, "auto" with
    # draft_model when one is set, else by prompt lookup; where it pays. "off" never.
    mode: str = "auto"
    max_draft_tokens: int = 8  # the most tokens drafted per verify pass; 0 = off
    draft_model: str = ""  # a small model with the same tokenizer (as model.path); "" = none


@dataclass(frozen=True)
class CacheConfig:
    enabled: bool = True
    block_size: int = 64
    ram_max_bytes: int = 0  # 0 = by the memory plan (engine/memory/plan.py), at most a quarter of the memory
    pinned_ram_share: float = 0.5  # above this share of the RAM budget, pinned blocks are served from the SSD
    pin_on_start: list[str] = field(default_factory=list)  # prompt files warmed and pinned at startup
    # Anthropic cache_control pins (TTL 5 min / 1 h, refreshed on use) hold at most this share of the
    # RAM budget (and of [ssd] max_bytes when set); the leases that expire first make room. 0 = off.
    cache_control_share: float = 0.25
    # Hybrid and sliding-window models: a checkpoint (recurrent state, window contents) every this
    # many prompt tokens, rounded up to whole blocks; 0 = only at prompt and message ends.
    checkpoint_every: int = 4096
    # Quantized KV, opt-in: 0 (off), 8 or 4 bits per key and value in full-attention layers, in the
    # running cache and in the blocks (RAM and SSD: 2x / 4x smaller than fp16). Outputs then equal
    # a cold run with the same kv_bits, not the full-precision run. Part of the cache namespace.
    kv_bits: int = 0
    # Several API keys: "per_key" gives each its own cache namespace (no hit on another's blocks,
    # kv/salts.py), "shared" one cache for all; "auto" = per_key when api_key_file holds several keys.
    isolation: str = "auto"
    # usage's cached_tokens: "exact", or "blocks" (rounded down to whole blocks, so a key sharing the
    # cache cannot read another's prompt token by token); "auto" = blocks when several keys share it.
    report_cached: str = "auto"


@dataclass(frozen=True)
class SSDConfig:
    enabled: bool = True
    cache_dir: str = ""  # "" = <home>/kv
    ttl_days: float = 7.0  # blocks not used for this long are pruned (pinned ones never); 0 = keep forever
    policy: str = "write_through"  # write_through: every new block; evict_only: blocks leaving RAM
    durability: str = "best_effort"  # best_effort: one attempt; persistent: retry failed writes
    persistent_max_retries: int = 3
    async_writes: bool = True  # false: write on the worker thread (slower decode; for debugging)
    # The writer's queue, by bytes; 0 = a quarter of the RAM budget (at least 256 MiB). Blocks shed
    # from a full queue are taken back from RAM when it runs empty.
    writer_queue_bytes: int = 0
    writer_queue_size: int = 0  # deprecated: a bound by count as well (0 = none)
    # A full writer queue: "shed" drops the least valuable queued block (deep unpinned conversation
    # blocks before shallow shared ones; pinned never), "write_inline" makes the request's thread write it.
    writer_when_full: str = "shed"
    write_hold_s: float = 2.0  # background writes wait up to this long while a request prefills; 0 = never
    flush_interval_s: float = 2.0  # how often the index is written while blocks arrive
    drain_timeout_s: float = 120.0  # the ceiling of the shutdown drain (it waits queued bytes / measured speed)
    max_bytes: int = 0  # disk budget; 0 = unlimited (the free-space floor still applies)
    min_free_bytes: int = 2 * 1024**3  # stop writing when the disk has less free space than this
    prefetch_on_start: bool = False  # after startup, read the hottest chains into RAM while the server is idle
    prefetch_max_bytes: int = 0  # at most this much; 0 = the RAM budget for blocks
    # An SSD hit's first blocks are prefilled while the rest are read, split by the measured speeds
    # (plain-attention models); false: every stored block is read.
    compute_while_loading: bool = True


ROUTER_POLICIES = ("lmetric", "load_only", "sticky", "unified", "round_robin")  # router.policies.Policy


@dataclass(frozen=True)
class RouterConfig:
    """`mlx-kvserve router`: a cache-aware proxy in front of several servers (docs/router.md)."""

    backends: list[str] = field(default_factory=list)  # base URLs of mlx-kvserve servers
    policy: str = "unified"
    overload_factor: float = 2.0  # unified: leave the session's backend above this x the average load
    session_header: str = "x-session-id"  # else OpenAI's `user`, else Anthropic's `metadata.user_id`
    tokenizer: str = ""  # "" = the model the backends report (its folder, or its hub id)
    listen_host: str = "127.0.0.1"
    listen_port: int = 8100
    api_key: str = field(default="", repr=False)  # what clients send to the router; "" = none
    api_key_file: str = ""
    backend_api_key: str = field(default="", repr=False)  # what the router sends (the backends' admin key if set)
    backend_api_key_file: str = ""
    allowed_hosts: list[str] = field(default_factory=list)  # as [server]'s, for the router
    allowed_origins: list[str] = field(default_factory=list)
    allow_no_key: bool = False
    health_interval_s: float = 2.0  # how often each backend's /health is polled (down ones come back this way)
    connect_timeout_s: float = 5.0
    # A backend that takes a request and then says nothing: how long until the request goes to the next one.
    first_byte_timeout_s: float = 30.0  # to a streamed reply's start (servers send it as they take the request)
    read_timeout_s: float = 600.0  # to a whole reply (sent after its last token), and any silence in a reply
    max_body_bytes: int = 4 * 1024 * 1024
    log_level: str = "info"


@dataclass(frozen=True)
class VisionConfig:
    """Images in requests to a vision-language model (docs/vision.md)."""

    max_images: int = 16  # images in one request
    max_image_bytes: int = 20 * 1024 * 1024  # one image, encoded (413 above)
    max_image_pixels: int = 40_000_000  # one image, width x height, read from its header (413 above)
    fetch_timeout_s: float = 10.0  # one image URL's whole fetch, redirects included ([server] fetch_image_urls)
    encoder_cache_bytes: int = 256 * 1024 * 1024  # vision-tower outputs kept by image digest; 0 = off


@dataclass(frozen=True)
class Config:
    server: ServerConfig = field(default_factory=ServerConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    generation: GenerationConfig = field(default_factory=GenerationConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    ssd: SSDConfig = field(default_factory=SSDConfig)
    router: RouterConfig = field(default_factory=RouterConfig)
    vision: VisionConfig = field(default_factory=VisionConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)

    def models_path(self) -> Path:
        return Path(self.model.models_dir).expanduser() if self.model.models_dir else default_home() / "models"

    def ssd_path(self) -> Path:
        return Path(self.ssd.cache_dir).expanduser() if self.ssd.cache_dir else default_home() / "kv"


_SECTIONS = {f.name: f.type for f in fields(Config)}


def _build_section(section: str, cls: type, values: dict[str, Any]) -> Any:
    hints = get_type_hints(cls)
    unknown = sorted(set(values) - set(hints))
    if unknown:
        raise ConfigError(f"{section}.{unknown[0]}: unknown key", param=f"{section}.{unknown[0]}")
    kwargs = {k: _coerce(section, k, v, hints[k]) for k, v in values.items()}
    return cls(**kwargs)


def _validate_limits(s: ServerConfig) -> None:
    _check(
        0 <= s.max_concurrent <= s.max_queue + 1,
        "server.max_concurrent",
        f"must be 0..max_queue + 1 ({s.max_queue + 1}): the worker queue holds at most max_queue waiting "
        f"requests, so raise server.max_queue too; got {s.max_concurrent}",
    )
    _check(s.max_concurrent_counts >= 1, "server.max_concurrent_counts", f"must be >= 1, got {s.max_concurrent_counts}")
    for key in ("max_prompt_tokens", "max_completion_tokens", "first_token_timeout_s", "request_timeout_s"):
        _check(getattr(s, key) >= 0, f"server.{key}", f"must be >= 0 (0 = no limit), got {getattr(s, key)}")
    for key in ("api_key", "admin_api_key"):
        value = getattr(s, key)
        _check(not (value and getattr(s, f"{key}_file")), f"server.{key}", f"set {key} or {key}_file, not both")
        _check(is_key_text(value), f"server.{key}", "must be printable ASCII without spaces")


def validate(config: Config) -> Config:
    """Check value ranges; raises ConfigError naming the key. Returns the config unchanged."""
    s, g, c = config.server, config.generation, config.cache
    _check(0 <= s.port <= 65535, "server.port", f"must be 0..65535, got {s.port}")
    _check(s.max_queue >= 1, "server.max_queue", f"must be >= 1, got {s.max_queue}")
    _check(s.max_batch >= 1, "server.max_batch", f"must be >= 1, got {s.max_batch}")
    _check(s.scheduling in ("cached_first", "fifo"), "server.scheduling", "must be cached_first or fifo")
    _check(s.context_overflow in ("error", "truncate"), "server.context_overflow", "must be error or truncate")
    _check(s.max_wait_s >= 0, "server.max_wait_s", f"must be >= 0, got {s.max_wait_s}")
    _check(s.prefill_batch_size >= 0, "server.prefill_batch_size", "must be >= 0 (0: max_batch)")
    _check(s.short_prefill_tokens >= 0, "server.short_prefill_tokens", "must be >= 0 (0: a quarter prefill chunk)")
    _check(s.max_body_bytes >= 1024, "server.max_body_bytes", "must be at least 1KiB")
    _check(s.shutdown_timeout_s >= 0, "server.shutdown_timeout_s", "must be >= 0")
    _check(s.body_read_timeout_s > 0, "server.body_read_timeout_s", "must be > 0 (a slow upload must end)")
    levels = ("critical", "error", "warning", "info", "debug")
    _check(s.log_level in levels, "server.log_level", f"must be one of {', '.join(levels)}")
    _validate_limits(s)
    _check(s.model_keep_alive_s >= 0, "server.model_keep_alive_s", "must be >= 0 (0 = never for idleness)")
    dtypes = ("float32", "float16", "bfloat16", "keep")
    _check(config.model.dtype in dtypes, "model.dtype", f"must be one of {', '.join(dtypes)}")
    _check(bool(config.model.path), "model.path", "must not be empty")
    _check(config.model.context_length >= 0, "model.context_length", "must be >= 0 (0 = the model's own)")
    _check(g.max_tokens >= 1, "generation.max_tokens", f"must be >= 1, got {g.max_tokens}")
    _check(0 <= g.temperature <= 2, "generation.temperature", "must be in [0, 2]")
    _check(0 < g.top_p <= 1, "generation.top_p", "must be in (0, 1]")
    _check(g.prefill_step_size >= 0, "generation.prefill_step_size", "must be >= 0 (0: by device)")
    _check(g.cpu_attention_rows >= 0, "generation.cpu_attention_rows", "must be >= 0 (0: no blocks)")
    _check(g.cpu_attention_softmax in ("numpy", "mlx"), "generation.cpu_attention_softmax", 'must be "numpy" or "mlx"')
    _check(c.block_size >= 1, "cache.block_size", f"must be >= 1, got {c.block_size}")
    _check(c.checkpoint_every >= 0, "cache.checkpoint_every", f"must be >= 0, got {c.checkpoint_every}")
    _check(c.kv_bits in (0, 4, 8), "cache.kv_bits", f"must be 0, 4 or 8, got {c.kv_bits}")
    _check(c.isolation in ("auto", "per_key", "shared"), "cache.isolation", "must be auto, per_key or shared")
    _check(c.report_cached in ("auto", "exact", "blocks"), "cache.report_cached", "must be auto, exact or blocks")
    _check(0 < c.pinned_ram_share <= 1, "cache.pinned_ram_share", "must be in (0, 1]")
    _check(0 <= c.cache_control_share <= 1, "cache.cache_control_share", "must be in [0, 1]")
    d = config.ssd
    _check(d.ttl_days >= 0, "ssd.ttl_days", "must be >= 0")
    _check(d.policy in ("write_through", "evict_only"), "ssd.policy", "must be write_through or evict_only")
    _check(d.durability in ("best_effort", "persistent"), "ssd.durability", "must be best_effort or persistent")
    _check(d.persistent_max_retries >= 0, "ssd.persistent_max_retries", "must be >= 0")
    _check(d.writer_queue_bytes >= 0, "ssd.writer_queue_bytes", "must be >= 0 (0 = a quarter of the RAM budget)")
    _check(d.writer_queue_size >= 0, "ssd.writer_queue_size", "must be >= 0 (0 = no bound by count; deprecated)")
    when_full = ("shed", "write_inline")
    _check(d.writer_when_full in when_full, "ssd.writer_when_full", f"must be one of {', '.join(when_full)}")
    _check(d.prefetch_max_bytes >= 0, "ssd.prefetch_max_bytes", "must be >= 0 (0 = the RAM budget)")
    _check(d.flush_interval_s >= 0, "ssd.flush_interval_s", "must be >= 0")
    _check(d.write_hold_s >= 0, "ssd.write_hold_s", "must be >= 0 (0 = never hold writes)")
    _check(d.drain_timeout_s >= 0, "ssd.drain_timeout_s", "must be >= 0")
    _validate_router(config.router)
    v = config.vision
    _check(v.max_images >= 0, "vision.max_images", "must be >= 0 (0: no images)")
    _check(v.max_image_bytes >= 1, "vision.max_image_bytes", "must be >= 1")
    _check(v.max_image_pixels >= 1, "vision.max_image_pixels", "must be >= 1")
    _check(v.fetch_timeout_s > 0, "vision.fetch_timeout_s", "must be > 0")
    _check(v.encoder_cache_bytes >= 0, "vision.encoder_cache_bytes", "must be >= 0 (0: off)")
    sp = config.speculative
    modes = ("auto", "off", "prompt_lookup", "draft")
    _check(sp.mode in modes, "speculative.mode", f"must be one of {', '.join(modes)}")
    _check(sp.mode != "draft" or bool(sp.draft_model), "speculative.mode", '"draft" needs speculative.draft_model')
    _check(0 <= sp.max_draft_tokens <= 64, "speculative.max_draft_tokens", "must be 0..64 (0 = off)")
    return config


def _validate_router(r: RouterConfig) -> None:
    for url in r.backends:
        _check(url.startswith(("http://", "https://")), "router.backends", f"must be http(s) URLs, got {url!r}")
    _check(len(set(r.backends)) == len(r.backends), "router.backends", "names a backend twice")
    _check(r.policy in ROUTER_POLICIES, "router.policy", f"must be one of {', '.join(ROUTER_POLICIES)}")
    _check(r.overload_factor >= 1, "router.overload_factor", f"must be >= 1, got {r.overload_factor}")
    _check(bool(r.session_header.strip()), "router.session_header", "must not be empty")
    _check(0 <= r.listen_port <= 65535, "router.listen_port", f"must be 0..65535, got {r.listen_port}")
    _check(r.health_interval_s > 0, "router.health_interval_s", "must be > 0")
    _check(r.connect_timeout_s > 0, "router.connect_timeout_s", "must be > 0")
    _check(r.first_byte_timeout_s > 0, "router.first_byte_timeout_s", "must be > 0")
    _check(r.read_timeout_s > 0, "router.read_timeout_s", "must be > 0")
    _check(r.max_body_bytes >= 1024, "router.max_body_bytes", "must be at least 1KiB")
    levels = ("critical", "error", "warning", "info", "debug")
    _check(r.log_level in levels, "router.log_level", f"must be one of {', '.join(levels)}")
    for key in ("api_key", "backend_api_key"):
        value = getattr(r, key)
        _check(not (value and getattr(r, f"{key}_file")), f"router.{key}", f"set {key} or {key}_file, not both")
        _check(is_key_text(value), f"router.{key}", "must be printable ASCII without spaces")


def load_config(path: str | Path | None = None, overrides: dict[str, dict[str, Any]] | None = None) -> Config:
    """Read the TOML file at `path` (if any), apply `overrides` ({section: {key: value}}, values
    of None ignored) and validate. Raises ConfigError for unreadable files or bad keys/values."""
    data: dict[str, Any] = {}
    if path is not None:
        try:
            data = tomllib.loads(Path(path).read_text())
        except OSError as exc:
            raise ConfigError(f"cannot read config file {path}: {exc.strerror}") from exc
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"config file {path} is not valid TOML: {exc}") from exc
    for name, values in data.items():
        if name in _SECTIONS and not isinstance(values, dict):  # before overrides are merged into it
            raise ConfigError(f"[{name}]: expected a table", param=name)
    for section, values in (overrides or {}).items():
        data.setdefault(section, {}).update({k: v for k, v in values.items() if v is not None})
    if "models" in data:  # [[models]]: the model registry, checked here, read by model_entries.py
        from .model_entries import model_entries

        model_entries(data.pop("models"))
    unknown = sorted(set(data) - set(_SECTIONS))
    if unknown:
        raise ConfigError(f"[{unknown[0]}]: unknown section", param=unknown[0])
    sections = {name: _build_section(name, cls, data.get(name, {})) for name, cls in get_type_hints(Config).items()}
    return validate(Config(**sections))


def as_dict(config: Config, redact: bool = False) -> dict[str, Any]:
    """The config as plain data; with `redact`, set API keys read "<redacted>"."""
    out = dataclasses.asdict(config)
    if redact:
        secrets = (
            ("server", "api_key"),
            ("server", "admin_api_key"),
            ("router", "api_key"),
            ("router", "backend_api_key"),
        )
        for section, key in secrets:
            if out[section][key]:
                out[section][key] = "<redacted>"
    return out
