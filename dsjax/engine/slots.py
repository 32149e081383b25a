"""The cache's slots: rows of a cache taken and put back (inside a prefill step), and the row counts a
prefill runs with (few, so that few programs are compiled)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from dsjax.cache import Cache
from dsjax.parallel.rules import slot_axes


def take_slots(cache: Cache, slots: jax.Array) -> Cache:
    """The rows `slots` of every cache array (slot axis 0 for lengths, 1 under the repeat axis)."""
    return Cache(lengths=cache.lengths[slots],
                 groups=jax.tree.map(lambda x: jnp.take(x, slots, axis=1), cache.groups),
                 history=None if cache.history is None else cache.history[slots])


def put_slots(cache: Cache, part: Cache, slots: jax.Array) -> Cache:
    """`cache` with rows `slots` replaced by `part` (slots must be distinct)."""
    return Cache(lengths=cache.lengths.at[slots].set(part.lengths),
                 groups=jax.tree.map(lambda x, y: x.at[:, slots].set(y), cache.groups, part.groups),
                 history=None if cache.history is None else cache.history.at[slots].set(part.history))


def prefill_rows(n: int, num_slots: int) -> int:
    """Rows of a prefill of `n` new requests: a power of two (few compiled shapes), rounded up to whole
    shares of the mesh axes that split the cache's slots. Fewer rows than devices could not be split, and
    attention and the indexer would then take their references, not their kernels
    (`kernels.dispatch.over_slots`)."""
    size = 1
    while size < n:
        size *= 2
    mesh = jax.sharding.get_abstract_mesh()
    axes = slot_axes(mesh, num_slots)
    share = math.prod(mesh.shape[a] for a in axes) if axes else 1
    return min(-(-size // share) * share, num_slots)


def prefill_buckets(num_slots: int, requests: int | None = None) -> list[int]:
    """Every row count `prefill_rows` gives for 1 … `num_slots` new requests (at most `requests`, the
    number a run will see, if known: no prefill takes more)."""
    most = num_slots if requests is None else max(1, min(requests, num_slots))
    return sorted({prefill_rows(n, num_slots) for n in range(1, most + 1)})
