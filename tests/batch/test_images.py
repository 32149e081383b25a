"""A request's images: data URLs resolve offline; remote URLs are refused without the flag, and with it
the fetcher never connects to private, loopback or link-local addresses."""

import base64
import io
import json
import os
import re
import struct
import threading
import time
import zlib

import deepseek_recipe as dr
import pytest
from PIL import Image

from dsjax.batch.images import (RECIPE_MAX_SIDE_PX, ImageRefused, ImageResolver, ImageTooLarge, LocalImageError,
                                destination_allowed, image_error_message, inline_local_images)


@pytest.mark.parametrize("address,allowed", [
    ("8.8.8.8", True), ("2606:4700:4700::1111", True),
    ("127.0.0.1", False), ("::1", False), ("10.1.2.3", False), ("172.16.0.9", False), ("192.168.1.1", False),
    ("169.254.169.254", False), ("fe80::1", False), ("::ffff:127.0.0.1", False), ("::ffff:10.0.0.1", False),
    ("0.0.0.0", False), ("::", False), ("224.0.0.1", False), ("100.64.0.1", False), ("fc00::1", False),
    ("240.0.0.1", False), ("not an address", False),
])
def test_destination_filter(address, allowed):
    assert destination_allowed("example.com", address) is allowed


def _data_url(w=60, h=40) -> str:
    out = io.BytesIO()
    Image.new("RGB", (w, h), (10, 200, 30)).save(out, "PNG")
    return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()


def test_remote_urls_are_refused_without_the_flag(listener):
    port, hits = listener
    with pytest.raises(ImageRefused, match="remote image URLs are refused .*--allow-remote-images"):
        ImageResolver().resolve([dr.DataUrlImageSource(_data_url()),
                                 dr.UrlImageSource(f"http://127.0.0.1:{port}/a.png", path="messages.0.content[1]")])
    assert hits == []


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "[::ffff:127.0.0.1]"])
def test_with_the_flag_private_destinations_are_never_connected(listener, host):
    port, hits = listener
    with pytest.raises(dr.ImageError) as e:
        ImageResolver(allow_remote=True).resolve([dr.UrlImageSource(f"http://{host}:{port}/a.png")])
    assert e.value.kind == "DestinationRejected"
    assert hits == []


@pytest.mark.parametrize("allow_remote", [False, True])
def test_data_urls_resolve_offline(allow_remote):
    images = ImageResolver(allow_remote).resolve([dr.DataUrlImageSource(_data_url(546, 546), "high")])
    (image,) = images.images
    assert (image.width, image.height, images.image_token_adjustment() + 1) == (546, 546, 184)


def test_an_undecodable_image_is_the_recipes_error():
    with pytest.raises(dr.ImageError):
        ImageResolver().resolve([dr.BytesImageSource(b"not an image")])


def test_local_files_are_inlined_as_data_urls_with_their_sniffed_type(tmp_path):
    from dsjax.batch.images import LocalImageError, inline_local_images, local_path

    assert [local_path(u) for u in ("a.png", "/x/b.png", "file:///x/c.png", "http://h/d.png", "data:image/png;,")] \
        == ["a.png", "/x/b.png", "/x/c.png", None, None]
    png = base64.b64decode(_data_url().split(",", 1)[1])
    (tmp_path / "pic.jpg").write_bytes(png)  # a PNG whatever its name says
    body = {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "pic.jpg"}},
                                                      {"type": "text", "text": "pic.jpg"}]}]}
    out = inline_local_images(body, str(tmp_path))
    assert out["messages"][0]["content"][0]["image_url"]["url"] == "data:image/png;base64," + base64.b64encode(
        png).decode()
    assert out["messages"][0]["content"][1] == {"type": "text", "text": "pic.jpg"}
    assert body["messages"][0]["content"][0]["image_url"]["url"] == "pic.jpg"  # the caller's body is untouched
    assert out["messages"][0]["content"][1] is body["messages"][0]["content"][1]  # what holds no image is shared
    text_only = {"messages": [{"role": "user", "content": "pic.jpg"}], "max_tokens": 3}
    assert inline_local_images(text_only, str(tmp_path)) is text_only
    source = {"type": "image", "source": {"type": "url", "url": f"file://{tmp_path}/pic.jpg"}}
    out = inline_local_images({"messages": [{"role": "user", "content": [source]}]}, str(tmp_path))
    assert out["messages"][0]["content"][0] == {"type": "image", "source": {
        "type": "base64", "media_type": "image/png", "data": base64.b64encode(png).decode()}}
    assert source["source"]["type"] == "url"
    with pytest.raises(LocalImageError, match="over the 10-byte limit"):
        inline_local_images(body, str(tmp_path), max_bytes=10)
    with pytest.raises(LocalImageError, match="cannot read the image file .*missing.png"):
        inline_local_images({"input": [{"type": "input_image", "image_url": "missing.png"}]}, str(tmp_path))


def _chat(url: str) -> dict:
    return {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}]}


def _inlined(body: dict) -> str:
    return body["messages"][0]["content"][0]["image_url"]["url"]


def _refusal(url: str, root, **kw) -> str:
    """The LocalImageError message for inlining `url` from `root`, checked to be writable as UTF-8."""
    with pytest.raises(LocalImageError) as e:
        inline_local_images(_chat(url), str(root), **kw)
    message = str(e.value)
    message.encode("utf-8")  # no lone surrogate: the error record holding it can be written
    return message


def test_local_images_are_read_only_from_inside_the_root(tmp_path, monkeypatch):
    png = base64.b64decode(_data_url().split(",", 1)[1])
    root, outside = tmp_path / "root", tmp_path / "outside"
    (root / "sub").mkdir(parents=True)
    outside.mkdir()
    (root / "sub" / "pic.png").write_bytes(png)
    (outside / "secret.png").write_bytes(png)
    (root / "out.png").symlink_to(outside / "secret.png")
    (root / "outdir").symlink_to(outside)
    (root / "in.png").symlink_to(root / "sub" / "pic.png")
    (root / "insub").symlink_to("sub")
    want = "data:image/png;base64," + base64.b64encode(png).decode()
    for url in ("sub/pic.png", "./sub/../sub/pic.png", "in.png", "insub/pic.png", f"{root}/sub/pic.png",
                f"file://{root}/in.png"):
        assert _inlined(inline_local_images(_chat(url), str(root))) == want, url
    # root given as a relative path, or through a symlink
    (tmp_path / "rootlink").symlink_to(root)
    assert _inlined(inline_local_images(_chat(f"{root}/sub/pic.png"), str(tmp_path / "rootlink"))) == want
    monkeypatch.chdir(tmp_path)
    assert _inlined(inline_local_images(_chat("sub/pic.png"), "root")) == want

    for url in (f"{outside}/secret.png", "../outside/secret.png", "sub/../../outside/secret.png", "out.png",
                "outdir/secret.png", "/etc/passwd", "file:///etc/passwd", f"file://{outside}/secret.png",
                "../x.png", "..", "/"):
        message = _refusal(url, root)
        assert message == (f"the image path {url.removeprefix('file://')!r} is outside the folder images are read "
                           f"from ({str(root)!r}): local images are read only from the input file's folder or the "
                           "--image-root the job was given"), url
    # the same message whether or not the file outside exists: nothing is opened to tell
    assert _refusal("/etc/passwd", root).replace("/etc/passwd", "X") \
        == _refusal("/etc/no-such-file-here", root).replace("/etc/no-such-file-here", "X")
    assert _refusal("../outside/secret.png", root).replace("secret", "X") \
        == _refusal("../outside/missing.png", root).replace("missing", "X")
    # `~` is an ordinary name: a folder called "~" inside the root, never the home folder
    assert "No such file" in _refusal("~/pic.png", root)
    (root / "~").mkdir()
    (root / "~" / "pic.png").write_bytes(png)
    assert _inlined(inline_local_images(_chat("~/pic.png"), str(root))) == want


def _never_blocks(fn, limit_s=5.0):
    """fn()'s exception, failing (not hanging) the test when fn takes over `limit_s`."""
    box = []

    def run():
        try:
            fn()
        except BaseException as e:  # noqa: BLE001 -- handed back to the test
            box.append(e)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(limit_s)
    assert not thread.is_alive(), "reading the image blocked"
    assert box, "no error was raised"
    return box[0]


def test_fifos_directories_and_devices_are_refused_without_blocking(tmp_path):
    os.mkfifo(tmp_path / "pipe.png")  # nothing ever writes to it: a blocking open would wait forever
    (tmp_path / "link.png").symlink_to("pipe.png")
    (tmp_path / "dir.png").mkdir()
    start = time.monotonic()
    for url, kind in (("pipe.png", "a FIFO"), ("link.png", "a FIFO"), ("dir.png", "a directory"),
                      (".", "a directory")):
        e = _never_blocks(lambda: inline_local_images(_chat(url), str(tmp_path)))
        assert isinstance(e, LocalImageError), e
        assert str(e) == f"the image path {url!r} is {kind}, not a regular file: an image must be a file"
    assert time.monotonic() - start < 1
    # a character device that never ends
    e = _never_blocks(lambda: inline_local_images(_chat("zero"), "/dev"))
    assert isinstance(e, LocalImageError) and "'zero' is a character device, not a regular file" in str(e)


def test_reading_has_a_time_limit(tmp_path):
    data = b"\x89PNG\r\n\x1a\n" + bytes(92)
    (tmp_path / "pic.png").write_bytes(data)
    assert "took over 0 s, the time limit of one image" in _refusal("pic.png", tmp_path, read_timeout=0)
    assert _inlined(inline_local_images(_chat("pic.png"), str(tmp_path), read_timeout=5)).endswith(
        base64.b64encode(data).decode())


def test_a_file_over_the_size_limit_is_too_large(tmp_path):
    (tmp_path / "big.png").write_bytes(base64.b64decode(_data_url().split(",", 1)[1]) + bytes(1000))
    assert "'big.png' is too large: " in _refusal("big.png", tmp_path, max_bytes=1000)
    assert "over the 1000-byte limit of one image" in _refusal("big.png", tmp_path, max_bytes=1000)
    (tmp_path / "exact.png").write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(992))
    assert inline_local_images(_chat("exact.png"), str(tmp_path), max_bytes=1000)


@pytest.mark.parametrize("raw,shown", [
    ("a\\u0000b.png", "holds a NUL byte"),
    ("\\ud800.png", "holds a lone surrogate"),  # as json.loads gives it from "\\ud800.png"
    ("x/\\udc80.png", "holds a lone surrogate"),
])
def test_unrepresentable_paths_are_local_image_errors(tmp_path, raw, shown):
    body = json.loads(json.dumps(_chat("URL")).replace("URL", raw))
    with pytest.raises(LocalImageError, match=shown) as e:
        inline_local_images(body, str(tmp_path))
    message = str(e.value)
    assert repr(_inlined(body)) in message  # the path as given, escaped
    json.dumps({"error": {"message": message}}, ensure_ascii=False).encode("utf-8")


def test_messages_about_odd_roots_and_names_are_encodable(tmp_path):
    png = base64.b64decode(_data_url().split(",", 1)[1])
    odd = tmp_path / os.fsdecode(b"r\xff")  # a folder name that is not UTF-8: a surrogate in Python
    odd.mkdir()
    (odd / "pic.png").write_bytes(png)
    assert inline_local_images(_chat("pic.png"), str(odd))
    for url in ("missing.png", "/etc/passwd", "../x.png"):
        assert "\\udcff" in _refusal(url, odd)  # shown escaped, never raw


def _png_header(w: int, h: int) -> bytes:
    """A PNG claiming w x h pixels, with (almost) no pixel data."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(b"\0" * 100)) + chunk(b"IEND", b""))


def test_inline_images_over_the_byte_limit_are_too_large():
    png = base64.b64decode(_data_url().split(",", 1)[1])
    big = png + bytes(5000)
    # The recipe's own check (32 MiB) lets these through: the fetcher's limit bounds fetched images only.
    ImageResolver(max_bytes=1 << 30).resolve([dr.DataUrlImageSource("data:image/png;base64," + base64.b64encode(
        big).decode())])
    for source in (dr.DataUrlImageSource("data:image/png;base64," + base64.b64encode(big).decode()),
                   dr.DataUrlImageSource("data:image/png," + "".join(f"%{b:02X}" for b in big)),
                   dr.BytesImageSource(big)):
        with pytest.raises(ImageTooLarge) as e:
            ImageResolver(max_bytes=len(png)).resolve([dr.DataUrlImageSource(_data_url()), source])
        assert str(e.value) == (f"image[1]: the image is {len(big)} bytes, over the {len(png)}-byte limit of "
                                "one image")
        assert isinstance(e.value, dr.ImageError) and isinstance(e.value, ValueError)  # the caller's handlers
        assert (e.value.kind, e.value.is_retryable) == ("ImageTooLarge", False)
    with pytest.raises(ImageTooLarge, match=r"^messages\.0\.content\[1\]: the image is"):
        ImageResolver(max_bytes=10).resolve([dr.BytesImageSource(png, path="messages.0.content[1]")])
    # at the limit is fine, whatever the padding
    for n in range(len(png), len(png) + 3):
        data = png + bytes(n - len(png))
        ImageResolver(max_bytes=n).resolve([dr.DataUrlImageSource("data:image/png;base64," + base64.b64encode(
            data).decode())])


@pytest.mark.parametrize("w,h", [(20000, 20000), (RECIPE_MAX_SIDE_PX + 1, 1), (1, 100000)])
def test_an_image_too_large_in_pixels_says_so(w, h):
    with pytest.raises(ImageTooLarge) as e:
        ImageResolver().resolve([dr.DataUrlImageSource(_data_url()), dr.BytesImageSource(_png_header(w, h))])
    assert str(e.value) == ("image[1]: the image is too large in pixels: deepseek-recipe decodes images of at "
                            f"most {RECIPE_MAX_SIDE_PX} pixels a side")
    assert "unsupported" not in str(e.value)


def test_the_recipes_limit_on_pixels_is_the_one_named():
    """RECIPE_MAX_SIDE_PX is measured: a side of that many pixels decodes, one more does not (and the
    recipe's own message calls it unsupported, which image_error_message replaces)."""
    out = io.BytesIO()
    Image.new("L", (RECIPE_MAX_SIDE_PX, 1)).save(out, "PNG")
    ImageResolver().resolve([dr.BytesImageSource(out.getvalue())])
    with pytest.raises(dr.ImageError) as e:
        dr.ImageResolver(dr.ReqwestImageFetcher(), dr.OpenCvImagePreprocessor()).resolve(
            [dr.BytesImageSource(_png_header(RECIPE_MAX_SIDE_PX + 1, 1))], dr.ImageQuota())
    assert e.value.kind == "ImageDimensionsTooLarge" and "unsupported image" in str(e.value)
    assert image_error_message(e.value) == ("image[0]: the image is too large in pixels: deepseek-recipe decodes "
                                            f"images of at most {RECIPE_MAX_SIDE_PX} pixels a side")


def test_file_urls_and_names_are_read_as_a_user_means_them(tmp_path):
    from dsjax.batch.images import LocalImageError, inline_local_images, local_path

    assert local_path("file://localhost/x/a%20b.png") == "/x/a b.png"
    assert local_path("FILE:///x/c.png") == "/x/c.png" and local_path("a:b.png") == "a:b.png"
    with pytest.raises(LocalImageError, match="on host 'elsewhere'"):
        local_path("file://elsewhere/x.png")
    png = base64.b64decode(_data_url().split(",", 1)[1])
    (tmp_path / "a b.png").write_bytes(png)
    (tmp_path / "empty.png").write_bytes(b"")
    (tmp_path / "notes.png").write_text("just text")

    def part(url):
        return {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}]}

    out = inline_local_images(part(f"file://{tmp_path}/a%20b.png".replace(" ", "%20")), str(tmp_path))
    assert out["messages"][0]["content"][0]["image_url"]["url"].startswith("data:image/png;base64,")
    for url, says in (("", "the image path is empty"), ("empty.png", "not a PNG, JPEG, GIF or WebP image (0 bytes, empty)"),
                      ("notes.png", "'notes.png' is not a PNG, JPEG, GIF or WebP image")):
        with pytest.raises(LocalImageError, match=re.escape(says)):
            inline_local_images(part(url), str(tmp_path))
