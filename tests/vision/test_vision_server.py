"""Images through the HTTP APIs on a tiny Gemma 3 (scripts/features.py tiny-vlm), loaded the way
`mlx-kvserve run --model DIR` loads it: OpenAI image_url parts, Anthropic image blocks and Responses
input_image parts reach the same cached prompt; bad images are 4xx naming their part; /health counts
image encodes and encoder-cache hits."""

from __future__ import annotations

import base64
import io
import sys
from pathlib import Path

import numpy as np
import pytest
from starlette.testclient import TestClient
from test_hardening_wire import make_engine

from mlx_kvserve.config import ApiKeys
from mlx_kvserve.models.loader import load_model
from mlx_kvserve.server.app import create_app

pytest.importorskip("mlx_vlm", reason="images need mlx-vlm (pyproject extra 'vision')")
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
from harness import tiny_vlm  # noqa: E402

QUESTION = "What colour is the picture, and what is in it? Answer in one short sentence."


def data_url(seed: int, size: tuple[int, int] = (40, 64), fmt: str = "PNG") -> str:
    from PIL import Image

    rng = np.random.default_rng(seed)
    pixels = np.clip(rng.integers(0, 256, 3) + rng.normal(0, 20, (*size, 3)), 0, 255).astype("uint8")
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format=fmt)
    return f"data:image/{fmt.lower()};base64,{base64.b64encode(buf.getvalue()).decode()}"


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    root = tmp_path_factory.mktemp("vision-server")
    folder = tiny_vlm.build(root / "model", "gemma3")
    loaded = load_model(str(folder), root / "models", "float32")
    assert loaded.vision is not None
    engine = make_engine(loaded, root)
    with TestClient(create_app(engine, ApiKeys("", ""))) as client:
        yield client


def openai_chat(client, url: str, question: str = QUESTION):
    content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": question}]
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": 6, "temperature": 0}
    return client.post("/v1/chat/completions", json=body)


def test_openai_anthropic_and_responses_share_the_cached_image(client):
    url = data_url(1)
    first = openai_chat(client, url)
    assert first.status_code == 200, first.text
    usage = first.json()["usage"]
    assert usage["prompt_tokens"] > 16 and usage["prompt_tokens_details"]["cached_tokens"] == 0
    again = openai_chat(client, url).json()
    assert again["choices"][0]["message"]["content"] == first.json()["choices"][0]["message"]["content"]
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= usage["prompt_tokens"] - 8

    media, data = url.removeprefix("data:").split(";base64,")
    blocks = [{"type": "image", "source": {"type": "base64", "media_type": media, "data": data}}]
    body = {
        "model": "default",
        "max_tokens": 6,
        "temperature": 0,
        "messages": [{"role": "user", "content": [*blocks, {"type": "text", "text": QUESTION}]}],
    }
    r = client.post("/v1/messages", json=body)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["cache_read_input_tokens"] >= usage["prompt_tokens"] - 8  # the same prompt

    parts = [{"type": "input_image", "image_url": url}, {"type": "input_text", "text": QUESTION}]
    body = {"input": [{"role": "user", "content": parts}], "max_output_tokens": 6, "temperature": 0}
    r = client.post("/v1/responses", json=body)
    assert r.status_code == 200, r.text

    health = client.get("/health").json()["vision"]
    assert health["family"] == "gemma3" and health["image_encodes"] == 1


def test_another_image_is_encoded_and_misses_from_its_block(client):
    before = client.get("/health").json()["vision"]["image_encodes"]
    r = openai_chat(client, data_url(2))
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] < 16  # at most the template's opening
    assert client.get("/health").json()["vision"]["image_encodes"] == before + 1


@pytest.mark.parametrize(
    ("url", "status", "words"),
    [
        ("https://example.com/a.png", 400, "fetch_image_urls"),
        ("data:image/png;base64,@@@", 400, "base64"),
        ("data:image/png;base64," + base64.b64encode(b"not an image").decode(), 400, "decoded"),
        ("ftp://example.com/a.png", 400, "data URL"),
    ],
)
def test_bad_images_are_4xx_naming_the_part(client, url, status, words):
    r = openai_chat(client, url)
    assert r.status_code == status, r.text
    message = r.json()["error"]["message"]
    assert "messages[0].content[0]" in message and words in message


def test_limits(client):
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (8000, 6000)).save(buf, format="PNG")  # 48 Mpixels in a small file
    r = openai_chat(client, "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode())
    assert r.status_code == 413 and "pixels" in r.json()["error"]["message"]
    content = [{"type": "image_url", "image_url": {"url": data_url(4)}}] * 17
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": 2}
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 400 and "17 images" in r.json()["error"]["message"]
    typed = openai_chat(client, data_url(1), question="I typed <start_of_image> myself")
    assert typed.status_code == 400
