"""Client images: decoded from data URLs (or fetched, when allowed), bounded, and given a digest.

Runs on HTTP worker threads (no MLX). Every error names the request part it came from: a bad image
is an InvalidRequestError (400), one over a size limit a PayloadTooLargeError (413).
"""

from __future__ import annotations

import base64
import binascii
import io
import logging
from dataclasses import dataclass

from ..errors import InvalidRequestError, PayloadTooLargeError
from .fetch import FetchError, FetchPolicy, fetch

DATA_PREFIX = "data:"
# One answer whatever went wrong, so that a client cannot use image URLs to learn what answers where
# (the reason is logged for the operator).
FETCH_FAILED = (
    "the image URL could not be fetched: refused (this server fetches from public addresses only), "
    "unreachable, not a 200 answer, or past [vision] fetch_timeout_s or max_image_bytes; "
    "send the image as a data URL (data:image/png;base64,...)"
)
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ImageLimits:
    max_images: int = 16  # per request
    max_bytes: int = 20 * 1024 * 1024  # encoded size of one image
    max_pixels: int = 40_000_000  # width x height of one image, checked before it is decoded
    fetch_urls: bool = False  # http(s) URLs are fetched only when on ([server] fetch_image_urls)
    fetch_timeout_s: float = 10.0  # the whole fetch, redirects included
    fetch_private: bool = False  # LAN and loopback addresses fetched too ([server] fetch_private_urls)


@dataclass(frozen=True)
class ImageRef:
    """One image part of a request, not decoded yet: its URL (a data URL or http(s)) and where it
    was (the part named in errors, e.g. "messages[1].content[0]")."""

    url: str
    where: str


def image_bytes(ref: ImageRef, limits: ImageLimits) -> bytes:
    """The encoded image behind `ref`: a base64 data URL decoded, or an http(s) URL fetched when
    `limits.fetch_urls` (at most max_bytes, within fetch_timeout_s in all, from allowed addresses only:
    vision/fetch.py)."""
    url = ref.url
    if url.startswith(DATA_PREFIX):
        header, sep, payload = url.partition(",")
        if not sep or not header.endswith(";base64"):
            raise InvalidRequestError(f"{ref.where}: the image data URL must be base64 (data:<type>;base64,...)")
        if len(payload) * 3 // 4 > limits.max_bytes:
            raise PayloadTooLargeError(f"{ref.where}: the image is over {limits.max_bytes} bytes")
        try:
            return base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            raise InvalidRequestError(f"{ref.where}: the image data is not valid base64") from None
    if url.startswith(("http://", "https://")):
        if not limits.fetch_urls:
            raise InvalidRequestError(
                f"{ref.where}: image URLs are not fetched by this server ([server] fetch_image_urls is off); "
                "send the image as a data URL (data:image/png;base64,...)"
            )
        return _fetch(ref, limits)
    raise InvalidRequestError(f"{ref.where}: the image URL must be a data URL or http(s)")


def _fetch(ref: ImageRef, limits: ImageLimits) -> bytes:
    policy = FetchPolicy(limits.fetch_timeout_s, limits.max_bytes, limits.fetch_private)
    try:
        return fetch(ref.url, policy)
    except FetchError as exc:
        log.info("%s: image URL not fetched: %s", ref.where, exc.reason)
        raise InvalidRequestError(f"{ref.where}: {FETCH_FAILED}", code="image_fetch_failed") from None


def decode_image(ref: ImageRef, limits: ImageLimits):  # -> PIL.Image.Image (RGB)
    """The image behind `ref` decoded to RGB. Its pixel count is checked from the header, before
    the pixels are decoded (a small file can hold a huge image)."""
    from PIL import Image, UnidentifiedImageError

    data = image_bytes(ref, limits)
    try:
        with Image.open(io.BytesIO(data)) as img:
            width, height = img.size
            if width * height > limits.max_pixels:
                raise PayloadTooLargeError(
                    f"{ref.where}: the image is {width}x{height} pixels, over the limit of {limits.max_pixels}"
                )
            return img.convert("RGB")
    except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as exc:
        raise InvalidRequestError(f"{ref.where}: the image could not be decoded: {exc}") from None


def check_count(refs: list[ImageRef], limits: ImageLimits) -> None:
    if len(refs) > limits.max_images:
        raise InvalidRequestError(f"the request holds {len(refs)} images, over the limit of {limits.max_images}")
