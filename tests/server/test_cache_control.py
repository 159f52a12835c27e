"""Anthropic `cache_control` honoured as pins that expire (issue 13, item 6): a marked block pins the
prompt's prefix up to and including it for its TTL, every use refreshes it, it ends by itself, it
shows in /v1/cache/pins, and leases hold at most their share of the budget. Time is a fake clock.
"""

from __future__ import annotations

import asyncio
import json

import anthropic
import pytest
from starlette.testclient import TestClient
from test_api_anthropic import _loaded
from test_api_tools import tool_loaded  # noqa: F401  (fixture)
from test_hardening_wire import BS, make_engine
from test_server_e2e import wait_until

from mlx_kvserve.config import ApiKeys
from mlx_kvserve.engine.cache.admin import CacheAdmin
from mlx_kvserve.errors import KVServeError
from mlx_kvserve.kv.leases import PinLeases
from mlx_kvserve.kv.pins import PinRegistry
from mlx_kvserve.server import cache_control
from mlx_kvserve.server.app import create_app


class Clock:
    def __init__(self, now: float = 1_000_000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


def chain(n: int, tag: bytes = b"a") -> list[bytes]:
    return [tag * 31 + bytes([i]) for i in range(n)]


# --- the lease book ------------------------------------------------------------------------------------------


def test_a_lease_covers_its_chain_until_it_expires_and_use_refreshes_it():
    clock = Clock()
    leases = PinLeases(None, clock=clock)
    pins = PinRegistry(None, leases)
    blocks = chain(3)
    assert leases.grant(blocks, 300.0) == 3
    assert all(pins.is_pinned(h) for h in blocks) and len(pins) == 3
    clock.now += 200
    assert leases.touch([blocks[-1], b"x" * 32]) == 1  # the request used the whole chain
    clock.now += 250  # 450 s after the grant, 250 after the use
    assert pins.is_pinned(blocks[0])
    clock.now += 51
    assert not any(pins.is_pinned(h) for h in blocks) and len(pins) == 0 and leases.items() == []
    assert leases.touch(blocks) == 0  # an expired lease is not revived by use


def test_granting_again_never_shortens_a_lease():
    clock = Clock()
    leases = PinLeases(None, clock=clock)
    leases.grant(chain(2), 3600.0)
    leases.grant(chain(2), 300.0)
    clock.now += 1000
    assert leases.covers(chain(2)[0])
    assert leases.items()[0]["ttl_s"] == 300.0


def test_leases_stay_within_their_byte_share_releasing_the_soonest_to_expire():
    clock = Clock()
    leases = PinLeases(None, max_bytes=5 * 100, clock=clock)  # five 100-byte blocks
    first, second = chain(3, b"a"), chain(2, b"b")
    leases.grant(first, 300.0, block_bytes=100)
    leases.grant(second, 3600.0, block_bytes=100)
    assert all(leases.covers(h) for h in first + second)
    third = chain(2, b"c")
    leases.grant(third, 3600.0, block_bytes=100)  # 7 > 5 blocks: the 5-minute lease goes
    assert not any(leases.covers(h) for h in first)
    assert all(leases.covers(h) for h in second + third) and leases.released_for_room == 1
    assert leases.grant(chain(9, b"d"), 300.0, block_bytes=100) == 5  # one chain alone: cut to the share


def test_leases_survive_a_restart_and_expired_or_damaged_ones_do_not(tmp_path):
    clock = Clock()
    path = tmp_path / "leases.json"
    leases = PinLeases(path, clock=clock)
    leases.grant(chain(2, b"a"), 300.0)
    leases.grant(chain(3, b"b"), 3600.0)
    clock.now += 400
    again = PinLeases(path, clock=clock)
    assert [item["blocks"] for item in again.items()] == [3]
    assert again.covers(chain(3, b"b")[0]) and not again.covers(chain(2, b"a")[0])
    path.write_text("{not json")
    assert PinLeases(path, clock=clock).items() == []  # set aside, no leases
    data = {"version": 1, "leases": {chain(1)[0].hex(): {"chain": "zz", "ttl_s": 300.0, "expires": 2e6}}}
    path.write_text(json.dumps(data))
    assert PinLeases(path, clock=clock).items() == []  # a chain that does not read back is dropped


def test_an_agent_turns_renewals_are_written_as_refreshes_and_covers_follow_every_grant(tmp_path):
    """Each turn of an agent session renews its system prompt's lease and leases a longer chain for its
    last message: a new chain is written at once, a renewal at most every SAVE_EVERY_S (as a refresh);
    the cover grows with each chain and shrinks when a lease ends for room."""
    from mlx_kvserve.kv.leases import SAVE_EVERY_S

    clock, path = Clock(), tmp_path / "leases.json"
    leases = PinLeases(path, max_bytes=12 * 100, clock=clock)
    system, turn1 = chain(3, b"s"), chain(3, b"s") + chain(4, b"t")
    leases.grant(system, 300.0, block_bytes=100)
    leases.grant(turn1, 300.0)
    written = path.read_bytes()
    assert [item["blocks"] for item in PinLeases(path, clock=clock).items()] == [3, 7]
    clock.now += 10
    leases.grant(system, 300.0)  # renewed: the file keeps the older expiry for now
    assert path.read_bytes() == written and leases.items()[-1]["expires_in_s"] == 300.0
    clock.now += SAVE_EVERY_S
    leases.grant(system, 300.0)
    assert path.read_bytes() != written
    expires = {item["blocks"]: item["expires_in_s"] for item in PinLeases(path, clock=clock).items()}
    assert expires == {3: 300.0, 7: 300.0 - 10 - SAVE_EVERY_S}
    assert all(leases.covers(h) for h in turn1)
    turn2 = system + chain(10, b"u")  # another branch, cut to the 12 blocks of the share: with it 16 blocks are
    leases.grant(turn2, 300.0)  # leased, so turn 1's lease, the soonest to expire, ends for room
    assert leases.released_for_room == 1 and all(leases.covers(h) for h in turn2[:12])
    assert not leases.covers(turn2[12]) and not any(leases.covers(h) for h in turn1[3:])
    clock.now += 301  # every lease expired: nothing covered, and a grant after it counts afresh
    assert not any(leases.covers(h) for h in turn2)
    leases.grant(chain(2, b"v"), 300.0)
    assert not any(leases.covers(h) for h in system) and all(leases.covers(h) for h in chain(2, b"v"))


# --- through the Anthropic API ---------------------------------------------------------------------------------

SYSTEM = "You are a careful assistant. " * 12  # several blocks of the byte-level tiny model


@pytest.fixture()
def served(tiny_model_dir, tmp_path):
    engine = make_engine(_loaded(tiny_model_dir, "tiny"), tmp_path)
    clock = Clock()
    engine.prefix_cache.manager.pins.leases.clock = clock
    with TestClient(create_app(engine, ApiKeys("", ""))) as client:
        yield engine, client, clock
    engine.stop(0)


def sdk(client) -> anthropic.Anthropic:
    return anthropic.Anthropic(api_key="none", base_url="http://testserver", http_client=client, max_retries=0)


def system_end(engine, question: str) -> tuple[list[int], int]:
    """The prompt of SYSTEM + `question`, and where SYSTEM's text ends in it."""
    prompt = engine.chat_tokens([{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}], True)
    tokenizer = engine.loaded.tokenizer
    end = next(n for n in range(len(prompt) + 1) if SYSTEM in tokenizer.decode(prompt[:n]))
    return prompt, end


def leases(client) -> list[dict]:
    return client.get("/v1/cache/pins").json()["leases"]


def test_a_marked_system_block_pins_its_prefix_for_five_minutes(served):
    engine, client, clock = served
    system = [{"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral"}}]
    first = sdk(client).messages.create(
        model="tiny", max_tokens=2, system=system, messages=[{"role": "user", "content": "hi"}]
    )
    prompt, end = system_end(engine, "hi")
    (lease,) = leases(client)
    assert lease["ttl_s"] == 300.0
    assert end - BS < lease["blocks"] * BS <= end  # the system prompt's full blocks, nothing after it
    usage = first.usage  # the pinned prefix was computed now: reported as written to the cache
    assert (usage.cache_read_input_tokens, usage.cache_creation_input_tokens) == (0, lease["blocks"] * BS)
    assert usage.input_tokens + usage.cache_creation_input_tokens == len(prompt)
    again = (
        sdk(client)
        .messages.create(model="tiny", max_tokens=2, system=system, messages=[{"role": "user", "content": "hi"}])
        .usage
    )
    assert again.cache_creation_input_tokens == 0 and again.cache_read_input_tokens >= lease["blocks"] * BS
    assert again.input_tokens + again.cache_read_input_tokens == len(prompt)
    hashes = engine.cache_admin().block_hashes(prompt[: lease["blocks"] * BS])
    assert lease["block_hash"] == hashes[-1].hex()
    assert all(engine.prefix_cache.manager.pins.is_pinned(h) for h in hashes)
    clock.now += 240  # a later request on the same system prompt, unmarked, uses the prefix: refreshed
    sdk(client).messages.create(model="tiny", max_tokens=2, system=SYSTEM, messages=[{"role": "user", "content": "yo"}])
    clock.now += 240
    assert len(leases(client)) == 1
    clock.now += 61
    assert leases(client) == [] and not engine.prefix_cache.manager.pins.is_pinned(hashes[0])


def test_a_one_hour_marker_and_a_marked_message_and_the_top_level_marker(served):
    engine, client, clock = served
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "first question " * 8}]},
        {"role": "assistant", "content": "an answer"},
        {
            "role": "user",
            "content": [{"type": "text", "text": "x" * 40, "cache_control": {"type": "ephemeral", "ttl": "1h"}}],
        },
    ]
    sdk(client).messages.create(model="tiny", max_tokens=2, system=SYSTEM, messages=messages)
    (lease,) = leases(client)
    assert lease["ttl_s"] == 3600.0 and lease["blocks"] >= 4
    clock.now += 3000
    assert len(leases(client)) == 1
    sdk(client).messages.create(
        model="tiny",
        max_tokens=2,
        messages=[{"role": "user", "content": "whole " * 40}],
        extra_body={"cache_control": {"type": "ephemeral"}},
    )
    assert sorted(item["ttl_s"] for item in leases(client)) == [300.0, 3600.0]


@pytest.mark.parametrize(
    "marker, words",
    [({"type": "ephemeral", "ttl": "2h"}, "'5m' or '1h'"), ({"type": "persistent"}, "ephemeral")],
)
def test_bad_markers_and_too_many_are_400s(served, marker, words):
    _, client, _ = served
    with pytest.raises(anthropic.BadRequestError, match=words):
        sdk(client).messages.create(
            model="tiny",
            max_tokens=2,
            system=[{"type": "text", "text": "s", "cache_control": marker}],
            messages=[{"role": "user", "content": "hi"}],
        )
    five = [{"type": "text", "text": f"s{i}", "cache_control": {"type": "ephemeral"}} for i in range(5)]
    with pytest.raises(anthropic.BadRequestError, match="at most 4"):
        sdk(client).messages.create(
            model="tiny", max_tokens=2, system=five, messages=[{"role": "user", "content": "hi"}]
        )


# --- a cut is not a request (issue 23, bug 3) ---------------------------------------------------------------

ALPHA = {
    "name": "alpha",
    "description": "The first tool, long enough to fill blocks of its own. " * 3,
    "input_schema": {"type": "object", "properties": {"x": {"type": "string"}}},
    "cache_control": {"type": "ephemeral"},
}
BETA = {"name": "beta", "input_schema": {"type": "object", "properties": {"n": {"type": "integer"}}}}
FORCED_BETA = {  # valid: the cut rendered at alpha's mark offers only alpha, and that is no request of its own
    "model": "tool-tiny",
    "max_tokens": 6,
    "tools": [ALPHA, BETA],
    "tool_choice": {"type": "tool", "name": "beta"},
    "messages": [{"role": "user", "content": "go"}],
}


@pytest.fixture()
def tool_served(tool_loaded, tmp_path):  # noqa: F811
    engine = make_engine(tool_loaded, tmp_path)
    submitted = []
    submit = engine.submit
    engine.submit = lambda req: (submitted.append(req), submit(req))[1]
    with TestClient(create_app(engine, ApiKeys("", ""))) as client:
        yield engine, client, submitted
    engine.stop(0)


def nothing_runs(engine) -> bool:
    return engine.worker.num_running == 0 and engine.worker.queue_depth == 0


@pytest.mark.parametrize("stream", [False, True])
def test_a_forced_tool_after_the_marked_one_is_served_and_pins_the_marked_tools(tool_served, stream):
    engine, client, submitted = tool_served
    reply = client.post("/v1/messages", json={**FORCED_BETA, "stream": stream})
    assert reply.status_code == 200, reply.text
    (lease,) = leases(client)
    prompt = submitted[0].prompt_tokens
    beta_at = engine.loaded.tokenizer.decode(prompt).index('"beta"')  # byte tokenizer: characters are tokens
    assert 0 < lease["blocks"] * BS <= beta_at  # alpha's blocks, nothing of beta
    assert wait_until(lambda: nothing_runs(engine), 10)


def test_an_error_after_submission_cancels_the_generation(tool_served, monkeypatch):
    engine, client, submitted = tool_served

    def fail(*args):
        raise KVServeError("the step after submission failed")

    # The route's step after the request was submitted: it sets up the request's leases.
    monkeypatch.setattr(cache_control, "PendingLeases", fail)
    body = {**FORCED_BETA, "tool_choice": {"type": "auto"}, "max_tokens": 1000}
    reply = client.post("/v1/messages", json=body)
    assert reply.status_code == 500 and "submission failed" in reply.text
    (gen_req,) = submitted
    assert gen_req.cancelled.is_set()
    assert wait_until(lambda: nothing_runs(engine), 10)


@pytest.mark.parametrize("stream", [False, True])
def test_a_lease_that_fails_is_logged_and_the_reply_stands(served, monkeypatch, caplog, stream):
    """Leases are taken beside the reply (a stream's after its first event): one that fails pins
    nothing, counts no cache_creation_input_tokens, and the reply is served whole."""
    engine, client, _ = served

    def fail(*args):
        raise KVServeError("the lease could not be taken")

    monkeypatch.setattr(CacheAdmin, "lease", fail)
    before = engine.cache_admin().leases()
    system = [{"type": "text", "text": "Fails to lease. " * 40, "cache_control": {"type": "ephemeral"}}]
    messages = [{"role": "user", "content": "hi"}]
    body = {"model": "tiny", "max_tokens": 4, "system": system, "messages": messages, "stream": stream}
    reply = client.post("/v1/messages", json=body, headers={"anthropic-version": "2023-06-01"})
    assert reply.status_code == 200, reply.text
    if stream:
        events = [json.loads(line[6:]) for line in reply.text.splitlines() if line.startswith("data: ")]
        assert [e["type"] for e in events][-2:] == ["message_delta", "message_stop"]
        usage = events[-2]["usage"]
    else:
        usage = reply.json()["usage"]
    assert usage["cache_creation_input_tokens"] == 0 and usage["input_tokens"] > 0
    assert engine.cache_admin().leases() == before
    assert "the marked prefixes could not be leased (the lease could not be taken)" in caplog.text


def test_a_cut_the_template_refuses_pins_nothing_and_the_request_is_served(served, monkeypatch):
    engine, client, _ = served

    def picky(render):
        def rendered(messages, *args, **kwargs):  # a template that refuses the cut's placeholder turn
            if messages[-1]["content"] == ".":
                raise ValueError("conversation roles must alternate")
            return render(messages, *args, **kwargs)

        return rendered

    monkeypatch.setattr(engine, "chat_tokens", picky(engine.chat_tokens))  # as ids
    monkeypatch.setattr(engine, "chat_text", picky(engine.chat_text))  # and as text
    system = [{"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral"}}]
    reply = sdk(client).messages.create(
        model="tiny", max_tokens=2, system=system, messages=[{"role": "user", "content": "hi"}]
    )
    assert reply.usage.cache_creation_input_tokens == 0 and leases(client) == []


def test_marked_prefixes_found_by_text_are_those_the_cuts_ids_give_and_encode_nothing(tool_served, monkeypatch):
    """A Claude Code-like request (two marked system blocks, a marked tool, a marked last message): where
    each marked prefix ends among the prompt's tokens, found from the cuts' text against the prompt's, is
    what comparing the cuts' own ids gives, and no cut is encoded for it."""
    from mlx_kvserve.engine.cache import token_memo
    from mlx_kvserve.server.anthropic.parse import to_openai
    from mlx_kvserve.server.messages import parse_messages

    engine = tool_served[0]
    mark = {"type": "ephemeral"}
    body = {
        "system": [
            {"type": "text", "text": "You are a coding agent.", "cache_control": mark},
            {"type": "text", "text": SYSTEM, "cache_control": mark},
        ],
        "tools": [ALPHA, BETA],
        "messages": [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "hello"},
            {"role": "user", "content": [{"type": "text", "text": "and now?", "cache_control": mark}]},
        ],
    }

    def prompt_of(cut):
        out = to_openai(cut, count_only=True)
        return parse_messages(out["messages"]), out.get("tools") or None, out.get("chat_template_kwargs", {})

    async def text(cut):
        return engine.chat_text(*prompt_of(cut))

    async def ids(cut):
        messages, tools, kwargs = prompt_of(cut)
        return engine.chat_tokens(messages, True, tools, kwargs)

    class Handler:
        pass

    handler, found = Handler(), cache_control.marks(body)
    handler.engine = engine
    messages, tools, kwargs = prompt_of({"model": "tool-tiny", "max_tokens": 4, **body})
    prompt = engine.chat_tokens(messages, True, tools, kwargs)
    prompt_text = engine.chat_text(messages, tools, kwargs)
    assert prompt_text is not None and len(found) == 4
    encodes = []
    real = token_memo.TokenMemo._encode
    monkeypatch.setattr(token_memo.TokenMemo, "_encode", lambda memo, *a: (encodes.append(a), real(memo, *a))[1])
    by_text = asyncio.run(cache_control.marked_ends(handler, found, prompt, prompt_text, cache_control.Cut(text, ids)))
    assert encodes == []
    by_ids = asyncio.run(cache_control.marked_ends(handler, found, prompt, None, cache_control.Cut(text, ids)))
    assert len(encodes) == 4  # each cut encoded (the memo reusing what it can)
    assert by_text == by_ids
    alpha, system0, system1, last = by_text  # marks() lists tools, then system blocks, then messages
    assert 0 < alpha < len(prompt) and 0 < system0 < system1 < len(prompt) and last == len(prompt)
