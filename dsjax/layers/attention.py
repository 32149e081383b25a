"""The V4 attention block: low-rank queries, one shared K=V head, sinks, window + compressed keys.

Keys are `[sliding-window raw keys | compressed entries]`. Window key k is visible to query q iff
`q − sw < k ≤ q` (positions); a compressed entry is visible as its compressor decides (HCA: causally
complete windows; CSA: the indexer's picks). V carries RoPE, so the output's rope slice is rotated
back by the query position before the grouped output projection.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from dsjax.cache import LayerCache, extend_window
from dsjax.config import CSA, HCA, SLIDING, ModelConfig
from dsjax.kernels.sparse_attention.op import sparse_decode, sparse_prefill
from dsjax.layers.compression import Selection
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
        self.kernels = "auto"  # a run option (`dsjax.model.with_kernels`)
        self.rope = cfg.rope_for(attention_type) if attention_type in (SLIDING, CSA, HCA) else None
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
        cls = compressors.get(attention_type)
        self.compressor = None if cls is None else cls(cfg, rngs=rngs, dtype=dtype)

    def _project_in(self, x_bsh, positions_bs):
        """Rope tables, q_res (shared with the indexer), rotated queries and rotated shared K=V."""
        cfg = self.cfg
        b, s, _ = x_bsh.shape
        cos, sin = rope_table(self.rope, cfg.head_dim, positions_bs, x_bsh.dtype)
        q_res_bsr = self.q_a_norm(self.q_a_proj(x_bsh))
        q_bshd = self.q_b_proj(q_res_bsr).reshape(b, s, cfg.num_attention_heads, cfg.head_dim)
        if cfg.q_head_norm:
            q_bshd = unweighted_rms_norm(q_bshd, cfg.rms_norm_eps)
        q_bshd = apply_rope(q_bshd, cos[:, :, None], sin[:, :, None])
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

    def extend(self, x_bch: jax.Array, start_b: jax.Array, n_valid_b: jax.Array,
               cache: LayerCache) -> tuple[jax.Array, LayerCache]:
        """Cached attention for C new tokens per row at positions start…start+C−1 (the first n_valid
        real) through the sparse attention operations (`kernels.sparse_attention`): keys are the window
        (`cache.extend_window`: the ring and the chunk itself) and the compressed entries the compressor's
        `Selection` names, all as the cache stores them. Rows with n_valid = 0 leave the cache unchanged."""
        cfg = self.cfg
        c_len = x_bch.shape[1]
        positions_bc = start_b[:, None] + jnp.arange(c_len)[None, :]
        cos_h, sin_h, q_res_bcr, q_bchd, kv_bcd = self._project_in(x_bch, positions_bc)
        entries, selection = None, Selection()
        if self.compressor is not None:
            entries, selection, cache = self.compressor.extend(x_bch, q_res_bcr, positions_bc, start_b, n_valid_b,
                                                               cache)
        keys, window = extend_window(cache.window, kv_bcd, start_b, n_valid_b)
        scale = cfg.head_dim ** -0.5
        if c_len == 1:
            # One query per row: its keys are ring rows 0 … end − 1.
            o_bhd = sparse_decode(q_bchd[:, 0], keys.rows, keys.end_bc[:, 0], entries, self.sinks[...], scale,
                                  entries_len_b=selection.entries_len_b, idx_bk=selection.idx_bk,
                                  kernels=self.kernels)
            o_bchd = o_bhd[:, None]
        else:
            o_bchd = sparse_prefill(q_bchd, keys.rows, keys.start_bc, keys.end_bc, entries, self.sinks[...], scale,
                                    entries_len_bc=selection.entries_len_bc, idx_bck=selection.idx_bck,
                                    kernels=self.kernels)
        return self.project_out(o_bchd, cos_h, sin_h), dataclasses.replace(cache, window=window)

    def project_out(self, o_bshd, cos_h, sin_h) -> jax.Array:
        """De-rotate the rope slice at the query position, then the grouped low-rank output projection."""
        b, s = o_bshd.shape[:2]
        o_bshd = apply_rope(o_bshd, cos_h, -sin_h)
        o_bsgi = o_bshd.reshape(b, s, self.cfg.o_groups, -1)
        return self.o_b_proj(self.o_a_proj(o_bsgi).reshape(b, s, -1))

