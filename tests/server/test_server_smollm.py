"""A real server on the real SmolLM2: it answers a factual question, and its usage counts agree
with the model's own tokenizer."""

import openai
import pytest
from transformers import AutoTokenizer

pytestmark = pytest.mark.slow

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def server(start_module_server, smollm_dir):
    return start_module_server(smollm_dir)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def tokenizer(smollm_dir):
    return AutoTokenizer.from_pretrained(str(smollm_dir))


def test_served_id_is_the_folder_name(client, smollm_dir):
    assert [m.id for m in client.models.list().data] == [smollm_dir.name]


def test_capital_of_france(client, smollm_dir, tokenizer):
    r = client.chat.completions.create(model=smollm_dir.name, messages=QUESTION, temperature=0, max_tokens=20)
    answer = r.choices[0].message.content
    assert "Paris" in answer
    text = tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=False)
    assert r.usage.prompt_tokens == len(tokenizer(text, add_special_tokens=False)["input_ids"])
    # Greedy output of plain English re-tokenizes to the tokens that produced it; usage counts the
    # end-of-turn token too when the model ended the answer (as vLLM and mlx_lm.server do).
    assert r.choices[0].finish_reason == "stop"  # the model ends its answer: its eos is counted
    assert r.usage.completion_tokens == len(tokenizer(answer, add_special_tokens=False)["input_ids"]) + 1
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_streamed_answer_equals_the_whole_one(client, smollm_dir):
    def ask(**kw):
        return client.chat.completions.create(
            model=smollm_dir.name, messages=QUESTION, temperature=0, max_tokens=20, **kw
        )

    whole = ask().choices[0].message.content
    chunks = list(ask(stream=True, stream_options={"include_usage": True}))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == whole
    assert chunks[-1].usage.completion_tokens >= 1


def test_text_completion_usage(client, smollm_dir, tokenizer):
    prompt = "The Eiffel Tower is located in the city of"
    r = client.completions.create(model=smollm_dir.name, prompt=prompt, temperature=0, max_tokens=8)
    text = r.choices[0].text
    assert "Paris" in text
    assert r.usage.prompt_tokens == len(tokenizer(prompt)["input_ids"])
    ended = r.choices[0].finish_reason == "stop"  # at eos, counted in usage
    assert r.usage.completion_tokens == len(tokenizer(text, add_special_tokens=False)["input_ids"]) + ended
    assert ended or r.usage.completion_tokens == 8
