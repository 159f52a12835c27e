"""Cached turns arriving while cold prompts prefill (issue 26): their time to first token and the cold
prompts', with the product (a short rest prefilled on its own, last token included, its first token
sampled from that pass: it joins decoding at once, engine/batch/direct_join.py; a step that a request joined
ends after its decode pass, engine/batch/mlx_batch.py) next to the two codes before: `side prefill`
(the short rest prefilled on its own but for its last token, which the batch's move to decoding ran in
a one-token pass of its own, a step later: engine/batch/side_prefill.py) and `before` (the short rest padded
into the cold prompts' prefill passes; mlx-lm's step, which goes on to prefill the next chunk before
returning the moved requests' first tokens).

In process, on the engine's Generator (SmolLM2 or --model, SSD off): `--cold` clients send a cold
~`words`-word prompt (several prefill chunks); one batch step later `--warm` clients send a later turn
of a conversation whose earlier turns are cached (a few dozen new tokens, a short join). Reports the
later turns' mean TTFT and the cold prompts' mean TTFT for each variant, alternated round by round in
one process; every reply is checked equal between the variants.

Usage: python -m mlx_kvserve.cpu.blas_exec .venv/bin/python scripts/bench_turn_beside_prefill.py [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from harness import ROOT, default_model_dir
from harness.kvstack import make_generator, server_attention
from harness.prompts import system_prompt
from harness.reports import write_report


def one_round(gen, colds: list[list[int]], warms: list[list[int]], max_tokens: int) -> dict:
    """Admit the cold prompts, step once, admit the warm ones; run to the end. TTFTs and replies."""
    from mlx_kvserve.engine.request import Finished, GenerationRequest, SamplingParams, TextDelta

    sched = gen.scheduler
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    sent: dict[str, float] = {}
    first: dict[str, float] = {}
    replies: dict[str, tuple] = {}

    def sink(name: str):
        def emit(event) -> None:
            if isinstance(event, TextDelta) and event.num_tokens:
                first.setdefault(name, time.perf_counter() - sent[name])
            if isinstance(event, Finished):
                replies[name] = event.token_ids

        return emit

    def admit(name: str, tokens: list[int]) -> None:
        sent[name] = time.perf_counter()
        sched.admit(GenerationRequest(name, tokens, params, sink(name)))

    for i, tokens in enumerate(colds):
        admit(f"cold{i}", tokens)
    sched.step()
    for i, tokens in enumerate(warms):
        admit(f"warm{i}", tokens)
    while sched.has_work:
        sched.step()
    cold = statistics.mean(v for k, v in first.items() if k.startswith("cold"))
    warm = statistics.mean(v for k, v in first.items() if k.startswith("warm"))
    return {"cold_ttft": cold, "warm_ttft": warm, "replies": replies}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="model folder (default: the default model)")
    p.add_argument("--words", type=int, default=900)
    p.add_argument("--cold", type=int, default=2)
    p.add_argument("--warm", type=int, default=4)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--out", default=str(ROOT / "results" / "turn_beside_prefill"))
    args = p.parse_args(argv)
    server_attention()  # the CPU attention the server runs (cpu/attention.py)

    import mlx.core as mx
    from mlx_lm.generate import BatchGenerator

    from mlx_kvserve.config import default_home
    from mlx_kvserve.engine.batch import direct_join, side_prefill
    from mlx_kvserve.engine.batch import mlx_batch as batch_generator
    from mlx_kvserve.engine.request import GenerationRequest, SamplingParams
    from mlx_kvserve.models.loader import load_model

    loaded = load_model(
        str(Path(args.model) if args.model else default_model_dir()), default_home() / "models", "float32"
    )
    tok = loaded.tokenizer
    product = batch_generator.KVServeBatchGenerator._next, side_prefill._short_beside_long, direct_join.fits

    def place(variant) -> None:
        batch_generator.KVServeBatchGenerator._next, side_prefill._short_beside_long, direct_join.fits = variant

    def mlx_lm_step(self):  # the step before: moved requests' first tokens wait for the next chunk
        moved = self._move_done_prompts()
        prompts, generated = BatchGenerator._next(self)
        return moved + prompts, generated

    never = lambda *args: False  # noqa: E731
    variants = {"product": product, "side prefill": (*product[:2], never), "before": (mlx_lm_step, never, never)}
    results: dict[str, list[dict]] = {v: [] for v in variants}
    for r in range(args.rounds):
        for name in variants if r % 2 == 0 else list(variants)[::-1]:
            place(variants[name])
            gen = make_generator(loaded.model, tok, 16)
            # The warm conversations' earlier turns, cached (a RAM hit up to the new message).
            histories = [tok.encode(system_prompt(f"warm{i}", target_words=150)) for i in range(args.warm)]
            for h in histories:
                gen.run(GenerationRequest("seed", h, SamplingParams(max_tokens=1), lambda e: None))
            colds = [tok.encode(system_prompt(f"cold{r}-{i}", target_words=args.words)) for i in range(args.cold)]
            warms = [h + tok.encode(f" Round {r}: and what about item {i}?") for i, h in enumerate(histories)]
            gen.scheduler.prefill_batch_size = args.cold
            results[name].append(one_round(gen, colds, warms, args.max_tokens))
            mx.clear_cache()
    place(product)
    names = list(variants)
    same = all(
        a["replies"] == b["replies"] for n in names[1:] for a, b in zip(results[names[0]], results[n], strict=True)
    )
    med = {v: {k: statistics.median(x[k] for x in rs) for k in ("cold_ttft", "warm_ttft")} for v, rs in results.items()}
    lines = [
        "# Cached turns beside cold prefills: a short rest prefilled alone, the first token in its step",
        "",
        f"{loaded.name}, {args.cold} cold prompts of ~{args.words} words, {args.warm} later turns one step after, "
        f"{args.rounds} rounds alternated, medians; same replies: {same}",
        "",
        "| code | later turns' mean TTFT s | cold prompts' mean TTFT s |",
        "|---|---|---|",
        *(f"| {v} | {med[v]['warm_ttft']:.2f} | {med[v]['cold_ttft']:.2f} |" for v in names),
    ]
    out = {"medians": med, "same_replies": same}
    write_report(out, Path(args.out), lines)
    if not same:
        raise SystemExit("the variants gave different replies")
    return out


if __name__ == "__main__":
    main()
