"""Issue 46, per-key isolation in the routes (in process, the tiny model; the servers of
test_cache_isolation.py check the cache itself): stored responses are their key's, a Responses API
lease on a prompt shorter than a block is salted with the key's root, and with several keys, per_key
isolation and no admin key, /v1/cache/ shows a key only its own requests and leaves what changes
everyone's cache (flush, shared pins, pins by hash, the pin list) to an admin key."""

from __future__ import annotations

import pytest
from starlette.testclient import TestClient
from test_api_tools import _loaded
from test_cache_isolation import KEY_A, KEY_B, KEY_FILE

from mlx_kvserve.api_keys import ApiKeys, parse_key_file
from mlx_kvserve.config import load_config
from mlx_kvserve.engine.cache_admin import CacheAdmin
from mlx_kvserve.engine.engine import Engine
from mlx_kvserve.server.app import create_app

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
