"""The whole benchmark suite in one command: mlx-kvserve vs mlx_lm.server (and plain mlx-lm), one run.

Starts our server and `mlx_lm.server` on the same model on free loopback ports (both with the same
BLAS: OpenBLAS preloaded where installed), alternates requests between them (only one is busy at a
time) and writes results.json, report.md (tables, targets, machine and versions) and PNG charts to
a results folder (default results/<UTC timestamp>/).

Scenarios (--scenarios, comma-separated; default all):
  system        ~1.2k-token system prompt: cold, exact repeat, new question          (bench_prefix.py)
  restart       first request after a restart: ours from the SSD, theirs cold        (bench_prefix.py)
  conversation  TTFT per turn of a 16-turn conversation (--quick: 4 turns)           (bench_prefix.py)
  interleaved   14 conversations round-robin, more than mlx_lm.server's 10 caches    (bench_interleaved.py)
  pins          flood + pin at depths 0, 4, 8, 16 (--quick: 16 only)                (bench_pins.py)
  decode        decode tokens/s, our engine vs mlx-lm stream_generate, in-process    (bench_prefix.py)
  ssd           write-through cost: hit TTFT and decode tok/s, SSD off / on / unheld  (bench_prefix.py)
  concurrent    C = 1, 4, 8 clients x T turns at once, own system prompts; 8 clients on one shared
                system prompt: TTFT mean / p90 per turn, tokens/s             (bench_concurrent.py)
--quick: one rep and fewer turns/conversations/depths/tokens; under 10 minutes on a 2-core CPU.

Usage: python -m mlx_kvserve.cpu.blas_exec .venv/bin/python scripts/bench.py [--quick] [--scenarios a,b] [--out DIR]
Charts need matplotlib: pip install -e '.[bench]'.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import os
import platform
import sys
import time
from pathlib import Path

from harness import OURS, ROOT, THEIRS, default_model_dir

# The measurements are harness.scenarios', shared with bench_prefix/interleaved/concurrent/pins.py: here they
# all run on one pair of servers (running those scripts as subprocesses would start a pair for each).
from harness.scenarios import concurrent, interleaved, pins
from harness.scenarios.prefix import (
    decode_speed,
    scenario_conversation,
    scenario_restart,
    scenario_system_prompt,
    ssd_write_cost,
)
from harness.scenarios.prefix import report_lines as prefix_report_lines
from harness.servers import server_env, start_servers, stop_servers

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


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def machine_info(model_dir: Path) -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        mem = None
    return {
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "memory_gib": round(mem / 2**30, 1) if mem else None,
        "python": platform.python_version(),
        "mlx": _version("mlx"),
        "mlx_cpu": _version("mlx-cpu"),
        "mlx_lm": _version("mlx-lm"),
        "mlx_kvserve": _version("mlx-kvserve"),
        "blas_bench_process": blas_in_use(),
        "blas_servers_preload": server_env().get("LD_PRELOAD", ""),
        "model": model_dir.name,
        "model_dir": str(model_dir),
    }


# -- the suite -----------------------------------------------------------------------------------


def run_suite(wanted: list[str], params: dict, out: Path, model_dir: Path) -> dict:
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
        servers = start_servers(model_dir)
        timings["server_start"] = round(time.perf_counter() - start, 1)
        results["meta"]["machine"]["blas_servers"] = {s.name: process_blas(s.proc.pid) for s in servers}
        try:
            if "system" in wanted:
                results["system_prompt"] = timed("system", scenario_system_prompt, servers, reps)
                save()
            if "conversation" in wanted:
                results["conversation"] = timed(
                    "conversation", scenario_conversation, servers, params["conversation_turns"]
                )
                save()
            if "interleaved" in wanted:
                results["interleaved"] = timed(
                    "interleaved",
                    interleaved.scenario_interleaved,
                    servers,
                    params["interleaved_conversations"],
                    params["interleaved_turns"],
                    params["interleaved_max_tokens"],
                )
                save()
            if "concurrent" in wanted:
                results["concurrent"] = timed(
                    "concurrent", concurrent.scenario_concurrent, servers, *params["concurrent"].values()
                )
                save()
            if "restart" in wanted:  # last: it restarts both servers
                results["restart"] = timed("restart", scenario_restart, servers, reps)
                save()
        finally:
            stop_servers(servers)
    if "pins" in wanted:
        results["pins"] = timed(
            "pins",
            pins.run_pins,
            model_dir,
            server_env(),
            params["pin_depths"],
            params["pin_rules"],
            params["pin_flood"],
        )
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


# -- targets, report, charts ---------------------------------------------------------------------


def targets(results: dict) -> list[tuple[str, str, bool]]:
    """(target, figure measured, met) for each issue-7 target whose scenario ran."""
    rows = []
    if "system_prompt" in results:
        a, b = results["system_prompt"][OURS], results["system_prompt"][THEIRS]
        for key, label in (("repeat", "Repeat"), ("new_question", "New-question")):
            rows.append(
                (
                    f"{label} TTFT no worse than mlx_lm.server",
                    f"{a[key]:.3f} s vs {b[key]:.3f} s ({b[key] / a[key]:.2f}x)",
                    a[key] <= b[key],
                )
            )
    if "restart" in results:
        r = results["restart"][OURS]
        frac = r["cold"] / r["after_restart"]
        rows.append(
            (
                "First request after restart under 1/10 of cold",
                f"{r['after_restart']:.3f} s vs cold {r['cold']:.3f} s (1/{frac:.1f})",
                frac >= 10,
            )
        )
    if "pins" in results:
        pins = results["pins"]
        depth = 16 if 16 in pins["depths"] else max(pins["depths"])
        p, u = pins["pinned"][depth]["ttft_s"], pins["unpinned"][depth]["ttft_s"]
        rows.append(
            (
                f"Pinned depth-{depth} turn under a flood at least 8x faster than unpinned",
                f"{p:.3f} s vs {u:.3f} s ({u / p:.1f}x)",
                u / p >= 8,
            )
        )
    if "decode" in results:
        d = results["decode"]
        rows.append(
            (
                "Decode within 5% of plain mlx-lm",
                f"{d['ours_tps']:.1f} vs {d['mlx_lm_tps']:.1f} tok/s ({d['ratio']:.3f})",
                d["ratio"] >= 0.95,
            )
        )
    if "ssd_write_cost" in results:
        w = results["ssd_write_cost"]
        rows.append(
            (
                "Decode with SSD write-through at least 95% of SSD off",
                f"{w['decode_tps_ssd_on']:.1f} vs {w['decode_tps_ssd_off']:.1f} tok/s ({w['ratio']:.3f})",
                w["ratio"] >= 0.95,
            )
        )
        rows.append(
            (
                "Cache hit while the writer is busy: TTFT within 10% of SSD off",
                f"{w['hit_ttft_ssd_on']:.3f} vs {w['hit_ttft_ssd_off']:.3f} s "
                f"(never held: {w['hit_ttft_ssd_on_no_hold']:.3f} s)",
                w["hit_ttft_ssd_on"] <= 1.1 * w["hit_ttft_ssd_off"],
            )
        )
    return rows


def report_markdown(results: dict, charts: list[str]) -> str:
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
    if "interleaved" in results:
        lines += ["## Many interleaved conversations", ""]
        lines += interleaved.report_lines(results["interleaved"], [OURS, THEIRS]) + [""]
    if "concurrent" in results:
        lines += ["## Concurrent clients (continuous batching)", ""]
        lines += concurrent.report_lines(results["concurrent"], [OURS, THEIRS]) + [""]
    if "pins" in results:
        p = results["pins"]
        lines += [
            f"## Flood + pin ({p['flood_conversations']} flood conversations, {p['rules']} rules)",
            "",
            *pins.report_lines(p),
            "",
        ]
    if charts:
        lines += ["## Charts", ""] + [f"![{c}]({c})" for c in charts] + [""]
    return "\n".join(lines)


def _label_bars(ax, bars, fmt: str = "{:.2f}") -> None:
    for bar in bars:
        h = bar.get_height()
        ax.annotate(
            fmt.format(h),
            (bar.get_x() + bar.get_width() / 2, h),
            ha="center",
            va="bottom",
            fontsize=7,
            xytext=(0, 1),
            textcoords="offset points",
        )


def _grouped(ax, groups: list[str], series: dict[str, list[float]], log: bool = False, fmt: str = "{:.2f}") -> None:
    n = len(series)
    width = 0.8 / n
    for i, (name, values) in enumerate(series.items()):
        xs = [g + (i - (n - 1) / 2) * width for g in range(len(groups))]
        _label_bars(ax, ax.bar(xs, values, width, label=name), fmt)
    ax.set_xticks(range(len(groups)), groups)
    if log:
        ax.set_yscale("log")
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)


def make_charts(results: dict, out: Path) -> list[str]:
    """PNG charts for the scenarios that ran; [] (with a note) when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import matplotlib.ticker
    except ImportError:
        print("matplotlib not installed: no charts (pip install -e '.[bench]')", file=sys.stderr)
        return []
    names = []

    def save(fig, name: str, title: str, ax) -> None:
        ax.set_title(title, fontsize=10)
        fig.tight_layout()
        fig.savefig(out / name, dpi=110)
        plt.close(fig)
        names.append(name)

    if "system_prompt" in results:
        sp = results["system_prompt"]
        keys = ["cold", "repeat", "new_question"]
        fig, ax = plt.subplots(figsize=(6.4, 4))
        _grouped(ax, ["cold", "repeat", "new question"], {n: [sp[n][k] for k in keys] for n in (OURS, THEIRS)}, True)
        ax.set_ylabel("TTFT s (log scale)")
        save(fig, "system_prompt.png", "~1.2k-token system prompt: TTFT", ax)
    if "restart" in results:
        r = results["restart"]
        fig, ax = plt.subplots(figsize=(6.4, 4))
        _grouped(
            ax,
            ["cold", "first request after restart"],
            {n: [r[n]["cold"], r[n]["after_restart"]] for n in (OURS, THEIRS)},
            True,
        )
        ax.set_ylabel("TTFT s (log scale)")
        save(fig, "restart.png", "Restart: ours from the SSD, theirs cold", ax)
    if "conversation" in results:
        conv = results["conversation"]
        fig, ax = plt.subplots(figsize=(6.4, 4))
        for n in (OURS, THEIRS):
            ax.plot(range(1, len(conv[n]) + 1), conv[n], marker="o", label=n)
        ax.set_yscale("log")
        ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
        ax.set_xlabel("turn")
        ax.set_ylabel("TTFT s (log scale)")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
        save(fig, "conversation.png", "Conversation: TTFT per turn (turn 1 cold)", ax)
    if "interleaved" in results:
        il = results["interleaved"]
        fig, ax = plt.subplots(figsize=(6.4, 4))
        turns = [f"turn {t + 1}" for t in range(il["turns"])]
        _grouped(ax, turns, {n: il[n]["ttft_mean"] for n in (OURS, THEIRS)})
        ax.set_ylabel("mean TTFT s")
        save(fig, "interleaved.png", f"{il['conversations']} interleaved conversations: mean TTFT per turn", ax)
    if "pins" in results:
        p = results["pins"]
        fig, ax = plt.subplots(figsize=(6.4, 4))
        series = {
            "mlx-kvserve pinned": [p["pinned"][d]["ttft_s"] for d in p["depths"]],
            "mlx-kvserve unpinned": [p["unpinned"][d]["ttft_s"] for d in p["depths"]],
            "mlx_lm.server": [p["mlx_lm.server"][d]["ttft_s"] for d in p["depths"]],
        }
        _grouped(ax, [f"depth {d}" for d in p["depths"]], series)
        ax.set_ylabel("TTFT s of the next turn")
        save(fig, "pins.png", f"Flood ({p['flood_conversations']} conversations) + pin: next-turn TTFT", ax)
    if "decode" in results or "ssd_write_cost" in results:
        fig, ax = plt.subplots(figsize=(6.4, 4))
        labels, values = [], []
        if "decode" in results:
            labels += ["ours", "mlx-lm\nstream_generate"]
            values += [results["decode"]["ours_tps"], results["decode"]["mlx_lm_tps"]]
        if "ssd_write_cost" in results:
            labels += ["ours, SSD off", "ours, SSD on"]
            values += [results["ssd_write_cost"]["decode_tps_ssd_off"], results["ssd_write_cost"]["decode_tps_ssd_on"]]
        _label_bars(ax, ax.bar(range(len(values)), values, color=[f"C{i}" for i in range(len(values))]), "{:.1f}")
        ax.set_xticks(range(len(values)), labels, fontsize=8)
        ax.set_ylabel("decode tokens/s")
        ax.grid(axis="y", alpha=0.3)
        save(fig, "decode.png", "Decode speed", ax)
    return names


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer reps/turns/depths: under 10 minutes on 2 cores")
    parser.add_argument(
        "--scenarios", default=",".join(SCENARIOS), help="comma-separated subset of: " + ", ".join(SCENARIOS)
    )
    parser.add_argument("--out", help="results folder (default results/<UTC timestamp>/)")
    parser.add_argument("--model", help="model folder (default: the default model, fetched if needed)")
    args = parser.parse_args()
    wanted = [s.strip() for s in args.scenarios.split(",") if s.strip()]
    unknown = [s for s in wanted if s not in SCENARIOS]
    if unknown:
        parser.error(f"unknown scenario(s) {unknown}; choose from {SCENARIOS}")
    wanted = [s for s in SCENARIOS if s in wanted]
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    out = Path(args.out) if args.out else ROOT / "results" / stamp
    out.mkdir(parents=True, exist_ok=True)
    model_dir = Path(args.model) if args.model else default_model_dir()
    params = PARAMS["quick" if args.quick else "full"]
    print(f"scenarios {wanted}, params {params}, results -> {out}", flush=True)
    results = run_suite(wanted, params, out, model_dir)
    charts = make_charts(results, out)
    report = report_markdown(results, charts)
    (out / "report.md").write_text(report)
    print("\n" + report)
    print(f"results: {out}")


if __name__ == "__main__":
    main()
