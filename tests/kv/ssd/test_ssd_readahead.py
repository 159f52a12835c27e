"""kv/ssd/readahead.py: a chain's block files advised in order, a bounded lead past the file being
read, and a chain loaded with it equal to one loaded file by file (the checks in test_kv_unit.py and
test_hardening_files.py cover damaged and forged files on the same path)."""

from __future__ import annotations

import time

import pytest

from mlx_kvserve.kv.ssd import readahead


def advised_paths(monkeypatch) -> list:
    seen: list = []
    monkeypatch.setattr(readahead, "CAN_ADVISE", True)
    monkeypatch.setattr(readahead, "_advise", lambda path: seen.append(path) or 1000)
    return seen


def wait_for(condition, timeout_s: float = 5.0) -> None:
    end = time.monotonic() + timeout_s
    while not condition() and time.monotonic() < end:
        time.sleep(0.005)


def test_files_are_advised_in_order_at_most_the_lead_ahead(monkeypatch, tmp_path):
    seen = advised_paths(monkeypatch)
    paths = [tmp_path / f"{i}.safetensors" for i in range(6)]
    ahead = readahead.Readahead(paths, ahead_bytes=2500)  # each file is 1000 bytes: 3 ahead
    try:
        wait_for(lambda: len(seen) == 3)
        time.sleep(0.05)
        assert seen == paths[:3]
        ahead.consumed(2)
        wait_for(lambda: len(seen) == 5)
        time.sleep(0.05)
        assert seen == paths[:5]
        ahead.consumed(6)
        wait_for(lambda: len(seen) == 6)
        assert seen == paths
    finally:
        ahead.close()


def test_close_stops_a_waiting_readahead(monkeypatch, tmp_path):
    seen = advised_paths(monkeypatch)
    ahead = readahead.Readahead([tmp_path / f"{i}" for i in range(100)], ahead_bytes=1)
    wait_for(lambda: len(seen) == 1)
    ahead.close()
    ahead.close()
    assert len(seen) == 1


@pytest.mark.skipif(not readahead.CAN_ADVISE, reason="no posix_fadvise here")
def test_advising_a_missing_or_odd_file_is_skipped(tmp_path):
    (tmp_path / "real").write_bytes(b"x" * 4096)
    assert readahead._advise(tmp_path / "real") == 4096
    assert readahead._advise(tmp_path / "missing") == 0
    assert readahead._advise(tmp_path) == 0  # a folder is not a regular file


def test_a_chain_loads_through_the_pipelined_windows(tmp_path):
    import mlx.core as mx

    from mlx_kvserve.kv.ssd import reads
    from mlx_kvserve.kv.ssd.store import SSDStore

    store = SSDStore(tmp_path / "kv", b"\x01" * 32)
    tokens = tuple(range(4))
    hashes, parent = [], b"\x01" * 32
    for i in range(2 * reads.LOAD_WINDOW + 3):  # three windows, the last one short
        block_hash = bytes([i + 1]) * 32
        store.save_block(
            block_hash, parent, tokens, {"0.k": mx.full((1, 1, 4, 2), float(i)), "0.v": mx.zeros((1, 1, 4, 2))}
        )
        hashes.append(block_hash)
        parent = block_hash
    loaded = store.load_blocks([(h, tokens) for h in hashes])
    assert [block.arrays["0.k"][0, 0, 0, 0].item() for block in loaded] == [float(i) for i in range(len(hashes))]
    assert (
        len(store.load_blocks([(h, tokens) for h in hashes[:5]] + [(b"\xee" * 32, tokens), (hashes[6], tokens)])) == 5
    )
    damaged = store._path(hashes[10])  # in the second window, read while the first is checked
    data = bytearray(damaged.read_bytes())
    data[-1] ^= 0xFF
    damaged.write_bytes(bytes(data))
    assert len(store.load_blocks([(h, tokens) for h in hashes])) == 10
    assert not damaged.exists() and store.stats()["ssd_corrupt"] == 1
