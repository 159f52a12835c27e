"""engine/order.py: cached-first start order with a starvation bound, and the scheduler applying it."""

from dataclasses import dataclass

from kvharness import make_generator
from mlx_lm import load

from mlx_kvserve.engine.order import StartOrder
from mlx_kvserve.engine.request import Finished, GenerationRequest, SamplingParams


@dataclass
class P:
    req: str
    started: float
    seq: int


def test_cached_first_picks_the_fewest_uncached_tokens():
    pending = [P("cold", 0.0, 1), P("warm", 0.5, 2), P("warmer", 0.9, 3)]
    uncached = {"cold": 2000, "warm": 120, "warmer": 60}.get
    assert StartOrder("cached_first", 5.0).pick(pending, uncached, now=1.0).req == "warmer"


def test_a_request_past_the_bound_goes_first_oldest_first():
    pending = [P("cold-a", 0.0, 1), P("cold-b", 1.0, 2), P("warm", 5.5, 3)]
    uncached = {"cold-a": 2000, "cold-b": 1000, "warm": 10}.get
    order = StartOrder("cached_first", 5.0)
    assert order.pick(pending, uncached, now=5.9).req == "cold-a"  # waited 5.9 s
    assert order.pick(pending[1:], uncached, now=5.9).req == "warm"  # cold-b waited only 4.9 s
    assert order.pick(pending[1:], uncached, now=6.0).req == "cold-b"


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
