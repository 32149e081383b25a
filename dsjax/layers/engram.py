"""DeepSeek-V4.1's Engram conditional memory: rows of an n-gram table, looked up by hashes of each token's
last few (compressed) tokens (`layers/ngram_hash.py`), projected to one key per stream and a
shared value, and written into the streams through a per-stream gate.

`g_n = sigmoid(signed_sqrt(⟨T_n ⊙ q_n ⊙ k_n, key_n⟩ · rstd(T_n) · rstd(key_n) · H^-0.5))`,
`T_n ← T_n + g_n · value`, in fp32; tokens that are not live (image spans, padding) pass unchanged.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from dsjax.layers.linear import Linear
from dsjax.layers.variables import Buffer
from dsjax.quant import dequantize_fp8, quantize_fp8

ROW_GROUP = 32  # values per scale in a quantized table row


def _rstd(x: jax.Array, eps: float) -> jax.Array:
    return jax.lax.rsqrt(jnp.mean(x * x, axis=-1) + eps)


class Engram(nnx.Module):
    """One Engram layer: a table `[rows, head_dim]`, `wkv` to `(N + 1)·H` (N keys first, then the value)."""

    def __init__(self, cfg, rows: int, *, rngs: nnx.Rngs, dtype=jnp.float32):
        self.cfg = cfg
        n, h = cfg.hc_mult, cfg.hidden_size
        table = 0.02 * jax.random.normal(rngs.params(), (rows, cfg.engram_head_dim))
        # On a mesh the table's values split over the devices (`parallel.rules`): the release's tables are
        # ~100 GB each, and the row counts are not multiples of a device count; each device gathers its part.
        if cfg.quantization is None:
            self.table = nnx.Param(table.astype(dtype), axes=(None, "engram_dim"))
            self.table_scale = None
        else:  # as released: e4m3 rows with a ue8m0 scale per 32 values
            q, scale = quantize_fp8(table, (1, ROW_GROUP), "ue8m0")
            self.table = nnx.Param(q, axes=(None, "engram_dim"))
            self.table_scale = Buffer(scale, axes=(None, "engram_dim"))
        self.kv_proj = Linear(cfg.engram_hash_heads * cfg.engram_head_dim, (n + 1) * h, rngs=rngs, dtype=dtype,
                              quant=cfg.quantization)
        self.q_weight = nnx.Param(jnp.ones((n, h), dtype))
        self.k_weight = nnx.Param(jnp.ones((n, h), dtype))

    def lookup(self, rows: jax.Array) -> jax.Array:
        """The table's rows `[..., head_dim]` (fp32 when stored in FP8: only these rows are dequantized)."""
        q = jnp.take(self.table[...], rows, axis=0, mode="clip")
        if self.table_scale is None:
            return q
        scale = jnp.take(self.table_scale[...], rows, axis=0, mode="clip")
        return dequantize_fp8(q, scale, jnp.float32, (1, ROW_GROUP))  # per row: blocks of 1 × 32

    def __call__(self, h_bsnh: jax.Array, rows_bsk: jax.Array, live_bs: jax.Array) -> jax.Array:
        """The streams after the write; `rows_bsk` are this layer's table rows of each token."""
        cfg = self.cfg
        b, s, n, h = h_bsnh.shape
        emb = self.lookup(rows_bsk).reshape(b, s, -1).astype(h_bsnh.dtype)
        kv = self.kv_proj(emb)
        key_bsnh = kv[..., : n * h].astype(jnp.float32).reshape(b, s, n, h)
        value_bsh = kv[..., n * h:].astype(jnp.float32)
        hf = h_bsnh.astype(jnp.float32)
        weight_nh = self.q_weight[...].astype(jnp.float32) * self.k_weight[...].astype(jnp.float32)
        dot = jnp.sum(hf * weight_nh * key_bsnh, axis=-1)
        dot = dot * _rstd(hf, cfg.rms_norm_eps) * _rstd(key_bsnh, cfg.rms_norm_eps) * h ** -0.5
        gate = jax.nn.sigmoid(jnp.copysign(jnp.sqrt(jnp.maximum(jnp.abs(dot), 1e-6)), dot))
        gate = jnp.where(live_bs[..., None], gate, 0.0)
        return (hf + gate[..., None] * value_bsh[:, :, None, :]).astype(h_bsnh.dtype)
