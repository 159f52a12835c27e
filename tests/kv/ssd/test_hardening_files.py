"""Files on disk are untrusted input (issue 17): tails are served only under their own parent
(item 1); a damaged index, pins file, shutdown record, fingerprint memo or conversion marker is set
aside and rebuilt, never a crash or a hang (items 2-4); `cache verify` checks tails and removes temp
leftovers (item 16)."""

from __future__ import annotations

import json
import os
import random
import shutil
import threading
from pathlib import Path

import mlx.core as mx
import pytest
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st
from kvharness import close_ssd, greedy, make_generator
from mlx_lm.utils import load

from mlx_kvserve.chain import BlockHasher
from mlx_kvserve.checked_json import KEEP_DAMAGED, Hex, Int, MapOf, Obj, load_json
from mlx_kvserve.cli import cli
from mlx_kvserve.kv.hashing import MEMO_SCHEMA, model_fingerprint, namespace_hash
from mlx_kvserve.kv.pins import PINS_SCHEMA, PinRegistry
from mlx_kvserve.kv.ssd.format import tail_key
from mlx_kvserve.kv.ssd.index import INDEX_NAME, INDEX_SCHEMA
from mlx_kvserve.kv.ssd.shutdown_record import SHUTDOWN_FILE, SHUTDOWN_SCHEMA, read_shutdown_record
from mlx_kvserve.kv.ssd.store import SSDStore, store_dir
from mlx_kvserve.kv.ssd.tails import SSDTailStore
from mlx_kvserve.models.gguf import MARKER_FILE, MARKER_SCHEMA, _source_stamp, is_converted

NS = namespace_hash("hardening", "float32", 16)
X, Y = b"\x0a" * 32, b"\x0b" * 32


def arrays(n: int, seed: int = 0) -> dict[str, mx.array]:
    mx.random.seed(seed)
    out = {"0.k": mx.random.normal((1, 2, n, 4)), "0.v": mx.random.normal((1, 2, n, 4))}
    mx.eval(list(out.values()))
    return out


def set_aside_copies(path: Path) -> list[Path]:
    return sorted(path.parent.glob(f"{path.name}.damaged-*"))


def finishes(fn, timeout: float = 10.0):
    """fn() in a daemon thread: its result, or a failure (not a hung test) if it blocks."""
    result: list = []
    thread = threading.Thread(target=lambda: result.append(fn()), daemon=True)
    thread.start()
    thread.join(timeout)
    assert not thread.is_alive(), f"{fn} blocked for {timeout} s"
    return result[0]


# --- item 1: a tail is served only under the parent it was saved for ---------------------------------


def test_tail_copied_under_another_parent_is_not_served(tmp_path):
    store = SSDTailStore(tmp_path, NS)
    tokens = [5, 6, 7, 8]
    assert store.save(X, tokens, arrays(4, 1))
    (src,) = (tmp_path / X.hex()).glob("*.safetensors")
    (tmp_path / Y.hex()).mkdir()
    copied = tmp_path / Y.hex() / src.name
    shutil.copy(src, copied)
    assert store.best(Y, tokens + [9]) is None
    assert not copied.exists() and store.stats["ssd_tail_errors"] == 1
    # Renamed to the key a tail of Y with these tokens would have: its header still names X.
    renamed = tmp_path / Y.hex() / f"{tail_key(Y, tokens).hex()}.safetensors"
    shutil.copy(src, renamed)
    assert store.best(Y, tokens + [9]) is None
    assert not renamed.exists() and store.stats["ssd_tail_errors"] == 2
    assert store.best(X, tokens + [9]).num_shared == 4  # the original still serves its own parent


def test_tail_folder_links_are_never_followed(tmp_path):
    """A per-parent folder that is a link to another folder: nothing there is read or deleted."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "model.safetensors").write_bytes(b"weights the cache must never touch")
    tails = tmp_path / "tails"
    tails.mkdir()
    (tails / Y.hex()).symlink_to(outside, target_is_directory=True)
    store = SSDTailStore(tails, NS)
    os.utime(outside / "model.safetensors", (1, 1))  # "unused" for decades
    assert store.best(Y, [1, 2]) is None
    assert store.prune(ttl_s=60) == 0
    assert store.clear() == 0
    assert (outside / "model.safetensors").read_bytes().startswith(b"weights")


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    return load(str(tiny_model_dir))


def test_tail_copy_attack_through_the_engine_serves_the_cold_text(tiny, tmp_path):
    """The issue's repro: Y+T then X+T, copy X's tail into Y's folder, restart, ask Y+T again."""
    model, tokenizer = tiny
    rng = random.Random(3)
    x, y, t = ([rng.randrange(3, 250) for _ in range(n)] for n in (64, 64, 20))
    bs = 16
    cold_ids, cold_text, _ = greedy(make_generator(model, tokenizer, bs), y + t, 10)
    first = make_generator(model, tokenizer, bs, ssd_dir=tmp_path)
    greedy(first, y + t, 10)
    greedy(first, x + t, 10)
    assert close_ssd(first)
    hasher = first.prefix_cache.manager.hasher
    tails = first.prefix_cache.ssd_tier.tails.folder
    parent_x, parent_y = (hasher.hash_blocks(p)[-1].hex() for p in (x + t, y + t))
    for old in (tails / parent_y).iterdir():
        old.unlink()
    for src in (tails / parent_x).glob("*.safetensors"):
        shutil.copy(src, tails / parent_y / src.name)

    restarted = make_generator(model, tokenizer, bs, ssd_dir=tmp_path)
    ids, text, cached = greedy(restarted, y + t, 10)
    assert cached == 5 * bs  # the full blocks only: the foreign tail was refused
    assert ids == cold_ids and text == cold_text
    assert restarted.prefix_cache.ssd_tier.tails.stats["ssd_tail_errors"] >= 1
    close_ssd(restarted)


# --- item 2: a damaged index ------------------------------------------------------------------------


def saved_store(root: Path, n: int = 3) -> tuple[SSDStore, list[bytes]]:
    store = SSDStore(root, NS)
    hashes = BlockHasher(NS, 4).hash_blocks(list(range(4 * n)))
    for i, block_hash in enumerate(hashes):
        store.save_block(block_hash, NS if i == 0 else hashes[i - 1], list(range(4 * i, 4 * i + 4)), arrays(4, i))
    assert store.flush()
    return store, hashes


def huge_num_tokens(path: Path) -> None:
    doc = json.loads(path.read_text())
    next(iter(doc["entries"].values()))["num_tokens"] = "@"
    path.write_text(json.dumps(doc).replace('"@"', "1e999"))


@pytest.mark.parametrize(
    "damage",
    [
        lambda p: p.write_text("[" * 200_000),
        huge_num_tokens,
        lambda p: (p.unlink(), os.mkfifo(p)),
        lambda p: (p.unlink(), p.mkdir()),
    ],
    ids=["deep-nesting", "num_tokens-1e999", "fifo", "directory"],
)
def test_damaged_index_is_set_aside_and_the_files_adopted(tmp_path, damage):
    _, hashes = saved_store(tmp_path)
    index = tmp_path / INDEX_NAME
    damage(index)
    reopened = finishes(lambda: SSDStore(tmp_path, NS))
    (damaged,) = reopened.damaged_files
    assert damaged.path == index and damaged.moved_to == set_aside_copies(index)[0]
    assert not index.exists() or index.is_file()
    report = reopened.validate_index()
    assert report.adopted == len(hashes) and reopened.flush()
    assert SSDStore(tmp_path, NS).damaged_files == [] and json.loads(index.read_text())["entries"]


def test_cache_verify_survives_a_damaged_index(tmp_path):
    root = tmp_path / "kv"
    saved_store(store_dir(root, NS))
    index = store_dir(root, NS) / INDEX_NAME
    index.write_text("[" * 200_000)
    result = CliRunner().invoke(cli, ["cache", "verify", "--dir", str(root)])
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit), result.output  # not a crash
    row = result.output.splitlines()[2].split()
    assert row[2] == "3" and row[3] == "3" and row[-1] == "1"  # blocks, adopted, damaged (after model, namespace)
    assert f"{INDEX_NAME}: nested too deeply; set aside as {INDEX_NAME}.damaged-" in result.output
    index.unlink()
    os.mkfifo(index)
    result = finishes(lambda: CliRunner().invoke(cli, ["cache", "verify", "--dir", str(root)]))
    assert result.exit_code == 1 and "not a regular file (a FIFO)" in result.output, result.output
    assert CliRunner().invoke(cli, ["cache", "verify", "--dir", str(root)]).exit_code == 0


# --- item 3: a damaged pins file --------------------------------------------------------------------


@pytest.mark.parametrize(
    "content", ["[" * 100_000, '{"version":1,"pins":{"00":null}}', '{"version":1,"pins":{"' + "ab" * 32 + '":true}}']
)
def test_damaged_pins_file_starts_without_pins(tmp_path, content):
    path = tmp_path / "pins.json"
    path.write_text(content)
    (tmp_path / ".pins.json.tmp").write_text("{")  # an interrupted write
    pins = PinRegistry(path)
    assert len(pins) == 0 and [d.path for d in pins.damaged_files] == [path]
    assert set_aside_copies(path) and not path.exists() and not (tmp_path / ".pins.json.tmp").exists()
    pins.pin([X])
    assert PinRegistry(path).count(X) == 1


def test_set_aside_keeps_only_the_newest_copies(tmp_path):
    path = tmp_path / "pins.json"
    for _ in range(KEEP_DAMAGED + 3):
        path.write_text("{")
        assert PinRegistry(path).damaged_files
    assert len(set_aside_copies(path)) == KEEP_DAMAGED


# --- item 4: shutdown record, fingerprint memo, conversion marker, the schema reader ---------------


def test_shutdown_record_is_checked_and_temp_leftovers_removed(tmp_path):
    path = tmp_path / SHUTDOWN_FILE
    (tmp_path / f".{SHUTDOWN_FILE}.tmp").write_text("{")
    path.write_text('{"shutdown_clean": "yes", "shutdown_partial_flush": false}')
    damaged: list = []
    assert read_shutdown_record(tmp_path, damaged) == {"shutdown_clean": False, "shutdown_partial_flush": None}
    assert [d.path for d in damaged] == [path] and not (tmp_path / f".{SHUTDOWN_FILE}.tmp").exists()
    path.write_text('{"shutdown_clean": true, "shutdown_partial_flush": false, "ssd_bytes": "x"}')
    assert read_shutdown_record(tmp_path, consume=False) == {"shutdown_clean": True, "shutdown_partial_flush": False}
    assert read_shutdown_record(tmp_path) == {"shutdown_clean": True, "shutdown_partial_flush": False}
    assert read_shutdown_record(tmp_path) == {"shutdown_clean": None, "shutdown_partial_flush": None}
    os.mkfifo(path)
    assert finishes(lambda: read_shutdown_record(tmp_path))["shutdown_clean"] is False


def test_damaged_fingerprint_memo_is_rebuilt(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"a": 1}')
    (model / "model.safetensors").write_bytes(b"weights")
    expected = model_fingerprint(model)
    memo = tmp_path / "fingerprints.json"
    for content in ("[" * 100_000, '{"k": 1e999}', '{"k": "' + "z" * 64 + '"}'):
        memo.write_text(content)
        damaged: list = []
        assert model_fingerprint(model, memo, damaged) == expected
        assert [d.path for d in damaged] == [memo]
        assert model_fingerprint(model, memo, damaged) == expected and len(damaged) == 1  # the rebuilt memo is used


def test_damaged_conversion_marker_means_convert_again(tmp_path):
    src, dst = tmp_path / "m.gguf", tmp_path / "converted"
    src.write_bytes(b"gguf")
    dst.mkdir()
    marker = dst / MARKER_FILE
    marker.write_text(json.dumps(_source_stamp(src, "float32")))
    assert is_converted(src, dst, "float32")
    for content in ("[" * 100_000, '{"version": 1e999}', "\x00\x01"):
        marker.write_text(content)
        assert not is_converted(src, dst, "float32")
    marker.unlink()
    os.mkfifo(marker)
    assert finishes(lambda: is_converted(src, dst, "float32")) is False


SCHEMAS = [INDEX_SCHEMA, PINS_SCHEMA, SHUTDOWN_SCHEMA, MEMO_SCHEMA, MARKER_SCHEMA]
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=70), children, max_size=4),
    max_leaves=16,
)


@settings(max_examples=200, deadline=None)
@given(content=st.one_of(st.binary(max_size=200), JSON_VALUES.map(lambda v: json.dumps(v).encode())))
def test_load_json_never_raises_and_returns_only_checked_values(content, tmp_path_factory):
    folder = tmp_path_factory.mktemp("fuzz", numbered=True)
    path = folder / "file.json"
    for schema in SCHEMAS:
        path.write_bytes(content)
        loaded = load_json(path, schema, 1 << 20, "fuzzed file")
        assert (loaded.value is None) != (loaded.damaged is None)
        assert loaded.damaged is None or not path.exists()
    shutil.rmtree(folder)


def test_schema_checks_types_not_just_shapes(tmp_path):
    schema = Obj({"n": Int(0, 10), "h": Hex(2), "m": MapOf(Hex(1), Int(1, 3), max_items=2)})
    path = tmp_path / "f.json"
    good = {"n": 3, "h": "abcd", "m": {"0f": 2}, "extra": [1]}
    path.write_text(json.dumps(good))
    assert load_json(path, schema, 1024, "f").value == {"n": 3, "h": "abcd", "m": {"0f": 2}}  # extras dropped
    for bad in ({"n": True}, {"n": 11}, {"n": 3.0}, {"h": "ABCD"}, {"h": "abc"}, {"m": {"0F": 2}}, {"m": {"0f": 0}}):
        path.write_text(json.dumps(good | bad))
        assert load_json(path, schema, 1024, "f").damaged is not None, bad
    path.write_text(json.dumps(good) + " " * 2000)
    assert "allowed" in load_json(path, schema, 1024, "f").damaged.reason


# --- item 16: cache verify checks tails and removes temp leftovers ---------------------------------


def test_cache_verify_checks_tails_and_cleans_leftovers(tmp_path):
    root = tmp_path / "kv"
    folder = store_dir(root, NS)
    saved_store(folder)
    tails = SSDTailStore(folder / "tails", NS)
    for i, parent in enumerate((X, Y)):
        assert tails.save(parent, [1, 2, 3 + i], arrays(3, i))
    good = sorted((folder / "tails").rglob("*.safetensors"))
    (of_x,) = (folder / "tails" / X.hex()).glob("*.safetensors")
    shutil.copy(of_x, folder / "tails" / Y.hex() / of_x.name)  # the copy attack
    (folder / "tails" / Y.hex() / f".{'cd' * 32}.tmp.safetensors").write_bytes(b"partial")
    (folder / "tails" / "junk").write_text("?")
    (folder / ".pins.json.tmp").write_text("{")
    (folder / f".{SHUTDOWN_FILE}.tmp").write_text("{")
    (folder / SHUTDOWN_FILE).write_text('{"shutdown_clean": true, "shutdown_partial_flush": false}')

    result = CliRunner().invoke(cli, ["cache", "verify", "--dir", str(root)])
    assert result.exit_code == 1, result.output
    header, _, row = result.output.splitlines()[:3]
    assert dict(zip(header.split(), row.split(), strict=True)) | {"model": "", "namespace": ""} == {
        "model": "",
        "namespace": "",
        "blocks": "3",
        "adopted": "0",
        "missing": "0",
        "invalid": "0",
        "temp": "3",  # the tail's, pins' and shutdown record's leftovers
        "tails": "2",
        "bad_tails": "2",  # the copied tail and the junk file
        "damaged": "0",
    }
    assert sorted((folder / "tails").rglob("*.safetensors")) == good
    assert not (folder / ".pins.json.tmp").exists() and not (folder / f".{SHUTDOWN_FILE}.tmp").exists()
    assert (folder / SHUTDOWN_FILE).exists()  # verify never consumes the record the next start reads
    assert CliRunner().invoke(cli, ["cache", "verify", "--dir", str(root)]).exit_code == 0
