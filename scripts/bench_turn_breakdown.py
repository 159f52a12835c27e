"""Where a cached turn's time to first token goes when several clients send their next turn together.

In process (no HTTP), on the engine's own batch (Scheduler over mlx-lm's BatchGenerator): C clients,
each with its own ~`words`-word system prompt, run `turns` greedy turns together; from turn 2 on each
prompt is a cache hit up to the new user message. For each turn it reports the TTFT and the time of
each stage of the batch, synchronised with mx.eval so that lazy work lands in the stage that caused it:
assembling the cached prefix (PrefixCache.prepare), merging the requests' caches into the batch,
the prefill forward of the uncached tokens, moving the prompts to the decode batch (split), the
first decode forward (generate), and the decode steps. A second table times the attention of
those prefill forwards alone (mx.fast.scaled_dot_product_attention at the model's shapes), the part
that grows with the cached context and that no cache can skip.

Usage: python -m mlx_kvserve.blas_exec .venv/bin/python scripts/bench_turn_breakdown.py [--clients 4]
       [--words 600] [--turns 4] [--model DIR] [--out results/turn_breakdown]
"""

from __future__ import annotations

import argparse
import importlib
import json
import statistics
import time
from pathlib import Path

import mlx.core as mx
from harness import ROOT, default_model_dir
from harness.prompts import QUESTIONS, system_prompt

STAGES = {  # (module, class, method) -> stage name
    ("mlx_kvserve.engine.prefix_cache", "PrefixCache", "prepare"): "assemble prefix",
    ("mlx_lm.generate", "BatchGenerator", "_make_batch"): "merge into batch",
    ("mlx_lm.generate", "PromptProcessingBatch", "prompt"): "prefill forward",
    ("mlx_lm.generate", "PromptProcessingBatch", "split"): "split to decode",
    ("mlx_lm.generate", "PromptProcessingBatch", "generate"): "first decode forward",
    ("mlx_lm.generate", "GenerationBatch", "_step"): "decode steps",
}


def _states(obj) -> list:
    """Every array a batch or a prepared prefix holds, to evaluate at the end of a stage."""
    caches = getattr(obj, "prompt_cache", None) or []
    return [c.state for c in caches if c is not None and getattr(c, "keys", 1) is not None]


def instrument(times: dict[str, float]) -> None:
    """Wrap each stage to evaluate what it built and add its wall time to `times`."""
    for (module, cls_name, method), stage in STAGES.items():
        cls = getattr(importlib.import_module(module), cls_name)
        original = getattr(cls, method)

        def timed(self, *args, _original=original, _stage=stage, **kwargs):
            start = time.perf_counter()
            out = _original(self, *args, **kwargs)
            mx.eval(_states(out if hasattr(out, "prompt_cache") else self))
            times[_stage] = times.get(_stage, 0.0) + time.perf_counter() - start
            return out

        setattr(cls, method, timed)


def run_turns(generator, tokenizer, clients: int, words: int, turns: int, max_tokens: int) -> list[dict]:
    from mlx_kvserve.engine.request import Finished, GenerationRequest, SamplingParams, TextDelta

    scheduler = generator.scheduler
    histories = [
        [{"role": "system", "content": system_prompt(f"breakdown-{c}-{time.time()}", words)}] for c in range(clients)
    ]
    times: dict[str, float] = {}
    instrument(times)
    rows = []
    for turn in range(turns):
        events: list[list] = []
        times.clear()
        start = time.perf_counter()
        for c in range(clients):
            histories[c].append({"role": "user", "content": QUESTIONS[(c + turn) % len(QUESTIONS)]})
            prompt = tokenizer.apply_chat_template(histories[c], add_generation_prompt=True)
            events.append([])
            req = GenerationRequest(f"c{c}t{turn}", prompt, SamplingParams(max_tokens, 0.0), events[-1].append)
            scheduler.admit(req)
        first: list[float | None] = [None] * clients
        while scheduler.num_running:
            scheduler.step()
            for c in range(clients):
                if first[c] is None and any(isinstance(e, TextDelta) for e in events[c]):
                    first[c] = time.perf_counter() - start
        finished = [next(e for e in evs if isinstance(e, Finished)) for evs in events]
        for c, evs in enumerate(events):
            histories[c].append(
                {"role": "assistant", "content": "".join(e.text for e in evs if isinstance(e, TextDelta))}
            )
        rows.append(
            {
                "turn": turn + 1,
                "ttft_s": statistics.mean(f for f in first if f is not None),
                "prompt_tokens": statistics.mean(f.usage.prompt_tokens for f in finished),
                "cached_tokens": statistics.mean(f.usage.cached_tokens for f in finished),
                "stages_s": dict(times),
            }
        )
        print(json.dumps(rows[-1]), flush=True)
    return rows


def attention_cost(model, context: int, new_tokens: int, reps: int = 5) -> dict:
    """ms of one layer's attention of `new_tokens` queries over `context` cached keys, at the model's
    head shapes, and the same for one decode token."""
    args = model.args
    heads, kv_heads = args.num_attention_heads, args.num_key_value_heads
    dim = getattr(args, "head_dim", None) or args.hidden_size // heads

    def timed(q_len: int) -> float:
        q = mx.random.normal((1, heads, q_len, dim))
        k = mx.random.normal((1, kv_heads, context + q_len, dim))
        v = mx.random.normal((1, kv_heads, context + q_len, dim))
        mx.eval(q, k, v)
        best = float("inf")
        for _ in range(reps):
            start = time.perf_counter()
            mx.eval(mx.fast.scaled_dot_product_attention(q, k, v, scale=dim**-0.5, mask="causal"))
            best = min(best, time.perf_counter() - start)
        return best * 1000

    layers = len(model.layers)
    prefill, decode = timed(new_tokens), timed(1)
    return {
        "context": context,
        "new_tokens": new_tokens,
        "layers": layers,
        "prefill_attention_ms_per_layer": prefill,
        "prefill_attention_ms_all_layers": prefill * layers,
        "decode_attention_ms_all_layers": decode * layers,
    }


def forward_without_context_ms(model, clients: int, new_tokens: int, reps: int = 3) -> float:
    """ms of the model's forward of `clients` x `new_tokens` tokens on an empty cache: the prefill's
    cost apart from attending to a cached context."""
    from mlx_lm.models.cache import make_prompt_cache

    best = float("inf")
    for _ in range(reps):
        cache = make_prompt_cache(model)
        tokens = mx.random.randint(0, 1000, (clients, new_tokens))
        start = time.perf_counter()
        mx.eval(model(tokens, cache=cache))
        best = min(best, time.perf_counter() - start)
    return best * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--words", type=int, default=600)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--model", help="model folder (default: the default model)")
    parser.add_argument("--out", default=str(ROOT / "results" / "turn_breakdown"))
    args = parser.parse_args()

    from harness.kvstack import make_generator, server_attention
    from mlx_lm.utils import load

    server_attention()  # the CPU attention the server runs (cpu/attention.py)

    model, tokenizer = load(str(args.model or default_model_dir()))
    generator = make_generator(model, tokenizer, 64)
    rows = run_turns(generator, tokenizer, args.clients, args.words, args.turns, args.max_tokens)
    last = rows[-1]
    new = max(1, round(last["prompt_tokens"] - last["cached_tokens"]))
    attention = attention_cost(model, round(last["cached_tokens"]), new)
    attention["forward_without_context_ms"] = forward_without_context_ms(model, args.clients, new)
    print(json.dumps(attention))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "result.json").write_text(json.dumps({"args": vars(args), "turns": rows, "attention": attention}, indent=1))


if __name__ == "__main__":
    main()
