"""C conversations in process, each sending its next turn the moment its reply ends (as the HTTP
clients of bench_concurrent.py do): later turns arrive one by one while the others decode or
prefill, not together. Their TTFT with the product (a short rest prefilled on its own, last token
included, its first token sampled there: it joins decoding in the step that starts it,
engine/batch/direct_join.py) and with `side prefill` (the code before: the short rest prefilled in the
batch's step, or on its own beside a long prompt, but for its last token, which the move to decoding
ran in a one-token pass of its own a step later), alternated round by round in one process.

On the engine's Generator with the server's scheduling defaults (SmolLM2 or --model; SSD off, no
HTTP): each client has its own ~`words`-word system prompt (cold), then `turns - 1` later turns.
Reports per variant the mean TTFT of first and later turns, the wall time and completion tokens/s,
medians over the rounds; the replies are compared between the variants.

Usage: python -m mlx_kvserve.cpu.blas_exec .venv/bin/python scripts/bench_staggered_turns.py [--clients 4]
       [--rounds 3] [--words 300] [--turns 2] [--max-tokens 16] [--model DIR]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from harness import ROOT, default_model_dir
from harness.kvstack import make_generator, server_attention
from harness.prompts import QUESTIONS, system_prompt
from harness.reports import write_report


def conversations(gen, tok, clients: int, words: int, turns: int, max_tokens: int, nonce: str) -> dict:
    """Run the clients to their last turn, stepping the scheduler as the worker does; a client's
    next turn is admitted right after the step that finished its reply."""
    from mlx_kvserve.engine.request import Failed, Finished, GenerationRequest, SamplingParams, TextDelta

    sched = gen.scheduler
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    histories = [[{"role": "system", "content": system_prompt(f"{nonce}-{c}", words)}] for c in range(clients)]
    ttft: list[list[float]] = [[] for _ in range(turns)]
    replies: list[list[tuple]] = [[] for _ in range(clients)]
    tokens = [0]
    live: dict[int, tuple[int, float, list]] = {}  # client -> (turn, sent, events)

    def send(c: int, turn: int) -> None:
        histories[c].append({"role": "user", "content": QUESTIONS[(c + turn) % len(QUESTIONS)]})
        prompt = tok.apply_chat_template(histories[c], add_generation_prompt=True)
        live[c] = (turn, time.perf_counter(), [])
        sched.admit(GenerationRequest(f"c{c}t{turn}", prompt, params, live[c][2].append))

    start = time.perf_counter()
    for c in range(clients):
        send(c, 0)
    answered: set[tuple[int, int]] = set()
    while live:
        sched.step()
        now = time.perf_counter()
        for c, (turn, sent, events) in list(live.items()):
            if (c, turn) not in answered and any(isinstance(e, TextDelta) for e in events):
                answered.add((c, turn))
                ttft[turn].append(now - sent)
            if events and isinstance(events[-1], Failed):
                raise RuntimeError(f"client {c}, turn {turn}: {events[-1].error!r}")
            if events and isinstance(events[-1], Finished):
                done = events[-1]
                tokens[0] += done.usage.completion_tokens
                replies[c].append(done.token_ids)
                text = "".join(e.text for e in events if isinstance(e, TextDelta))
                histories[c].append({"role": "assistant", "content": text})
                del live[c]
                if turn + 1 < turns:
                    send(c, turn + 1)
    wall = time.perf_counter() - start
    later = [t for turn in ttft[1:] for t in turn]
    return {
        "first_ttft": statistics.mean(ttft[0]),
        "later_ttft": statistics.mean(later) if later else 0.0,
        "wall_s": wall,
        "tokens_per_s": tokens[0] / wall,
        "replies": replies,
    }


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="model folder (default: the default model)")
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--words", type=int, default=300)
    p.add_argument("--turns", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default=str(ROOT / "results" / "staggered_turns"))
    args = p.parse_args(argv)
    server_attention()  # the CPU attention the server runs (cpu/attention.py)

    import mlx.core as mx

    from mlx_kvserve.config import Config, default_home
    from mlx_kvserve.engine.batch import direct_join
    from mlx_kvserve.engine.batch.order import StartOrder
    from mlx_kvserve.engine.request import GenerationRequest, SamplingParams
    from mlx_kvserve.models.loader import load_model

    loaded = load_model(
        str(Path(args.model) if args.model else default_model_dir()), default_home() / "models", "float32"
    )
    tok, server = loaded.tokenizer, Config().server
    product = direct_join.fits
    variants = {"product": product, "side prefill": lambda *a: False}
    results: dict[str, list[dict]] = {v: [] for v in variants}
    for r in range(args.rounds):
        nonce = f"{r}-{time.time()}"  # new prompts each round, the same for both variants
        for name in variants if r % 2 == 0 else list(variants)[::-1]:
            direct_join.fits = variants[name]
            gen = make_generator(loaded.model, tok, 64)
            gen.scheduler.max_batch = server.batch_limit()
            gen.scheduler.order = StartOrder(server.scheduling, server.max_wait_s)
            warm = tok.apply_chat_template([{"role": "user", "content": "warm up"}], add_generation_prompt=True)
            gen.run(GenerationRequest("warm", warm, SamplingParams(max_tokens=4), lambda e: None))
            results[name].append(conversations(gen, tok, args.clients, args.words, args.turns, args.max_tokens, nonce))
            mx.clear_cache()
    direct_join.fits = product
    names = list(variants)
    same = all(a["replies"] == b["replies"] for a, b in zip(results[names[0]], results[names[1]], strict=True))
    keys = ("first_ttft", "later_ttft", "wall_s", "tokens_per_s")
    med = {v: {k: statistics.median(x[k] for x in rs) for k in keys} for v, rs in results.items()}
    lines = [
        "# Later turns arriving one by one: the first token from the short rest's own prefill",
        "",
        f"{loaded.name}, {args.clients} clients, ~{args.words}-word system prompts, {args.turns} turns of "
        f"{args.max_tokens} tokens, {args.rounds} rounds alternated, medians; same replies: {same}",
        "",
        "| code | first turns' mean TTFT s | later turns' mean TTFT s | wall s | tokens/s | later turns, all rounds |",
        "|---|---|---|---|---|---|",
        *(
            f"| {v} | {med[v]['first_ttft']:.2f} | {med[v]['later_ttft']:.2f} | {med[v]['wall_s']:.1f} | "
            f"{med[v]['tokens_per_s']:.2f} | {', '.join(format(x['later_ttft'], '.2f') for x in results[v])} |"
            for v in names
        ),
    ]
    out = {
        "medians": med,
        "same_replies": same,
        "rounds": {v: [{k: x[k] for k in keys} for x in rs] for v, rs in results.items()},
    }
    write_report(out, Path(args.out), lines)
    return out


if __name__ == "__main__":
    main()
