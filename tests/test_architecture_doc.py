"""docs/architecture.md names every module of the package (issue 48), so "where do I change X" has an answer
there: a module counts as named by its path under mlx_kvserve/ (`server/slots.py`), or by its file name in a
list under its folder (`kv/` ... `ram.py`); a sub-package's list (`openai/` (`parse` · `tools`)) may give
stems; a package is named by its folder (`launch/`)."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "mlx_kvserve"
DOC = ROOT / "docs" / "architecture.md"


def is_named(rel: Path, doc: str) -> bool:
    folder = f"{rel.parent.name}/"
    if rel.name == "__init__.py":
        return folder in doc
    if rel.as_posix() in doc or (rel.parent == Path(".") and f"`{rel.name}`" in doc):
        return True
    if rel.parent != Path(".") and folder in doc:
        return rel.name in doc or (len(rel.parts) > 2 and f"`{rel.stem}`" in doc)
    return False


def unnamed_modules(doc: str) -> list[str]:
    paths = (p.relative_to(PACKAGE) for p in sorted(PACKAGE.rglob("*.py")))
    return [p.as_posix() for p in paths if p != Path("__init__.py") and not is_named(p, doc)]


def test_the_architecture_doc_names_every_module():
    missing = unnamed_modules(DOC.read_text())
    assert not missing, f"docs/architecture.md does not name {missing}: add a one-line entry for each"


def test_the_check_finds_a_module_left_out():
    doc = "`kv/` ... `ram.py` · `engine/build.py` · `openai/` (`parse`) · `launch/` · `cli.py`"
    assert is_named(Path("kv/ram.py"), doc) and is_named(Path("engine/build.py"), doc)
    assert is_named(Path("server/openai/parse.py"), doc) and is_named(Path("launch/__init__.py"), doc)
    assert is_named(Path("cli.py"), doc)
    assert not is_named(Path("engine/slots.py"), doc) and not is_named(Path("server/openai/tools.py"), doc)
    assert not is_named(Path("service/__init__.py"), doc) and not is_named(Path("cpu/blas.py"), doc)
