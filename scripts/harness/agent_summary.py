"""bench_agent.py's parameters and the arithmetic of its report: the cold reference a turn is compared
with, the ratios per turn and over the run, the targets, the markdown (checked by the tests without servers)."""

from __future__ import annotations

from typing import NamedTuple

from harness import OURS, THEIRS

TARGET_COLD, TARGET_THEIRS = 5.0, 2.0


class Params(NamedTuple):
    instruction_words: int  # agent instructions; with 20 schemas the system turn is ~6k SmolLM2 tokens
    num_tools: int
    turns: int
    restart_after: int  # the restart conversation restarts both servers after this many turns
    max_tokens: int  # per reply


FULL = Params(instruction_words=2900, num_tools=20, turns=10, restart_after=5, max_tokens=16)


QUICK = Params(instruction_words=500, num_tools=6, turns=4, restart_after=2, max_tokens=8)


def cold_reference(points: list[tuple[int, float]], tokens: int) -> float:
    """Cold TTFT at `tokens` prompt tokens: the line through two measured (tokens, seconds) points
    (through the origin when both have one length)."""
    (a, ta), (b, tb) = points
    if a == b:
        return ta * tokens / a
    return ta + (tb - ta) * (tokens - a) / (b - a)


def summarize(turns: list[dict], full_cold: tuple[int, float]) -> dict:
    """Per turn: our TTFT, mlx_lm.server's, the cold reference (turn 1: itself) and the two ratios;
    over turns 2..N: the ratios of the TTFT sums; whether each target is met per turn and over the run."""
    first = turns[0][OURS]
    points = [(first["prompt_tokens"], first["ttft_s"]), full_cold]
    rows = []
    for i, row in enumerate(turns):
        ours, theirs = row[OURS], row[THEIRS]
        cold = first["ttft_s"] if i == 0 else cold_reference(points, ours["prompt_tokens"])
        rows.append(
            {
                "turn": i + 1,
                "prompt_tokens": ours["prompt_tokens"],
                "same_prompt": ours["prompt_tokens"] == theirs["prompt_tokens"],
                "cached": {OURS: ours["cached_tokens"], THEIRS: theirs["cached_tokens"]},
                "ttft_s": {OURS: ours["ttft_s"], THEIRS: theirs["ttft_s"]},
                "cold_s": cold,
                "vs_cold": cold / ours["ttft_s"],
                "vs_theirs": theirs["ttft_s"] / ours["ttft_s"],
            }
        )
    later = rows[1:]
    ours_sum = sum(r["ttft_s"][OURS] for r in later)
    run = {
        "vs_cold": sum(r["cold_s"] for r in later) / ours_sum,
        "vs_theirs": sum(r["ttft_s"][THEIRS] for r in later) / ours_sum,
    }
    met = {
        "per_turn_cold": all(r["vs_cold"] >= TARGET_COLD for r in later),
        "per_turn_theirs": all(r["vs_theirs"] >= TARGET_THEIRS for r in later),
        "run_cold": run["vs_cold"] >= TARGET_COLD,
        "run_theirs": run["vs_theirs"] >= TARGET_THEIRS,
    }
    return {"rows": rows, "run": run, "met": met}


def _yes(ok: bool) -> str:
    return "met" if ok else "**missed**"


def report_lines(results: dict) -> list[str]:
    """The markdown report: one table per conversation, then its ratios against the targets."""
    p = Params(**results["params"])
    lines = [
        f"System turn {results['system_tokens']} tokens ({p.num_tools} tool schemas), {p.turns} turns, "
        f"{p.max_tokens} tokens per reply, greedy. TTFT in seconds; cold = our cold TTFT at the turn's prompt "
        f"length, interpolated between turn 1 and a cold {results['full_cold'][0]}-token request "
        f"({results['full_cold'][1]:.2f} s). Wall time {results['wall_s'] / 60:.1f} min.",
    ]
    for name, conv in results["conversations"].items():
        s = summarize(conv["turns"], tuple(results["full_cold"]))
        lines += [
            "",
            f"**{name}**",
            "",
            "| turn | prompt tokens | cached ours / theirs | mlx-kvserve | mlx_lm.server | cold | cold / ours "
            "| theirs / ours |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for r in s["rows"]:
            cached = " / ".join("-" if r["cached"][n] is None else str(r["cached"][n]) for n in (OURS, THEIRS))
            same = "" if r["same_prompt"] else " (prompts differ)"
            lines.append(
                f"| {r['turn']} | {r['prompt_tokens']}{same} | {cached} | {r['ttft_s'][OURS]:.2f} | "
                f"{r['ttft_s'][THEIRS]:.2f} | {r['cold_s']:.2f} | {r['vs_cold']:.1f}x | {r['vs_theirs']:.2f}x |"
            )
        later = s["rows"][1:]
        m, run = s["met"], s["run"]
        lines += [
            "",
            f"Turns 2-{p.turns}: cold / ours {min(r['vs_cold'] for r in later):.1f}x at least "
            f"(>= {TARGET_COLD:.0f}x per turn: {_yes(m['per_turn_cold'])}), {run['vs_cold']:.1f}x over the run "
            f"({_yes(m['run_cold'])}); theirs / ours {min(r['vs_theirs'] for r in later):.2f}x at least "
            f"(>= {TARGET_THEIRS:.0f}x per turn: {_yes(m['per_turn_theirs'])}), {run['vs_theirs']:.2f}x over the "
            f"run ({_yes(m['run_theirs'])}).",
        ]
    firsts = {
        r[n]["first"] for conv in results["conversations"].values() for r in conv["turns"] for n in (OURS, THEIRS)
    }
    if firsts != {"content"}:
        lines += ["", f"First deltas carried: {sorted(firsts)} (not only text)."]
    return lines
