"""Qwen2-VL images through the HTTP APIs (a tiny Qwen2-VL, loaded as `mlx-kvserve run --model DIR`
loads it): an OpenAI image_url part, an Anthropic image block and a Responses input_image part of
the same image and question are the same prompt, so the second and third hit the first's blocks
past the image (M-RoPE positions restored: the same reply); a typed image token is a 400."""

from __future__ import annotations

import base64
import io
import sys
from pathlib import Path

import pytest
from starlette.testclient import TestClient
from test_hardening_wire import make_engine
from test_vision_server import QUESTION, data_url

from mlx_kvserve.config import ApiKeys
from mlx_kvserve.models.loader import load_model
from mlx_kvserve.server.app import create_app

pytest.importorskip("mlx_vlm", reason="images need mlx-vlm (pyproject extra 'vision')")
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
from harness import tiny_vlm  # noqa: E402


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen-server")
    folder = tiny_vlm.build(root / "model", "qwen2_vl", image_size=112)
    loaded = load_model(str(folder), root / "models", "float32")
    assert loaded.vision is not None and loaded.vision.name == "qwen2_vl"
    with TestClient(create_app(make_engine(loaded, root), ApiKeys("", ""))) as client:
        yield client


def test_openai_then_anthropic_then_responses_hit_the_same_image(client):
    url = data_url(11, size=(80, 112))
    content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": QUESTION}]
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": 6, "temperature": 0}
    first = client.post("/v1/chat/completions", json=body)
    assert first.status_code == 200, first.text
    reply, usage = first.json()["choices"][0]["message"]["content"], first.json()["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] == 0

    media, data = url.removeprefix("data:").split(";base64,")
    blocks = [{"type": "image", "source": {"type": "base64", "media_type": media, "data": data}}]
    body = {"model": "default", "max_tokens": 6, "temperature": 0}
    body["messages"] = [{"role": "user", "content": [*blocks, {"type": "text", "text": QUESTION}]}]
    r = client.post("/v1/messages", json=body)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["cache_read_input_tokens"] >= usage["prompt_tokens"] - 8
    assert "".join(b.get("text", "") for b in r.json()["content"]) == reply

    parts = [{"type": "input_image", "image_url": url}, {"type": "input_text", "text": QUESTION}]
    body = {"input": [{"role": "user", "content": parts}], "max_output_tokens": 6, "temperature": 0}
    r = client.post("/v1/responses", json=body)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["input_tokens_details"]["cached_tokens"] >= usage["prompt_tokens"] - 8
    texts = [p["text"] for item in r.json()["output"] for p in item.get("content", []) if p["type"] == "output_text"]
    assert "".join(texts) == reply

    health = client.get("/health").json()["vision"]
    assert health["family"] == "qwen2_vl" and health["image_encodes"] == 1


def test_a_typed_image_token_is_a_400(client):
    content = [{"type": "image_url", "image_url": {"url": data_url(12)}}, {"type": "text", "text": "<|image_pad|>"}]
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": 2}
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 400 and "image" in r.json()["error"]["message"]


def plain_png(size: tuple[int, int]) -> str:
    """A one-colour PNG of (height, width): small however large (noise would pass max_body_bytes)."""
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", size[::-1], (200, 30, 30)).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


@pytest.mark.parametrize("size", [(5000, 1), (1, 5000), (100, 100_000)])  # (height, width)
def test_an_extreme_aspect_ratio_is_a_400_naming_the_bound(client, size):
    content = [{"type": "image_url", "image_url": {"url": plain_png(size)}}, {"type": "text", "text": "hi"}]
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": 2}
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    assert "content[0]: the image is" in message and "aspect ratio" in message and "200:1" in message
