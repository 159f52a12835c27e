"""A new question under the same messages reuses the prompt up to where its own message starts, not
only up to the last whole block before it (engine/cache/prefix_cache.py `_tail_ends`: a tail is kept at each
new message start). The server's own stack (engine/build.py), the default model and its chat template."""

from __future__ import annotations

import threading

import pytest
from kvharness import greedy, make_generator
from mlx_lm.utils import load

from mlx_kvserve.config import load_config
from mlx_kvserve.engine.cache.message_starts import turn_start_token
from mlx_kvserve.engine.engine import Engine
from mlx_kvserve.engine.request import Finished, GenerationRequest, SamplingParams
from mlx_kvserve.models.loader import LoadedModel

SYSTEM = " ".join(f"Rule {i}: the visitor to room {i} signs the book at desk {i * 3}." for i in range(30))


@pytest.fixture(scope="module")
def smollm(smollm_dir):
    return load(str(smollm_dir))


def chat(tokenizer, question: str) -> list[int]:
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True))


def ask(engine: Engine, tokens: list[int]) -> Finished:
    done, events = threading.Event(), []
    params = SamplingParams(max_tokens=8, temperature=0.0)
    engine.submit(GenerationRequest(f"q{len(tokens)}", tokens, params, events.append, on_done=done.set))
    assert done.wait(300)
    assert isinstance(events[-1], Finished), events[-1]
    return events[-1]


@pytest.mark.parametrize("ssd", [False, True])
def test_a_new_question_reuses_the_prompt_up_to_its_own_message(smollm, smollm_dir, tmp_path, monkeypatch, ssd):
    monkeypatch.setenv("MLX_KVSERVE_HOME", str(tmp_path))
    model, tokenizer = smollm
    marker = turn_start_token(tokenizer)
    # The first question runs past the next block boundary: its prompt's own tail starts after the
    # block where the second question diverges, so only a tail at the message start serves that block.
    long_question = "Which desk is for room 4? " + " ".join(f"Say also which desk room {i} has." for i in range(12))
    first, second = chat(tokenizer, long_question), chat(tokenizer, "Who signs at desk 27?")
    user_start = [p for p, t in enumerate(second) if t == marker][-2]  # the user message's (the last: the reply's)
    assert first[:user_start] == second[:user_start] and first[user_start + 4 :] != second[user_start + 4 :]
    config = load_config(overrides={"ssd": {"enabled": ssd}, "speculative": {"mode": "off"}})
    block = config.cache.block_size
    assert user_start % block, "the message must start inside a block for this test to mean anything"
    assert len(first) > (user_start // block + 1) * block  # the first prompt's end tail is in a later block
    engine = Engine(LoadedModel("smollm", smollm_dir, model, tokenizer, {}, 2048), config)
    engine.start()
    try:
        ask(engine, first)
        hit = ask(engine, second)
    finally:
        engine.stop()
    assert hit.usage.cached_tokens >= user_start > user_start // block * block  # more than the whole blocks
    assert hit.token_ids == greedy(make_generator(model, tokenizer, block), second, 8)[0]  # = a cold run
