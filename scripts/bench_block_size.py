"""Choose [cache] block_size by measurement, in-process on the default model.

For each block size: cold TTFT and the time spent registering blocks after it, repeat TTFT
(exact same prompt), new-question TTFT (same ~1.2k-token system prompt), and blocks per prompt.
Usage: python -m mlx_kvserve.cpu.blas_exec .venv/bin/python scripts/bench_block_size.py [--sizes 16,32,64,128]
"""

from __future__ import annotations

import argparse
import json
import time

from harness import default_model_dir
from harness.prompts import QUESTIONS, system_prompt
from harness.reports import median


def run(sizes: list[int], reps: int) -> list[dict]:
    from mlx_lm.utils import load

    from mlx_kvserve.chain import BlockHasher
    from mlx_kvserve.engine.batch.generate import Generator
    from mlx_kvserve.engine.cache.prefix_cache import PrefixCache
    from mlx_kvserve.engine.request import GenerationRequest, SamplingParams
    from mlx_kvserve.kv.hashing import namespace_hash
    from mlx_kvserve.kv.manager import KVManager
    from mlx_kvserve.kv.ram import RAMStore

    model, tokenizer = load(str(default_model_dir()))

    def chat(system: str, question: str) -> list[int]:
        messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
        return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True))

    def ttft(gen: Generator, prompt: list[int]) -> tuple[float, int, float]:
        events = []
        req = GenerationRequest("b", prompt, SamplingParams(max_tokens=1, temperature=0.0), events.append)
        start = time.perf_counter()
        gen.run(req)
        total = time.perf_counter() - start
        done = events[-1]
        return done.first_token_s, done.usage.cached_tokens, total - done.first_token_s

    rows = []
    for bs in sizes:
        cold, register, repeat, new_q, cached_repeat, cached_new = [], [], [], [], [], []
        for rep in range(reps):
            manager = KVManager(BlockHasher(namespace_hash("bench", "float32", bs), bs), RAMStore(8 << 30))
            gen = Generator(model, tokenizer, PrefixCache(model, manager))
            system = system_prompt(nonce=f"{bs}-{rep}")
            first = chat(system, QUESTIONS[0])
            t, _, reg = ttft(gen, first)
            cold.append(t)
            register.append(reg)
            t, c, _ = ttft(gen, first)
            repeat.append(t)
            cached_repeat.append(c)
            t, c, _ = ttft(gen, chat(system, QUESTIONS[1]))
            new_q.append(t)
            cached_new.append(c)
        rows.append(
            {
                "block_size": bs,
                "prompt_tokens": len(first),
                "blocks_per_prompt": len(first) // bs,
                "cold_ttft_s": median(cold),
                "register_s": median(register),
                "repeat_ttft_s": median(repeat),
                "repeat_cached_tokens": cached_repeat[0],
                "new_question_ttft_s": median(new_q),
                "new_question_cached_tokens": cached_new[0],
            }
        )
        print(json.dumps(rows[-1]), flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sizes", default="16,32,64,128,256")
    parser.add_argument("--reps", type=int, default=2)
    args = parser.parse_args()
    rows = run([int(s) for s in args.sizes.split(",")], args.reps)
    print(
        "\n| block size | blocks/prompt | cold TTFT s | register s | repeat TTFT s (cached) | new question TTFT s (cached) |"
    )
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['block_size']} | {r['blocks_per_prompt']} | {r['cold_ttft_s']:.2f} | {r['register_s']:.3f} | "
            f"{r['repeat_ttft_s']:.3f} ({r['repeat_cached_tokens']}) | {r['new_question_ttft_s']:.3f} ({r['new_question_cached_tokens']}) |"
        )


if __name__ == "__main__":
    main()
