"""docs/architecture.md names every module of the package (issue 48), so "where do I change X" has an answer
there: a module counts as named by its path under mlx_kvserve/ (`server/slots.py`), or by its file name in a
list under its folder (`kv/` ... `ram.py`); a sub-package's list (`openai/` (`parse` · `tools`)) may give
stems; a package is named by its folder (`launch/`). And the other way: every `.py` file and `.md` page the doc
names exists, and every `Class.member` it names is defined, so it cannot send a newcomer to a module or a
method that moved or went away."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
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


# A file the doc names: `engine/batch/order.py`, `scripts/draw_architecture.py`, `tests/project/test_layout.py` or a bare
# `order.py` in a folder's list; a placeholder such as `server/<api>/parse.py` names no one file.
NAMED_FILE = re.compile(r"(?<![\w/.<>-])([A-Za-z_][\w/.-]*\.py)\b")


def missing_files(doc: str, root: Path = ROOT) -> list[str]:
    """The `.py` files `doc` names that exist nowhere: a path under the repository or the package, or a bare
    file name found in neither the package, scripts/ nor tests/."""
    package = root / "mlx_kvserve"
    names = {p.name for folder in ("mlx_kvserve", "scripts", "tests") for p in (root / folder).rglob("*.py")}
    missing = []
    for named in sorted(set(NAMED_FILE.findall(doc))):
        if "/" in named:
            found = (root / named).is_file() or (package / named).is_file()
        else:
            found = named in names
        if not found:
            missing.append(named)
    return missing


def test_every_file_the_doc_names_exists():
    missing = missing_files(DOC.read_text())
    assert not missing, f"docs/architecture.md names {missing}, which do not exist: a module moved or went away"


def test_the_file_check_finds_a_removed_module(tmp_path):
    (tmp_path / "mlx_kvserve" / "engine").mkdir(parents=True)
    (tmp_path / "mlx_kvserve" / "engine" / "order.py").write_text("")
    for folder in ("scripts", "tests"):
        (tmp_path / folder).mkdir()
    doc = "`engine/order.py` · `order.py` · `server/<api>/parse.py` · `engine/gone.py` · `solo.py` · `scripts/x.py`"
    assert missing_files(doc, tmp_path) == ["engine/gone.py", "scripts/x.py", "solo.py"]


def test_every_doc_the_doc_links_exists():
    links = re.findall(r"\]\(([\w.-]+\.md)(?:#[\w-]+)?\)", DOC.read_text())
    assert links and all((DOC.parent / link).is_file() for link in links), links


def draw_script():
    """scripts/draw_architecture.py as a module (its pure part: no matplotlib needed)."""
    path = ROOT / "scripts" / "draw_architecture.py"
    spec = importlib.util.spec_from_file_location("draw_architecture", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_packages_picture_can_be_drawn_from_the_imports():
    """Every package has a place in the picture and no import goes against its layers (`--check`)."""
    done = subprocess.run(
        [sys.executable, "scripts/draw_architecture.py", "--check"], cwd=ROOT, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert " 0 problems" in done.stdout


def test_the_picture_check_finds_a_new_package_and_an_import_upward():
    draw = draw_script()
    members = {"kv": ["manager"], "server": ["app"], "plugins": ["x"]}
    edges = Counter({("server", "kv"): 3, ("kv", "server"): 1})
    assert draw.problems(members, edges) == [
        "no place in BOXES for plugins",
        "against the layers: kv -> server (1 imports)",
    ]


DOTTED = re.compile(r"\b([A-Z]\w+)\.(\w+)\b")


def missing_members(doc: str, package: Path = PACKAGE) -> list[str]:
    """`Class.member` names in `doc` whose class the package defines but whose member none of its files defines."""
    sources = [p.read_text() for p in package.rglob("*.py")]
    missing = []
    for cls, member in sorted(set(DOTTED.findall(doc))):
        homes = [s for s in sources if re.search(rf"^class {cls}\b", s, re.M)]
        defined = re.compile(rf"^\s+(?:async )?def {member}\(|^\s+{member}\s*[:=]", re.M)
        if homes and not any(defined.search(s) for s in homes):
            missing.append(f"{cls}.{member}")
    return missing


def test_every_method_the_doc_names_exists():
    missing = missing_members(DOC.read_text())
    assert not missing, f"docs/architecture.md names {missing}, which their classes do not define"


def test_the_member_check_finds_a_renamed_method(tmp_path):
    (tmp_path / "a.py").write_text("class Engine:\n    limit = 1\n\n    def start(self):\n        pass\n")
    doc = "`Engine.start` · `Engine.limit` · `Engine.begin` · `BatchGenerator.insert`"
    assert missing_members(doc, tmp_path) == ["Engine.begin"]
