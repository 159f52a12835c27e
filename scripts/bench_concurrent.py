"""Concurrent clients: continuous batching against `mlx_lm.server` (its batching on, as by default).

For C in `clients` (1, 4, 8): C clients at once, each with its own system prompt (~`system_words`
words) and its growing history, T turns each (a client sends its next turn when its reply is in).
Then `shared`: 8 clients arriving at once with one shared (cold) system prompt and their own question.
One server at a time is loaded. Reports mean and p90 TTFT per turn and overall completion tokens/s.
Usage: python -m mlx_kvserve.blas_exec .venv/bin/python scripts/bench_concurrent.py [--quick] [--out DIR]
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from pathlib import Path

from bench_common import QUESTIONS, ROOT, system_prompt, write_report
from bench_prefix import Server, stream_chat


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


def ssd_off_server(ours: Server) -> Server:
    """A second instance of our server, on its own port and home, with the SSD tier off."""
    import tempfile

    from bench import chat_ttft, free_port

    config = Path(tempfile.mkdtemp(prefix="kvserve-ssd-off-")) / "config.toml"
    config.write_text("[ssd]\nenabled = false\n")
    port = free_port()
    cmd = [a if a != str(ours.port) else str(port) for a in ours.cmd] + ["--config", str(config)]
    env = dict(ours.env, MLX_KVSERVE_HOME=str(config.parent))
    server = Server(f"{ours.name} (SSD off)", cmd, port, env, ours.ready_path)
    server.wait(server.ready_path)
    chat_ttft(server, [{"role": "user", "content": "warm up"}], 4)  # first-use kernel compilation
    return server


def synthetic_model(shape: str, bits: int, folder: Path) -> Path:
    """A random-weight llama of `shape` (mlx_kvserve.models.synthetic.SHAPES), `bits`-bit weights
    (0: float16), written to `folder` so that both servers load the same model (the GPU run uses
    the Llama-3-8B shape: no download needed)."""
    import mlx.core as mx

    from mlx_kvserve.models.synthetic import llama_config, random_llama, write_model_folder

    overrides = {"quantization": {"group_size": 64, "bits": bits}} if bits else {}
    config = llama_config(shape, **overrides)
    config["max_position_embeddings"] = max(config["max_position_embeddings"], 32768)  # 8k-16k-token prompts
    return write_model_folder(folder, config, random_llama(config, dtype=mx.float16))


def main() -> None:
    from bench import start_servers, stop_servers

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="shorter prompts and replies, 2 turns")
    parser.add_argument("--out", default=str(ROOT / "results" / "concurrent"))
    parser.add_argument("--clients", help="comma-separated client counts (default 1,4,8)")
    parser.add_argument("--words", type=int, help="system prompt words (default 300 quick / 1400)")
    parser.add_argument("--turns", type=int, help="turns per client (default 2 quick / 3)")
    parser.add_argument("--ssd-off-too", action="store_true", help="also run our server with [ssd] enabled = false")
    parser.add_argument("--model", help="model folder for both servers (default: the default model)")
    parser.add_argument("--synthetic", help="a random-weight llama of this shape instead, e.g. llama3-8b (GPU runs)")
    parser.add_argument("--bits", type=int, default=4, help="weight bits of --synthetic (0: float16)")
    args = parser.parse_args()
    turns, max_tokens, words = (2, 16, 300) if args.quick else (3, 32, 1400)
    turns, words = args.turns or turns, args.words or words
    clients = [int(c) for c in args.clients.split(",")] if args.clients else [1, 4, 8]
    model_dir = Path(args.model) if args.model else None
    if args.synthetic:
        import tempfile

        model_dir = synthetic_model(args.synthetic, args.bits, Path(tempfile.mkdtemp(prefix="kvserve-model-")) / "m")
    servers = start_servers(model_dir)
    if args.ssd_off_too:
        servers.insert(1, ssd_off_server(servers[0]))
    try:
        result = scenario_concurrent(servers, clients, turns, max_tokens, words)
    finally:
        stop_servers(servers)
    write_report(result, Path(args.out), report_lines(result, [s.name for s in servers]))


if __name__ == "__main__":
    main()
