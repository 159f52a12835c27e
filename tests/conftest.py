import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).parent))
# The tests sit in folders that mirror the package (tests/kv/ssd/ for mlx_kvserve/kv/ssd/); a test module
# shares fixtures with another by name (`from test_api_tools import tool_engine`), wherever either sits.
for _test in sorted(Path(__file__).parent.rglob("test_*.py")):
    if str(_test.parent) not in sys.path:
        sys.path.append(str(_test.parent))
# scripts/harness is the support package the benches and the tests share (servers, free_port, the
# synthetic models, the engine stack); tests import `harness`, never a bench script module.
sys.path.insert(0, str(ROOT / "scripts"))

import tinymodel  # noqa: E402
from harness.kvstack import OPEN_TIERS  # noqa: E402
from harness.servers import free_port  # noqa: E402  (re-exported: tests import it from conftest)


@pytest.fixture(autouse=True, scope="session")
def _testclient_host():
    """Starlette's TestClient, and the SDK clients tests point at it, send `Host: testserver`: tests
    answer that name as a loopback one. Production never does (server/local_guard.py; its tests
    put the real names back)."""
    from mlx_kvserve.server import local_guard

    names = local_guard.LOOPBACK_NAMES
    local_guard.LOOPBACK_NAMES = names | {"testserver"}
    yield
    local_guard.LOOPBACK_NAMES = names


@pytest.fixture(autouse=True)
def _mlx_attention_put_back():
    """cpu/attention.py replaces MLX's attention process-wide: a test that installs it must put MLX's back,
    or the tests after it would run another attention than they do alone. Restored, and the test fails."""
    import mlx.core as mx

    mlx_attention = mx.fast.scaled_dot_product_attention
    yield
    if mx.fast.scaled_dot_product_attention is not mlx_attention:
        mx.fast.scaled_dot_product_attention = mlx_attention
        pytest.fail("left mx.fast.scaled_dot_product_attention replaced (cpu/attention.py: uninstall())")


@pytest.fixture(autouse=True)
def _close_ssd_tiers():
    """SSD writer threads are non-daemon (by design): a failing test must not leave one running,
    or the test process would never exit."""
    yield
    while OPEN_TIERS:
        tier = OPEN_TIERS.pop()
        if tier.writer.is_alive:
            tier.writer.stop(5)


def pytest_sessionfinish(session, exitstatus):
    """An Engine a failing test left running keeps its non-daemon worker and SSD writer threads:
    stop them here (after the report), or the test process would wait for them forever at exit."""
    import gc

    from mlx_kvserve.engine.engine import Engine
    from mlx_kvserve.kv.ssd.writer import SSDWriterThread

    live = [o for o in gc.get_objects() if isinstance(o, Engine | SSDWriterThread)]
    for obj in sorted(live, key=lambda o: isinstance(o, SSDWriterThread)):  # engines first: they stop their writers
        try:
            if isinstance(obj, Engine) and obj.worker.is_alive:
                obj.stop(5)
            elif isinstance(obj, SSDWriterThread) and obj.is_alive:
                obj.stop(5)
        except Exception as exc:  # a broken engine must not hide the report
            print(f"conftest: could not stop {type(obj).__name__}: {exc}", file=sys.stderr)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    return tinymodel.build_mlx_model(tmp_path_factory.mktemp("tiny") / "tiny-llama")


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    """The tiny random model loaded, as the engine's tests build an Engine from it (one per test module)."""
    from mlx_lm import load

    from mlx_kvserve.models.loader import LoadedModel

    model, tokenizer = load(str(tiny_model_dir))
    return LoadedModel("tiny", tiny_model_dir, model, tokenizer, {}, 2048)


@pytest.fixture(scope="session")
def smollm_dir() -> Path:
    """The real default model, fetched and converted once into the user's model cache."""
    from mlx_kvserve.config import default_home
    from mlx_kvserve.models.default import ensure_default_model

    return ensure_default_model(default_home() / "models", "float32")


class ServerProcess:
    """`mlx-kvserve run` in a child process on a free port, with its own home directory."""

    def __init__(self, model: Path | str, home: Path, *extra: str, config: Path | None = None):
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "mlx_kvserve", "run", "--model", str(model), "--port", str(self.port)]
        if config:
            cmd += ["--config", str(config)]
        env = dict(os.environ, MLX_KVSERVE_HOME=str(home), PYTHONUNBUFFERED="1")
        self.log_path = home / f"server-{self.port}.log"
        home.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen([*cmd, *extra], cwd=ROOT, env=env, stdout=self._log, stderr=subprocess.STDOUT)

    def wait_ready(self, timeout: float = 180.0) -> "ServerProcess":
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(f"{self.base_url}/health", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"server not ready after {timeout}s:\n{self.log()}")

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text()

    def stop(self, timeout: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode


def _server_starter(make_home):
    """Yield a `start(model, *extra, config=None, home=None)` function; stop every server it started."""
    started: list[ServerProcess] = []

    def start(model, *extra, config=None, home=None) -> ServerProcess:
        server = ServerProcess(model, home or make_home(), *extra, config=config)
        started.append(server)
        return server.wait_ready()

    yield start
    for server in started:
        server.stop()


@pytest.fixture
def start_server(tmp_path):
    yield from _server_starter(lambda: tmp_path / "home")


@pytest.fixture(scope="module")
def start_module_server(tmp_path_factory):
    """Like `start_server`, but the servers live for the whole test module (startup costs seconds)."""
    yield from _server_starter(lambda: tmp_path_factory.mktemp("home"))
