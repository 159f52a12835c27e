"""`GET /`: where a newcomer (or a browser) lands. A short JSON naming the dashboard, the health
route and the API routes; a small HTML page with the same links when the client asks for text/html.
`HEAD /` answers too: Claude Code checks its base URL with it before each run."""

from __future__ import annotations

import html

from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response

LINKS = {
    "ui": "/ui",
    "health": "/health",
    "metrics": "/metrics",
    "models": "/v1/models",
    "chat_completions": "/v1/chat/completions",
    "completions": "/v1/completions",
    "responses": "/v1/responses",
    "messages": "/v1/messages",
    "cache_stats": "/v1/cache/stats",
}
_NOTES = {
    "ui": "dashboard: the cache's hits, time saved, requests and a playground",
    "health": "status and cache statistics (JSON)",
    "metrics": "Prometheus metrics",
}


def root_body(model_name: str) -> dict:
    return {"object": "server", "name": "mlx-kvserve", "model": model_name, "dashboard": LINKS["ui"], "links": LINKS}


def root_html(model_name: str) -> str:
    items = "".join(
        f'<li><a href="{path}">{path}</a>{" — " + _NOTES[name] if name in _NOTES else ""}</li>'
        for name, path in LINKS.items()
    )
    return (
        "<!doctype html><meta charset=utf-8><title>mlx-kvserve</title>"
        f"<h1>mlx-kvserve</h1><p>Serving <b>{html.escape(model_name)}</b>. "
        f'Open the <a href="/ui">dashboard</a> to see the cache at work.</p><ul>{items}</ul>'
    )


def wants_html(request: Request) -> bool:
    return "text/html" in request.headers.get("accept", "")


def root_response(request: Request, model_name: str) -> Response:
    if wants_html(request):
        return HTMLResponse(root_html(model_name))
    return JSONResponse(root_body(model_name))


def dashboard_url(host: str, port: int) -> str:
    """The /ui address to print at start: a wildcard bind is reached on loopback, IPv6 in brackets."""
    if host in ("", "0.0.0.0", "::"):
        host = "127.0.0.1"
    elif ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{port}{LINKS['ui']}"
