"""Manifold-constrained hyper-connections: N residual streams, mixed by Sinkhorn-normalised weights."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from dsjax.config import ModelConfig
from dsjax.kernels.sinkhorn.op import sinkhorn
from dsjax.layers.norms import unweighted_rms_norm
from dsjax.numerics import einsum


def collapse(pre_bsn: jax.Array, h_bsnh: jax.Array) -> jax.Array:
    """`Σ_n pre[n]·h[n]` in fp32, cast to the streams' dtype."""
    return einsum("bsn,bsnh->bsh", pre_bsn, h_bsnh.astype(jnp.float32)).astype(h_bsnh.dtype)


class HyperConnection(nnx.Module):
    """Computes (post, comb, collapsed) from the streams `h [B,S,N,H]` for one block (attention or FFN); `mixes`
    gives the weights alone."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        n = cfg.hc_mult
        self.cfg = cfg
        self.kernels = "auto"  # a run option (`dsjax.model.with_kernels`)
        self.fn = nnx.Param(0.02 * jax.random.normal(rngs.params(), ((2 + n) * n, n * cfg.hidden_size)))
        self.base = nnx.Param(jnp.zeros(((2 + n) * n,), jnp.float32))
        self.scale = nnx.Param(jnp.ones((3,), jnp.float32))

    def __call__(self, h_bsnh: jax.Array):
        pre, post, comb = self.mixes(h_bsnh)
        return post, comb, collapse(pre, h_bsnh)

    def mixes(self, h_bsnh: jax.Array):
        """`(pre [B,S,N], post [B,S,N], comb [B,S,N,N])` in fp32 from the streams. V4 collapses its block's
        input with `pre`; V4.1's single pass collapses the next sublayer's input with it."""
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
        comb = sinkhorn(comb, cfg.hc_sinkhorn_iters, cfg.hc_eps, kernels=self.kernels)
        return pre, post, comb


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
