"""One model over two ranks (mx.distributed, ring backend on loopback; tensor parallel, pipeline
parallel by mlx-lm's split and by ours) with the block cache on each rank: greedy output equals
the single-process run, cold, on a RAM hit and on an SSD hit after restarting both ranks; a block
file lost on one rank gives a shorter hit with the same output; pins reach both ranks. A layout
whose heads do not divide is refused at startup. The agreement on the cached length is also
tested alone, with a fake group."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from kvharness import greedy, make_generator
from mlx_lm.utils import load
from tinymodel import build_mlx_model

ROOT = Path(__file__).resolve().parents[2]
BS = 16


def _run_ranks(model_dir: Path, home: Path, prompts: list[list[int]], *extra: str, mode: str = "tensor"):
    launcher = Path(sys.executable).with_name("mlx.launch")
    prompts_file = home / "prompts.json"
    prompts_file.write_text(json.dumps(prompts))
    script = Path(__file__).resolve().parents[1] / "dist_rank.py"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [str(launcher), "-n", "2", "--backend", "ring", "--", sys.executable, str(script)]
    cmd += [str(model_dir), str(home), mode, str(prompts_file), *extra]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env, cwd=home)


def _launch(model_dir: Path, home: Path, prompts: list[list[int]], *extra: str, mode: str = "tensor") -> dict:
    out = _run_ranks(model_dir, home, prompts, *extra, mode=mode)
    lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
    assert out.returncode == 0 and lines, f"rc {out.returncode}\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return json.loads(lines[-1].removeprefix("RESULT "))


@pytest.fixture(scope="module")
def single(tiny_model_dir):
    model, tokenizer = load(str(tiny_model_dir))
    return model, tokenizer


def test_agreement_takes_the_shortest_prefix_any_rank_has(single):
    """A fake second rank that holds fewer tokens: the lookup shrinks to its length, and the output
    stays the cold one."""
    model, tokenizer = single
    prompt = tokenizer.encode("The river runs past the mill and the old bridge towards the sea. " * 5)
    cold = greedy(make_generator(model, tokenizer, BS), prompt, 10)
    gen = make_generator(model, tokenizer, BS)
    greedy(gen, prompt, 10)
    seen: list[list[int]] = []

    def other_rank_has(n: int) -> list[int]:
        lengths = [n, min(n, 3 * BS)]  # the other rank lost everything after block 3
        seen.append(lengths)
        return lengths

    gen.prefix_cache.agree = other_rank_has
    gen.scheduler.distributed = True  # as a rank's: no direct joins or shared-prefix waits
    ids, _, cached = greedy(gen, prompt, 10)
    assert cached == 3 * BS and ids == cold[0]
    assert seen[0][0] > 3 * BS and seen[-1] == [3 * BS, 3 * BS]
    gen.prefix_cache.manager.check_integrity()


def _qwen2(folder: Path) -> Path:
    """A tiny qwen2 (a family mlx-lm can pipeline; its llama cannot)."""
    from harness.synthetic import base_vocab_size, random_model, write_model_folder

    config = {
        "model_type": "qwen2",
        "hidden_size": 64,
        "num_hidden_layers": 4,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-5,
        "vocab_size": base_vocab_size(),
        "max_position_embeddings": 2048,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "eos_token_id": [2],
    }
    return write_model_folder(folder, config, random_model(config))


def _llama_3_heads(folder: Path) -> Path:
    """A tiny llama that splits as SmolLM2 does: 3 heads (no split in two, as SmolLM2's 9), and
    3 layers (mlx-lm's llama has no pipeline: our own split, 2 layers on rank 0)."""
    shape = {"num_attention_heads": 3, "num_key_value_heads": 3, "hidden_size": 48, "num_hidden_layers": 3}
    return build_mlx_model(folder, **shape)


def _needs_launcher() -> None:
    if shutil.which("mlx.launch", path=str(Path(sys.executable).parent)) is None:
        pytest.skip("mlx.launch is not installed next to this Python")


@pytest.mark.slow
@pytest.mark.parametrize("mode,model", [("tensor", "llama"), ("pipeline", "qwen2"), ("pipeline", "llama-3-heads")])
def test_two_ranks_equal_one_process_cold_hit_restart_and_lost_block(mode, model, tiny_model_dir, tmp_path):
    """tensor: mlx-lm's head split; pipeline: mlx-lm's own (qwen2) and ours (llama)."""
    _needs_launcher()
    builders = {"llama": lambda _: tiny_model_dir, "qwen2": _qwen2, "llama-3-heads": _llama_3_heads}
    model_dir = builders[model](tmp_path / model)
    model, tokenizer = load(str(model_dir))
    prompt = tokenizer.encode("Harbour lights shine over the quiet water while the boats come home. " * 4)
    expected = list(greedy(make_generator(model, tokenizer, BS), prompt, 10)[0])

    first = _launch(model_dir, tmp_path, [prompt, prompt], "--pin", mode=mode)
    assert [r["tokens"] for r in first["results"]] == [expected, expected]
    assert [r["cached"] for r in first["results"]] == [0, len(prompt) - 1]
    assert first["pinned"] == 1
    assert [r["kv_pinned_blocks"] for r in first["ranks"]] == [len(prompt) // BS] * 2  # pins reach both ranks
    assert all(r["kv_ram_blocks"] >= len(prompt) // BS for r in first["ranks"])

    restarted = _launch(model_dir, tmp_path, [prompt], mode=mode)  # both ranks restarted on their SSD folders
    assert restarted["results"] == [{"tokens": expected, "cached": len(prompt) - 1}]

    # Rank 1 loses its block 2 (a deleted file): both ranks use the prefix before it.
    rank1 = Path((tmp_path / "rank1.dir").read_text())
    victim = next(rank1.rglob(f"{first['hashes'][2]}.safetensors"))
    victim.unlink()
    shorter = _launch(model_dir, tmp_path, [prompt], mode=mode)
    assert shorter["results"] == [{"tokens": expected, "cached": 2 * BS}]


@pytest.mark.slow
def test_tensor_parallel_refuses_heads_that_do_not_divide_at_startup(tmp_path):
    """Before: both ranks loaded and served. Here 3 heads of 16 became one head of 24 per rank,
    shapes that fit, so every reply was silently wrong; on SmolLM2 (9 heads, 3 KV heads) every
    request failed in attention (query (1,4,n,72) vs keys (1,1,n,96))."""
    _needs_launcher()
    out = _run_ranks(_llama_3_heads(tmp_path / "llama"), tmp_path, [[1, 2, 3]], mode="tensor")
    assert "RESULT " not in out.stdout
    assert (
        "--distributed tensor cannot split this model over 2 ranks: num_attention_heads=3, num_key_value_heads=3 "
        "do not divide by 2" in out.stderr
    )
    assert "Use --distributed pipeline" in out.stderr
    assert "exited with code 1" in out.stderr  # the launcher then stops the other rank


def test_a_dead_rank_makes_health_a_503_with_the_reason():
    from types import SimpleNamespace

    from mlx_kvserve.engine.engine import Engine
    from mlx_kvserve.server.health import HealthMonitor

    class FakeEngine(SimpleNamespace):  # the real front over fake internals
        failure, is_alive, ssd_problem, cache_enabled = (
            Engine.failure,
            Engine.is_alive,
            Engine.ssd_problem,
            Engine.cache_enabled,
        )

    worker = SimpleNamespace(failed="", is_alive=True)
    config = SimpleNamespace(ssd=SimpleNamespace(enabled=False))
    engine = FakeEngine(worker=worker, config=config, health=lambda: {"cache": {"enabled": True}})
    monitor = HealthMonitor(engine)
    assert monitor.report()[1] == 200
    worker.failed = "distributed worker stopped: [ring] connection to a peer was lost"
    body, status = monitor.report()
    assert status == 503 and body["status"] == "unavailable" and body["problems"] == [worker.failed]
    worker.failed = ""
    engine.health = lambda: {"cache": {"enabled": True, "ranks_error": "TimeoutError"}}
    body, status = monitor.report()
    assert status == 503 and "do not answer: TimeoutError" in body["problems"][0]
