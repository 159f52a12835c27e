"""Probe mlx-lm's BatchGenerator on the tiny family models (issue 12 groundwork).

For each family (harness.synthetic.FAMILY_CONFIGS), on the CPU in float32, greedy:
  a. one prompt alone vs. batched with two others of different lengths (at once, arriving while
     the others decode, and joining one mid-prefill);
  b. prefill chunkings (prefill_step_size 512 vs 16, insert_segments at 64/128) and resuming from
     a cache extracted at a segment boundary (64, 128, 149), extracted alone or from a batch, and
     resumed alone or merged into a batch of cold prompts;
  c. RotatingKVCache layers: what the extracted cache holds, and whether a cache rebuilt from the
     last max_size positions in temporal order resumes to the same tokens;
  d. the dtypes of each cache array when the weights are bfloat16.
Prints one line per check; "SAME" means token-identical to the cold run of the prompt alone.

    .venv/bin/python -m mlx_kvserve.blas_exec .venv/bin/python scripts/probe_families.py [--fix-nemotron-h] [family ...]
"""

from __future__ import annotations

import copy
import sys
from dataclasses import dataclass

import mlx.core as mx
from harness.synthetic import FAMILY_CONFIGS, family_config, random_model
from mlx_lm.generate import BatchGenerator
from mlx_lm.models.cache import RotatingKVCache, make_prompt_cache

MAX_TOKENS = 20
BOUNDARIES = (64, 128, 149)  # 149: all but the last prompt token, so the resume decodes at once


@dataclass
class Request:
    segments: list[list[int]]
    cache: list | None = None
    all_tokens: list[int] | None = None
    start_step: int = 0  # inserted before this many BatchGenerator.next() calls have run


@dataclass
class Result:
    tokens: list[int]
    logprobs: list[mx.array]


def run(model, requests: list[Request], prefill_step_size: int = 512, on_prompt=None) -> list[Result]:
    """Greedy MAX_TOKENS tokens for every request through one BatchGenerator.
    on_prompt(generator, request index, prompt response) runs after each prompt step."""
    gen = BatchGenerator(model, max_tokens=MAX_TOKENS, prefill_step_size=prefill_step_size)
    results = [Result([], []) for _ in requests]
    uid_to_index: dict[int, int] = {}
    waiting = set(range(len(requests)))
    step = 0
    while waiting or any(len(r.tokens) < MAX_TOKENS for r in results):
        for i in sorted(waiting):
            r = requests[i]
            if r.start_step <= step:
                [uid] = gen.insert_segments([r.segments], caches=[r.cache], all_tokens=[r.all_tokens or []])
                uid_to_index[uid] = i
                waiting.discard(i)
        prompt_responses, generation_responses = gen.next()
        step += 1
        for response in prompt_responses:
            if on_prompt:
                on_prompt(gen, uid_to_index[response.uid], response)
        for response in generation_responses:
            results[uid_to_index[response.uid]].tokens.append(response.token)
            results[uid_to_index[response.uid]].logprobs.append(response.logprobs)
    gen.close()
    return results


def compare(name: str, cold: Result, other: Result) -> bool:
    same = cold.tokens == other.tokens
    # Logprob drift over the steps where both runs fed the same tokens.
    n = next((i for i, (a, b) in enumerate(zip(cold.tokens, other.tokens, strict=True)) if a != b), len(cold.tokens))
    drift = max(
        (mx.abs(a - b).max().item() for a, b in zip(cold.logprobs[: n + 1], other.logprobs[: n + 1], strict=True)),
        default=0,
    )
    verdict = "SAME" if same else f"DIFFERENT from token {n}: {other.tokens}"
    print(f"  {name:<44} {verdict}  (max |dlogprob| {drift:.2e})", flush=True)
    return same


def describe(cache: list) -> str:
    parts = []
    for c in cache:
        name = type(c).__name__
        if name == "RotatingKVCache":
            parts.append(f"Rot(keys {tuple(c.keys.shape)}, offset {c.offset}, _idx {c._idx}, keep {c.keep})")
        elif name == "KVCache":
            parts.append(f"KV(keys {tuple(c.keys.shape)} {c.keys.dtype}, offset {c.offset})")
        else:
            parts.append("Arrays(" + ", ".join(f"{tuple(a.shape)} {a.dtype}" for a in c.cache) + ")")
    return "; ".join(parts)


def capture_at(target: int, boundary: int, store: dict):
    """An on_prompt hook: copy request `target`'s cache when its prefill ends a segment at `boundary`."""

    def hook(gen, index, response):
        if index == target and response.end_of_segment and response.progress[0] == boundary:
            cache, tokens = gen.extract_cache([response.uid])[response.uid]
            store["cache"], store["tokens"] = copy.deepcopy(cache), list(tokens)

    return hook


def window_only(cache: list) -> list:
    """The cache with each RotatingKVCache rebuilt from just its last max_size positions."""
    rebuilt = []
    for c in cache:
        if isinstance(c, RotatingKVCache):
            fresh = RotatingKVCache(c.max_size, c.keep)
            fresh.keys = mx.contiguous(c._temporal_order(c.keys)[..., -c.max_size :, :])
            fresh.values = mx.contiguous(c._temporal_order(c.values)[..., -c.max_size :, :])
            fresh.offset, fresh._idx = c.offset, fresh.keys.shape[2]
            rebuilt.append(fresh)
        else:
            rebuilt.append(copy.deepcopy(c))
    return rebuilt


def probe_resume(model, prompt: list[int], others: list[list[int]], boundary: int, cold: Result) -> None:
    """b/c: extract the cache at a segment boundary (alone and in a batch), then resume from it."""
    segments = [prompt[:64], prompt[64:128], prompt[128:]]
    rest = prompt[boundary:]
    for where, batch, target in (
        ("alone", [Request(segments)], 0),
        ("in a batch", [Request([others[0]]), Request(segments), Request([others[1]])], 1),
    ):
        store: dict = {}
        segmented = run(model, batch, on_prompt=capture_at(target, boundary, store))[target]
        if boundary == BOUNDARIES[0]:
            compare(f"b. insert_segments 64/128 ({where})", cold, segmented)
        assert store["tokens"] == prompt[:boundary], "extracted tokens do not match the prefix"
        print(f"  extracted at {boundary} ({where}): {describe(store['cache'])}")
        resumed = run(model, [Request([rest], copy.deepcopy(store["cache"]), prompt[:boundary])])[0]
        compare(f"b. resume at {boundary}, extracted {where}", cold, resumed)
        if where == "alone":
            requests = [
                Request([others[0]]),
                Request([rest], copy.deepcopy(store["cache"]), prompt[:boundary]),
                Request([others[1]]),
            ]
            compare(f"b. resume at {boundary}, batched with cold prompts", cold, run(model, requests)[1])
        if any(isinstance(c, RotatingKVCache) for c in store["cache"]):
            trimmed = window_only(store["cache"])
            print(f"  window-only at {boundary}: {describe(trimmed)}")
            resumed = run(model, [Request([rest], trimmed, prompt[:boundary])])[0]
            compare(f"c. resume from last max_size at {boundary} ({where})", cold, resumed)


def probe(family: str) -> None:
    print(f"== {family}", flush=True)
    config = family_config(family)
    model = random_model(config, seed=0)
    keys = mx.random.split(mx.random.key(7), 3)
    prompt, short, long = (
        mx.random.randint(3, config["vocab_size"], (n,), key=k).tolist()
        for n, k in zip((150, 70, 230), keys, strict=True)
    )
    cold = run(model, [Request([prompt])])[0]
    print(f"  cold tokens {cold.tokens}")

    # a. batching
    batched = run(model, [Request([short]), Request([prompt]), Request([long])])
    compare("a. batched with 70 + 230 token prompts", cold, batched[1])
    staggered = run(model, [Request([short]), Request([long]), Request([prompt], start_step=3)])
    compare("a. joins while 70 + 230 decode (extend)", cold, staggered[2])
    # With 32-token prefill steps the long prompt is still mid-prefill when this one joins it.
    joining = run(model, [Request([long]), Request([prompt], start_step=2)], prefill_step_size=32)
    compare("a. joins 230 mid-prefill (step 32)", cold, joining[1])

    # b. chunkings and resuming (c. sliding windows inside)
    compare("b. prefill_step_size 16", cold, run(model, [Request([prompt])], prefill_step_size=16)[0])
    for boundary in BOUNDARIES:
        probe_resume(model, prompt, [short, long], boundary, cold)

    # d. the dtypes the cache holds when the weights are bfloat16
    bf16 = random_model(config, seed=0, dtype=mx.bfloat16)
    cache = make_prompt_cache(bf16)
    bf16(mx.array([prompt]), cache=cache)
    print(f"  d. bf16 weights, cache after prefill: {describe(cache)}", flush=True)


def fix_nemotron_h_lengths() -> None:
    """mlx-lm 0.32.2's nemotron_h drops cache.lengths on the way to ssm_update (mamba2 passes it),
    so a right-padded prompt in a batched prefill folds its padding into the SSM state. This is
    mamba2's _ssm, to check that this is the only difference."""
    from mlx_lm.models import nemotron_h
    from mlx_lm.models.ssm import ssm_update

    def _ssm(self, hidden_states, B, C, dt, cache, mask):
        b, s, _ = hidden_states.shape
        hidden_states = hidden_states.reshape(b, s, self.num_heads, self.head_dim)
        B = B.reshape(b, s, self.n_groups, self.ssm_state_size)
        C = C.reshape(b, s, self.n_groups, self.ssm_state_size)
        state, lengths = (cache[1], cache.lengths) if cache else (None, None)
        D = self.D.astype(hidden_states.dtype)
        y, state = ssm_update(
            hidden_states, self.A_log, B, C, D, dt, self.dt_bias, state, self.time_step_limit, mask, lengths
        )
        if cache:
            cache[1] = state
        return y.reshape(b, s, self.intermediate_size)

    nemotron_h.NemotronHMamba2Mixer._ssm = _ssm


if __name__ == "__main__":
    mx.set_default_device(mx.cpu)
    names = [a for a in sys.argv[1:] if not a.startswith("--")]
    if "--fix-nemotron-h" in sys.argv:
        fix_nemotron_h_lengths()
    for name in names or list(FAMILY_CONFIGS):
        probe(name)
