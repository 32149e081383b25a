"""A request's images: data URLs resolve offline; remote URLs are refused without the flag, and with it
the fetcher never connects to private, loopback or link-local addresses."""

import base64
import io

import deepseek_recipe as dr
import pytest
from PIL import Image

from dsjax.batch.images import ImageRefused, ImageResolver, destination_allowed


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
    out = inline_local_images({"messages": [{"role": "user", "content": [source]}]}, "/elsewhere")
    assert out["messages"][0]["content"][0] == {"type": "image", "source": {
        "type": "base64", "media_type": "image/png", "data": base64.b64encode(png).decode()}}
    assert source["source"]["type"] == "url"
    with pytest.raises(LocalImageError, match="over the 10-byte limit"):
        inline_local_images(body, str(tmp_path), max_bytes=10)
    with pytest.raises(LocalImageError, match="cannot read the image file .*missing.png"):
        inline_local_images({"input": [{"type": "input_image", "image_url": "missing.png"}]}, str(tmp_path))
