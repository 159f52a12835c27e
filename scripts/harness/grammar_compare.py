"""bench_grammar.py's schemas and documents, and its `--compare` of llguidance, outlines-core and xgrammar on
one tokenizer: compile and per-token mask times over a walk through a valid document, applying a bitmask to
MLX logits, import costs, and which schema features each enforces (checked by the tests on llguidance)."""

from __future__ import annotations

import importlib.metadata
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import mlx.core as mx
import numpy as np

from harness import grammar_libraries as gl

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string"}}},
    },
    "required": ["name", "age", "tags", "address"],
}


DOCUMENT = {
    "name": "Ada Lovelace",
    "age": 36,
    "tags": ["math", "engines", "notes"],
    "address": {"city": "London", "zip": "W1"},
}


ORDER = {
    "type": "object",
    "properties": {
        "id": {"type": "integer"},
        "status": {"enum": ["open", "paid", "shipped"]},
        "total": {"type": "number"},
        "gift": {"type": "boolean"},
        "note": {"type": ["string", "null"]},
    },
    "required": ["id", "status", "total", "gift", "note"],
}


NODE = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "children": {"type": "array", "items": {"$ref": "#/$defs/node"}}},
    "required": ["name", "children"],
}


def chain(depth: int, leaf: dict | None = None) -> dict:
    """A tree of `depth` nested nodes; the innermost is `leaf` (a valid node by default)."""
    node = leaf or {"name": "leaf", "children": []}
    for level in range(depth - 1):
        node = {"name": f"n{level}", "children": [node]}
    return node


# (name, schema, valid document): the documents every library is driven through, token by token.
TIMED = [
    ("person", SCHEMA, DOCUMENT),
    (
        "orders",
        {"type": "object", "properties": {"orders": {"type": "array", "items": ORDER}}, "required": ["orders"]},
        {
            "orders": [
                {"id": 1, "status": "paid", "total": 12.5, "gift": False, "note": None},
                {"id": 2, "status": "open", "total": 3, "gift": True, "note": "leave at the door"},
                {"id": 3, "status": "shipped", "total": 99.99, "gift": False, "note": "fragile"},
            ]
        },
    ),
    (
        "tree ($ref)",
        {"$defs": {"node": NODE}, "$ref": "#/$defs/node"},
        {"name": "a", "children": [{"name": "b", "children": [{"name": "c", "children": []}]}]},
    ),
]


# (feature, property schema, valid value, invalid value): each wrapped as {"v": ...} for the coverage table.
FEATURES = [
    ("enum", {"enum": ["red", "green"]}, "red", "blue"),
    ("anyOf", {"anyOf": [{"type": "integer"}, {"type": "string"}]}, "x", True),
    ("integer minimum/maximum", {"type": "integer", "minimum": 1, "maximum": 10}, 7, 11),
    ("number exclusiveMinimum", {"type": "number", "exclusiveMinimum": 0}, 0.5, -1.5),
    ("string min/maxLength", {"type": "string", "minLength": 2, "maxLength": 4}, "abc", "abcdef"),
    ("pattern", {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"}, "AB-123", "ab-123"),
    ("format date-time", {"type": "string", "format": "date-time"}, "2024-01-02T03:04:05Z", "yesterday"),
    (
        "array min/maxItems",
        {"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 2},
        [1, 2],
        [1, 2, 3],
    ),
    (
        "additionalProperties (map)",
        {"type": "object", "additionalProperties": {"type": "integer"}},
        {"a": 1},
        {"a": "x"},
    ),
    (
        "recursive $ref",
        {"$ref": "#/$defs/node"},
        {"name": "a", "children": [{"name": "b", "children": []}]},
        {"name": "a"},
    ),
    ("recursive $ref, 8 levels deep", {"$ref": "#/$defs/node"}, chain(8), chain(8, {"name": "x"})),
]


def compact(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"))


def import_cost(module: str) -> tuple[float, bool]:
    """Seconds to import `module` in a fresh interpreter, and whether torch came with it."""
    code = f"import sys, time; t = time.perf_counter(); import {module}; print(time.perf_counter() - t, 'torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    return float(out[0]), out[1] == "True"


def p90(values: list[float]) -> float:
    return statistics.quantiles(values, n=10)[-1] if len(values) > 1 else values[0]


def unpack_apply(logits: mx.array, mask: np.ndarray) -> mx.array:
    """engine/sampling/constrain.py's way: unpack the bits in numpy, then one mx.where."""
    allowed = np.unpackbits(mask[0].view(np.uint8), bitorder="little")[: logits.shape[-1]].astype(bool)
    return mx.where(mx.array(allowed), logits, -mx.inf)


def rotated(items: list, r: int) -> list:
    return items[r % len(items) :] + items[: r % len(items)] if items else []


def time_walks(libs: list[gl.Library], views: dict, hf: Any, eos: int, mask: np.ndarray, rounds: int) -> dict:
    """(library, schema) -> the per-round medians of a walk through TIMED's document, or the error."""
    docs = [(name, schema, hf.encode(compact(doc), add_special_tokens=False)) for name, schema, doc in TIMED]
    walks: dict[tuple[str, str], list[gl.Walk] | str] = {}
    for r in range(rounds):
        for lib in rotated(libs, r):
            for name, schema, tokens in docs:
                if isinstance(walks.get((lib.name, name)), str):
                    continue
                try:
                    walk = gl.drive(lib, views[lib.name], schema, tokens, eos, mask)
                    assert walk.refused_at is None, f"refused token {walk.refused_at} of the valid document"
                    walks.setdefault((lib.name, name), []).append(walk)
                except Exception as exc:  # a schema the library cannot compile: reported, not fatal
                    walks[(lib.name, name)] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:80]}"
    out = {}
    for key, found in walks.items():
        if isinstance(found, str):
            out[key] = {"error": found}
            continue
        med = lambda values: statistics.median(values) * 1e3  # noqa: E731
        out[key] = {
            "tokens": len(found[0].mask_s),
            "compile_ms": med([w.compile_s for w in found]),
            "first_mask_ms": med([w.mask_s[0] for w in found]),
            "mask_ms": med([statistics.median(w.mask_s) for w in found]),
            "mask_p90_ms": med([p90(w.mask_s) for w in found]),
            "advance_ms": med([statistics.median(w.advance_s) for w in found]),
        }
    return out


def time_apply(libs: list[gl.Library], vocab: int, rounds: int, reps: int = 50) -> dict[str, float | str]:
    """Applying one bitmask to a (1, vocab) float32 mx.array: constrain.py's numpy path, and each library's
    own MLX function where it runs here (the result is checked against the numpy path)."""
    rng = np.random.default_rng(0)
    mask = rng.integers(-(2**31), 2**31 - 1, size=(1, (vocab + 31) // 32), dtype=np.int32)
    logits = mx.random.normal((1, vocab))
    expected = unpack_apply(logits, mask)
    methods: dict[str, Callable] = {"numpy unpack + mx.where (engine/sampling/constrain.py)": unpack_apply}
    out: dict[str, float | str] = {}
    for lib in libs:
        label = f"{lib.name}'s own MLX function"
        try:
            fn = lib.apply()
            assert mx.array_equal(fn(logits, mask), expected).item(), "differs from the numpy path"
            methods[label] = fn
        except Exception as exc:  # Metal-only kernels on a CPU machine
            out[label] = f"not usable here ({type(exc).__name__}: {str(exc).splitlines()[0][:60]})"
    times: dict[str, list[float]] = {label: [] for label in methods}
    for r in range(rounds):
        for label in rotated(list(methods), r):
            for _ in range(reps):
                t0 = time.perf_counter()
                mx.eval(methods[label](logits, mask))
                times[label].append(time.perf_counter() - t0)
    return {label: statistics.median(values) * 1e3 for label, values in times.items()} | out


def coverage(libs: list[gl.Library], views: dict, hf: Any, eos: int, mask: np.ndarray) -> dict[str, dict[str, str]]:
    """feature -> library -> "enforced" (valid value accepted, invalid refused), "not enforced" (both
    accepted), "refuses valid" or the compile error."""
    table: dict[str, dict[str, str]] = {}
    for feature, prop, valid, invalid in FEATURES:
        schema: dict[str, Any] = {"type": "object", "properties": {"v": prop}, "required": ["v"]}
        if "$ref" in json.dumps(prop):
            schema["$defs"] = {"node": NODE}
        good, bad = (hf.encode(compact({"v": value}), add_special_tokens=False) for value in (valid, invalid))
        for lib in libs:
            try:
                accepts_good = gl.drive(lib, views[lib.name], schema, good, eos, mask).refused_at is None
                accepts_bad = gl.drive(lib, views[lib.name], schema, bad, eos, mask).refused_at is None
                verdict = "refuses valid" if not accepts_good else "not enforced" if accepts_bad else "enforced"
            except Exception as exc:
                verdict = f"error ({str(exc).splitlines()[0][:50]})"
            table.setdefault(feature, {})[lib.name] = verdict
    return table


def import_costs(libs: list[gl.Library]) -> dict[str, dict]:
    """Per library, and for mlx-lm's tokenizer module (which a server start imports: with torch merely
    installed, transformers loads it there too)."""
    seconds, brings_torch = import_cost("mlx_lm.tokenizer_utils")
    out = {"mlx-lm": {"version": importlib.metadata.version("mlx-lm"), "import_s": seconds, "torch": brings_torch}}
    for lib in libs:
        seconds, brings_torch = import_cost(lib.module)
        out[lib.name] = {"version": importlib.metadata.version(lib.dist), "import_s": seconds, "torch": brings_torch}
    return out


def compare(hf: Any, vocab: int, eos: int, rounds: int) -> tuple[dict, list[str]]:
    libs = gl.installed()
    missing = [lib.name for lib in gl.LIBRARIES if lib not in libs]
    info = import_costs(libs)
    views = {}
    for lib in libs:
        t0 = time.perf_counter()
        views[lib.name] = lib.setup(hf, vocab, eos)
        info[lib.name]["setup_s"] = time.perf_counter() - t0
    mask = np.full((1, (vocab + 31) // 32), -1, dtype=np.int32)
    walks = time_walks(libs, views, hf, eos, mask, rounds)
    applies = time_apply(libs, vocab, rounds)
    features = coverage(libs, views, hf, eos, mask)
    results = {
        "libraries": info,
        "walks": {f"{lib} / {schema}": v for (lib, schema), v in walks.items()},
        "apply_ms": applies,
        "coverage": features,
        "not_installed": missing,
    }
    return results, compare_lines(libs, info, walks, applies, features, missing, rounds)


def compare_lines(libs, info, walks, applies, features, missing, rounds) -> list[str]:
    lines = [
        "",
        f"Side by side ({rounds} rounds in alternating order, medians over rounds):",
        "",
        "| library | version | import, fresh interpreter (s) | loads torch | tokenizer setup (s) |",
        "|---|---|---|---|---|",
    ]
    for name, i in info.items():
        torch, setup = "yes" if i["torch"] else "no", f"{i['setup_s']:.2f}" if "setup_s" in i else "-"
        lines.append(f"| {name} | {i['version']} | {i['import_s']:.2f} | {torch} | {setup} |")
    lines += [
        "",
        "| library | schema | tokens | compile (ms) | first mask (ms) | mask median (ms) | mask p90 (ms) | "
        "advance median (ms) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for lib in libs:
        for schema, _, _ in TIMED:
            w = walks.get((lib.name, schema), {"error": "not run"})
            if "error" in w:
                lines.append(f"| {lib.name} | {schema} | {w['error']} | | | | | |")
                continue
            lines.append(
                f"| {lib.name} | {schema} | {w['tokens']} | {w['compile_ms']:.1f} | {w['first_mask_ms']:.3f} | "
                f"{w['mask_ms']:.3f} | {w['mask_p90_ms']:.3f} | {w['advance_ms']:.3f} |"
            )
    lines += ["", "| applying a bitmask to (1, vocabulary) float32 logits | median (ms) |", "|---|---|"]
    for label, value in applies.items():
        lines.append(f"| {label} | {value:.3f} |" if isinstance(value, float) else f"| {label} | {value} |")
    lines += ["", "| schema feature | " + " | ".join(lib.name for lib in libs) + " |", "|---" * (len(libs) + 1) + "|"]
    for feature, by_lib in features.items():
        lines.append(f"| {feature} | " + " | ".join(by_lib[lib.name] for lib in libs) + " |")
    if missing:
        lines += ["", "not installed: " + ", ".join(missing) + " (pip install them next to the project to compare)"]
    return lines
