"""`POST /v1/embeddings` in OpenAI's shape, served by an embedding model (a `[[models]]` entry with
`kind = "embedding"`: engine/embedding.py; docs/api.md#embeddings).

`input` is a string, a list of strings, a list of token ids or a list of token-id lists; the reply has
one `{"object": "embedding", "index", "embedding"}` per input, in order, with `usage.prompt_tokens`.
`encoding_format` "float" (default) or "base64" (the float32 little-endian bytes, as OpenAI sends them);
`dimensions` is honoured only as the model's entry allows (400 otherwise). Tokenizing runs in a thread;
the forward passes run on the model's own MLX thread, awaited here as a future.
"""

from __future__ import annotations

import asyncio
import base64
from typing import Any, NamedTuple

import numpy as np
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ..engine.embedding import check_dimensions, fit_dimensions
from ..errors import InvalidRequestError, ValidationError, model_not_found
from .bodies import read_json
from .gate import RECORD_KEY
from .prompts import MAX_TOKEN_ID

EMBEDDINGS_PATH = "/v1/embeddings"
MAX_INPUTS = 2048  # OpenAI's limit on inputs per request
KNOWN_FIELDS = frozenset({"model", "input", "encoding_format", "dimensions", "user", "keep_alive"})


class EmbeddingRequest(NamedTuple):
    """A parsed request: `texts` (strings to tokenize) or `token_lists` (ids as sent), one of them."""

    texts: list[str] | None
    token_lists: list[list[int]] | None
    encoding_format: str
    dimensions: int | None

    @property
    def num_inputs(self) -> int:
        return len(self.texts if self.texts is not None else self.token_lists or [])


def _is_ids(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)


def parse_embedding_request(body: Any) -> EmbeddingRequest:
    """The request's fields; ValidationError (422) naming the field for anything OpenAI refuses:
    an empty input, an empty string or token list, more than MAX_INPUTS, mixed kinds, an unknown field."""
    if not isinstance(body, dict):
        raise ValidationError("the body must be a JSON object", param=None)
    unknown = sorted(set(body) - KNOWN_FIELDS)
    if unknown:
        raise ValidationError(f"unknown field {unknown[0]!r}", param=unknown[0])
    raw = body.get("input")
    texts: list[str] | None = None
    ids: list[list[int]] | None = None
    if isinstance(raw, str):
        texts = [raw]
    elif isinstance(raw, list) and raw and all(isinstance(x, str) for x in raw):
        texts = raw
    elif isinstance(raw, list) and raw and _is_ids(raw):
        ids = [raw]
    elif isinstance(raw, list) and raw and all(_is_ids(x) for x in raw):
        ids = raw
    else:
        raise ValidationError(
            "'input' must be a string, a list of strings, a list of token ids or a list of token-id lists "
            "(none of them empty)",
            param="input",
        )
    inputs: list[Any] = texts if texts is not None else ids  # type: ignore[assignment]
    if len(inputs) > MAX_INPUTS:
        raise ValidationError(f"'input' may hold at most {MAX_INPUTS} inputs, got {len(inputs)}", param="input")
    if any(len(x) == 0 for x in inputs):
        raise ValidationError("'input' must not hold an empty string or token list", param="input")
    fmt = body.get("encoding_format", "float")
    if fmt not in ("float", "base64"):
        raise ValidationError('\'encoding_format\' must be "float" or "base64"', param="encoding_format")
    dims = body.get("dimensions")
    if dims is not None and (not isinstance(dims, int) or isinstance(dims, bool) or dims < 1):
        raise ValidationError("'dimensions' must be a positive integer", param="dimensions")
    return EmbeddingRequest(texts, ids, fmt, dims)


def encode_vector(vector: np.ndarray, encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":
        return base64.b64encode(vector.astype("<f4").tobytes()).decode("ascii")
    return vector.tolist()


def reply_body(vectors: np.ndarray, model: str, num_tokens: int, encoding_format: str) -> dict[str, Any]:
    data = [
        {"object": "embedding", "index": i, "embedding": encode_vector(v, encoding_format)}
        for i, v in enumerate(vectors)
    ]
    usage = {"prompt_tokens": num_tokens, "total_tokens": num_tokens}
    return {"object": "list", "data": data, "model": model, "usage": usage}


def not_an_embedding_model(name: str) -> InvalidRequestError:
    return InvalidRequestError(
        f'model {name!r} is a chat model; /v1/embeddings needs a model registered with kind = "embedding" '
        "(docs/models.md#embeddings)",
        param="model",
        code="model_not_embedding",
    )


async def _tokens(engine: Any, req: EmbeddingRequest) -> list[list[int]]:
    """Each input's ids, checked against the model's vocabulary and context."""
    if req.texts is not None:
        try:
            lists = await run_in_threadpool(lambda: [engine.text_tokens(t) for t in req.texts])
        except Exception as exc:  # tokenizers raise their own types
            raise InvalidRequestError(f"the input could not be tokenized: {exc}", param="input") from None
    else:
        lists = req.token_lists or []
        vocab = engine.vocab_size or MAX_TOKEN_ID
        if any(not 0 <= t < vocab for ids in lists for t in ids):
            raise ValidationError(f"token ids in 'input' must be in [0, {vocab})", param="input")
    limit = engine.context_length
    for i, ids in enumerate(lists):
        if not ids:
            raise InvalidRequestError(f"input {i} has no tokens", param="input")
        if limit and len(ids) > limit:
            raise InvalidRequestError(
                f"input {i} has {len(ids)} tokens; this model takes at most {limit}", param="input"
            )
    return lists


def embedding_routes(engine: Any) -> list[Route]:
    """/v1/embeddings over `engine` (an Engine or the several-models front: the bound model answers)."""

    async def embeddings(request: Request) -> Response:
        body = await read_json(request, engine.config.server.max_body_bytes)
        req = parse_embedding_request(body)
        if not getattr(engine, "is_embedding", False):  # one chat model served: a name it is not is unknown
            name = body.get("model")
            if isinstance(name, str) and name not in ("", "default", engine.model_name):
                raise model_not_found(name, [engine.model_name])
            raise not_an_embedding_model(engine.model_name)
        check_dimensions(req.dimensions, engine.dimensions, engine.min_dimensions, engine.model_name)
        lists = await _tokens(engine, req)
        done = await asyncio.wrap_future(engine.embed(lists))
        vectors = fit_dimensions(done.vectors, req.dimensions, engine.normalize)
        record = request.scope.get(RECORD_KEY)
        if record is not None:
            record.prompt_tokens = done.num_tokens
        return JSONResponse(reply_body(vectors, engine.model_name, done.num_tokens, req.encoding_format))

    return [Route(EMBEDDINGS_PATH, embeddings, methods=["POST"])]
