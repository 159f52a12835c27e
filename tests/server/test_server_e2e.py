"""A real `mlx-kvserve run` process on the tiny random-weight model, driven through the official
`openai` client (and raw httpx where status codes and headers matter).

Two long-lived servers keep startup costs down: `server` (default config) for the API surface and
error mapping, and `busy_server` (max_queue = 1, a 2 KiB body limit) on an "endless" variant of
the model that never emits a special token, for the tests that need generation to keep going.
"""

import json
import os
import signal
import threading
import time
from pathlib import Path

import httpx
import mlx.core as mx
import openai
import pytest
import tinymodel
from transformers import AutoTokenizer

MODEL = "tiny-llama"  # the served id: the folder name of `tiny_model_dir`
ENDLESS = "endless-llama"
CONTEXT = tinymodel.TINY["context"]
USER = [{"role": "user", "content": "hello the world"}]
PROMPT = "the quick brown fox 123"


def build_endless_model(folder: Path) -> Path:
    """The tiny model with zero lm_head rows for the special tokens: their logit is 0 while the best
    of the other 259 random logits is positive, so greedy decoding never stops before max_tokens."""
    tinymodel.build_mlx_model(folder)
    weights = mx.load(str(folder / "model.safetensors"))
    head = weights["lm_head.weight"]
    num_special = len(tinymodel.SPECIALS)
    weights["lm_head.weight"] = mx.concatenate([mx.zeros((num_special, head.shape[1])), head[num_special:]])
    mx.save_safetensors(str(folder / "model.safetensors"), weights)
    return folder


def write_config(folder: Path, text: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "kvserve.toml"
    path.write_text(text)
    return path


def make_client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0, timeout=60)


def wait_until(predicate, timeout: float, interval: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


def health(server) -> dict:
    return httpx.get(server.base_url + "/health", timeout=10).json()


@pytest.fixture(scope="module")
def server(start_module_server, tiny_model_dir):
    assert tiny_model_dir.name == MODEL
    return start_module_server(tiny_model_dir)


@pytest.fixture(scope="module")
def client(server):
    return make_client(server)


@pytest.fixture(scope="module")
def hf_tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(str(tiny_model_dir))


@pytest.fixture(scope="module")
def endless_model_dir(tmp_path_factory) -> Path:
    return build_endless_model(tmp_path_factory.mktemp("endless") / ENDLESS)


@pytest.fixture(scope="module")
def busy_server(start_module_server, endless_model_dir, tmp_path_factory):
    config = write_config(tmp_path_factory.mktemp("busy"), '[server]\nmax_queue = 1\nmax_body_bytes = "2KiB"\n')
    return start_module_server(endless_model_dir, config=config)


def chat_prompt_tokens(tokenizer, messages) -> int:
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


def greedy_chat(client, max_tokens: int = 100, **extra):
    return client.chat.completions.create(model=MODEL, messages=USER, max_tokens=max_tokens, temperature=0, **extra)


def collect_stream(stream) -> tuple[str, list]:
    chunks = list(stream)
    pieces = []
    for chunk in chunks:
        for choice in chunk.choices:
            piece = choice.delta.content if hasattr(choice, "delta") else choice.text
            pieces.append(piece or "")
    return "".join(pieces), chunks


# --- the API surface -------------------------------------------------------------------------


def test_models_lists_the_served_id(client):
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL]
    assert models[0].object == "model"
    assert models[0].owned_by == "mlx-kvserve"


def test_health_fields(server):
    body = health(server)
    assert body["status"] == "ok"
    assert body["model"] == MODEL
    assert body["context_length"] == CONTEXT
    assert body["busy"] is False
    assert body["queue_depth"] == 0
    assert isinstance(body["uptime_s"], int | float) and body["uptime_s"] >= 0
    assert isinstance(body["cache"], dict)
    memory = body["memory"]  # MLX's memory in the server process: on this CPU, the system's
    assert memory["device"] == "cpu" and memory["separate_device_memory"] is False
    assert memory["total_bytes"] == os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert memory["active_bytes"] > 0  # the weights at least
    assert memory["peak_bytes"] >= memory["active_bytes"]
    assert memory["buffer_cache_limit_bytes"] is None  # MLX's default off CUDA
    assert memory["requests_failed_out_of_memory"] == 0 and memory["last_out_of_memory"] is None


def test_chat_completion_and_usage(client, hf_tokenizer):
    r = greedy_chat(client, max_tokens=100)
    choice = r.choices[0]
    assert r.id.startswith("chatcmpl-")
    assert r.object == "chat.completion"
    assert r.model == MODEL
    assert choice.message.role == "assistant"
    assert choice.message.content
    assert r.usage.prompt_tokens == chat_prompt_tokens(hf_tokenizer, USER)
    assert 1 <= r.usage.completion_tokens <= 100
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    # "length" exactly when the budget ran out, "stop" when the model emitted its end token first.
    assert choice.finish_reason == ("length" if r.usage.completion_tokens == 100 else "stop")
    cached = r.usage.prompt_tokens_details.cached_tokens
    assert isinstance(cached, int) and 0 <= cached <= r.usage.prompt_tokens


def test_text_completion_and_usage(client, hf_tokenizer):
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=20, temperature=0)
    assert r.id.startswith("cmpl-")
    assert r.object == "text_completion"
    assert r.choices[0].text
    assert r.usage.prompt_tokens == len(hf_tokenizer(PROMPT)["input_ids"])
    assert r.usage.prompt_tokens_details.cached_tokens is not None


def test_text_completion_from_token_ids(client, hf_tokenizer):
    ids = hf_tokenizer(PROMPT)["input_ids"]
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=10, temperature=0)
    by_text = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=10, temperature=0)
    assert by_ids.usage.prompt_tokens == len(ids)
    assert by_ids.choices[0].text == by_text.choices[0].text


@pytest.mark.parametrize("kind", ["chat", "text"])
def test_streaming_equals_non_streaming(client, kind):
    if kind == "chat":

        def create(**kw):
            return client.chat.completions.create(model=MODEL, messages=USER, temperature=0, max_tokens=60, **kw)
    else:

        def create(**kw):
            return client.completions.create(model=MODEL, prompt=PROMPT, temperature=0, max_tokens=60, **kw)

    whole = create()
    text, chunks = collect_stream(create(stream=True, stream_options={"include_usage": True}))
    expected = whole.choices[0].message.content if kind == "chat" else whole.choices[0].text
    assert text == expected
    assert len(chunks) >= 3
    *content, last_choice_chunk, usage_chunk = chunks
    assert all(c.usage is None for c in content)
    assert last_choice_chunk.choices[0].finish_reason == whole.choices[0].finish_reason
    assert usage_chunk.choices == []
    assert usage_chunk.usage.prompt_tokens == whole.usage.prompt_tokens
    assert usage_chunk.usage.completion_tokens == whole.usage.completion_tokens
    assert usage_chunk.usage.prompt_tokens_details.cached_tokens is not None
    assert len({c.id for c in chunks}) == 1


def test_streaming_without_include_usage_sends_no_usage(client):
    _, chunks = collect_stream(greedy_chat(client, max_tokens=10, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.usage is None for c in chunks)
    assert chunks[-1].choices[0].finish_reason is not None


def pick_stop(text: str) -> str:
    """Two printable ASCII characters from the middle of `text`, to use as a stop string."""
    for i in range(3, len(text) - 1):
        pair = text[i : i + 2]
        if pair.isascii() and pair.isprintable() and not pair.isspace():
            return pair
    raise AssertionError(f"no usable stop string in {text!r}")


def test_stop_strings_cut_the_text(client):
    full = greedy_chat(client, max_tokens=60).choices[0].message.content
    stop = pick_stop(full)
    expected = full[: full.index(stop)]
    r = greedy_chat(client, max_tokens=60, stop=stop)
    assert r.choices[0].message.content == expected
    assert r.choices[0].finish_reason == "stop"
    streamed, _ = collect_stream(greedy_chat(client, max_tokens=60, stop=[stop], stream=True))
    assert streamed == expected


def test_earliest_of_several_stops_wins(client):
    full = greedy_chat(client, max_tokens=60).choices[0].message.content
    early = pick_stop(full)
    cut = full.index(early)
    late = pick_stop(full[cut + 2 :])
    assert full.index(late) > cut
    r = greedy_chat(client, max_tokens=60, stop=[late, early])
    assert r.choices[0].message.content == full[:cut]


@pytest.mark.parametrize("kind", ["chat", "text"])
def test_finish_reason_length(client, kind):
    if kind == "chat":
        r = greedy_chat(client, max_tokens=3)
    else:
        r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0)
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 3


def test_seed_gives_reproducible_sampling(client):
    def sample(seed: int) -> str:
        r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=30, temperature=1.0, seed=seed)
        return r.choices[0].text

    first = sample(1234)
    assert sample(1234) == first
    assert sample(4321) != first


def test_unknown_model_through_the_client(client):
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="gpt-17", messages=USER, max_tokens=3)
    assert MODEL in info.value.message
    assert info.value.status_code == 404


# --- bad input ---------------------------------------------------------------------------------

CHAT, TEXT = "/v1/chat/completions", "/v1/completions"
BAD_INPUTS = [
    pytest.param(CHAT, b'{"messages": [', 400, None, id="invalid-json"),
    pytest.param(CHAT, b"\xff\xfe", 400, None, id="not-utf8"),
    pytest.param(CHAT, [1, 2], 422, None, id="body-not-object"),
    pytest.param(CHAT, {"messages": USER, "temperature": "hot"}, 422, "temperature", id="wrong-type"),
    pytest.param(CHAT, {"messages": USER, "max_tokens": "5"}, 422, "max_tokens", id="wrong-type-int"),
    pytest.param(CHAT, {"messages": "hi"}, 422, "messages", id="messages-not-array"),
    pytest.param(CHAT, {"messages": []}, 422, "messages", id="empty-messages"),
    pytest.param(CHAT, {"messages": [{"role": "wizard", "content": "x"}]}, 422, "messages", id="unknown-role"),
    pytest.param(CHAT, {"messages": USER, "max_tokens": 0}, 422, "max_tokens", id="max-tokens-0"),
    pytest.param(CHAT, {"messages": USER, "seed": -1}, 422, "seed", id="negative-seed"),
    pytest.param(CHAT, {"messages": [{"role": "user", "content": "a" * 3000}]}, 400, "messages", id="long-chat"),
    pytest.param(TEXT, {"prompt": "a" * 3000}, 400, "prompt", id="long-prompt"),
    pytest.param(TEXT, {"prompt": [1, 99999]}, 422, "prompt", id="token-id-out-of-vocab"),
    pytest.param(TEXT, {"prompt": ""}, 422, "prompt", id="empty-prompt"),
    pytest.param(CHAT, {"model": "gpt-17", "messages": USER}, 404, "model", id="unknown-model"),
]


def post(server, path: str, body, **kw) -> httpx.Response:
    if isinstance(body, bytes):
        return httpx.post(server.base_url + path, content=body, headers={"content-type": "application/json"}, **kw)
    return httpx.post(server.base_url + path, json=body, **kw)


def assert_error(response: httpx.Response, status: int, param: str | None, error_type: str) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert {"message", "type", "param"} <= set(error)
    assert error["type"] == error_type
    assert error["param"] == param
    assert isinstance(error["message"], str) and error["message"]
    return error


@pytest.mark.parametrize(("path", "body", "status", "param"), BAD_INPUTS)
def test_bad_input(server, path, body, status, param):
    error = assert_error(post(server, path, body, timeout=30), status, param, "invalid_request_error")
    if status == 404:
        assert MODEL in error["message"]
        assert error["code"] == "model_not_found"
    if param in ("max_tokens", "messages", "prompt") and status == 400:
        assert error["code"] == "context_length_exceeded"
        assert str(CONTEXT) in error["message"]


def test_max_tokens_over_the_context_is_clamped_to_the_room_left(server):
    """Clients such as Claude Code always ask for 32000: the reply is bounded by the context, not refused."""
    reply = post(server, CHAT, {"messages": USER, "max_tokens": CONTEXT, "temperature": 0}, timeout=120)
    assert reply.status_code == 200, reply.text
    usage = reply.json()["usage"]
    assert usage["prompt_tokens"] + usage["completion_tokens"] <= CONTEXT


def test_worker_alive_after_bad_input(server, client):
    for path, body, *_ in (p.values for p in BAD_INPUTS):
        assert post(server, path, body, timeout=30).status_code >= 400
    r = greedy_chat(client, max_tokens=5)
    assert r.usage.completion_tokens >= 1
    assert r.choices[0].message.content
    assert health(server)["busy"] is False


# --- limits, disconnects, overload (the endless model) ----------------------------------------


def endless_stream(client, max_tokens: int = CONTEXT - 100):
    return client.chat.completions.create(
        model=ENDLESS, messages=USER, max_tokens=max_tokens, temperature=0, stream=True
    )


def test_endless_model_runs_to_max_tokens(busy_server):
    r = make_client(busy_server).chat.completions.create(model=ENDLESS, messages=USER, max_tokens=300, temperature=0)
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 300


def test_oversized_body_is_413(busy_server):
    body = json.dumps({"messages": [{"role": "user", "content": "x" * 3000}]}).encode()
    assert_error(post(busy_server, CHAT, body, timeout=30), 413, None, "invalid_request_error")

    def chunked():  # no content-length: the limit is enforced while reading
        yield body[:1000]
        yield body[1000:]

    response = httpx.post(busy_server.base_url + CHAT, content=chunked(), timeout=30)
    assert_error(response, 413, None, "invalid_request_error")
    small = make_client(busy_server).chat.completions.create(model=ENDLESS, messages=USER, max_tokens=3)
    assert small.usage.completion_tokens == 3


def seconds_per_token(client) -> float:
    started = time.perf_counter()
    r = client.chat.completions.create(model=ENDLESS, messages=USER, max_tokens=200, temperature=0)
    assert r.usage.completion_tokens == 200
    return (time.perf_counter() - started) / 200


def test_disconnect_cancels_generation(busy_server):
    client = make_client(busy_server)
    max_tokens = CONTEXT - 100
    # Without cancellation the worker would stay busy for the whole generation; allow a third of it.
    deadline = max(0.5, min(3.0, seconds_per_token(client) * max_tokens / 3))
    stream = endless_stream(client, max_tokens)
    for i, _ in enumerate(stream):
        if i == 5:
            break
    assert health(busy_server)["busy"] is True
    stream.close()
    closed = time.monotonic()
    assert wait_until(lambda: health(busy_server)["busy"] is False, timeout=deadline), "worker still busy"
    r = client.chat.completions.create(model=ENDLESS, messages=USER, max_tokens=5, temperature=0)
    assert r.usage.completion_tokens == 5
    assert time.monotonic() - closed < deadline + 2.0


def test_disconnect_cancels_a_non_streaming_request(busy_server):
    client = make_client(busy_server)
    max_tokens = CONTEXT - 100
    deadline = max(0.5, min(3.0, seconds_per_token(client) * max_tokens / 3))
    body = {"messages": USER, "max_tokens": max_tokens, "temperature": 0}
    with pytest.raises(httpx.ReadTimeout):  # the client gives up and closes the connection
        httpx.post(busy_server.base_url + CHAT, json=body, timeout=httpx.Timeout(10, read=0.3))
    assert wait_until(lambda: health(busy_server)["busy"] is False, timeout=deadline), "worker still busy"


def test_queue_full_is_429_with_retry_after(busy_server):
    client = make_client(busy_server)
    running = endless_stream(client)
    next(iter(running))
    assert wait_until(lambda: health(busy_server)["busy"] is True, timeout=10)
    waiting = endless_stream(client)  # takes the one queue slot
    assert health(busy_server)["queue_depth"] == 1

    results: list[httpx.Response] = []

    def overflow():
        body = {"messages": USER, "max_tokens": CONTEXT - 100}
        results.append(httpx.post(busy_server.base_url + CHAT, json=body, timeout=30))

    threads = [threading.Thread(target=overflow) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    try:
        assert len(results) == 3
        for response in results:
            assert_error(response, 429, None, "rate_limit_error")
            assert int(response.headers["retry-after"]) >= 1
    finally:
        waiting.close()
        running.close()
    assert wait_until(lambda: health(busy_server)["busy"] is False, timeout=10)
    assert health(busy_server)["queue_depth"] == 0
    r = client.chat.completions.create(model=ENDLESS, messages=USER, max_tokens=5)
    assert r.usage.completion_tokens == 5


# --- shutdown ------------------------------------------------------------------------------------


def stream_lines(server, max_tokens: int):
    body = {"model": ENDLESS, "messages": USER, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    body["stream_options"] = {"include_usage": True}
    return httpx.stream("POST", server.base_url + CHAT, json=body, timeout=30)


def read_rest(lines) -> list[str]:
    """The remaining SSE data lines; stops quietly if the server cuts the connection."""
    rest = []
    try:
        rest.extend(line for line in lines if line.startswith("data: "))
    except httpx.HTTPError:
        pass
    return rest


def test_sigterm_lets_the_streaming_request_finish(start_server, endless_model_dir, tmp_path):
    config = write_config(tmp_path / "cfg", "[server]\nshutdown_timeout_s = 20\n")
    server = start_server(endless_model_dir, config=config)
    max_tokens = 300
    with stream_lines(server, max_tokens) as response:
        lines = response.iter_lines()
        first = [next(lines) for _ in range(6)]
        server.proc.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        rest = read_rest(lines)
    data = [line for line in first if line.startswith("data: ")] + rest
    assert data[-1] == "data: [DONE]"
    usage = json.loads(data[-2].removeprefix("data: "))["usage"]
    assert usage["completion_tokens"] == max_tokens
    assert server.proc.wait(timeout=20) == 0
    assert time.monotonic() - signalled < 20


def test_sigterm_exits_cleanly_when_a_request_outlives_the_timeout(start_server, endless_model_dir, tmp_path):
    timeout = 1.0
    config = write_config(tmp_path / "cfg", f"[server]\nshutdown_timeout_s = {timeout}\n")
    server = start_server(endless_model_dir, config=config)
    with stream_lines(server, CONTEXT - 100) as response:
        lines = response.iter_lines()
        for _ in range(6):
            next(lines)
        server.proc.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        rest = read_rest(lines)
        assert "data: [DONE]" not in rest  # cut short, not run to the end
    assert server.proc.wait(timeout=timeout + 15) == 0
    assert time.monotonic() - signalled < timeout + 4
    assert "Application shutdown complete" in server.log()  # the lifespan stopped the worker
