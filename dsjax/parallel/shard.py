"""Placing a model's variables on a mesh by the rules table."""

from __future__ import annotations

import jax
from flax import nnx

from dsjax.parallel.rules import param_sharding


def shard_model(model: nnx.Module, mesh: jax.sharding.Mesh) -> nnx.Module:
    """The same model with every variable placed on `mesh` as `dsjax.parallel.rules` says. Run it under
    `jax.set_mesh(mesh)` so that the MoE takes the expert-parallel path. (To load a checkpoint straight onto a mesh, convert it and pass
    `mesh=` to `load_model`: that never holds a whole copy.)"""
    graphdef, state = nnx.split(model)
    flat = list(nnx.to_flat_state(state))
    for path, var in flat:
        var.set_value(jax.device_put(var.get_value(), param_sharding(mesh, path, var)))
    return nnx.merge(graphdef, nnx.from_flat_state(flat))
