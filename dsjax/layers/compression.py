"""The compressor core shared by the attention's compressors (`compressor.py`: HCA, CSA) and the lightning
indexer's key compressor (`indexer.py`), and the `Selection` of entries a compressed layer attends.

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

from dsjax.cache import CompressorState, gather_windows, store_windows
from dsjax.config import ModelConfig
from dsjax.layers.linear import Linear
from dsjax.layers.norms import RMSNorm
from dsjax.layers.rope import apply_rope, rope_table


def entry_visible(positions_bs: jax.Array, n_entries: int, rate: int) -> jax.Array:
    """`[B,S,T]` bool: entry w is visible to the query at position t iff `w < (t+1)//rate`."""
    threshold_bs = (positions_bs + 1) // rate
    return jnp.arange(n_entries)[None, None, :] < threshold_bs[..., None]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Selection:
    """The compressed entries each of a chunk's C queries attends, in the form the sparse attention
    operations take (`kernels.sparse_attention`): HCA sets `entries_len_bc`, CSA `idx_bck`, a sliding
    layer neither. A layer attending another layer's entries may take that layer's Selection as is."""

    entries_len_bc: jax.Array | None = None  # [B, C] int: entries 0 … entries_len − 1 (all complete windows)
    idx_bck: jax.Array | None = None  # [B, C, K] int32: the indexer's picks, −1 picks nothing

    @property
    def entries_len_b(self) -> jax.Array | None:
        """`entries_len` of one query per row (C = 1), `[B]`."""
        return None if self.entries_len_bc is None else self.entries_len_bc[:, 0]

    @property
    def idx_bk(self) -> jax.Array | None:
        """The picks of one query per row (C = 1), `[B, K]`."""
        return None if self.idx_bck is None else self.idx_bck[:, 0]


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

    def compress_into(self, x_bch: jax.Array, state: CompressorState, start_b: jax.Array,
                      n_valid_b: jax.Array) -> CompressorState:
        """The cached form of `compress`: C chunk tokens (the first `n_valid` of each row real) after
        `start` cached ones, pooled with the buffered partial window; the windows completed here become
        entries of the returned state (`cache.gather_windows`, `cache.store_windows`). Positions past a
        row's real tokens never change it."""
        windows = gather_windows(state, self.kv_proj(x_bch), self.gate_proj(x_bch), start_b)
        pooled_bkc = self.pool(windows.kv_bkmn, windows.gate_bkmn, windows.first_b, windows.prev_kv_bmc,
                               windows.prev_gate_bmc, windows.has_prev_b)
        return store_windows(state, windows, pooled_bkc, start_b + n_valid_b)
