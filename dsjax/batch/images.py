"""A request's images, resolved and preprocessed by deepseek-recipe for the V4.1 encoder.

Local files (a path, or a `file://` URL, where a request gives an image URL) are read by the job and
inlined as data URLs before the recipe converts the request: the recipe takes URLs and data only.
Requests are untrusted input, so a local image is read only from inside one folder (the input file's,
or the job's --image-root; symlinks are followed, and must end inside it too), only when it is a
regular file, and within a size and a time limit: a FIFO or a device never blocks the job.

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
import stat
import time
import urllib.parse
from typing import Any, Sequence

import deepseek_recipe as dr


class ImageRefused(ValueError):
    """A source the job will not fetch (a remote URL without `allow_remote`)."""


class LocalImageError(ValueError):
    """A local image file that cannot be inlined: a bad path, outside the image folder, missing,
    unreadable, not a regular file, too large, or too slow to read."""


class ImageTooLarge(dr.ImageError, ValueError):
    """An image over a size limit: its bytes over the job's limit of one image, or its pixels over what
    the recipe decodes. A `dr.ImageError` (kind "ImageTooLarge", not retryable), so that a caller
    that handles the recipe's image errors handles it too."""

    def __init__(self, message: str):
        super().__init__(message)
        self.kind, self.is_retryable = "ImageTooLarge", False


READ_TIMEOUT_S = 30.0  # the longest one local image file may take to read
# The longest side the recipe decodes (measured on deepseek-recipe 0.2.0; it says only that such an
# image is "unsupported"); named in the message that replaces the recipe's.
RECIPE_MAX_SIDE_PX = 8192
_CHUNK = 1 << 20
_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*:")
# Leading bytes of the formats the recipe decodes; the data URL's media type is taken from them.
_MAGIC = ((b"\x89PNG\r\n\x1a\n", "image/png"), (b"\xff\xd8\xff", "image/jpeg"), (b"GIF87a", "image/gif"),
          (b"GIF89a", "image/gif"))


def local_path(url: str) -> str | None:
    """The file an image URL names (a `file:` URL, percent-decoded, on no host or `localhost`; or a
    string with no URL scheme), else None."""
    if url[:5].lower() == "file:":
        parts = urllib.parse.urlsplit(url)
        if parts.netloc not in ("", "localhost"):
            raise LocalImageError(f"the image URL {url[:200]!r} names a file on host {parts.netloc!r}: only "
                                  "this machine's files can be read")
        return urllib.parse.unquote(parts.path)
    # A one-letter "scheme" is no URL's: `a:b.png` is a file name.
    m = _SCHEME.match(url)
    return url if m is None or len(m.group(0)) <= 2 else None


def _media_type(data: bytes) -> str:
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "image/webp"
    return next((mt for magic, mt in _MAGIC if data.startswith(magic)), "application/octet-stream")


def _file_kind(mode: int) -> str:
    kinds = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
             (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))
    return next((name for test, name in kinds if test(mode)), "not a regular file")


def _confined(path: str, root: str) -> str:
    """The real path of the image file `path` (relative paths from `root`), which must lie inside the
    real path of `root`. Decided from the path alone, before anything is opened, so that the message
    is the same whether or not a file outside exists."""
    if not path:
        raise LocalImageError("the image path is empty: give a file name, a data URL or an http(s) URL")
    if "\0" in path:
        raise LocalImageError(f"the image path {path!r} holds a NUL byte: no file has such a name")
    try:
        path.encode("utf-8")
    except UnicodeEncodeError:
        # json.loads lets a lone surrogate through ("\\ud800"); repr() keeps it out of the message.
        raise LocalImageError(f"the image path {path!r} is not valid Unicode text (it holds a lone "
                              "surrogate): no file has such a name") from None
    real_root = os.path.realpath(root)
    real = os.path.realpath(os.path.join(real_root, path))  # `~` is a name like any other
    if os.path.commonpath([real_root, real]) != real_root:
        raise LocalImageError(f"the image path {path!r} is outside the folder images are read from "
                              f"({real_root!r}): local images are read only from the input file's folder "
                              "or the --image-root the job was given")
    return real


def _unreadable(path: str, real: str, e: OSError) -> LocalImageError:
    # strerror, not str(e): that repeats the file name unescaped
    return LocalImageError(f"cannot read the image file {path!r} ({real!r}): {e.strerror or type(e).__name__}")


def _read(path: str, root: str, max_bytes: int, read_timeout: float) -> tuple[str, str]:
    """(media type, base64 body) of the image file `path` (relative paths from `root`, inside it)."""
    real = _confined(path, root)
    try:
        # Non-blocking, so that opening a FIFO returns at once (fstat then refuses it); no symlink
        # may replace the last component after realpath resolved it.
        fd = os.open(real, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        raise _unreadable(path, real, e) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise LocalImageError(f"the image path {path!r} is {_file_kind(st.st_mode)}, not a regular "
                                  "file: an image must be a file")
        if st.st_size > max_bytes:
            raise LocalImageError(f"the image file {path!r} is too large: {st.st_size} bytes, over the "
                                  f"{max_bytes}-byte limit of one image")
        # Read to the end, not to st_size: a file that grows is caught by the size limit; one that
        # reads slowly (a network or FUSE mount) by the time limit, checked between chunks.
        deadline, chunks, size = time.monotonic() + read_timeout, [], 0
        while chunk := os.read(fd, min(_CHUNK, max_bytes + 1 - size)):
            chunks.append(chunk)
            size += len(chunk)
            if size > max_bytes:
                raise LocalImageError(f"the image file {path!r} is too large: over the {max_bytes}-byte "
                                      "limit of one image")
            if time.monotonic() >= deadline:
                raise LocalImageError(f"reading the image file {path!r} took over {read_timeout:g} s, the "
                                      "time limit of one image")
    except OSError as e:
        raise _unreadable(path, real, e) from None
    finally:
        os.close(fd)
    data = b"".join(chunks)
    media = _media_type(data)
    if media == "application/octet-stream":
        raise LocalImageError(f"the image file {path!r} is not a PNG, JPEG, GIF or WebP image "
                              f"({len(data)} bytes{', empty' if not data else ''})")
    return media, base64.b64encode(data).decode("ascii")


def inline_local_images(body: Any, root: str, max_bytes: int = 20 << 20, *,
                        read_timeout: float = READ_TIMEOUT_S) -> Any:
    """`body` with every local image file inlined (chat `image_url`, responses `input_image`, messages
    `image` URL sources), relative paths read from `root`, and only files inside it (real paths, after
    symlinks), each of at most `max_bytes` and read within `read_timeout` seconds. `body` is left as it
    was: the parts on the way to an inlined image are new, the rest is shared, and a body without local
    images is returned itself. Raises LocalImageError for a path or file that cannot be read."""

    def data_url(path: str) -> str:
        mt, data = _read(path, root, max_bytes, read_timeout)
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
            mt, data = _read(local_path(source["url"]), root, max_bytes, read_timeout)
            changed["source"] = {"type": "base64", "media_type": mt, "data": data}
        for key, value in node.items():
            if key not in ("image_url", "source"):
                new = visit(value)
                if new is not value:
                    changed[key] = new
        return {**node, **changed} if changed else node

    return visit(body)


_IMAGE_PARTS = ("image_url", "input_image", "image")  # chat, responses, messages


def count_images(body: Any) -> int:
    """How many image parts `body` holds, in any of the three protocols (tool results included).

    For V4's format the recipe writes "[Unsupported Image]" in place of an image and keeps no source,
    so the parts are counted in the body itself."""
    if isinstance(body, list):
        return sum(count_images(x) for x in body)
    if not isinstance(body, dict):
        return 0
    # Tool declarations hold JSON schemas, whose "type" keys are no content parts.
    return (body.get("type") in _IMAGE_PARTS) + sum(count_images(v) for k, v in body.items() if k != "tools")


def _inline_bytes(source: dr.ImageSource) -> int:
    """The size of an inline image (a data URL's decoded body, from its length: nothing is decoded);
    0 for a URL."""
    if source.kind == "bytes":
        return len(source.data)
    if source.kind != "data_url":
        return 0
    head, _, body = source.data_url.partition(",")
    if head.lower().endswith(";base64"):
        body = body.rstrip("= \t\r\n")
        return (len(body) - sum(body.count(c) for c in " \t\r\n")) * 3 // 4
    return len(body.encode("utf-8", "surrogatepass")) - 2 * body.count("%")


def image_error_message(e: dr.ImageError) -> str:
    """The recipe's message for `e`, made truthful where it is not: the recipe calls an image too large
    in pixels "unsupported"."""
    if e.kind == "ImageDimensionsTooLarge":
        where = str(e).split(": ", 1)[0]
        return (f"{where}: the image is too large in pixels: deepseek-recipe decodes images of at most "
                f"{RECIPE_MAX_SIDE_PX} pixels a side")
    return str(e)


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
    filter; `max_bytes` bounds one image, fetched or inline."""

    def __init__(self, allow_remote: bool = False, max_bytes: int = 20 << 20):
        self.allow_remote, self.max_bytes = allow_remote, max_bytes
        fetcher = dr.ReqwestImageFetcher.with_max_bytes(max_bytes)
        if allow_remote:
            fetcher = fetcher.with_destination_filter(destination_allowed)
        self._resolver = dr.ImageResolver(fetcher, dr.OpenCvImagePreprocessor())

    def resolve(self, sources: Sequence[dr.ImageSource]) -> dr.MultiModalData:
        """The request's images in placeholder order. Raises ImageRefused for a remote URL when remote
        fetching is off (before anything is fetched), ImageTooLarge for an image over `max_bytes`
        (before anything is decoded) or over the pixels the recipe decodes, and the recipe's
        `ImageError` for an image it cannot fetch, decode or fit, or past its quota."""
        remote = [s.path or s.url for s in sources if s.kind == "url"]
        if remote and not self.allow_remote:
            at = ", ".join(remote).encode("utf-8", "backslashreplace").decode("utf-8")  # no lone surrogates
            raise ImageRefused(f"remote image URLs are refused (at {at}): offline jobs fetch "
                               "nothing unless started with --allow-remote-images")
        # The fetcher's limit bounds fetched images only: the recipe takes inline ones up to its own
        # 32 MiB.
        for i, s in enumerate(sources):
            size = _inline_bytes(s)
            if size > self.max_bytes:
                raise ImageTooLarge(f"{s.path or f'image[{i}]'}: the image is {size} bytes, over the "
                                    f"{self.max_bytes}-byte limit of one image")
        try:
            return self._resolver.resolve(list(sources), dr.ImageQuota())
        except dr.ImageError as e:
            if e.kind == "ImageDimensionsTooLarge":
                raise ImageTooLarge(image_error_message(e)) from None
            raise
