"""`GET /v1/models` and `GET /v1/models/{id}`: the one served model, in OpenAI's shape, or in
Anthropic's when the request carries an `anthropic-version` header (Anthropic's SDKs and Claude Code
always send one). Each card carries the context window under the names clients read
(server/context_window.py: window_fields)."""

from __future__ import annotations

import datetime
from typing import Any

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ..engine.front import EngineFront
from ..errors import model_not_found
from .anthropic.reply import error_response as anthropic_error
from .context_window import window_fields
from .gate import note_error


def _card(engine: EngineFront, anthropic: bool) -> dict[str, Any]:
    name, created = engine.model_name, int(engine.started_at)
    server = engine.config.server
    limits = window_fields(engine.context_length, server.max_prompt_tokens, server.max_completion_tokens, anthropic)
    if not anthropic:
        return {"id": name, "object": "model", "created": created, "owned_by": "mlx-kvserve"} | limits
    stamp = datetime.datetime.fromtimestamp(created, datetime.UTC).isoformat().replace("+00:00", "Z")
    return {"type": "model", "id": name, "display_name": name, "created_at": stamp} | limits


def model_routes(engine: EngineFront) -> list[Route]:
    def is_anthropic(request: Request) -> bool:
        return "anthropic-version" in request.headers

    async def models(request: Request) -> Response:
        card = _card(engine, is_anthropic(request))
        if not is_anthropic(request):
            return JSONResponse({"object": "list", "data": [card]})
        return JSONResponse({"data": [card], "has_more": False, "first_id": card["id"], "last_id": card["id"]})

    async def model(request: Request) -> Response:
        name = request.path_params["model_id"]
        if not name:  # "/v1/models/": a trailing slash is a 404 like on every route (app.py)
            raise HTTPException(404, "Not Found")
        if name not in (engine.model_name, "default"):
            error = model_not_found(name, [engine.model_name])
            if is_anthropic(request):
                note_error(request.scope, error)
                return anthropic_error(error)
            raise error  # the app's handler answers in OpenAI's shape
        return JSONResponse(_card(engine, is_anthropic(request)))

    return [
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/models/{model_id:path}", model, methods=["GET"]),
    ]
