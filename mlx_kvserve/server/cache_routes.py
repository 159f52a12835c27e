"""Cache administration routes: /v1/cache/pin, unpin, pins, stats, flush, prune."""

from __future__ import annotations

from typing import Any

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ..engine.cache.admin import CacheAdmin, parse_hashes
from ..engine.front import EngineFront
from ..errors import InvalidRequestError, PermissionDeniedError, ValidationError
from . import prompts
from .bodies import read_json
from .context_window import check_prompt, window
from .gate import OWN_KEY, PRINCIPAL_KEY
from .messages import check_text, parse_messages

ADMIN_NEEDED = "which with several API keys caching apart needs the admin key: set server.admin_api_key"


def _principal(request: Request, body: dict[str, Any]) -> str:
    """Whose chain a pin's prompt is hashed in: the requester's (per_key isolation), or with
    `"shared": true` the plain namespace's, whose pinned blocks every principal's lookups use (kv/salts.py)."""
    shared = body.get("shared", False)
    if not isinstance(shared, bool):
        raise ValidationError("'shared' must be a boolean", param="shared")
    if shared and request.scope.get(OWN_KEY):
        raise PermissionDeniedError(
            f"'shared': true pins for every key, {ADMIN_NEEDED}", param="shared", code="admin_key_required"
        )
    return "" if shared else request.scope.get(PRINCIPAL_KEY, "")


async def _target_hashes(
    engine: EngineFront, admin: CacheAdmin, body: dict[str, Any], warm: bool, principal: str = "", own: bool = False
) -> tuple[list[bytes], bool]:
    """(hashes named by the body, whether they are a prompt's chain). `warm`: prefill a prompt
    whose blocks are not cached yet. `principal`: whose chain a prompt is hashed and warmed in.
    `own`: the key may reach only its own blocks (gate.OWN_KEY): PermissionDeniedError (403) for
    hashes, which may be anyone's, and for a prompt whose chain ends in a shared pin's blocks."""
    forms = [k for k in ("block_hashes", "messages", "prompt") if k in body]
    if len(forms) != 1:
        raise ValidationError("give exactly one of 'block_hashes', 'messages' or 'prompt'")
    if forms[0] == "block_hashes":
        if own:
            raise PermissionDeniedError(
                f"'block_hashes' may name any key's blocks, {ADMIN_NEEDED}; name your prompt ('messages' or "
                "'prompt') instead",
                param="block_hashes",
                code="admin_key_required",
            )
        return parse_hashes(body["block_hashes"]), False
    if forms[0] == "messages":
        add_prompt = body.get("add_generation_prompt", True)
        if not isinstance(add_prompt, bool):
            raise ValidationError("'add_generation_prompt' must be a boolean", param="add_generation_prompt")
        messages = parse_messages(body["messages"])
        tokens = await prompts.chat_tokens(engine, messages, add_prompt)
    else:
        prompt = body["prompt"]
        if not isinstance(prompt, str) or not prompt:
            raise ValidationError("'prompt' must be a non-empty string", param="prompt")
        tokens = await prompts.text_tokens(engine, check_text(prompt, "prompt"))
    hashes = engine.block_hashes(tokens, principal)
    if not hashes:
        raise InvalidRequestError(
            f"the prompt has {len(tokens)} tokens, less than one {admin.manager.block_size}-token block"
        )
    check_prompt(len(tokens), window(engine.context_length), "chat" if "messages" in body else "text")
    if own and hashes[-1] == engine.block_hashes(tokens)[-1]:  # the whole prompt walks a shared pin
        raise PermissionDeniedError(
            f"this prompt's blocks are a shared pin (every key's), {ADMIN_NEEDED}", code="admin_key_required"
        )
    if warm and admin.missing(hashes):
        await run_in_threadpool(engine.prefill, tokens, None, principal)
    return hashes, True


def cache_routes(engine: EngineFront) -> list[Route]:
    admin = engine.cache_admin()

    async def body_of(request: Request, allow_empty: bool = False) -> dict[str, Any]:
        body = await read_json(request, engine.config.server.max_body_bytes, allow_empty)
        if not isinstance(body, dict):
            raise ValidationError("request body must be a JSON object")
        return body

    async def pin(request: Request) -> Response:
        body = await body_of(request)
        own = bool(request.scope.get(OWN_KEY))
        hashes, is_chain = await _target_hashes(engine, admin, body, True, _principal(request, body), own)
        result = await run_in_threadpool(admin.pin, hashes, is_chain)
        if is_chain:
            result["block_hashes"] = [h.hex() for h in hashes]
        return JSONResponse(result)

    async def unpin(request: Request) -> Response:
        body = await body_of(request)
        own = bool(request.scope.get(OWN_KEY))
        hashes, is_chain = await _target_hashes(engine, admin, body, False, _principal(request, body), own)
        return JSONResponse(await run_in_threadpool(admin.unpin, hashes, is_chain))

    async def pins(request: Request) -> Response:
        return JSONResponse(
            {"pins": await run_in_threadpool(admin.pins), "leases": await run_in_threadpool(admin.leases)}
        )

    async def stats(request: Request) -> Response:
        return JSONResponse(engine.cache_stats())

    async def flush(request: Request) -> Response:
        body = await body_of(request, allow_empty=True)  # chunked bodies have no Content-Length: read any
        include_ssd = body.get("ssd", False)
        if not isinstance(include_ssd, bool):
            raise ValidationError("'ssd' must be a boolean", param="ssd")
        return JSONResponse(await run_in_threadpool(admin.flush, include_ssd))

    async def prune(request: Request) -> Response:
        await body_of(request, allow_empty=True)  # no fields, but a body that is no JSON object is an error
        return JSONResponse(await run_in_threadpool(admin.prune))

    return [
        Route("/v1/cache/pin", pin, methods=["POST"]),
        Route("/v1/cache/unpin", unpin, methods=["POST"]),
        Route("/v1/cache/pins", pins, methods=["GET"]),
        Route("/v1/cache/stats", stats, methods=["GET"]),
        Route("/v1/cache/flush", flush, methods=["POST"]),
        Route("/v1/cache/prune", prune, methods=["POST"]),
    ]
