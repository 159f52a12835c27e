"""Issue 46, per-key isolation in the routes (in process, the tiny model; the servers of
test_cache_isolation.py check the cache itself): stored responses are their key's, a Responses API
lease on a prompt shorter than a block is salted with the key's root, and with several keys, per_key
isolation and no admin key, /v1/cache/ shows a key only its own requests and leaves what changes
everyone's cache (flush, shared pins, pins by hash, the pin list) to an admin key."""

from __future__ import annotations

import pytest
from starlette.testclient import TestClient
from test_api_tools import _loaded
from test_cache_isolation import ADMIN, KEY_A, KEY_B, KEY_FILE

from mlx_kvserve.api_keys import ApiKeys, parse_key_file
from mlx_kvserve.config import load_config
from mlx_kvserve.engine.cache.admin import CacheAdmin
from mlx_kvserve.engine.engine import Engine
from mlx_kvserve.server.app import create_app
from mlx_kvserve.server.gate import PRINCIPAL_HEADER_ENV

PRINCIPALS = parse_key_file(KEY_FILE, "keys")  # alice (KEY_A), key-2 (KEY_B), carol
ALICE = PRINCIPALS[0].identity


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


BLOCK = 32  # more than the prompt of "Hi" (21 tokens), less than it and its reply


@pytest.fixture(scope="module")
def engine(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("isolation")
    overrides = {"cache": {"block_size": BLOCK}, "ssd": {"cache_dir": str(root / "kv"), "async_writes": False}}
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MLX_KVSERVE_HOME", str(root / "home"))
        return Engine(_loaded(tiny_model_dir, "tiny"), load_config(overrides=overrides))


@pytest.fixture(scope="module")
def keyed(engine):
    """Three inference keys, per_key isolation ("auto"), no admin key."""
    with TestClient(create_app(engine, ApiKeys(KEY_A, "", PRINCIPALS))) as client:
        yield client


def respond(client, key: str, **fields) -> dict:
    body = {"model": "tiny", "input": "Hi", "max_output_tokens": 4, "temperature": 0} | fields
    reply = client.post("/v1/responses", json=body, headers=auth(key))
    assert reply.status_code == 200, reply.text
    return reply.json()


# --- stored responses ----------------------------------------------------------------------------------------


def test_a_key_cannot_read_continue_or_delete_another_keys_stored_response(keyed):
    kept = respond(keyed, KEY_A)["id"]
    unknown = keyed.get("/v1/responses/resp_never", headers=auth(KEY_B))
    assert unknown.status_code == 404
    theirs = keyed.get(f"/v1/responses/{kept}", headers=auth(KEY_B))
    assert theirs.status_code == 404  # as if it did not exist: the same answer as an unknown id
    assert theirs.json()["error"] == unknown.json()["error"] | {"message": f"response with id {kept!r} not found"}
    body = {"model": "tiny", "input": "And?", "previous_response_id": kept, "max_output_tokens": 2}
    go_on = keyed.post("/v1/responses", json=body, headers=auth(KEY_B))
    assert go_on.status_code == 404 and go_on.json()["error"]["param"] == "previous_response_id"
    assert keyed.delete(f"/v1/responses/{kept}", headers=auth(KEY_B)).status_code == 404
    # Still there for its own key, which may continue and delete it.
    assert keyed.get(f"/v1/responses/{kept}", headers=auth(KEY_A)).json()["id"] == kept
    assert respond(keyed, KEY_A, input="And?", previous_response_id=kept)["previous_response_id"] == kept
    assert keyed.delete(f"/v1/responses/{kept}", headers=auth(KEY_A)).status_code == 200


def beside(engine, keys: ApiKeys) -> TestClient:
    """A second app on the engine `keyed` started (no lifespan: one worker serves both)."""
    return TestClient(create_app(engine, keys))


def test_one_key_keeps_reading_its_stored_responses(engine, keyed):
    client = beside(engine, ApiKeys(KEY_A, ""))
    kept = respond(client, KEY_A)["id"]
    assert client.get(f"/v1/responses/{kept}", headers=auth(KEY_A)).status_code == 200


# --- leases --------------------------------------------------------------------------------------------------


def test_a_lease_on_a_prompt_shorter_than_a_block_is_in_the_keys_chain(engine, keyed, monkeypatch):
    granted: list[tuple[list[int], list[bytes]]] = []
    lease = CacheAdmin.lease

    def recording(self, tokens, ttl_s, known=()):
        granted.append((list(tokens), list(known)))
        return lease(self, tokens, ttl_s, known)

    monkeypatch.setattr(CacheAdmin, "lease", recording)
    assert len(engine.chat_tokens([{"role": "user", "content": "Hi"}])) < BLOCK
    respond(keyed, KEY_A, input="Hi", max_output_tokens=24)
    ((tokens, known),) = granted
    assert len(tokens) >= BLOCK  # the prompt and its reply: a full block to lease
    own, plain = engine.block_hashes(tokens, ALICE), engine.block_hashes(tokens)
    assert own and not set(own) & set(plain)
    assert engine.cache_admin().block_hashes(tokens, known) == own  # what was leased: alice's chain
    assert own[-1].hex() in {lease["block_hash"] for lease in engine.cache_admin().leases()}


# --- /v1/cache/ with several keys caching apart and no admin key ------------------------------------------------

SYSTEM = "You are the office's assistant. Answer briefly and kindly, in English, in one sentence. " * 2


def chat(client, key: str) -> str:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}
    reply = client.post("/v1/chat/completions", json=body, headers=auth(key))
    assert reply.status_code == 200, reply.text
    return reply.json()["id"]


def test_a_key_lists_only_its_own_requests(keyed):
    mine, theirs = chat(keyed, KEY_A), chat(keyed, KEY_B)
    ids_a = [r["id"] for r in keyed.get("/v1/cache/requests", headers=auth(KEY_A)).json()["requests"]]
    ids_b = [r["id"] for r in keyed.get("/v1/cache/requests", headers=auth(KEY_B)).json()["requests"]]
    assert mine in ids_a and theirs not in ids_a
    assert theirs in ids_b and mine not in ids_b
    assert keyed.get("/v1/cache/stats", headers=auth(KEY_B)).status_code == 200  # counts only, as /metrics


@pytest.mark.parametrize(
    ("method", "path", "body"),
    [
        ("POST", "/v1/cache/flush", {}),
        ("POST", "/v1/cache/prune", {}),
        ("GET", "/v1/cache/pins", None),  # every key's block hashes, which unpin by hash would take
        ("GET", "/v1/cache/events", None),
        ("POST", "/v1/cache/pin", {"prompt": SYSTEM, "shared": True}),
        ("POST", "/v1/cache/pin", {"block_hashes": ["00" * 32]}),
        ("POST", "/v1/cache/unpin", {"block_hashes": ["00" * 32]}),
    ],
)
def test_what_reaches_every_keys_cache_needs_an_admin_key(keyed, method, path, body):
    reply = keyed.request(method, path, json=body, headers=auth(KEY_A))
    assert reply.status_code == 403, reply.text
    error = reply.json()["error"]
    assert error["code"] == "admin_key_required" and "server.admin_api_key" in error["message"]


def test_a_key_pins_its_own_prompt_but_not_a_shared_one(engine, keyed):
    own = keyed.post("/v1/cache/pin", json={"prompt": SYSTEM}, headers=auth(KEY_B))
    assert own.status_code == 200, own.text
    assert keyed.post("/v1/cache/unpin", json={"prompt": SYSTEM}, headers=auth(KEY_B)).json()["unpinned_count"] == 1
    admin = beside(engine, ApiKeys(KEY_A, ADMIN, PRINCIPALS))
    assert admin.post("/v1/cache/pin", json={"prompt": SYSTEM, "shared": True}, headers=auth(ADMIN)).status_code == 200
    try:  # the prompt is all shared blocks: unpinning it would unpin every key's
        refused = keyed.post("/v1/cache/unpin", json={"prompt": SYSTEM}, headers=auth(KEY_B))
        assert refused.status_code == 403 and refused.json()["error"]["code"] == "admin_key_required"
    finally:
        admin.post("/v1/cache/unpin", json={"prompt": SYSTEM, "shared": True}, headers=auth(ADMIN))
    assert not engine.cache_admin().pins()


def test_an_admin_key_or_a_single_key_reaches_the_whole_cache(engine, keyed):
    admin = beside(engine, ApiKeys(KEY_A, ADMIN, PRINCIPALS))
    assert admin.post("/v1/cache/flush", json={}, headers=auth(ADMIN)).status_code == 200
    assert admin.get("/v1/cache/pins", headers=auth(KEY_A)).status_code == 401  # the admin key's alone
    chat(admin, KEY_A), chat(admin, KEY_B)
    assert len(admin.get("/v1/cache/requests", headers=auth(ADMIN)).json()["requests"]) == 2
    single = beside(engine, ApiKeys(KEY_A, ""))
    assert single.post("/v1/cache/flush", json={}, headers=auth(KEY_A)).status_code == 200
    assert single.get("/v1/cache/pins", headers=auth(KEY_A)).status_code == 200


def test_a_models_process_holds_a_key_to_its_own_when_its_parent_says_so(engine, keyed, monkeypatch):
    """A model in a process of its own gets /v1/cache/ requests from its parent, which names in
    x-kvserve-own-cache the key they come from: the child's routes hold it to its own blocks."""
    body, header = {"block_hashes": ["00" * 32]}, {"x-kvserve-own-cache": "alice"}
    plain = beside(engine, ApiKeys(KEY_A, ""))  # a server no parent started: the header means nothing
    assert plain.post("/v1/cache/pin", json=body, headers=auth(KEY_A) | header).status_code == 200
    monkeypatch.setenv(PRINCIPAL_HEADER_ENV, "1")
    child = beside(engine, ApiKeys(KEY_A, ""))
    refused = child.post("/v1/cache/pin", json=body, headers=auth(KEY_A) | header)
    assert refused.status_code == 403 and refused.json()["error"]["param"] == "block_hashes"
    assert child.post("/v1/cache/pin", json=body, headers=auth(KEY_A)).status_code == 200
