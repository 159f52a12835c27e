"""The support-code layout (issue 25): every script in scripts/ imports the shared harness
(scripts/harness/) and libraries, never another script and nothing under tests/; the product
(mlx_kvserve/) imports neither the harness nor the tests."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "scripts"
TEST_MODULES = {p.stem for p in (ROOT / "tests").glob("*.py")}


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


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def package_imports(path: Path, top_level_only: bool) -> set[str]:
    """The mlx_kvserve modules `path` imports (relative imports resolved); with `top_level_only`,
    only the imports run when the module loads (not those inside functions or TYPE_CHECKING)."""
    tree = ast.parse(path.read_text(), str(path))
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    here = module_name(path).split(".")
    if path.name != "__init__.py":
        here = here[:-1]
    found = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("mlx_kvserve")}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here[: len(here) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            if mod.startswith("mlx_kvserve"):
                found.add(mod)
                found |= {f"{mod}.{a.name}" for a in node.names}
    modules = {module_name(p) for p in PACKAGE.rglob("*.py")}
    return {m for m in found if m in modules}


def test_kv_is_imported_only_by_the_engine_and_the_offline_cache_commands():
    allowed = ("mlx_kvserve.kv", "mlx_kvserve.engine", "mlx_kvserve.cache_cli")
    for path in PACKAGE.rglob("*.py"):
        name = module_name(path)
        if name.startswith(allowed):
            continue
        wrong = sorted(m for m in package_imports(path, False) if m.startswith("mlx_kvserve.kv"))
        assert not wrong, f"{name} imports {wrong}: go through the engine's front (engine/engine.py)"


def test_no_import_circles_in_the_package():
    graph = {module_name(p): package_imports(p, True) for p in PACKAGE.rglob("*.py")}
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if nxt == node or nxt.startswith(node + "."):  # a package importing its own submodule
                continue
            if state.get(nxt) == 1:
                cycle = path[path.index(nxt) :] + [nxt] if nxt in path else [node, nxt]
                raise AssertionError(f"import circle: {' -> '.join(cycle)}")
            if nxt not in state:
                visit(nxt, [*path, nxt])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])


def test_modules_stay_small():
    """~400 lines per module (STYLE.md); kv/blocks.py, the one door to mlx-lm's cache classes, a little more."""
    for path in PACKAGE.rglob("*.py"):
        lines = len(path.read_text().splitlines())
        assert lines <= 470, f"{path.relative_to(ROOT)} has {lines} lines: split it by job"
