"""The server's view of an engine (engine/front.py, issue 48): the Engine and the several-models front
(registry/front.py) both have every EngineFront member, with a signature that takes what the protocol's
callers pass; the several-models front names each one itself (no `__getattr__` forwarding)."""

from __future__ import annotations

import ast
import inspect
import textwrap

from mlx_kvserve.engine.engine import Engine
from mlx_kvserve.engine.front import EngineFront
from mlx_kvserve.registry.front import RoutedEngine

MEMBERS = sorted(
    name
    for name, value in vars(EngineFront).items()
    if not name.startswith("_") and (callable(value) or isinstance(value, property))
)


def assigned_in_init(cls: type) -> set[str]:
    """The `self.name` attributes `cls.__init__` assigns (instance data the class itself does not hold)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls.__init__)))
    names = set()
    for node in ast.walk(tree):
        targets = (
            node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        )
        for target in targets:
            for sub in ast.walk(target):
                if isinstance(sub, ast.Attribute) and isinstance(sub.value, ast.Name) and sub.value.id == "self":
                    names.add(sub.attr)
    return names


def takes(impl, proto) -> str:
    """Why `impl` cannot be called as `proto` is ("" when it can): every protocol parameter by the same name
    and kind (a default where the protocol has one); any extra parameter of `impl` optional."""
    want = list(inspect.signature(proto).parameters.values())[1:]
    have = inspect.signature(impl).parameters
    for p in want:
        q = have.get(p.name)
        if q is None:
            return f"no parameter {p.name}"
        if q.kind != p.kind:
            return f"{p.name} is {q.kind.description}, not {p.kind.description}"
        if p.default is not inspect.Parameter.empty and q.default is inspect.Parameter.empty:
            return f"{p.name} has no default"
    extra = [q.name for n, q in list(have.items())[1:] if n not in {p.name for p in want}]
    required = [n for n in extra if have[n].default is inspect.Parameter.empty and have[n].kind.value < 2]
    return f"extra required parameters {required}" if required else ""


def check(cls: type, own_only: bool) -> list[str]:
    problems = []
    instance_data = assigned_in_init(cls)
    for name in MEMBERS:
        proto = vars(EngineFront)[name]
        where = vars(cls) if own_only else {k: getattr(cls, k) for k in dir(cls)}
        impl = where.get(name)
        if impl is None:
            if isinstance(proto, property) and name in instance_data and not own_only:
                continue  # a plain attribute set in __init__ reads as the property does
            problems.append(f"{cls.__name__}.{name} missing")
        elif isinstance(proto, property):
            if not isinstance(impl, property) and callable(impl):
                problems.append(f"{cls.__name__}.{name} is a method, the protocol reads a value")
        elif not callable(impl) or isinstance(impl, property):
            problems.append(f"{cls.__name__}.{name} is not a method")
        elif why := takes(impl, proto):
            problems.append(f"{cls.__name__}.{name}: {why}")
    return problems


def test_the_protocol_names_what_the_server_calls():
    assert {"submit", "chat_tokens", "cache_admin", "health", "config", "model_name", "prompt_progress"} <= set(MEMBERS)


def test_the_engine_is_an_engine_front():
    assert check(Engine, own_only=False) == []


def test_the_several_models_front_names_every_member_itself():
    assert check(RoutedEngine, own_only=True) == []
    assert "__getattr__" not in vars(RoutedEngine)


def test_the_check_can_fail():
    class Partial:
        def __init__(self):
            self.config = None

        def submit(self): ...

        def chat_tokens(self, messages, principal=""): ...

        def health(self, extra): ...

    problems = check(Partial, own_only=False)
    assert "Partial.submit: no parameter req" in problems
    assert "Partial.chat_tokens: no parameter add_generation_prompt" in problems
    assert "Partial.health: extra required parameters ['extra']" in problems
    assert "Partial.model_name missing" in problems and not any(p.startswith("Partial.config") for p in problems)
