"""engine/batch/order.py: cached-first start order with a starvation bound, and the scheduler applying it."""

from dataclasses import dataclass

from kvharness import make_generator
from mlx_lm import load

from mlx_kvserve.engine.batch.order import StartOrder
from mlx_kvserve.engine.request import Finished, GenerationRequest, SamplingParams


@dataclass
class P:
    req: str
    started: float
    seq: int
    passed_at: float | None = None


def test_cached_first_picks_the_fewest_uncached_tokens():
    pending = [P("cold", 0.0, 1), P("warm", 0.5, 2), P("warmer", 0.9, 3)]
    uncached = {"cold": 2000, "warm": 120, "warmer": 60}.get
    assert StartOrder("cached_first", 5.0).pick(pending, uncached, now=1.0).req == "warmer"


def test_a_request_passed_over_for_the_bound_goes_first_oldest_first():
    pending = [P("cold-a", 0.0, 1), P("cold-b", 1.0, 2), P("warm", 5.5, 3), P("warmer", 5.6, 4)]
    uncached = {"cold-a": 2000, "cold-b": 1000, "warm": 10, "warmer": 5}.get
    order = StartOrder("cached_first", 5.0)
    pick = order.pick(pending, uncached, now=6.0)
    assert pick.req == "warmer"  # the colds waited 5-6 s, but for room, not because of the order
    rest = [p for p in pending if p is not pick]
    order.passed(rest, pick, now=6.0)
    assert [p.passed_at for p in rest] == [6.0, 6.0, 6.0]  # every earlier arrival was passed
    assert order.pick(rest, uncached, now=10.9).req == "warm"  # passed over for 4.9 s: not yet
    assert order.pick(rest, uncached, now=11.0).req == "cold-a"  # 5 s: oldest first
    assert order.overdue(rest[0], 11.0) and not order.overdue(P("new", 10.0, 9), 11.0)


def test_a_later_pick_does_not_reset_the_time_passed_over():
    order = StartOrder("cached_first", 5.0)
    cold, warm1, warm2 = P("cold", 0.0, 1), P("w1", 1.0, 2), P("w2", 3.0, 3)
    order.passed([cold], warm1, now=1.0)
    order.passed([cold], warm2, now=3.0)
    assert cold.passed_at == 1.0


def test_fifo_keeps_arrival_order():
    pending = [P("b", 0.0, 2), P("a", 0.0, 1)]
    assert StartOrder("fifo").pick(pending, lambda r: 0, now=0.0).req == "a"


def test_scheduler_starts_the_cached_request_first_and_outputs_match(tiny_model_dir):
    """Three requests admitted together, one prefill at a time: the one whose prompt is cached
    starts (and gets its first token) before the cold ones that arrived earlier, and every
    reply equals its FIFO reply token for token."""
    model, tokenizer = load(str(tiny_model_dir))
    bs = 16
    text = " ".join(f"Note {i}: the orchard row {i} has {i * 5} apple trees by the old wall." for i in range(40))
    other = " ".join(f"Log {i}: the ferry left pier {i} at {i + 2} pm." for i in range(40))
    warm_prompt = tokenizer.encode(text)[: 6 * bs]
    colds = [tokenizer.encode(other)[i * 8 * bs : (i + 1) * 8 * bs] for i in range(2)]
    params = SamplingParams(max_tokens=6)

    def run(order: StartOrder) -> tuple[list[str], dict[str, tuple]]:
        gen = make_generator(model, tokenizer, bs)
        sched = gen.scheduler
        sched.order, sched.prefill_batch_size = order, 1
        gen.run(GenerationRequest("seed", warm_prompt + tokenizer.encode(" Why?"), params, lambda e: None))
        firsts: list[str] = []
        outs: dict[str, tuple] = {}

        def sink(name):
            def emit(event):
                if name not in firsts:
                    firsts.append(name)
                if isinstance(event, Finished):
                    outs[name] = event.token_ids

            return emit

        reqs = [GenerationRequest(f"cold{i}", p, params, sink(f"cold{i}")) for i, p in enumerate(colds)]
        reqs.append(GenerationRequest("warm", warm_prompt + tokenizer.encode(" And row 3?"), params, sink("warm")))
        for r in reqs:
            sched.admit(r)
        while sched.has_work:
            sched.step()
        return firsts, outs

    firsts, outs = run(StartOrder("cached_first", 60.0))
    assert firsts[0] == "warm"
    fifo_firsts, fifo_outs = run(StartOrder("fifo"))
    assert fifo_firsts[0] == "cold0"
    assert outs == fifo_outs and len(outs) == 3


def test_a_cold_request_waiting_for_room_does_not_jump_a_cached_one(tiny_model_dir):
    """The batch is full (max_batch 1) while a cold request waits, longer than the bound; a cached
    request arrives; when room frees, the cached one starts first (the cold one waited for room, no
    one passed it); the cold one is now passed and starts next."""
    import time

    model, tokenizer = load(str(tiny_model_dir))
    bs = 16
    text = " ".join(f"Note {i}: the orchard row {i} has {i * 5} apple trees by the old wall." for i in range(40))
    other = " ".join(f"Log {i}: the ferry left pier {i} at {i + 2} pm." for i in range(40))
    warm_prompt = tokenizer.encode(text)[: 6 * bs]
    gen = make_generator(model, tokenizer, bs)
    sched = gen.scheduler
    sched.order, sched.max_batch = StartOrder("cached_first", 0.05), 1
    gen.run(
        GenerationRequest("seed", warm_prompt + tokenizer.encode(" Why?"), SamplingParams(max_tokens=2), lambda e: None)
    )
    firsts: list[str] = []

    def sink(name):
        return lambda event: firsts.append(name) if name not in firsts else None

    busy = GenerationRequest("busy", tokenizer.encode(other)[:40], SamplingParams(max_tokens=8), sink("busy"))
    sched.admit(busy)
    sched.step()  # busy is in the batch: no room
    sched.admit(
        GenerationRequest("cold", tokenizer.encode(other)[50 : 50 + 8 * bs], SamplingParams(max_tokens=2), sink("cold"))
    )
    time.sleep(0.1)  # the cold one waits past the bound, for room
    sched.admit(
        GenerationRequest("warm", warm_prompt + tokenizer.encode(" Row 3?"), SamplingParams(max_tokens=2), sink("warm"))
    )
    while sched.has_work:
        sched.step()
    assert firsts == ["busy", "warm", "cold"]


def test_a_short_request_joins_while_the_prefill_slots_hold_a_long_prompt(tiny_model_dir):
    """prefill_batch_size 1 holds a long cold prompt (many chunks); a cached turn arriving meanwhile
    joins past the limit and has its first token long before the cold prompt's prefill ends; a
    second long prompt waits for the slot. Every reply equals its reply alone."""
    model, tokenizer = load(str(tiny_model_dir))
    bs, step = 16, 32
    text = " ".join(f"Note {i}: the orchard row {i} has {i * 5} apple trees by the old wall." for i in range(40))
    other = " ".join(f"Log {i}: the ferry left pier {i} at {i + 2} pm." for i in range(60))
    warm = tokenizer.encode(text)[: 6 * bs]
    longs = [tokenizer.encode(other)[i * 300 : (i + 1) * 300] for i in range(2)]
    params = SamplingParams(max_tokens=3)

    def alone(prompt):
        gen = make_generator(model, tokenizer, bs, prefill_step_size=step)
        out = []
        gen.run(GenerationRequest("a", prompt, params, out.append))
        return out[-1].token_ids

    gen = make_generator(model, tokenizer, bs, prefill_step_size=step)
    sched = gen.scheduler
    sched.prefill_batch_size = 1
    gen.run(GenerationRequest("seed", warm + tokenizer.encode(" Why?"), params, lambda e: None))
    first_step: dict[str, int] = {}
    outs: dict[str, tuple] = {}
    steps = 0

    def sink(name):
        def emit(event):
            first_step.setdefault(name, steps)
            if isinstance(event, Finished):
                outs[name] = event.token_ids

        return emit

    sched.admit(GenerationRequest("long0", longs[0], params, sink("long0")))
    sched.step()
    steps += 1
    sched.admit(GenerationRequest("long1", longs[1], params, sink("long1")))
    sched.admit(GenerationRequest("warm", warm + tokenizer.encode(" Row 3?"), params, sink("warm")))
    while sched.has_work:
        sched.step()
        steps += 1
    chunks = 300 // step
    assert first_step["warm"] <= 3 < chunks < first_step["long0"] < first_step["long1"]
    assert outs == {
        "long0": alone(longs[0]),
        "long1": alone(longs[1]),
        "warm": alone(warm + tokenizer.encode(" Row 3?")),
    }


def test_a_cold_prompt_within_one_chunk_waits_for_a_prefill_slot(tiny_model_dir):
    """Only a short uncached rest (at most short_prefill_tokens, a quarter chunk by default) joins past
    prefill_batch_size: a cold prompt that fits one chunk but is longer waits for the slot (joining,
    it would slow the long prompt's chunks), while a cached turn with 4 new tokens joins at once."""
    model, tokenizer = load(str(tiny_model_dir))
    bs, step = 16, 32
    text = " ".join(f"Note {i}: the orchard row {i} has {i * 5} apple trees by the old wall." for i in range(40))
    other = " ".join(f"Log {i}: the ferry left pier {i} at {i + 2} pm." for i in range(60))
    warm = tokenizer.encode(text)[: 6 * bs]
    long0, mid = tokenizer.encode(other)[:300], tokenizer.encode(other)[400:424]  # mid: 24 tokens, cold
    params = SamplingParams(max_tokens=2)
    gen = make_generator(model, tokenizer, bs, prefill_step_size=step)
    sched = gen.scheduler
    sched.prefill_batch_size = 1
    assert sched.short_prefill_tokens == step // 4
    gen.run(GenerationRequest("seed", warm + tokenizer.encode(" Why?"), params, lambda e: None))
    first_step: dict[str, int] = {}
    steps = 0

    def sink(name):
        return lambda event: first_step.setdefault(name, steps)

    sched.admit(GenerationRequest("long0", long0, params, sink("long0")))
    sched.step()
    steps += 1
    sched.admit(GenerationRequest("mid", mid, params, sink("mid")))
    sched.admit(GenerationRequest("warm", warm + tokenizer.encode(" Row 3?"), params, sink("warm")))
    while sched.has_work:
        sched.step()
        steps += 1
    assert first_step["warm"] <= 3 < 300 // step < first_step["long0"] <= first_step["mid"]

    sched.short_prefill_tokens = step  # the rule before: any rest within one chunk joined
    first_step.clear()
    steps = 0
    long1 = tokenizer.encode(other)[600:900]
    sched.admit(GenerationRequest("long1", long1, params, sink("long1")))
    sched.step()
    steps += 1
    sched.admit(GenerationRequest("mid2", tokenizer.encode(other)[1000:1024], params, sink("mid2")))
    while sched.has_work:
        sched.step()
        steps += 1
    assert first_step["mid2"] <= 3 < first_step["long1"]
