"""Expert routers: learned top-k (with a selection-only correction bias) and the hash router (`tid2eid`).

Both weight the chosen experts by the raw scores, renormalised to sum 1 and scaled by
`routed_scaling_factor`; the correction bias only influences which experts are chosen.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from dsjax.config import ModelConfig
from dsjax.layers.variables import Buffer
from dsjax.numerics import einsum


def score(logits: jax.Array, scoring_func: str) -> jax.Array:
    if scoring_func == "sqrtsoftplus":
        return jnp.sqrt(jax.nn.softplus(logits))
    if scoring_func == "sigmoid":
        return jax.nn.sigmoid(logits)
    raise ValueError(f"unknown scoring_func {scoring_func!r}")


class _Router(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, dtype=jnp.float32):
        self.cfg = cfg
        self.weight = nnx.Param((0.02 * jax.random.normal(rngs.params(), (cfg.n_routed_experts, cfg.hidden_size)))
                                .astype(dtype))

    def scores(self, x_nh: jax.Array) -> jax.Array:
        logits = einsum("nh,eh->ne", x_nh, self.weight[...].astype(x_nh.dtype))
        return score(logits, self.cfg.scoring_func)

    def weigh(self, scores_ne: jax.Array, idx_nk: jax.Array) -> jax.Array:
        w_nk = jnp.take_along_axis(scores_ne, idx_nk, axis=-1)
        w_nk = w_nk / (jnp.sum(w_nk, axis=-1, keepdims=True) + 1e-20)
        return w_nk * self.cfg.routed_scaling_factor


class TopKRouter(_Router):
    """Selects `top_k(score + e_score_correction_bias)`; weights by the unbiased scores."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, dtype=jnp.float32):
        super().__init__(cfg, rngs=rngs, dtype=dtype)
        self.e_score_correction_bias = Buffer(jnp.zeros((cfg.n_routed_experts,), jnp.float32))

    def __call__(self, x_nh: jax.Array, token_ids_n: jax.Array):
        scores_ne = self.scores(x_nh)
        _, idx_nk = jax.lax.top_k(scores_ne + self.e_score_correction_bias[...], self.cfg.num_experts_per_tok)
        return self.weigh(scores_ne, idx_nk), idx_nk


class HashRouter(_Router):
    """Selects the fixed experts `tid2eid[token_id]`; weights by the learned scores."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, dtype=jnp.float32):
        super().__init__(cfg, rngs=rngs, dtype=dtype)
        self.tid2eid = Buffer(jnp.zeros((cfg.vocab_size, cfg.num_experts_per_tok), jnp.int32))

    def __call__(self, x_nh: jax.Array, token_ids_n: jax.Array):
        idx_nk = jnp.take(self.tid2eid[...], token_ids_n, axis=0, mode="clip")
        return self.weigh(self.scores(x_nh), idx_nk), idx_nk


class Fp32TopKRouter(TopKRouter):
    """`TopKRouter` with fp32 logits whatever the activations' dtype (DeepSeek-V4.1's routers; alone, its DSpark
    stages', which route no image tokens)."""

    def scores(self, x_nh: jax.Array) -> jax.Array:
        logits = einsum("nh,eh->ne", x_nh.astype(jnp.float32), self.weight[...].astype(jnp.float32))
        return score(logits, self.cfg.scoring_func)


class ImageAwareRouter(Fp32TopKRouter):
    """DeepSeek-V4.1's router: fp32 logits, and selection biased by `bias_vl` for image tokens and by
    `e_score_correction_bias` for text (the weights stay the unbiased scores)."""

    def __init__(self, cfg, *, rngs: nnx.Rngs, dtype=jnp.float32):
        super().__init__(cfg, rngs=rngs, dtype=dtype)
        self.bias_vl = Buffer(jnp.zeros((cfg.n_routed_experts,), jnp.float32))

    def __call__(self, x_nh: jax.Array, image_n: jax.Array):
        scores_ne = self.scores(x_nh)
        bias_ne = jnp.where(image_n.astype(bool)[:, None], self.bias_vl[...], self.e_score_correction_bias[...])
        _, idx_nk = jax.lax.top_k(scores_ne + bias_ne, self.cfg.num_experts_per_tok)
        return self.weigh(scores_ne, idx_nk), idx_nk
