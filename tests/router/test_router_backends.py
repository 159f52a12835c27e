"""Router-side backend state: block set from events/snapshots, hit estimate, load counters."""

from mlx_kvserve.chain import BlockHasher
from mlx_kvserve.kv.hashing import namespace_hash
from mlx_kvserve.router.backends import CLAIM_PENALTY_S, BackendState

BS = 4


def hashes(tokens):
    return BlockHasher(namespace_hash("m", "float32", BS), BS).hash_blocks(tokens)


def test_estimate_is_longest_stored_prefix_in_tokens():
    b = BackendState("http://a", block_size=BS)
    h = hashes(list(range(16)))  # 4 blocks
    b.apply_events(stored=[h[0], h[1], h[3]])
    assert b.estimate_cache_hit(h) == 2 * BS  # h[2] missing: the chain stops there
    b.apply_events(removed=[h[0]])
    assert b.estimate_cache_hit(h) == 0


def test_unknown_layout_estimates_nothing():
    b = BackendState("http://a")
    h = hashes(list(range(8)))
    b.apply_events(stored=h)
    assert b.estimate_cache_hit(h) == 0 and b.num_blocks == 2


def test_snapshot_replaces_block_set():
    b = BackendState("http://a", block_size=BS)
    h = hashes(list(range(8)))
    b.apply_events(stored=[h[0]])
    b.reset_blocks([h[1]])
    assert b.num_blocks == 1 and b.estimate_cache_hit(h) == 0


def test_load_counters_round_trip_and_view():
    b = BackendState("http://a", block_size=BS)
    b.start_request(100)
    b.start_request(50)
    b.prefill_done(100)
    b.decoded(3)
    v = b.view([])
    assert (v.name, v.num_requests, v.pending_prefill_tokens, v.decode_tokens, v.cache_hit_tokens) == (
        "http://a",
        2,
        50,
        3,
        0,
    )
    b.finish_request(pending_prefill_left=0, decoded_tokens=3)
    b.finish_request(pending_prefill_left=50, decoded_tokens=0)
    b.finish_request(pending_prefill_left=0, decoded_tokens=0)  # one too many clamps at zero
    assert (b.num_requests, b.pending_prefill_tokens, b.decode_tokens) == (0, 0, 0)


def test_claims_contradicted_in_a_row_are_ignored_for_a_while():
    now = [100.0]
    b = BackendState("http://a", block_size=BS, clock=lambda: now[0])
    h = hashes(list(range(16)))  # 4 blocks
    b.apply_events(stored=h)
    claim = b.estimate_cache_hit(h)
    assert claim == 4 * BS
    # honest replies: a one-block claim back as 0, half a claim back, or an unweighable (no) claim
    assert not b.check_claim(BS, 0) and not b.check_claim(claim, claim // 2) and not b.check_claim(0, 0)
    assert not b.check_claim(claim, 0) and not b.check_claim(claim, BS)  # two strikes
    assert not b.check_claim(claim, claim)  # an agreeing reply resets the streak
    assert not b.check_claim(claim, 0) and not b.check_claim(claim, 0)
    assert b.check_claim(claim, 0)  # the third in a row
    assert b.num_contradictions == 5 and b.claims_ignored_s == CLAIM_PENALTY_S
    assert b.estimate_cache_hit(h) == 0 and b.num_blocks == 4  # still followed, not counted on
    assert not b.check_claim(0, 0)  # what it reports while ignored weighs nothing
    now[0] += CLAIM_PENALTY_S
    assert b.estimate_cache_hit(h) == claim and b.claims_ignored_s == 0
    assert b.check_claim(claim, 0)  # still lying: ignored again at the first contradiction
    assert b.estimate_cache_hit(h) == 0
