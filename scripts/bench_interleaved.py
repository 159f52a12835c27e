"""Many interleaved conversations: more of them than `mlx_lm.server` keeps prompt caches for (10).

`conversations` chats, each with its own short system prompt, advance round-robin: turn 1 of every
conversation, then turn 2 of every conversation, and so on. Each request goes to both servers in turn
(only one is busy at a time). With more conversations than its 10 cache entries, `mlx_lm.server`'s LRU
has dropped a conversation by the time it comes round again; our block cache keeps them all.
Reports mean TTFT (and mean cached tokens) per turn index for each server.
Usage: python -m mlx_kvserve.blas_exec .venv/bin/python scripts/bench_interleaved.py [--quick] [--out DIR]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from bench_common import QUESTIONS, ROOT, TOPICS, write_report
from bench_prefix import Server, chat_ttft


def short_system(tag: str, topic: str, rules: int = 6) -> str:
    """A short (~150-token) system prompt, unique per `tag`."""
    lines = [f"Conversation {tag}.", f"You are a tutor who specialises in {topic}."]
    lines += [
        f"Rule {i + 1}: answer questions about {topic} in one short sentence with a real example." for i in range(rules)
    ]
    return "\n".join(lines)


def scenario_interleaved(servers: list[Server], conversations: int = 14, turns: int = 3, max_tokens: int = 12) -> dict:
    """{server: {"ttft_mean": [per turn], "cached_mean": [per turn], "ttft": [[per conversation] per turn]}}."""
    stamp = time.time()
    chats = {
        s.name: [
            [{"role": "system", "content": short_system(f"{s.name}-{c}-{stamp}", TOPICS[c % len(TOPICS)])}]
            for c in range(conversations)
        ]
        for s in servers
    }
    ttft = {s.name: [[] for _ in range(turns)] for s in servers}
    cached = {s.name: [[] for _ in range(turns)] for s in servers}
    for turn in range(turns):
        for c in range(conversations):
            question = f"Turn {turn + 1}: {QUESTIONS[(c + turn) % len(QUESTIONS)]}"
            for server in servers:
                messages = chats[server.name][c]
                messages.append({"role": "user", "content": question})
                t, text, n_cached = chat_ttft(server, messages, max_tokens=max_tokens)
                messages.append({"role": "assistant", "content": text})
                ttft[server.name][turn].append(t)
                cached[server.name][turn].append(n_cached or 0)
        print(
            "interleaved turn",
            turn + 1,
            {s.name: round(statistics.mean(ttft[s.name][turn]), 3) for s in servers},
            "cached",
            {s.name: round(statistics.mean(cached[s.name][turn])) for s in servers},
            flush=True,
        )
    return {
        "conversations": conversations,
        "turns": turns,
        **{
            s.name: {
                "ttft_mean": [statistics.mean(v) for v in ttft[s.name]],
                "cached_mean": [statistics.mean(v) for v in cached[s.name]],
                "ttft": ttft[s.name],
            }
            for s in servers
        },
    }


def report_lines(result: dict, names: list[str]) -> list[str]:
    lines = [
        f"| turn ({result['conversations']} conversations, round-robin) | "
        + " | ".join(f"{n} mean TTFT s (cached)" for n in names)
        + " | ratio (theirs / ours) |",
        "|---" * (len(names) + 2) + "|",
    ]
    for turn in range(result["turns"]):
        cells = [f"{result[n]['ttft_mean'][turn]:.3f} ({result[n]['cached_mean'][turn]:.0f})" for n in names]
        ratio = result[names[-1]]["ttft_mean"][turn] / result[names[0]]["ttft_mean"][turn]
        lines.append(f"| {turn + 1} | " + " | ".join(cells) + f" | {ratio:.2f}x |")
    return lines


def main() -> None:
    from bench import start_servers, stop_servers

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--conversations", type=int)
    parser.add_argument("--turns", type=int)
    parser.add_argument("--out", default=str(ROOT / "results" / "interleaved"))
    args = parser.parse_args()
    conversations = args.conversations or (12 if args.quick else 14)
    turns = args.turns or 3
    servers = start_servers()
    try:
        result = scenario_interleaved(servers, conversations, turns, 4 if args.quick else 12)
    finally:
        stop_servers(servers)
    write_report(result, Path(args.out), report_lines(result, [s.name for s in servers]))


if __name__ == "__main__":
    main()
