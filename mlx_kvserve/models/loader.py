"""Resolve a model argument (default / hub id / MLX folder / .gguf file) and load it via mlx-lm."""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import ModelLoadError
from .default import DEFAULT_MODEL_NAME, ensure_default_model
from .gguf import convert_gguf, is_converted

log = logging.getLogger(__name__)


@dataclass
class LoadedModel:
    """A model ready to serve. `name` is the id clients see; `context_length` bounds prompt+completion."""

    name: str
    path: Path
    model: Any  # mlx.nn.Module
    tokenizer: Any  # mlx_lm TokenizerWrapper
    config: dict[str, Any]
    context_length: int
    vision: Any = None  # vision.families.*Family: the vision tower of a vision-language model (mlx-vlm)


def _gguf_folder(src: Path, models_dir: Path, dtype: str) -> Path:
    digest = hashlib.sha256(str(src.resolve()).encode()).hexdigest()[:12]
    return models_dir / f"{src.stem}-{digest}-{dtype}"


def resolve_model_path(spec: str, models_dir: Path, dtype: str) -> tuple[str, Path]:
    """(served name, local MLX folder) for a model spec, converting or downloading as needed."""
    if spec == "default":
        return DEFAULT_MODEL_NAME, ensure_default_model(models_dir, dtype)  # type: ignore[arg-type]
    local = Path(spec).expanduser()
    if local.suffix == ".gguf":
        if not local.is_file():
            raise ModelLoadError(f"GGUF file not found: {local}")
        dst = _gguf_folder(local, models_dir, dtype)
        if not is_converted(local, dst, dtype):
            convert_gguf(local, dst, dtype)  # type: ignore[arg-type]
        return local.stem, dst
    if local.is_dir():
        if not (local / "config.json").exists():
            raise ModelLoadError(f"{local} is not an MLX model folder (no config.json)")
        return local.name, local
    if spec.count("/") == 1 and not spec.startswith((".", "/")):
        from huggingface_hub import snapshot_download  # mlx-lm's own dependency

        try:
            path = snapshot_download(
                spec, allow_patterns=["*.json", "*.safetensors", "*.py", "*.model", "*.tiktoken", "*.txt", "*.jinja"]
            )
        except Exception as exc:  # the hub client raises many unrelated types
            raise ModelLoadError(f"cannot download {spec} from the Hugging Face hub: {exc}") from exc
        return spec, Path(path)
    raise ModelLoadError(f"model {spec!r} is not a folder, a .gguf file or a hub id (owner/name)")


def context_length(config: dict[str, Any]) -> int:
    for key in ("max_position_embeddings", "max_seq_len", "n_positions", "seq_length"):
        if isinstance(config.get(key), int):
            return config[key]
    text = config.get("text_config") or {}
    return int(text.get("max_position_embeddings", 4096))


def load_model(
    spec: str,
    models_dir: Path,
    dtype: str,
    served_name: str = "",
    distributed: tuple[Any, str] | None = None,
    chat_template: str = "",
) -> LoadedModel:
    """The model and tokenizer. `distributed`: (mx.distributed group, "tensor" | "pipeline"): this
    rank's shard (models/sharding.py). `chat_template`: a Jinja template file, or
    the template itself, used instead of the tokenizer's (mlx-lm then reads its tool-call and
    thinking markers from it). ModelLoadError when the file cannot be read."""
    from mlx_lm.utils import load

    from .sharding import load_shard

    name, path = resolve_model_path(spec, models_dir, dtype)
    log.info("loading model %s from %s", name, path)
    extra = {"chat_template": read_chat_template(chat_template)} if chat_template else None
    try:
        if distributed is None:
            model, tokenizer = load(str(path), tokenizer_config=extra)
        else:
            model, tokenizer = load_shard(path, models_dir, *distributed, extra)
    except (OSError, ValueError, KeyError) as exc:
        raise ModelLoadError(f"cannot load model from {path}: {exc}") from exc
    config = json.loads((path / "config.json").read_text())
    vision = load_vision(path, config, tokenizer) if distributed is None else None
    return LoadedModel(served_name or name, path, model, tokenizer, config, context_length(config), vision)


def load_vision(path: Path, config: dict[str, Any], tokenizer: Any) -> Any:
    """The vision tower of a vision-language model folder (None for a text model). A family not
    served yet is logged and served as text: its image parts are then refused (400)."""
    if "vision_config" not in config:
        return None
    try:
        from ..vision.families import load_family

        return load_family(path, config, tokenizer)
    except (ImportError, ValueError, KeyError, OSError) as exc:
        log.warning("model %s: images are not served (%s); serving it as a text model", path.name, exc)
        return None


MAX_TEMPLATE_BYTES = 1024 * 1024


def read_chat_template(spec: str) -> str:
    """The template `[model] chat_template` names: the text itself when it holds Jinja markup
    ("{{" or "{%"), else the contents of that file. ModelLoadError when it cannot be read."""
    if "{{" in spec or "{%" in spec:
        return spec
    path = Path(spec).expanduser()
    try:
        if path.stat().st_size > MAX_TEMPLATE_BYTES:
            raise ModelLoadError(f"chat template {path} is over {MAX_TEMPLATE_BYTES} bytes")
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ModelLoadError(f"cannot read the chat template {path} ([model] chat_template): {exc}") from None
