"""The V4 MoE block: routed experts (top-k or hash routed) plus the shared expert."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from dsjax.config import HASH_MOE, ModelConfig
from dsjax.layers.experts import RoutedExperts, SharedExpert
from dsjax.layers.router import HashRouter, TopKRouter


class MoE(nnx.Module):
    def __init__(self, cfg: ModelConfig, mlp_type: str, *, rngs: nnx.Rngs, dtype=jnp.float32):
        router = HashRouter if mlp_type == HASH_MOE else TopKRouter
        self.gate = router(cfg, rngs=rngs, dtype=dtype)
        self.experts = RoutedExperts(cfg, rngs=rngs, dtype=dtype)
        self.shared_experts = SharedExpert(cfg, rngs=rngs, dtype=dtype)

    def __call__(self, x_bsh: jax.Array, token_ids_bs: jax.Array) -> jax.Array:
        b, s, h = x_bsh.shape
        x_nh = x_bsh.reshape(b * s, h)
        weights_nk, idx_nk = self.gate(x_nh, token_ids_bs.reshape(-1))
        routed = self.experts(x_nh, weights_nk, idx_nk).reshape(b, s, h)
        return routed + self.shared_experts(x_bsh)
