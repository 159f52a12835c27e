"""What refusing an oversized prompt costs, side by side (issue 46): a chat request of N MB whose text is
far past SmolLM2's window, refused after the chat template and the tokenizer ran (as before) or by the
size check of server/prompt_bound.py (the bound computed once beforehand, as the server does at a
tokenizer's first request). Alternates the two, prints medians and the ratio, and the bound's one-time cost.

    python scripts/bench_prompt_bound.py [--mb 3] [--rounds 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

from harness import default_model_dir
from mlx_lm.utils import load_tokenizer

from mlx_kvserve.server import prompt_bound
from mlx_kvserve.server.context_window import ContextLengthError, window
from mlx_kvserve.server.openai import parse as oa

CONTEXT = 8192


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--mb", type=float, default=3.0)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    tokenizer = load_tokenizer(default_model_dir())
    started = time.perf_counter()
    per_token = prompt_bound.max_token_bytes(tokenizer)
    print(f"longest token: {per_token} bytes, found in {time.perf_counter() - started:.3f} s (once per tokenizer)")
    messages = [{"role": "user", "content": "word " * int(args.mb * 1e6 / 5)}]
    req = oa.parse_request({"messages": messages}, "chat", oa.Defaults(16, 0.0, 1.0))
    win = window(CONTEXT)

    def tokenized() -> None:
        count = len(tokenizer.apply_chat_template(messages, add_generation_prompt=True))
        assert count > win.max_prompt

    def checked() -> None:
        try:
            prompt_bound.check_size(req, tokenizer, win, False)
        except ContextLengthError:
            return
        raise AssertionError("not refused by its size")

    times: dict[str, list[float]] = {"tokenize, then refuse": [], "size check": []}
    for _ in range(args.rounds):
        for name, run in (("tokenize, then refuse", tokenized), ("size check", checked)):
            started = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - started)
    medians = {name: statistics.median(t) for name, t in times.items()}
    for name, median in medians.items():
        print(f"{name:>22}: median {median * 1000:9.2f} ms over {args.rounds} rounds ({args.mb:g} MB of text)")
    print(f"ratio: {medians['tokenize, then refuse'] / medians['size check']:.0f}x")


if __name__ == "__main__":
    main()
