"""The token memo (engine/cache/token_memo.py) gives exactly a full encode's ids on many prompt pairs, and
reuses ids where it may; tokenizers whose split cannot be trusted get no memo."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers.tokenization_utils_tokenizers import TokenizersBackend

from mlx_kvserve.engine.cache import token_memo
from mlx_kvserve.engine.engine import Engine

SPECIALS = ["<|begin_of_text|>", "<|im_start|>", "<|im_end|>", "<|eot_id|>"]
QWEN_SPLIT = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
CORPUS = "hello world, the user said: ls -la; résumé naïve 日本語 🙂 tool result\n\n  indented code() {x: 1}\n"
PIECES = [
    "ls -la\n", "total 48\ndrwxr-xr-x  5 me staff 160 .\n", "résumé naïve 🙂", "日本語のテキスト", "  \n\n",
    "<|im_end|>", "<|im_start|>assistant", "<|im_", "|>", "<|eot_id|><|eot_id|>", " <|im_end|> ", "\t{x: 1}\n",
    '{"tool_use_id": "t1", "content": "ok"}', "<|begin_of_text|>", "a" * 40, " ", "\n", "'s 're",
]  # fmt: skip


def byte_level_tokenizer(pre: pre_tokenizers.PreTokenizer | None = None, specials: list | None = None) -> Tokenizer:
    """A small Qwen / Llama-3 style byte-level BPE with ChatML and Llama-3 special tokens."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre or pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(QWEN_SPLIT), "isolated"), pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )  # fmt: skip
    tok.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    tok.train_from_iterator([CORPUS] * 20, trainers.BpeTrainer(vocab_size=500, initial_alphabet=alphabet))
    tok.add_special_tokens(specials or SPECIALS)
    if specials is None:  # Llama 3's BOS, added by encodes that ask for special tokens (the template's do not)
        bos = ("<|begin_of_text|>", tok.token_to_id("<|begin_of_text|>"))
        tok.post_processor = processors.TemplateProcessing(single="<|begin_of_text|> $A", special_tokens=[bos])
    return tok


def chatml(turns: list[tuple[str, str]]) -> str:
    return "".join(f"<|im_start|>{role}\n{text}<|im_end|>\n" for role, text in turns) + "<|im_start|>assistant\n"


def conversations(rng: random.Random, num: int) -> list[str]:
    """Prompt texts in order: growing conversations, edited middles, tool results, unicode, user text
    holding special tokens' spellings (or parts of them) and whitespace around the marks."""
    texts = []
    for _ in range(num):
        turns = [("system", "".join(rng.choices(PIECES, k=8)))]
        for _ in range(rng.randint(2, 6)):
            turns.append((rng.choice(["user", "assistant", "tool"]), "".join(rng.choices(PIECES, k=rng.randint(0, 6)))))
            texts.append(chatml(turns))
        edited = list(turns)
        i = rng.randrange(len(edited))
        edited[i] = (edited[i][0], edited[i][1][: rng.randint(0, 9)] + rng.choice(PIECES))
        texts.append(chatml(edited))
        texts.append(chatml(turns)[: -rng.randint(1, 30)])  # cut anywhere, even inside a mark
    return texts


def check_same_ids(hf, texts: list[str], monkeypatch) -> token_memo.TokenMemo:
    monkeypatch.setattr(token_memo, "MIN_REUSE_CHARS", 1)  # reuse even short prefixes: more boundaries tried
    memo = token_memo.TokenMemo(hf, token_memo.boundary_ids(hf), max_entries=4)
    rng = random.Random(7)
    for i, text in enumerate(texts):
        out = hf(text, add_special_tokens=False, return_offsets_mapping=True)
        full, principal = out["input_ids"], f"p{i % 2}"
        assert memo.encode(text, principal=principal) == full, text
        # tokens_within: the ids wholly inside a prefix of the text, from the memo's offsets (joined or not)
        for chars in {0, len(text), *(rng.randint(0, len(text)) for _ in range(3))}:
            reach = [max(e for _, e in out["offset_mapping"][: n + 1]) for n in range(len(full))]
            assert memo.tokens_within(text, full, chars, principal) == sum(r <= chars for r in reach), (text, chars)
        assert memo.tokens_within(text, full[:-1], len(text), principal) is None  # not the ids of this text
        assert memo.tokens_within(text + "?", full, len(text), principal) is None  # a text not memoized
    return memo


def test_byte_level_bpe_memo_equals_full_encode(monkeypatch):
    hf = TokenizersBackend(tokenizer_object=byte_level_tokenizer())
    assert len(token_memo.boundary_ids(hf)) == len(SPECIALS)
    texts = conversations(random.Random(0), 40)
    assert hf("hi")["input_ids"][0] == hf.convert_tokens_to_ids("<|begin_of_text|>")  # BOS only when asked
    memo = check_same_ids(hf, texts, monkeypatch)
    assert memo.reused_tokens > sum(len(t) for t in texts) // 20  # the memo did the work, not full encodes


def test_smollm_memo_equals_full_encode_and_template(smollm_dir, monkeypatch):
    from mlx_lm.utils import load_tokenizer

    wrapper = load_tokenizer(smollm_dir)
    hf = wrapper._tokenizer
    memo = check_same_ids(hf, conversations(random.Random(1), 30), monkeypatch)
    assert memo.reused_tokens > 0
    # Engine.chat_tokens through the memo gives what the template's own tokenization gives, turn after turn
    fake = SimpleNamespace(loaded=SimpleNamespace(tokenizer=wrapper))
    messages = [{"role": "system", "content": "You are terse. " * 200}]
    for text in ["run ls", "it printed <|im_end|> and 🙂", "thanks"]:
        messages += [{"role": "user", "content": text}]
        want = list(wrapper.apply_chat_template(messages, add_generation_prompt=True))
        assert Engine.chat_tokens(fake, messages) == want
        messages += [{"role": "assistant", "content": "ok " + text}]
    assert token_memo.memo_for(wrapper).reused_tokens > 0


def test_principals_never_share_entries(monkeypatch):
    hf = TokenizersBackend(tokenizer_object=byte_level_tokenizer())
    memo = token_memo.TokenMemo(hf, token_memo.boundary_ids(hf))
    text = chatml([("system", "hello world " * 200), ("user", "ls -la")])
    memo.encode(text, principal="alice")
    memo.encode(text + "more", principal="bob")
    assert memo.reused_tokens == 0
    memo.encode(text + "more", principal="alice")
    assert memo.reused_tokens > 200


def test_one_principals_many_prompts_push_out_its_own_entries_first():
    hf = TokenizersBackend(tokenizer_object=byte_level_tokenizer())
    memo = token_memo.TokenMemo(hf, token_memo.boundary_ids(hf), max_entries=4)
    bobs = chatml([("system", "bob's agent " * 100), ("user", "go")])
    memo.encode(bobs, principal="bob")
    for i in range(10):  # alice's ten conversations, each newer than bob's one
        memo.encode(chatml([("user", f"alice {i} " * 50)]), principal="alice")
    assert ("bob", bobs) in memo.entries and len(memo.entries) == 4
    assert sorted(p for p, _ in memo.entries) == ["alice", "alice", "alice", "bob"]
    memo.encode(bobs + "more", principal="bob")
    assert memo.reused_tokens > 100  # bob's next turn still reuses his
    for i in range(3):  # more of alice's: hers go again, bob's one stays
        memo.encode(chatml([("user", f"carol {i} " * 50)]), principal="alice")
    assert [p for p, _ in memo.entries].count("bob") == 1


def test_entries_bounded_in_count_and_chars():
    hf = TokenizersBackend(tokenizer_object=byte_level_tokenizer())
    memo = token_memo.TokenMemo(hf, token_memo.boundary_ids(hf), max_entries=3, max_chars=5000)
    for i in range(6):
        memo.encode(chatml([("user", f"{i} " + "x" * 1500)]))
    assert len(memo.entries) <= 3 and memo.num_chars <= 5000
    assert memo.num_chars == sum(len(e.text) for e in memo.entries.values())


@pytest.mark.parametrize(
    "case",
    ["metaspace_first", "rstrip", "single_word", "nested", "split_special"],
)
def test_untrusted_splits_get_no_boundaries(case):
    """A piece's ids that depend on where it sits (Metaspace "first" prepends only at offset 0), on the
    next characters (rstrip, single_word) or a longer added token holding the mark: never a boundary."""
    if case == "metaspace_first":
        pre = pre_tokenizers.Metaspace(prepend_scheme="first")
        assert token_memo.boundary_ids(TokenizersBackend(tokenizer_object=byte_level_tokenizer(pre))) == frozenset()
        return
    if case == "split_special":
        hf = TokenizersBackend(tokenizer_object=byte_level_tokenizer())
        hf.split_special_tokens = True
        assert token_memo.boundary_ids(hf) == frozenset()
        return
    specials = {
        "rstrip": [AddedToken("<|im_end|>", rstrip=True, special=True, normalized=False)],
        "single_word": [AddedToken("<|im_end|>", single_word=True, special=True, normalized=False)],
        "nested": ["<|im_end|>", "<|im_end|>\n"],
    }[case]
    hf = TokenizersBackend(tokenizer_object=byte_level_tokenizer(specials=specials))
    ids = token_memo.boundary_ids(hf)
    assert hf.convert_tokens_to_ids("<|im_end|>") not in ids


def test_custom_tokenizer_gets_no_memo():
    class Preprocessing(TokenizersBackend):
        def encode(self, text, **kwargs):
            return super().encode(text.replace("\n", "<n>"), **kwargs)

    assert token_memo.memo_for(Preprocessing(tokenizer_object=byte_level_tokenizer())) is None
    assert token_memo.memo_for(SimpleNamespace()) is None


def test_requests_memoize_under_their_own_principal(tiny_model_dir, tmp_path, monkeypatch):
    """Through the app with per_key isolation: each key's prompts sit under its own principal (the
    gate's PRINCIPAL), and a follow-up of one key reuses only that key's entry."""
    from starlette.testclient import TestClient
    from test_api_tools import _loaded
    from test_cache_isolation import KEY_A, KEY_B, KEY_FILE

    from mlx_kvserve.api_keys import ApiKeys, parse_key_file
    from mlx_kvserve.config import load_config
    from mlx_kvserve.server.app import create_app

    monkeypatch.setenv("MLX_KVSERVE_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(token_memo, "MIN_REUSE_CHARS", 1)
    engine = Engine(_loaded(tiny_model_dir, "tiny"), load_config(overrides={"ssd": {"enabled": False}}))
    memo = token_memo.memo_for(engine.tokenizer)
    assert memo is not None  # the tiny model's byte-level BPE with ChatML marks
    principals = parse_key_file(KEY_FILE, "keys")
    turn = [{"role": "user", "content": "Hi there"}]
    with TestClient(create_app(engine, ApiKeys(KEY_A, "", principals))) as client:
        for key in (KEY_A, KEY_B):
            body = {"model": "tiny", "messages": turn, "max_tokens": 1, "temperature": 0}
            reply = client.post("/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"})
            assert reply.status_code == 200, reply.text
        owners = {p for p, _ in memo.entries}
        assert owners == {principals[0].identity, principals[1].identity}
        reused = memo.reused_tokens
        body = {"model": "tiny", "messages": [*turn, {"role": "assistant", "content": "Hello"}, *turn], "max_tokens": 1}
        reply = client.post("/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {KEY_A}"})
        assert reply.status_code == 200, reply.text
        assert memo.reused_tokens > reused
    engine.stop()


@pytest.mark.parametrize(("kind", "tail"), [("rstrip", "  \nhello"), ("single_word", "x")])
def test_the_excluded_marks_would_give_wrong_ids(kind, tail, monkeypatch):
    """Why boundary_ids leaves rstrip and single_word marks out: trusted anyway, the memo's ids differ."""
    monkeypatch.setattr(token_memo, "MIN_REUSE_CHARS", 1)
    mark = AddedToken("<|im_end|>", special=True, normalized=False, **{kind: True})
    hf = TokenizersBackend(tokenizer_object=byte_level_tokenizer(specials=[mark]))
    forced = token_memo.TokenMemo(hf, frozenset([hf.convert_tokens_to_ids("<|im_end|>")]))
    checked = token_memo.TokenMemo(hf, token_memo.boundary_ids(hf))
    first, second = "hello world <|im_end|>", "hello world <|im_end|>" + tail
    want = hf(second, add_special_tokens=False)["input_ids"]
    for memo in (forced, checked):
        memo.encode(first)
    assert forced.encode(second) != want
    assert checked.encode(second) == want and checked.reused_tokens == 0
