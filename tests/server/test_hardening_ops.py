"""Operations hardening (issue 17, items 9, 14, 15): one process per cache folder, private file
modes whatever the umask, and no API key in clear text in a service file."""

from __future__ import annotations

import os
import plistlib
import shutil
import signal
import stat
import subprocess
import sys
from pathlib import Path

import click
import mlx.core as mx
import pytest
from click.testing import CliRunner
from conftest import ROOT, free_port
from kvharness import greedy

from mlx_kvserve import cache_cli
from mlx_kvserve.cli import _overrides, cli
from mlx_kvserve.config import ApiKeys, load_api_keys, load_config
from mlx_kvserve.engine.engine import Engine
from mlx_kvserve.errors import ConfigError, ConflictError
from mlx_kvserve.fsmode import ensure_private_root
from mlx_kvserve.kv.hashing import namespace_hash
from mlx_kvserve.kv.ssd.folder_lock import LOCK_NAME, FolderBusyError, FolderLock
from mlx_kvserve.kv.ssd.format import TEMP_SUFFIX
from mlx_kvserve.kv.ssd.store import SaveResult, SSDStore, store_dir
from mlx_kvserve.kv.ssd.tails import SSDTailStore
from mlx_kvserve.service import commands

BS = 16
NAMESPACE = namespace_hash("hardening-ops", "float32", BS)


@pytest.fixture
def home(tmp_path, monkeypatch) -> Path:
    """The server's home (fingerprint memo; the default cache root is <home>/kv)."""
    monkeypatch.setenv("MLX_KVSERVE_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


@pytest.fixture
def umask():
    """Set the process umask for one test; restored afterwards."""
    old = os.umask(0o022)
    yield os.umask
    os.umask(old)


def _config(cache_dir: Path, **ssd):
    return load_config(overrides={"cache": {"block_size": BS}, "ssd": {"cache_dir": str(cache_dir), **ssd}})


def _prompt(tokenizer) -> list[int]:
    text = " ".join(f"Entry {i}: the harbour light number {i} shines at {i * 3} o'clock." for i in range(12))
    return tokenizer.encode(text)[: 3 * BS + BS // 2]  # three blocks and a tail


def _arrays(seed: int) -> dict[str, mx.array]:
    arrays = {"k": mx.arange(64, dtype=mx.float32) + seed, "v": mx.ones((4, 16)) * seed}
    mx.eval(arrays)
    return arrays


def _block_hash(i: int) -> bytes:
    return bytes([i]) * 32


def _modes(root: Path) -> dict[str, int]:
    """Mode bits of `root` and everything under it, by path relative to its parent."""
    paths = [root, *root.rglob("*")]
    return {str(p.relative_to(root.parent)): stat.S_IMODE(p.lstat().st_mode) for p in paths}


def _assert_private(modes: dict[str, int], root: Path) -> None:
    for rel, mode in modes.items():
        expected = 0o700 if (root.parent / rel).is_dir() else 0o600
        assert mode == expected, f"{rel}: {mode:04o}, expected {expected:04o}"


# --- item 9: one process per cache folder ----------------------------------------------------------


def test_a_second_engine_on_the_same_folder_joins_it_as_a_guest(tiny, home, tmp_path):
    """The folder's owner keeps pins, the index and the shutdown record; a guest reads and adds blocks."""
    config = _config(tmp_path / "kv")
    first = Engine(tiny, config)
    folder = first.folder_lock.folder
    first.prefix_cache.manager.pins.pin([_block_hash(1)])
    pins_before = (folder / "pins.json").read_bytes()

    second = Engine(tiny, config)
    assert first.folder_lock.is_owner and not second.folder_lock.is_owner
    assert second.prefix_cache.folder_owner == f"pid {os.getpid()}"
    assert second.local_cache_stats()["ssd_role"] == "guest" and first.local_cache_stats()["ssd_role"] == "owner"
    with pytest.raises(ConflictError) as refused:
        second.cache_admin().pin([_block_hash(1)])
    assert refused.value.status_code == 409 and f"pid {os.getpid()}" in refused.value.message
    second.stop()
    assert (folder / "pins.json").read_bytes() == pins_before  # the guest wrote none of the owner's state
    assert not (folder / "shutdown.json").exists()

    first.stop()
    assert not first.folder_lock.is_held and (folder / "shutdown.json").exists()
    third = Engine(tiny, config)  # the folder is free again: the next one owns it
    assert third.folder_lock.is_owner and third.prefix_cache.manager.pins.count(_block_hash(1)) == 1
    third.stop()


def test_blocks_one_server_writes_are_hits_for_the_other(tiny, home, tmp_path):
    """Two engines on one folder (owner + guest): what either writes, the other serves from the SSD
    with the same greedy output; the guest never deletes a file and the owner's index adopts its blocks."""
    config = _config(tmp_path / "kv")
    owner, guest = Engine(tiny, config), Engine(tiny, config)
    prompt = _prompt(tiny.tokenizer)
    other = list(reversed(prompt))
    try:
        cold = greedy(guest.scheduler, prompt, 6)
        hashes = guest.prefix_cache.manager.hasher.hash_blocks(prompt)
        assert hashes and _wait_for(lambda: all((guest.folder_lock.folder / _relpath(h)).is_file() for h in hashes))
        hit = greedy(owner.scheduler, prompt, 6)
        assert hit[:2] == cold[:2] and cold[2] == 0 and hit[2] >= (len(prompt) - 1) // BS * BS > 0
        owner_stats = owner.local_cache_stats()  # some blocks may be computed while the rest are read
        assert owner_stats["ssd_hits"] >= 1 and owner_stats["ssd_adopted"] >= 1

        cold_other = greedy(owner.scheduler, other, 6)
        other_hashes = owner.prefix_cache.manager.hasher.hash_blocks(other)
        assert _wait_for(lambda: all((owner.folder_lock.folder / _relpath(h)).is_file() for h in other_hashes))
        hit_other = greedy(guest.scheduler, other, 6)
        assert hit_other[:2] == cold_other[:2] and hit_other[2] >= (len(other) - 1) // BS * BS > cold_other[2]
        assert guest.local_cache_stats()["ssd_hits"] >= 1
    finally:
        guest.stop()
        owner.stop()
    restarted = Engine(tiny, config)  # the owner's index lists the guest's blocks
    try:
        assert restarted.local_cache_stats()["ssd_startup_validation"]["dropped_missing"] == 0
        restarted.prefix_cache.ssd_tier.store.check_integrity()
    finally:
        restarted.stop()


def test_folder_roles_owner_guests_and_offline_commands(tmp_path):
    """Servers share (one owner, any guests); an offline command needs the folder to itself."""
    folder = tmp_path / "ns"
    folder.mkdir()
    owner = FolderLock.acquire_server(folder)
    guest = FolderLock.acquire_server(folder)
    assert (owner.role, guest.role) == ("owner", "guest") and guest.owner.pid == os.getpid()
    assert owner.has_guests()
    with pytest.raises(FolderBusyError):
        FolderLock.acquire(folder, "cache verify")  # the owner holds it
    owner.release()
    with pytest.raises(FolderBusyError) as refused:
        FolderLock.acquire(folder, "cache verify")  # no owner, but a guest still reads and writes
    assert "guests" in refused.value.message
    guest.release()
    verify = FolderLock.acquire(folder, "cache verify")
    with pytest.raises(FolderBusyError) as refused:
        FolderLock.acquire_server(folder)  # neither owner nor guest while verify runs
    assert refused.value.holder.role == "cache verify"
    verify.release()
    alone = FolderLock.acquire_server(folder)
    assert alone.is_owner and not alone.has_guests()
    alone.release()


def test_a_guest_deletes_nothing(tmp_path):
    """A guest store never deletes: not temp files, not damaged blocks, not over the budget."""
    folder = store_dir(tmp_path / "kv", NAMESPACE)
    owner = SSDStore(folder, NAMESPACE)
    assert owner.save_block(_block_hash(1), NAMESPACE, list(range(BS)), _arrays(1)) is SaveResult.SAVED
    assert owner.flush()
    size = next(folder.glob("??/*.safetensors")).stat().st_size
    alien_temp = folder / "ab" / f"{'ab' * 32}.{os.getppid()}-3{TEMP_SUFFIX}"  # a live writer's
    alien_temp.parent.mkdir(exist_ok=True)
    alien_temp.write_bytes(b"in progress")
    junk = folder / "cd" / "not-a-block"
    junk.parent.mkdir(exist_ok=True)
    junk.write_bytes(b"junk")
    index_before = (folder / "index.json").read_bytes()
    guest = SSDStore(folder, NAMESPACE, max_bytes=size, is_owner=False)
    report = guest.validate_index()
    assert report.kept == 1 and junk.exists() and alien_temp.exists()
    assert guest.save_block(_block_hash(2), NAMESPACE, list(range(BS, 2 * BS)), _arrays(2)) is SaveResult.SKIPPED
    assert guest.prune_expired(now=1e12) == 0 and guest.flush()
    assert guest.remove_unpinned() == 1 and owner.contains(_block_hash(1))  # only its own view forgets it
    assert (folder / "index.json").read_bytes() == index_before and len(
        list(folder.glob("??/*[0-9a-f].safetensors"))
    ) == 1
    owner_again = SSDStore(folder, NAMESPACE)
    report = owner_again.validate_index(others_write=True)
    assert report.deleted_invalid == 1 and not junk.exists()
    assert alien_temp.exists()  # guests write here and its writer (our parent process) is alive
    assert owner_again.validate_index().deleted_temp == 1 and not alien_temp.exists()  # alone: a leftover


def _wait_for(condition, timeout_s: float = 60.0) -> bool:
    import time

    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def _relpath(block_hash: bytes) -> str:
    from mlx_kvserve.kv.ssd.format import block_relpath

    return block_relpath(block_hash)


def test_the_lock_dies_with_its_holder_even_under_kill_9(tmp_path):
    folder = tmp_path / "ns"
    folder.mkdir()
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time\n"
            "from mlx_kvserve.kv.ssd.folder_lock import FolderLock\n"
            f"lock = FolderLock.acquire({str(folder)!r}, 'server')\n"
            "print('locked', flush=True)\n"
            "time.sleep(120)\n",
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(FolderBusyError) as refused:
            FolderLock.acquire(folder, "server")
        assert refused.value.holder.pid == holder.pid and refused.value.holder.role == "server"
        assert f"pid {holder.pid}" in refused.value.message
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait(10)
    lock = FolderLock.acquire(folder, "server")  # no stale lock after kill -9
    assert stat.S_IMODE((folder / LOCK_NAME).stat().st_mode) == 0o600
    lock.release()
    lock.release()  # idempotent


def test_run_exits_non_zero_naming_the_holder_when_an_offline_command_holds_the_folder(tiny, home, tmp_path):
    """`mlx-kvserve run` in a second process on a folder `cache verify` holds: exit 1, the pid on stderr."""
    holder = Engine(tiny, _config(home / "kv"))  # the default cache root of `home`
    folder = holder.folder_lock.folder
    holder.stop()
    verify = FolderLock.acquire(folder, "cache verify")
    try:
        env = dict(os.environ, MLX_KVSERVE_HOME=str(home), MLX_KVSERVE_FAST_BLAS="0")
        cmd = [sys.executable, "-m", "mlx_kvserve", "run", "--model", str(tiny.path), "--port", str(free_port())]
        cmd += ["--config", str(_write(tmp_path / "bs.toml", f"[cache]\nblock_size = {BS}\n"))]
        result = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    finally:
        verify.release()
    assert result.returncode == 1, result.stderr
    assert f"Error: the cache folder {folder} is in use" in result.stderr
    assert f"(pid {os.getpid()}, cache verify)" in result.stderr
    assert "ERROR" in result.stderr  # logged as well as printed


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def _store_with_a_temp_file(root: Path) -> tuple[Path, Path]:
    """A store folder with one block and a writer's temp file in progress: (folder, temp file)."""
    folder = store_dir(root, NAMESPACE)
    store = SSDStore(folder, NAMESPACE)
    assert store.save_block(_block_hash(1), NAMESPACE, list(range(BS)), _arrays(1)) is SaveResult.SAVED
    assert store.flush()
    temp = folder / _block_hash(2).hex()[:2] / f"{_block_hash(2).hex()}.{os.getpid()}-7{TEMP_SUFFIX}"
    temp.parent.mkdir(exist_ok=True)
    temp.write_bytes(b"a block being written")
    return folder, temp


def test_verify_changes_nothing_while_a_server_holds_the_folder(tmp_path):
    root = tmp_path / "kv"
    folder, temp = _store_with_a_temp_file(root)
    index_before = (folder / "index.json").read_bytes()
    server = FolderLock.acquire(folder, "server")

    result = CliRunner().invoke(cli, ["cache", "verify", "--dir", str(root)])
    assert result.exit_code == 2, result.output
    assert f"pid {os.getpid()}, server" in result.stderr and "changed nothing" in result.stderr
    assert temp.exists() and (folder / "index.json").read_bytes() == index_before

    server.release()
    result = CliRunner().invoke(cli, ["cache", "verify", "--dir", str(root)])
    assert result.exit_code == 1, result.output  # now it runs: the leftover temp file is a problem
    assert not temp.exists()


def test_verify_holds_the_lock_while_it_runs_and_releases_it(tmp_path, monkeypatch):
    root = tmp_path / "kv"
    folder, _ = _store_with_a_temp_file(root)
    seen: list[str] = []
    real = cache_cli._verify_folder

    def verify_folder(path, namespace):
        with pytest.raises(FolderBusyError) as refused:  # a server starting now is refused
            FolderLock.acquire(path, "server")
        seen.append(refused.value.holder.role)
        return real(path, namespace)

    monkeypatch.setattr(cache_cli, "_verify_folder", verify_folder)
    assert CliRunner().invoke(cli, ["cache", "verify", "--dir", str(root)]).exit_code == 1
    assert seen == ["cache verify"]
    FolderLock.acquire(folder, "server").release()  # free once verify is done


# --- item 14: private modes whatever the umask -----------------------------------------------------


@pytest.mark.parametrize("mask", [0o000, 0o022])
def test_everything_the_server_writes_is_private(tiny, home, tmp_path, umask, mask):
    umask(mask)
    root = tmp_path / "kv"
    engine = Engine(tiny, _config(root))
    prompt = _prompt(tiny.tokenizer)
    greedy(engine.scheduler, prompt, 4)
    manager = engine.prefix_cache.manager
    manager.pins.pin(manager.hasher.hash_blocks(prompt)[:1])
    engine.stop()  # drains the writer: blocks, tails, index, shutdown record

    folder = engine.folder_lock.folder
    names = {p.name for p in folder.iterdir()}
    assert {"index.json", "pins.json", "shutdown.json", "tails", LOCK_NAME} <= names
    assert list(folder.glob("??/*.safetensors")) and list(folder.glob("tails/*/*.safetensors"))
    _assert_private(_modes(root), root)
    _assert_private(_modes(home), home)  # the home and its fingerprint memo, created by the server
    assert (home / "fingerprints.json").is_file()


def test_folders_removed_while_running_are_recreated_private(tmp_path, umask):
    umask(0o000)
    root = tmp_path / "kv"
    folder = store_dir(root, NAMESPACE)
    store = SSDStore(folder, NAMESPACE)
    tails = SSDTailStore(folder / "tails", NAMESPACE)
    assert store.save_block(_block_hash(1), NAMESPACE, list(range(BS)), _arrays(1)) is SaveResult.SAVED
    shutil.rmtree(root)  # an operator clears the cache while the server runs

    assert tails.save(_block_hash(2), [1, 2, 3], _arrays(3)) is SaveResult.SAVED  # root, folder, tails/<parent>/
    assert store.save_block(_block_hash(2), NAMESPACE, list(range(BS)), _arrays(2)) is SaveResult.SAVED  # shard
    assert store.flush()
    assert {p.name for p in folder.iterdir()} >= {"index.json", "tails", _block_hash(2).hex()[:2]}
    _assert_private(_modes(root), root)


@pytest.mark.parametrize("mode", [0o755, 0o750, 0o701])
def test_an_existing_shared_cache_dir_is_refused_not_chmodded(tmp_path, mode):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(mode)
    with pytest.raises(ConfigError) as refused:
        ensure_private_root(shared, "ssd.cache_dir")
    assert f"ssd.cache_dir {shared} is open to other users (mode {mode:04o})" in refused.value.message
    assert f"chmod 700 {shared}" in refused.value.message
    assert stat.S_IMODE(shared.stat().st_mode) == mode and not any(shared.iterdir())
    shared.chmod(0o700)
    ensure_private_root(shared, "ssd.cache_dir")  # a private one is used as it is


def test_the_engine_refuses_a_shared_cache_dir(tiny, home, tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o755)
    with pytest.raises(ConfigError, match="is open to other users"):
        Engine(tiny, _config(shared))
    assert stat.S_IMODE(shared.stat().st_mode) == 0o755 and not any(shared.iterdir())
    file = tmp_path / "a-file"
    file.write_text("")
    with pytest.raises(ConfigError, match="is not a folder"):
        Engine(tiny, _config(file))


# --- item 15: the service's API keys live in 0600 files ------------------------------------------

API_KEY, ADMIN_KEY = "sk-service-inference-0123456789", "sk-service-admin-9876543210"


@pytest.fixture
def service_home(tmp_path, monkeypatch, umask) -> Path:
    umask(0o000)  # the key file must be private whatever the umask
    home = tmp_path / "user"
    monkeypatch.setenv("HOME", str(home))
    for name in [k for k in os.environ if k.startswith("MLX_KVSERVE_")]:
        monkeypatch.delenv(name)
    for name in ("XDG_CACHE_HOME", "XDG_STATE_HOME", "XDG_CONFIG_HOME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("MLX_KVSERVE_API_KEY", API_KEY)
    monkeypatch.setenv("MLX_KVSERVE_ADMIN_API_KEY", ADMIN_KEY)
    monkeypatch.setattr(commands, "run_command", lambda args, **kw: subprocess.CompletedProcess(args, 0, "", ""))
    return home


def _service_env(platform: str, service_file: Path) -> dict[str, str]:
    """The MLX_KVSERVE_* variables the service starts with."""
    if platform == "macos":
        env = plistlib.loads(service_file.read_bytes())["EnvironmentVariables"]
    else:
        lines = [line.removeprefix("Environment=") for line in service_file.read_text().splitlines()]
        env = dict(line.split("=", 1) for line in lines if line.startswith("MLX_KVSERVE_"))
    return {k: v for k, v in env.items() if k.startswith("MLX_KVSERVE_")}


@pytest.mark.parametrize("platform", ["macos", "linux"])
def test_install_puts_the_keys_in_private_files_not_in_the_service_file(service_home, platform, monkeypatch):
    result = CliRunner().invoke(cli, ["service", "install", "--platform", platform, "--label", "kv"])
    assert result.exit_code == 0, result.output
    if platform == "macos":
        service_file = service_home / "Library" / "LaunchAgents" / "kv.plist"
    else:
        service_file = service_home / ".config" / "systemd" / "user" / "kv.service"
    text = service_file.read_text()
    assert API_KEY not in text and ADMIN_KEY not in text and API_KEY not in result.output

    keys = service_home / ".config" / "mlx-kvserve"
    assert stat.S_IMODE(keys.stat().st_mode) == 0o700
    for name, key in (("kv.api.key", API_KEY), ("kv.admin.key", ADMIN_KEY)):
        assert stat.S_IMODE((keys / name).stat().st_mode) == 0o600
        assert (keys / name).read_text().strip() == key
    env = _service_env(platform, service_file)
    assert env == {
        "MLX_KVSERVE_API_KEY_FILE": str(keys / "kv.api.key"),
        "MLX_KVSERVE_ADMIN_API_KEY_FILE": str(keys / "kv.admin.key"),
    }

    # The server started with that environment reads both keys from the files.
    monkeypatch.delenv("MLX_KVSERVE_API_KEY")
    monkeypatch.delenv("MLX_KVSERVE_ADMIN_API_KEY")
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert load_api_keys(load_config(None, _overrides(None, None, None, None)).server) == ApiKeys(API_KEY, ADMIN_KEY)

    result = CliRunner().invoke(cli, ["service", "uninstall", "--platform", platform, "--label", "kv"])
    assert result.exit_code == 0, result.output
    assert not (keys / "kv.api.key").exists() and not (keys / "kv.admin.key").exists()


@pytest.mark.parametrize("platform", ["macos", "linux"])
def test_dry_run_shows_neither_the_key_nor_writes_its_file(service_home, platform):
    result = CliRunner().invoke(cli, ["service", "install", "--dry-run", "--platform", platform, "--label", "kv"])
    assert result.exit_code == 0, result.output
    assert API_KEY not in result.output and ADMIN_KEY not in result.output
    key_file = service_home / ".config" / "mlx-kvserve" / "kv.api.key"
    assert f"# would write the key from $MLX_KVSERVE_API_KEY to {key_file} (mode 0600; not shown)" in result.output
    assert "MLX_KVSERVE_API_KEY_FILE" in result.output and f"{key_file}" in result.output.split("would write")[-1]
    assert not service_home.exists()


def test_install_refuses_a_key_and_a_key_file_together(service_home, tmp_path, monkeypatch):
    monkeypatch.setenv("MLX_KVSERVE_API_KEY_FILE", str(tmp_path / "other.key"))
    result = CliRunner().invoke(cli, ["service", "install", "--platform", "linux"])
    assert result.exit_code == 1
    assert "set $MLX_KVSERVE_API_KEY or $MLX_KVSERVE_API_KEY_FILE, not both" in result.output
    assert not service_home.exists()
    with pytest.raises(click.UsageError, match="not both"):  # `run` refuses the same pair
        _overrides(None, None, None, None)
