"""StepTurns (engine/batch/step_turns.py) without a model: steps run one at a time, in the order they asked,
and an engine alone never waits."""

import threading
import time
from types import SimpleNamespace

from mlx_kvserve.engine.batch.step_turns import StepTurns, share_turns


def test_steps_take_turns_in_the_order_they_asked():
    turns, order, inside = StepTurns(), [], []

    def step(name: str) -> None:
        with turns.turn():
            inside.append(name)
            assert len(inside) == 1, "two steps at once"
            order.append(name)
            time.sleep(0.01)
            inside.remove(name)

    with turns.turn():  # a long step holds the turn while the others ask, one after the other
        threads = []
        for name in ("small", "large", "third"):
            threads.append(threading.Thread(target=step, args=(name,)))
            threads[-1].start()
            while turns.num_turns < len(threads) + 1:
                time.sleep(0.001)
    for thread in threads:
        thread.join(5)
    assert order == ["small", "large", "third"] and turns.num_waits == 3


def test_an_engine_alone_never_waits_and_share_turns_reaches_its_worker():
    turns = StepTurns()
    for _ in range(5):
        with turns.turn():
            pass
    assert turns.num_turns == 5 and turns.num_waits == 0
    engine = SimpleNamespace(worker=SimpleNamespace(turns=None))
    share_turns(engine, turns)
    assert engine.worker.turns is turns
    share_turns(SimpleNamespace(), turns)  # an embedding engine (no InferenceWorker): left alone
