"""Forged block files (issue 46, finding 3): a table naming a wrong shape, a wrong dtype, a shape of
[0, 2**62] or offsets past the payload, with a valid checksum, made every request reaching the block
fail with a 500 across retries and restarts; keys and values swapped with the checksum recomputed
were served as wrong text. Now each is a damaged file: removed, counted in ssd_corrupt, listed by
`cache verify` (exit 1), the prefix recomputed.

Two forgers: one holding the folder's key (the table check against the model's layout catches the
forgery), one without it, who recomputes the checksum with the public algorithm (unkeyed blake3,
or format 3's xxh3): the keyed checksum catches that, the K/V swap included."""

from __future__ import annotations

import json
import os
import shutil
import stat
import struct
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
from click.testing import CliRunner
from kvharness import greedy
from test_hardening_files import NS, arrays
from test_server_ssd import wait_written

from mlx_kvserve.cli import cli
from mlx_kvserve.config import load_config
from mlx_kvserve.engine.engine import Engine
from mlx_kvserve.kv.ssd import format as ssd_format
from mlx_kvserve.kv.ssd.folder_key import KEY_FILE, folder_key
from mlx_kvserve.kv.ssd.format import ArraySlot, FormatError, block_relpath, decode_table, encode_table
from mlx_kvserve.kv.ssd.index import INDEX_NAME
from mlx_kvserve.kv.ssd.store import SSDStore
from mlx_kvserve.kv.ssd.table_check import (
    RULES_FILE,
    ArrayRule,
    TableExpectation,
    check_table,
    read_rules,
    save_rules,
)
from mlx_kvserve.kv.ssd.tier import SSDTier
from mlx_kvserve.kv.ssd.writer import SSDWriterThread

BS, NUM_BLOCKS, MAX_TOKENS = 16, 6, 8
FORGED = 2  # the block forged: blocks 0 and 1 still come from the SSD


# --- forging a block file ----------------------------------------------------------------------------


def forge(path: Path, edit: Callable[[list[ArraySlot], bytearray], list[ArraySlot]], key: bytes | None) -> None:
    """Rewrite the block file at `path`: `edit` changes its table (returned) and payload (in place);
    the checksum is recomputed keyed with `key`, or with the public algorithm when it is None."""
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    head = json.loads(raw[8 : 8 + length])
    meta = head["__metadata__"]
    payload = bytearray(raw[8 + length :])
    table = encode_table(edit(list(decode_table(meta["arrays"])), payload))
    header = ssd_format.parse_metadata(meta, bytes.fromhex(meta["namespace"]))
    checksum = ssd_format._checksum(key, bytes.fromhex(meta["namespace"]), header, table, [bytes(payload)])
    head["__metadata__"] = {**meta, "arrays": table, "checksum": checksum}
    head["payload"] = {"dtype": "U8", "shape": [len(payload)], "data_offsets": [0, len(payload)]}
    text = json.dumps(head, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + bytes(payload))


def other_shape(slots, payload):
    """The first array's bytes read as another shape of the same size."""
    s = slots[0]
    return [s._replace(shape=(s.shape[0], s.shape[1] * s.shape[2], 1, s.shape[3])), *slots[1:]]


def other_dtype(slots, payload):
    """The first array's bytes read as another dtype of the same size."""
    same_size = {"float32": "int32", "float16": "bfloat16", "bfloat16": "float16"}
    return [slots[0]._replace(dtype=same_size[slots[0].dtype]), *slots[1:]]


def huge_shape(slots, payload):
    """[0, 2**62]: no bytes, a shape no cache can take."""
    return [slots[0]._replace(shape=(0, 2**62)), *slots[1:]]


def offsets_past_the_end(slots, payload):
    return [s._replace(offset=s.offset + 1024) for s in slots]


def keys_and_values_swapped(slots, payload):
    """Layer 0's keys where its values are and the other way round: same names, shapes, dtypes."""
    k, v = (next(s for s in slots if s.name == name) for name in ("0.k", "0.v"))
    kb, vb = payload[k.offset : k.offset + k.nbytes], payload[v.offset : v.offset + v.nbytes]
    payload[k.offset : k.offset + k.nbytes], payload[v.offset : v.offset + v.nbytes] = vb, kb
    return slots


TABLE_FORGERIES = [other_shape, other_dtype, huge_shape, offsets_past_the_end]


# --- the table check alone ---------------------------------------------------------------------------


RULES = TableExpectation(
    {
        "0.k": ArrayRule("float16", (1, 2, 1, 4), per_token=True, required=True),
        "0.v": ArrayRule("float16", (1, 2, 1, 4), per_token=True, required=True),
        "1.k": ArrayRule("float16", (1, 2, 1, 4), per_token=True, required=False),  # a window layer
        "1.v": ArrayRule("float16", (1, 2, 1, 4), per_token=True, required=False),
        "2.s0": ArrayRule("float32", (1, 3, 5), per_token=False, required=False),  # a recurrent state
    },
    block_size=4,
)


def slots_for(shapes: dict[str, tuple[tuple[int, ...], str]]) -> tuple[list[ArraySlot], int]:
    """The slots plan_payload would make for arrays of these shapes and dtypes (any shape: no arrays made)."""
    slots, offset = [], 0
    for name in sorted(shapes):
        offset = -(-offset // 16) * 16
        slots.append(ArraySlot(name, shapes[name][1], shapes[name][0], offset))
        offset += slots[-1].nbytes
    return slots, offset


GOOD = {"0.k": ((1, 2, 4, 4), "float16"), "0.v": ((1, 2, 4, 4), "float16")}


def test_tables_the_layout_can_take_pass():
    for shapes, tokens in [
        (GOOD, 4),
        ({n: ((1, 2, 3, 4), "float16") for n in ("0.k", "0.v")}, 3),  # a tail
        ({**GOOD, "1.k": ((1, 2, 2, 4), "float16"), "1.v": ((1, 2, 2, 4), "float16")}, 4),  # a window's suffix
        ({**GOOD, "2.s0": ((1, 3, 5), "float32")}, 4),
    ]:
        slots, size = slots_for(shapes)
        check_table(slots, size, tokens, RULES)


@pytest.mark.parametrize(
    "shapes, tokens, why",
    [
        ({**GOOD, "0.k": ((1, 8, 2, 4), "float16")}, 4, "shape"),
        ({**GOOD, "0.k": ((1, 2, 4, 4), "bfloat16")}, 4, "bfloat16"),
        ({**GOOD, "0.k": ((0, 2**62), "float16")}, 4, "float16"),
        ({**GOOD, "0.k": ((1, 2, 3, 4), "float16")}, 4, "positions"),  # keys and values disagree
        ({"0.k": GOOD["0.k"]}, 4, "missing"),
        ({**GOOD, "9.k": ((1, 2, 4, 4), "float16")}, 4, "not in the layout"),
        ({**GOOD, "1.k": ((1, 2, 2, 4), "float16")}, 4, "missing"),  # half a layer
        ({**GOOD, "1.k": ((1, 2, 4, 4), "float16"), "1.v": ((1, 2, 2, 4), "float16")}, 4, "positions"),
        ({**GOOD, "2.s0": ((1, 3, 6), "float32")}, 4, "shape"),
        ({n: ((1, 2, 5, 4), "float16") for n in ("0.k", "0.v")}, 5, "5 tokens in a 4-token layout"),
        (GOOD, 3, "shape"),  # more positions than the file has tokens
    ],
)
def test_tables_the_layout_cannot_take_are_refused(shapes, tokens, why):
    slots, size = slots_for(shapes)
    with pytest.raises(FormatError, match=why):
        check_table(slots, size, tokens, RULES)


def test_a_table_must_fill_its_payload_exactly():
    slots, size = slots_for(GOOD)
    for payload_bytes in (size - 16, size + 16):
        with pytest.raises(FormatError, match="covers"):
            check_table(slots, payload_bytes, 4, None)


def test_the_rules_file_round_trips_and_a_damaged_one_is_refused(tmp_path):
    save_rules(tmp_path, RULES)
    assert read_rules(tmp_path) == RULES
    (tmp_path / RULES_FILE).write_text('{"block_size": 4, "rules": {"0.k": ["float16", [1, -2], true, true]}}')
    with pytest.raises(ValueError):
        read_rules(tmp_path)


# --- the folder's key --------------------------------------------------------------------------------


def test_the_key_is_made_once_private_and_kept(tmp_path):
    key = folder_key(tmp_path)
    path = tmp_path / KEY_FILE
    assert len(key) == 32 and stat.S_IMODE(path.stat().st_mode) == 0o600
    assert folder_key(tmp_path) == key and folder_key(tmp_path, may_replace=False) == key


@pytest.mark.parametrize("damage", ["short", "readable by others", "fifo"])
def test_a_damaged_key_is_replaced_by_the_owner_and_refused_by_a_guest(tmp_path, damage):
    old = folder_key(tmp_path)
    path = tmp_path / KEY_FILE
    if damage == "short":
        path.write_bytes(old[:16])
    elif damage == "readable by others":
        path.chmod(0o644)
    else:
        path.unlink()
        os.mkfifo(path)
    with pytest.raises(OSError):
        folder_key(tmp_path, may_replace=False)
    new = folder_key(tmp_path)
    assert len(new) == 32 and new != old and list(tmp_path.glob(f"{KEY_FILE}.damaged-*"))


def test_a_file_of_another_folder_is_not_served(tmp_path):
    """Copied from another folder: another key (format 3's files are deleted at startup by version)."""
    other = SSDStore(tmp_path / "other", NS)
    h, tokens = b"\x0c" * 32, list(range(4))
    other.save_block(h, NS, tokens, arrays(4))
    store = SSDStore(tmp_path / "mine", NS)
    (tmp_path / "mine" / block_relpath(h)).parent.mkdir()
    shutil.copy(tmp_path / "other" / block_relpath(h), tmp_path / "mine" / block_relpath(h))
    assert store.validate_index().adopted == 1  # its header names this namespace
    assert store.load_block(h, tokens) is None and store.stats()["ssd_corrupt"] == 1
    assert not (tmp_path / "mine" / block_relpath(h)).exists()
    store.check_integrity()


# --- a store: forged files are misses, deleted and counted ------------------------------------------


def saved(tmp_path: Path) -> tuple[SSDStore, bytes, list[int], Path]:
    store = SSDStore(tmp_path, NS, table_rules=TableExpectation(
        {n: ArrayRule("float32", (1, 2, 1, 4), per_token=True, required=True) for n in ("0.k", "0.v")}, 4
    ))  # fmt: skip
    h, tokens = b"\x0d" * 32, [1, 2, 3, 4]
    store.save_block(h, NS, tokens, arrays(4))
    return store, h, tokens, tmp_path / block_relpath(h)


@pytest.mark.parametrize("host_reads", [False, True], ids=["mlx", "host"])
@pytest.mark.parametrize("edit", TABLE_FORGERIES + [keys_and_values_swapped], ids=lambda f: f.__name__)
@pytest.mark.parametrize("with_key", [True, False], ids=["with-key", "public-checksum"])
def test_a_forged_block_is_a_miss_deleted_and_counted(tmp_path, edit, with_key, host_reads):
    store, h, tokens, path = saved(tmp_path)
    if edit is keys_and_values_swapped and with_key:
        pytest.skip("whoever holds the key can swap them undetected: see docs/operations.md")
    forge(path, edit, store.key if with_key else None)
    store.host_reads = host_reads
    assert store.load_block(h, tokens) is None
    assert store.stats()["ssd_corrupt"] == 1 and not path.exists()
    store.check_integrity()


def test_the_public_algorithm_never_verifies(tmp_path):
    """The very file, its checksum recomputed with unkeyed blake3 (format 4's framing, no key)."""
    store, h, tokens, path = saved(tmp_path)
    pristine = path.read_bytes()
    forge(path, lambda slots, payload: slots, None)  # unkeyed blake3 over the very same content
    assert store.load_block(h, tokens) is None and not path.exists()
    path.write_bytes(pristine)
    assert store.load_block(h, tokens) is not None  # written again, it verifies


# --- the engine: the request answered as a cold run, across restarts, and `cache verify` ------------


@pytest.fixture(autouse=True)
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("MLX_KVSERVE_HOME", str(tmp_path / "home"))


OPEN_ENGINES: list[Engine] = []


@pytest.fixture(autouse=True)
def _stop_engines():
    """An engine's SSD writer thread is non-daemon: stop every engine, even after a failure."""
    yield
    while OPEN_ENGINES:
        OPEN_ENGINES.pop().stop(10)


def _engine(tiny, root: Path) -> Engine:
    overrides = {"cache": {"block_size": BS}, "ssd": {"cache_dir": str(root), "compute_while_loading": False}}
    engine = Engine(tiny, load_config(overrides=overrides))
    OPEN_ENGINES.append(engine)
    return engine


def _stop(engine: Engine) -> None:
    OPEN_ENGINES.remove(engine)
    engine.stop(30)


@pytest.fixture(scope="module")
def stored(tiny, tmp_path_factory):
    """A cache folder holding one prompt's blocks, the prompt, its cold output and block hashes."""
    root = tmp_path_factory.mktemp("kv")
    text = " ".join(f"Step {i}: move disk {i % 3} from peg {i % 2} to peg {(i + 1) % 3}." for i in range(40))
    prompt = tiny.tokenizer.encode(text)[: NUM_BLOCKS * BS + 5]
    engine = _engine(tiny, root)
    cold = greedy(engine.scheduler, prompt, MAX_TOKENS)
    hashes = engine.prefix_cache.manager.hasher.hash_blocks(prompt)
    _stop(engine)
    return root, prompt, cold[0], hashes


def _forged_copy(stored, tmp_path: Path, edit, with_key: bool) -> tuple[Path, Path]:
    """A copy of the stored cache root with block FORGED forged: (root, the forged file)."""
    root = tmp_path / "kv"
    shutil.copytree(stored[0], root)
    folder = next(p.parent for p in root.rglob(INDEX_NAME))
    path = folder / block_relpath(stored[3][FORGED])
    forge(path, edit, (folder / KEY_FILE).read_bytes() if with_key else None)
    return root, path


FORGERIES = [(edit, True) for edit in TABLE_FORGERIES] + [(keys_and_values_swapped, False), (other_shape, False)]


@pytest.mark.parametrize(
    "edit, with_key", FORGERIES, ids=[f"{e.__name__}-{'with-key' if k else 'public'}" for e, k in FORGERIES]
)
def test_a_forged_block_is_recomputed_across_restarts_and_listed_by_verify(tiny, stored, tmp_path, edit, with_key):
    _, prompt, cold, hashes = stored
    root, path = _forged_copy(stored, tmp_path, edit, with_key)
    engine = _engine(tiny, root)  # a restart with the forged file in the folder
    for attempt in range(2):  # the first request meets the file; a retry finds what replaced it
        ids, _, cached = greedy(engine.scheduler, prompt, MAX_TOKENS)
        assert ids == cold
        if attempt == 0:
            assert cached == FORGED * BS
            assert engine.local_cache_stats()["ssd_corrupt"] == 1
    _stop(engine)
    folder = path.parent.parent
    if path.exists():  # the writer saved the recomputed block there: intact, its own tokens
        namespace = bytes.fromhex(json.loads((folder / INDEX_NAME).read_text())["namespace"])
        header, _ = ssd_format.read_block_file(path, namespace, hashes[FORGED], key=(folder / KEY_FILE).read_bytes())
        assert header.token_ids == tuple(prompt[FORGED * BS : (FORGED + 1) * BS])
    again = _engine(tiny, root)  # and after another restart, the whole prefix from the SSD
    ids, _, cached = greedy(again.scheduler, prompt, MAX_TOKENS)
    assert ids == cold and again.local_cache_stats()["ssd_corrupt"] == 0
    _stop(again)

    root, path = _forged_copy(stored, tmp_path / "verify", edit, with_key)
    result = CliRunner().invoke(cli, ["cache", "verify", "--dir", str(root)])
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit), result.output
    row = result.output.splitlines()[2].split()
    assert row[5] == "1", result.output  # the invalid column (after model and namespace): the forged file
    assert not path.exists() and "not checked" not in result.output
    assert CliRunner().invoke(cli, ["cache", "verify", "--dir", str(root)]).exit_code == 0


# --- a server: 200, never 500 -----------------------------------------------------------------------------


def test_a_server_answers_a_forged_folder_with_the_cold_text(start_server, tiny_model_dir, tmp_path):
    server = start_server(tiny_model_dir, home=tmp_path / "home")
    system = " ".join(f"Rule {i}: keep harbour {i} clear of boats." for i in range(30))

    def chat() -> tuple[str, int]:
        body = {"messages": [{"role": "system", "content": system}, {"role": "user", "content": "Hi"}]}
        r = httpx.post(f"{server.base_url}/v1/chat/completions", json=body | {"max_tokens": 8, "temperature": 0})
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["message"]["content"], r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    text, _ = chat()
    assert wait_written(server)["ssd_blocks"] > 0
    files = sorted(p for p in (tmp_path / "home" / "kv").rglob("*.safetensors") if len(p.parent.name) == 2)
    key = (files[0].parent.parent / KEY_FILE).read_bytes()
    for path in files:
        forge(path, huge_shape, key)
    httpx.post(f"{server.base_url}/v1/cache/flush", json={}).raise_for_status()  # RAM: gone
    assert chat()[0] == text
    assert chat()[0] == text
    assert httpx.get(f"{server.base_url}/health").json()["cache"]["ssd_corrupt"] >= 1


# --- any failure turning a verified file into a payload is a damaged file, not a 500 -----------------


def test_a_payload_that_cannot_be_made_is_a_damaged_file(tmp_path):
    """The tier's `from_arrays` raising anything (a layout it cannot take): the block is a miss,
    deleted and counted; a tail likewise (ssd_tail_errors)."""
    store = SSDStore(tmp_path, NS)
    writer = SSDWriterThread(lambda *job: None)

    def from_arrays(named):
        raise RuntimeError("[concatenate] shapes differ")  # what mlx raised for a forged shape

    tier = SSDTier(store, writer, "write_through", dict, from_arrays, async_writes=False)
    try:
        h, tokens = b"\x0e" * 32, list(range(4))
        store.save_block(h, NS, tokens, arrays(4))
        assert tier.load_many([(h, tokens)]) == []
        assert store.stats()["ssd_corrupt"] == 1 and not (tmp_path / block_relpath(h)).exists()
        tier.save_tail(h, [7, 8], arrays(2))
        assert tier.load_tail(h, [7, 8, 9]) is None
        assert tier.tails.stats["ssd_tail_errors"] == 1 and not list(tier.tails.folder.rglob("*.safetensors"))
        store.check_integrity()
    finally:
        writer.stop(5)
