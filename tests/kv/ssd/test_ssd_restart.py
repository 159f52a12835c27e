"""After a restart the cache is served from the SSD, and a hit from the SSD gives exactly the
output of a cold run. Damaged files are never served. Never weaken these tests."""

import time

import mlx.core as mx
import pytest
from kvharness import close_ssd, cold_logits, final_logits, greedy, make_generator
from mlx_lm.utils import load

ATOL = RTOL = 1e-3
BS = 16


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    return load(str(tiny_model_dir))


def _prompt(tokenizer, n_blocks: int) -> list[int]:
    text = " ".join(f"Entry {i}: the harbour light number {i} shines at {i * 3} o'clock." for i in range(30))
    return tokenizer.encode(text)[: n_blocks * BS + BS // 2]


def _check_restart_hit(model, tokenizer, tmp_path, prompt, max_tokens):
    cold_ids, cold_text, _ = greedy(make_generator(model, tokenizer, BS), prompt, max_tokens)
    first = make_generator(model, tokenizer, BS, ssd_dir=tmp_path)
    greedy(first, prompt, max_tokens)
    assert close_ssd(first)  # shutdown drained the writer and flushed the index

    restarted = make_generator(model, tokenizer, BS, ssd_dir=tmp_path)  # empty RAM, same disk
    logits, cached = final_logits(restarted, prompt)
    expected = len(prompt) - 1  # every full block from the SSD, then the persisted tail
    assert cached == expected > BS
    ids, text, cached_run = greedy(restarted, prompt, max_tokens)
    assert cached_run == expected
    assert ids == cold_ids and text == cold_text
    reference = cold_logits(model, prompt)
    assert mx.allclose(logits, reference, atol=ATOL, rtol=RTOL).item(), mx.abs(logits - reference).max().item()
    stats = restarted.prefix_cache.manager.stats()
    assert stats["kv_promotions"] == expected // BS
    assert restarted.prefix_cache.ssd_tier.stats()["ssd_tail_hits"] == 1
    restarted.prefix_cache.manager.check_integrity()
    restarted.prefix_cache.ssd_tier.store.check_integrity()
    close_ssd(restarted)


def test_tiny_restart_hit_matches_cold(tiny, tmp_path):
    model, tokenizer = tiny
    _check_restart_hit(model, tokenizer, tmp_path, _prompt(tokenizer, 5), 20)


@pytest.mark.slow
def test_smollm_restart_hit_matches_cold(smollm_dir, tmp_path):
    model, tokenizer = load(str(smollm_dir))
    _check_restart_hit(model, tokenizer, tmp_path, _prompt(tokenizer, 6), 12)


def test_corrupt_block_file_is_never_served(tiny, tmp_path):
    model, tokenizer = tiny
    prompt = _prompt(tokenizer, 4)
    cold_ids, _, _ = greedy(make_generator(model, tokenizer, BS), prompt, 16)
    first = make_generator(model, tokenizer, BS, ssd_dir=tmp_path)
    greedy(first, prompt, 16)
    close_ssd(first)
    files = sorted(tmp_path.rglob("*.safetensors"))
    assert len(files) >= 4
    # Flip bytes in the middle of the data of the block holding tokens 32..47 (the third block).
    third = make_generator(model, tokenizer, BS).prefix_cache.manager.hasher.hash_blocks(prompt, 3)[2]
    victim = next(f for f in files if f.stem == third.hex())
    data = bytearray(victim.read_bytes())
    for i in range(len(data) - 64, len(data) - 32):
        data[i] ^= 0xFF
    victim.write_bytes(bytes(data))

    restarted = make_generator(model, tokenizer, BS, ssd_dir=tmp_path)
    ids, _, cached = greedy(restarted, prompt, 16)
    assert cached == 2 * BS  # the chain stops before the damaged block
    assert ids == cold_ids
    ssd = restarted.prefix_cache.ssd_tier.store.stats()
    assert ssd["ssd_corrupt"] == 1
    corrupt = bytes(data)
    assert close_ssd(restarted)  # the damaged file was deleted; the recomputed block is written anew
    assert not victim.exists() or victim.read_bytes() != corrupt
    again = make_generator(model, tokenizer, BS, ssd_dir=tmp_path)
    ids, _, cached = greedy(again, prompt, 16)  # a third process reads the whole chain back
    assert ids == cold_ids and cached > 2 * BS
    assert again.prefix_cache.ssd_tier.store.stats()["ssd_corrupt"] == 0
    close_ssd(again)


def test_ram_budget_eviction_falls_back_to_ssd(tiny, tmp_path):
    """With a RAM budget of about one block, later lookups come from the SSD and still match."""
    model, tokenizer = tiny
    prompt = _prompt(tokenizer, 5)
    cold_ids, _, _ = greedy(make_generator(model, tokenizer, BS), prompt, 16)
    gen = make_generator(model, tokenizer, BS, ram_bytes=20_000, ssd_dir=tmp_path)
    greedy(gen, prompt, 16)
    gen.prefix_cache.ssd_tier.writer.stop(30)  # everything written before we look again
    ids, _, cached = greedy(gen, prompt, 16)
    assert ids == cold_ids
    assert cached >= 4 * BS
    stats = gen.prefix_cache.manager.stats()
    assert stats["kv_evictions"] > 0 and stats["kv_promotions"] > 0
    gen.prefix_cache.manager.check_integrity()


def test_evict_only_writes_blocks_only_when_ram_evicts_them(tiny, tmp_path):
    from kvharness import OPEN_TIERS

    model, tokenizer = tiny
    prompt = _prompt(tokenizer, 5)
    roomy = make_generator(model, tokenizer, BS, ssd_dir=tmp_path / "a")
    roomy.prefix_cache.ssd_tier.policy = "evict_only"
    greedy(roomy, prompt, 8)
    roomy.prefix_cache.ssd_tier.writer.stop(30)
    assert roomy.prefix_cache.ssd_tier.store.stats()["ssd_blocks"] == 0  # nothing left RAM

    tight = make_generator(model, tokenizer, BS, ram_bytes=20_000, ssd_dir=tmp_path / "b")
    tight.prefix_cache.ssd_tier.policy = "evict_only"
    greedy(tight, prompt, 8)
    tight.prefix_cache.ssd_tier.writer.stop(30)
    evictions = tight.prefix_cache.manager.stats()["kv_evictions"]
    assert evictions > 0
    assert tight.prefix_cache.ssd_tier.store.stats()["ssd_blocks"] == evictions
    assert len(OPEN_TIERS) >= 2


def test_evict_only_writes_what_is_still_in_ram_at_shutdown(tiny, tiny_model_dir, tmp_path):
    """A clean stop of an evict_only engine writes its RAM blocks, so a restart serves them."""
    from mlx_kvserve.config import load_config
    from mlx_kvserve.engine.engine import Engine
    from mlx_kvserve.models.loader import LoadedModel

    model, tokenizer = tiny
    prompt = _prompt(tokenizer, 5)
    cold_ids, _, _ = greedy(make_generator(model, tokenizer, BS), prompt, 8)
    config = load_config(
        overrides={"cache": {"block_size": BS}, "ssd": {"cache_dir": str(tmp_path), "policy": "evict_only"}}
    )
    loaded = LoadedModel("tiny", tiny_model_dir, model, tokenizer, {}, 2048)

    def run_engine() -> tuple[Engine, tuple[int, ...], int]:
        engine = Engine(loaded, config)
        ids, _, cached = greedy(engine.scheduler, prompt, 8)
        return engine, ids, cached

    first, ids, cached = run_engine()
    assert cached == 0 and ids == cold_ids
    first.stop()
    store = first.prefix_cache.ssd_tier.store
    assert store.stats()["ssd_blocks"] == first.prefix_cache.manager.stats()["kv_ram_blocks"] > 0
    second, ids, cached = run_engine()
    assert cached >= 5 * BS and ids == cold_ids  # from the SSD, same output
    second.stop()


def test_writes_wait_while_a_request_prefills(tiny, tmp_path):
    """With write_hold_s, no batch of block writes is taken between a request's lookup and its
    first token (a batch taken before finishes); the writes go on afterwards, output unchanged."""
    model, tokenizer = tiny
    prompt = _prompt(tokenizer, 12)
    cold_ids, _, _ = greedy(make_generator(model, tokenizer, BS), prompt, 4)
    gen = make_generator(model, tokenizer, BS, ssd_dir=tmp_path, write_hold_s=10.0)
    tier, cache, writer = gen.prefix_cache.ssd_tier, gen.prefix_cache, gen.prefix_cache.ssd_tier.writer
    saves: list[float] = []
    takes: list[float] = []  # when the writer took a batch (under the hold's lock)
    windows: list[tuple[float, float]] = []
    save_jobs, take, prepare, first_token = tier.save_jobs, writer._queue.take, cache.prepare, cache.first_token

    def slow_save(jobs):
        for _ in jobs:
            saves.append(time.monotonic())
            time.sleep(0.02)  # ~0.25 s of writes for the first request's blocks: still going at the second
        return save_jobs(jobs)

    def timed_take(*args):
        batch = take(*args)
        if batch:
            takes.append(time.monotonic())
        return batch

    def timed_prepare(tokens, *args):
        tier.hold_writes()  # what prepare does first, here before the window opens
        windows.append((time.monotonic(), float("inf")))
        time.sleep(0.05)  # a window several saves long: unheld, the writer would take batches in it
        return prepare(tokens, *args)

    def timed_first_token():
        if windows and windows[-1][1] == float("inf"):
            windows[-1] = (windows[-1][0], time.monotonic())
        first_token()

    writer._save_batch, writer._queue.take = slow_save, timed_take
    writer._max_batch_jobs = 1  # one block per batch: a batch boundary every save
    cache.prepare, cache.first_token = timed_prepare, timed_first_token
    greedy(gen, prompt, 4)
    ids, _, cached = greedy(gen, prompt[:-3] + prompt[-3:], 4)  # a hit while the writes are pending
    assert ids == cold_ids and cached == len(prompt) - 1
    assert close_ssd(gen)
    assert len(saves) >= 12  # every block (and tail) was still written
    lo, hi = windows[1]
    assert hi < float("inf")
    inside = [t for t in takes if lo < t < hi]
    assert not inside, f"{len(inside)} write batches were taken during the second request's prefill"
    assert any(t >= hi for t in takes)  # some writes were held until the first token
