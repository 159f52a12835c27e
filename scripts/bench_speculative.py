"""Speculative decoding (issue 28): decode tokens/s with speculation off and with prompt lookup, side by
side in one run, on SmolLM2-135M (greedy), driven through the engine's Generator (no server).

Tasks: (a) an agent edit whose answer repeats a span of a code file in the prompt, (b) free prose,
(c) JSON tool arguments that copy values from the prompt. Each round runs every task with speculation
off, then on (adaptive, as the server runs it), alternating which goes first; figures are medians
over rounds. Decode tokens/s = (completion tokens - 1) / (last token - first token): the first
token is the prefill's. Every on/off pair is checked to give the same tokens.

    python -m mlx_kvserve.blas_exec .venv/bin/python scripts/bench_speculative.py [--rounds 3] [--max-tokens 160]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from harness import ROOT, default_model_dir
from harness.kvstack import make_generator
from harness.reports import write_report
from mlx_lm.utils import load

from mlx_kvserve.engine.request import Finished, GenerationRequest, SamplingParams, TextDelta
from mlx_kvserve.engine.speculative import build_speculator

CODE = "\n".join(
    f"def handle_{name}(request, store):\n"
    f'    """Serve the {name} endpoint."""\n'
    f"    item = store.get(request.args['{name}_id'])\n"
    f"    if item is None:\n"
    f"        return error(404, 'no such {name}')\n"
    f"    return render(item, fields={fields!r})\n"
    for name, fields in [("user", ["id", "name"]), ("order", ["id", "total"]), ("invoice", ["id", "due"])]
)
TASKS = {
    "edit": "Here is a Python file:\n\n" + CODE + "\n\nRewrite the whole file, renaming `store` to `db` everywhere. "
    "Output only the code.",
    "prose": "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "json": "Customer record: name Ada Lovelace, email ada@example.com, city London, plan premium, seats 12.\n"
    'Call the tool create_customer with JSON arguments {"name": ..., "email": ..., "city": ..., "plan": ..., '
    '"seats": ...} filled from the record. Output only the JSON.',
}


def one(gen, prompt: list[int], max_tokens: int) -> tuple[tuple[int, ...], float, int]:
    """(tokens, decode tokens/s, completion tokens) of one greedy request."""
    marks: list[float] = []
    events: list = []

    def emit(event) -> None:
        if isinstance(event, TextDelta) and event.num_tokens:
            marks.append(time.perf_counter())
        events.append(event)

    gen.run(GenerationRequest("bench", prompt, SamplingParams(max_tokens=max_tokens), emit))
    done = events[-1]
    assert isinstance(done, Finished), done
    n = len(done.token_ids)
    rate = (len(marks) - 1) / (marks[-1] - marks[0]) if len(marks) > 1 and marks[-1] > marks[0] else 0.0
    return done.token_ids, rate, n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--max-draft-tokens", type=int, default=8)
    ap.add_argument("--out", type=Path, default=ROOT / "results" / "speculative")
    args = ap.parse_args()
    model, tokenizer = load(str(default_model_dir()))
    plain = make_generator(model, tokenizer, 64)
    spec_gen = make_generator(model, tokenizer, 64)
    spec = build_speculator(model, tokenizer, spec_gen.prefix_cache.layout, "auto", args.max_draft_tokens)
    spec_gen.scheduler.speculation = spec
    prompts = {
        name: tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
        for name, text in TASKS.items()
    }
    for prompt in prompts.values():  # warm both caches and the spec path's cost table
        one(plain, prompt, 8)
        one(spec_gen, prompt, 8)
    rates: dict[str, dict[str, list[float]]] = {name: {"off": [], "on": []} for name in TASKS}
    accept: dict[str, tuple[int, int]] = {}
    lengths: dict[str, int] = {}
    for r in range(args.rounds):
        for name, prompt in prompts.items():
            order = [("off", plain), ("on", spec_gen)]
            before = (spec.stats.drafted_tokens, spec.stats.accepted_tokens)
            got = {}
            for label, gen in order if r % 2 == 0 else order[::-1]:
                got[label] = one(gen, prompt, args.max_tokens)
                rates[name][label].append(got[label][1])
            assert got["on"][0] == got["off"][0], f"{name}: speculation changed the output"
            lengths[name] = got["on"][2]
            d, a = accept.get(name, (0, 0))
            accept[name] = (d + spec.stats.drafted_tokens - before[0], a + spec.stats.accepted_tokens - before[1])
    results = {"max_tokens": args.max_tokens, "rounds": args.rounds, "tasks": {}}
    lines = [
        f"# Speculative decoding (prompt lookup), SmolLM2-135M float32, greedy, {args.rounds} rounds",
        "",
        "| task | tokens | off tok/s | prompt lookup tok/s | speedup | drafted | accepted | acceptance |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name in TASKS:
        off, on = statistics.median(rates[name]["off"]), statistics.median(rates[name]["on"])
        drafted, accepted = accept[name]
        results["tasks"][name] = {"off_tok_s": off, "on_tok_s": on, "drafted": drafted, "accepted": accepted}
        lines.append(
            f"| {name} | {lengths[name]} | {off:.1f} | {on:.1f} | {on / off:.2f}x | {drafted} | {accepted} | "
            f"{accepted / drafted if drafted else 0:.0%} |"
        )
    results["speculator"] = spec.describe()
    write_report(results, args.out, lines)


if __name__ == "__main__":
    main()
