"""The backend's side of the router: the KV manager's block events and the /v1/cache/layout and
/v1/cache/events routes (snapshot, resumption, resync, the SSE stream)."""

import json
import random
from pathlib import Path
from types import SimpleNamespace

from starlette.applications import Starlette
from starlette.testclient import TestClient
from test_pins_unit import BS, FakeTier, insert_all, manager

from mlx_kvserve.engine.engine import Engine
from mlx_kvserve.errors import KVServeError
from mlx_kvserve.kv.events import BlockEventLog
from mlx_kvserve.server.gate import error_response, is_admin_path
from mlx_kvserve.server.router_routes import router_routes


def replay(mgr, since=0, start=()) -> set[bytes]:
    """The block set a follower builds from `start` and the events after `since`."""
    blocks = set(start)
    for e in mgr.events.since(since, limit=10**6).events:
        (blocks.add if e.kind.value == "stored" else blocks.discard)(e.block_hash)
    return blocks


def resident(mgr) -> set[bytes]:
    return {b.block_hash for b in mgr.resident_blocks()}


def test_stores_and_evictions_are_events_in_ram_order():
    mgr = manager(budget=300)  # three 100-byte blocks fit
    hashes = insert_all(mgr, list(range(4 * BS)))
    kinds = [(e.kind.value, e.block_hash) for e in mgr.events.since(0).events]
    # the fourth insert evicts the least recently used (the first) in the same step
    assert kinds == [("stored", h) for h in hashes] + [("removed", hashes[0])]
    assert replay(mgr) == resident(mgr) == set(hashes[1:])


def test_flush_reports_every_dropped_block():
    mgr = manager()
    insert_all(mgr, list(range(3 * BS)))
    seq = mgr.events.last_seq
    mgr.flush()
    assert [e.kind.value for e in mgr.events.since(seq).events] == ["removed"] * 3
    assert replay(mgr) == resident(mgr) == set()


def test_promotion_from_the_next_tier_is_a_stored_event():
    tier = FakeTier()
    mgr = manager(budget=200, tier=tier)
    tokens = list(range(3 * BS))
    insert_all(mgr, tokens)  # the first block went to the tier only
    assert replay(mgr) == resident(mgr)
    seq = mgr.events.last_seq
    found = mgr.lookup(tokens)  # promotes the first block back, which evicts another
    mgr.release(found.blocks)
    assert "stored" in [e.kind.value for e in mgr.events.since(seq).events]
    assert replay(mgr) == resident(mgr)


def test_random_operations_replay_to_the_resident_set():
    rng = random.Random(7)
    mgr = manager(budget=1000, tier=FakeTier())
    for _ in range(300):
        tokens = [rng.randrange(6) for _ in range(rng.randrange(1, 6) * BS)]
        op = rng.random()
        if op < 0.6:
            insert_all(mgr, tokens)
        elif op < 0.95:
            mgr.release(mgr.lookup(tokens).blocks)
        else:
            mgr.flush()
    assert replay(mgr) == resident(mgr)
    mgr.check_integrity()


def test_snapshot_then_later_events_rebuild_the_state():
    mgr = manager(budget=500)
    insert_all(mgr, list(range(4 * BS)))
    seq = mgr.events.last_seq  # read first, as the route does
    snapshot = resident(mgr)
    insert_all(mgr, list(range(100, 100 + 4 * BS)))  # evicts some of the snapshot
    assert replay(mgr, seq, snapshot) == resident(mgr)


class FakeEngine(SimpleNamespace):
    """The real Engine front (what the routes read) over fake internals."""

    model_path, cache_reason, router_view = Engine.model_path, Engine.cache_reason, Engine.router_view


def app_for(mgr, reason="") -> TestClient:
    engine = FakeEngine(
        model_name="m",
        loaded=SimpleNamespace(path=Path("/models/m")),
        prefix_cache=SimpleNamespace(manager=mgr, reason=reason),
    )
    handlers = {KVServeError: lambda request, exc: error_response(exc)}  # as the server's app maps them
    return TestClient(Starlette(routes=router_routes(engine), exception_handlers=handlers))


def test_layout_names_namespace_block_size_and_epoch():
    mgr = manager()
    body = app_for(mgr).get("/v1/cache/layout").json()
    assert body == {
        "model": "m",
        "model_path": "/models/m",
        "enabled": True,
        "namespace": mgr.hasher.namespace.hex(),
        "block_size": BS,
        "epoch": mgr.events.epoch,
        "last_seq": 0,
    }
    off = app_for(None, reason="disabled by configuration")
    assert off.get("/v1/cache/layout").json()["enabled"] is False
    r = off.get("/v1/cache/events")
    assert r.status_code == 404 and "disabled by configuration" in r.text


def test_events_resume_from_a_position_and_resync_when_it_means_nothing():
    mgr = manager()
    client = app_for(mgr)
    hashes = insert_all(mgr, list(range(2 * BS)))
    first = client.get("/v1/cache/events", params={"stream": "false"}).json()["messages"]
    assert first == [{"type": "snapshot", "epoch": mgr.events.epoch, "seq": 2, "hashes": [h.hex() for h in hashes]}]
    more = insert_all(mgr, list(range(100, 100 + BS)))
    page = client.get("/v1/cache/events", params={"stream": "false", "since": 2, "epoch": mgr.events.epoch})
    assert page.json()["messages"] == [
        {"type": "events", "epoch": mgr.events.epoch, "seq": 3, "events": [["stored", more[0].hex()]]}
    ]
    other_epoch = client.get("/v1/cache/events", params={"stream": "false", "since": 2, "epoch": "restarted"})
    assert other_epoch.json()["messages"][0]["type"] == "snapshot"
    mgr.events = BlockEventLog(capacity=1)  # a bounded log that dropped the position
    insert_all(mgr, list(range(200, 200 + 2 * BS)))
    dropped = client.get("/v1/cache/events", params={"stream": "false", "since": 0, "epoch": mgr.events.epoch})
    assert dropped.json()["messages"][0]["type"] == "snapshot"


def test_bad_parameters_are_422():
    client = app_for(manager())
    for params in (
        {"since": "-1"},
        {"since": "x"},
        {"since": "\u00b2"},
        {"since": "9" * 40},
        {"max_s": "nan"},
        {"max_s": "99"},
        {"stream": "maybe"},
    ):
        r = client.get("/v1/cache/events", params=params)
        assert r.status_code == 422, params


def test_stream_sends_snapshot_then_events_then_ends():
    mgr = manager()
    insert_all(mgr, list(range(BS)))
    client = app_for(mgr)
    with client.stream("GET", "/v1/cache/events", params={"max_s": "0.3"}) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        text = "".join(r.iter_text())
    names = [line[7:] for line in text.splitlines() if line.startswith("event: ")]
    assert names == ["snapshot", "end"]
    snapshot = json.loads(next(line[6:] for line in text.splitlines() if line.startswith("data: ")))
    assert snapshot["seq"] == 1 and len(snapshot["hashes"]) == 1


def test_both_routes_need_the_admin_key():
    # block hashes tell which prompts are cached: the gate treats them as cache administration
    assert is_admin_path("/v1/cache/layout") and is_admin_path("/v1/cache/events")
