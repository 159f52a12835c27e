"""scripts/bench_families.py without servers: its prompts, its summary of a scenario, its report and
the checkpoint sizes it measures (scripts/harness/families.py), on tiny models of the two families it
benchmarks."""

from __future__ import annotations

from pathlib import Path

import pytest
from harness import families
from harness.families import FULL, QUICK, Hit
from harness.synthetic import family_config, random_model, write_model_folder


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    """Tiny qwen3_5 (hybrid) and gemma3_text (window 24) folders with the byte tokenizer."""
    out = {}
    for family in ("qwen3_5", "gemma3_text"):
        config = family_config(family)
        out[family] = write_model_folder(tmp_path_factory.mktemp(family), config, random_model(config))
    return out


def test_system_prompts_are_about_the_asked_size_and_unique(folders):
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    client = families.Client(None, load_tokenizer(folders["qwen3_5"]), 8)
    for p in (QUICK, FULL):
        a, b = families.system_text("a", p.system_tokens), families.system_text("b", p.system_tokens)
        assert a != b
        tokens = client.count([{"role": "system", "content": a}])
        assert 0.95 * p.system_tokens <= tokens <= 1.05 * p.system_tokens + 20, tokens  # template + a few merges


def test_summary_means_ratio_and_targets():
    result = {"cold_s": [2.0, 4.0], "hits": [Hit(0.2, 95, 100), Hit(0.4, 190, 200)]}
    s = families.summarize(result)
    assert s["cold_s"] == 3.0 and s["hit_s"] == pytest.approx(0.3) and s["speedup"] == pytest.approx(10.0)
    assert s["shared"] == 150 and s["cached"] == 142.5 and s["share"] == pytest.approx(0.95) and s["meets"]
    assert not families.summarize({"cold_s": [2.0], "hits": [[0.2, 80, 100]]})["meets"]  # 80% cached
    assert not families.summarize({"cold_s": [1.0], "hits": [[0.3, 100, 100]]})["meets"]  # 3.3x
    unreported = families.summarize({"cold_s": [2.0], "hits": [[0.1, None, 100]]})
    assert unreported["cached"] is None and unreported["share"] is None and not unreported["meets"]


def test_report_rows_and_checkpoint_figures():
    size = {"state_bytes_per_checkpoint": 4096 * 64, "window_bytes_per_checkpoint": 0, "kv_bytes_per_token": 2048}
    health = {
        "block_size": 64,
        "kv_ram_blocks": 10,
        "kv_ram_bytes": 640 * 2048,
        "kv_tails": 4,
        "kv_tail_bytes": 4 << 20,
    }
    scenario = {"cold_s": [3.0], "hits": [[0.1, 99, 100]]}
    results = {
        "m": {
            "checkpoint": size,
            "health": health,
            "servers": {
                "mlx-kvserve": {"repeat": scenario},
                "mlx_lm.server": {"repeat": {**scenario, "hits": [[0.1, None, 100]]}},
            },
        }
    }
    report = "\n".join(families.report_lines(results, QUICK, 4096))
    assert "| m | repeat | mlx-kvserve | 100 | 99 | 99% | 3.00 | 0.100 | 30.0x | met |" in report
    assert "| m | repeat | mlx_lm.server | 100 | n/a | n/a | 3.00 | 0.100 | 30.0x | missed |" in report
    assert "mlx_lm.server reported no cached tokens (m, repeat)" in report
    assert "- m: full-attention KV 2048 bytes per token; one checkpoint holds 256 KiB of recurrent state" in report
    assert (
        "as much as 128 tokens of that KV" in report
        and "`checkpoint_every = 4096` prompt tokens adds 64 bytes" in report
    )
    assert "window layers" not in report  # no window layers: no window figure
    assert "10 blocks of 64 tokens, 2048 bytes per token; 4 tails" in report and "of 1024 KiB on average" in report
    assert "kv_tail_bytes / tokens in blocks = 6554 bytes per token" in report


def test_shared_prefix_is_the_longest_common_prefix_with_what_came_before(folders, monkeypatch):
    from harness.clients import ChatReply
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    replies = iter(["abc", "de", "fg"])
    monkeypatch.setattr(families, "stream_chat", lambda *a: ChatReply(0.5, next(replies), 7, 2))
    client = families.Client(None, load_tokenizer(folders["qwen3_5"]), 2)
    system = {"role": "system", "content": "Rules."}
    history = [system]
    first = client.turn(history, "One?")
    assert first == Hit(0.5, 7, 0)  # nothing came before
    second = client.turn(history, "Two?")  # the whole first turn, its reply included, is shared
    assert second.shared == client.count(history[:3])
    other, _ = client.ask([system, {"role": "user", "content": "Three?"}])
    assert other.shared == client.count([system]) + 6  # and "<|im_start|>user\n": a byte tokenizer's 6 tokens


def test_checkpoint_bytes_of_a_hybrid_and_a_window_model(folders):
    hybrid = families.checkpoint_bytes(folders["qwen3_5"], positions=64)
    assert hybrid["state_bytes_per_checkpoint"] > 0 and hybrid["window_bytes_per_checkpoint"] == 0
    config = family_config("qwen3_5")  # 2 full-attention layers of 2 KV heads x 16 dims, float32
    assert hybrid["kv_bytes_per_token"] == 2 * 2 * config["num_key_value_heads"] * config["head_dim"] * 4
    window = families.checkpoint_bytes(folders["gemma3_text"], positions=64)
    assert window["state_bytes_per_checkpoint"] == 0 and window["kv_bytes_per_token"] > 0
    # 4 window layers of 24 positions (the window's last positions) x (keys + values) x 2 heads x 16 dims x 4 bytes
    assert window["window_bytes_per_checkpoint"] == 4 * 24 * 2 * 2 * 16 * 4
