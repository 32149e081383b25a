"""The V4 attention block: low-rank queries, one shared K=V head, sinks, window + compressed keys.

Keys are `[sliding-window raw keys | compressed entries]`. Window key k is visible to query q iff
`q − sw < k ≤ q` (positions); a compressed entry is visible as its compressor decides (HCA: causally
complete windows; CSA: the indexer's picks). V carries RoPE, so the output's rope slice is rotated
back by the query position before the grouped output projection.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from dsjax.cache import LayerCache, as_rows
from dsjax.config import CSA, HCA, SLIDING, ModelConfig
from dsjax.kernels.sparse_attention.op import sparse_decode, sparse_prefill
from dsjax.layers.compressor import CSACompressor, HCACompressor
from dsjax.layers.linear import GroupedLinear, Linear
from dsjax.layers.norms import RMSNorm, unweighted_rms_norm
from dsjax.layers.rope import apply_rope, rope_table
from dsjax.numerics import einsum


def window_visible(q_pos_bs: jax.Array, k_pos_bk: jax.Array, window: int) -> jax.Array:
    """`[B,S,K]` bool: raw key k is visible to query q iff `q − window < k ≤ q`."""
    q = q_pos_bs[:, :, None]
    k = k_pos_bk[:, None, :]
    return (k <= q) & (k > q - window)


def attend_with_sinks(q_bshd, kv_bkd, visible_bsk, sinks_h, scale: float) -> jax.Array:
    """Softmax attention of nh query heads over one shared K=V head, with a per-head sink logit.

    `P = exp(a) / (Σ exp(a) + exp(sink))`: the sink takes probability mass but adds no value.
    Scores are formed in the activation dtype and the softmax runs in fp32, as in the reference.
    """
    s_bhsk = einsum("bshd,bkd->bhsk", q_bshd, kv_bkd) * jnp.asarray(scale, q_bshd.dtype)
    s_bhsk = jnp.where(visible_bsk[:, None], s_bhsk.astype(jnp.float32), -jnp.inf)
    b, h, s, _ = s_bhsk.shape
    sink_bhs1 = jnp.broadcast_to(sinks_h.astype(jnp.float32)[None, :, None, None], (b, h, s, 1))
    logits = jnp.concatenate([s_bhsk, sink_bhs1], axis=-1)
    p_bhsk = jax.nn.softmax(logits, axis=-1)[..., :-1].astype(kv_bkd.dtype)
    return einsum("bhsk,bkd->bshd", p_bhsk, kv_bkd)


class Attention(nnx.Module):
    """Shared-KV MQA with sinks for one layer type (sliding, CSA or HCA)."""

    def __init__(self, cfg: ModelConfig, attention_type: str, *, rngs: nnx.Rngs, dtype=jnp.float32):
        self.cfg = cfg
        self.attention_type = attention_type
        nh, d = cfg.num_attention_heads, cfg.head_dim
        q = cfg.quantization
        self.q_a_proj = Linear(cfg.hidden_size, cfg.q_lora_rank, rngs=rngs, dtype=dtype, quant=q)
        self.q_a_norm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
        # Tensor parallelism splits the query heads: q_b's rows, the sinks, and the output projection's
        # groups (o_a's rows, o_b's columns), so attention needs no gather until o_b's sum.
        self.q_b_proj = Linear(cfg.q_lora_rank, nh * d, rngs=rngs, dtype=dtype, quant=q, axes=("heads", None))
        self.kv_proj = Linear(cfg.hidden_size, d, rngs=rngs, dtype=dtype, quant=q)
        self.kv_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.o_a_proj = GroupedLinear(nh * d // cfg.o_groups, cfg.o_groups * cfg.o_lora_rank, cfg.o_groups,
                                      rngs=rngs, dtype=dtype, quant=q, axes=("heads", None))
        self.o_b_proj = Linear(cfg.o_groups * cfg.o_lora_rank, cfg.hidden_size, rngs=rngs, dtype=dtype,
                               quant=q, axes=("embed", "heads"))
        self.sinks = nnx.Param(jnp.zeros((nh,), jnp.float32), axes=("heads",))
        compressors = {SLIDING: None, CSA: CSACompressor, HCA: HCACompressor}
        cls = compressors[attention_type]
        self.compressor = None if cls is None else cls(cfg, rngs=rngs, dtype=dtype)

    def _project_in(self, x_bsh, positions_bs):
        """Rope tables, q_res (shared with the indexer), rotated queries and rotated shared K=V."""
        cfg = self.cfg
        b, s, _ = x_bsh.shape
        cos, sin = rope_table(cfg.rope_for(self.attention_type), cfg.head_dim, positions_bs, x_bsh.dtype)
        q_res_bsr = self.q_a_norm(self.q_a_proj(x_bsh))
        q_bshd = self.q_b_proj(q_res_bsr).reshape(b, s, cfg.num_attention_heads, cfg.head_dim)
        q_bshd = apply_rope(unweighted_rms_norm(q_bshd, cfg.rms_norm_eps), cos[:, :, None], sin[:, :, None])
        kv_bsd = apply_rope(self.kv_norm(self.kv_proj(x_bsh)), cos, sin)
        return cos[:, :, None], sin[:, :, None], q_res_bsr, q_bshd, kv_bsd

    def __call__(self, x_bsh: jax.Array, positions_bs: jax.Array, record: dict | None = None) -> jax.Array:
        """`record`, if given, receives a CSA layer's `indexer_picks [B,S,T]` and `indexer_kl`."""
        cfg = self.cfg
        cos_h, sin_h, q_res_bsr, q_bshd, kv_bsd = self._project_in(x_bsh, positions_bs)
        visible_bsk = window_visible(positions_bs, positions_bs, cfg.sliding_window)
        if self.compressor is not None:
            entries_btd, entry_visible_bst = self.compressor(x_bsh, q_res_bsr, positions_bs)
            if record is not None and self.attention_type == CSA:
                record["indexer_picks"] = entry_visible_bst
                record["indexer_kl"] = self.compressor.indexer.distillation_loss(
                    x_bsh, q_res_bsr, positions_bs, q_bshd, entries_btd, cfg.head_dim ** -0.5)
            kv_bsd = jnp.concatenate([kv_bsd, entries_btd], axis=1)
            visible_bsk = jnp.concatenate([visible_bsk, entry_visible_bst], axis=-1)

        o_bshd = attend_with_sinks(q_bshd, kv_bsd, visible_bsk, self.sinks[...], cfg.head_dim ** -0.5)
        return self.project_out(o_bshd, cos_h, sin_h)

    def extend(self, x_bch: jax.Array, start_b: jax.Array, n_valid_b: jax.Array, cache: LayerCache):
        """Cached attention for C new tokens per row at positions start…start+C−1 (the first n_valid
        real) through the sparse attention operations (`kernels.sparse_attention`): keys are the window
        ring, the chunk itself and the compressed entries, all as the cache stores them (the chunk's
        own rows pass through the cache's storage first). Rows with n_valid = 0 leave the cache unchanged."""
        cfg = self.cfg
        w = cfg.sliding_window
        c_len = x_bch.shape[1]
        positions_bc = start_b[:, None] + jnp.arange(c_len)[None, :]
        cos_h, sin_h, q_res_bcr, q_bchd, kv_bcd = self._project_in(x_bch, positions_bc)
        entries, selection, states = None, {}, {}
        if self.compressor is not None:
            entries, selection, states = self.compressor.sparse(x_bch, q_res_bcr, positions_bc, start_b, n_valid_b,
                                                                cache)
        scale = cfg.head_dim ** -0.5
        if c_len == 1:
            rows = jnp.arange(x_bch.shape[0])
            target_b = jnp.where(n_valid_b > 0, jnp.mod(start_b, w), w)  # out of range: dropped
            ring = jax.tree.map(lambda r, new: r.at[rows, target_b].set(new[:, 0], mode="drop"), cache.window,
                                as_rows(kv_bcd, cache.window))
            # The ring holds positions ≡ slot (mod W); after this write, slots 0 … min(start + 1, W) − 1 are
            # exactly the window q − W < k ≤ q of the query at q = start.
            one = {f"{k}_b" if k == "entries_len" else "idx_bk": v[:, 0] for k, v in selection.items()}
            o_bhd = sparse_decode(q_bchd[:, 0], ring, jnp.minimum(start_b + 1, w), entries, self.sinks[...], scale,
                                  **one, kernels=cfg.kernels)
            return self.project_out(o_bhd[:, None], cos_h, sin_h), LayerCache(ring, **states)

        # Window rows in position order: the ring's W rows (positions start−W … start−1) then the chunk's.
        # Query c (position start + c) sees rows c+1 … c+W, of which ring rows need a position ≥ 0 and
        # chunk rows must be real.
        ring_slots_bw = jnp.mod(start_b[:, None] - w + jnp.arange(w)[None, :], w)
        chunk_rows = as_rows(kv_bcd, cache.window)
        window = jax.tree.map(lambda r, new: jnp.concatenate([jnp.take_along_axis(
            r, ring_slots_bw.reshape(ring_slots_bw.shape + (1,) * (r.ndim - 2)), axis=1), new], axis=1),
            cache.window, chunk_rows)
        c = jnp.arange(c_len)[None, :]
        window_start_bc = jnp.maximum(c + 1, w - start_b[:, None])
        window_end_bc = jnp.minimum(c + w + 1, w + n_valid_b[:, None])
        picks = {f"{k}_bc" if k == "entries_len" else "idx_bck": v for k, v in selection.items()}
        o_bchd = sparse_prefill(q_bchd, window, window_start_bc, window_end_bc, entries, self.sinks[...], scale,
                                **picks, kernels=cfg.kernels)
        # The ring keeps, for each slot i, the newest real position ≡ i (mod W).
        new_pos_bw = _ring_positions(start_b + n_valid_b - 1, w)
        from_chunk = new_pos_bw >= start_b[:, None]
        idx = jnp.clip(new_pos_bw - start_b[:, None], 0, c_len - 1)
        new_rows = jax.tree.map(lambda x: jnp.take_along_axis(x, idx.reshape(idx.shape + (1,) * (x.ndim - 2)), 1),
                                chunk_rows)
        ring = jax.tree.map(lambda new, old: jnp.where(from_chunk.reshape(from_chunk.shape + (1,) * (old.ndim - 2)),
                                                       new, old), new_rows, cache.window)
        return self.project_out(o_bchd, cos_h, sin_h), LayerCache(ring, **states)

    def project_out(self, o_bshd, cos_h, sin_h) -> jax.Array:
        """De-rotate the rope slice at the query position, then the grouped low-rank output projection."""
        b, s = o_bshd.shape[:2]
        o_bshd = apply_rope(o_bshd, cos_h, -sin_h)
        o_bsgi = o_bshd.reshape(b, s, self.cfg.o_groups, -1)
        return self.o_b_proj(self.o_a_proj(o_bsgi).reshape(b, s, -1))


def _ring_positions(last_b: jax.Array, window: int) -> jax.Array:
    """`[B, W]`: the position held by ring slot i when `last` is the newest position written
    (the largest p ≤ last with p ≡ i mod W); negative where nothing was written yet."""
    i = jnp.arange(window)[None, :]
    return last_b[:, None] - jnp.mod(last_b[:, None] - i, window)
