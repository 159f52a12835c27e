"""The block checksum (blake3 keyed with the folder's secret), the format 3+ payload (every array of a block in one byte array, laid
out by a table) and the format version bumps."""

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

KEY = b"\x07" * 32


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
    reference = block_checksum(NS, header, arrays, key=KEY)
    for name, arr in arrays.items():
        for position in range(arr.nbytes):
            changed = {**arrays, name: flipped(arr, position)}
            assert block_checksum(NS, header, changed, key=KEY) != reference, (name, position)


def file_parts(path):
    """(raw bytes, header length, the payload's table) of a block file."""
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    head = json.loads(raw[8 : 8 + length])
    assert set(head) == {"payload", "__metadata__"}  # one array per file
    return raw, length, ssd_format.decode_table(head["__metadata__"]["arrays"])


def test_a_flipped_byte_in_each_array_of_a_file_is_caught(tmp_path):
    store = make_store(tmp_path)
    h, parent, tokens, arrays = block(3)
    store.save_block(h, parent, tokens, arrays)
    path = tmp_path / block_relpath(h)
    pristine, length, slots = file_parts(path)
    assert sorted(s.name for s in slots) == sorted(arrays)
    for slot in slots:
        for offset in (slot.offset, slot.offset + slot.nbytes // 2, slot.offset + slot.nbytes - 1):
            damaged = bytearray(pristine)
            damaged[8 + length + offset] ^= 0x80
            path.write_bytes(bytes(damaged))
            with pytest.raises(FormatError, match="checksum"):
                read_block_file(path, NS, h, key=store.key)
    path.write_bytes(pristine)
    assert read_block_file(path, NS, h, key=store.key)[0].token_ids == tuple(tokens)


def test_a_changed_table_is_caught(tmp_path):
    """The table says where each array lies and what it is: editing it (same bytes, another shape,
    two arrays swapped) must fail the checksum, not serve reinterpreted KV."""
    store = make_store(tmp_path)
    h, parent, tokens, arrays = block(5)
    store.save_block(h, parent, tokens, arrays)
    path = tmp_path / block_relpath(h)
    pristine, length, slots = file_parts(path)
    head = json.loads(pristine[8 : 8 + length])
    first, second = slots[0], slots[1]
    edits = [
        [
            first._replace(shape=(first.shape[0], -1 + 1 + first.shape[1] * first.shape[2], 1, first.shape[3])),
            *slots[1:],
        ],
        [first._replace(offset=second.offset), second._replace(offset=first.offset), *slots[2:]],
    ]
    for edited in edits:
        edited = sorted(edited, key=lambda s: s.offset)
        meta = {**head["__metadata__"], "arrays": ssd_format.encode_table(edited)}
        text = json.dumps({**head, "__metadata__": meta}).encode()
        text += b" " * (-len(text) % 8)
        path.write_bytes(struct.pack("<Q", len(text)) + text + pristine[8 + length :])
        with pytest.raises(FormatError, match="checksum"):
            read_block_file(path, NS, h, key=store.key)


def raw_bytes(arr: mx.array) -> bytes:
    return np.asarray(mx.contiguous(arr.reshape(-1)).view(mx.uint8)).tobytes() if arr.size else b""


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16, mx.uint8])
def test_arrays_come_back_bit_exact_whatever_their_sizes(tmp_path, dtype):
    """Odd sizes make the writer pad between arrays (each starts aligned): the arrays read back are
    the arrays written, bit for bit, with their names, dtypes and shapes, empty ones included."""
    shapes = {"0.k": (1, 3, 5, 7), "0.v": (1, 3, 5, 7), "1.k": (1, 2, 0, 4), "1.v": (1, 2, 0, 4), "2.s0": (1, 1, 3)}
    arrays = {n: (mx.random.normal(s) * 50).astype(dtype) for n, s in shapes.items()}
    path = tmp_path / "b.safetensors"
    h = b"\x09" * 32
    ssd_format.write_block_file(path, NS, BlockHeader(h, b"\x00" * 32, (1, 2, 3), ""), arrays, key=KEY)
    _, _, slots = file_parts(path)
    assert all(s.offset % 16 == 0 for s in slots)
    _, loaded = read_block_file(path, NS, h, key=KEY)
    assert sorted(loaded) == sorted(arrays)
    for name, arr in arrays.items():
        got = loaded[name]
        assert (got.dtype, got.shape) == (arr.dtype, arr.shape)
        assert raw_bytes(got) == raw_bytes(arr) and (got.size == 0 or len(raw_bytes(got)) == got.nbytes)


def test_the_checksum_covers_names_dtypes_shapes_and_identity():
    _, _, _, arrays = block(4, dtype=mx.float16)
    header = header_of()
    reference = block_checksum(NS, header, arrays, key=KEY)
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
        assert block_checksum(namespace, other_header, other_arrays, key=KEY) != reference


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
def test_a_strided_array_hashes_as_its_contiguous_copy(dtype):
    full = mx.random.normal((1, 2, 8, 4)).astype(dtype)
    sliced = full[..., 2:6, :]  # a view with the strides of the whole array
    mx.eval(full, sliced)
    assert not memoryview(sliced).c_contiguous
    copy = mx.contiguous(sliced)
    mx.eval(copy)
    header = header_of()
    assert block_checksum(NS, header, {"0.k": sliced}, key=KEY) == block_checksum(NS, header, {"0.k": copy}, key=KEY)
