"""bench.py's measurements, which bench.py runs too: a system prompt cold, repeated and with a new
question; the first request after a restart; TTFT per turn of a conversation (all on running servers);
decode tokens/s and what SSD write-through costs (in-process); and the report of whichever ran."""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

from harness.clients import chat_ttft
from harness.prompts import QUESTIONS, system_prompt
from harness.reports import median
from harness.servers import Server


def scenario_system_prompt(servers: list[Server], reps: int, words: int = 880) -> dict:
    """Cold, exact repeat and a new question on a ~`words`-word system prompt (880: ~1.2k tokens)."""
    out = {s.name: {"cold": [], "repeat": [], "new_question": [], "cached": {}} for s in servers}
    for rep in range(reps):
        for server in servers:  # each server gets its own unique (cold) system prompt
            system = system_prompt(nonce=f"{server.name}-{rep}-{time.time()}", target_words=words)

            def ask(q: str, system: str = system) -> list[dict]:
                return [{"role": "system", "content": system}, {"role": "user", "content": q}]

            row = out[server.name]
            t, _, _ = chat_ttft(server, ask(QUESTIONS[0]))
            row["cold"].append(t)
            t, _, c = chat_ttft(server, ask(QUESTIONS[0]))
            row["repeat"].append(t)
            row["cached"]["repeat"] = c
            t, _, c = chat_ttft(server, ask(QUESTIONS[1 + rep % 3]))
            row["new_question"].append(t)
            row["cached"]["new_question"] = c
            print(server.name, {k: round(v[-1], 3) for k, v in row.items() if isinstance(v, list)}, flush=True)
    return {name: {k: median(v) if isinstance(v, list) else v for k, v in row.items()} for name, row in out.items()}


def scenario_restart(servers: list[Server], reps: int) -> dict:
    """Cold request, restart the server, the same request again: ours from the SSD, theirs cold."""
    out = {}
    for server in servers:
        cold, after = [], []
        for rep in range(reps):
            system = system_prompt(nonce=f"restart-{server.name}-{rep}-{time.time()}")
            messages = [{"role": "system", "content": system}, {"role": "user", "content": QUESTIONS[0]}]
            cold.append(chat_ttft(server, messages)[0])
            server.restart()
            chat_ttft(server, [{"role": "user", "content": "warm up"}], 2)  # kernel compilation after start
            t, _, cached = chat_ttft(server, messages)
            after.append(t)
        out[server.name] = {"cold": median(cold), "after_restart": median(after), "cached_after_restart": cached}
        print(server.name, "restart", out[server.name], flush=True)
    return out


def scenario_conversation(servers: list[Server], turns: int) -> dict:
    out = {}
    for server in servers:
        messages = [{"role": "system", "content": system_prompt(nonce=f"conv-{server.name}-{time.time()}")}]
        ttfts = []
        for turn in range(turns):
            messages.append({"role": "user", "content": f"Turn {turn + 1}: {QUESTIONS[turn % len(QUESTIONS)]}"})
            t, text, _ = chat_ttft(server, messages, max_tokens=24)
            messages.append({"role": "assistant", "content": text})
            ttfts.append(t)
        out[server.name] = ttfts
        print(server.name, "conversation TTFT per turn", [round(t, 2) for t in ttfts], flush=True)
    return out


def decode_speed(model_dir: Path, reps: int, max_tokens: int) -> dict:
    """Decode tokens/s of our Generator vs mlx_lm.stream_generate on the same prompt, alternating."""
    from mlx_lm import stream_generate
    from mlx_lm.utils import load

    from harness.kvstack import make_generator
    from mlx_kvserve.engine.request import Finished, GenerationRequest, SamplingParams

    model, tokenizer = load(str(model_dir))
    messages = [{"role": "user", "content": "Write a long, detailed story about a lighthouse keeper who finds a map."}]
    prompt = list(tokenizer.apply_chat_template(messages, add_generation_prompt=True))
    ours, theirs = [], []
    for _ in range(reps):
        gen = make_generator(model, tokenizer, 64)
        events, stamps = [], []

        def emit(event, events=events, stamps=stamps):
            events.append(event)
            stamps.append(time.perf_counter())

        req = GenerationRequest("d", prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0), emit)
        start = time.perf_counter()
        gen.run(req)
        done = events[-1]
        assert isinstance(done, Finished)
        # Block registration runs after the Finished event: it is not decode time.
        decode_s = stamps[-1] - start - done.first_token_s
        ours.append((done.usage.completion_tokens - 1) / decode_s)
        *_, last = stream_generate(model, tokenizer, prompt, max_tokens=max_tokens)
        theirs.append(last.generation_tps)
        print(
            f"decode: ours {ours[-1]:.1f} tok/s ({done.usage.completion_tokens} tokens), mlx-lm {theirs[-1]:.1f} tok/s ({last.generation_tokens} tokens)",
            flush=True,
        )
    return {"ours_tps": median(ours), "mlx_lm_tps": median(theirs), "ratio": median(ours) / median(theirs)}


def ssd_write_cost(model_dir: Path, reps: int, max_tokens: int) -> dict:
    """What write-through costs the requests that run while the writer is busy. A request
    registers ~20 new blocks; right after it come a cache hit (a new question on the same system
    prompt: TTFT) and a long decode (tokens/s). Modes: the SSD tier off; on, with writes held
    while a request prefills ([ssd] write_hold_s, the default); on, never held."""
    from mlx_lm.utils import load

    from harness.kvstack import close_ssd, make_generator
    from mlx_kvserve.config import SSDConfig
    from mlx_kvserve.engine.request import Finished, GenerationRequest, SamplingParams

    model, tokenizer = load(str(model_dir))
    modes = {"off": None, "on": SSDConfig().write_hold_s, "on_no_hold": 0.0}

    def chat(system: str, question: str) -> list[int]:
        messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
        return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True))

    def run(gen, prompt, tokens) -> tuple[Finished, float]:
        """(Finished, seconds from start to the last event)."""
        events, stamps = [], []

        def emit(event, events=events, stamps=stamps):
            events.append(event)
            stamps.append(time.perf_counter())

        start = time.perf_counter()
        gen.run(GenerationRequest("w", prompt, SamplingParams(max_tokens=tokens, temperature=0.0), emit))
        return events[-1], stamps[-1] - start

    tps: dict[str, list[float]] = {mode: [] for mode in modes}
    hit: dict[str, list[float]] = {mode: [] for mode in modes}
    story = chat("You are a storyteller.", "Write a long, detailed story about a lighthouse keeper.")
    for rep in range(reps):
        for mode, hold in modes.items():
            ssd_dir = Path(tempfile.mkdtemp(prefix="kvserve-ssdcost-")) if hold is not None else None
            gen = make_generator(model, tokenizer, 64, ssd_dir=ssd_dir, write_hold_s=hold or 0.0)
            system = system_prompt(f"{mode}-{rep}-{time.time()}")
            run(gen, chat(system, QUESTIONS[0]), 1)
            done, _ = run(gen, chat(system, QUESTIONS[1]), 1)
            hit[mode].append(done.first_token_s)
            done, total = run(gen, story, max_tokens)
            tps[mode].append((done.usage.completion_tokens - 1) / (total - done.first_token_s))
            if ssd_dir is not None:
                close_ssd(gen)
            print(f"ssd write cost {mode}: hit TTFT {hit[mode][-1]:.3f}s, decode {tps[mode][-1]:.2f} tok/s", flush=True)
    on, off, no_hold = median(tps["on"]), median(tps["off"]), median(tps["on_no_hold"])
    return {
        "decode_tps_ssd_off": off,
        "decode_tps_ssd_on": on,
        "decode_tps_ssd_on_no_hold": no_hold,
        "ratio": on / off,
        "hit_ttft_ssd_off": median(hit["off"]),
        "hit_ttft_ssd_on": median(hit["on"]),
        "hit_ttft_ssd_on_no_hold": median(hit["on_no_hold"]),
    }


def report_lines(results: dict) -> list[str]:
    """Markdown for whichever of this script's scenarios are in `results`."""
    lines: list[str] = []
    if "system_prompt" in results:
        a, b = results["system_prompt"]["mlx-kvserve"], results["system_prompt"]["mlx_lm.server"]
        lines += [
            "| scenario | mlx-kvserve TTFT s | mlx_lm.server TTFT s | ratio (theirs / ours) |",
            "|---|---|---|---|",
        ]
        for key in ("cold", "repeat", "new_question"):
            lines.append(f"| {key.replace('_', ' ')} | {a[key]:.3f} | {b[key]:.3f} | {b[key] / a[key]:.2f}x |")
        lines.append(
            f"\nOurs: hit/cold = 1/{a['cold'] / a['repeat']:.1f} (repeat), 1/{a['cold'] / a['new_question']:.1f} "
            f"(new question); cached tokens {a['cached']}"
        )
    if "restart" in results:
        ra, rb = results["restart"]["mlx-kvserve"], results["restart"]["mlx_lm.server"]
        lines += [
            "",
            "| first request after a restart | mlx-kvserve | mlx_lm.server |",
            "|---|---|---|",
            f"| cold TTFT s | {ra['cold']:.3f} | {rb['cold']:.3f} |",
            f"| after restart TTFT s | {ra['after_restart']:.3f} | {rb['after_restart']:.3f} |",
            f"| after restart / cold | 1/{ra['cold'] / ra['after_restart']:.1f} | 1/{rb['cold'] / rb['after_restart']:.1f} |",
            f"| cached tokens after restart | {ra['cached_after_restart']} | - |",
        ]
    if "conversation" in results:
        ours_turns, their_turns = results["conversation"]["mlx-kvserve"], results["conversation"]["mlx_lm.server"]
        lines += ["", "| turn | mlx-kvserve TTFT s | mlx_lm.server TTFT s |", "|---|---|---|"]
        lines += [
            f"| {i + 1} | {x:.3f} | {y:.3f} |" for i, (x, y) in enumerate(zip(ours_turns, their_turns, strict=True))
        ]
    if "decode" in results:
        dec = results["decode"]
        lines.append(
            f"\nDecode: ours {dec['ours_tps']:.1f} tok/s, mlx-lm stream_generate {dec['mlx_lm_tps']:.1f} tok/s, "
            f"ratio {dec['ratio']:.3f}"
        )
    if "ssd_write_cost" in results:
        w = results["ssd_write_cost"]
        lines.append(
            f"\nDecode right after a request that wrote ~20 blocks: SSD off {w['decode_tps_ssd_off']:.1f} tok/s, "
            f"on {w['decode_tps_ssd_on']:.1f} tok/s, ratio {w['ratio']:.3f} "
            f"(on without write_hold_s: {w['decode_tps_ssd_on_no_hold']:.1f} tok/s)"
        )
        lines.append(
            f"\nTTFT of a cache hit right after that request: SSD off {w['hit_ttft_ssd_off']:.3f} s, "
            f"on {w['hit_ttft_ssd_on']:.3f} s, on without write_hold_s {w['hit_ttft_ssd_on_no_hold']:.3f} s"
        )
    return lines
