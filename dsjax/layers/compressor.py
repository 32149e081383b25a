"""KV compressors: HCA (disjoint windows of m' tokens) and the CSA two-series overlapping pool.

A compressor turns the layer input `x [B,S,H]` into compressed entries `[B,T,width]`, T = ⌊S/m⌋, one
per complete window. Entry w is a per-channel softmax-gated sum over its window (HCA) or over
[Ca of window w−1 | Cb of window w] (CSA, `overlap=True`), then kv_norm, then RoPE (compress table)
at position w·m, the window's start. Entry w becomes visible to query position t once
`w < (t+1)//m`, i.e. from the last token of its own window on.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

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
        usable = x_bsh[:, : n_win * m]
        n = self.position_bias.shape[-1]
        kv_bwmn = self.kv_proj(usable).reshape(b, n_win, m, n)
        gate_bwmn = self.gate_proj(usable).reshape(b, n_win, m, n) + self.position_bias[...]
        if self.overlap:
            kv_bwmn, gate_bwmn = self._overlap_pool(kv_bwmn, gate_bwmn)
        p = jax.nn.softmax(gate_bwmn.astype(jnp.float32), axis=2).astype(kv_bwmn.dtype)
        pooled_bwc = self.kv_norm(jnp.sum(kv_bwmn * p, axis=2))
        cos, sin = rope_table(self.cfg.rope_compress, self.cfg.head_dim, jnp.arange(n_win) * m, pooled_bwc.dtype)
        return apply_rope(pooled_bwc, cos, sin)

    def _overlap_pool(self, kv_bwmn, gate_bwmn):
        """Slots [0,m) hold window w−1's Ca (zero kv, −inf gate for w=0), slots [m,2m) window w's Cb."""
        c = self.width
        ca_kv, cb_kv = kv_bwmn[..., :c], kv_bwmn[..., c:]
        ca_gate, cb_gate = gate_bwmn[..., :c], gate_bwmn[..., c:]
        prev_kv = jnp.concatenate([jnp.zeros_like(ca_kv[:, :1]), ca_kv[:, :-1]], axis=1)
        prev_gate = jnp.concatenate([jnp.full_like(ca_gate[:, :1], -jnp.inf), ca_gate[:, :-1]], axis=1)
        return (jnp.concatenate([prev_kv, cb_kv], axis=2), jnp.concatenate([prev_gate, cb_gate], axis=2))


class HCACompressor(Compressor):
    """Heavily compressed attention: disjoint windows of m' tokens, every visible entry attended."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, dtype=jnp.float32):
        super().__init__(cfg, cfg.head_dim, cfg.compress_rate_hca, overlap=False, rngs=rngs, dtype=dtype)

    def __call__(self, x_bsh, q_res_bsr, positions_bs):
        """Entries `[B,T,D]` and the `[B,S,T]` visibility mask."""
        entries = self.compress(x_bsh)
        return entries, entry_visible(positions_bs, entries.shape[1], self.rate)


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
