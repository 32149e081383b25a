"""KV compressors: HCA (disjoint windows of m' tokens) and the CSA two-series overlapping pool.

A compressor turns the layer input `x [B,S,H]` into compressed entries `[B,T,width]`, T = ⌊S/m⌋, one
per complete window. Entry w is a per-channel softmax-gated sum over its window (HCA) or over
[Ca of window w−1 | Cb of window w] (CSA, `overlap=True`), then kv_norm, then RoPE (compress table)
at position w·m, the window's start. Entry w becomes visible to query position t once
`w < (t+1)//m`, i.e. from the last token of its own window on.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from dsjax.cache import CompressorState, as_rows
from dsjax.config import ModelConfig
from dsjax.layers.linear import Linear
from dsjax.layers.norms import RMSNorm
from dsjax.layers.rope import apply_rope, rope_table


def entry_visible(positions_bs: jax.Array, n_entries: int, rate: int) -> jax.Array:
    """`[B,S,T]` bool: entry w is visible to the query at position t iff `w < (t+1)//rate`."""
    threshold_bs = (positions_bs + 1) // rate
    return jnp.arange(n_entries)[None, None, :] < threshold_bs[..., None]


class Compressor(nnx.Module):
    """Gated window pooling to `width` channels at rate `rate`; `overlap` selects the CSA two-series pool."""

    def __init__(self, cfg: ModelConfig, width: int, rate: int, overlap: bool, *, rngs: nnx.Rngs,
                 dtype=jnp.float32):
        self.cfg = cfg
        self.width = width
        self.rate = rate
        self.overlap = overlap
        n = 2 * width if overlap else width
        self.kv_proj = Linear(cfg.hidden_size, n, rngs=rngs, dtype=dtype)
        self.gate_proj = Linear(cfg.hidden_size, n, rngs=rngs, dtype=dtype)
        self.position_bias = nnx.Param(jnp.zeros((rate, n), jnp.float32))
        self.kv_norm = RMSNorm(width, cfg.rms_norm_eps)

    def compress(self, x_bsh: jax.Array) -> jax.Array:
        """Entries `[B, ⌊S/m⌋, width]` for the complete windows of x, counted from position 0."""
        b, s, _ = x_bsh.shape
        m = self.rate
        n_win = s // m
        n = self.position_bias.shape[-1]
        usable = x_bsh[:, : n_win * m]
        kv_bkmn = self.kv_proj(usable).reshape(b, n_win, m, n)
        gate_bkmn = self.gate_proj(usable).reshape(b, n_win, m, n)
        return self.pool(kv_bkmn, gate_bkmn, jnp.zeros((b,), jnp.int32))

    def pool(self, kv_bkmn, gate_bkmn, first_window_b, prev_kv_bmw=None, prev_gate_bmw=None,
             has_prev_b=None) -> jax.Array:
        """Entries for K consecutive windows of raw (unbiased) projections, the first being window
        `first_window_b`: `[B, K, width]`, RoPE'd at each window's start position.

        With `overlap`, window k pools [Ca of window k−1 | Cb of window k]; window 0's predecessor is
        `prev_*` where `has_prev_b`, else empty (zero kv, −inf gate: weight 0).
        """
        m, c = self.rate, self.width
        bias_mn = self.position_bias[...]
        gate_bkmn = gate_bkmn + bias_mn
        if self.overlap:
            ca_kv, cb_kv = kv_bkmn[..., :c], kv_bkmn[..., c:]
            ca_gate, cb_gate = gate_bkmn[..., :c], gate_bkmn[..., c:]
            if prev_kv_bmw is None:
                first_kv = jnp.zeros_like(ca_kv[:, :1])
                first_gate = jnp.full_like(ca_gate[:, :1], -jnp.inf)
            else:
                keep = has_prev_b[:, None, None]
                first_kv = jnp.where(keep, prev_kv_bmw, 0).astype(ca_kv.dtype)[:, None]
                first_gate = jnp.where(keep, prev_gate_bmw + bias_mn[:, :c], -jnp.inf)[:, None]
                first_gate = first_gate.astype(ca_gate.dtype)
            kv_bkmn = jnp.concatenate([jnp.concatenate([first_kv, ca_kv[:, :-1]], 1), cb_kv], axis=2)
            gate_bkmn = jnp.concatenate([jnp.concatenate([first_gate, ca_gate[:, :-1]], 1), cb_gate], axis=2)
        p = jax.nn.softmax(gate_bkmn.astype(jnp.float32), axis=2).astype(kv_bkmn.dtype)
        pooled_bkc = self.kv_norm(jnp.sum(kv_bkmn * p, axis=2))
        k = pooled_bkc.shape[1]
        positions_bk = (first_window_b[:, None] + jnp.arange(k)[None, :]) * m
        cos, sin = rope_table(self.cfg.rope_compress, self.cfg.head_dim, positions_bk, pooled_bkc.dtype)
        return apply_rope(pooled_bkc, cos, sin)

    def append(self, x_bch: jax.Array, state: CompressorState, start_b: jax.Array, n_valid_b: jax.Array):
        """Append C chunk tokens (the first `n_valid` of each row are real) after `start` cached ones.

        Returns all entries `[B, max_len // m, width]` in the cache's storage (those of windows completed
        here written in) and the new state.
        Positions past a row's real tokens never change it.
        """
        b, c_len, _ = x_bch.shape
        m = self.rate
        kv_new = self.kv_proj(x_bch)
        gate_new = self.gate_proj(x_bch)
        # Align the span [w0·m, start + C) to whole windows: K windows from the buffer's window w0 on.
        n_win = -(-(m - 1 + c_len) // m)
        span = n_win * m
        w0_b = start_b // m
        off_b = start_b - w0_b * m
        j = jnp.arange(span)[None, :]
        from_buf = j < off_b[:, None]
        buf_idx = jnp.minimum(j, m - 1)
        chunk_idx = jnp.clip(j - off_b[:, None], 0, c_len - 1)

        def aligned(buf_bmn, new_bcn):
            a = jnp.take_along_axis(buf_bmn, jnp.broadcast_to(buf_idx, (b, span))[..., None], axis=1)
            c = jnp.take_along_axis(new_bcn, chunk_idx[..., None], axis=1)
            return jnp.where(from_buf[..., None], a, c.astype(a.dtype))

        n = kv_new.shape[-1]
        kv_bkmn = aligned(state.buffer_kv, kv_new).reshape(b, n_win, m, n)
        gate_bkmn = aligned(state.buffer_gate, gate_new).reshape(b, n_win, m, n)
        pooled = self.pool(kv_bkmn, gate_bkmn, w0_b, state.overlap_kv, state.overlap_gate, w0_b > 0)

        end_b = start_b + n_valid_b
        w_idx_bk = w0_b[:, None] + jnp.arange(n_win)[None, :]
        complete_bk = (w_idx_bk + 1) * m <= end_b[:, None]
        capacity = jax.tree.leaves(state.entries)[0].shape[1]
        # Windows that complete get written; the rest are sent out of range and dropped.
        target = jnp.where(complete_bk & (w_idx_bk < capacity), w_idx_bk, capacity)
        rows = jnp.arange(b)[:, None]
        stored = jax.tree.map(lambda e, p: e.at[rows, target].set(p, mode="drop"), state.entries,
                              as_rows(pooled, state.entries))

        w_end_b = end_b // m
        tail_k = jnp.clip(w_end_b - w0_b, 0, n_win - 1)  # window (within the span) holding the new tail
        new = dataclasses.replace(state, entries=stored, buffer_kv=_window(kv_bkmn, tail_k),
                                  buffer_gate=_window(gate_bkmn, tail_k))
        if self.overlap:
            last_k = jnp.clip(w_end_b - 1 - w0_b, 0, n_win - 1)
            moved = (w_end_b > w0_b)[:, None, None]
            c = self.width
            new.overlap_kv = jnp.where(moved, _window(kv_bkmn, last_k)[..., :c], state.overlap_kv)
            new.overlap_gate = jnp.where(moved, _window(gate_bkmn, last_k)[..., :c], state.overlap_gate)
        return stored, new


def _window(a_bkmx: jax.Array, k_b: jax.Array) -> jax.Array:
    """Window k_b[b] of each row: `[B, K, m, x] -> [B, m, x]`."""
    return jnp.take_along_axis(a_bkmx, k_b[:, None, None, None], axis=1)[:, 0]


class HCACompressor(Compressor):
    """Heavily compressed attention: disjoint windows of m' tokens, every visible entry attended."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, dtype=jnp.float32):
        super().__init__(cfg, cfg.head_dim, cfg.compress_rate_hca, overlap=False, rngs=rngs, dtype=dtype)

    def __call__(self, x_bsh, q_res_bsr, positions_bs):
        """Entries `[B,T,D]` and the `[B,S,T]` visibility mask."""
        entries = self.compress(x_bsh)
        return entries, entry_visible(positions_bs, entries.shape[1], self.rate)

    def sparse(self, x_bch, q_res_bcr, positions_bc, start_b, n_valid_b, cache):
        """Cached form for the sparse attention operations: (entries in the cache's storage, each query's
        selection — every complete window so far: `entries_len [B, C]` —, new LayerCache fields)."""
        entries, state = self.append(x_bch, cache.compressor, start_b, n_valid_b)
        return entries, {"entries_len": (positions_bc + 1) // self.rate}, {"compressor": state}


class CSACompressor(Compressor):
    """Compressed sparse attention: overlapping two-series windows, entries picked by the lightning indexer."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, dtype=jnp.float32):
        from dsjax.layers.indexer import Indexer

        super().__init__(cfg, cfg.head_dim, cfg.compress_rate_csa, overlap=True, rngs=rngs, dtype=dtype)
        self.indexer = Indexer(cfg, rngs=rngs, dtype=dtype)

    def __call__(self, x_bsh, q_res_bsr, positions_bs):
        """Entries `[B,T,D]` and the `[B,S,T]` mask of the entries the indexer selected per query."""
        entries = self.compress(x_bsh)
        return entries, self.indexer(x_bsh, q_res_bsr, positions_bs)

    def sparse(self, x_bch, q_res_bcr, positions_bc, start_b, n_valid_b, cache):
        """Cached form for the sparse attention operations: (entries in the cache's storage, the indexer's
        picks `idx [B, C, K]`, new LayerCache fields)."""
        entries, state = self.append(x_bch, cache.compressor, start_b, n_valid_b)
        with jax.named_scope("indexer"):
            idx, index_state = self.indexer.picks(x_bch, q_res_bcr, positions_bc, start_b, n_valid_b,
                                                  cache.indexer)
        return entries, {"idx": idx}, {"compressor": state, "indexer": index_state}
