"""A later turn's tokenization with and without the token memo (engine/cache/token_memo.py), side by side.

A Claude Code-shaped conversation (a long system prompt, tool results, short replies) on SmolLM2's
tokenizer, grown to each length; the timed request is the next turn (one reply and one tool result
more). "full": the chat template with its own tokenization (what every request cost before); "memo":
the template rendered to text, then encoded through a memo that holds the previous turn's prompt (as
the server's does after that turn). Alternated, medians; the ids are checked equal every time.

    python -m mlx_kvserve.cpu.blas_exec .venv/bin/python scripts/bench_token_memo.py [--lengths 12000 25000]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from mlx_lm.utils import load_tokenizer

from mlx_kvserve.engine.cache import token_memo
from mlx_kvserve.models.default import ensure_default_model

TOOL_RESULT = "".join(
    f"-rw-r--r--  1 me staff {1000 + 37 * i:6d} Dec  7 13:{i % 60:02d} src/module_{i}.py  # def handler_{i}(req): ...\n"
    for i in range(40)
)


def conversation(tokenizer, num_tokens: int) -> list[dict]:
    """Messages whose prompt is about `num_tokens` tokens: system prompt, then tool-call turns."""
    system = "You are an interactive CLI tool that helps users with software engineering tasks. " * 60
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "List the files and explain."}]
    while len(tokenizer.apply_chat_template(messages, add_generation_prompt=True)) < num_tokens:
        messages += [
            {"role": "assistant", "content": f"I'll run `ls -la` (step {len(messages)})."},
            {"role": "user", "content": f"<tool_result id=t{len(messages)}>\n{TOOL_RESULT}</tool_result> 🙂 continue"},
        ]
    return messages


def timed(fn) -> tuple[float, list[int]]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def render(wrapper, messages: list[dict]) -> str:
    return wrapper.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


def one_turn(wrapper, hf, boundaries, before: list[dict], messages: list[dict]) -> tuple:
    """(full s, memo s, render-only s, full ids, memo ids, ids reused) of `messages` after `before` was memoized."""
    memo = token_memo.TokenMemo(hf, boundaries)
    memo.encode(render(wrapper, before))  # the previous turn, as the server memoized it
    full, want = timed(lambda: list(wrapper.apply_chat_template(messages, add_generation_prompt=True)))
    memoized, got = timed(lambda: memo.encode(render(wrapper, messages)))
    rendered = timed(lambda: render(wrapper, messages))[0]
    return full, memoized, rendered, want, got, memo.reused_tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path, help="model folder (default: the shipped SmolLM2)")
    parser.add_argument("--lengths", type=int, nargs="+", default=[12000, 25000])
    parser.add_argument("--reps", type=int, default=7)
    args = parser.parse_args()
    model = args.model or ensure_default_model(Path.home() / ".cache/mlx-kvserve/models", "float32")
    wrapper = load_tokenizer(model)
    hf = wrapper._tokenizer
    boundaries = token_memo.boundary_ids(hf)
    print(f"tokenizer {type(hf).__name__}, {len(boundaries)} boundary tokens; medians of {args.reps}")
    print(
        "| prompt tokens | new tokens | full (template + encode) s | render only s | memo (render + encode) s | memo / full |"
    )
    print("|---|---|---|---|---|---|")
    for length in args.lengths:
        messages = conversation(wrapper, length)
        before = messages[:-2]

        full_s, memo_s, render_s = [], [], []
        for _ in range(args.reps):
            full, memo, rendered, want, got, reused = one_turn(wrapper, hf, boundaries, before, messages)
            full_s.append(full), memo_s.append(memo), render_s.append(rendered)
            assert got == want, "memo ids differ from the full encode"
        new = len(want) - reused
        full, memo_t, rend = (statistics.median(x) for x in (full_s, memo_s, render_s))
        print(f"| {len(want)} | {new} | {full:.4f} | {rend:.4f} | {memo_t:.4f} | {memo_t / full:.2f}x |")


if __name__ == "__main__":
    main()
