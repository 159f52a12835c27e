"""One rank's shard of a model for `--distributed`.

- tensor: mlx-lm's `sharded_load` with `Model.shard`, which splits every layer by heads. mlx-lm
  shards whatever it is given: with heads that do not divide by the ranks (SmolLM2's 9 over 2)
  the model loads and every request then fails in attention, so such a layout is refused here,
  before anything loads, naming the numbers and what to do instead.
- pipeline: mlx-lm's `sharded_load` where the family has its own `pipeline` (qwen2, qwen3_moe,
  deepseek_v3, …), else our own split of `model.model.layers` (models/pipeline.py).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
from pathlib import Path
from typing import Any

from ..errors import ModelLoadError

# config.json fields that mlx-lm's `shard` methods divide by the number of ranks (heads of
# attention and of linear attention, MLP and expert widths); the embeddings are never split.
TENSOR_SPLIT_FIELDS = (
    "num_attention_heads",
    "num_key_value_heads",
    "intermediate_size",
    "moe_intermediate_size",
    "shared_expert_intermediate_size",
    "linear_num_key_heads",
    "linear_num_value_heads",
)


def _split_fields(config: dict[str, Any]) -> list[tuple[str, int]]:
    sections = [config, config.get("text_config") or {}]
    return [(f, v) for s in sections for f in TENSOR_SPLIT_FIELDS if type(v := s.get(f)) is int]


def tensor_split_problems(config: dict[str, Any], size: int) -> list[str]:
    """The fields of TENSOR_SPLIT_FIELDS (in `config` or its `text_config`) that do not divide by
    `size` ranks, as "name=value"; empty when the layout splits."""
    return [f"{field}={value}" for field, value in _split_fields(config) if value % size]


def check_tensor_split(config: dict[str, Any], size: int) -> None:
    """ModelLoadError naming the fields that do not divide and what to do, else nothing."""
    problems = tensor_split_problems(config, size)
    if not problems:
        return
    common = math.gcd(*(value for _, value in _split_fields(config)))
    counts = [n for n in range(2, min(common, 64) + 1) if common % n == 0][:4]
    instead = f", or {', '.join(map(str, counts))} ranks" if counts else "; no number of ranks divides them all"
    raise ModelLoadError(
        f"--distributed tensor cannot split this model over {size} ranks: {', '.join(problems)} "
        f"{'does' if len(problems) == 1 else 'do'} not divide by {size} (every layer is split by heads). "
        f"Use --distributed pipeline (each rank runs a run of layers){instead}."
    )


def load_shard(path: Path, models_dir: Path, group: Any, mode: str, tokenizer_config: dict | None) -> tuple[Any, Any]:
    """This rank's (model, tokenizer). ModelLoadError for a layout that cannot be split; mlx-lm's
    own errors (OSError, ValueError, KeyError) pass through."""
    import mlx.core as mx
    from mlx_lm.utils import load, sharded_load

    from .pipeline import split_layers

    if mode == "tensor":
        check_tensor_split(json.loads((path / "config.json").read_text()), group.size())
        return sharded_load(str(path), tensor_group=group, tokenizer_config=tokenizer_config)
    model, tokenizer = load(str(path), tokenizer_config=tokenizer_config, lazy=True)
    if hasattr(getattr(model, "model", None), "pipeline"):  # mlx-lm splits this family itself
        del model
        source = with_weight_index(path, models_dir)
        return sharded_load(str(source), pipeline_group=group, tokenizer_config=tokenizer_config)
    split_layers(model, group)
    mx.eval(model.parameters())  # this rank's layers only: the others were dropped unread
    mx.eval(mx.distributed.all_sum(mx.array(1.0), stream=mx.cpu, group=group))  # every rank loaded
    return model, tokenizer


def with_weight_index(path: Path, models_dir: Path) -> Path:
    """A folder mlx-lm's pipeline loading can read: it picks each rank's weight files from
    model.safetensors.index.json, which a single-file model lacks. Then a sibling folder of links
    to the model's files plus a generated index (the user's folder is left as it is)."""
    if (path / "model.safetensors.index.json").exists():
        return path
    weights = sorted(path.glob("*.safetensors"))
    digest = hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:12]
    linked = models_dir / f"{path.name}-{digest}-indexed"
    linked.mkdir(parents=True, exist_ok=True)
    weight_map = {}
    for f in weights:
        with open(f, "rb") as fh:  # a safetensors header: u64 length, then JSON naming every tensor
            header = json.loads(fh.read(int.from_bytes(fh.read(8), "little")))
        weight_map.update({name: f.name for name in header if name != "__metadata__"})
    for f in path.iterdir():
        link = linked / f.name
        if f.is_file() and not link.exists():
            with contextlib.suppress(FileExistsError):  # every rank on one machine makes the same links
                link.symlink_to(f.resolve())
    tmp = linked / f".index.{os.getpid()}.tmp"
    tmp.write_text(json.dumps({"weight_map": weight_map}))
    os.replace(tmp, linked / "model.safetensors.index.json")
    return linked
