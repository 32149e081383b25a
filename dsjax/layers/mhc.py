"""Manifold-constrained hyper-connections: N residual streams, mixed by Sinkhorn-normalised weights."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from dsjax.config import ModelConfig
from dsjax.layers.norms import unweighted_rms_norm
from dsjax.layers.numerics import einsum


def sinkhorn(comb: jax.Array, iters: int, eps: float) -> jax.Array:
    """Column-normalise, then `iters−1` rounds of row+column normalisation (ends column-normalised)."""
    def normalise(c, axis):
        return c / (jnp.sum(c, axis=axis, keepdims=True) + eps)

    comb = normalise(comb, -2)
    rounds = functools.partial(jax.lax.fori_loop, 0, max(iters - 1, 0), lambda _, c: normalise(normalise(c, -1), -2))
    # On accelerators the rounds are unrolled so that they fuse into one kernel instead of a device loop
    # of small kernels per round (about 600 launches per decode step at 4 layers on an H200); on CPUs,
    # where a loop costs nothing, the unrolled form only makes every compile slower (+40%).
    return jax.lax.platform_dependent(comb, cpu=rounds, default=functools.partial(rounds, unroll=True))


def collapse(pre_bsn: jax.Array, h_bsnh: jax.Array) -> jax.Array:
    """`Σ_n pre[n]·h[n]` in fp32, cast to the streams' dtype."""
    return einsum("bsn,bsnh->bsh", pre_bsn, h_bsnh.astype(jnp.float32)).astype(h_bsnh.dtype)


class HyperConnection(nnx.Module):
    """Computes (post, comb, collapsed) from the streams `h [B,S,N,H]` for one block (attention or FFN)."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        n = cfg.hc_mult
        self.cfg = cfg
        self.fn = nnx.Param(0.02 * jax.random.normal(rngs.params(), ((2 + n) * n, n * cfg.hidden_size)))
        self.base = nnx.Param(jnp.zeros(((2 + n) * n,), jnp.float32))
        self.scale = nnx.Param(jnp.ones((3,), jnp.float32))

    def __call__(self, h_bsnh: jax.Array):
        cfg = self.cfg
        n = cfg.hc_mult
        b, s = h_bsnh.shape[:2]
        flat = unweighted_rms_norm(h_bsnh.reshape(b, s, -1).astype(jnp.float32), cfg.rms_norm_eps)
        mix = einsum("bsi,oi->bso", flat, self.fn[...].astype(jnp.float32))
        base = self.base[...].astype(jnp.float32)
        s_pre, s_post, s_comb = self.scale[...].astype(jnp.float32)
        pre = jax.nn.sigmoid(mix[..., :n] * s_pre + base[:n]) + cfg.hc_eps
        post = 2 * jax.nn.sigmoid(mix[..., n:2 * n] * s_post + base[n:2 * n])
        comb_logits = mix[..., 2 * n:].reshape(b, s, n, n) * s_comb + base[2 * n:].reshape(n, n)
        comb = jax.nn.softmax(comb_logits, axis=-1) + cfg.hc_eps
        comb = sinkhorn(comb, cfg.hc_sinkhorn_iters, cfg.hc_eps)
        return post, comb, collapse(pre, h_bsnh)


def mix_streams(post_bsn, comb_bsnn, out_bsh, h_bsnh) -> jax.Array:
    """`h_new[k] = post[k]·out + Σ_j comb[j,k]·h[j]`: comb is applied transposed."""
    dtype = h_bsnh.dtype
    expand = post_bsn.astype(dtype)[..., None] * out_bsh[:, :, None, :]
    return expand + einsum("bsjk,bsjh->bskh", comb_bsnn.astype(dtype), h_bsnh)


class HyperHead(nnx.Module):
    """The final collapse of the N streams to one (sigmoid weights, no Sinkhorn)."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        n = cfg.hc_mult
        self.cfg = cfg
        self.hc_fn = nnx.Param(0.02 * jax.random.normal(rngs.params(), (n, n * cfg.hidden_size)))
        self.hc_base = nnx.Param(jnp.zeros((n,), jnp.float32))
        self.hc_scale = nnx.Param(jnp.ones((1,), jnp.float32))

    def __call__(self, h_bsnh: jax.Array) -> jax.Array:
        b, s = h_bsnh.shape[:2]
        flat = unweighted_rms_norm(h_bsnh.reshape(b, s, -1).astype(jnp.float32), self.cfg.rms_norm_eps)
        mix = einsum("bsi,oi->bso", flat, self.hc_fn[...].astype(jnp.float32))
        pre = jax.nn.sigmoid(mix * self.hc_scale[...].astype(jnp.float32) + self.hc_base[...]) + self.cfg.hc_eps
        return collapse(pre, h_bsnh)
