"""Not collected by the suite (no test_ prefix): tests/project/test_failing_test_exits.py runs it in a child
pytest. It fails while an Engine with an SSD tier is still running (its non-daemon worker and writer
threads), as a failing engine test does before reaching `engine.stop()`."""

from mlx_lm.utils import load

from mlx_kvserve.config import load_config
from mlx_kvserve.engine.engine import Engine
from mlx_kvserve.models.loader import LoadedModel


def test_fails_with_an_engine_running(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("MLX_KVSERVE_HOME", str(tmp_path / "home"))
    model, tokenizer = load(str(tiny_model_dir))
    config = load_config(overrides={"ssd": {"cache_dir": str(tmp_path / "kv")}})
    engine = Engine(LoadedModel("tiny", tiny_model_dir, model, tokenizer, {}, 2048), config)
    engine.start()
    assert engine.worker.is_alive and engine.prefix_cache.ssd_tier.writer.is_alive
    raise AssertionError("failed before engine.stop()")
