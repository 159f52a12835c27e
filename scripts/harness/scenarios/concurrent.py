"""bench_concurrent.py's measurement, which bench.py runs too: C clients at once, each on its own system
prompt, then 8 at once on one shared prompt; and its report."""

from __future__ import annotations

import statistics
import threading
import time

from harness.clients import stream_chat
from harness.prompts import QUESTIONS, system_prompt
from harness.servers import Server


def chat(server: Server, messages: list[dict], max_tokens: int) -> tuple[float, str, int]:
    """(seconds to the first content token, text, completion tokens) of one streamed greedy chat."""
    reply = stream_chat(server, messages, max_tokens, timeout_s=900)
    return reply.ttft_s, reply.text, reply.completion_tokens


def p90(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(0.9 * (len(ordered) - 1)))]


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
        "completion_tokens": tokens[0],
        "wall_s": wall,
        "tokens_per_s": tokens[0] / wall,
    }


def scenario_concurrent(
    servers: list[Server], clients: list[int], turns: int, max_tokens: int, system_words: int
) -> dict:
    """{server: {"C=<n>": run_clients(...), "shared8": run_clients(...)}} (each server alone)."""
    out: dict = {"clients": clients, "turns": turns, "max_tokens": max_tokens, "system_words": system_words}
    for server in servers:
        row = out.setdefault(server.name, {})
        for n in clients:
            stamp = time.time()
            systems = [system_prompt(f"{server.name}-{n}-{c}-{stamp}", system_words) for c in range(n)]
            row[f"C={n}"] = run_clients(server, systems, turns, max_tokens)
            print(server.name, f"C={n}", [round(v, 3) for v in row[f"C={n}"]["ttft_mean"]], flush=True)
        shared = system_prompt(f"{server.name}-shared-{time.time()}", system_words)
        row["shared8"] = run_clients(server, [shared] * 8, 1, max_tokens)
        print(server.name, "shared8", round(row["shared8"]["ttft_mean"][0], 3), flush=True)
    return out


def report_lines(result: dict, names: list[str]) -> list[str]:
    lines = [
        f"Concurrent clients: own ~{result['system_words']}-word system prompts, {result['turns']} turns, "
        f"{result['max_tokens']} tokens per reply; `shared8`: 8 clients at once on one cold system prompt.",
        "",
        "| case | turn | "
        + " | ".join(f"{n} TTFT mean / p90 s" for n in names)
        + " | ratio of means (theirs / ours) |",
        "|---" * (len(names) + 3) + "|",
    ]
    cases = [f"C={n}" for n in result["clients"]] + ["shared8"]
    for case in cases:
        for turn in range(len(result[names[0]][case]["ttft_mean"])):
            cells = [
                f"{result[n][case]['ttft_mean'][turn]:.2f} / {result[n][case]['ttft_p90'][turn]:.2f}" for n in names
            ]
            ratio = result[names[-1]][case]["ttft_mean"][turn] / result[names[0]][case]["ttft_mean"][turn]
            lines.append(f"| {case} | {turn + 1} | " + " | ".join(cells) + f" | {ratio:.2f}x |")
    lines += ["", "| case | " + " | ".join(f"{n} tokens/s" for n in names) + " |", "|---" * (len(names) + 1) + "|"]
    for case in cases:
        lines.append(f"| {case} | " + " | ".join(f"{result[n][case]['tokens_per_s']:.1f}" for n in names) + " |")
    return lines
