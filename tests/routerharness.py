"""Fake backends for the router's tests: real HTTP servers on loopback (uvicorn in a thread), each with a real
KVManager behind the real /v1/cache/layout and /v1/cache/events routes, and a chat endpoint whose behaviour a
test sets (answer, stream slowly, fail mid-stream, answer 503). A byte tokenizer stands in for the model's.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import uvicorn
from harness.servers import free_port
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from mlx_kvserve.chain import BlockHasher
from mlx_kvserve.engine.engine import Engine
from mlx_kvserve.kv.hashing import namespace_hash
from mlx_kvserve.kv.manager import KVManager
from mlx_kvserve.kv.ram import RAMStore
from mlx_kvserve.server.router_routes import router_routes

BS = 4


class FakeEngine(SimpleNamespace):
    """The real Engine front (what the router routes read) over fake internals."""

    model_path, cache_reason, router_view = Engine.model_path, Engine.cache_reason, Engine.router_view


class ByteTokenizer:
    """Token ids are the UTF-8 bytes; a chat renders as its contents joined by newlines."""

    def encode(self, text: str) -> list[int]:
        return list(text.encode())

    def apply_chat_template(self, messages, add_generation_prompt=True, **kwargs) -> list[int]:
        return self.encode("\n".join(m["content"] for m in messages))


def chat_tokens(messages: list[dict]) -> list[int]:
    return ByteTokenizer().apply_chat_template(messages)


class ServerThread:
    """An ASGI app served by uvicorn on a free loopback port, in a daemon thread."""

    def __init__(self, app, port: int | None = None):
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(
            app, host="127.0.0.1", port=self.port, log_level="warning", lifespan="on", timeout_graceful_shutdown=2
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.time() + 10
        while not self.server.started:
            assert time.time() < deadline, "server did not start"
            time.sleep(0.01)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)


class FakeBackend:
    """A backend with a real block cache. `mode`: "ok", "slow" (a chunk every `delay_s`), "die" (one chunk
    then the connection breaks; /health fails too), "busy" (503), "down" (/health fails), "hang" (takes a
    completion request and never answers; /health answers). `seen` records (path, headers, body) of each
    request; `closed` counts streams whose client went away before the end.

    What it reports to a router can be spoiled: `layout_body` (JSON-able, or raw bytes) replaces its
    /v1/cache/layout answer while set; each string in `event_streams` is served, raw, as one whole
    /v1/cache/events stream before the real ones resume."""

    def __init__(self, name: str, model_path: str = "", ns: bytes | None = None):
        self.name = name
        self.mode = "ok"
        self.delay_s = 0.05
        self.num_chunks = 3
        self.seen: list[tuple[str, dict, dict]] = []
        self.closed = 0
        self.finished = 0
        self.layout_body: object = None
        self.event_streams: list[str] = []
        self.num_layout_requests = 0
        self.is_stopping = False
        self.kept: dict[str, dict] = {}  # stored Responses API responses, by id
        self.lookup_status: int | None = None  # set: every stored-response lookup answers this (a broken backend)
        self.report_cached: int | None = None  # set: the cached_tokens its replies report (a backend that lies)
        self.hasher = BlockHasher(ns or namespace_hash("fake-model", "float32", BS), BS)
        self.manager = KVManager(self.hasher, RAMStore(10**9))
        self.engine = engine = FakeEngine(
            model_name="fake",
            loaded=SimpleNamespace(path=Path(model_path or "/nonexistent/fake")),
            prefix_cache=SimpleNamespace(manager=self.manager, reason=""),
        )
        self.real_routes = {r.path: r.endpoint for r in router_routes(engine)}
        routes = [
            Route("/health", self.health, methods=["GET"]),
            Route("/v1/chat/completions", self.chat, methods=["POST"]),
            Route("/v1/messages", self.chat, methods=["POST"]),
            Route("/v1/responses", self.responses, methods=["POST"]),
            Route("/v1/responses/{response_id}", self.kept_response, methods=["GET", "DELETE"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/v1/cache/layout", self.layout, methods=["GET"]),
            Route("/v1/cache/events", self.events, methods=["GET"]),
        ]
        self.app = Starlette(routes=routes)
        self.server: ServerThread | None = None

    @property
    def url(self) -> str:
        return self.server.url

    def start(self, port: int | None = None) -> FakeBackend:
        self.server = ServerThread(self.app, port)
        return self

    def stop(self) -> None:
        self.is_stopping = True
        self.server.stop()

    def real_layout(self) -> dict:
        """What the real /v1/cache/layout route answers (a start for a spoiled one)."""
        events = self.manager.events
        return {
            "model": "fake",
            "model_path": str(self.engine.loaded.path),
            "enabled": True,
            "namespace": self.hasher.namespace.hex(),
            "block_size": BS,
            "epoch": events.epoch,
            "last_seq": events.last_seq,
        }

    def store(self, tokens: list[int]) -> int:
        """Register the full blocks of `tokens` as cached; returns how many were new."""
        hashes = self.hasher.hash_blocks(tokens)
        new = 0
        for i, h in enumerate(hashes):
            parent = hashes[i - 1] if i else self.hasher.namespace
            new += self.manager.cache_block(h, parent, tokens[i * BS : (i + 1) * BS], None, 1)
        return new

    async def health(self, request: Request) -> Response:
        return JSONResponse({"status": "ok"}, status_code=503 if self.mode in ("down", "die") else 200)

    async def layout(self, request: Request) -> Response:
        self.num_layout_requests += 1
        if isinstance(self.layout_body, bytes):
            return Response(self.layout_body, media_type="application/json")
        if self.layout_body is not None:
            return JSONResponse(self.layout_body)
        return await self.real_routes["/v1/cache/layout"](request)

    async def events(self, request: Request) -> Response:
        if self.event_streams:
            return Response(self.event_streams.pop(0), media_type="text/event-stream")
        return await self.real_routes["/v1/cache/events"](request)

    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": self.name}]})

    async def chat(self, request: Request) -> Response:
        try:
            body = json.loads(await request.body())
        except ValueError:
            body = None
        self.seen.append((request.url.path, dict(request.headers), body))
        if self.mode == "busy":
            return JSONResponse({"error": {"message": "busy"}}, status_code=503)
        while self.mode == "hang" and not self.is_stopping:
            await asyncio.sleep(0.05)
        if not isinstance(body, dict):
            return JSONResponse({"error": {"message": "not JSON"}}, status_code=400)
        tokens = chat_tokens(body.get("messages", []))
        cached = sum(1 for h in self.hasher.hash_blocks(tokens) if self.manager.in_ram(h)) * BS
        cached = cached if self.report_cached is None else self.report_cached
        usage = {"prompt_tokens": len(tokens), "completion_tokens": self.num_chunks, "total_tokens": len(tokens) + 3}
        usage["prompt_tokens_details"] = {"cached_tokens": cached}
        if not body.get("stream"):
            await asyncio.sleep(self.delay_s if self.mode == "slow" else 0)
            if await request.is_disconnected():
                self.closed += 1
                return Response(status_code=499)
            self.store(tokens)
            self.finished += 1
            return JSONResponse({"choices": [{"message": {"content": self.name}}], "usage": usage})
        return StreamingResponse(self._stream(tokens, usage), media_type="text/event-stream")

    async def responses(self, request: Request) -> Response:
        """A Responses API reply, kept under a new id; a follow-up to an id kept elsewhere is a 404."""
        body = json.loads(await request.body())
        self.seen.append((request.url.path, dict(request.headers), body))
        prev = body.get("previous_response_id")
        if prev is not None and prev not in self.kept:
            return JSONResponse({"error": {"message": f"response {prev!r} not found"}}, status_code=404)
        rid = f"resp_{self.name}_{len(self.kept)}"
        self.kept[rid] = body
        usage = {"input_tokens": 1, "output_tokens": 1, "total_tokens": 2}
        return JSONResponse({"id": rid, "object": "response", "status": "completed", "output": [], "usage": usage})

    async def kept_response(self, request: Request) -> Response:
        rid = request.path_params["response_id"]
        if self.lookup_status is not None:
            return JSONResponse({"error": {"message": "something broke"}}, status_code=self.lookup_status)
        if rid not in self.kept:
            return JSONResponse({"error": {"message": f"response {rid!r} not found"}}, status_code=404)
        if request.method == "DELETE":
            del self.kept[rid]
            return JSONResponse({"id": rid, "object": "response.deleted", "deleted": True})
        return JSONResponse({"id": rid, "object": "response", "status": "completed", "output": []})

    async def _stream(self, tokens: list[int], usage: dict):
        done = False
        try:
            yield f"data: {json.dumps({'choices': [{'delta': {'role': 'assistant'}}]})}\n\n"
            for i in range(self.num_chunks):
                if self.mode in ("slow", "die") and i:
                    await asyncio.sleep(self.delay_s)
                if self.mode == "die" and i == 1:
                    raise RuntimeError("backend died")
                yield f"data: {json.dumps({'choices': [{'delta': {'content': f'{self.name}{i}'}}]})}\n\n"
            self.store(tokens)
            yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
            yield "data: [DONE]\n\n"
            done = True
            self.finished += 1
        finally:
            if not done and self.mode != "die":
                self.closed += 1


def wait_for(predicate, timeout: float = 5.0, what: str = "condition") -> None:
    deadline = time.time() + timeout
    while not predicate():
        assert time.time() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)
