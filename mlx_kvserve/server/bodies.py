"""Request bodies: read within the size limit and parsed as strict JSON (a 413 past the limit, a 400
for anything a request field cannot hold)."""

from __future__ import annotations

import json
from typing import Any

from starlette.requests import Request

from ..errors import InvalidRequestError, PayloadTooLargeError


class _NotJSON(ValueError):
    pass


def _refuse_constant(name: str) -> Any:
    raise _NotJSON(f"{name} is not a JSON value")  # Python's json takes NaN and Infinity; JSON does not


async def read_json(request: Request, limit: int, allow_empty: bool = False) -> Any:
    """The body parsed as JSON ({} for an empty one when `allow_empty`). Raises
    PayloadTooLargeError (413) past `limit`, InvalidRequestError (400) for anything else that is
    not JSON a request field can hold."""
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and (len(declared) > 18 or int(declared) > limit):
        raise PayloadTooLargeError(f"request body of {declared} bytes exceeds the limit of {limit} bytes")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise PayloadTooLargeError(f"request body exceeds the limit of {limit} bytes")
        chunks.append(chunk)
    raw = b"".join(chunks)
    if allow_empty and not raw.strip():
        return {}
    try:
        return json.loads(raw, parse_constant=_refuse_constant)
    except (UnicodeDecodeError, json.JSONDecodeError, _NotJSON) as exc:
        raise InvalidRequestError(f"request body is not valid JSON: {exc}") from None
    except ValueError:  # the one other: an integer past int()'s digit limit (4300 by default)
        raise InvalidRequestError("request body holds an integer with too many digits to read") from None
    except RecursionError:  # a few thousand nested brackets fit in any body limit
        raise InvalidRequestError("request body is nested too deeply") from None
