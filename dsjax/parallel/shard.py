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


def on_mesh(model: nnx.Module, mesh: jax.sharding.Mesh | None) -> nnx.Module:
    """`model` placed on `mesh` (`shard_model`); as it is without one."""
    return model if mesh is None else shard_model(model, mesh)


def abstract_on_mesh(state: nnx.State, mesh: jax.sharding.Mesh) -> nnx.State:
    """`state` (e.g. of `nnx.eval_shape`) as ShapeDtypeStructs carrying the shardings the rules give them
    on `mesh`: what ahead-of-time lowering for that mesh takes, with nothing allocated."""
    def place(path, var):
        v = var.get_value()
        return var.replace(jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=param_sharding(mesh, path, var)))

    return nnx.from_flat_state([(path, place(path, var)) for path, var in nnx.to_flat_state(state)])
