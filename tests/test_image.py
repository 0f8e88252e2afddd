"""slime.data.image: every accepted image form, the RGB conversion rules, and each error."""

from __future__ import annotations

import base64
import functools
import http.server
import io
import os
import socket
import threading

import numpy as np
import pyarrow.parquet as pq
import pytest
from PIL import Image

from slime.data.image import ImageDecodeError, decode_image, encode_image_base64

SAMPLE = os.path.join(os.path.dirname(__file__), "..", "examples", "geo3k_vlm", "data", "train.parquet")


@pytest.fixture(scope="module")
def geo3k_struct() -> dict:
    """The first image struct {bytes, path} of the bundled sample, as pyarrow returns it."""
    return pq.read_table(SAMPLE, columns=["images"]).column("images")[0].as_py()[0]


def _png_bytes(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def _reference_rgb(png: bytes) -> np.ndarray:
    """float64 reference: straight-alpha composite of the PNG's RGBA pixels onto white."""
    rgba = np.asarray(Image.open(io.BytesIO(png)).convert("RGBA"), dtype=np.float64)
    alpha = rgba[..., 3:] / 255.0
    return alpha * rgba[..., :3] + (1.0 - alpha) * 255.0


def _colourful_rgb() -> Image.Image:
    rng = np.random.default_rng(0)
    return Image.fromarray(rng.integers(0, 256, size=(9, 13, 3), dtype=np.uint8), mode="RGB")


# ---------------------------------------------------------------- accepted forms


def test_hf_struct_bytes_match_reference(geo3k_struct):
    assert geo3k_struct["bytes"]  # the sample ships real bytes
    image = decode_image(geo3k_struct)
    assert image.mode == "RGB"
    reference = _reference_rgb(geo3k_struct["bytes"])
    assert image.size == (reference.shape[1], reference.shape[0])
    np.testing.assert_allclose(np.asarray(image, dtype=np.float64), reference, atol=1.0)


def test_hf_struct_path_used_when_bytes_empty(tmp_path):
    original = _colourful_rgb()
    (tmp_path / "imgs").mkdir()
    original.save(tmp_path / "imgs" / "a.png")
    image = decode_image({"bytes": None, "path": "imgs/a.png"}, base_dir=str(tmp_path))
    assert np.array_equal(np.asarray(image), np.asarray(original))
    image = decode_image({"bytes": b"", "path": str(tmp_path / "imgs" / "a.png")})
    assert np.array_equal(np.asarray(image), np.asarray(original))


def test_file_path_absolute_and_relative(tmp_path):
    original = _colourful_rgb()
    original.save(tmp_path / "b.png")
    assert np.array_equal(np.asarray(decode_image(str(tmp_path / "b.png"))), np.asarray(original))
    assert np.array_equal(np.asarray(decode_image("b.png", base_dir=str(tmp_path))), np.asarray(original))


def test_raw_bytes():
    original = _colourful_rgb()
    assert np.array_equal(np.asarray(decode_image(_png_bytes(original))), np.asarray(original))


@pytest.mark.parametrize(
    "prefix",
    ["", "data:image/png;base64,", "data:image/None;base64,", "data:;base64,"],
    ids=["bare", "data-uri", "geo3k-imgurl-None-prefix", "no-media-type"],
)
def test_base64_and_data_uris(prefix):
    original = _colourful_rgb()
    text = prefix + base64.b64encode(_png_bytes(original)).decode("ascii")
    assert np.array_equal(np.asarray(decode_image(text)), np.asarray(original))


def test_base64_with_line_breaks():
    original = _colourful_rgb()
    encoded = base64.encodebytes(_png_bytes(original)).decode("ascii")  # 76-char lines
    assert "\n" in encoded
    assert np.array_equal(np.asarray(decode_image(encoded)), np.asarray(original))


def test_pil_image_input_not_modified():
    original = _colourful_rgb().convert("RGBA")
    image = decode_image(original)
    assert image.mode == "RGB" and original.mode == "RGBA"
    assert np.array_equal(np.asarray(image), np.asarray(original)[..., :3])  # opaque alpha


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


@pytest.fixture()
def http_root(tmp_path):
    """A local http.server thread serving tmp_path; yields (base_url, folder)."""
    handler = functools.partial(_QuietHandler, directory=str(tmp_path))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", tmp_path
    server.shutdown()
    server.server_close()


def test_http_url(http_root):
    base_url, folder = http_root
    original = _colourful_rgb()
    original.save(folder / "c.png")
    image = decode_image(f"{base_url}/c.png")
    assert np.array_equal(np.asarray(image), np.asarray(original))
    # an HF struct whose path is a URL
    image = decode_image({"bytes": None, "path": f"{base_url}/c.png"})
    assert np.array_equal(np.asarray(image), np.asarray(original))


def test_http_404_names_url_and_row(http_root):
    base_url, _ = http_root
    with pytest.raises(ImageDecodeError, match=r"row 7, field 'images\[0\]'.*missing\.png.*HTTP 404"):
        decode_image(f"{base_url}/missing.png", row=7, field="images[0]")


def test_http_timeout():
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)  # accepts the connection but never answers
    try:
        url = f"http://127.0.0.1:{listener.getsockname()[1]}/slow.png"
        with pytest.raises(ImageDecodeError, match=r"slow\.png.*timeout 0\.3 s"):
            decode_image(url, timeout_s=0.3)
    finally:
        listener.close()


# ---------------------------------------------------------------- RGB conversion


def test_rgba_half_transparent_composited_on_white():
    image = Image.new("RGBA", (2, 1))
    image.putpixel((0, 0), (255, 0, 0, 128))  # half-transparent red
    image.putpixel((1, 0), (0, 0, 0, 0))  # fully transparent black
    out = np.asarray(decode_image(image), dtype=np.int64)
    # by hand: a = 128/255; r = 255; g = b = (1 - a) * 255 = 127
    assert out[0, 0].tolist() == [255, 127, 127]
    assert out[0, 1].tolist() == [255, 255, 255]


def test_la_composited_on_white():
    image = Image.new("LA", (1, 1), (0, 51))  # black at alpha 0.2
    out = np.asarray(decode_image(_png_bytes(image)), dtype=np.int64)
    assert out[0, 0].tolist() == [204] * 3  # 0.2 * 0 + 0.8 * 255


def test_palette_with_transparency():
    image = Image.new("P", (2, 1))
    image.putpalette([0, 0, 255] + [10, 20, 30] + [0, 0, 0] * 254)
    image.putpixel((0, 0), 0)
    image.putpixel((1, 0), 1)
    image.info["transparency"] = 0  # palette entry 0 is transparent
    out = np.asarray(decode_image(_png_bytes(image)), dtype=np.int64)
    assert out[0, 0].tolist() == [255, 255, 255]
    assert out[0, 1].tolist() == [10, 20, 30]


def test_palette_opaque():
    image = Image.new("P", (1, 1))
    image.putpalette([200, 100, 50] + [0, 0, 0] * 255)
    out = np.asarray(decode_image(_png_bytes(image)), dtype=np.int64)
    assert out[0, 0].tolist() == [200, 100, 50]


def test_grey_and_bilevel():
    grey = Image.fromarray(np.array([[0, 77, 255]], dtype=np.uint8), mode="L")
    assert np.asarray(decode_image(_png_bytes(grey)))[0].tolist() == [[0] * 3, [77] * 3, [255] * 3]
    bilevel = Image.new("1", (2, 1))
    bilevel.putpixel((1, 0), 1)
    assert np.asarray(decode_image(_png_bytes(bilevel)))[0].tolist() == [[0] * 3, [255] * 3]


def test_cmyk():
    image = Image.new("CMYK", (1, 1), (0, 255, 255, 0))  # pure red in naive CMYK
    assert np.asarray(decode_image(image))[0, 0].tolist() == [255, 0, 0]


def test_sixteen_bit_grey_png():
    values = np.array([[0, 257 * 100, 65535, 300]], dtype=np.uint16)
    png = _png_bytes(Image.fromarray(values))
    assert Image.open(io.BytesIO(png)).mode.startswith("I")  # really a 16-bit PNG
    out = np.asarray(decode_image(png), dtype=np.int64)
    # round(v / 257): 0, 100, 255, round(1.167) = 1
    assert out[0, :, 0].tolist() == [0, 100, 255, 1]
    assert (out[..., 0] == out[..., 2]).all()


def test_float_mode_rejected():
    image = Image.new("F", (1, 1), 0.5)
    with pytest.raises(ImageDecodeError, match=r"row 3.*mode 'F'.*re-save"):
        decode_image(image, row=3)


# ---------------------------------------------------------------- errors


def test_struct_without_bytes_or_path():
    with pytest.raises(ImageDecodeError, match=r"row 5 \(id 99\), field 'images\[1\]'.*neither bytes nor a path"):
        decode_image({"bytes": None, "path": None}, row="5 (id 99)", field="images[1]")


def test_missing_file_names_resolved_path(tmp_path):
    with pytest.raises(ImageDecodeError, match=r"row 2.*looked for .*nope\.png"):
        decode_image("nope.png", base_dir=str(tmp_path), row=2)


def test_not_an_image():
    with pytest.raises(ImageDecodeError, match=r"field 'img'.*raw bytes \(11 bytes.*not a readable image"):
        decode_image(b"hello world", field="img")


def test_truncated_png(geo3k_struct):
    cut = geo3k_struct["bytes"][: len(geo3k_struct["bytes"]) // 2]
    with pytest.raises(ImageDecodeError, match="not a readable image"):
        decode_image({"bytes": cut, "path": None}, row=0)


def test_data_uri_errors():
    with pytest.raises(ImageDecodeError, match="not base64-encoded"):
        decode_image("data:image/png,rawdata")
    with pytest.raises(ImageDecodeError, match="invalid base64"):
        decode_image("data:image/None;base64,@@@")
    with pytest.raises(ImageDecodeError, match="base64 payload is empty"):
        decode_image("data:image/None;base64,")


def test_garbage_string():
    with pytest.raises(ImageDecodeError, match="neither an existing file.*nor valid base64"):
        decode_image("not/an/image?.png")


def test_unsupported_type():
    with pytest.raises(ImageDecodeError, match="unsupported image value of type int"):
        decode_image(42, row=1, field="images[0]")


# ---------------------------------------------------------------- encoding


def test_encode_image_base64_is_bare_png_and_round_trips():
    original = _colourful_rgb()
    text = encode_image_base64(original)
    assert not text.startswith("data:")
    raw = base64.b64decode(text, validate=True)
    assert raw[:8] == b"\x89PNG\r\n\x1a\n"
    assert np.array_equal(np.asarray(Image.open(io.BytesIO(raw))), np.asarray(original))
    assert np.array_equal(np.asarray(decode_image(text)), np.asarray(original))
