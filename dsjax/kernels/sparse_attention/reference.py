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

from dsjax.cache import Rows, read_rows


def gather_rows(rows: Rows, idx_bk: jax.Array) -> Rows:
    """Rows `idx[b, k]` of each slot (any storage); -1 reads row 0."""
    safe = jnp.maximum(idx_bk, 0)[..., None]
    return jax.tree.map(lambda a: jnp.take_along_axis(a, safe, axis=1), rows)


def unpacked_picks(window: Rows, entries: Rows | None, idx_bk: jax.Array | None, dtype):
    """(window, entries, picks) for a kernel that reads float rows: the window ring and each slot's picked
    entries (only those) unpacked to `dtype` as `read_rows` does, the picks renumbered to index the
    picked rows (`[B, K]`, -1 kept where nothing is picked or the pick is out of range)."""
    if entries is not None and idx_bk is not None:
        valid = (idx_bk >= 0) & (idx_bk < jax.tree.leaves(entries)[0].shape[1])
        entries = read_rows(gather_rows(entries, jnp.where(valid, idx_bk, 0)), dtype)
        idx_bk = jnp.where(valid, jnp.arange(idx_bk.shape[1], dtype=jnp.int32), -1)
    elif entries is not None:
        entries = read_rows(entries, dtype)
    return read_rows(window, dtype), entries, idx_bk


def sparse_decode_reference(q_bhd: jax.Array, window: Rows, window_len_b: jax.Array, entries: Rows | None,
                            sinks_h: jax.Array, scale: float, *, entries_len_b: jax.Array | None = None,
                            idx_bk: jax.Array | None = None, out_dtype=None) -> jax.Array:
    """One query per slot over its window and compressed entries, `[B, H, D]`.

    - `window [B, W, D]` (array or PackedKV): ring rows `0 … window_len[b]−1` are visible;
    - `entries [B, T, D]`: with `entries_len_b`, rows `0 … entries_len[b]−1` are visible (HCA); with
      `idx_bk [B, K]`, the picked rows are (CSA; -1 picks nothing); None: sliding-window layers.
    `out_dtype` defaults to q's dtype; fp32 returns the sums unrounded.
    """
    column = lambda x: None if x is None else x[:, None]  # noqa: E731
    return sparse_prefill_reference(q_bhd[:, None], window, jnp.zeros_like(window_len_b)[:, None],
                                    window_len_b[:, None], entries, sinks_h, scale,
                                    entries_len_bc=column(entries_len_b), idx_bck=column(idx_bk),
                                    out_dtype=out_dtype)[:, 0]


def sparse_prefill_reference(q_bchd: jax.Array, window: Rows, window_start_bc: jax.Array, window_end_bc: jax.Array,
                             entries: Rows | None, sinks_h: jax.Array, scale: float, *,
                             entries_len_bc: jax.Array | None = None, idx_bck: jax.Array | None = None,
                             out_dtype=None) -> jax.Array:
    """C queries per slot, `[B, C, H, D]`: query c sees its slot's window rows `[start[b, c], end[b, c])`
    and entry rows `[0, entries_len[b, c])` (HCA) or `idx[b, c, :]` (CSA; -1 picks nothing)."""
    dtype = q_bchd.dtype
    f32, exact = jnp.float32, jax.lax.Precision.HIGHEST
    # Widened operands: bf16 products are exact in fp32, and XLA:CPU would otherwise sum bf16 in bf16.
    q_bchd = q_bchd.astype(f32)
    keys_bnd = read_rows(window, dtype).astype(f32)
    n = jnp.arange(keys_bnd.shape[1])
    visible = [(n >= window_start_bc[..., None]) & (n < window_end_bc[..., None])]
    scores = [jnp.einsum("bchd,bnd->bchn", q_bchd, keys_bnd, precision=exact)]
    if entries is not None:
        if (entries_len_bc is None) == (idx_bck is None):
            raise ValueError("sparse attention: give exactly one of the entry counts (attend a prefix) and the picks")
        if idx_bck is not None:
            b, c, k = idx_bck.shape
            picked = read_rows(gather_rows(entries, idx_bck.reshape(b, c * k)), dtype).astype(f32)
            picked_bckd = picked.reshape(b, c, k, -1)
            visible.append(idx_bck >= 0)
            scores.append(jnp.einsum("bchd,bckd->bchk", q_bchd, picked_bckd, precision=exact))
        else:
            entries_btd = read_rows(entries, dtype).astype(f32)
            visible.append(jnp.arange(entries_btd.shape[1]) < entries_len_bc[..., None])
            scores.append(jnp.einsum("bchd,btd->bcht", q_bchd, entries_btd, precision=exact))
    s_bchn = jnp.concatenate(scores, axis=-1) * scale
    s_bchn = jnp.where(jnp.concatenate(visible, axis=-1)[:, :, None, :], s_bchn, -jnp.inf)
    sink = jnp.broadcast_to(sinks_h.astype(f32)[:, None], (*s_bchn.shape[:3], 1))
    p_bchn = jax.nn.softmax(jnp.concatenate([s_bchn, sink], axis=-1), axis=-1)[..., :-1]
    w = keys_bnd.shape[1]
    o_bchd = jnp.einsum("bchn,bnd->bchd", p_bchn[..., :w], keys_bnd, precision=exact)
    if entries is not None:
        spec = "bchk,bckd->bchd" if idx_bck is not None else "bcht,btd->bchd"
        o_bchd += jnp.einsum(spec, p_bchn[..., w:], picked_bckd if idx_bck is not None else entries_btd,
                             precision=exact)
    return o_bchd.astype(out_dtype or dtype)
