"""Mount the /ui page on an app: its static files, served without a key (they hold no data), and
`GET /v1/cache/requests`, the recent requests log, behind the admin key like every /v1/cache/ route.

The page is served by a middleware outside the RequestGate: a browser cannot send a Bearer header when
it opens a page, and the files need none. The same middleware fills the requests log from the
RequestRecord the gate leaves in the scope once a request is done.
"""

from __future__ import annotations

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from .gate import LIMITED_PATHS, OWN_KEY, RECORD_KEY
from .ui import SECURITY_HEADERS, RecentRequests, asset

UI_PATH = "/ui"
REQUESTS_PATH = "/v1/cache/requests"
_LOGGED = LIMITED_PATHS - {"/v1/messages/count_tokens"}  # requests that generate


def ui_response(path: str, method: str, page: str = "index.html") -> Response:
    """The answer to a request for `path` under /ui (/ui itself: `page`): a static file, 404 or 405."""
    if method not in ("GET", "HEAD"):
        return PlainTextResponse("method not allowed", status_code=405, headers={"allow": "GET, HEAD"})
    found = asset(page if path == UI_PATH else path[len(UI_PATH) + 1 :])
    if found is None:
        return PlainTextResponse("not found", status_code=404)
    return Response(found.body, media_type=found.content_type, headers=SECURITY_HEADERS)


def is_ui_path(path: str) -> bool:
    return path == UI_PATH or path.startswith(UI_PATH + "/")


class UiMiddleware:
    """Answers /ui (with `page`) and /ui/<file> itself; passes everything else on, then logs finished
    completions in `recent` (None: logs nothing, as on the router)."""

    def __init__(self, app: ASGIApp, recent: RecentRequests | None, page: str = "index.html"):
        self.app = app
        self.recent = recent
        self.page = page

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if is_ui_path(scope["path"]):
            await ui_response(scope["path"], scope["method"], self.page)(scope, receive, send)
            return
        if self.recent is None:
            await self.app(scope, receive, send)
            return
        try:
            await self.app(scope, receive, send)
        finally:
            record = scope.get(RECORD_KEY)  # finished by the gate, inside this call
            if record is not None and record.endpoint in _LOGGED and scope["method"] == "POST":
                self.recent.add(record)


def mount_ui(app: Starlette, capacity: int = 200) -> RecentRequests:
    """Serve /ui and /v1/cache/requests on `app`. Call after the RequestGate is added, so the page
    is served outside it and the log route inside it (it is appended to the gate's live route list)."""
    recent = RecentRequests(capacity)

    async def requests_log(request: Request) -> Response:
        own = request.scope.get(OWN_KEY)  # several keys caching apart: a key sees its own requests only
        return JSONResponse({"requests": recent.items(own), "capacity": capacity})

    app.router.routes.append(Route(REQUESTS_PATH, requests_log, methods=["GET"]))
    app.add_middleware(UiMiddleware, recent=recent)
    return recent


def mount_router_ui(app: Starlette) -> None:
    """Serve the router's page (its backends and its choices) at /ui, outside its key check."""
    app.add_middleware(UiMiddleware, recent=None, page="router.html")
