"""The benches' prompts: a ~1.2k-token system prompt made unique by a nonce, and short questions."""

from __future__ import annotations

TOPICS = ["rivers", "mountains", "deserts", "forests", "oceans", "islands", "volcanoes", "glaciers", "lakes", "valleys"]


def system_prompt(nonce: str = "", target_words: int = 880) -> str:
    """A ~1.2k-token system prompt (SmolLM2 tokenizer); `nonce` makes it unique (a cold prompt)."""
    lines = [f"Session {nonce}." if nonce else "Session.", "You are a careful geography tutor. Follow these rules:"]
    i, words = 0, 0
    while words < target_words:
        topic = TOPICS[i % len(TOPICS)]
        line = f"Rule {i + 1}: when asked about {topic}, give one precise fact, name a real example, and keep the answer short."
        lines.append(line)
        words += len(line.split())
        i += 1
    return "\n".join(lines)


QUESTIONS = [
    "What is the capital of France?",
    "Name a large desert in Africa.",
    "Which ocean is the largest?",
    "What is the highest mountain on Earth?",
]
