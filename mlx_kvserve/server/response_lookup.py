"""`GET` and `DELETE /v1/responses/{id}` on a server whose models may run in processes of their own
(server/model_process.py): a stored response lives in the process of the model that wrote it, so one this
process does not hold (404) is asked of each model process that serves now, and the first that holds it
answers. Without model processes this is the route's own answer."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ..registry.registry import ModelRegistry
from .model_process import ModelProcess
from .model_proxy import forward

PREFIX = "/v1/responses/"


def is_lookup(scope: Scope) -> bool:
    return scope["type"] == "http" and scope["path"].startswith(PREFIX) and scope["method"] in ("GET", "DELETE")


async def captured(run: Callable[[Send], Awaitable[None]]) -> list[Message]:
    messages: list[Message] = []

    async def keep(message: Message) -> None:
        messages.append(message)

    await run(keep)
    return messages


def status(messages: list[Message]) -> int:
    return next((m["status"] for m in messages if m["type"] == "http.response.start"), 500)


async def lookup(app: ASGIApp, registry: ModelRegistry, scope: Scope, receive: Receive, send: Send) -> None:
    """Answer from this process's store, else from the first model process holding the response."""
    answer = await captured(lambda keep: app(scope, receive, keep))
    if status(answer) == 404:
        for _, engine in registry.loaded_engines():
            if isinstance(engine, ModelProcess) and engine.ready(0):
                theirs = await captured(lambda keep, child=engine: forward(child, scope, receive, keep))
                if status(theirs) != 404:
                    answer = theirs
                    break
    for message in answer:
        await send(message)
