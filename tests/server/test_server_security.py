"""Security and limits on a real `mlx-kvserve run` process (tiny random-weight models): API keys over
every endpoint, token limits, first-token and total timeouts, and fuzzed bodies that must never
get a 5xx. Metrics, logs, load and signals are in test_server_ops.py."""

import json

import httpx
import openai
import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from test_server_e2e import build_endless_model, wait_until, write_config

from mlx_kvserve.cli import cli
from mlx_kvserve.config import ApiKeys, load_api_keys, load_config
from mlx_kvserve.errors import ConfigError

MODEL = "tiny-llama"
USER = [{"role": "user", "content": "hello the world"}]
CHAT, TEXT = "/v1/chat/completions", "/v1/completions"
LONG_PROMPT = "a " * 900  # 1800 tokens: prefill takes far longer than a few milliseconds
API_KEY, ENV_KEY, ADMIN_KEY = "sk-inference-123", "sk-from-env-456", "sk-admin-789"

# Every endpoint, with a request that succeeds when the key is right.
ENDPOINTS = [
    ("POST", CHAT, {"messages": USER, "max_tokens": 2}),
    ("POST", TEXT, {"prompt": "hi", "max_tokens": 2}),
    ("GET", "/v1/models", None),
    ("GET", "/metrics", None),
    ("GET", "/v1/cache/stats", None),
    ("GET", "/v1/cache/pins", None),
    ("GET", "/health", None),
]
ADMIN_PATHS = {"/v1/cache/stats", "/v1/cache/pins"}


def call(server, method: str, path: str, body=None, key: str | None = None, **kw) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key is not None else {}
    return httpx.request(method, server.base_url + path, json=body, headers=headers, timeout=60, **kw)


def assert_error(response: httpx.Response, status: int, error_type: str, code: str | None = None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["type"] == error_type and error["message"]
    if code is not None:
        assert error["code"] == code
    return error


# --- configuration of keys and limits (no server) ------------------------------------------------


def test_key_sources_and_their_order(tmp_path, monkeypatch):
    key_file = tmp_path / "key"
    key_file.write_text(f"  {API_KEY}\n")
    toml = write_config(tmp_path, f'[server]\napi_key_file = "{key_file}"\nadmin_api_key = "{ADMIN_KEY}"\n')
    assert load_api_keys(load_config(toml).server) == ApiKeys(API_KEY, ADMIN_KEY)  # file read, stripped

    def shown(*args: str) -> dict:
        result = CliRunner().invoke(cli, ["config", "show", "--config", str(toml), *args])
        assert result.exit_code == 0, result.output
        return json.loads(result.output)["server"]

    assert shown()["api_key_file"] == str(key_file) and shown()["admin_api_key"] == "<redacted>"
    monkeypatch.setenv("MLX_KVSERVE_API_KEY", ENV_KEY)  # the environment replaces the file's key file
    assert shown()["api_key"] == "<redacted>" and shown()["api_key_file"] == ""
    assert shown("--api-key-file", str(key_file))["api_key"] == ""  # a flag replaces the environment
    result = CliRunner().invoke(cli, ["config", "show", "--api-key", "a", "--api-key-file", str(key_file)])
    assert result.exit_code == 2 and "not both" in result.output


@pytest.mark.parametrize(
    ("text", "key"),
    [
        ('api_key = "a"\napi_key_file = "/k"', "server.api_key"),
        ('api_key = "two words"', "server.api_key"),
        ("max_concurrent = 18", "server.max_concurrent"),  # above max_queue + 1
        ("max_prompt_tokens = -1", "server.max_prompt_tokens"),
        ("first_token_timeout_s = -0.5", "server.first_token_timeout_s"),
    ],
)
def test_bad_limit_and_key_settings_name_the_key(tmp_path, text, key):
    with pytest.raises(ConfigError) as info:
        load_config(write_config(tmp_path, f"[server]\n{text}\n"))
    assert info.value.param == key


def test_unreadable_or_empty_key_file_is_a_config_error(tmp_path):
    (tmp_path / "empty").write_text("\n")
    for path in (tmp_path / "missing", tmp_path / "empty"):
        config = load_config(write_config(tmp_path, f'[server]\napi_key_file = "{path}"\n'))
        with pytest.raises(ConfigError) as info:
            load_api_keys(config.server)
        assert info.value.param == "server.api_key_file" and str(path) in info.value.message


# --- the auth matrix ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def keyed_server(start_module_server, tiny_model_dir, tmp_path_factory):
    """Inference key from --api-key-file (the flag beats $MLX_KVSERVE_API_KEY), admin key from the TOML."""
    folder = tmp_path_factory.mktemp("keyed")
    key_file = folder / "api.key"
    key_file.write_text(API_KEY + "\n")
    config = write_config(folder, f'[server]\nadmin_api_key = "{ADMIN_KEY}"\n')
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MLX_KVSERVE_API_KEY", ENV_KEY)
        return start_module_server(tiny_model_dir, "--api-key-file", str(key_file), config=config)


@pytest.fixture(scope="module")
def env_key_server(start_module_server, tiny_model_dir):
    """Inference key from the environment only: it guards the cache admin endpoints too."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MLX_KVSERVE_API_KEY", ENV_KEY)
        return start_module_server(tiny_model_dir)


@pytest.fixture(scope="module")
def admin_only_server(start_module_server, tiny_model_dir, tmp_path_factory):
    """Inference open, cache admin behind a key."""
    config = write_config(tmp_path_factory.mktemp("admin"), f'[server]\nadmin_api_key = "{ADMIN_KEY}"\n')
    return start_module_server(tiny_model_dir, config=config)


@pytest.fixture(scope="module")
def plain_server(start_module_server, tiny_model_dir, tmp_path_factory):
    """No keys; token limits small enough that fuzzed requests finish at once."""
    text = "[server]\nmax_prompt_tokens = 200\nmax_completion_tokens = 16\n[generation]\nmax_tokens = 8\n"
    return start_module_server(tiny_model_dir, config=write_config(tmp_path_factory.mktemp("plain"), text))


def expected_keys(server_kind: str, path: str) -> tuple[set, set]:
    """(keys that open `path`, keys rejected with 401) on each server; None is no header."""
    if path == "/health":
        return {None, "wrong", API_KEY, ENV_KEY, ADMIN_KEY}, set()
    every = {None, "wrong", API_KEY, ENV_KEY, ADMIN_KEY}
    if server_kind == "plain" or (server_kind == "admin-only" and path not in ADMIN_PATHS):
        return every, set()
    if server_kind == "keyed":
        opening = {ADMIN_KEY} if path in ADMIN_PATHS else {API_KEY, ADMIN_KEY}  # admin opens everything
    elif server_kind == "env":
        opening = {ENV_KEY}
    else:
        opening = {ADMIN_KEY}
    return opening, every - opening


@pytest.mark.parametrize("server_kind", ["keyed", "env", "admin-only", "plain"])
def test_auth_matrix(request, server_kind):
    fixture = {"keyed": "keyed_server", "env": "env_key_server", "admin-only": "admin_only_server"}
    server = request.getfixturevalue(fixture.get(server_kind, "plain_server"))
    for method, path, body in ENDPOINTS:
        opening, rejected = expected_keys(server_kind, path)
        for key in opening:
            response = call(server, method, path, body, key)
            assert response.status_code == 200, (path, key, response.text)
        for key in rejected:
            response = call(server, method, path, body, key)
            error = assert_error(response, 401, "invalid_request_error", "invalid_api_key")
            assert response.headers["www-authenticate"] == "Bearer", (path, key)
            assert ("admin API key" in error["message"]) == (path in ADMIN_PATHS and server_kind != "env")


@pytest.mark.parametrize(
    "header",
    [f"Basic {API_KEY}", f"Bearer {API_KEY}x", f"Bearer {API_KEY[:-1]}", API_KEY, "Bearer", f"Bearer {API_KEY} x"],
)
def test_near_miss_authorization_headers_are_rejected(keyed_server, header):
    response = httpx.get(keyed_server.base_url + "/v1/models", headers={"Authorization": header}, timeout=30)
    assert_error(response, 401, "invalid_request_error", "invalid_api_key")


def test_unknown_paths_need_the_key_too(keyed_server):
    assert call(keyed_server, "GET", "/v1/nothing-here").status_code == 401  # the route list stays private
    assert call(keyed_server, "GET", "/v1/nothing-here", key=API_KEY).status_code == 404
    assert call(keyed_server, "GET", "/health", key="anything").json()["status"] == "ok"


def test_openai_client_with_and_without_the_key(keyed_server):
    def client(key: str) -> openai.OpenAI:
        return openai.OpenAI(base_url=keyed_server.base_url + "/v1", api_key=key, max_retries=0, timeout=60)

    reply = client(API_KEY).chat.completions.create(model=MODEL, messages=USER, max_tokens=3)
    assert reply.choices[0].message.content is not None
    with pytest.raises(openai.AuthenticationError) as info:
        client(ENV_KEY).models.list()  # the flag's key won over the environment's
    assert info.value.status_code == 401 and info.value.code == "invalid_api_key"


# --- token limits ---------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["chat", "text"])
def test_prompt_token_limit(plain_server, kind):
    path, body = (
        (CHAT, {"messages": [{"role": "user", "content": "b " * 150}]})
        if kind == "chat"
        else (TEXT, {"prompt": "b " * 150})
    )
    # In OpenAI's words, as past the context (agents compact on them): max_prompt_tokens is the window told.
    error = assert_error(
        call(plain_server, "POST", path, body), 400, "invalid_request_error", "context_length_exceeded"
    )
    assert error["param"] == ("messages" if kind == "chat" else "prompt")
    assert error["message"].startswith("This model's maximum context length is 200 tokens. However, your")


def test_completion_token_limit(plain_server):
    body = {"messages": USER, "max_tokens": 17}
    error = assert_error(call(plain_server, "POST", CHAT, body), 422, "invalid_request_error")
    assert error["param"] == "max_tokens" and "at most 16" in error["message"]
    body = {"messages": USER, "max_completion_tokens": 17, "max_tokens": 3}  # the newer field wins
    assert call(plain_server, "POST", CHAT, body).status_code == 422
    at_limit = call(plain_server, "POST", CHAT, {"messages": USER, "max_tokens": 16, "temperature": 0}).json()
    assert 1 <= at_limit["usage"]["completion_tokens"] <= 16
    default = call(plain_server, "POST", TEXT, {"prompt": "x", "temperature": 0}).json()
    assert 1 <= default["usage"]["completion_tokens"] <= 8  # generation.max_tokens applies below the limit


# --- timeouts -------------------------------------------------------------------------------------------


def sse_events(response: httpx.Response) -> list:
    return [line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: ")]


@pytest.fixture(scope="module")
def first_token_server(start_module_server, tiny_model_dir, tmp_path_factory):
    config = write_config(tmp_path_factory.mktemp("ttft"), "[server]\nfirst_token_timeout_s = 0.005\n")
    return start_module_server(tiny_model_dir, config=config)


def test_first_token_timeout(first_token_server):
    server = first_token_server
    body = {"prompt": LONG_PROMPT, "max_tokens": 5}
    error = assert_error(call(server, "POST", TEXT, body), 504, "server_error", "first_token_timeout")
    assert "server.first_token_timeout_s" in error["message"]
    with httpx.stream("POST", server.base_url + TEXT, json=body | {"stream": True}, timeout=60) as response:
        assert response.status_code == 200  # the stream had started: the error ends it
        events = sse_events(response)
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"]["code"] == "first_token_timeout"
    # Both requests were cancelled in the worker, which goes on serving.
    assert wait_until(lambda: call(server, "GET", "/health").json()["busy"] is False, timeout=10)
    assert call(server, "GET", "/health").json()["status"] == "ok"


@pytest.fixture(scope="module")
def endless_dir(tmp_path_factory):
    return build_endless_model(tmp_path_factory.mktemp("endless-sec") / "endless-llama")


@pytest.fixture(scope="module")
def total_timeout_server(start_module_server, endless_dir, tmp_path_factory):
    config = write_config(tmp_path_factory.mktemp("total"), "[server]\nrequest_timeout_s = 0.5\n")
    return start_module_server(endless_dir, config=config)


@pytest.mark.parametrize("stream", [False, True])
def test_total_timeout_cancels_a_long_generation(total_timeout_server, stream):
    server = total_timeout_server
    body = {"messages": USER, "max_tokens": 1900, "temperature": 0, "stream": stream}
    if stream:
        with httpx.stream("POST", server.base_url + CHAT, json=body, timeout=60) as response:
            events = sse_events(response)
        assert events[-1] == "[DONE]" and len(events) > 3  # tokens flowed before the deadline
        assert json.loads(events[-2])["error"]["code"] == "request_timeout"
    else:
        assert_error(call(server, "POST", CHAT, body), 504, "server_error", "request_timeout")
    assert wait_until(lambda: call(server, "GET", "/health").json()["busy"] is False, timeout=5)


# --- fuzzed bodies: never a 5xx ----------------------------------------------------------------------

SCALARS = st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False) | st.text(max_size=30)
VALUES = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=10,
)
ROLES = st.sampled_from(["system", "developer", "user", "assistant", "tool", "wizard", ""])
PARTS = st.lists(
    st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url"]), "text": st.text(max_size=20)}), max_size=3
)
MESSAGE = st.fixed_dictionaries({"role": ROLES | VALUES}, optional={"content": st.text(max_size=80) | PARTS | VALUES})
FIELDS = {
    "model": st.sampled_from(["", "default", MODEL, "gpt-4o"]) | VALUES,
    "messages": st.lists(MESSAGE, max_size=3) | VALUES,
    "prompt": st.text(max_size=60) | st.lists(st.integers(-5, 300), max_size=8) | VALUES,
    "max_tokens": st.integers(-3, 20) | VALUES,
    "max_completion_tokens": st.integers(-3, 20) | VALUES,
    "temperature": st.floats(-1, 3, allow_nan=False) | VALUES,
    "top_p": st.floats(-1, 2, allow_nan=False) | VALUES,
    "seed": st.integers(-5, 2**65) | VALUES,
    "stop": st.text(max_size=4) | st.lists(st.text(max_size=3), max_size=10) | VALUES,
    "stream": st.booleans() | VALUES,
    "stream_options": st.fixed_dictionaries({}, optional={"include_usage": SCALARS}) | VALUES,
    "n": st.integers(0, 2) | VALUES,
    "kvserve": st.fixed_dictionaries({}, optional={"return_block_hashes": SCALARS}) | VALUES,
}
# One odd field on an otherwise valid request reaches the tokenizer, the worker and streaming.
ONE_ODD_FIELD = st.sampled_from(sorted(FIELDS)).flatmap(
    lambda name: FIELDS[name].map(lambda value: {"messages": USER, "prompt": "hi", "max_tokens": 3, name: value})
)
BODIES = ONE_ODD_FIELD | st.fixed_dictionaries({}, optional=FIELDS) | VALUES
FUZZ = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def assert_no_server_error(server, path: str, content: bytes) -> None:
    headers = {"content-type": "application/json"}
    with httpx.stream("POST", server.base_url + path, content=content, headers=headers, timeout=60) as response:
        assert response.status_code < 500, response.read()
        if response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream"):
            events = sse_events(response)
            assert events[-1] == "[DONE]"
            assert all(json.loads(e).get("error", {}).get("type") != "server_error" for e in events[:-1])
        else:
            response.read()


@FUZZ
@given(body=BODIES, path=st.sampled_from([CHAT, TEXT]))
def test_fuzzed_json_bodies_never_get_a_5xx(plain_server, body, path):
    # json.dumps escapes lone surrogates, which the server then decodes back into the strings.
    assert_no_server_error(plain_server, path, json.dumps(body).encode())


@settings(FUZZ, max_examples=50)
@given(content=st.binary(max_size=64))
@example(content=b"[" * 100_000)  # deeper than Python's recursion limit
@example(content=b'{"messages": [{"role": "user", "content": "\\ud800"}]}')
@example(content=b'{"prompt": "\\udfff x", "max_tokens": 2}')
@example(content=b'{"messages": [{"role": "user", "content": "hi"}], "temperature": NaN}')
def test_fuzzed_raw_bodies_never_get_a_5xx(plain_server, content):
    for path in (CHAT, TEXT):
        assert_no_server_error(plain_server, path, content)
