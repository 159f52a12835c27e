"""bench.py --scenarios interleaved's measurement, which bench.py runs too: more conversations than mlx_lm.server keeps
prompt caches for, advanced round-robin; and its report."""

from __future__ import annotations

import statistics
import time

from harness.clients import chat_ttft
from harness.prompts import QUESTIONS, TOPICS
from harness.servers import Server


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
    systems = {
        s.name: [short_system(f"{s.name}-{c}-{stamp}", TOPICS[c % len(TOPICS)]) for c in range(conversations)]
        for s in servers
    }
    chats = {name: [[{"role": "system", "content": text}] for text in texts] for name, texts in systems.items()}
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
    """Mean TTFT (cached tokens) per turn and server, and each other server's over ours (names[0])."""
    ours, others = names[0], names[1:]
    lines = [
        f"| turn ({result['conversations']} conversations, round-robin) | "
        + " | ".join(f"{n} mean TTFT s (cached)" for n in names)
        + "".join(f" | {n} / {ours}" for n in others)
        + " |",
        "|---" * (1 + len(names) + len(others)) + "|",
    ]
    for turn in range(result["turns"]):
        cells = [f"{result[n]['ttft_mean'][turn]:.3f} ({result[n]['cached_mean'][turn]:.0f})" for n in names]
        base = result[ours]["ttft_mean"][turn]
        ratios = [f"{result[n]['ttft_mean'][turn] / base:.2f}x" for n in others]
        lines.append(f"| {turn + 1} | " + " | ".join(cells + ratios) + " |")
    return lines
