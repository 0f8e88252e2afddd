"""Decode the image values found in dataset rows into RGB PIL images, and encode them back.

Dataset rows carry images in several forms, depending on how the dataset was written:

- a Hugging Face ``datasets`` Image struct ``{"bytes": ..., "path": ...}`` (what
  ``pyarrow`` / ``pandas`` return for an ``Image`` column, e.g. the bundled geo3k sample);
- a file path (absolute, or relative to the dataset's folder);
- an ``http(s)://`` URL;
- a base64 string, or a ``data:`` URI such as ``data:image/png;base64,...``.  The
  ``chenhegu/geo3k_imgurl`` dataset used by the upstream recipe writes the malformed prefix
  ``data:image/None;base64,``; the media type of a data URI is therefore ignored and the
  format is read from the image bytes themselves;
- raw encoded bytes, or an already decoded ``PIL.Image.Image``.

Whatever the input, :func:`decode_image` returns a fully loaded ``mode == "RGB"`` image, so
the processor always sees 3 channels of 8 bits.  The conversion rules are in
:func:`to_rgb`.  Every failure raises :class:`ImageDecodeError` naming the dataset row and
field and what was wrong.
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

DEFAULT_URL_TIMEOUT_S = 30.0
"""Seconds to wait for an image URL (connect and each read) before giving up."""

# Modes that carry an alpha channel (straight or premultiplied); flattened onto white.
_ALPHA_MODES = {"RGBA", "RGBa", "LA", "La", "PA"}
# 16-bit single-channel modes; "I" is how older Pillow versions opened 16-bit PNGs.
_WIDE_MODES = {"I;16", "I;16L", "I;16B", "I;16N", "I"}
# Modes that Pillow converts to RGB exactly (no range question).
_PLAIN_MODES = {"1", "L", "P", "CMYK", "YCbCr", "LAB", "HSV"}


class ImageDecodeError(ValueError):
    """An image value in a dataset row cannot be turned into an RGB image.

    The message names the row and field (when the caller gave them) and what was wrong.
    """


def decode_image(
    value: Any,
    *,
    base_dir: str | None = None,
    row: int | str | None = None,
    field: str | None = None,
    timeout_s: float = DEFAULT_URL_TIMEOUT_S,
) -> Image.Image:
    """Turn one image value from a dataset row into a loaded RGB ``PIL.Image.Image``.

    Args:
        value: one of
            - ``dict`` with keys ``bytes`` and/or ``path`` (a Hugging Face Image struct):
              non-empty ``bytes`` are used; otherwise ``path`` is read as a string below;
            - ``str``: a ``data:`` URI (``data:<anything>;base64,<payload>``; the media
              type, including the malformed ``image/None``, is ignored), an ``http://`` /
              ``https://`` URL, an existing file path, or else a bare base64 string;
            - ``bytes`` / ``bytearray``: an encoded image file (PNG, JPEG, ...);
            - ``PIL.Image.Image``.
        base_dir: folder against which relative file paths are resolved (the dataset
            file's folder); ``None`` means the current directory.
        row: the dataset row, for error messages (e.g. ``"12 (id 2406)"``).
        field: the column / item, for error messages (e.g. ``"images[0]"``).
        timeout_s: URL timeout, seconds.

    Returns:
        The image in mode ``"RGB"`` (uint8, H x W x 3), pixels loaded, EXIF orientation
        applied (``PIL.ImageOps.exif_transpose``, as image viewers display it).  Alpha
        is flattened onto white; see :func:`to_rgb`.

    Raises:
        ImageDecodeError: unsupported type, missing file, unreachable URL, invalid base64,
            bytes that are not an image, or an image mode with no defined RGB conversion.
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
    """Convert a PIL image of any common mode to mode ``"RGB"`` (8 bits per channel).

    Rules:
        - ``RGB``: returned as is.
        - alpha modes (``RGBA``, ``LA``, ``PA``, premultiplied ``RGBa`` / ``La``) and ``P``
          images with a transparent palette entry: alpha-composited onto an opaque white
          background (``out = a * c + (1 - a) * 255`` per channel, Pillow's
          ``Image.alpha_composite``).  White, because geometry diagrams are dark lines
          on a transparent or white page; dropping alpha instead would expose whatever
          colour the transparent pixels store (often black) and hide the lines.
        - 16-bit grey (``I;16*``, and ``I`` which older Pillow uses for 16-bit PNGs):
          scaled to 8 bits as ``round(v / 257)`` (maps 0..65535 onto 0..255 exactly at
          the ends), clipped to 0..65535 first; then grey -> RGB.
        - ``1``, ``L``, ``P`` (opaque), ``CMYK``, ``YCbCr``, ``LAB``, ``HSV``: Pillow's
          ``Image.convert("RGB")``.

    Args:
        image: the input image (loaded or lazy).
        where: context for error messages.

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
    """Encode ``image`` as a PNG file and return it base64-encoded (ASCII, standard alphabet).

    The result is the bare base64 text, with **no** ``data:image/png;base64,`` prefix (the
    form SGLang's ``image_data`` accepts).  PNG is lossless, so
    ``decode_image(encode_image_base64(img))`` has the same pixels as an RGB ``img``.
    Uses zlib level 1: these strings are made once per prompt and sent over the network,
    where encoding time matters more than a few percent of size.

    Args:
        image: any PIL image PNG can store (the data pipeline passes resized RGB images).
    """
    buffer = io.BytesIO()
    image.save(buffer, format="PNG", compress_level=1)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def _decode_string(text: str, *, base_dir: str | None, where: str, timeout_s: float) -> Image.Image:
    """Dispatch a string value: data URI, URL, existing file, or bare base64."""
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
    """Strict base64 decode (whitespace, e.g. line breaks, is allowed and removed)."""
    compact = "".join(payload.split())
    try:
        data = base64.b64decode(compact, validate=True)
    except (binascii.Error, ValueError) as e:
        raise ImageDecodeError(f"{where}: invalid base64 ({e}) in {_short(payload)}") from None
    if not data:
        raise ImageDecodeError(f"{where}: the base64 payload is empty")
    return data


def _fetch(url: str, *, where: str, timeout_s: float) -> bytes:
    """GET ``url`` with urllib; every network failure becomes an ImageDecodeError."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            return response.read()
    except urllib.error.HTTPError as e:
        raise ImageDecodeError(f"{where}: GET {url} failed with HTTP {e.code} {e.reason}") from None
    except (urllib.error.URLError, TimeoutError, OSError) as e:
        reason = getattr(e, "reason", e)
        raise ImageDecodeError(f"{where}: GET {url} failed ({reason}; timeout {timeout_s} s)") from None


def _open_bytes(data: bytes, *, where: str, source: str) -> Image.Image:
    """Open and fully decode encoded image bytes, then convert to RGB."""
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
