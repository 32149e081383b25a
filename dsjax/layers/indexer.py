"""The lightning indexer: scores compressed entries per query and keeps the top-k causally visible ones."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from dsjax.cache import CompressorState, num_entries
from dsjax.config import ModelConfig
from dsjax.kernels.indexer.op import index_scores
from dsjax.layers.compression import Compressor, Selection, entry_visible
from dsjax.layers.linear import Linear
from dsjax.layers.rope import apply_rope, rope_table
from dsjax.layers.topk import top_picks
from dsjax.numerics import einsum


class IndexerScorer(nnx.Module):
    """Per-query head weights `w[b,s,h] = weights_proj(x)·nI^-0.5` (may be negative)."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, dtype=jnp.float32):
        self.weights_proj = Linear(cfg.hidden_size, cfg.index_n_heads, rngs=rngs, dtype=dtype)

    def head_weights(self, x_bsh: jax.Array) -> jax.Array:
        """`w [B, S, nI]` in fp32."""
        w_bsh = self.weights_proj(x_bsh).astype(jnp.float32)
        return w_bsh * (w_bsh.shape[-1] ** -0.5)

    def __call__(self, q_bshc: jax.Array, keys_btc: jax.Array, x_bsh: jax.Array) -> jax.Array:
        """`score[b,s,t] = Σ_h w[b,s,h] · relu(q[b,s,h]·k[b,t]) · c^-0.5`, all in fp32."""
        c = q_bshc.shape[-1]
        dots_bsht = einsum("bshc,btc->bsht", q_bshc.astype(jnp.float32), keys_btc.astype(jnp.float32))
        s_bsht = jax.nn.relu(dots_bsht) * (c ** -0.5)
        return einsum("bsht,bsh->bst", s_bsht, self.head_weights(x_bsh))


class Indexer(Compressor):
    """Its own overlapping compressor at `index_head_dim`, queries from the attention's `q_res`, top-k pick."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, dtype=jnp.float32):
        super().__init__(cfg, cfg.index_head_dim, cfg.compress_rate_csa, overlap=True, rngs=rngs, dtype=dtype)
        self.kernels = "auto"  # a run option (`dsjax.model.with_kernels`)
        # FP8 like the attention's own projections; the compressor's and weights_proj stay unquantized.
        self.q_b_proj = Linear(cfg.q_lora_rank, cfg.index_n_heads * cfg.index_head_dim, rngs=rngs, dtype=dtype,
                               quant=cfg.quantization)
        self.scorer = IndexerScorer(cfg, rngs=rngs, dtype=dtype)

    def queries(self, q_res_bsr: jax.Array, positions_bs: jax.Array) -> jax.Array:
        """Index queries `[B, S, nI, c]` from the attention's `q_res`, rotated at the token position."""
        b, s, _ = q_res_bsr.shape
        q_bshc = self.q_b_proj(q_res_bsr).reshape(b, s, self.cfg.index_n_heads, self.width)
        cos, sin = rope_table(self.cfg.rope_compress, self.cfg.head_dim, positions_bs, q_bshc.dtype)
        return apply_rope(q_bshc, cos[:, :, None], sin[:, :, None])

    def scores(self, x_bsh, q_res_bsr, positions_bs, keys_btc=None):
        """Index scores `[B,S,T]` with causally invisible entries at −inf (keys default to x's own)."""
        if keys_btc is None:
            keys_btc = self.compress(x_bsh)
        score_bst = self.scorer(self.queries(q_res_bsr, positions_bs), keys_btc, x_bsh)
        visible = entry_visible(positions_bs, keys_btc.shape[1], self.rate)
        return jnp.where(visible, score_bst, -jnp.inf), visible

    def __call__(self, x_bsh, q_res_bsr, positions_bs) -> jax.Array:
        """`[B,S,T]` bool: the ≤ index_topk visible entries with the highest scores, per query."""
        return self.select(*self.scores(x_bsh, q_res_bsr, positions_bs))

    def extend(self, x_bch: jax.Array, q_res_bcr: jax.Array, positions_bc: jax.Array, start_b: jax.Array,
               n_valid_b: jax.Array, state: CompressorState) -> tuple[Selection, CompressorState]:
        """Cached form for the sparse attention operations: each query's top `min(index_topk, T)` visible
        entries as `Selection.idx_bck [B, C, k]` (in increasing order, −1 where fewer are visible), and
        the new key state. Scores go through `kernels.indexer.index_scores` over the keys in their storage
        (decode and prefill chunks alike), the pick through `layers.topk.top_picks`."""
        state = self.compress_into(x_bch, state, start_b, n_valid_b)
        score_bct = index_scores(self.queries(q_res_bcr, positions_bc), self.scorer.head_weights(x_bch),
                                 state.entries, num_entries(positions_bc + 1, self.rate), self.width ** -0.5,
                                 kernels=self.kernels)
        with jax.named_scope("topk"):
            idx_bck = top_picks(score_bct, self.cfg.index_topk)
        return Selection(idx_bck=idx_bck), state

    def distillation_loss(self, x_bsh, q_res_bsr, positions_bs, q_bshd, entries_btd, scale: float) -> jax.Array:
        """The indexer's training objective (`distillation_kl`) on its own scores of detached inputs, so only
        the indexer learns."""
        sg = jax.lax.stop_gradient
        score_bst, visible_bst = self.scores(sg(x_bsh), sg(q_res_bsr), positions_bs)
        return distillation_kl(score_bst, visible_bst, q_bshd, entries_btd, scale)

    def select(self, score_bst: jax.Array, visible: jax.Array) -> jax.Array:
        """Top `min(index_topk, T)` of each query's scores, restricted to visible entries."""
        n_entries = score_bst.shape[-1]
        k = min(self.cfg.index_topk, n_entries)
        if k == 0:
            return visible
        _, top_bsk = jax.lax.top_k(score_bst, k)
        picked = jnp.zeros(score_bst.shape, jnp.bool_)
        picked = jax.vmap(jax.vmap(lambda row, idx: row.at[idx].set(True)))(picked, top_bsk)
        # Picks past the visible count (−inf scores) are dropped, as the reference turns them into −1.
        return picked & visible


def distillation_kl(score_bst: jax.Array, visible_bst: jax.Array, q_bshd: jax.Array, entries_btd: jax.Array,
                    scale: float) -> jax.Array:
    """DeepSeek-V3.2's DSA indexer objective: KL(target ‖ softmax(index scores)) over the visible entries, mean
    over queries that see any. The target, the main attention's head-mean distribution over the same entries,
    is detached: the loss trains only what produced `score_bst`."""
    sg = jax.lax.stop_gradient
    logits_bhst = einsum("bshd,btd->bhst", sg(q_bshd), sg(entries_btd)).astype(jnp.float32) * scale
    logits_bhst = jnp.where(visible_bst[:, None], logits_bhst, -jnp.inf)
    any_bs = jnp.any(visible_bst, axis=-1)
    safe = any_bs[..., None]
    target_bst = jnp.mean(jax.nn.softmax(jnp.where(safe[:, None], logits_bhst, 0.0), axis=-1), axis=1)
    score_bst = jnp.where(visible_bst, score_bst, -jnp.inf)
    log_q_bst = jax.nn.log_softmax(jnp.where(safe, score_bst, 0.0), axis=-1)
    log_q_bst = jnp.where(visible_bst, log_q_bst, 0.0)
    terms = jnp.where(visible_bst & (target_bst > 0),
                      target_bst * (jnp.log(jnp.where(target_bst > 0, target_bst, 1.0)) - log_q_bst), 0.0)
    kl_bs = jnp.sum(terms, axis=-1)
    return jnp.sum(jnp.where(any_bs, kl_bs, 0.0)) / jnp.maximum(jnp.sum(any_bs), 1)
