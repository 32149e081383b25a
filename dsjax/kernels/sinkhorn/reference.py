"""The pure-JAX reference of mHC's Sinkhorn normalisation (and the fallback on backends without a
kernel): column-normalise each `[n, n]` matrix, then `iters − 1` rounds of row and column
normalisation, each `c / (Σ c + eps)`, so the result ends column-normalised."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


def normalise(c: jax.Array, axis: int, eps: float) -> jax.Array:
    """`c / (Σ_axis c + eps)`: one half-round (shared with the kernel, so both compute alike)."""
    return c / (jnp.sum(c, axis=axis, keepdims=True) + eps)


def rounds(c: jax.Array, iters: int, eps: float, unroll: bool = False) -> jax.Array:
    """The whole normalisation of `c [..., n, n]`, as a loop of `iters − 1` rounds after the first
    column normalisation (`unroll`: as straight-line code)."""
    one_round = lambda _, x: normalise(normalise(x, -1, eps), -2, eps)  # noqa: E731
    return jax.lax.fori_loop(0, max(iters - 1, 0), one_round, normalise(c, -2, eps), unroll=unroll)


def sinkhorn_reference(comb: jax.Array, iters: int, eps: float) -> jax.Array:
    """`rounds(comb)`: a device loop on CPUs; unrolled elsewhere (TPUs, and GPUs when the kernel cannot
    run), so that the rounds fuse into one kernel rather than a loop of small ones. On a CPU the
    unrolled form only makes every compile slower (+40%). On a GPU it makes XLA's priority fusion
    slow (the demo's decode step compiled in 62 s, 58 of them in that pass): the kernel avoids both."""
    rolled = functools.partial(rounds, iters=iters, eps=eps)
    return jax.lax.platform_dependent(comb, cpu=rolled, default=functools.partial(rolled, unroll=True))
