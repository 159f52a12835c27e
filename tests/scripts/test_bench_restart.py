"""The floors the SSD scenarios compare with (scripts/harness/diskio.py): raw reads of every block file,
cold and from the page cache, and a raw write."""

from __future__ import annotations

import os

from harness import diskio


def test_the_raw_read_floor_reads_every_file(tmp_path):
    files = []
    for i in range(3):
        path = tmp_path / f"{i:02d}" / f"block{i}.safetensors"
        path.parent.mkdir()
        path.write_bytes(os.urandom(100_000))
        files.append(path)
    assert sorted(diskio.block_files(tmp_path)) == files
    for cold in (False, True) if diskio.CAN_DROP else (False,):
        assert diskio.raw_read_s(files, cold) > 0


def test_raw_write_measures_a_positive_bandwidth_and_leaves_nothing(tmp_path):
    assert diskio.raw_write_bps(tmp_path, 1 << 20) > 0
    assert list(tmp_path.iterdir()) == []
