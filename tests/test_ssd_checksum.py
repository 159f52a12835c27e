"""The block checksum (format v2: xxh3-128) and the format version bump that came with it."""

from __future__ import annotations

import json
import struct

import mlx.core as mx
import numpy as np
import pytest
from blake3 import blake3
from test_ssd_store import NS, block, make_store

from mlx_kvserve.chain import framed
from mlx_kvserve.kv.ssd import format as ssd_format
from mlx_kvserve.kv.ssd.format import BlockHeader, FormatError, block_checksum, block_relpath, read_block_file


def header_of(block_hash=b"\x01" * 32, parent=b"\x02" * 32, tokens=(1, 2, 3, 4)) -> BlockHeader:
    return BlockHeader(block_hash, parent, tuple(tokens), "")


def v1_checksum(namespace: bytes, header: BlockHeader, arrays) -> str:
    """The checksum of format version 1 (blake3, descriptors interleaved with the bytes)."""
    ids = ssd_format.encode_tokens(header.token_ids).encode()
    hasher = blake3(framed(namespace, header.block_hash, header.parent_hash, ids))
    for name in sorted(arrays):
        arr = arrays[name]
        hasher.update(framed(name.encode(), str(arr.dtype).encode(), repr(tuple(arr.shape)).encode()))
        hasher.update(np.ascontiguousarray(np.asarray(arr)).reshape(-1).view(np.uint8))
    return hasher.hexdigest()


def test_a_version_1_file_is_not_served_and_is_deleted_at_startup(tmp_path):
    store = make_store(tmp_path)
    h, parent, tokens, arrays = block(1)
    store.save_block(h, parent, tokens, arrays)
    assert store.flush()
    path = tmp_path / block_relpath(h)
    loaded, meta = mx.load(str(path), return_metadata=True)
    old = v1_checksum(NS, BlockHeader(h, parent, tuple(tokens), ""), loaded)  # an intact file of version 1
    mx.save_safetensors(str(path), loaded, metadata={**meta, "version": "1", "checksum": old})
    restarted = make_store(tmp_path)
    assert restarted.contains(h)  # the index of the last run still lists it
    report = restarted.validate_index()
    assert (report.deleted_invalid, report.kept) == (1, 0)
    assert not path.exists() and not restarted.contains(h)
    assert restarted.load_block(h, tokens) is None
    restarted.check_integrity()


def flipped(arr: mx.array, position: int) -> mx.array:
    raw = bytearray(np.asarray(arr).tobytes())
    raw[position] ^= 0x01
    return mx.array(np.frombuffer(bytes(raw), dtype=np.asarray(arr).dtype).reshape(arr.shape))


def test_a_flipped_bit_anywhere_in_any_array_changes_the_checksum():
    _, _, _, arrays = block(2)
    header = header_of()
    reference = block_checksum(NS, header, arrays)
    for name, arr in arrays.items():
        for position in range(arr.nbytes):
            changed = {**arrays, name: flipped(arr, position)}
            assert block_checksum(NS, header, changed) != reference, (name, position)


def test_a_flipped_byte_in_each_array_of_a_file_is_caught(tmp_path):
    store = make_store(tmp_path)
    h, parent, tokens, arrays = block(3)
    store.save_block(h, parent, tokens, arrays)
    path = tmp_path / block_relpath(h)
    pristine = path.read_bytes()
    (length,) = struct.unpack("<Q", pristine[:8])
    tensors = {k: v for k, v in json.loads(pristine[8 : 8 + length]).items() if k != "__metadata__"}
    assert len(tensors) == len(arrays)
    for entry in tensors.values():
        start, end = entry["data_offsets"]
        for offset in (start, (start + end) // 2, end - 1):
            damaged = bytearray(pristine)
            damaged[8 + length + offset] ^= 0x80
            path.write_bytes(bytes(damaged))
            with pytest.raises(FormatError, match="checksum"):
                read_block_file(path, NS, h)
    path.write_bytes(pristine)
    assert read_block_file(path, NS, h)[0].token_ids == tuple(tokens)


def test_the_checksum_covers_names_dtypes_shapes_and_identity():
    _, _, _, arrays = block(4, dtype=mx.float16)
    header = header_of()
    reference = block_checksum(NS, header, arrays)
    first = sorted(arrays)[0]
    variants = [
        (NS, header, {("x" + k if k == first else k): v for k, v in arrays.items()}),  # renamed
        (NS, header, {**arrays, first: arrays[first].reshape(-1)}),  # same bytes, other shape
        (NS, header, {**arrays, first: arrays[first].view(mx.bfloat16)}),  # same bytes, other dtype
        (NS, header_of(tokens=(1, 2, 3, 5)), arrays),
        (NS, header_of(parent=b"\x03" * 32), arrays),
        (NS, header_of(block_hash=b"\x04" * 32), arrays),
        (b"\x05" * 32, header, arrays),
    ]
    for namespace, other_header, other_arrays in variants:
        assert block_checksum(namespace, other_header, other_arrays) != reference


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
def test_a_strided_array_hashes_as_its_contiguous_copy(dtype):
    full = mx.random.normal((1, 2, 8, 4)).astype(dtype)
    sliced = full[..., 2:6, :]  # a view with the strides of the whole array
    mx.eval(full, sliced)
    assert not memoryview(sliced).c_contiguous
    copy = mx.contiguous(sliced)
    mx.eval(copy)
    header = header_of()
    assert block_checksum(NS, header, {"0.k": sliced}) == block_checksum(NS, header, {"0.k": copy})
