"""llguidance, outlines-core and xgrammar behind one small interface, for `bench_grammar.py --compare`.

Each is imported only when used: outlines-core and xgrammar are not project dependencies. All three fill
the same bitmask layout, int32 words of shape (1, ceil(vocab / 32)) where bit i of word w allows token
32 w + i, so the caller checks and applies masks the same way whichever library wrote them.
"""

from __future__ import annotations

import importlib.util
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import mlx.core as mx
import numpy as np


def gpt2_byte_decoder() -> dict[str, int]:
    """The inverse of GPT-2's bytes_to_unicode: a byte-level BPE token's characters back to its bytes."""
    byte_values = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    codes = list(byte_values)
    for b in range(256):
        if b not in byte_values:  # bytes without a printable character get 256, 257, ... in order
            codes.append(256 + len(byte_values) - 188)
            byte_values.append(b)
    return {chr(c): b for b, c in zip(byte_values, codes, strict=True)}


@dataclass(frozen=True)
class Library:
    """One grammar library behind the few calls the comparison makes (the bitmask: see the module's doc)."""

    name: str
    dist: str  # the PyPI distribution
    module: str  # imported lazily; the library is "not installed" when it cannot be found
    setup: Callable[[Any, int, int], Any]  # (HF tokenizer, vocab size, eos id) -> its tokenizer view
    compile: Callable[[Any, dict], Any]  # (tokenizer view, JSON schema) -> a matcher at the start
    fill: Callable[[Any, np.ndarray], Any]  # the mask of the current state into the bitmask
    advance: Callable[[Any, int], Any]  # consume one token
    apply: Callable[[], Callable[[mx.array, np.ndarray], mx.array]]  # its own MLX mask application


def _llg_setup(hf: Any, vocab: int, eos: int) -> Any:
    import llguidance.hf

    return llguidance.hf.from_tokenizer(hf, n_vocab=vocab, eos_token=eos)


def _llg_compile(tokenizer: Any, schema: dict) -> Any:
    import llguidance

    # The options engine/sampling/constrain.py uses: compact JSON.
    grammar = llguidance.grammar_from(
        "json_schema", json.dumps({**schema, "x-guidance": {"whitespace_flexible": False}})
    )
    matcher = llguidance.LLMatcher(tokenizer, grammar)
    if matcher.is_error():
        raise ValueError(matcher.get_error())
    return matcher


def _llg_fill(matcher: Any, mask: np.ndarray) -> None:
    import llguidance.numpy

    llguidance.numpy.fill_next_token_bitmask(matcher, mask, 0)


def _llg_apply() -> Callable:
    import llguidance.mlx

    return llguidance.mlx.apply_token_bitmask


def _xgr_setup(hf: Any, vocab: int, eos: int) -> Any:
    import xgrammar

    info = xgrammar.TokenizerInfo.from_huggingface(hf, vocab_size=vocab, stop_token_ids=[eos])
    return xgrammar.GrammarCompiler(info, cache_enabled=False)  # no cache: every round compiles


def _xgr_compile(compiler: Any, schema: dict) -> Any:
    import xgrammar

    compiled = compiler.compile_json_schema(json.dumps(schema), any_whitespace=False, separators=(",", ":"))
    return xgrammar.GrammarMatcher(compiled)


def _xgr_apply() -> Callable:
    from xgrammar.kernels.apply_token_bitmask_mlx import apply_token_bitmask_mlx

    return lambda logits, mask: apply_token_bitmask_mlx(mx.array(mask), logits, logits.shape[-1])


def _oc_setup(hf: Any, vocab: int, eos: int) -> Any:
    import outlines_core

    # outlines-core takes the vocabulary as bytes -> ids (its from_pretrained needs the Hub); special
    # tokens stay out, as they do in the other two.
    decoder, special = gpt2_byte_decoder(), set(hf.added_tokens_decoder)
    by_bytes: dict[bytes, list[int]] = {}
    for token_id in range(len(hf)):
        if token_id not in special:
            by_bytes.setdefault(bytes(decoder[c] for c in hf.convert_ids_to_tokens(token_id)), []).append(token_id)
    return outlines_core.Vocabulary(eos, by_bytes)


def _oc_compile(vocabulary: Any, schema: dict) -> Any:
    import outlines_core
    from outlines_core.json_schema import build_regex_from_schema

    regex = build_regex_from_schema(json.dumps(schema), "")  # "": no whitespace between tokens
    return outlines_core.Guide(outlines_core.Index(regex, vocabulary))


def _oc_apply() -> Callable:
    import outlines_core.kernels.mlx

    return outlines_core.kernels.mlx.apply_token_bitmask


LIBRARIES = [
    Library(
        "llguidance",
        "llguidance",
        "llguidance",
        _llg_setup,
        _llg_compile,
        _llg_fill,
        lambda m, t: m.consume_token(t),
        _llg_apply,
    ),
    Library(
        "outlines-core",
        "outlines-core",
        "outlines_core",
        _oc_setup,
        _oc_compile,
        lambda g, mask: g.write_mask_into(mask.ctypes.data, mask.size, mask.itemsize),
        lambda g, t: g.advance(t),
        _oc_apply,
    ),
    Library(
        "xgrammar",
        "xgrammar",
        "xgrammar",
        _xgr_setup,
        _xgr_compile,
        lambda m, mask: m.fill_next_token_bitmask(mask, 0),
        lambda m, t: m.accept_token(t),
        _xgr_apply,
    ),
]


class Walk(NamedTuple):
    compile_s: float
    mask_s: list[float]
    advance_s: list[float]
    refused_at: int | None  # index of the first token refused (len(tokens): end-of-sequence refused)


def is_allowed(mask: np.ndarray, token: int) -> bool:
    return bool((int(mask[0, token // 32]) >> (token % 32)) & 1)


def drive(lib: Library, view: Any, schema: dict, tokens: list[int], eos: int, mask: np.ndarray) -> Walk:
    """Compile `schema`, then for each token: fill the mask, check the token is allowed, advance by it;
    at the end the mask must allow end-of-sequence."""
    t0 = time.perf_counter()
    state = lib.compile(view, schema)
    compile_s = time.perf_counter() - t0
    mask_s, advance_s = [], []
    for i, token in enumerate(tokens):
        t0 = time.perf_counter()
        lib.fill(state, mask)
        mask_s.append(time.perf_counter() - t0)
        if not is_allowed(mask, token):
            return Walk(compile_s, mask_s, advance_s, i)
        t0 = time.perf_counter()
        lib.advance(state, token)
        advance_s.append(time.perf_counter() - t0)
    lib.fill(state, mask)
    return Walk(compile_s, mask_s, advance_s, None if is_allowed(mask, eos) else len(tokens))


def installed() -> list[Library]:
    return [lib for lib in LIBRARIES if importlib.util.find_spec(lib.module) is not None]
