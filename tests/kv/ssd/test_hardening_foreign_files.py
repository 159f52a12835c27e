"""Foreign files and numbers in the cache folder (issue 23, bugs 4 and 5, the leases weakness).

A FIFO, a device, a folder or a link where the server expects a block file or a temp file is never
waited on: a block is a miss (served by recomputing), a temp file is replaced. Numbers read from
disk are bounded: a subnormal speed in speeds.json, a lease expiring in 1e300, an access time in the
future. A C call blocked in open() holds the GIL, so no thread can time it out: `promptly` has a
child process open the FIFO's other end after a while, and fails the test if that was needed."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from kvharness import greedy
from test_hardening_files import NS, X, arrays, saved_store, set_aside_copies
from test_server_ssd import wait_written

from mlx_kvserve.config import load_config
from mlx_kvserve.engine.cache.front_prefill import SPEEDS_FILE, FrontPrefill
from mlx_kvserve.engine.engine import Engine
from mlx_kvserve.kv.hashing import model_fingerprint
from mlx_kvserve.kv.leases import LEASES_FILE, PinLeases
from mlx_kvserve.kv.pins import PinRegistry
from mlx_kvserve.kv.ssd.format import atomic_write, block_relpath, read_block_file, read_header, tail_key
from mlx_kvserve.kv.ssd.index import INDEX_NAME
from mlx_kvserve.kv.ssd.shutdown_record import SHUTDOWN_FILE, write_shutdown_record
from mlx_kvserve.kv.ssd.store import SSDStore
from mlx_kvserve.kv.ssd.tails import SSDTailStore
from mlx_kvserve.safe_files import NotRegularFileError, create_new, open_regular

ONE_HOUR = 3600.0  # the longest cache_control TTL
LIMIT_S = 10.0  # far above any of these calls; the unblocker acts only after it
UNBLOCK = """
import os, sys, time
time.sleep(float(sys.argv[1]))
for _ in range(60):  # whoever waits on a FIFO here: a reader gets EOF, a writer a reader
    for path in sys.argv[2:]:
        try:
            os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
        except OSError:
            pass
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
            time.sleep(0.5)
            os.close(fd)
        except OSError:
            pass
    time.sleep(0.5)
"""


def promptly(fn, *fifos: Path):
    """fn()'s result (or its exception, raised here); fails instead of hanging when fn waits on
    one of `fifos`."""
    child = subprocess.Popen([sys.executable, "-c", UNBLOCK, str(LIMIT_S), *map(str, fifos)])
    outcome: list = []

    def run() -> None:
        try:
            outcome.append((True, fn()))
        except BaseException as exc:  # passed back as a value, raised in the test's thread
            outcome.append((False, exc))

    start = time.monotonic()
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        thread.join(LIMIT_S + 60)
    finally:
        elapsed = time.monotonic() - start
        child.kill()
        child.wait()
    assert outcome and elapsed < LIMIT_S, f"{fn} waited {elapsed:.1f} s on a FIFO"
    ok, value = outcome[0]
    if not ok:
        raise value
    return value


def fifo_at(path: Path) -> Path:
    path.unlink(missing_ok=True)
    os.mkfifo(path)
    return path


# --- the helpers themselves -------------------------------------------------------------------------


def test_only_regular_files_are_opened_and_temp_paths_are_taken_over(tmp_path):
    fifo, folder, link = fifo_at(tmp_path / "fifo"), tmp_path / "folder", tmp_path / "link"
    folder.mkdir()
    (tmp_path / "target").write_text("outside")
    link.symlink_to(tmp_path / "target")
    for path, kind in ((fifo, "a FIFO"), (folder, "a directory"), (link, "a link"), ("/dev/null", "character")):
        with pytest.raises(NotRegularFileError, match=kind):
            promptly(lambda p=path: open_regular(p), fifo)
    with os.fdopen(open_regular(link, follow_links=True)) as f:
        assert f.read() == "outside"
    for path in (fifo, link, tmp_path / "stale", tmp_path / "empty"):
        (tmp_path / "stale").write_text("old")
        (tmp_path / "empty").mkdir(exist_ok=True)
        fd = promptly(lambda p=path: create_new(p), fifo)
        os.write(fd, b"new")
        os.close(fd)
        assert path.read_bytes() == b"new" and not path.is_symlink() and (path.stat().st_mode & 0o777) == 0o600
    assert (tmp_path / "target").read_text() == "outside"  # a link is replaced, never written through


# --- bug 4: temp files of every writer ----------------------------------------------------------------


def test_a_fifo_at_the_pins_temp_file_does_not_freeze_pinning(tmp_path):
    pins = PinRegistry(tmp_path / "pins.json")
    fifo = fifo_at(tmp_path / ".pins.json.tmp")  # after startup, which removes leftovers
    promptly(lambda: pins.pin([X]), fifo)
    assert PinRegistry(tmp_path / "pins.json").count(X) == 1 and not fifo.exists()


def test_a_fifo_at_the_index_temp_file_does_not_stall_the_flush(tmp_path):
    store, hashes = saved_store(tmp_path)
    store.load_block(hashes[0], list(range(4)))  # a change to flush
    fifo = fifo_at(tmp_path / f"{INDEX_NAME}.{os.getpid()}.tmp")
    assert promptly(store.flush, fifo)
    assert not fifo.exists() and len(json.loads((tmp_path / INDEX_NAME).read_text())["entries"]) == 3


@pytest.mark.parametrize("writer", ["shutdown", "leases", "speeds", "memo", "tail"])
def test_a_fifo_at_any_other_temp_file_is_replaced(tmp_path, writer):
    if writer == "shutdown":
        fifo, call = tmp_path / f".{SHUTDOWN_FILE}.tmp", lambda: write_shutdown_record(tmp_path, True, False)
        made = tmp_path / SHUTDOWN_FILE
    elif writer == "leases":
        leases = PinLeases(tmp_path / LEASES_FILE)
        fifo, call, made = tmp_path / f".{LEASES_FILE}.tmp", lambda: leases.grant([X], 300.0), tmp_path / LEASES_FILE
    elif writer == "speeds":
        made = tmp_path / SPEEDS_FILE
        fifo, call = tmp_path / f"{SPEEDS_FILE}.{os.getpid()}.tmp", lambda: atomic_write(made, b"{}")
    elif writer == "memo":
        (tmp_path / "model").mkdir()
        (tmp_path / "model" / "config.json").write_text("{}")
        made = tmp_path / "fingerprints.json"
        fifo, call = made.with_suffix(f".tmp{os.getpid()}"), lambda: model_fingerprint(tmp_path / "model", made)
    else:
        tails = SSDTailStore(tmp_path / "tails", NS)
        key = tail_key(X, [1, 2, 3])
        (tmp_path / "tails" / X.hex()).mkdir(parents=True)
        fifo, call = (
            tmp_path / "tails" / X.hex() / f".{key.hex()}.{os.getpid()}.tmp.safetensors",
            lambda: tails.save(X, [1, 2, 3], arrays(3)),
        )
        made = tmp_path / "tails" / X.hex() / f"{key.hex()}.safetensors"
    fifo_at(fifo)
    promptly(call, fifo)
    assert made.is_file() and not fifo.exists()


# --- bug 4: a block file that is not a regular file -------------------------------------------------


@pytest.mark.parametrize("kind", ["fifo", "link", "directory"])
def test_a_block_file_that_is_not_a_regular_file_is_a_miss_and_removed(tmp_path, kind):
    store, hashes = saved_store(tmp_path)
    path = tmp_path / block_relpath(hashes[1])
    good = path.read_bytes()
    path.unlink()
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "link":
        (tmp_path / "elsewhere").write_bytes(good)
        path.symlink_to(tmp_path / "elsewhere")
    else:
        path.mkdir()
    with pytest.raises(OSError):
        promptly(lambda: read_header(path, NS), path)
    wanted = [(h, list(range(4 * i, 4 * i + 4))) for i, h in enumerate(hashes)]
    assert len(promptly(lambda: store.load_blocks(wanted), path)) == 1  # the chain stops at the foreign file
    assert store.stats()["ssd_corrupt"] == 1 and (kind == "directory" or not os.path.lexists(path))
    assert (kind != "link") or (tmp_path / "elsewhere").read_bytes() == good  # never followed nor deleted


BS, NUM_BLOCKS, MAX_TOKENS = 16, 6, 8


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


def _stop(engine: Engine, timeout: float = 30) -> None:
    OPEN_ENGINES.remove(engine)
    engine.stop(timeout)


def _engine(tiny, root: Path, **ssd) -> Engine:
    overrides = {"cache": {"block_size": BS}, "ssd": {"cache_dir": str(root), **ssd}}
    engine = Engine(tiny, load_config(overrides=overrides))
    OPEN_ENGINES.append(engine)
    return engine


@pytest.fixture(scope="module")
def stored(tiny, tmp_path_factory):
    """A cache folder holding one prompt's blocks, the prompt and its cold output."""
    root = tmp_path_factory.mktemp("kv")
    text = " ".join(f"Step {i}: move disk {i % 3} from peg {i % 2} to peg {(i + 1) % 3}." for i in range(40))
    prompt = tiny.tokenizer.encode(text)[: NUM_BLOCKS * BS + 5]
    engine = _engine(tiny, root)
    cold = greedy(engine.scheduler, prompt, MAX_TOKENS)
    _stop(engine)
    return root, prompt, cold[0]


def _copy(stored, tmp_path) -> tuple[Path, Path]:
    """A copy of the stored cache root, and its namespace folder."""
    root = tmp_path / "kv"
    shutil.copytree(stored[0], root)
    return root, next(p.parent for p in root.rglob(INDEX_NAME))


def test_a_fifo_in_place_of_a_block_is_served_by_recomputing(tiny, stored, tmp_path):
    """The issue's repro: mx.load blocked in open() holding the GIL, and every request timed out."""
    root, folder = _copy(stored, tmp_path)
    _, prompt, cold = stored
    engine = _engine(tiny, root, compute_while_loading=False)
    hashes = engine.prefix_cache.manager.hasher.hash_blocks(prompt)
    fifo = fifo_at(folder / block_relpath(hashes[2]))
    ids, _, cached = promptly(lambda: greedy(engine.scheduler, prompt, MAX_TOKENS), fifo)
    assert ids == cold and cached == 2 * BS
    stats = engine.local_cache_stats()
    assert stats["ssd_corrupt"] == 1 and stats["ssd_hits"] == 2
    # The FIFO is gone: deleted, or already replaced by the recomputed block the writer saved after
    # the request (a race with the check); then the file there is that block, intact.
    if os.path.lexists(fifo):
        namespace, key = engine.prefix_cache.manager.hasher.namespace, engine.prefix_cache.ssd_tier.store.key
        assert read_block_file(fifo, namespace, hashes[2], key=key)[0].token_ids == tuple(prompt[2 * BS : 3 * BS])


def test_shutdown_completes_with_fifos_at_the_index_and_record_temp_files(tiny, stored, tmp_path):
    root, folder = _copy(stored, tmp_path)
    engine = _engine(tiny, root)
    greedy(engine.scheduler, stored[1][:40], 2)  # a use for the index to record
    fifos = [fifo_at(folder / f"{INDEX_NAME}.{os.getpid()}.tmp"), fifo_at(folder / f".{SHUTDOWN_FILE}.tmp")]
    promptly(lambda: _stop(engine), *fifos)
    assert json.loads((folder / SHUTDOWN_FILE).read_text())["shutdown_clean"] is True
    again = _engine(tiny, root)
    assert again.local_cache_stats()["shutdown_clean"] is True


# --- bug 5: numbers read from disk ------------------------------------------------------------------


@pytest.mark.parametrize("read", ["5e-324", "1e999", "-1", "1e300"])
def test_an_out_of_range_speed_is_set_aside_and_the_ssd_hit_served(tiny, stored, tmp_path, read):
    root, folder = _copy(stored, tmp_path)
    _, prompt, cold = stored
    (folder / SPEEDS_FILE).write_text(f'{{"blocks_read_per_s": {read}, "prefill_tokens_per_s": 5000.0}}')
    engine = _engine(tiny, root)
    ids, _, cached = greedy(engine.scheduler, prompt, MAX_TOKENS)
    assert ids == cold and cached == len(prompt) - 1
    stats = engine.local_cache_stats()
    assert [d["file"] for d in stats["damaged_files"]] == [SPEEDS_FILE]
    _stop(engine)
    saved = json.loads((folder / SPEEDS_FILE).read_text()) if (folder / SPEEDS_FILE).exists() else {}
    assert all(1e-3 <= v <= 1e9 for v in saved.values())  # never written back


@pytest.mark.parametrize("odd", [5e-324, float("inf"), float("nan"), -1.0, 0.0])
def test_the_split_is_always_a_whole_share_of_the_blocks(odd):
    for read, prefill in ((odd, 1600.0), (100.0, odd), (odd, odd)):
        front = FrontPrefill(None, None, BS, 512, lambda r=read: r, lambda p=prefill: p)
        assert 0 <= front.blocks_to_compute(0, 100) <= 100


def test_an_access_time_in_the_future_reads_as_now(tmp_path):
    saved_store(tmp_path)
    doc = json.loads((tmp_path / INDEX_NAME).read_text())
    for entry in doc["entries"].values():
        entry["last_accessed"] = 1e300
    (tmp_path / INDEX_NAME).write_text(json.dumps(doc))
    store = SSDStore(tmp_path, NS, ttl_s=60.0, clock=lambda: 1000.0)
    assert store.prune_expired(now=1061.0) == 3  # none "used in the future" outlives the TTL


# --- leases.json -------------------------------------------------------------------------------------


def _write_leases(path: Path, leases: dict[bytes, tuple[int, float, float]]) -> None:
    """{tag: (chain length, ttl_s, expires)}, each chain of `tag`-tagged hashes."""
    doc = {"version": 1, "leases": {}}
    for tag, (n, ttl, expires) in leases.items():
        chain = [tag * 31 + bytes([i]) for i in range(n)]
        doc["leases"][chain[-1].hex()] = {"chain": b"".join(chain).hex(), "ttl_s": ttl, "expires": expires}
    path.write_text(json.dumps(doc))


def test_a_lease_from_the_file_never_outlives_its_ttl(tmp_path):
    now = [1000.0]
    path = tmp_path / LEASES_FILE
    _write_leases(path, {b"a": (2, 300.0, 1e300), b"b": (2, 86400.0 * 7, 1e300)})
    leases = PinLeases(path, clock=lambda: now[0])
    assert sorted(item["expires_in_s"] for item in leases.items()) == [300.0, ONE_HOUR]
    now[0] += ONE_HOUR + 1
    assert leases.items() == [] and not leases.covers(b"a" * 31 + b"\x00")


def test_leases_are_refitted_to_the_cap_at_load(tmp_path):
    path = tmp_path / LEASES_FILE
    leases = PinLeases(path, max_bytes=10 * 100, clock=lambda: 1000.0)
    for tag in (b"a", b"b", b"c"):
        leases.grant([tag * 31 + bytes([i]) for i in range(3)], 300.0, block_bytes=100)
    assert len(leases) == 9
    smaller = PinLeases(path, max_bytes=4 * 100, clock=lambda: 1000.0)  # the share shrank meanwhile
    assert len(smaller) == 3 and smaller.released_for_room == 2


def test_a_damaged_leases_file_is_listed_in_damaged_files(tiny, stored, tmp_path):
    root, folder = _copy(stored, tmp_path)
    (folder / LEASES_FILE).write_text('{"version": 1, "leases": {"' + "ab" * 32 + '": 7}}')
    engine = _engine(tiny, root)
    damaged = engine.local_cache_stats()["damaged_files"]
    assert [d["file"] for d in damaged] == [LEASES_FILE] and set_aside_copies(folder / LEASES_FILE)


# --- the repro, as a user runs it: a server process, requests, SIGTERM -----------------------


def test_a_server_with_fifos_in_its_folder_answers_and_exits_on_sigterm(start_server, tiny_model_dir, tmp_path):
    server = start_server(tiny_model_dir, home=tmp_path / "home")
    system = " ".join(f"Rule {i}: keep harbour {i} clear of boats." for i in range(30))

    def chat() -> tuple[str, int]:
        body = {"messages": [{"role": "system", "content": system}, {"role": "user", "content": "Hi"}], "max_tokens": 8}
        r = httpx.post(f"{server.base_url}/v1/chat/completions", json=body | {"temperature": 0}, timeout=LIMIT_S)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["message"]["content"], r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    text, _ = chat()
    blocks = wait_written(server)["ssd_blocks"]
    files = [p for p in (tmp_path / "home" / "kv").rglob("*.safetensors") if len(p.parent.name) == 2]
    assert len(files) == blocks > 0
    for path in files:
        fifo_at(path)
    folder = files[0].parent.parent
    httpx.post(f"{server.base_url}/v1/cache/flush", json={}, timeout=LIMIT_S).raise_for_status()  # RAM: gone
    assert chat() == (text, 0)  # every block a FIFO: all recomputed, in time
    assert httpx.get(f"{server.base_url}/health", timeout=LIMIT_S).json()["cache"]["ssd_corrupt"] == 1
    fifo_at(folder / ".pins.json.tmp")
    r = httpx.post(f"{server.base_url}/v1/cache/pin", json={"prompt": system}, timeout=LIMIT_S)
    assert r.status_code == 200, r.text
    fifo_at(folder / f"{INDEX_NAME}.{server.proc.pid}.tmp")
    fifo_at(folder / f".{SHUTDOWN_FILE}.tmp")
    server.proc.send_signal(signal.SIGTERM)
    assert server.proc.wait(LIMIT_S) == 0
    assert json.loads((folder / SHUTDOWN_FILE).read_text())["shutdown_clean"] is True
