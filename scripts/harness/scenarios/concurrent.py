"""bench.py --scenarios concurrent's measurement, which bench.py runs too: C clients at once, each on its own system
prompt, then 8 at once on one shared prompt; and its report (per turn; cold first turns' mean, p99 and max
next to the later turns' mean; issue 26's targets as ratios ours / each peer)."""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable

from harness import THEIRS, VLLM
from harness.clients import stream_chat
from harness.prompts import QUESTIONS, system_prompt
from harness.servers import Server


def chat(server: Server, messages: list[dict], max_tokens: int) -> tuple[float, str, int]:
    """(seconds to the first content token, text, completion tokens) of one streamed greedy chat."""
    reply = stream_chat(server, messages, max_tokens, timeout_s=1800)  # 16 cold ~2k-token prompts: minutes
    return reply.ttft_s, reply.text, reply.completion_tokens


def p90(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(0.9 * (len(ordered) - 1)))]


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0-100), linear between the two nearest ranks (numpy's default): with C < 100
    samples, p99 lies between the two largest."""
    ordered = sorted(values)
    pos = q / 100 * (len(ordered) - 1)
    low = int(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def run_clients(server: Server, systems: list[str], turns: int, max_tokens: int) -> dict:
    """One thread per system prompt, all started together; {ttft: [[per client] per turn], tokens_per_s}."""
    ttft: list[list[float]] = [[] for _ in range(turns)]
    tokens = [0]
    lock = threading.Lock()
    barrier = threading.Barrier(len(systems))
    errors: list[BaseException] = []

    def client(c: int) -> None:
        messages = [{"role": "system", "content": systems[c]}]
        barrier.wait()
        try:
            for turn in range(turns):
                messages.append({"role": "user", "content": f"{QUESTIONS[(c + turn) % len(QUESTIONS)]} (client {c})"})
                t, text, n = chat(server, messages, max_tokens)
                messages.append({"role": "assistant", "content": text})
                with lock:
                    ttft[turn].append(t)
                    tokens[0] += n
        except BaseException as exc:  # reported after the join
            errors.append(exc)

    threads = [threading.Thread(target=client, args=(c,)) for c in range(len(systems))]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    if errors:
        raise errors[0]
    return {
        "ttft": ttft,
        "ttft_mean": [statistics.mean(v) for v in ttft],
        "ttft_p90": [p90(v) for v in ttft],
        "ttft_p99": [percentile(v, 99) for v in ttft],
        "ttft_max": [max(v) for v in ttft],
        "completion_tokens": tokens[0],
        "wall_s": wall,
        "tokens_per_s": tokens[0] / wall,
    }


def scenario_concurrent(
    servers: list[Server], clients: list[int], turns: int, max_tokens: int, system_words: int
) -> dict:
    """{server: {"C=<n>": run_clients(...), "shared8": run_clients(...)}} (each server alone). A case that
    fails is {"error": why} and the run goes on: a peer that breaks under load is a finding, not a crash."""
    out: dict = {"clients": clients, "turns": turns, "max_tokens": max_tokens, "system_words": system_words}
    for server in servers:
        row = out.setdefault(server.name, {})
        for n in clients:
            systems = case_systems(server.name, f"C={n}", system_words)
            row[f"C={n}"] = run_case(server, f"C={n}", systems, turns, max_tokens)
        row["shared8"] = run_case(server, "shared8", case_systems(server.name, "shared8", system_words), 1, max_tokens)
    return out


def case_systems(server: str, case: str, words: int, salt: str = "") -> list[str]:
    """The system prompts of `case` ("C=<n>": n of their own; "shared8": one for all 8 clients) on `server`,
    cold: a nonce of `salt`, the server, the case and the time leads each. The salt comes first, so
    prompts under two salts (two rounds) part right after "Session " and share no cached prefix."""
    stamp = time.time()
    if case == "shared8":
        return [system_prompt(f"{salt}{server}-shared-{stamp}", words)] * 8
    n = int(case.removeprefix("C="))
    return [system_prompt(f"{salt}{server}-{n}-{c}-{stamp}", words) for c in range(n)]


def run_case(server: Server, case: str, systems: list[str], turns: int, max_tokens: int) -> dict:
    """run_clients(...), or {"error": why} (with the server's log) when a request failed."""
    try:
        result = run_clients(server, systems, turns, max_tokens)
    except Exception as exc:
        result = {"error": f"{type(exc).__name__}: {exc} (log {server.log.name})"}
        print(server.name, case, result["error"], flush=True)
        return result
    print(server.name, case, [round(v, 3) for v in result["ttft_mean"]], flush=True)
    return result


# -- report ------------------------------------------------------------------------------------------

MEASURES = {"later": "later turns, mean TTFT", "first": "first turn (cold), mean TTFT", "tokens_per_s": "tokens/s"}


def target(measure: str, peer: str, clients: int) -> tuple[str, float] | None:
    """Issue 26's bound on ours / `peer` for `measure` at `clients`, as (operator, bound); None where
    the issue sets none (later turns vs mlx_lm.server and first turns are named at 4, 8 and 16 clients)."""
    named = clients in (4, 8, 16)
    if measure == "later" and peer == VLLM:
        return ("<", 1.0)  # ahead of vllm-mlx at every C
    if measure == "later" and named:
        return ("<=", 0.5 if clients == 16 else 0.7)  # 16: more conversations than mlx_lm.server's 10 caches
    if measure == "first" and peer == THEIRS and named:
        return ("<=", 0.7)
    if measure == "tokens_per_s" and named:
        return (">=", 1.1)
    return None


def is_met(ratio: float, bound: tuple[str, float]) -> bool:
    op, value = bound
    return {"<": ratio < value, "<=": ratio <= value, ">=": ratio >= value}[op]


def summary(case: dict) -> dict | None:
    """{first, first_p99, first_max, later, tokens_per_s} of one run_clients result; None if it failed."""
    if "error" in case:
        return None
    later = [t for turn in case["ttft"][1:] for t in turn]
    return {
        "first": case["ttft_mean"][0],
        "first_p99": case["ttft_p99"][0],
        "first_max": case["ttft_max"][0],
        "later": statistics.mean(later) if later else None,
        "tokens_per_s": case["tokens_per_s"],
    }


def quotient(ours: float | None, theirs: float | None) -> float | None:
    """ours / theirs; None where either is missing or zero."""
    return ours / theirs if ours and theirs else None


def case_ratio(runs: dict, ours: str, peer: str, case: str, measure: str) -> float | None:
    """ours / `peer` for `measure` (a summary() key) in `case` of `runs` ({server: {case: run_clients
    result}}); None where either failed or has no such figure (later turns of a one-turn case)."""
    mine, theirs = summary(runs[ours][case]), summary(runs[peer][case])
    return quotient(mine and mine[measure], theirs and theirs[measure])


def ratio_cell(ratio: float | None, bound: tuple[str, float] | None = None) -> str:
    if ratio is None:
        return "-"
    verdict = "" if bound is None else " met" if is_met(ratio, bound) else " **missed**"
    return f"{ratio:.2f}x{verdict}"


def report_lines(result: dict, names: list[str]) -> list[str]:
    """The report: per case and turn, TTFT mean / p90 per server and ours (names[0]) / each peer present
    (mlx_lm.server, vllm-mlx); tokens/s; cold first turns' mean / p99 / max next to the later turns'
    mean per server and C; issue 26's targets, met or missed; the cases that failed."""
    ours, peers = names[0], [n for n in (THEIRS, VLLM) if n in names[1:]]
    cases = [f"C={n}" for n in result["clients"]] + ["shared8"]
    turns = {case: max(len(result[n][case].get("ttft_mean", [])) for n in names) for case in cases}
    heads = [f"{n} TTFT mean / p90 s" for n in names] + [f"ours / {p}" for p in peers]
    lines = [
        f"Concurrent clients: own ~{result['system_words']}-word system prompts, {result['turns']} turns, "
        f"{result['max_tokens']} tokens per reply; `shared8`: 8 clients at once on one cold system prompt. "
        "Servers one after the other; ratios are ours / peer (below 1: ours faster, for tokens/s above 1).",
        "",
        "| case | turn | " + " | ".join(heads) + " |",
        "|---" * (len(names) + len(peers) + 2) + "|",
    ]
    for case in cases:
        for turn in range(turns[case]):
            runs = [result[n][case] for n in names]
            cells = [
                "failed" if "error" in r else f"{r['ttft_mean'][turn]:.2f} / {r['ttft_p90'][turn]:.2f}" for r in runs
            ]
            means = {n: r.get("ttft_mean", [None] * (turn + 1))[turn] for n, r in zip(names, runs, strict=True)}
            ratios = [ratio_cell(quotient(means[ours], means[p])) for p in peers]
            lines.append(f"| {case} | {turn + 1} | " + " | ".join(cells + ratios) + " |")
    lines += ["", "| case | " + " | ".join(f"{n} tokens/s" for n in names) + " |", "|---" * (len(names) + 1) + "|"]
    for case in cases:
        cells = [f"{result[n][case]['tokens_per_s']:.1f}" if "error" not in result[n][case] else "-" for n in names]
        lines.append(f"| {case} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "Cold first turns (C requests each; p99 interpolated between the two largest) and later turns "
        f"(turns 2-{result['turns']}), TTFT s:",
        "",
        "| clients | server | first turn mean | first turn p99 | first turn max | later turns mean | tokens/s |",
        "|---|---|---|---|---|---|---|",
    ]
    for n_clients in result["clients"]:
        for name in names:
            s = summary(result[name][f"C={n_clients}"])
            if s is None:
                lines.append(f"| {n_clients} | {name} | failed | | | | |")
                continue
            later = "-" if s["later"] is None else f"{s['later']:.2f}"
            lines.append(
                f"| {n_clients} | {name} | {s['first']:.2f} | {s['first_p99']:.2f} | {s['first_max']:.2f} | "
                f"{later} | {s['tokens_per_s']:.1f} |"
            )
    lines += target_lines(
        result["clients"], peers, lambda measure, peer, n: case_ratio(result, ours, peer, f"C={n}", measure)
    )
    for name in names:
        for case in cases:
            if "error" in result[name][case]:
                lines.append(f"- {name} {case} failed: {result[name][case]['error']}")
    return lines


def target_lines(
    clients: list[int], peers: list[str], ratio: Callable[[str, str, int], float | None], basis: str = ""
) -> list[str]:
    """Issue 26's targets per C in `clients`: ratio(measure, peer, C), ours / each peer, marked met or
    missed where one is set; `basis` ends the heading (how the ratios were formed, where not plain)."""
    lines = [
        "",
        "Issue 26's targets (later turns <= 0.7x `mlx_lm.server` at 4 and 8 clients, <= 0.5x at 16, below 1x "
        f"vllm-mlx at every C; first turn <= 0.7x `mlx_lm.server`; tokens/s >= 1.1x both peers){basis}:",
        "",
        "| clients | measure | " + " | ".join(f"ours / {p}" for p in peers) + " |",
        "|---|---" + "|---" * len(peers) + "|",
    ]
    for n_clients in clients:
        for measure, label in MEASURES.items():
            cells = [ratio_cell(ratio(measure, p, n_clients), target(measure, p, n_clients)) for p in peers]
            lines.append(f"| {n_clients} | {label} | " + " | ".join(cells) + " |")
    return lines
