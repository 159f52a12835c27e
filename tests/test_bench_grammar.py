"""scripts/bench_grammar.py's comparison pieces (scripts/harness/grammar_compare.py): the byte-level
vocabulary, the walk through a document and the coverage verdicts, on llguidance (the one library the
project installs) and SmolLM2's tokenizer."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from harness import grammar_compare
from harness import grammar_libraries as gl


def test_byte_decoder_is_a_bijection_onto_bytes():
    decoder = gl.gpt2_byte_decoder()
    assert sorted(decoder.values()) == list(range(256))
    assert decoder["Ġ"] == ord(" ") and decoder["Ċ"] == ord("\n") and decoder["a"] == ord("a")


def test_chain_nests_and_ends_in_the_leaf():
    tree = grammar_compare.chain(3, {"name": "x"})
    assert tree["children"][0]["children"][0] == {"name": "x"}


def test_unpack_apply_keeps_exactly_the_allowed_tokens():
    mask = np.zeros((1, 2), dtype=np.int32)
    mask[0, 0], mask[0, 1] = 0b101, 1 << 3  # tokens 0, 2 and 35
    out = grammar_compare.unpack_apply(mx.arange(40, dtype=mx.float32)[None], mask)
    assert np.isfinite(np.array(out[0])).nonzero()[0].tolist() == [0, 2, 35]


def test_rotated_alternates_the_order():
    assert [grammar_compare.rotated([1, 2, 3], r) for r in range(3)] == [[1, 2, 3], [2, 3, 1], [3, 1, 2]]


@pytest.fixture(scope="module")
def hf_tokenizer(smollm_dir):
    from mlx_lm.tokenizer_utils import load

    return load(smollm_dir)


@pytest.mark.slow
def test_llguidance_walks_the_documents_and_enforces_every_feature(hf_tokenizer):
    llg = next(lib for lib in gl.installed() if lib.name == "llguidance")
    hf, eos, vocab = hf_tokenizer._tokenizer, hf_tokenizer.eos_token_id, 49152
    views = {"llguidance": llg.setup(hf, vocab, eos)}
    mask = np.full((1, vocab // 32), -1, dtype=np.int32)
    walks = grammar_compare.time_walks([llg], views, hf, eos, mask, rounds=1)
    for name, _, doc in grammar_compare.TIMED:
        walk = walks[("llguidance", name)]
        assert "error" not in walk, walk
        assert walk["tokens"] == len(hf.encode(grammar_compare.compact(doc), add_special_tokens=False))
        assert walk["mask_ms"] > 0 and walk["compile_ms"] > 0
    # A document the schema refuses stops the walk at the offending token.
    tokens = hf.encode('{"v":"blue"}', add_special_tokens=False)
    schema = {"type": "object", "properties": {"v": {"enum": ["red"]}}, "required": ["v"]}
    assert gl.drive(llg, views["llguidance"], schema, tokens, eos, mask).refused_at is not None
    table = grammar_compare.coverage([llg], views, hf, eos, mask)
    assert {feature: v["llguidance"] for feature, v in table.items()} == {
        feature: "enforced" for feature, *_ in grammar_compare.FEATURES
    }
