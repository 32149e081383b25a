"""A request's images, resolved and preprocessed by deepseek-recipe for the V4.1 encoder.

Offline jobs must not reach arbitrary hosts: a source that is a remote URL is refused unless remote
fetching was asked for, and then the fetcher connects only to public addresses (never to private,
loopback, link-local, multicast or reserved ones, whatever the host name resolves to, redirects
included: the recipe's fetcher asks `destination_allowed` for every address it would connect to).
"""

from __future__ import annotations

import ipaddress
from typing import Sequence

import deepseek_recipe as dr


class ImageRefused(ValueError):
    """A source the job will not fetch (a remote URL without `allow_remote`)."""


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
        self.allow_remote = allow_remote
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
