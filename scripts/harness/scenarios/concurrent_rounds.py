"""bench.py --scenarios concurrent --rounds R: every case of the concurrent scenario measured R times, the servers in
alternating order (round 1 as given, round 2 reversed, round 3 as given ...), so that a load change on a
shared machine falls on every server instead of on the one measured at that moment. The report takes
ours / peer per round, then the median (min, max) over rounds, and reads issue 26's targets off the
medians."""

from __future__ import annotations

import statistics
from typing import NamedTuple

from harness import THEIRS, VLLM
from harness.scenarios.concurrent import MEASURES, case_ratio, case_systems, ratio_cell, run_case, summary, target_lines
from harness.servers import Server


def round_order(servers: list[Server], r: int) -> list[Server]:
    """Round r's order (r from 0): as given on even rounds, reversed on odd ones."""
    return servers if r % 2 == 0 else servers[::-1]


def scenario_rounds(
    servers: list[Server], clients: list[int], turns: int, max_tokens: int, system_words: int, rounds: int
) -> dict:
    """Per case (C=<n> for n in `clients`, then shared8), `rounds` rounds, each server once a round in
    round_order. Round r's prompts carry the salt "round<r>-" (case_systems), so no round reuses a cache
    that an earlier one filled, on any server. A failed run is {"error": why} and the rounds go on.
    {clients, turns, max_tokens, system_words, "rounds": [{"order": {case: [names]}, name: {case: run}}]}:
    each round's entry has scenario_concurrent's shape, plus the order it ran in."""
    out: dict = {"clients": clients, "turns": turns, "max_tokens": max_tokens, "system_words": system_words}
    out["rounds"] = [{"order": {}} for _ in range(rounds)]
    for case, case_turns in [(f"C={n}", turns) for n in clients] + [("shared8", 1)]:
        for r, runs in enumerate(out["rounds"]):
            order = round_order(servers, r)
            runs["order"][case] = [s.name for s in order]
            for server in order:
                systems = case_systems(server.name, case, system_words, salt=f"round{r + 1}-")
                run = run_case(server, f"{case} round {r + 1}", systems, case_turns, max_tokens)
                runs.setdefault(server.name, {})[case] = run
    return out


# -- report ------------------------------------------------------------------------------------------


class Spread(NamedTuple):
    """One measure's ratios ours / peer in one case: per round (None where either run failed or has no
    such figure), and the median, min and max of those present (None where no round has one)."""

    per_round: list[float | None]
    median: float | None
    low: float | None
    high: float | None


def spread(result: dict, ours: str, peer: str, case: str, measure: str) -> Spread:
    per_round = [case_ratio(runs, ours, peer, case, measure) for runs in result["rounds"]]
    present = [r for r in per_round if r is not None]
    if not present:
        return Spread(per_round, None, None, None)
    return Spread(per_round, statistics.median(present), min(present), max(present))


def figure_cells(run: dict) -> list[str]:
    """First turn mean TTFT, later turns mean TTFT, tokens/s of one run."""
    s = summary(run)
    if s is None:
        return ["failed", "", ""]
    later = "-" if s["later"] is None else f"{s['later']:.2f}"
    return [f"{s['first']:.2f}", later, f"{s['tokens_per_s']:.1f}"]


def rounds_report_lines(result: dict, names: list[str]) -> list[str]:
    """The report of scenario_rounds: per case, round and server (in the order measured) the first turn's
    and the later turns' mean TTFT and tokens/s; ratios ours (names[0]) / each peer present per round
    with their median and range; issue 26's targets on the median ratios; the runs that failed."""
    ours, peers = names[0], [n for n in (THEIRS, VLLM) if n in names[1:]]
    rounds = result["rounds"]
    cases = [f"C={n}" for n in result["clients"]] + ["shared8"]
    lines = [
        f"Concurrent clients: own ~{result['system_words']}-word system prompts, {result['turns']} turns, "
        f"{result['max_tokens']} tokens per reply; `shared8`: 8 clients at once on one cold system prompt. "
        f"{len(rounds)} rounds per case, the servers in alternating order (round 1 as listed, round 2 reversed, "
        "...), each round on new system prompts (no round hits another's cache). Ratios are ours / peer per "
        "round, then their median and range over rounds (below 1: ours faster, for tokens/s above 1).",
        "",
        "| case | round | order | server | first turn mean TTFT s | later turns mean TTFT s | tokens/s |",
        "|---|---|---|---|---|---|---|",
    ]
    for case in cases:
        for r, runs in enumerate(rounds):
            for i, name in enumerate(runs["order"][case]):
                cells = [case, str(r + 1), str(i + 1), name, *figure_cells(runs[name][case])]
                lines.append("| " + " | ".join(cells) + " |")
    lines += [
        "",
        "| case | measure | ratio | "
        + " | ".join(f"round {r + 1}" for r in range(len(rounds)))
        + " | median | min - max |",
        "|---|---|---" + "|---" * len(rounds) + "|---|---|",
    ]
    for case in cases:
        for measure, label in MEASURES.items():
            if case == "shared8" and measure == "later":
                continue  # one turn
            for peer in peers:
                s = spread(result, ours, peer, case, measure)
                span = "-" if s.low is None else f"{s.low:.2f}x - {s.high:.2f}x"
                cells = [ratio_cell(r) for r in s.per_round] + [ratio_cell(s.median), span]
                lines.append(f"| {case} | {label} | ours / {peer} | " + " | ".join(cells) + " |")
    lines += target_lines(
        result["clients"],
        peers,
        lambda measure, peer, n: spread(result, ours, peer, f"C={n}", measure).median,
        basis=f", on the median ratio over {len(rounds)} rounds",
    )
    for r, runs in enumerate(rounds):
        for name in names:
            for case in cases:
                if "error" in runs[name][case]:
                    lines.append(f"- {name} {case} round {r + 1} failed: {runs[name][case]['error']}")
    return lines
