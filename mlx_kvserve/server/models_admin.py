"""The routes and metrics of a server with several models ([[models]], registry/registry.py):
`GET /v1/models` and `/v1/models/{id}` list every registered model with its state (OpenAI's shape with
extra fields, or Anthropic's with an `anthropic-version` header); `GET /v1/cache/models`,
`POST /v1/cache/models/load` and `/v1/cache/models/unload` (`{"model": id}`) under the admin key."""

from __future__ import annotations

import datetime
import time
from collections.abc import Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ..config import ServerConfig
from ..errors import KVServeError, ValidationError
from ..registry.registry import LOADED, ModelRegistry
from .anthropic.reply import error_response as anthropic_error
from .bodies import read_json
from .context_window import window_fields
from .gate import note_error
from .metrics import PREFIX

CARD_FIELDS = ("state", "kind", "aliases", "pinned", "in_use", "memory_bytes", "ssd_bytes")  # ours, beside OpenAI's


def _card(row: dict[str, Any], created: int, anthropic: bool, server: ServerConfig) -> dict[str, Any]:
    # The context: the one it served at its last load, else its entry's cap (none before a first load).
    limits = window_fields(
        row["context_length"] or 0, server.max_prompt_tokens, server.max_completion_tokens, anthropic
    )
    if anthropic:
        stamp = datetime.datetime.fromtimestamp(created, datetime.UTC).isoformat().replace("+00:00", "Z")
        return {"type": "model", "id": row["id"], "display_name": row["id"], "created_at": stamp} | limits
    card = {"id": row["id"], "object": "model", "created": created, "owned_by": "mlx-kvserve"}
    return card | {k: row[k] for k in CARD_FIELDS} | limits


def models_routes(registry: ModelRegistry, max_body_bytes: int) -> list[Route]:
    created = int(time.time())

    def is_anthropic(request: Request) -> bool:
        return "anthropic-version" in request.headers

    async def models(request: Request) -> Response:
        anthropic = is_anthropic(request)
        cards = [_card(row, created, anthropic, registry.config.server) for row in registry.describe()["models"]]
        if not anthropic:
            return JSONResponse({"object": "list", "data": cards})
        return JSONResponse({"data": cards, "has_more": False, "first_id": cards[0]["id"], "last_id": cards[-1]["id"]})

    async def model(request: Request) -> Response:
        name = request.path_params["model_id"]
        if not name:  # a trailing slash is a 404 like on every route (app.py)
            raise HTTPException(404, "Not Found")
        try:
            slot = registry.resolve(name)
        except KVServeError as exc:
            if not is_anthropic(request):
                raise  # the app's handler answers in OpenAI's shape
            note_error(request.scope, exc)
            return anthropic_error(exc)
        return JSONResponse(_card(registry.describe_slot(slot), created, is_anthropic(request), registry.config.server))

    async def model_of(request: Request) -> str:
        body = await read_json(request, max_body_bytes)
        if not isinstance(body, dict) or not isinstance(body.get("model"), str):
            raise ValidationError('the body must be {"model": "<id>"}', param="model")
        return body["model"]

    async def listing(request: Request) -> Response:
        return JSONResponse(registry.describe())

    async def load(request: Request) -> Response:
        name = await model_of(request)
        return JSONResponse(await run_in_threadpool(registry.load, name))

    async def unload(request: Request) -> Response:
        name = await model_of(request)
        return JSONResponse(await run_in_threadpool(registry.unload, name))

    return [
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/models/{model_id:path}", model, methods=["GET"]),
        Route("/v1/cache/models", listing, methods=["GET"]),
        Route("/v1/cache/models/load", load, methods=["POST"]),
        Route("/v1/cache/models/unload", unload, methods=["POST"]),
    ]


class RegistryCollector(Collector):
    """Per-model gauges and counters, read from the registry when scraped."""

    def __init__(self, registry: ModelRegistry):
        self.registry = registry

    def collect(self) -> Iterator[Metric]:
        described = self.registry.describe()
        rows = described["models"]
        families = [
            (GaugeMetricFamily, "model_loaded", "1 while the model is loaded", lambda r: int(r["state"] == LOADED)),
            (GaugeMetricFamily, "model_in_use", "Requests holding the model", lambda r: r["in_use"]),
            (
                GaugeMetricFamily,
                "model_memory_bytes",
                "Weights and KV in RAM of a loaded model",
                lambda r: r["memory_bytes"],
            ),
            (GaugeMetricFamily, "model_ssd_bytes", "Bytes of the model's SSD folder", lambda r: r["ssd_bytes"] or 0),
            (CounterMetricFamily, "model_loads", "Times the model was loaded", lambda r: r["loads"]),
            (CounterMetricFamily, "model_unloads", "Times the model was unloaded", lambda r: r["unloads"]),
        ]
        for cls, name, text, value in families:
            family = cls(PREFIX + name, text, labels=["model"])
            for row in rows:
                family.add_metric([row["id"]], value(row))
            yield family
        yield GaugeMetricFamily(
            PREFIX + "model_memory_budget_bytes", "[server] model_memory_bytes", value=described["memory_budget_bytes"]
        )
