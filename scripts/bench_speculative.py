"""Speculative decoding (issue 28): decode tokens/s with speculation off, with prompt lookup and with a
draft model, side by side in one run, on SmolLM2-135M (greedy), driven through the engine's Generator
(no server); with --peer, task (a) over HTTP next to mlx_lm.server, plain and with --draft-model.

Tasks: (a) an agent edit whose answer repeats a span of a code file in the prompt, (b) free prose,
(c) JSON tool arguments that copy values from the prompt. Each round runs every task with speculation
off, by prompt lookup and by the draft model (each adaptive, as the server runs it), rotating which
goes first; figures are medians over rounds. Decode tokens/s = (completion tokens - 1) / (last token -
first token): the first token is the prefill's. Every variant is checked to give the same tokens.

(c) shows the tool's two earlier calls as an agent's history does (a record, then the call's JSON
arguments), then a new record: SmolLM2-135M answers with the call's JSON alone, keys from the earlier
calls and values from the record. (An earlier form of (c) asked for the JSON with no example; this model
answered it in prose about `json.dumps` and opened the JSON object at token ~118 of 120, so that task
measured prose: 1.03-1.13x, docs/speculative.md.)

The draft model is SmolLM2-135M itself (float32): the only model with SmolLM2's tokenizer available
offline. It agrees with the target always, but one of its steps costs what a target step costs, so it
cannot pay (a quantized copy is no cheaper here: MLX's quantized matmuls have no BLAS path on the CPU,
and its prefill is many times slower). The figures show the adaptive depth falling back to plain steps
and what mlx_lm.server's fixed-depth drafting (3 tokens) costs; a draft several times smaller than the
target (on a Mac, where decode is bound by memory bandwidth) is where a draft model pays.

Over HTTP each request's prompt starts with its own "(run N)" line: mlx_lm.server 0.32.2 with
--draft-model answers a prompt it has cached with an empty completion.

    python -m mlx_kvserve.cpu.blas_exec .venv/bin/python scripts/bench_speculative.py [--rounds 3] [--max-tokens 120] [--peer]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from harness import OURS, ROOT, THEIRS, default_model_dir
from harness.clients import stream_chat
from harness.kvstack import make_generator, server_attention
from harness.reports import write_report
from harness.servers import Server, free_port, server_env
from mlx_lm.utils import load

from mlx_kvserve.engine.request import Finished, GenerationRequest, SamplingParams, TextDelta
from mlx_kvserve.engine.speculative.draft import DraftModel, draft_block_cache
from mlx_kvserve.engine.speculative.speculator import build_speculator

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
    "json": "Convert each customer record to the JSON arguments of the tool create_customer.\n\n"
    "Record: name Grace Hopper, email grace@navy.mil, city Arlington, plan basic, seats 3.\n"
    'Arguments: {"name": "Grace Hopper", "email": "grace@navy.mil", "city": "Arlington", "plan": "basic", '
    '"seats": 3}\n\n'
    "Record: name Alan Turing, email alan@bletchley.uk, city Manchester, plan team, seats 40.\n"
    'Arguments: {"name": "Alan Turing", "email": "alan@bletchley.uk", "city": "Manchester", "plan": "team", '
    '"seats": 40}\n\n'
    "Record: name Ada Lovelace, email ada@example.com, city London, plan premium, seats 12.\n"
    "Arguments:",
}
VARIANTS = ("off", "lookup", "draft")


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


def in_process(args, tokenizer, model, draft_dir: Path) -> dict:
    """Every task with speculation off, by prompt lookup and by the draft model, `rounds` times."""
    draft_model, _ = load(str(draft_dir))
    gens = {name: make_generator(model, tokenizer, 64) for name in VARIANTS}
    specs = {
        "lookup": build_speculator(model, tokenizer, gens["lookup"].prefix_cache.layout, "prompt_lookup", args.k),
        "draft": build_speculator(
            model,
            tokenizer,
            gens["draft"].prefix_cache.layout,
            "draft",
            args.k,
            DraftModel(draft_model, "self", draft_block_cache(draft_model, "bench-draft", 64, 1 << 28)),
        ),
    }
    for name, spec in specs.items():
        gens[name].scheduler.speculation = spec
    prompts = {name: chat_prompt(tokenizer, text) for name, text in TASKS.items()}
    for prompt in prompts.values():  # warm the caches and the cost tables
        for gen in gens.values():
            one(gen, prompt, 8)
    rates = {task: {v: [] for v in VARIANTS} for task in TASKS}
    counts = {task: {v: [0, 0] for v in specs} for task in TASKS}
    lengths: dict[str, int] = {}
    for r in range(args.rounds):
        for task, prompt in prompts.items():
            got = {}
            for i in range(len(VARIANTS)):
                label = VARIANTS[(i + r) % len(VARIANTS)]
                spec = specs.get(label)
                before = (spec.stats.drafted_tokens, spec.stats.accepted_tokens) if spec else (0, 0)
                got[label] = one(gens[label], prompt, args.max_tokens)
                rates[task][label].append(got[label][1])
                if spec:
                    counts[task][label][0] += spec.stats.drafted_tokens - before[0]
                    counts[task][label][1] += spec.stats.accepted_tokens - before[1]
            assert got["lookup"][0] == got["off"][0] == got["draft"][0], f"{task}: speculation changed the output"
            lengths[task] = got["off"][2]
    tasks = {}
    for task in TASKS:
        med = {v: statistics.median(rates[task][v]) for v in VARIANTS}
        tasks[task] = {"tokens": lengths[task], **{f"{v}_tok_s": med[v] for v in VARIANTS}, "drafts": counts[task]}
    return {"tasks": tasks, "speculators": {name: spec.describe() for name, spec in specs.items()}}


def chat_prompt(tokenizer, text: str) -> list[int]:
    return tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)


def peer(args, draft_dir: Path) -> dict:
    """Task (a) over HTTP, one server at a time: ours (prompt lookup; draft model), mlx_lm.server
    (plain; --draft-model, its default 3 draft tokens). Median decode tokens/s over `rounds` requests."""
    model_dir = str(default_model_dir())
    env = server_env()
    work = Path(tempfile.mkdtemp(prefix="kvserve-spec-"))
    configs = {}
    for mode in ("prompt_lookup", "draft"):
        configs[mode] = work / f"{mode}.toml"
        configs[mode].write_text(f'[speculative]\nmode = "{mode}"\ndraft_model = "{draft_dir}"\n')
    ours = [sys.executable, "-m", "mlx_kvserve", "run", "--model", model_dir, "--port"]
    theirs = [sys.executable, "-m", "mlx_lm.server", "--model", model_dir, "--port"]
    runs = {
        "ours, prompt lookup": (OURS, lambda p: [*ours, str(p), "--config", str(configs["prompt_lookup"])], "/health"),
        "ours, draft model": (OURS, lambda p: [*ours, str(p), "--config", str(configs["draft"])], "/health"),
        "mlx_lm.server, plain": (THEIRS, lambda p: [*theirs, str(p)], "/v1/models"),
        "mlx_lm.server --draft-model": (
            THEIRS,
            lambda p: [*theirs, str(p), "--draft-model", str(draft_dir)],
            "/v1/models",
        ),
    }
    results = {}
    for label, (name, cmd, ready) in runs.items():
        port = free_port()
        server = Server(name, cmd(port), port, dict(env, MLX_KVSERVE_HOME=str(work / f"home-{port}")), ready)
        try:
            server.wait(ready)
            stream_chat(server, edit_messages(-1), 8)  # warm: kernels, the cost tables
            rates, texts = [], set()
            for r in range(args.rounds):
                reply = stream_chat(server, edit_messages(r), args.max_tokens)
                rates.append((reply.completion_tokens - 1) / (reply.done_s - reply.ttft_s))
                texts.add(reply.text)
            results[label] = {"tok_s": statistics.median(rates), "texts": sorted(texts)}
        finally:
            server.stop()
    plain = results["mlx_lm.server, plain"]["texts"]
    for r in results.values():
        r["same_text_as_plain"] = r.pop("texts") == plain
    return results


def edit_messages(r: int) -> list[dict]:
    return [{"role": "user", "content": f"(run {r})\n" + TASKS["edit"]}]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=120)
    ap.add_argument("--k", type=int, default=8, help="max_draft_tokens")
    ap.add_argument("--peer", action="store_true", help="also task (a) over HTTP next to mlx_lm.server")
    ap.add_argument("--out", type=Path, default=ROOT / "results" / "speculative")
    args = ap.parse_args()
    server_attention()  # the CPU attention the server runs (cpu/attention.py)
    args.out.mkdir(parents=True, exist_ok=True)
    load_before = os.getloadavg()
    model, tokenizer = load(str(default_model_dir()))
    draft_dir = default_model_dir()
    results = {"max_tokens": args.max_tokens, "rounds": args.rounds, **in_process(args, tokenizer, model, draft_dir)}
    lines = [
        f"# Speculative decoding, SmolLM2-135M float32, greedy, {args.rounds} rounds, {args.max_tokens} tokens",
        f"draft model: {draft_dir.name} (itself); load average before {load_before[0]:.2f}",
        "",
        "| task | off tok/s | prompt lookup tok/s | speedup | draft model tok/s | speedup | "
        "lookup drafted/accepted | draft drafted/accepted |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for task, t in results["tasks"].items():
        (ld, la), (dd, da) = t["drafts"]["lookup"], t["drafts"]["draft"]
        lines.append(
            f"| {task} | {t['off_tok_s']:.1f} | {t['lookup_tok_s']:.1f} | {t['lookup_tok_s'] / t['off_tok_s']:.2f}x | "
            f"{t['draft_tok_s']:.1f} | {t['draft_tok_s'] / t['off_tok_s']:.2f}x | {ld}/{la} | {dd}/{da} |"
        )
    if args.peer:
        results["peer_edit"] = peer(args, draft_dir)
        lines += ["", "Task (a) over HTTP, one server at a time:", "", "| server | decode tok/s | same text as plain |"]
        lines.append("|---|---|---|")
        for label, r in results["peer_edit"].items():
            lines.append(f"| {label} | {r['tok_s']:.1f} | {r['same_text_as_plain']} |")
    results["load_average"] = {"before": load_before, "after": os.getloadavg()}
    lines += ["", f"load average after: {results['load_average']['after'][0]:.2f}"]
    write_report(results, args.out, lines)


if __name__ == "__main__":
    main()
