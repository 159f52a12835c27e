"""config.example.toml documents every config key with its default, and loads to exactly the defaults.

A new field in a section dataclass fails these tests until it is added to config.example.toml (as a key,
or as a commented `# key = value` where the default depends on the platform) and to docs/configuration.md.
"""

import dataclasses
import re
from pathlib import Path
from typing import get_type_hints

import pytest

from mlx_kvserve.config import Config, load_config

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "config.example.toml"
CONFIG_DOC = ROOT / "docs" / "configuration.md"

_SECTION_RE = re.compile(r"^\[([a-z_]+)\]\s*(#.*)?$")
_KEY_RE = re.compile(r"^(#\s*)?([a-z_][a-z0-9_]*)\s*=")


def config_fields() -> dict[str, set[str]]:
    """{section: {key}} for every field of every section dataclass of Config."""
    # get_type_hints, not Field.type: config.py uses `from __future__ import annotations` (types are strings).
    return {name: {f.name for f in dataclasses.fields(cls)} for name, cls in get_type_hints(Config).items()}


def documented_keys(text: str) -> dict[str, dict[str, bool]]:
    """{section: {key: is_commented}} for each `key =` or `# key =` line under a `[section]` header."""
    keys: dict[str, dict[str, bool]] = {}
    section = None
    for line in text.splitlines():
        line = line.strip()
        if m := _SECTION_RE.match(line):
            section = m.group(1)
            keys.setdefault(section, {})
        elif section is not None and (m := _KEY_RE.match(line)):
            keys[section][m.group(2)] = m.group(1) is not None
    return keys


def missing_keys(text: str) -> list[str]:
    documented = documented_keys(text)
    return sorted(
        f"{section}.{key}"
        for section, names in config_fields().items()
        for key in names
        if key not in documented.get(section, {})
    )


def non_default_keys(path: Path) -> list[str]:
    """`section.key` of each key set in the file whose loaded value differs from the default."""
    loaded, defaults = load_config(path), Config()
    data = tomllib.loads(path.read_text())
    return sorted(
        f"{section}.{key}"
        for section, values in data.items()
        for key in values
        if getattr(getattr(loaded, section), key) != getattr(getattr(defaults, section), key)
    )


def test_example_loads_to_the_defaults():
    assert load_config(EXAMPLE) == Config()
    assert non_default_keys(EXAMPLE) == []


def test_every_key_set_in_the_example_is_a_default():
    data = tomllib.loads(EXAMPLE.read_text())
    defaults = Config()
    for section, values in data.items():
        loaded = getattr(load_config(EXAMPLE), section)
        for key in values:
            assert getattr(loaded, key) == getattr(getattr(defaults, section), key), f"{section}.{key}"


def test_every_config_field_is_in_the_example():
    assert missing_keys(EXAMPLE.read_text()) == []


def test_example_names_no_key_that_does_not_exist():
    fields = config_fields()
    documented = documented_keys(EXAMPLE.read_text())
    assert set(documented) == set(fields)
    for section, names in documented.items():
        assert set(names) <= fields[section], f"[{section}] documents unknown keys {set(names) - fields[section]}"


def test_commented_keys_are_valid_when_uncommented(tmp_path):
    text = EXAMPLE.read_text()
    commented = [k for names in documented_keys(text).values() for k, is_commented in names.items() if is_commented]
    assert commented, "expected at least the platform-dependent model.dtype to be commented"
    uncommented = re.sub(r"(?m)^#\s*([a-z_][a-z0-9_]*\s*=)", r"\1", text)
    path = tmp_path / "uncommented.toml"
    path.write_text(uncommented)
    load_config(path)  # raises ConfigError for an invalid value


def test_every_key_has_a_comment_above_it():
    lines = [line.strip() for line in EXAMPLE.read_text().splitlines()]
    for i, line in enumerate(lines):
        m = _KEY_RE.match(line)
        if m and not m.group(1):
            assert i > 0 and lines[i - 1].startswith("#"), f"line {i + 1} ({line}) has no comment above it"


def test_every_key_is_in_the_configuration_doc():
    doc = CONFIG_DOC.read_text()
    missing = [
        f"{section}.{key}"
        for section, names in config_fields().items()
        for key in names
        if f"`{section}.{key}`" not in doc
    ]
    assert missing == []


# The checks above must be able to fail: a copy of the example with one key removed or one value changed.


def test_a_removed_key_is_reported():
    text = EXAMPLE.read_text()
    without = re.sub(r"(?m)^prefill_step_size\s*=.*$", "", text)
    assert missing_keys(without) == ["generation.prefill_step_size"]
    without_commented = re.sub(r"(?m)^#\s*dtype\s*=.*$", "", text)
    assert missing_keys(without_commented) == ["model.dtype"]


def test_a_changed_default_is_reported(tmp_path):
    path = tmp_path / "changed.toml"
    path.write_text(re.sub(r"(?m)^port\s*=.*$", "port = 8001", EXAMPLE.read_text()))
    assert non_default_keys(path) == ["server.port"]


@pytest.mark.parametrize("section", [s.name for s in dataclasses.fields(Config)])
def test_each_section_has_a_header(section):
    assert re.search(rf"(?m)^\[{section}\]", EXAMPLE.read_text())
