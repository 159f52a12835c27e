"""Recorded requests of real agent clients, kept as test data (tests/data/client_requests/): what
try_clients.py --record saved (retired; `git show 77ef6db:scripts/try_clients.py`), and test_client_requests.py replays against the server
so that a field a client version sends is never refused without a test failing.

A recording keeps every field and every block of the request as the client sent it; only long text
(system prompts, tool descriptions, file contents) is cut, so the files stay small and the prompts
fit a test model's context. Text under `arguments` (JSON a client parses) is never cut.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

DATA = next(p for p in Path(__file__).resolve().parents if p.name == "tests") / "data" / "client_requests"
MAX_TEXT = 300  # characters kept of a long string
DEVICE_ID = re.compile(r'(\\?"device_id\\?":\s*\\?")[0-9a-f]+')  # Claude Code's per-machine id, in metadata


def shrink(value: Any, key: str = "") -> Any:
    """`value` with every string longer than MAX_TEXT cut to it (not under `arguments`)."""
    if isinstance(value, dict):
        return {k: shrink(v, k) for k, v in value.items()}
    if isinstance(value, list):
        return [shrink(v, key) for v in value]
    if isinstance(value, str):
        value = DEVICE_ID.sub(lambda m: m.group(1) + "0" * 16, value)
        if len(value) > MAX_TEXT and key != "arguments":
            return value[:MAX_TEXT] + " [cut]"
    return value


def recording(client: str, version: str, requests: list[tuple[str, str, bytes]], how: str = "") -> dict[str, Any]:
    """A client version's recording: its (method, path, body) requests, bodies shrunk. `how`: a
    second recording of the same version run another way (e.g. "interactive"), saved beside it."""
    items = []
    for method, path, body in requests:
        item: dict[str, Any] = {"method": method, "path": path}
        if body:
            item["body"] = shrink(json.loads(body))
        items.append(item)
    return {"client": client, "version": version, "how": how, "requests": items}


def save(rec: dict[str, Any], folder: Path = DATA) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{rec['client']}-{rec['version']}{'-' + rec['how'] if rec.get('how') else ''}.json"
    path.write_text(json.dumps(rec, indent=1, ensure_ascii=False) + "\n")
    return path


def load_all(folder: Path = DATA) -> list[dict[str, Any]]:
    return [json.loads(p.read_text()) for p in sorted(folder.glob("*.json"))]
