"""A request's images, resolved and preprocessed by deepseek-recipe for the V4.1 encoder.

Local files (a path, or a `file://` URL, where a request gives an image URL) are read by the job and
inlined as data URLs before the recipe converts the request: the recipe takes URLs and data only.

Offline jobs must not reach arbitrary hosts: a source that is a remote URL is refused unless remote
fetching was asked for, and then the fetcher connects only to public addresses (never to private,
loopback, link-local, multicast or reserved ones, whatever the host name resolves to, redirects
included: the recipe's fetcher asks `destination_allowed` for every address it would connect to).
"""

from __future__ import annotations

import base64
import ipaddress
import os
import re
from typing import Any, Sequence

import deepseek_recipe as dr


class ImageRefused(ValueError):
    """A source the job will not fetch (a remote URL without `allow_remote`)."""


class LocalImageError(ValueError):
    """A local image file that cannot be inlined: missing, unreadable, not a file, or too large."""


_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*:")
# Leading bytes of the formats the recipe decodes; the data URL's media type is taken from them.
_MAGIC = ((b"\x89PNG\r\n\x1a\n", "image/png"), (b"\xff\xd8\xff", "image/jpeg"), (b"GIF87a", "image/gif"),
          (b"GIF89a", "image/gif"))


def local_path(url: str) -> str | None:
    """The file an image URL names (a `file://` URL, or a string with no URL scheme), else None."""
    if url.startswith("file://"):
        return url[len("file://"):]
    return None if _SCHEME.match(url) else url


def _media_type(data: bytes) -> str:
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "image/webp"
    return next((mt for magic, mt in _MAGIC if data.startswith(magic)), "application/octet-stream")


def _read(path: str, root: str, max_bytes: int) -> tuple[str, str]:
    """(media type, base64 body) of the image file `path` (relative paths from `root`)."""
    full = os.path.join(root, os.path.expanduser(path))
    try:
        with open(full, "rb") as f:
            data = f.read(max_bytes + 1)
    except OSError as e:
        raise LocalImageError(f"cannot read the image file {full!r}: {e.strerror or e}") from None
    if len(data) > max_bytes:
        raise LocalImageError(f"the image file {full!r} is over the {max_bytes}-byte limit of one image")
    return _media_type(data), base64.b64encode(data).decode("ascii")


def inline_local_images(body: Any, root: str, max_bytes: int = 20 << 20) -> Any:
    """`body` with every local image file inlined (chat `image_url`, responses `input_image`, messages
    `image` URL sources), relative paths read from `root`. `body` is left as it was: the parts on the
    way to an inlined image are new, the rest is shared, and a body without local images is returned
    itself. Raises LocalImageError for a file that cannot be read."""

    def data_url(path: str) -> str:
        mt, data = _read(path, root, max_bytes)
        return f"data:{mt};base64,{data}"

    def visit(node):
        if isinstance(node, list):
            items = [visit(item) for item in node]
            return node if all(a is b for a, b in zip(items, node)) else items
        if not isinstance(node, dict):
            return node
        changed = {}
        url = node.get("image_url")
        if isinstance(url, dict) and isinstance(url.get("url"), str) and local_path(url["url"]) is not None:
            changed["image_url"] = {**url, "url": data_url(local_path(url["url"]))}
        elif isinstance(url, str) and local_path(url) is not None:
            changed["image_url"] = data_url(local_path(url))
        source = node.get("source")
        if (node.get("type") == "image" and isinstance(source, dict) and source.get("type") == "url"
                and isinstance(source.get("url"), str) and local_path(source["url"]) is not None):
            mt, data = _read(local_path(source["url"]), root, max_bytes)
            changed["source"] = {"type": "base64", "media_type": mt, "data": data}
        for key, value in node.items():
            if key not in ("image_url", "source"):
                new = visit(value)
                if new is not value:
                    changed[key] = new
        return {**node, **changed} if changed else node

    return visit(body)


def destination_allowed(host: str, address: str) -> bool:
    """Whether the fetcher may connect to `address` (resolved from `host`): public unicast only."""
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return False
    if ip.version == 6 and ip.ipv4_mapped is not None:  # ::ffff:127.0.0.1 is 127.0.0.1
        ip = ip.ipv4_mapped
    return ip.is_global and not (ip.is_private or ip.is_loopback or ip.is_link_local or ip.is_multicast
                                 or ip.is_reserved or ip.is_unspecified)


class ImageResolver:
    """Resolves the image sources of one request into preprocessed images (`dr.MultiModalData`).

    `allow_remote` enables remote URLs, through the recipe's fetcher with `destination_allowed` as its
    filter; `max_bytes` bounds one fetched image."""

    def __init__(self, allow_remote: bool = False, max_bytes: int = 20 << 20):
        self.allow_remote, self.max_bytes = allow_remote, max_bytes
        fetcher = dr.ReqwestImageFetcher.with_max_bytes(max_bytes)
        if allow_remote:
            fetcher = fetcher.with_destination_filter(destination_allowed)
        self._resolver = dr.ImageResolver(fetcher, dr.OpenCvImagePreprocessor())

    def resolve(self, sources: Sequence[dr.ImageSource]) -> dr.MultiModalData:
        """The request's images in placeholder order. Raises ImageRefused for a remote URL when remote
        fetching is off (before anything is fetched), and the recipe's `ImageError` for an image it
        cannot fetch, decode or fit, or past its quota."""
        remote = [s.path or s.url for s in sources if s.kind == "url"]
        if remote and not self.allow_remote:
            raise ImageRefused(f"remote image URLs are refused (at {', '.join(remote)}): offline jobs fetch "
                               "nothing unless started with --allow-remote-images")
        return self._resolver.resolve(list(sources), dr.ImageQuota())
