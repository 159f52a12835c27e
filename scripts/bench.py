"""The whole benchmark suite in one command: mlx-kvserve vs mlx_lm.server (and plain mlx-lm), one run.

Starts our server and `mlx_lm.server` on the same model on free loopback ports (both with the same
BLAS: OpenBLAS preloaded where installed), alternates requests between them (only one is busy at a
time) and writes results.json and report.md (tables, targets, machine and versions) to a results
folder (default results/<UTC timestamp>/).

Scenarios (--scenarios, comma-separated; default all):
  system        ~1.2k-token system prompt: cold, exact repeat, new question (--system-words N,M: several
                sizes on the same servers)
  restart       first request after a restart: ours from the SSD, theirs cold
  conversation  TTFT per turn of a 16-turn conversation (--quick: 4 turns)
  interleaved   14 conversations round-robin, more than mlx_lm.server's 10 caches (--conversations N)
  pins          flood + pin at depths 0, 4, 8, 16 (--quick: 16 only); servers of its own
  decode        decode tokens/s, our engine vs mlx-lm stream_generate, in-process
  ssd           write-through cost: hit TTFT and decode tok/s, SSD off / on / unheld, in-process
  concurrent    C = 1, 4, 8 clients x T turns at once, own system prompts; 8 clients on one shared
                system prompt: TTFT mean / p90 per turn, tokens/s (--clients, --rounds R: servers in
                alternating order each round, ratios per round and their median)
--quick: one rep and fewer turns/conversations/depths/tokens; under 10 minutes on a 2-core CPU.
Peers: --vllm-mlx PATH adds vllm-mlx (prefix cache on); --variants a,b adds our server configured as
harness/variants.py's VARIANTS (e.g. ssd-off, fifo) to the server scenarios.

Usage: python -m mlx_kvserve.cpu.blas_exec .venv/bin/python scripts/bench.py [--quick] [--scenarios a,b] [--out DIR]
"""

from __future__ import annotations

import argparse
import datetime
import json
import time
from pathlib import Path

from harness import OURS, ROOT, THEIRS, default_model_dir
from harness.reports import machine

# The measurements are harness.scenarios': the server ones run on one set of servers, started once.
from harness.scenarios import concurrent, concurrent_rounds, interleaved, pins
from harness.scenarios.prefix import (
    decode_speed,
    scenario_conversation,
    scenario_restart,
    scenario_system_prompt,
    ssd_write_cost,
)
from harness.scenarios.prefix import report_lines as prefix_report_lines
from harness.servers import server_env, start_servers, stop_servers
from harness.variants import VARIANTS, variant_server

from mlx_kvserve.cpu.blas import blas_in_use, mapped_blas

SCENARIOS = ["system", "restart", "conversation", "interleaved", "pins", "decode", "ssd", "concurrent"]
SERVER_SCENARIOS = {"system", "restart", "conversation", "interleaved", "concurrent"}

PARAMS = {
    "full": {
        "reps": 3,
        "conversation_turns": 16,
        "interleaved_conversations": 14,
        "interleaved_turns": 3,
        "interleaved_max_tokens": 12,
        "pin_depths": [0, 4, 8, 16],
        "pin_rules": 16,
        "pin_flood": 12,
        "decode_tokens": 128,
        "concurrent": {"clients": [1, 4, 8], "turns": 3, "max_tokens": 32, "system_words": 1400},
    },
    "quick": {
        "reps": 1,
        "conversation_turns": 4,
        "interleaved_conversations": 12,
        "interleaved_turns": 3,
        "interleaved_max_tokens": 4,
        "pin_depths": [16],
        "pin_rules": 12,
        "pin_flood": 12,
        "decode_tokens": 64,
        "concurrent": {"clients": [1, 4, 8], "turns": 2, "max_tokens": 16, "system_words": 300},
    },
}


# -- servers -------------------------------------------------------------------------------------


def process_blas(pid: int) -> str:
    """The BLAS another process has mapped (reads /proc/<pid>/maps, Linux)."""
    return mapped_blas(pid)


# -- machine and versions ------------------------------------------------------------------------


def machine_info(model_dir: Path) -> dict:
    return machine() | {
        "blas_bench_process": blas_in_use(),
        "blas_servers_preload": server_env().get("LD_PRELOAD", ""),
        "model": model_dir.name,
        "model_dir": str(model_dir),
    }


# -- the suite -----------------------------------------------------------------------------------


def run_suite(wanted: list[str], params: dict, out: Path, model_dir: Path, args: argparse.Namespace) -> dict:
    results: dict = {
        "meta": {
            "started_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "scenarios": wanted,
            "params": params,
            "machine": machine_info(model_dir),
            "timings_s": {},
        }
    }
    timings = results["meta"]["timings_s"]
    suite_start = time.perf_counter()

    def save() -> None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "results.json").write_text(json.dumps(results, indent=2))

    def timed(name: str, fn, *args):
        print(f"\n== {name}", flush=True)
        start = time.perf_counter()
        value = fn(*args)
        timings[name] = round(time.perf_counter() - start, 1)
        print(f"== {name}: {timings[name]} s", flush=True)
        return value

    reps = params["reps"]
    if SERVER_SCENARIOS & set(wanted):
        start = time.perf_counter()
        servers = start_servers(model_dir, args.vllm_mlx)
        for i, name in enumerate(v for v in args.variants.split(",") if v):
            servers.insert(1 + i, variant_server(servers[0], name))
        timings["server_start"] = round(time.perf_counter() - start, 1)
        results["meta"]["servers"] = [s.name for s in servers]  # the reports' column order, ours first
        results["meta"]["machine"]["blas_servers"] = {s.name: process_blas(s.proc.pid) for s in servers}
        try:
            sizes = [int(w) for w in args.system_words.split(",")]
            for words in sizes if "system" in wanted else []:  # several sizes: servers started once (a GPU run)
                key = "system_prompt" if len(sizes) == 1 else f"system_prompt_{words}w"
                results[key] = timed(f"system {words} words", scenario_system_prompt, servers, reps, words)
                save()
            if "conversation" in wanted:
                turns = params["conversation_turns"]
                results["conversation"] = timed("conversation", scenario_conversation, servers, turns)
                save()
            if "interleaved" in wanted:
                case = [params[f"interleaved_{k}"] for k in ("conversations", "turns", "max_tokens")]
                results["interleaved"] = timed("interleaved", interleaved.scenario_interleaved, servers, *case)
                save()
            if "concurrent" in wanted:
                case = [*params["concurrent"].values(), *([args.rounds] if args.rounds > 1 else [])]
                measure = concurrent_rounds.scenario_rounds if args.rounds > 1 else concurrent.scenario_concurrent
                results["concurrent"] = timed("concurrent", measure, servers, *case)
                results["concurrent"]["commands"] = {s.name: " ".join(s.cmd) for s in servers}
                save()
            if "restart" in wanted:  # last: it restarts both servers
                results["restart"] = timed("restart", scenario_restart, servers, reps)
                save()
        finally:
            stop_servers(servers)
    if "pins" in wanted:
        case = [params[f"pin_{k}"] for k in ("depths", "rules", "flood")]
        results["pins"] = timed("pins", pins.run_pins, model_dir, server_env(), *case)
        save()
    if "decode" in wanted:
        results["decode"] = timed("decode", decode_speed, model_dir, reps, params["decode_tokens"])
        save()
    if "ssd" in wanted:
        results["ssd_write_cost"] = timed("ssd", ssd_write_cost, model_dir, reps, params["decode_tokens"])
        save()
    timings["total"] = round(time.perf_counter() - suite_start, 1)
    save()
    return results


# -- targets, report ------------------------------------------------------------------------------


def targets(results: dict) -> list[tuple[str, str, bool]]:
    """(target, figure measured, met) for each issue-7 target whose scenario ran."""
    rows = []
    if "system_prompt" in results:
        a, b = results["system_prompt"][OURS], results["system_prompt"][THEIRS]
        for key, label in (("repeat", "Repeat"), ("new_question", "New-question")):
            figure = f"{a[key]:.3f} s vs {b[key]:.3f} s ({b[key] / a[key]:.2f}x)"
            rows.append((f"{label} TTFT no worse than mlx_lm.server", figure, a[key] <= b[key]))
    if "restart" in results:
        r = results["restart"][OURS]
        frac = r["cold"] / r["after_restart"]
        figure = f"{r['after_restart']:.3f} s vs cold {r['cold']:.3f} s (1/{frac:.1f})"
        rows.append(("First request after restart under 1/10 of cold", figure, frac >= 10))
    if "pins" in results:
        pins = results["pins"]
        depth = 16 if 16 in pins["depths"] else max(pins["depths"])
        p, u = pins["pinned"][depth]["ttft_s"], pins["unpinned"][depth]["ttft_s"]
        target = f"Pinned depth-{depth} turn under a flood at least 8x faster than unpinned"
        rows.append((target, f"{p:.3f} s vs {u:.3f} s ({u / p:.1f}x)", u / p >= 8))
    if "decode" in results:
        d = results["decode"]
        figure = f"{d['ours_tps']:.1f} vs {d['mlx_lm_tps']:.1f} tok/s ({d['ratio']:.3f})"
        rows.append(("Decode within 5% of plain mlx-lm", figure, d["ratio"] >= 0.95))
    if "ssd_write_cost" in results:
        w = results["ssd_write_cost"]
        figure = f"{w['decode_tps_ssd_on']:.1f} vs {w['decode_tps_ssd_off']:.1f} tok/s ({w['ratio']:.3f})"
        rows.append(("Decode with SSD write-through at least 95% of SSD off", figure, w["ratio"] >= 0.95))
        on, off, unheld = w["hit_ttft_ssd_on"], w["hit_ttft_ssd_off"], w["hit_ttft_ssd_on_no_hold"]
        target = "Cache hit while the writer is busy: TTFT within 10% of SSD off"
        rows.append((target, f"{on:.3f} vs {off:.3f} s (never held: {unheld:.3f} s)", on <= 1.1 * off))
    return rows


def report_markdown(results: dict) -> str:
    meta, m = results["meta"], results["meta"]["machine"]
    quick = " (--quick)" if meta["params"] == PARAMS["quick"] else ""
    lines = [
        f"# mlx-kvserve benchmark{quick}, {meta['started_utc']}",
        "",
        f"Machine: {m['platform']}, {m['cpu']}, {m['cpu_count']} CPUs, {m['memory_gib']} GiB. "
        f"Python {m['python']}, mlx {m['mlx']}, mlx-lm {m['mlx_lm']}, mlx-kvserve {m['mlx_kvserve']}. "
        f"Model: {m['model']}.",
        f"BLAS: this process {m['blas_bench_process']}; servers "
        + (
            ", ".join(f"{k} {v}" for k, v in m.get("blas_servers", {}).items())
            or f"preload {m['blas_servers_preload']!r}"
        )
        + ".",
        "Scenario wall times (s): " + ", ".join(f"{k} {v}" for k, v in meta["timings_s"].items()) + ".",
        "",
    ]
    rt = targets(results)
    if rt:
        lines += ["## Targets", "", "| target | measured | met |", "|---|---|---|"]
        lines += [f"| {t} | {fig} | {'yes' if ok else '**no**'} |" for t, fig, ok in rt]
        lines.append("")
    prefix_keys = ("system_prompt", "restart", "conversation", "decode", "ssd_write_cost")
    prefix = {k: results[k] for k in prefix_keys if k in results}
    if prefix:
        lines += ["## System prompt, restart, conversation, decode", "", *prefix_report_lines(prefix), ""]
    for key in [k for k in results if k.startswith("system_prompt_")]:
        lines += [f"## System prompt of {key.split('_')[-1][:-1]} words", ""]
        lines += [*prefix_report_lines({"system_prompt": results[key]}), ""]
    names = meta.get("servers", [OURS, THEIRS])
    if "interleaved" in results:
        lines += ["## Many interleaved conversations", ""]
        lines += interleaved.report_lines(results["interleaved"], names) + [""]
    if "concurrent" in results:
        lines += ["## Concurrent clients (continuous batching)", ""]
        rounds = meta["params"].get("rounds", 1) > 1
        report = concurrent_rounds.rounds_report_lines if rounds else concurrent.report_lines
        lines += report(results["concurrent"], names) + [""]
    if "pins" in results:
        p = results["pins"]
        title = f"## Flood + pin ({p['flood_conversations']} flood conversations, {p['rules']} rules)"
        lines += [title, "", *pins.report_lines(p), ""]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer reps/turns/depths: under 10 minutes on 2 cores")
    parser.add_argument(
        "--scenarios", default=",".join(SCENARIOS), help="comma-separated subset of: " + ", ".join(SCENARIOS)
    )
    parser.add_argument("--out", help="results folder (default results/<UTC timestamp>/)")
    parser.add_argument("--model", help="model folder (default: the default model, fetched if needed)")
    parser.add_argument("--reps", type=int, help="repeats of system, restart, decode, ssd (default 1 quick / 3)")
    parser.add_argument(
        "--system-words", default="880", help="system prompt words, comma-separated (880: ~1.2k tokens)"
    )
    parser.add_argument("--conversations", type=int, help="interleaved conversations (default 12 quick / 14)")
    parser.add_argument("--clients", help="concurrent client counts, comma-separated (default 1,4,8)")
    parser.add_argument("--turns", type=int, help="turns per concurrent client (default 2 quick / 3)")
    parser.add_argument("--words", type=int, help="each concurrent client's system prompt words (300 quick / 1400)")
    parser.add_argument("--rounds", type=int, default=1, help="concurrent rounds, servers alternating (default 1)")
    parser.add_argument("--variants", default="", help=f"our server configured as these too: {', '.join(VARIANTS)}")
    parser.add_argument("--vllm-mlx", help="the vllm-mlx executable of a scratch venv (left out: not run)")
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    wanted = [s.strip() for s in args.scenarios.split(",") if s.strip()]
    unknown = [s for s in wanted if s not in SCENARIOS]
    if unknown:
        parser.error(f"unknown scenario(s) {unknown}; choose from {SCENARIOS}")
    wanted = [s for s in SCENARIOS if s in wanted]
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    out = Path(args.out) if args.out else ROOT / "results" / stamp
    out.mkdir(parents=True, exist_ok=True)
    model_dir = Path(args.model) if args.model else default_model_dir()
    params = json.loads(json.dumps(PARAMS["quick" if args.quick else "full"]))  # a copy the flags may change
    conc = params["concurrent"]
    params["reps"] = args.reps or params["reps"]
    params["interleaved_conversations"] = args.conversations or params["interleaved_conversations"]
    conc["clients"] = [int(c) for c in args.clients.split(",")] if args.clients else conc["clients"]
    conc["turns"], conc["system_words"] = args.turns or conc["turns"], args.words or conc["system_words"]
    if args.rounds > 1:
        params["rounds"] = args.rounds
    print(f"scenarios {wanted}, params {params}, results -> {out}", flush=True)
    results = run_suite(wanted, params, out, model_dir, args)
    report = report_markdown(results)
    (out / "report.md").write_text(report)
    print("\n" + report)
    print(f"results: {out}")


if __name__ == "__main__":
    main()
