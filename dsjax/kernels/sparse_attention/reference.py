"""The pure-JAX reference of V4 sparse decode attention (and its fallback on every backend without a
kernel): dequantize, gather the picked compressed entries, then one softmax with sinks over
`[window keys | compressed entries]`.

Numerics, shared with the kernels: from the (bf16 or fp32) queries and keys on, everything is fp32:
the scores `q·k` (products exact, sums in fp32) and their scaling, the softmax, and P·V. The dense
path (prefill, training) follows the Hugging Face model instead, which rounds the scores and the
normalised probabilities to bf16 in a bf16 model. Those roundings are discontinuous: two correct
fp32 summation orders that straddle a bf16 rounding boundary move a peaked probability by up to 2%,
so no kernel can reproduce them; the decode operation keeps the exact values, which is what both
roundings approximate.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dsjax.cache import read_rows
from dsjax.quant import PackedKV

Rows = jax.Array | PackedKV


def gather_rows(rows: Rows, idx_bk: jax.Array) -> Rows:
    """Rows `idx[b, k]` of each slot (any storage); -1 reads row 0."""
    safe = jnp.maximum(idx_bk, 0)[..., None]
    return jax.tree.map(lambda a: jnp.take_along_axis(a, safe, axis=1), rows)


def sparse_decode_reference(q_bhd: jax.Array, window: Rows, window_len_b: jax.Array, entries: Rows | None,
                            sinks_h: jax.Array, scale: float, *, entries_len_b: jax.Array | None = None,
                            idx_bk: jax.Array | None = None, out_dtype=None) -> jax.Array:
    """One query per slot over its window and compressed entries, `[B, H, D]`.

    - `window [B, W, D]` (array or PackedKV): ring rows `0 … window_len[b]−1` are visible;
    - `entries [B, T, D]`: with `entries_len_b`, rows `0 … entries_len[b]−1` are visible (HCA); with
      `idx_bk [B, K]`, the picked rows are (CSA; -1 picks nothing); None: sliding-window layers.
    `out_dtype` defaults to q's dtype; fp32 returns the sums unrounded.
    """
    dtype = q_bhd.dtype
    keys_bnd = read_rows(window, dtype)
    visible_bn = jnp.arange(keys_bnd.shape[1])[None, :] < window_len_b[:, None]
    if entries is not None:
        if (entries_len_b is None) == (idx_bk is None):
            raise ValueError("sparse decode: give exactly one of entries_len_b (attend a prefix) and idx_bk (picks)")
        if idx_bk is not None:
            entries, entry_visible = gather_rows(entries, idx_bk), idx_bk >= 0
        else:
            n_rows = jax.tree.leaves(entries)[0].shape[1]
            entry_visible = jnp.arange(n_rows)[None, :] < entries_len_b[:, None]
        keys_bnd = jnp.concatenate([keys_bnd, read_rows(entries, dtype)], axis=1)
        visible_bn = jnp.concatenate([visible_bn, entry_visible], axis=1)

    f32, exact = jnp.float32, jax.lax.Precision.HIGHEST
    # Widened operands: bf16 products are exact in fp32, and XLA:CPU would otherwise sum bf16 in bf16.
    keys_bnd = keys_bnd.astype(f32)
    s_bhn = jnp.einsum("bhd,bnd->bhn", q_bhd.astype(f32), keys_bnd, precision=exact)
    s_bhn = jnp.where(visible_bn[:, None, :], s_bhn * scale, -jnp.inf)
    sink_bh1 = jnp.broadcast_to(sinks_h.astype(f32)[None, :, None], (*s_bhn.shape[:2], 1))
    p_bhn = jax.nn.softmax(jnp.concatenate([s_bhn, sink_bh1], axis=-1), axis=-1)[..., :-1]
    o_bhd = jnp.einsum("bhn,bnd->bhd", p_bhn, keys_bnd, precision=exact)
    return o_bhd.astype(out_dtype or dtype)
