"""Rebuild a Hugging Face `tokenizer.json` + `tokenizer_config.json` from GGUF metadata.

GGUF files carry the vocabulary, merges, token types, special-token ids and the chat template
as metadata; llama.cpp names the pre-tokenizer regex by a short key (`tokenizer.ggml.pre`).
This module turns that metadata into files `transformers.AutoTokenizer` loads, using the
`tokenizers` library for the actual model. Supported: `gpt2` (byte-level BPE) with the common
pre-tokenizer variants, and `llama` (SentencePiece BPE with byte fallback).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

from ..errors import ModelLoadError

# llama.cpp token types (gguf TokenType): 1 normal, 2 unknown, 3 control, 4 user defined, 6 byte.
_CONTROL, _USER_DEFINED = 3, 4

_LLAMA3_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Pre-tokenizers that split every digit apart before the GPT-2 regex (llama.cpp's STARCODER group).
_DIGIT_SPLIT_PRE = {"smollm", "starcoder", "refact", "codeshell", "exaone", "minerva", "command-r"}


def _byte_level_pre_tokenizer(pre: str):
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _DIGIT_SPLIT_PRE:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if pre in ("llama-bpe", "llama3", "qwen2", "deepseek-r1-qwen"):
        regex = _QWEN2_REGEX if pre.startswith(("qwen", "deepseek")) else _LLAMA3_REGEX
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(regex), behavior="isolated", invert=False),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    return byte_level  # "default", "gpt2" and unknown keys: the plain GPT-2 regex


def _gpt2_tokenizer(meta: dict[str, Any], tokens: list[str]) -> Tokenizer:
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
    vocab = {tok: i for i, tok in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = _byte_level_pre_tokenizer(str(meta.get("tokenizer.ggml.pre", "default")))
    tok.decoder = decoders.ByteLevel()
    return tok


def _spm_merges(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """Derive BPE merges from a SentencePiece vocabulary: every split of a piece into two
    known pieces is a merge, ranked by the merged piece's score (higher merges first)."""
    vocab = {tok: i for i, tok in enumerate(tokens)}
    ranked = []
    for piece, piece_id in vocab.items():
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in vocab and right in vocab:
                ranked.append((-scores[piece_id], piece_id, vocab[left], vocab[right], left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


def _llama_spm_tokenizer(meta: dict[str, Any], tokens: list[str]) -> Tokenizer:
    scores = [float(s) for s in _as_list(meta.get("tokenizer.ggml.scores", [0.0] * len(tokens)))]
    unk_id = int(_scalar(meta.get("tokenizer.ggml.unknown_token_id", 0)))
    vocab = {tok: i for i, tok in enumerate(tokens)}
    bpe = models.BPE(
        vocab=vocab,
        merges=_spm_merges(tokens, scores),
        unk_token=tokens[unk_id],
        fuse_unk=True,
        byte_fallback=True,
    )
    tok = Tokenizer(bpe)
    add_prefix = bool(_scalar(meta.get("tokenizer.ggml.add_space_prefix", True)))
    steps = [normalizers.Prepend("▁")] if add_prefix else []
    tok.normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", "▁")])
    strip = [decoders.Strip(content=" ", left=1, right=0)] if add_prefix else []
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), *strip])
    return tok


def _scalar(value: Any) -> Any:
    return value.item() if hasattr(value, "item") else value


def _as_list(value: Any) -> list:
    return value.tolist() if hasattr(value, "tolist") else list(value)


def _special_id(meta: dict[str, Any], key: str) -> int | None:
    value = meta.get(f"tokenizer.ggml.{key}_token_id")
    return None if value is None else int(_scalar(value))


def build_tokenizer(meta: dict[str, Any]) -> tuple[Tokenizer, dict[str, Any]]:
    """Return (tokenizer, tokenizer_config) rebuilt from GGUF metadata.

    Raises ModelLoadError when the GGUF has no vocabulary or uses a tokenizer model this
    converter does not know (e.g. `bert`, `rwkv`).
    """
    tokens = list(meta.get("tokenizer.ggml.tokens", []))
    if not tokens:
        raise ModelLoadError("GGUF has no tokenizer.ggml.tokens: cannot rebuild a tokenizer")
    kind = str(meta.get("tokenizer.ggml.model", "gpt2"))
    if kind == "gpt2":
        tok = _gpt2_tokenizer(meta, tokens)
    elif kind == "llama":
        tok = _llama_spm_tokenizer(meta, tokens)
    else:
        raise ModelLoadError(f"GGUF tokenizer model {kind!r} is not supported (gpt2 or llama)")

    types = _as_list(meta.get("tokenizer.ggml.token_type", [1] * len(tokens)))
    ids = {name: _special_id(meta, name) for name in ("bos", "eos", "unknown", "padding", "eot")}
    special_ids = {i for i in ids.values() if i is not None}
    tok.add_special_tokens(
        [
            AddedToken(t, special=True, normalized=False)
            for i, t in enumerate(tokens)
            if types[i] == _CONTROL or i in special_ids
        ]
    )
    tok.add_tokens([AddedToken(t, normalized=False) for i, t in enumerate(tokens) if types[i] == _USER_DEFINED])

    add_bos = bool(_scalar(meta.get("tokenizer.ggml.add_bos_token", kind == "llama")))
    if add_bos and ids["bos"] is not None:
        bos = tokens[ids["bos"]]
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, ids["bos"])]
        )
    elif kind == "gpt2":
        tok.post_processor = processors.ByteLevel(trim_offsets=False)

    def name(key: str) -> str | None:
        return None if ids[key] is None else tokens[ids[key]]

    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": name("bos"),
        "eos_token": name("eos"),
        "unk_token": name("unknown"),
        "pad_token": name("padding"),
        "add_bos_token": add_bos,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
    }
    template = meta.get("tokenizer.chat_template")
    if template:
        config["chat_template"] = str(template)
    return tok, {k: v for k, v in config.items() if v is not None}


def eos_token_ids(meta: dict[str, Any]) -> list[int]:
    """The ids that end generation: eos plus end-of-turn where the GGUF names one."""
    found = [_special_id(meta, key) for key in ("eos", "eot")]
    return sorted({i for i in found if i is not None})


def write_tokenizer_files(meta: dict[str, Any], folder: Path) -> None:
    tok, config = build_tokenizer(meta)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
