"""Decode the image values found in dataset rows into RGB PIL images, and encode them back.

Accepted values: a Hugging Face Image struct ``{"bytes", "path"}``, a file path (relative to the
dataset's folder), an ``http(s)://`` URL, a base64 string or ``data:`` URI (its media type ignored:
``chenhegu/geo3k_imgurl`` writes ``data:image/None;base64,``), raw encoded bytes, a PIL image.
:func:`decode_image` returns a loaded ``"RGB"`` image (rules: :func:`to_rgb`); every failure raises
:class:`ImageDecodeError` naming the row, field and what was wrong.
"""

from __future__ import annotations

import base64
import binascii
import io
import os
import urllib.error
import urllib.request
from typing import Any

import numpy as np
from PIL import Image, ImageOps

from slime.errors import SlimeError

DEFAULT_URL_TIMEOUT_S = 30.0
"""Seconds to wait for an image URL (connect and each read) before giving up."""

# Modes that carry an alpha channel (straight or premultiplied); flattened onto white.
_ALPHA_MODES = {"RGBA", "RGBa", "LA", "La", "PA"}
# 16-bit single-channel modes; "I" is how older Pillow versions opened 16-bit PNGs.
_WIDE_MODES = {"I;16", "I;16L", "I;16B", "I;16N", "I"}
# Modes that Pillow converts to RGB exactly (no range question).
_PLAIN_MODES = {"1", "L", "P", "CMYK", "YCbCr", "LAB", "HSV"}


class ImageDecodeError(SlimeError, ValueError):
    """An image value in a dataset row cannot be turned into an RGB image (the message names the row and field)."""


def decode_image(
    value: Any,
    *,
    base_dir: str | None = None,
    row: int | str | None = None,
    field: str | None = None,
    timeout_s: float = DEFAULT_URL_TIMEOUT_S,
) -> Image.Image:
    """One image value of a dataset row as a loaded ``"RGB"`` PIL image (uint8 H x W x 3), EXIF orientation applied.

    A struct's non-empty ``bytes`` win over its ``path``; a string is a ``data:`` URI, a URL, an existing
    file (relative to ``base_dir``) or else bare base64.  ``row`` and ``field`` name the value in errors;
    ``timeout_s``: URL timeout, seconds.

    Raises:
        ImageDecodeError: unsupported type, missing file, unreachable URL, invalid base64, bytes that
            are not an image, or a mode with no RGB conversion.
    """
    where = _where(row, field)
    if isinstance(value, Image.Image):
        return to_rgb(ImageOps.exif_transpose(value), where=where)
    if isinstance(value, (bytes, bytearray)):
        return _open_bytes(bytes(value), where=where, source="raw bytes")
    if isinstance(value, dict):
        data, path = value.get("bytes"), value.get("path")
        if data:
            return _open_bytes(bytes(data), where=where, source="the struct's bytes")
        if path:
            return _decode_string(path, base_dir=base_dir, where=where, timeout_s=timeout_s)
        raise ImageDecodeError(
            f"{where}: the image struct has neither bytes nor a path ({_short(value)}); "
            "fix the dataset row or drop it"
        )
    if isinstance(value, str):
        return _decode_string(value, base_dir=base_dir, where=where, timeout_s=timeout_s)
    raise ImageDecodeError(
        f"{where}: unsupported image value of type {type(value).__name__} ({_short(value)}); expected an "
        "Image struct {bytes, path}, a file path, an http(s) URL, a base64 string / data URI, bytes or a PIL image"
    )


def to_rgb(image: Image.Image, *, where: str = "image") -> Image.Image:
    """A PIL image of any common mode as ``"RGB"``, 8 bits per channel.

    Alpha modes (and ``P`` with a transparent entry) are composited onto white (geometry diagrams are
    dark lines on a transparent page; dropping alpha would expose the stored colour, often black);
    16-bit grey is ``round(v / 257)``; ``1``, ``L``, ``P``, ``CMYK``, ``YCbCr``, ``LAB``, ``HSV`` go through
    ``Image.convert("RGB")``.

    Raises:
        ImageDecodeError: a mode with no defined conversion (e.g. 32-bit float ``F``).
    """
    mode = image.mode
    if mode == "RGB":
        return image
    if mode == "P" and "transparency" in image.info:
        image, mode = image.convert("RGBA"), "RGBA"
    if mode in _ALPHA_MODES:
        rgba = image.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    if mode in _WIDE_MODES:
        wide = np.asarray(image, dtype=np.float64).clip(0, 65535)
        grey = np.round(wide / 257.0).astype(np.uint8)
        return Image.fromarray(grey, mode="L").convert("RGB")
    if mode in _PLAIN_MODES:
        return image.convert("RGB")
    raise ImageDecodeError(
        f"{where}: image mode {mode!r} has no defined RGB conversion; re-save the image as 8-bit RGB/RGBA/grey"
    )


def encode_image_base64(image: Image.Image) -> str:
    """``image`` as a PNG (lossless, zlib level 1), base64 text without a ``data:`` prefix (SGLang's ``image_data``)."""
    buffer = io.BytesIO()
    image.save(buffer, format="PNG", compress_level=1)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def _decode_string(text: str, *, base_dir: str | None, where: str, timeout_s: float) -> Image.Image:
    if text.startswith("data:"):
        header, comma, payload = text.partition(",")
        if not comma or not header.endswith(";base64"):
            raise ImageDecodeError(
                f"{where}: data URI {header[:60]!r}... is not base64-encoded (expected 'data:<type>;base64,<payload>')"
            )
        return _open_bytes(_b64decode(payload, where=where), where=where, source=f"data URI ({header})")
    if text.startswith(("http://", "https://")):
        return _open_bytes(_fetch(text, where=where, timeout_s=timeout_s), where=where, source=f"URL {text}")
    path = text if os.path.isabs(text) or base_dir is None else os.path.join(base_dir, text)
    if os.path.isfile(path):
        with open(path, "rb") as f:
            return _open_bytes(f.read(), where=where, source=f"file {path}")
    try:
        data = _b64decode(text, where=where)
    except ImageDecodeError:
        raise ImageDecodeError(
            f"{where}: {_short(text)} is neither an existing file (looked for {path!r}), an http(s) URL, "
            "a data URI nor valid base64; fix the path (relative paths resolve against the dataset's folder)"
        ) from None
    return _open_bytes(data, where=where, source="base64 string")


def _b64decode(payload: str, *, where: str) -> bytes:
    """Strict base64 decode; whitespace is removed first."""
    compact = "".join(payload.split())
    try:
        data = base64.b64decode(compact, validate=True)
    except (binascii.Error, ValueError) as e:
        raise ImageDecodeError(f"{where}: invalid base64 ({e}) in {_short(payload)}") from None
    if not data:
        raise ImageDecodeError(f"{where}: the base64 payload is empty")
    return data


def _fetch(url: str, *, where: str, timeout_s: float) -> bytes:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            return response.read()
    except urllib.error.HTTPError as e:
        raise ImageDecodeError(f"{where}: GET {url} failed with HTTP {e.code} {e.reason}") from None
    except (urllib.error.URLError, TimeoutError, OSError) as e:
        reason = getattr(e, "reason", e)
        raise ImageDecodeError(f"{where}: GET {url} failed ({reason}; timeout {timeout_s} s)") from None


def _open_bytes(data: bytes, *, where: str, source: str) -> Image.Image:
    try:
        image = Image.open(io.BytesIO(data))
        image.load()
    except (Image.UnidentifiedImageError, Image.DecompressionBombError, OSError, SyntaxError, ValueError) as e:
        raise ImageDecodeError(
            f"{where}: {source} ({len(data)} bytes, starting {data[:8]!r}) is not a readable image: {e}"
        ) from None
    return to_rgb(ImageOps.exif_transpose(image), where=where)


def _where(row: int | str | None, field: str | None) -> str:
    parts = []
    if row is not None:
        parts.append(f"row {row}")
    if field is not None:
        parts.append(f"field {field!r}")
    return ", ".join(parts) or "image"


def _short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + f"... ({len(text)} chars)"
