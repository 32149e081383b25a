"""The MoE block: routed experts (top-k, hash or V4.1's image-aware routing) plus the shared expert."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from dsjax.config import HASH_MOE, IMAGE_MOE, TEXT_MOE, ModelConfig
from dsjax.layers.experts import RoutedExperts, SharedExpert
from dsjax.layers.router import Fp32TopKRouter, HashRouter, ImageAwareRouter, TopKRouter
from dsjax.layers.expert_parallel import expert_axis, routed_experts_parallel


class MoE(nnx.Module):
    def __init__(self, cfg: ModelConfig, mlp_type: str, *, rngs: nnx.Rngs, dtype=jnp.float32):
        routers = {HASH_MOE: HashRouter, IMAGE_MOE: ImageAwareRouter, TEXT_MOE: Fp32TopKRouter}
        router = routers.get(mlp_type, TopKRouter)
        self.gate = router(cfg, rngs=rngs, dtype=dtype)
        self.experts = RoutedExperts(cfg, rngs=rngs, dtype=dtype)
        self.shared_experts = SharedExpert(cfg, rngs=rngs, dtype=dtype)

    def __call__(self, x_bsh: jax.Array, token_ids_bs: jax.Array, record: dict | None = None) -> jax.Array:
        """`record`, if given, receives `expert_ids [B,S,k]` and, for top-k routing, `moe_balance`.
        `token_ids_bs` is what the router reads beside x: the token ids (hash routing) or, for V4.1's
        image-aware router, the image-token mask."""
        b, s, h = x_bsh.shape
        x_nh = x_bsh.reshape(b * s, h)
        weights_nk, idx_nk = self.gate(x_nh, token_ids_bs.reshape(-1))
        mesh = jax.sharding.get_abstract_mesh()
        if expert_axis(mesh) is not None:
            routed = routed_experts_parallel(self.experts, x_nh, weights_nk, idx_nk, mesh)
        else:
            routed = self.experts(x_nh, weights_nk, idx_nk)
        routed = routed.reshape(b, s, h)
        if record is not None:
            record["expert_ids"] = idx_nk.reshape(b, s, -1)
            if isinstance(self.gate, TopKRouter):
                record["moe_balance"] = balance_loss(self.gate.scores(x_nh), idx_nk)
        return routed + self.shared_experts(x_bsh)


def balance_loss(scores_ne: jax.Array, idx_nk: jax.Array) -> jax.Array:
    """DeepSeek-V3's sequence-wise balance loss over one batch: `Σ_e f_e·P_e`, where f_e is expert e's
    share of the N·k routing slots times E (1 when balanced) and P_e its mean normalised score."""
    n_experts = scores_ne.shape[-1]
    p_e = jnp.mean(scores_ne / jnp.sum(scores_ne, axis=-1, keepdims=True), axis=0)
    f_e = jnp.bincount(idx_nk.reshape(-1), length=n_experts) * (n_experts / idx_nk.size)
    return jnp.sum(jax.lax.stop_gradient(f_e) * p_e)
