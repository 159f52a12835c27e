"""Our own pipeline split, for model families mlx-lm cannot pipeline (llama, gemma3, gpt_oss, …):
each rank runs a contiguous run of the model's layers (`model.model.layers`, `.backbone.layers`,
…), passing the hidden state on with mx.distributed send/recv, as mlx-lm's own pipelined models
do (mlx_lm/models/pipeline.py, qwen2):

- rank r runs the layers after those of ranks r+1 … size-1 (rank size-1 the first layers, rank 0
  the last), an even split with the extra layers on the low ranks: mlx-lm's order and split;
- the first layer of a rank's run receives the previous stage's hidden state, the last sends its
  output to the next stage; then every rank all-gathers rank 0's output, so every rank computes
  the final norm and logits (the engine samples on every rank alike);
- the other ranks' layers become pass-throughs that keep the layer's plain attributes (the
  model's own code reads some, e.g. llama's `use_sliding`) and none of its weights;
- the cache covers this rank's layers only (`make_cache`, `layers`), as in mlx-lm's pipelined
  models. At each call it is spread back over every layer index, a layer run elsewhere getting
  one of this rank's caches of the same kind, so the masks the model builds from `cache[i]` are
  right (every layer of a kind has the same offsets and padding).

The model's class is swapped for a subclass with that `__call__`, `layers` and `make_cache`: the
engine, mlx-lm's batch generator and the cache layout keep using the object they know.
"""

from __future__ import annotations

import copy
import inspect
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import make_prompt_cache

from ..errors import ModelLoadError

INNER_NAMES = ("model", "backbone", "transformer")  # where mlx-lm's families keep their list of layers


def stage_bounds(num_layers: int, rank: int, size: int) -> tuple[int, int]:
    """[start, end) of the layers `rank` runs: rank 0 the last ones, the low ranks one extra."""
    base, extra = divmod(num_layers, size)
    split = [base + (1 if r < extra else 0) for r in range(size)]
    start = sum(split[rank + 1 :])
    return start, start + split[rank]


def split_layers(model: nn.Module, group: Any) -> None:
    """Make `model` this rank's stage, in place, before its weights are evaluated (the other
    ranks' layers are then never read). ModelLoadError when the model has no list of layers,
    fewer layers than ranks, or a cache that is not one entry per layer."""
    name = getattr(model, "model_type", type(model).__name__)
    inner = next((n for n in INNER_NAMES if isinstance(getattr(model.get(n), "layers", None), list)), None)
    if inner is None:
        raise ModelLoadError(
            f"--distributed pipeline: the {name} model class keeps no list of layers "
            f"(model.{{{','.join(INNER_NAMES)}}}.layers) to split; use --distributed tensor"
        )
    layers = model[inner].layers
    num, rank, size = len(layers), group.rank(), group.size()
    if num < size:
        raise ModelLoadError(f"--distributed pipeline: {num} layers cannot be split over {size} ranks; use fewer ranks")
    template = make_prompt_cache(model)
    if len(template) != num:
        raise ModelLoadError(
            f"--distributed pipeline: the {name} model's cache has {len(template)} entries for {num} layers, so "
            "it cannot be split by layers; use --distributed tensor"
        )
    start, end = stage_bounds(num, rank, size)
    own_slot: dict[tuple, int] = {}  # a cache kind -> the slot of this rank's first layer of that kind
    for i in range(start, end):
        own_slot.setdefault(_kind(template[i]), i - start)
    slots = tuple(i - start if start <= i < end else own_slot.get(_kind(template[i])) for i in range(num))
    for i in range(num):
        if not start <= i < end:
            layers[i] = _Elsewhere(layers[i])
    last = end - 1
    layers[start] = _StageEdge(layers[start], group, receive=rank < size - 1, send=start == last)
    if last != start:
        layers[last] = _StageEdge(layers[last], group, receive=False, send=True)
    cls = type(model)
    model.__class__ = type(f"Pipelined{cls.__name__}", (_PipelineStage, cls), {})
    model._stage = _Stage(inner, start, end, slots, tuple(template[start:end]))


def _kind(cache: Any) -> tuple:
    """What makes two layers' caches interchangeable for building masks."""
    return type(cache), getattr(cache, "max_size", None), getattr(cache, "keep", None)


@dataclass(frozen=True)
class _Stage:
    inner: str  # the model's attribute holding the list of layers
    start: int
    end: int
    slots: tuple[int | None, ...]  # per layer of the model: the index into this rank's cache, or None
    caches: tuple[Any, ...]  # empty caches of this rank's layers, copied by make_cache


class _PipelineStage:
    """Put in front of the model's own class by split_layers."""

    _stage: _Stage

    def __call__(self, inputs: mx.array, cache: Any = None, *args: Any, **kwargs: Any) -> mx.array:
        if cache is not None:
            cache = [cache[j] if j is not None else None for j in self._stage.slots]
        return super().__call__(inputs, cache, *args, **kwargs)  # type: ignore[misc]

    @property
    def layers(self) -> list[Any]:
        """This rank's layers (what its cache covers), as mlx-lm's pipelined models answer."""
        stage = self._stage
        return getattr(self, stage.inner).layers[stage.start : stage.end]

    def make_cache(self) -> list[Any]:
        return [copy.deepcopy(c) for c in self._stage.caches]


class _Elsewhere(nn.Module):
    """A layer another rank runs: the hidden state passes through unchanged."""

    def __init__(self, layer: nn.Module):
        super().__init__()
        for name, value in vars(layer).items():  # plain attributes only: no weights, no submodules
            if not name.startswith("_"):
                object.__setattr__(self, name, value)

    def __call__(self, x: mx.array, *args: Any, **kwargs: Any) -> mx.array:
        return x


class _StageEdge(nn.Module):
    """One of this rank's layers at an edge of its run: with `receive`, the hidden state comes
    from the previous stage (rank + 1); with `send`, the output goes to the next (rank - 1, none
    after rank 0) and every rank then all-gathers rank 0's."""

    def __init__(self, layer: nn.Module, group: Any, receive: bool, send: bool):
        super().__init__()
        self.layer = layer
        rank = group.rank()
        self.group = group
        self.receive_from = rank + 1 if receive else None
        self.send_to = rank - 1 if send and rank > 0 else None
        self.gather = send
        params = list(inspect.signature(layer.__call__).parameters)
        self.cache_pos = params.index("cache") - 1 if "cache" in params else None  # in *args (after x)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:  # the model's code reads the layer's attributes (e.g. use_sliding)
            layer = self.get("layer")
            if layer is None:
                raise
            return getattr(layer, name)

    def __call__(self, x: mx.array, *args: Any, **kwargs: Any) -> mx.array:
        if self.receive_from is not None:
            x = mx.distributed.recv_like(x, self.receive_from, group=self.group)
        h = self.layer(x, *args, **kwargs)
        if self.send_to is not None:
            h = mx.distributed.send(h, self.send_to, group=self.group)
            cache = kwargs.get("cache")
            if cache is None and self.cache_pos is not None and len(args) > self.cache_pos:
                cache = args[self.cache_pos]
            _depend(cache, h)
        if self.gather:
            h = mx.distributed.all_gather(h, group=self.group)[: h.shape[0]]
        return h


def _depend(cache: Any, sent: mx.array) -> None:
    """Tie the send to this layer's cache: a prefill chunk evaluates only the caches, and the
    next stage waits for what this one sends (as mlx-lm's pipelined models do)."""
    if cache is None:
        return
    if getattr(cache, "keys", None) is not None:
        cache.keys = mx.depends(cache.keys, sent)
    elif isinstance(getattr(cache, "cache", None), list) and cache.cache and cache.cache[0] is not None:
        cache.cache[0] = mx.depends(cache.cache[0], sent)
