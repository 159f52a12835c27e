"""Issue 46: a prompt whose text alone is past the context window is refused in the API's own words
before the tokenizer runs on it (server/prompt_bound.py), and a prompt that fits never is."""

from __future__ import annotations

import random

import pytest
from starlette.testclient import TestClient
from test_api_tools import _loaded
from test_hardening_wire import make_engine
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers

from mlx_kvserve.config import ApiKeys
from mlx_kvserve.server.app import create_app
from mlx_kvserve.server.prompt_bound import max_token_bytes

BIG = "word " * 600_000  # 3 MB


@pytest.fixture(scope="module")
def served(tiny_model_dir, tmp_path_factory):
    engine = make_engine(_loaded(tiny_model_dir, "tiny"), tmp_path_factory.mktemp("bound"))
    with TestClient(create_app(engine, ApiKeys("", ""))) as client:
        yield engine, client


@pytest.fixture
def tokenized(served, monkeypatch):
    """The lengths of the texts the engine tokenizes from here on."""
    engine, _ = served
    seen: list[int] = []
    chat, text = engine.chat_tokens, engine.text_tokens

    def chat_tokens(messages, *args, **kw):
        seen.append(sum(len(m.get("content") or "") for m in messages))
        return chat(messages, *args, **kw)

    def text_tokens(prompt):
        seen.append(len(prompt))
        return text(prompt)

    monkeypatch.setattr(engine, "chat_tokens", chat_tokens)
    monkeypatch.setattr(engine, "text_tokens", text_tokens)
    return seen


def test_a_tokens_bytes_bound_every_texts_token_count(served, smollm_dir):
    from mlx_lm.utils import load_tokenizer

    rng = random.Random(7)
    pieces = ["the ", "   ", "\n\n", "é", "日本語", "🙂", "<|im_start|>", "0123456789", "ĠĠ", "aaaaaaaa"]
    for tokenizer in (served[0].tokenizer, load_tokenizer(smollm_dir)):
        per_token = max_token_bytes(tokenizer)
        assert per_token is not None and 8 <= per_token <= 200
        for _ in range(10):
            text = "".join(rng.choice(pieces) * rng.randint(1, 80) for _ in range(30))
            assert len(tokenizer.encode(text)) >= len(text.encode()) // per_token


def test_a_tokenizer_that_may_drop_text_has_no_bound():
    wordpiece = Tokenizer(models.WordPiece({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
    assert max_token_bytes(wordpiece) is None  # not a transformers tokenizer: nothing to read
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE({"a": 0, "b": 1}, [], byte_fallback=True))
    assert max_token_bytes(PreTrainedTokenizerFast(tokenizer_object=bpe)) == 1
    bpe.normalizer = normalizers.Sequence([normalizers.NFC(), normalizers.Replace(" ", "▁")])
    assert max_token_bytes(PreTrainedTokenizerFast(tokenizer_object=bpe)) == 3  # NFC: 3 bytes may become 1
    for normalizer in (normalizers.Lowercase(), normalizers.StripAccents(), normalizers.NFKC()):
        bpe.normalizer = normalizer
        assert max_token_bytes(PreTrainedTokenizerFast(tokenizer_object=bpe)) is None
    bpe.normalizer, bpe.pre_tokenizer = None, pre_tokenizers.WhitespaceSplit()  # drops whitespace
    assert max_token_bytes(PreTrainedTokenizerFast(tokenizer_object=bpe)) is None
    unk = Tokenizer(models.BPE({"a": 0, "[UNK]": 1}, [], unk_token="[UNK]", fuse_unk=True))
    assert max_token_bytes(PreTrainedTokenizerFast(tokenizer_object=unk)) is None  # a run of unknowns: one token


@pytest.mark.parametrize(
    ("path", "body", "words"),
    [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": BIG}]}, "maximum context length is 2048"),
        ("/v1/completions", {"prompt": BIG}, "maximum context length is 2048"),
        ("/v1/messages", {"messages": [{"role": "user", "content": BIG}]}, "prompt is too long: "),
        ("/v1/responses", {"input": BIG, "max_output_tokens": 16}, "exceeds the context window"),
    ],
)
def test_a_3mb_prompt_is_refused_without_tokenizing(served, tokenized, path, body, words):
    _, client = served
    limit = {} if path == "/v1/responses" else {"max_tokens": 1}
    reply = client.post(path, json={"model": "tiny", **limit, **body})
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert words in error["message"]
    assert tokenized == []  # the tokenizer never saw it
    if path == "/v1/chat/completions":
        assert error["code"] == "context_length_exceeded"


def test_a_prompt_that_fits_is_never_refused_by_its_size(served, tokenized):
    """Text far longer in bytes than the window in tokens, that still fits: many bytes a token."""
    engine, client = served
    per_token = max_token_bytes(engine.tokenizer)
    text = "<|im_start|>" * 1500  # 18 kB: one token each, 1500 tokens in a 2048 window
    assert len(text.encode()) > engine.context_length and len(text.encode()) // per_token < 2047
    reply = client.post("/v1/completions", json={"model": "tiny", "prompt": text, "max_tokens": 1})
    assert reply.status_code == 200, reply.text
    assert tokenized == [len(text)]
    # At the bound (2047 tokens at the fewest): tokenized, then refused by its real count.
    over = "x" * (2048 * per_token - 1)
    reply = client.post("/v1/completions", json={"model": "tiny", "prompt": over, "max_tokens": 1})
    assert reply.status_code == 400 and tokenized[-1] == len(over)


def test_truncate_counts_only_the_newest_turn(tiny_model_dir, tmp_path, monkeypatch):
    engine = make_engine(_loaded(tiny_model_dir, "tiny"), tmp_path, context_overflow="truncate")
    old = [{"role": "user", "content": "word " * 3000}, {"role": "assistant", "content": "ok"}]  # past 2048
    with TestClient(create_app(engine, ApiKeys("", ""))) as client:
        body = {"model": "tiny", "max_tokens": 1, "messages": [*old, {"role": "user", "content": "Hi"}]}
        reply = client.post("/v1/chat/completions", json=body)
        assert reply.status_code == 200, reply.text  # the old turn dropped
        assert reply.headers["x-kvserve-truncated-messages"] == "2"
        calls = []
        monkeypatch.setattr(engine, "chat_tokens", lambda *a, **k: calls.append(1) or [])
        body["messages"][-1]["content"] = BIG
        reply = client.post("/v1/chat/completions", json=body)
        assert reply.status_code == 400 and calls == []
    engine.stop(0)
