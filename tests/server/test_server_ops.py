"""Operating the server: /metrics and the request log after real requests, /health's verdicts, a
bounded load test with an in-flight limit, and SIGTERM in the middle of streaming load."""

import json
import re
import signal
import stat
import threading
import time
from types import SimpleNamespace

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from starlette.testclient import TestClient
from test_server_e2e import build_endless_model, wait_until, write_config

from mlx_kvserve.config import ApiKeys, Config, load_config
from mlx_kvserve.engine.engine import Engine
from mlx_kvserve.engine.memory import device as device_memory
from mlx_kvserve.server.app import create_app
from mlx_kvserve.server.health import ERROR_WINDOW_S, HealthMonitor
from mlx_kvserve.service import stop_timeout_s, writer_drain_s

USER = [{"role": "user", "content": "hello the world"}]
CHAT, TEXT = "/v1/chat/completions", "/v1/completions"
SHARED = " ".join(f"rule {i}: keep answers short." for i in range(20))  # > 2 blocks of 64 tokens


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.base_url + path, json=body, timeout=60)


def health(server) -> dict:
    return httpx.get(server.base_url + "/health", timeout=10).json()


def scrape(server) -> dict[tuple, float]:
    """{(sample name, sorted labels): value} from /metrics."""
    text = httpx.get(server.base_url + "/metrics", timeout=10).text
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def delta(after: dict, before: dict, name: str, **labels) -> float:
    key = (name, tuple(sorted(labels.items())))
    return after.get(key, 0.0) - before.get(key, 0.0)


def wait_idle(server) -> dict:
    """/health once the worker is idle and the SSD writer has caught up."""

    def idle() -> bool:
        body = health(server)
        cache = body["cache"]
        return not body["busy"] and cache.get("writer_queue_depth", 0) == 0 and cache.get("writer_pending", 0) == 0

    assert wait_until(idle, timeout=20)
    return health(server)


# --- metrics and logs after real requests -------------------------------------------------------------


@pytest.fixture(scope="module")
def server(start_module_server, tiny_model_dir):
    return start_module_server(tiny_model_dir)


def test_metrics_count_what_was_done(server):
    before = scrape(server)
    replies = [post(server, CHAT, {"messages": USER, "max_tokens": 4, "temperature": 0}) for _ in range(3)]
    system = [{"role": "system", "content": SHARED}, {"role": "user", "content": "one?"}]
    replies += [post(server, CHAT, {"messages": system, "max_tokens": 3}) for _ in range(2)]  # the 2nd hits the cache
    streamed = {"prompt": "x", "max_tokens": 3, "stream": True, "stream_options": {"include_usage": True}}
    events = post(server, TEXT, streamed).text.split("\n\n")
    stream_usage = json.loads(events[-3].removeprefix("data: "))["usage"]  # before "data: [DONE]" and ""
    assert all(reply.status_code == 200 for reply in replies)
    assert post(server, CHAT, {"messages": "nope"}).status_code == 422
    assert post(server, CHAT, {"messages": USER, "max_tokens": 0}).status_code == 422
    assert httpx.get(server.base_url + "/v1/nowhere", timeout=10).status_code == 404
    after = scrape(server)

    requests = "mlx_kvserve_requests_total"
    assert delta(after, before, requests, endpoint=CHAT, status="200") == 5
    assert delta(after, before, requests, endpoint=CHAT, status="422") == 2
    assert delta(after, before, requests, endpoint=TEXT, status="200") == 1
    assert delta(after, before, requests, endpoint="other", status="404") == 1
    assert delta(after, before, "mlx_kvserve_time_to_first_token_seconds_count", endpoint=CHAT) == 5
    assert delta(after, before, "mlx_kvserve_time_to_first_token_seconds_count", endpoint=TEXT) == 1
    assert delta(after, before, "mlx_kvserve_request_duration_seconds_count", endpoint=CHAT) == 7
    ttft_in_a_minute = delta(after, before, "mlx_kvserve_time_to_first_token_seconds_bucket", endpoint=CHAT, le="60.0")
    assert ttft_in_a_minute == 5
    usages = [reply.json()["usage"] for reply in replies] + [stream_usage]
    for name, field in [("prompt_tokens", "prompt_tokens"), ("completion_tokens", "completion_tokens")]:
        assert delta(after, before, f"mlx_kvserve_{name}_total") == sum(u[field] for u in usages), name
    cached = sum(u["prompt_tokens_details"]["cached_tokens"] for u in usages)
    assert cached >= 128 and delta(after, before, "mlx_kvserve_cached_prompt_tokens_total") == cached


def test_cache_metrics_mirror_the_engine(server):
    system = [{"role": "system", "content": SHARED + " again"}, {"role": "user", "content": "two?"}]
    for _ in range(2):
        assert post(server, CHAT, {"messages": system, "max_tokens": 2}).status_code == 200
    cache = wait_idle(server)["cache"]
    metrics = scrape(server)

    def value(name: str, **labels) -> float:
        return metrics[(name, tuple(sorted(labels.items())))]

    assert value("mlx_kvserve_cache_hits_total", tier="ram") == cache["kv_hits"] - cache["kv_promotions"] > 0
    assert value("mlx_kvserve_cache_hits_total", tier="ssd") == cache["kv_promotions"]
    assert value("mlx_kvserve_cache_misses_total", tier="ram") == cache["kv_misses"] > 0
    assert value("mlx_kvserve_cache_misses_total", tier="ssd") == cache["ssd_misses"]
    assert value("mlx_kvserve_cache_bytes", tier="ram") == cache["kv_ram_bytes"] + cache["kv_tail_bytes"]
    assert value("mlx_kvserve_cache_bytes", tier="ssd") == cache["ssd_bytes"] > 0
    assert value("mlx_kvserve_ssd_writer_queue_depth") == cache["writer_queue_depth"] == 0
    assert value("mlx_kvserve_ssd_writer_queued_bytes") == cache["writer_queued_bytes"] == 0
    assert value("mlx_kvserve_ssd_writer_owed_bytes") == cache["writer_owed_bytes"] == 0
    assert value("mlx_kvserve_ssd_blocks_written_total") == cache["writer_written"] > 0
    assert value("mlx_kvserve_ssd_writer_shed_total") == cache["writer_shed"]
    assert value("mlx_kvserve_ssd_writer_refilled_total") == cache["writer_refilled"]
    assert value("mlx_kvserve_ssd_write_errors_total") == cache["ssd_errors"] == 0
    assert value("mlx_kvserve_ssd_writer_failures_total") == cache["writer_failures"] == 0
    assert value("mlx_kvserve_requests_in_flight") == 0


LOG_LINE = re.compile(r"INFO mlx_kvserve\.requests: (id=\S+( \w+=\S+)+)$")


def request_lines(server) -> list[dict]:
    return [
        dict(pair.split("=", 1) for pair in m.group(1).split())
        for m in map(LOG_LINE.search, server.log().splitlines())
        if m
    ]


def test_one_structured_log_line_per_request(server):
    reply = post(server, TEXT, {"prompt": "the quick brown fox", "max_tokens": 5, "temperature": 0}).json()
    bad = post(server, TEXT, {"prompt": ""})
    assert bad.status_code == 422
    assert wait_until(lambda: any(line["id"] == reply["id"] for line in request_lines(server)), timeout=5)
    (line,) = [line for line in request_lines(server) if line["id"] == reply["id"]]
    assert line["endpoint"] == TEXT and line["method"] == "POST" and line["status"] == "200"
    assert line["stream"] == "false" and line["error"] == "-"
    usage = reply["usage"]
    assert int(line["prompt_tokens"]) == usage["prompt_tokens"]
    assert int(line["cached_tokens"]) == usage["prompt_tokens_details"]["cached_tokens"]
    assert int(line["completion_tokens"]) == usage["completion_tokens"]
    assert 0 < float(line["ttft_s"]) <= float(line["duration_s"])
    rejected = [line for line in request_lines(server) if line["status"] == "422"]
    assert rejected and rejected[-1]["id"].startswith("req-") and rejected[-1]["ttft_s"] == "-"
    assert not any(line["endpoint"] == "/health" for line in request_lines(server))  # polled: debug level only


# --- /health verdicts (no model) ----------------------------------------------------------------------


class FakeEngine:
    """Just what the app, /health and /metrics read from an Engine: the real front over fake internals."""

    is_alive, failure, queue_depth, is_busy = Engine.is_alive, Engine.failure, Engine.queue_depth, Engine.is_busy
    cache_enabled, leases_active, ssd_problem = Engine.cache_enabled, Engine.leases_active, Engine.ssd_problem

    def __init__(self):
        self.config = Config()
        self.model_name, self.started_at, self.context_length = "fake", time.time(), 128
        self.worker = SimpleNamespace(is_alive=True, queue_depth=0, is_busy=False)
        self.prefix_cache = SimpleNamespace(
            manager=object(), ssd_tier=SimpleNamespace(writer=SimpleNamespace(is_alive=True))
        )
        self.stats = {"enabled": True, "ssd_errors": 0, "writer_failures": 0, "ssd_bytes": 0}
        self.on_stop = lambda: None

    def cache_stats(self) -> dict:
        return dict(self.stats)

    def cache_admin(self):
        from mlx_kvserve.engine.cache.admin import CacheAdmin

        return CacheAdmin(self.prefix_cache)

    def health(self) -> dict:
        return {"status": "ok", "model": self.model_name, "cache": self.cache_stats()}

    def start(self) -> None:
        pass

    def stop(self, timeout: float | None = None) -> None:
        self.on_stop()


def test_health_degraded_reasons():
    engine, now = FakeEngine(), [0.0]
    monitor = HealthMonitor(engine, clock=lambda: now[0])
    body, status = monitor.report()
    assert body.pop("memory")["device"] == "cpu"  # MLX's memory in this process (device_memory.memory_report)
    assert (body, status) == ({**engine.health(), "problems": []}, 200)
    engine.stats.update(ssd_errors=2, writer_failures=2)  # two writes failed: the store and the writer both count them
    body, status = monitor.report()
    assert status == 200 and body["status"] == "degraded"
    assert "SSD writes are failing (2 errors since start" in body["problems"][0]  # counted once, not 4
    now[0] += ERROR_WINDOW_S + 1  # no new failures for a while: healthy again
    assert monitor.report()[0]["status"] == "ok"
    engine.worker.is_alive = False
    engine.prefix_cache.ssd_tier = None  # [ssd] enabled, but the tier could not start
    problems = monitor.report()[0]["problems"]
    assert len(problems) == 2 and "worker" in problems[0] and "SSD tier is off" in problems[1]


def test_health_degraded_after_requests_failed_for_want_of_memory(monkeypatch):
    engine, now = FakeEngine(), [0.0]
    failures = {"count": 5, "last": ""}  # five before this server: not its problem
    monkeypatch.setattr(device_memory, "_failures", failures)
    monitor = HealthMonitor(engine, clock=lambda: now[0])
    assert monitor.report()[0]["status"] == "ok"
    failures.update(count=7, last="cudaMallocAsync(&data, size, stream) failed: out of memory")
    body = monitor.report()[0]
    assert body["status"] == "degraded" and body["memory"]["requests_failed_out_of_memory"] == 7
    assert body["problems"] == [
        "requests failed for want of memory (7 since start, the last within 300s: cudaMallocAsync(&data, size, "
        "stream) failed: out of memory); /health memory shows what holds it"
    ]
    now[0] += ERROR_WINDOW_S + 1  # no new failures for a while: healthy again
    assert monitor.report()[0]["status"] == "ok"


def test_health_degraded_when_the_disk_is_below_its_free_space_floor():
    engine, now = FakeEngine(), [0.0]
    monitor = HealthMonitor(engine, clock=lambda: now[0])
    engine.stats["ssd_tail_skipped_low_space"] = 3  # tails refused by the floor: the disk is (nearly) full
    problems = monitor.report()[0]["problems"]
    assert len(problems) == 1 and "free-space floor" in problems[0] and "3 writes skipped" in problems[0]
    now[0] += ERROR_WINDOW_S + 1
    assert monitor.report()[0]["status"] == "ok"


def test_health_is_503_once_shutdown_begins():
    engine = FakeEngine()
    seen = []
    with TestClient(create_app(engine, ApiKeys("", ""))) as client:
        assert client.get("/health").status_code == 200
        engine.on_stop = lambda: seen.append(client.get("/health"))  # the lifespan stops the engine
    (response,) = seen
    assert response.status_code == 503 and response.json()["status"] == "shutting_down"


# --- a bounded load test --------------------------------------------------------------------------------

NUM_CLIENTS, NUM_REQUESTS, LIMIT = 8, 3, 3
RAM_BUDGET = 32 * 2**20


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        (kib,) = [line.split()[1] for line in f if line.startswith("VmRSS:")]
    return int(kib) * 1024


def one_request(server, client: int, i: int) -> dict:
    kind = CHAT if (client + i) % 2 else TEXT
    stream = i == 1
    content = f"{SHARED} client {client} request {i}"
    body = {"messages": [{"role": "user", "content": content}]} if kind == CHAT else {"prompt": content}
    body |= {"max_tokens": 24, "stream": stream}
    started = time.monotonic()
    response = httpx.post(server.base_url + kind, json=body, timeout=60)
    ended = time.monotonic()
    streamed = stream and response.status_code == 200
    lines = [line for line in response.text.splitlines() if line.startswith("data: ")] if streamed else []
    return {
        "kind": kind,
        "stream": stream,
        "status": response.status_code,
        "retry_after": response.headers.get("retry-after"),
        "payload": None if streamed else response.json(),
        "events": lines,
        "span": (started, ended),
    }


def check_shape(result: dict) -> None:
    chat = result["kind"] == CHAT
    if result["stream"]:
        assert result["events"][-1] == "data: [DONE]"
        chunks = [json.loads(e.removeprefix("data: ")) for e in result["events"][:-1]]
        assert {c["object"] for c in chunks} == {"chat.completion.chunk" if chat else "text_completion"}
        assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")
        return
    body = result["payload"]
    assert body["object"] == ("chat.completion" if chat else "text_completion")
    choice = body["choices"][0]
    assert isinstance(choice["message"]["content"] if chat else choice["text"], str)
    assert choice["finish_reason"] in ("stop", "length")
    usage = body["usage"]
    assert 1 <= usage["completion_tokens"] <= 24
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]


def test_bounded_load(start_server, tiny_model_dir, tmp_path):
    config = write_config(tmp_path / "cfg", f'[server]\nmax_concurrent = {LIMIT}\n[cache]\nram_max_bytes = "32MiB"\n')
    server = start_server(tiny_model_dir, config=config)
    rss_before = rss_bytes(server.proc.pid)
    start = threading.Barrier(NUM_CLIENTS)
    results: list[dict] = []

    def client(n: int) -> None:
        start.wait()
        results.extend(one_request(server, n, i) for i in range(NUM_REQUESTS))

    threads = [threading.Thread(target=client, args=(n,)) for n in range(NUM_CLIENTS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert len(results) == NUM_CLIENTS * NUM_REQUESTS
    statuses = [r["status"] for r in results]
    assert set(statuses) <= {200, 429}, statuses
    assert 200 in statuses and 429 in statuses  # 8 clients started together against a limit of 3
    for result in results:
        if result["status"] == 200:
            check_shape(result)
            continue
        assert result["retry_after"] == "1" and result["payload"]["error"]["type"] == "rate_limit_error"
        # Rejected only while the limit was reached: at least LIMIT other requests overlapped it.
        start_r, end_r = result["span"]
        overlapping = [o for o in results if o is not result and o["span"][0] <= end_r and o["span"][1] >= start_r]
        assert len(overlapping) >= LIMIT
    metrics = scrape(server)
    for status in ("200", "429"):
        counted = sum(
            metrics.get(("mlx_kvserve_requests_total", (("endpoint", e), ("status", status))), 0) for e in (CHAT, TEXT)
        )
        assert counted == statuses.count(int(status))
    cache = wait_idle(server)["cache"]
    assert cache["kv_ram_bytes"] + cache["kv_tail_bytes"] <= RAM_BUDGET
    rss_after = rss_bytes(server.proc.pid)
    assert rss_after < rss_before + RAM_BUDGET + 256 * 2**20, (rss_before, rss_after)
    assert rss_after < 2 * 2**30


# --- SIGTERM during streaming load -------------------------------------------------------------------


def test_sigterm_during_streaming_load(start_server, tmp_path_factory, tmp_path):
    endless = build_endless_model(tmp_path_factory.mktemp("endless-ops") / "endless-llama")
    home, shutdown_s = tmp_path / "home", 15.0
    config = write_config(tmp_path / "cfg", f"[server]\nshutdown_timeout_s = {shutdown_s}\n")
    server = start_server(endless, config=config, home=home)
    num_streams, max_tokens = 4, 150
    outcomes: list[list[str]] = []
    started = threading.Barrier(num_streams + 1)

    def stream() -> None:
        body = {"messages": USER, "max_tokens": max_tokens, "temperature": 0, "stream": True}
        body["stream_options"] = {"include_usage": True}
        with httpx.stream("POST", server.base_url + CHAT, json=body, timeout=60) as response:
            lines = response.iter_lines()
            first = next(lines)
            started.wait()
            outcomes.append([first, *lines])

    threads = [threading.Thread(target=stream) for _ in range(num_streams)]
    for t in threads:
        t.start()
    started.wait(timeout=30)  # every stream has its first chunk; most wait for the worker
    server.proc.send_signal(signal.SIGTERM)
    signalled = time.monotonic()
    for t in threads:
        t.join(timeout=60)
    assert server.proc.wait(timeout=60) == 0
    stop_budget = stop_timeout_s(shutdown_s, writer_drain_s(load_config(config)))
    assert time.monotonic() - signalled < stop_budget
    assert len(outcomes) == num_streams
    for lines in outcomes:
        data = [line for line in lines if line.startswith("data: ")]
        assert data[-1] == "data: [DONE]"  # every in-flight stream ended cleanly, none cut
        assert json.loads(data[-2].removeprefix("data: "))["usage"]["completion_tokens"] == max_tokens
    assert "shutdown_clean=True" in server.log()
    for folder in [home / "kv", *(p for p in (home / "kv").iterdir() if p.is_dir())]:
        assert stat.S_IMODE(folder.stat().st_mode) == 0o700, folder

    again = start_server(endless, config=config, home=home)
    assert health(again)["cache"]["shutdown_clean"] is True
