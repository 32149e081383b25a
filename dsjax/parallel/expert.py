"""Expert parallelism: routed experts split over the mesh's expert axis, tokens brought to them.

Inside `jax.shard_map` each device holds E/ep experts and 1/(dp·ep) of the tokens. This path runs on
every backend (XLA:CPU has no ragged all-to-all): the tokens of an ep group are all-gathered with their
routing, each device runs the pairs routed to its own experts through the grouped matmuls, and the
partial sums are reduce-scattered back to the tokens' owners. It is dropless: results equal the
single-device model up to the order of the final sum.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from dsjax.layers.experts import RoutedExperts, dense_experts, grouped_mlp
from dsjax.parallel.rules import mesh_axes


def expert_axis(mesh) -> str | None:
    """The mesh axis the routed experts are split over, or None (one device, or no expert axis)."""
    axes = mesh_axes(mesh, "expert")
    return axes[0] if axes else None


def routed_experts_parallel(experts: RoutedExperts, x_nh: jax.Array, weights_nk: jax.Array,
                            idx_nk: jax.Array, mesh) -> jax.Array:
    """`experts(x_nh, weights_nk, idx_nk)` with the experts split over `mesh`'s expert axis."""
    ep = expert_axis(mesh)
    tokens = mesh_axes(mesh, "tokens")
    cfg = experts.cfg
    if cfg.n_routed_experts % mesh.shape[ep]:
        raise ValueError(f"the expert axis ({mesh.shape[ep]}) must divide n_routed_experts ({cfg.n_routed_experts})")
    e_local = cfg.n_routed_experts // mesh.shape[ep]
    n = x_nh.shape[0]
    pad = -n % math.prod(mesh.shape[a] for a in tokens)
    if pad:  # padding rows carry weight 0 to expert 0: they add nothing and are cut off below
        x_nh = jnp.pad(x_nh, ((0, pad), (0, 0)))
        weights_nk = jnp.pad(weights_nk, ((0, pad), (0, 0)))
        idx_nk = jnp.pad(idx_nk, ((0, pad), (0, 0)))
    stored = [experts.stored("gate_up_proj"), experts.stored("down_proj")]
    quantized = experts.storage is not None

    def local(x, w, idx, gate_up, down, *scales):
        x_all = jax.lax.all_gather(x, ep, axis=0, tiled=True)
        w_all = jax.lax.all_gather(w, ep, axis=0, tiled=True)
        idx_all = jax.lax.all_gather(idx, ep, axis=0, tiled=True)
        gate_up_scale, down_scale = scales if quantized else (None, None)
        y_all = grouped_mlp(x_all, w_all, idx_all,
                            dense_experts(gate_up, gate_up_scale, experts.storage, cfg, x.dtype),
                            dense_experts(down, down_scale, experts.storage, cfg, x.dtype), cfg,
                            first_expert=jax.lax.axis_index(ep) * e_local)
        return jax.lax.psum_scatter(y_all, ep, scatter_dimension=0, tiled=True)

    token_spec, expert_spec = P(tokens), P(ep)
    args = [x_nh, weights_nk, idx_nk, stored[0][0], stored[1][0]]
    if quantized:
        args += [stored[0][1], stored[1][1]]
    y = jax.shard_map(local, mesh=mesh, in_specs=(token_spec,) * 3 + (expert_spec,) * (len(args) - 3),
                      out_specs=token_spec)(*args)
    return y[:n]
