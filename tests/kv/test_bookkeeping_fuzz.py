"""Whatever is in the bookkeeping files before startup (the SSD index, pins, the shutdown record,
the fingerprint memo), the server starts, serves exactly the cold greedy text, keeps /health,
/v1/cache/stats and /metrics answering 200, and lists each damaged file on /health (issue 17,
items 2-4). In-process app on the tiny random model; one server start per case."""

from __future__ import annotations

import json
import os
import random
import shutil
import tempfile
from pathlib import Path
from typing import Any, NamedTuple

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from mlx_lm.utils import load
from starlette.testclient import TestClient

from mlx_kvserve.checked_json import parse_json
from mlx_kvserve.config import ApiKeys, load_config
from mlx_kvserve.engine.engine import Engine
from mlx_kvserve.kv.hashing import MEMO_SCHEMA
from mlx_kvserve.kv.pins import PINS_SCHEMA
from mlx_kvserve.kv.ssd.index import INDEX_SCHEMA
from mlx_kvserve.kv.ssd.shutdown_record import SHUTDOWN_SCHEMA
from mlx_kvserve.models.loader import LoadedModel
from mlx_kvserve.server.app import create_app

BS = 16
PROMPT = [(i * 37 + 11) % 250 + 3 for i in range(3 * BS + 5)]  # 3 blocks and a tail, as token ids
FILES = ("index.json", "pins.json", "shutdown.json", "fingerprints.json")


class Served(NamedTuple):
    text: str
    cached_tokens: int
    health: dict[str, Any]
    stats: dict[str, Any]
    metrics: str


def serve_once(loaded: LoadedModel, root: Path, pin: bool = False) -> Served:
    """Start a server on `root` (home and SSD cache), run PROMPT greedily, read /health,
    /v1/cache/stats and /metrics, stop (a clean shutdown)."""
    config = load_config(overrides={"cache": {"block_size": BS}, "ssd": {"cache_dir": str(root / "kv")}})
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MLX_KVSERVE_HOME", str(root / "home"))  # where the fingerprint memo lives
        engine = Engine(loaded, config)
    with TestClient(create_app(engine, ApiKeys("", ""))) as client:
        reply = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 8, "temperature": 0})
        assert reply.status_code == 200, reply.text
        if pin:
            manager = engine.prefix_cache.manager
            assert manager.pin(manager.hasher.hash_blocks(PROMPT)[-1:])
        answers = [client.get(path) for path in ("/health", "/v1/cache/stats", "/metrics")]
        assert [a.status_code for a in answers] == [200, 200, 200], [a.text[:300] for a in answers]
    body = reply.json()
    cached = body["usage"]["prompt_tokens_details"]["cached_tokens"]
    return Served(body["choices"][0]["text"], cached, answers[0].json(), answers[1].json(), answers[2].text)


def bookkeeping_paths(root: Path) -> dict[str, Path]:
    (namespace_dir,) = (root / "kv").iterdir()
    paths = {name: namespace_dir / name for name in FILES[:3]}
    paths["fingerprints.json"] = root / "home" / "fingerprints.json"
    return paths


class Seed(NamedTuple):
    root: Path  # after one clean run: blocks, tails, index, pins, shutdown record, memo
    cold: Served
    docs: dict[str, Any]  # each bookkeeping file's valid content


@pytest.fixture(scope="module")
def loaded(tiny_model_dir) -> LoadedModel:
    model, tokenizer = load(str(tiny_model_dir))
    return LoadedModel("tiny", tiny_model_dir, model, tokenizer, {}, 2048)


@pytest.fixture(scope="module")
def seed(loaded, tmp_path_factory) -> Seed:
    root = tmp_path_factory.mktemp("seed")
    cold = serve_once(loaded, root, pin=True)
    assert cold.cached_tokens == 0
    docs = {name: json.loads(path.read_text()) for name, path in bookkeeping_paths(root).items()}
    assert docs["pins.json"]["pins"] and docs["index.json"]["entries"] and docs["shutdown.json"]["shutdown_clean"]
    return Seed(root, cold, docs)


# --- the cases: each writes one kind of bad content into every bookkeeping file -------------------

LEAVES = {  # the value each "bad value" case replaces, per file
    "index.json": lambda doc: (doc["entries"][next(iter(doc["entries"]))], "num_tokens"),
    "pins.json": lambda doc: (doc["pins"], next(iter(doc["pins"]))),
    "shutdown.json": lambda doc: (doc, "shutdown_clean"),
    "fingerprints.json": lambda doc: (doc, next(iter(doc))),
}
# Raw JSON text none of the four leaves accepts (an int count, a bool, a hex digest).
BAD_VALUES = ["1e999", "-1e999", "NaN", "-Infinity", "9" * 5000, "null", "[]", "{}", '"zz"', "-1", "1.5", "[" * 5000]
GARBAGE = {
    "deep-list": b"[" * 200_000,
    "deep-object": b'{"a":' * 100_000,
    "empty": b"",
    "binary": random.Random(17).randbytes(4096),
    "not-utf8": b'\xff\xfe{"version": 1}',
    "top-level-list": b"[]",
    "top-level-null": b"null",
    "top-level-number": b"1e999",
}


def with_bad_value(doc: Any, name: str, raw: str) -> bytes:
    doc = json.loads(json.dumps(doc))
    holder, key = LEAVES[name](doc)
    holder[key] = "@@BAD@@"
    return json.dumps(doc).replace('"@@BAD@@"', raw).encode()


def damage(path: Path, case: str, seed: Seed, name: str) -> None:
    path.unlink()
    if case == "fifo":
        os.mkfifo(path)
    elif case == "directory":
        path.mkdir()
        (path / "inside").write_text("{}")
    elif case == "link-to-device":
        path.symlink_to("/dev/zero")
    elif case == "truncated":
        text = json.dumps(seed.docs[name]).encode()
        path.write_bytes(text[: len(text) // 2])
    elif case in GARBAGE:
        path.write_bytes(GARBAGE[case])
    else:
        path.write_bytes(with_bad_value(seed.docs[name], name, case))


CASES = ["fifo", "directory", "link-to-device", "truncated", *GARBAGE, *BAD_VALUES]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c if len(c) < 20 else c[:12] + "…")
def test_server_survives_damaged_bookkeeping_files(loaded, seed, tmp_path, case):
    root = tmp_path / "root"
    shutil.copytree(seed.root, root, symlinks=True)
    paths = bookkeeping_paths(root)
    for name, path in paths.items():
        damage(path, case, seed, name)

    served = serve_once(loaded, root)

    assert served.text == seed.cold.text
    assert served.cached_tokens >= 3 * BS  # the block files were adopted again: the cache still works
    damaged = {d["file"]: d for d in served.health["cache"]["damaged_files"]}
    assert sorted(damaged) == sorted(FILES), served.health["cache"]["damaged_files"]
    assert served.stats["damaged_files"] == served.health["cache"]["damaged_files"]
    for name, path in paths.items():
        entry = damaged[name]
        assert entry["reason"] and entry["moved_to"].startswith(f"{name}.damaged-")
        assert os.path.lexists(path.with_name(entry["moved_to"]))  # set aside, not lost
    assert served.health["cache"]["shutdown_clean"] is False  # the record was unreadable
    assert served.health["cache"]["kv_pinned_blocks"] == 0  # the pins were in the damaged file
    assert "mlx_kvserve_cache_enabled 1.0" in served.metrics


def test_rebuilt_files_are_used_by_the_next_start(loaded, seed, tmp_path):
    """After a start that set the damaged files aside, the next start finds valid files again."""
    root = tmp_path / "root"
    shutil.copytree(seed.root, root, symlinks=True)
    for name, path in bookkeeping_paths(root).items():
        damage(path, "deep-list", seed, name)
    serve_once(loaded, root)
    again = serve_once(loaded, root)
    assert again.text == seed.cold.text and again.cached_tokens >= 3 * BS
    assert again.health["cache"]["damaged_files"] == []
    assert again.health["cache"]["shutdown_clean"] is True


def test_bad_shutdown_record_fields_never_reach_health_or_metrics(loaded, seed, tmp_path):
    """Extra fields in a valid record used to be copied into the cache stats: a string
    `ssd_bytes` broke /metrics (500) for the whole run."""
    root = tmp_path / "root"
    shutil.copytree(seed.root, root, symlinks=True)
    record = {"shutdown_clean": True, "shutdown_partial_flush": False, "at": 1.0, "ssd_bytes": "lots", "kv_hits": []}
    bookkeeping_paths(root)["shutdown.json"].write_text(json.dumps(record))
    served = serve_once(loaded, root)
    cache = served.health["cache"]
    assert cache["shutdown_clean"] is True and cache["shutdown_partial_flush"] is False
    assert isinstance(cache["ssd_bytes"], int) and isinstance(cache["kv_hits"], int)
    assert cache["damaged_files"] == []  # extra fields are ignored, not damage
    assert "mlx_kvserve_cache_bytes" in served.metrics


# --- random content: hypothesis writes near-valid, arbitrary JSON or raw bytes into each file --------

JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=70),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=70), children, max_size=4),
    max_leaves=12,
)


def random_content(doc: Any, name: str) -> st.SearchStrategy[bytes]:
    near_valid = JSON_VALUES.map(lambda value: with_bad_value(doc, name, json.dumps(value)))
    return st.one_of(near_valid, JSON_VALUES.map(lambda v: json.dumps(v).encode()), st.binary(max_size=300))


def is_usable(name: str, data: bytes, namespace: str) -> bool:
    """The oracle: whether the owner would use this content (its declared schema, plus the namespace
    check of the index)."""
    schemas = {"index.json": INDEX_SCHEMA, "pins.json": PINS_SCHEMA, "shutdown.json": SHUTDOWN_SCHEMA}
    try:
        doc = parse_json(data, schemas.get(name, MEMO_SCHEMA))
    except ValueError:
        return False
    return name != "index.json" or doc["namespace"] == namespace


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_server_survives_random_bookkeeping_files(loaded, seed, data):
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "root"
        shutil.copytree(seed.root, root, symlinks=True)
        expected_damaged = set()
        for name, path in bookkeeping_paths(root).items():
            content = data.draw(random_content(seed.docs[name], name), label=name)
            path.write_bytes(content)
            if not is_usable(name, content, seed.docs["index.json"]["namespace"]):
                expected_damaged.add(name)
        served = serve_once(loaded, root)
    assert served.text == seed.cold.text
    assert {d["file"] for d in served.health["cache"]["damaged_files"]} == expected_damaged
    assert isinstance(served.health["cache"]["shutdown_clean"], (bool, type(None)))
