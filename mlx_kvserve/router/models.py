"""Which backend serves which model: read from each backend's /health (a server with several models lists
every registered model there with its state; a one-model server names its model), and the first step of a
routing decision: a request naming a model goes to the backends that have it loaded, else to those that
have it registered (loading it there on demand), else it is a 404 naming the models the backends serve.
The policy then picks among those backends by cache and load, as for any request.

A request naming no model ("", "default" or none) is served by each backend's default model: no filter.
A backend that has not reported its models yet (its first /health poll is pending, or it reports none)
may serve any model: it counts as having it registered.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

from ..errors import NotFoundError

LOADED = "loaded"
MAX_MODELS = 1024  # rows read from one report
MAX_NAME = 256  # characters of an id or alias


class ModelReport(NamedTuple):
    """What one backend serves: each id and alias -> its model's id, and each id -> its state
    ("loaded", "loading", "unloading", "unloaded")."""

    ids: dict[str, str]
    states: dict[str, str]


def is_default(model: str | None) -> bool:
    return model in (None, "", "default")


def _name(value: Any) -> str | None:
    return value if isinstance(value, str) and 0 < len(value) <= MAX_NAME else None


def parse_health_models(body: Any) -> ModelReport | None:
    """The models a /health body reports; None when it reports none usable (checked: a backend's
    report never breaks the router, it only goes unused)."""
    if not isinstance(body, dict):
        return None
    rows = body.get("models")
    if not isinstance(rows, list):
        model = _name(body.get("model"))
        return ModelReport({model: model}, {model: LOADED}) if model else None
    ids: dict[str, str] = {}
    states: dict[str, str] = {}
    for row in rows[:MAX_MODELS]:
        model = _name(row.get("id")) if isinstance(row, dict) else None
        if model is None:
            continue
        states[model] = _name(row.get("state")) or "unloaded"
        aliases = row.get("aliases") if isinstance(row.get("aliases"), list) else []
        for name in (model, *(a for a in map(_name, aliases[:MAX_MODELS]) if a)):
            ids.setdefault(name, model)
    return ModelReport(ids, states) if ids else None


def model_rank(report: ModelReport | None, model: str | None) -> int:
    """2: `model` is loaded there; 1: registered there (or the backend has not reported its models);
    0: not served there."""
    if is_default(model) or report is None:
        return 1
    found = report.ids.get(model)  # type: ignore[arg-type]
    if found is None:
        return 0
    return 2 if report.states.get(found) == LOADED else 1


def by_model(ranks: Sequence[int]) -> list[int]:
    """Indices of the backends to pick among, given each one's model_rank: those with the best rank
    above 0, in order; [] when none serves the model."""
    best = max(ranks, default=0)
    return [i for i, rank in enumerate(ranks) if rank == best] if best else []


def model_not_served(model: str, reports: Sequence[ModelReport | None]) -> NotFoundError:
    """The 404 for a model no backend serves, naming the models they do."""
    served = sorted({m for r in reports if r is not None for m in r.states})
    names = ", ".join(repr(m) for m in served) or "no model reported yet"
    return NotFoundError(
        f"model {model!r} not found; the backends serve {names}", param="model", code="model_not_found"
    )
