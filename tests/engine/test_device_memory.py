"""Where the model's arrays live and MLX's hold on that memory (engine/memory/device.py).

With MLX's CUDA backend the arrays live in the GPU's own memory and MLX's allocator keeps freed buffers
up to 80% of it: on an H100 a second server on the same GPU, and then this server's own prefills, failed
with "cudaMallocAsync ... out of memory", and every later request failed too. So on such a device the
budgets are shares of the GPU's memory, the buffer cache is bounded, and a request failed for want of
memory hands the cached buffers back so the next step can run. CUDA is faked here (this machine has none):
what is asserted is what the server does with the device's answers."""

from __future__ import annotations

import mlx.core as mx
import pytest
from kvharness import make_generator
from mlx_lm.utils import load

from mlx_kvserve.config import ConfigError, load_config
from mlx_kvserve.engine.build import build_stack
from mlx_kvserve.engine.memory import device as device_memory
from mlx_kvserve.engine.request import Failed, Finished, GenerationRequest, SamplingParams
from mlx_kvserve.models.loader import load_model

GIB = 1024**3
CUDA_OOM = "cudaMallocAsync(&data, size, stream) failed: out of memory"


@pytest.fixture
def fake_cuda(monkeypatch):
    """This process as if its arrays lived on an 80 GiB CUDA GPU; records set_cache_limit calls."""
    limits: list[int] = []
    monkeypatch.setattr(device_memory, "arrays_in_device_memory", lambda: True)
    monkeypatch.setattr(mx, "device_info", lambda: {"device_name": "H100", "total_memory": 80 * GIB})
    monkeypatch.setattr(mx, "set_cache_limit", lambda n: limits.append(n) or 0)
    monkeypatch.setattr(device_memory, "_cache_limit", None)
    return limits


def test_on_a_gpu_with_its_own_memory_budgets_are_shares_of_it(fake_cuda):
    assert device_memory.array_memory_bytes() == 80 * GIB
    assert device_memory.bound_buffer_cache(0) == 20 * GIB and fake_cuda == [20 * GIB]
    assert device_memory.bound_buffer_cache(3 * GIB) == 3 * GIB and fake_cuda[-1] == 3 * GIB
    assert device_memory.memory_report()["buffer_cache_limit_bytes"] == 3 * GIB


def test_on_the_cpu_mlx_keeps_its_default(monkeypatch):
    limits: list[int] = []
    monkeypatch.setattr(mx, "set_cache_limit", lambda n: limits.append(n) or 0)
    monkeypatch.setattr(device_memory, "_cache_limit", None)
    assert not device_memory.arrays_in_device_memory()
    assert device_memory.array_memory_bytes() == device_memory.physical_memory_bytes()
    assert device_memory.bound_buffer_cache(0) is None and limits == []
    assert device_memory.bound_buffer_cache(GIB) == GIB and limits == [GIB]  # an explicit limit applies anywhere


def test_the_kv_budget_follows_the_gpu_memory(fake_cuda, tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("MLX_KVSERVE_HOME", str(tmp_path))
    config = load_config(None, {"model": {"path": str(tiny_model_dir)}, "ssd": {"enabled": False}})
    loaded = load_model(config.model.path, config.models_path(), config.model.dtype)
    stack = build_stack(loaded, config)
    # a quarter of the GPU's 80 GiB, less the tails' eighth (not a quarter of this machine's RAM)
    assert stack.prefix_cache.manager.stats()["kv_ram_max_bytes"] == 20 * GIB - 20 * GIB // 8
    assert fake_cuda == [20 * GIB]  # and the buffer cache bounded to a quarter when the stack is built


def test_the_limit_is_a_byte_size_in_the_config():
    assert load_config(None, {"server": {"mlx_cache_limit_bytes": "6GiB"}}).server.mlx_cache_limit_bytes == 6 * GIB
    with pytest.raises(ConfigError, match="mlx_cache_limit_bytes"):
        load_config(None, {"server": {"mlx_cache_limit_bytes": -1}})


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    return load(str(tiny_model_dir))


def run(gen, prompts: list[list[int]]) -> list[list]:
    events: list[list] = [[] for _ in prompts]
    for i, prompt in enumerate(prompts):
        gen.scheduler.admit(GenerationRequest(f"r{i}", prompt, SamplingParams(max_tokens=8), events[i].append))
    while gen.scheduler.num_running:
        gen.scheduler.step()
    return events


@pytest.mark.parametrize("message", [CUDA_OOM, "some other failure"])
def test_a_step_out_of_memory_hands_the_cached_buffers_back_and_serving_goes_on(tiny, monkeypatch, message):
    model, tokenizer = tiny
    text = " ".join(f"Shelf {i} keeps {i * 7} blue tins of tea." for i in range(12))
    prompts = [tokenizer.encode(text)[:40], tokenizer.encode(text)[10:35]]
    expected = [e[-1].token_ids for e in run(make_generator(model, tokenizer, 16), prompts)]
    cleared: list[int] = []
    monkeypatch.setattr(mx, "clear_cache", lambda: cleared.append(1))
    before = device_memory.memory_report()["requests_failed_out_of_memory"]

    gen = make_generator(model, tokenizer, 16)
    outs: list[list] = [[], []]
    for i, prompt in enumerate(prompts):
        gen.scheduler.admit(GenerationRequest(f"f{i}", prompt, SamplingParams(max_tokens=8), outs[i].append))
    gen.scheduler.step()

    def fails():
        raise RuntimeError(message)

    gen.scheduler._batch.next = fails
    gen.scheduler.step()
    assert all(isinstance(o[-1], Failed) and message in str(o[-1].error) for o in outs)
    report = device_memory.memory_report()
    oom = message == CUDA_OOM
    assert len(cleared) == (2 if oom else 0)  # once per failed request, only for an allocation failure
    assert report["requests_failed_out_of_memory"] == before + (2 if oom else 0)
    if oom:
        assert report["last_out_of_memory"] == CUDA_OOM
    # the same engine serves the same prompts again, exactly as a fresh one did
    again = run(gen, prompts)
    assert all(isinstance(e[-1], Finished) for e in again)
    assert [e[-1].token_ids for e in again] == expected
