"""The support-code layout (issue 25): every script in scripts/ imports the shared harness
(scripts/harness/) and libraries, never another script and nothing under tests/; the product
(mlx_kvserve/) imports neither the harness nor the tests."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = ROOT / "scripts"
TEST_MODULES = {p.stem for p in (ROOT / "tests").rglob("*.py")}


def imported_modules(path: Path) -> set[str]:
    """The top-level names of every module `path` imports, at any depth of the file."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def test_no_script_imports_another_script_or_the_tests():
    scripts = {p.stem for p in SCRIPTS.glob("*.py")}
    for path in [*SCRIPTS.glob("*.py"), *(SCRIPTS / "harness").rglob("*.py")]:
        wrong = imported_modules(path) & (scripts | TEST_MODULES)
        assert not wrong, f"{path.relative_to(ROOT)} imports {sorted(wrong)}: share code through scripts/harness"


def test_the_product_imports_neither_the_harness_nor_the_tests():
    for path in (ROOT / "mlx_kvserve").rglob("*.py"):
        wrong = imported_modules(path) & ({"harness", "tests", "scripts"} | TEST_MODULES)
        assert not wrong, f"{path.relative_to(ROOT)} imports {sorted(wrong)}"


PACKAGE = ROOT / "mlx_kvserve"

# Imports a circle may close through, named with the reason (issue 48). None now: the Scheduler's solo path, which
# closed one, is a method of the Scheduler again.
NAMED_EXCEPTIONS: set[tuple[str, str]] = set()


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def local_imports(path: Path, modules: set[str], root: Path = ROOT) -> set[str]:
    """The `modules` that `path` imports by any import statement: at the top, inside functions (deferred),
    under TYPE_CHECKING or a try (relative imports resolved; `from pkg import mod` counts `pkg.mod`)."""
    tree = ast.parse(path.read_text(), str(path))
    here = module_name(path, root).split(".")
    if path.name != "__init__.py":
        here = here[:-1]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here[: len(here) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            found.add(mod)
            found |= {f"{mod}.{a.name}" for a in node.names}
    return found & modules


def package_imports(path: Path) -> set[str]:
    """The mlx_kvserve modules `path` imports, by any import statement."""
    return local_imports(path, {module_name(p) for p in PACKAGE.rglob("*.py")})


def test_kv_is_imported_only_by_the_engine_the_registry_and_the_offline_cache_commands():
    allowed = ("mlx_kvserve.kv", "mlx_kvserve.engine", "mlx_kvserve.registry", "mlx_kvserve.cache_cli")
    for path in PACKAGE.rglob("*.py"):
        name = module_name(path)
        if name.startswith(allowed):
            continue
        wrong = sorted(m for m in package_imports(path) if m.startswith("mlx_kvserve.kv"))
        assert not wrong, f"{name} imports {wrong}: go through the engine's front (engine/engine.py)"


def import_circle(graph: dict[str, set[str]]) -> list[str] | None:
    """The first import circle of `graph` (module -> modules it imports), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if nxt == node or nxt.startswith(node + ".") or (node, nxt) in NAMED_EXCEPTIONS:
                continue  # a package importing its own submodule
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := visit(nxt, [*path, nxt])):
                return cycle
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node, [node])):
            return cycle
    return None


def test_no_import_circles_in_the_package_counting_every_import():
    graph = {module_name(p): package_imports(p) for p in PACKAGE.rglob("*.py")}
    cycle = import_circle(graph)
    assert cycle is None, f"import circle: {' -> '.join(cycle)}"


def test_no_import_circles_in_the_scripts_counting_every_import():
    paths = [*SCRIPTS.glob("*.py"), *(SCRIPTS / "harness").rglob("*.py")]
    modules = {module_name(p, SCRIPTS) for p in paths}
    cycle = import_circle({module_name(p, SCRIPTS): local_imports(p, modules, SCRIPTS) for p in paths})
    assert cycle is None, f"import circle in scripts/: {' -> '.join(cycle)}"


def test_the_circle_check_sees_deferred_and_type_only_imports(tmp_path):
    """The check must be able to fail: a circle closed inside a function, or under TYPE_CHECKING, is found."""
    (tmp_path / "a.py").write_text("import b\n")
    (tmp_path / "b.py").write_text("def f():\n    from a import x\n")
    (tmp_path / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from d import D\n")
    (tmp_path / "d.py").write_text("from c import f\n")
    modules = {"a", "b", "c", "d"}
    graph = {p.stem: local_imports(p, modules, tmp_path) for p in tmp_path.glob("*.py")}
    assert import_circle({k: graph[k] for k in "ab"}) == ["a", "b", "a"]
    assert import_circle({k: graph[k] for k in "cd"}) == ["c", "d", "c"]


# Modules allowed past the size rule, each with its reason: a class lives in one file (STYLE.md), and a rule that
# pushed half of it into helpers reading its privates would be worse than one named long file.
LONG_MODULES = {
    # The Scheduler: each request's Run through its phases, mlx-lm's batch, and the paths outside it (a direct
    # join, a side prefill, the speculative path), which all read and change the same running requests.
    "mlx_kvserve/engine/batch/scheduler.py": 700,
}


def test_modules_stay_small():
    """~400 lines per module (STYLE.md); kv/blocks.py, the one door to mlx-lm's cache classes, a little more."""
    for path in PACKAGE.rglob("*.py"):
        lines = len(path.read_text().splitlines())
        limit = LONG_MODULES.get(path.relative_to(ROOT).as_posix(), 470)
        assert lines <= limit, f"{path.relative_to(ROOT)} has {lines} lines: split it by job"


def private_names(path: Path, cls: str) -> set[str]:
    """The private members of class `cls` in `path`: its `_name` methods and the `self._name` it assigns."""
    tree = ast.parse(path.read_text(), str(path))
    (node,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls]
    names = {f.name for f in node.body if isinstance(f, ast.FunctionDef) and f.name.startswith("_")}
    for sub in ast.walk(node):
        if isinstance(sub, ast.Attribute) and isinstance(sub.ctx, ast.Store) and isinstance(sub.value, ast.Name):
            if sub.value.id == "self" and sub.attr.startswith("_"):
                names.add(sub.attr)
    return {n for n in names if not n.startswith("__")}


def private_reads(path: Path, names: set[str]) -> list[str]:
    """`x._name` in `path` for any `_name` of `names` on a value other than `self`/`cls` (another object's
    privates), as "line: source"."""
    source = path.read_text()
    found = []
    for node in ast.walk(ast.parse(source, str(path))):
        if isinstance(node, ast.Attribute) and node.attr in names:
            if not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                found.append(f"{node.lineno}: {ast.get_source_segment(source, node)}")
    return found


def test_the_schedulers_privates_are_read_only_in_its_file():
    """The Scheduler is one class in one file (issue 48): no other module of the package reaches into it."""
    home = PACKAGE / "engine" / "batch" / "scheduler.py"
    names = private_names(home, "Scheduler")
    assert {"_running", "_pending", "_waiting", "_generator", "_end"} <= names  # the scan sees what it guards
    for path in PACKAGE.rglob("*.py"):
        if path != home:
            reads = private_reads(path, names)
            assert not reads, f"{path.relative_to(ROOT)} reads the Scheduler's privates: {reads}"


def test_the_private_read_check_can_fail(tmp_path):
    (tmp_path / "s.py").write_text(
        "class S:\n    def __init__(self):\n        self._running = {}\n    def _go(self): ...\n"
    )
    (tmp_path / "f.py").write_text("def f(sched):\n    self = sched\n    return sched._running, sched._go(), self._x\n")
    names = private_names(tmp_path / "s.py", "S")
    assert names == {"_running", "_go"}
    assert private_reads(tmp_path / "f.py", names) == ["3: sched._running", "3: sched._go"]


def test_the_batch_asks_the_prefix_cache_and_never_reaches_through_it():
    """engine/batch/ asks PrefixCache questions (uncached_tokens, lookup_hashes, cached_in_ram) and is told
    whether it runs distributed (Scheduler(distributed=...)); it never reads the KVManager behind the cache."""
    through = {"manager", "hasher", "in_ram", "next_tier", "block_size", "agree"}
    for path in (PACKAGE / "engine" / "batch").glob("*.py"):
        source = path.read_text()
        found = [
            f"{node.lineno}: {ast.get_source_segment(source, node)}"
            for node in ast.walk(ast.parse(source, str(path)))
            if isinstance(node, ast.Attribute) and node.attr in through
        ]
        assert not found, f"{path.relative_to(ROOT)} reaches through the prefix cache: {found}"


def test_the_scheduler_is_built_with_what_it_needs():
    """The Engine passes the Scheduler everything in its constructor (issue 48): nothing in the package sets
    an attribute on a scheduler from outside (as `engine.generator.scheduler.kv_room = ...` did)."""
    home = PACKAGE / "engine" / "batch" / "scheduler.py"
    for path in PACKAGE.rglob("*.py"):
        if path == home:
            continue
        source = path.read_text()
        found = []
        for node in ast.walk(ast.parse(source, str(path))):
            if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                owner = node.value
                name = owner.attr if isinstance(owner, ast.Attribute) else getattr(owner, "id", "")
                if name in ("scheduler", "sched"):
                    found.append(f"{node.lineno}: {ast.get_source_segment(source, node)}")
        assert not found, f"{path.relative_to(ROOT)} sets the scheduler's attributes: {found}"
