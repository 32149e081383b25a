"""DeepSeek-V4.1's DSpark drafter: three stages that propose a block of k tokens from one target step.

Target features are the streams entering target layers 37–39 (after Engram, before the attention mixes), each
averaged over the streams and concatenated; the first stage projects them, `main_x = main_norm(main_proj(f))`.
Each stage's context keys are `kv_norm(wkv(main_x))` rotated at the target token's position (its own window of
`sliding_window` positions, as the release keeps them: MXFP8). A draft block is the token the target just emitted
at position a followed by k − 1 noise tokens at a + 1 … a + k − 1; every draft query sees the context keys of
positions a − window … a − 1 and all k draft keys (bidirectional inside the block), with the sink. Each stage is
a single-pass mHC block (sliding-window attention of its own, a top-k MoE without image bias); the last stage's
`pre` collapses the streams. Draft i proposes the token at a + 1 + i from `head(norm(h_i))` plus a rank-r Markov
bias on the token before it; its confidence logit is `proj([h_i, markov_embed(previous token)])` on the state
before the norm, as the release computes it (NeMo AutoModel's trainer feeds the normed state instead).
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from dsjax.cache_formats import quantize_dequantize
from dsjax.config import TEXT_MOE
from dsjax.config_v41 import V41Config
from dsjax.layers.attention import Attention, attend_with_sinks
from dsjax.layers.embedding import Embedding
from dsjax.layers.linear import Linear
from dsjax.layers.mhc import HyperConnection, collapse
from dsjax.layers.moe import MoE
from dsjax.layers.norms import RMSNorm
from dsjax.layers.rope import apply_rope, rope_table
from dsjax.layers.single_pass_block import post_update
from dsjax.numerics import einsum, precision


class DSparkAttention(Attention):
    """A stage's attention: queries from the draft block, keys from the target's context (`context_keys`) and
    from the block itself; V4's projections, sink and output path, the sliding layers' RoPE."""

    def __init__(self, cfg: V41Config, *, rngs: nnx.Rngs, dtype=jnp.float32):
        super().__init__(cfg, "dspark", rngs=rngs, dtype=dtype)
        self.rope = cfg.rope_for_ratio(0)
        self.cache_rounding = True  # a numerics option (`dsjax.model_v41.with_cache_rounding`)

    def _rounded(self, kv: jax.Array) -> jax.Array:
        return quantize_dequantize(kv, "mxfp8") if self.cache_rounding else kv

    def context_keys(self, main_x_bth: jax.Array, positions_bt: jax.Array) -> jax.Array:
        """`[B,T,D]`: the keys of target tokens at `positions_bt` from their projected features."""
        cos, sin = rope_table(self.rope, self.cfg.head_dim, positions_bt, main_x_bth.dtype)
        return self._rounded(apply_rope(self.kv_norm(self.kv_proj(main_x_bth)), cos, sin))

    def __call__(self, x_bkh: jax.Array, positions_bk: jax.Array, context_btd: jax.Array,
                 visible_bkt: jax.Array) -> jax.Array:
        """The block's k queries over the context keys they see (`visible_bkt`) and the block's own k keys."""
        cos_h, sin_h, _, q_bkhd, kv_bkd = self._project_in(x_bkh, positions_bk)
        b, k = positions_bk.shape
        keys = jnp.concatenate([context_btd.astype(kv_bkd.dtype), self._rounded(kv_bkd)], axis=1)
        visible = jnp.concatenate([visible_bkt, jnp.ones((b, k, k), bool)], axis=-1)
        o_bkhd = attend_with_sinks(q_bkhd, keys, visible, self.sinks[...], self.cfg.head_dim ** -0.5)
        return self.project_out(o_bkhd, cos_h, sin_h)


class MarkovHead(nnx.Module):
    """The rank-r token-transition bias: `head(embed(previous token))` `[..., vocab]`, and the embedding."""

    def __init__(self, vocab: int, rank: int, *, rngs: nnx.Rngs, dtype=jnp.float32):
        self.embed = Embedding(vocab, rank, rngs=rngs, dtype=dtype)
        self.head = Linear(rank, vocab, rngs=rngs, dtype=dtype)

    def __call__(self, previous: jax.Array) -> tuple[jax.Array, jax.Array]:
        e = self.embed(previous)
        w = self.head.weight[...]
        # fp32 out of the head's dtype with fp32 accumulation, as the target's logits (`DeepseekV41.logits`).
        return jnp.einsum("...r,vr->...v", e.astype(w.dtype), w, preferred_element_type=jnp.float32,
                          precision=precision(w)), e


class ConfidenceHead(nnx.Module):
    """An fp32 logit per draft position that the draft token is accepted."""

    def __init__(self, width: int, *, rngs: nnx.Rngs, dtype=jnp.float32):
        self.proj = Linear(width, 1, rngs=rngs, dtype=dtype)

    def __call__(self, state_bkh: jax.Array, markov_bkr: jax.Array) -> jax.Array:
        x = jnp.concatenate([state_bkh.astype(jnp.float32), markov_bkr.astype(jnp.float32)], axis=-1)
        return einsum("...i,oi->...o", x, self.proj.weight[...].astype(jnp.float32))[..., 0]


class DSparkStage(nnx.Module):
    """One stage under the release's names (`mtp.S.*`): the first also holds the features' projection, the last
    the final norm, the Markov head and the confidence head."""

    def __init__(self, cfg: V41Config, first: bool, last: bool, *, rngs: nnx.Rngs, dtype=jnp.float32):
        h = cfg.hidden_size
        self.attn_hc = HyperConnection(cfg, rngs=rngs)
        self.attn_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.attn = DSparkAttention(cfg, rngs=rngs, dtype=dtype)
        self.ffn_hc = HyperConnection(cfg, rngs=rngs)
        self.ffn_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.ffn = MoE(draft_moe_config(cfg), TEXT_MOE, rngs=rngs, dtype=dtype)
        width = len(cfg.dspark_target_layer_ids) * h
        self.main_proj = nnx.data(Linear(width, h, rngs=rngs, dtype=dtype, quant=cfg.quantization) if first
                                  else None)
        self.main_norm = nnx.data(RMSNorm(h, cfg.rms_norm_eps) if first else None)
        self.norm = nnx.data(RMSNorm(h, cfg.rms_norm_eps) if last else None)
        r = cfg.dspark_markov_rank
        self.markov_head = nnx.data(MarkovHead(cfg.vocab_size, r, rngs=rngs, dtype=dtype) if last else None)
        self.confidence_head = nnx.data(ConfidenceHead(h + r, rngs=rngs, dtype=dtype) if last else None)

    def __call__(self, h_bknh: jax.Array, pre_bkn: jax.Array, positions_bk: jax.Array, context_btd: jax.Array,
                 visible_bkt: jax.Array) -> tuple[jax.Array, jax.Array]:
        """`(streams, pre for the next stage)`."""
        pre_a, post_a, comb_a = self.attn_hc.mixes(h_bknh)
        with jax.named_scope("attention"):
            a_bkh = self.attn(self.attn_norm(collapse(pre_bkn, h_bknh)), positions_bk, context_btd, visible_bkt)
        h_bknh = post_update(post_a, comb_a, a_bkh, h_bknh)
        pre_f, post_f, comb_f = self.ffn_hc.mixes(h_bknh)
        with jax.named_scope("moe"):
            no_images = jnp.zeros(positions_bk.shape, bool)
            f_bkh = self.ffn(self.ffn_norm(collapse(pre_a, h_bknh)), no_images)
        return post_update(post_f, comb_f, f_bkh, h_bknh), pre_f


def draft_moe_config(cfg: V41Config) -> V41Config:
    """The stages' MoE: `dspark_n_routed_experts` experts, `dspark_num_experts_per_tok` picked."""
    return cfg.replace(n_routed_experts=cfg.dspark_n_routed_experts,
                       num_experts_per_tok=cfg.dspark_num_experts_per_tok)


def target_features(streams: Sequence[jax.Array]) -> jax.Array:
    """`[B,T,len(streams)·H]` from each target layer's streams `[B,T,N,H]`: the mean over the streams (fp32)."""
    return jnp.concatenate([jnp.mean(h.astype(jnp.float32), axis=2).astype(h.dtype) for h in streams], axis=-1)


def main_states(stages: Sequence[DSparkStage], features_btf: jax.Array) -> jax.Array:
    """`main_x [B,T,H]` from target features `[B,T,len(target layers)·H]`."""
    first = stages[0]
    return first.main_norm(first.main_proj(features_btf))


def context_keys(stages: Sequence[DSparkStage], main_x_bth: jax.Array, positions_bt: jax.Array) -> list[jax.Array]:
    """Each stage's context keys `[B,T,D]` for target tokens at `positions_bt`."""
    return [s.attn.context_keys(main_x_bth, positions_bt) for s in stages]


def context_visible(positions_bt: jax.Array, anchor_b: jax.Array, window: int) -> jax.Array:
    """`[B,T]` bool: context key at position t is visible to a block anchored at a iff `a − window ≤ t < a`."""
    a = anchor_b[:, None]
    return (positions_bt < a) & (positions_bt >= a - window)


def draft_states(stages: Sequence[DSparkStage], x_bkh: jax.Array, positions_bk: jax.Array,
                 contexts: Sequence[jax.Array], visible_bkt: jax.Array) -> jax.Array:
    """The block's collapsed states `[B,k,H]` before the final norm, from its input embeddings `[B,k,H]`."""
    b, k, h = x_bkh.shape
    n = stages[0].attn_hc.cfg.hc_mult
    h_bknh = jnp.broadcast_to(x_bkh[:, :, None, :], (b, k, n, h))
    pre_bkn = jnp.zeros((b, k, n), jnp.float32).at[..., 0].set(1.0)
    for stage, context in zip(stages, contexts):
        h_bknh, pre_bkn = stage(h_bknh, pre_bkn, positions_bk, context, visible_bkt)
    return collapse(pre_bkn, h_bknh)


def draft_heads(stages: Sequence[DSparkStage], state_bkh: jax.Array, previous_bk: jax.Array,
                confidence_from_normed: bool = False) -> tuple[jax.Array, jax.Array, jax.Array]:
    """`(normed states [B,k,H], Markov bias [B,k,V] fp32, confidence logits [B,k] fp32)` given each position's
    previous token. `confidence_from_normed` feeds the confidence head the normed state, as drafters trained
    with NeMo AutoModel expect; the release (and DeepInfer) feeds it the state before the norm."""
    last = stages[-1]
    normed = last.norm(state_bkh)
    transition, emb = last.markov_head(previous_bk)
    return normed, transition, last.confidence_head(normed if confidence_from_normed else state_bkh, emb)
