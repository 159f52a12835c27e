"""How a model is split over ranks, without launching any: the tensor-parallel refusal of layouts
whose heads do not divide by the ranks (SmolLM2's 9 heads over 2), and our own pipeline split
(models/pipeline.py) run stage by stage in one process, the collectives replaced by a mailbox,
giving the unsplit model's logits for families whose masks come from a given layer's cache."""

from __future__ import annotations

import mlx.core as mx
import pytest
from familymodels import build_family_model
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.utils import load
from tinymodel import build_mlx_model

from mlx_kvserve.errors import ModelLoadError
from mlx_kvserve.models import pipeline
from mlx_kvserve.models.sharding import check_tensor_split, tensor_split_problems

SMOLLM2 = {"num_attention_heads": 9, "num_key_value_heads": 3, "intermediate_size": 1536, "hidden_size": 576}


def test_tensor_split_refuses_heads_that_do_not_divide_naming_them_and_what_to_do():
    assert tensor_split_problems(SMOLLM2, 2) == ["num_attention_heads=9", "num_key_value_heads=3"]
    assert tensor_split_problems(SMOLLM2, 3) == []
    with pytest.raises(ModelLoadError) as err:
        check_tensor_split(SMOLLM2, 2)
    message = err.value.message
    assert "num_attention_heads=9, num_key_value_heads=3 do not divide by 2" in message
    assert "--distributed pipeline" in message and "or 3 ranks" in message
    check_tensor_split(SMOLLM2, 3)
    llama8b = {"num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 14336}
    with pytest.raises(ModelLoadError, match="intermediate_size=14336 do not divide by 3.*or 2, 4, 8 ranks"):
        check_tensor_split(llama8b, 3)
    nested = {"text_config": {"num_attention_heads": 4, "num_key_value_heads": 1}}  # a VLM's text model
    with pytest.raises(ModelLoadError, match="num_key_value_heads=1 does not divide by 2.*no number of ranks"):
        check_tensor_split(nested, 2)


def test_stage_bounds_follow_mlx_lm_rank_0_runs_the_last_layers():
    assert [pipeline.stage_bounds(30, r, 2) for r in range(2)] == [(15, 30), (0, 15)]
    assert [pipeline.stage_bounds(3, r, 2) for r in range(2)] == [(1, 3), (0, 1)]  # the extra layer on rank 0
    assert [pipeline.stage_bounds(7, r, 3) for r in range(3)] == [(4, 7), (2, 4), (0, 2)]


class FakeGroup:
    def __init__(self, rank: int, size: int):
        self._rank, self._size = rank, size

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size


class Mailbox:
    """send / recv_like / all_gather within one process: the stages run one after another, from
    the last rank (the first layers) to rank 0, so every receive finds what the stage before sent."""

    def __init__(self):
        self.sent: list[mx.array] = []

    def send(self, x, dst, group=None):
        self.sent.append(x)
        return x

    def recv_like(self, x, src, group=None):
        h = self.sent.pop(0)
        assert h.shape == x.shape and h.dtype == x.dtype
        return h

    def all_gather(self, x, group=None):
        return mx.concatenate([x] * 2)  # only rank 0's part is kept; the test reads rank 0's logits


def _stages(model_dir, size: int) -> list:
    """The model split for ranks size-1 … 0, in the order they run."""
    stages = []
    for rank in reversed(range(size)):
        model, _ = load(str(model_dir), lazy=True)
        pipeline.split_layers(model, FakeGroup(rank, size))
        mx.eval(model.parameters())
        stages.append(model)
    return stages


def _run_both(whole, stages, tokens: list[int], monkeypatch) -> None:
    """Prefill `tokens` in two chunks, then decode 4 greedy tokens, comparing rank 0's logits
    with the unsplit model's at every step."""
    mailbox = Mailbox()
    for name in ("send", "recv_like", "all_gather"):
        monkeypatch.setattr(mx.distributed, name, getattr(mailbox, name))
    whole_cache = make_prompt_cache(whole)
    stage_caches = [make_prompt_cache(s) for s in stages]
    cut = len(tokens) // 2
    steps = [tokens[:cut], tokens[cut:]]
    for _ in range(4):
        chunk = mx.array([steps[-1]])
        expected = whole(chunk, cache=whole_cache)[:, -1]
        got = [stage(chunk, cache=cache)[:, -1] for stage, cache in zip(stages, stage_caches, strict=True)][-1]
        mx.eval(expected, got, [c.state for caches in stage_caches for c in caches])
        assert mx.allclose(got, expected, atol=1e-4, rtol=1e-4).item()
        steps.append([int(mx.argmax(expected).item())])
    assert not mailbox.sent


@pytest.mark.parametrize("family", ["llama", "gemma3_text", "gpt_oss", "lfm2", "mamba2"])
def test_own_pipeline_split_gives_the_unsplit_logits(family, tmp_path, monkeypatch):
    """Two stages; llama as SmolLM2 is split (3 heads: no tensor split; 3 layers: 2 on rank 0),
    the others mix cache kinds and pick their masks from given layers' caches."""
    if family == "llama":
        shape = {"num_attention_heads": 3, "num_key_value_heads": 3, "hidden_size": 48, "num_hidden_layers": 3}
        folder = build_mlx_model(tmp_path / family, **shape)
    else:
        folder = build_family_model(tmp_path / family, family)
    whole, _ = load(str(folder))
    stages = _stages(folder, 2)
    num_layers = len(whole.layers)
    assert [len(s.layers) for s in stages] == [num_layers // 2, num_layers - num_layers // 2]
    assert [len(make_prompt_cache(s)) for s in stages] == [len(s.layers) for s in stages]
    tokens = list(range(3, 3 + 40))  # beyond gemma3's and gpt_oss's 24-token windows
    _run_both(whole, stages, tokens, monkeypatch)


def test_a_model_whose_cache_is_not_one_entry_per_layer_is_refused(tmp_path):
    folder = build_family_model(tmp_path / "nemotron_h", "nemotron_h")  # MLP blocks have no cache
    model, _ = load(str(folder), lazy=True)
    with pytest.raises(ModelLoadError, match="cache has 3 entries for 6 layers"):
        pipeline.split_layers(model, FakeGroup(0, 2))
    model, _ = load(str(folder), lazy=True)
    with pytest.raises(ModelLoadError, match="6 layers cannot be split over 8 ranks"):
        pipeline.split_layers(model, FakeGroup(0, 8))
