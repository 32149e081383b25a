"""One place that decides how a kernel-backed operation runs: the Pallas kernel for the platform
being lowered for, chosen with `jax.lax.platform_dependent`, or the pure-JAX reference."""

from __future__ import annotations

import math
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from dsjax.parallel.rules import slot_axes


class CannotTile(ValueError):
    """This kernel cannot tile these shapes: raised by a kernel for shapes, storage or tiling it does
    not take, or a GPU without the instructions it needs. `dispatch` then takes the next kernel or the
    reference; any other error propagates. A ValueError, for callers of a kernel itself."""


def _tiles(kernel: Callable[[], jax.Array] | None) -> Callable[[], jax.Array] | None:
    """`kernel` if it can be traced for these shapes, else (it raised CannotTile) None.
    `platform_dependent` traces every branch on every platform, so an untileable kernel must be left
    out, not merely never lowered."""
    if kernel is None:
        return None
    try:
        jax.eval_shape(kernel)
    except CannotTile:
        return None
    return kernel


def _first_that_tiles(kernels: Sequence[Callable[[], jax.Array]]) -> Callable[[], jax.Array] | None:
    return next((k for k in map(_tiles, kernels) if k is not None), None)


def dispatch(reference: Callable[[], jax.Array], *, kernels: str,
             gpu: Callable[[bool], jax.Array] | Sequence[Callable[[bool], jax.Array]] = (),
             tpu: Callable[[], jax.Array] | None = None) -> jax.Array:
    """Run one operation. `kernels` is `ModelConfig.kernels`; `gpu(interpret)` and `tpu()` build the
    kernels' results (`gpu` may list several GPU kernels, most specialised first: the first that
    tiles the shapes runs; a kernel raises CannotTile where it does not). "auto" lowers the CUDA kernel
    for cuda, the TPU kernel for tpu and the reference for every other backend (CPU, ROCm, other
    plugins), and the reference wherever a kernel cannot tile the shapes; "reference" always uses the
    reference; "interpret" runs the GPU kernel interpreted on any backend. Under a mesh of several
    devices a kernel runs only inside a shard_map over all of its axes (`over_slots` makes one), the
    reference outside."""
    mesh = jax.sharding.get_abstract_mesh()
    # Inside a shard_map over every axis (the expert-parallel MoE) each device runs its own program, so a
    # kernel call is per device. Elsewhere under a mesh of several devices XLA partitions the reference;
    # a Pallas call would need a shard_map of its own (Pallas calls are not partitioned automatically).
    if kernels == "reference" or (not mesh.empty and mesh.size > 1 and not mesh.are_all_axes_manual):
        return reference()
    gpus = (gpu,) if callable(gpu) else tuple(gpu)
    if kernels == "interpret":
        return (_first_that_tiles([lambda g=g: g(True) for g in gpus]) or reference)()
    branches = {name: fn for name, fn in (("cuda", _first_that_tiles([lambda g=g: g(False) for g in gpus])),
                                          ("tpu", _tiles(tpu))) if fn is not None}
    if not branches:
        return reference()
    return jax.lax.platform_dependent(**branches, default=reference)


def over_slots(op: Callable[..., jax.Array], slots: dict, shared: dict | None = None) -> jax.Array:
    """`op(**slots, **shared)`, where every array in `slots` (pytrees allowed) leads with the cache-slot
    axis and so does the result. Under a mesh of several devices (outside a shard_map) it runs in a
    shard_map over the mesh axes that split the slots (`parallel.rules.slot_axes`), each device on its own
    slots, so that `dispatch` inside may take a kernel: Pallas calls are not partitioned automatically.
    Elsewhere, or when no slot axis divides the slots, `op` runs as it is. Non-array leaves (None, Python
    numbers) pass through as they are; arrays of `shared` reach every device whole."""
    shared = shared or {}
    mesh = jax.sharding.get_abstract_mesh()
    leaves, tree = jax.tree.flatten((slots, shared), is_leaf=lambda x: x is None)
    n_slot_leaves = len(jax.tree.flatten(slots, is_leaf=lambda x: x is None)[0])
    split = [i for i, x in enumerate(leaves) if isinstance(x, jax.Array)]
    lead = {leaves[i].shape[0] for i in split if i < n_slot_leaves}
    if mesh.empty or mesh.size == 1 or mesh.are_all_axes_manual or len(lead) != 1:
        return op(**slots, **shared)
    axes = slot_axes(mesh, lead.pop())
    if not axes:
        return op(**slots, **shared)
    ways = math.prod(mesh.shape[a] for a in axes)
    # Zero-sized arrays (an empty rope part, say) are rebuilt inside, not passed: XLA's SPMD partitioner
    # crashes (XLA:CPU, jax 0.11.2) on a shard_map operand that zero-sized-HLO elimination made a constant.
    empty = {i: leaves[i] for i in split if leaves[i].size == 0}
    passed = [i for i in split if i not in empty]
    specs = tuple(P(axes) if i < n_slot_leaves else P() for i in passed)

    def local(*values):
        inner = list(leaves)
        for i, v in zip(passed, values):
            inner[i] = v
        for i, x in empty.items():
            inner[i] = jnp.zeros(((x.shape[0] // ways if i < n_slot_leaves else x.shape[0]), *x.shape[1:]), x.dtype)
        local_slots, local_shared = jax.tree.unflatten(tree, inner)
        return op(**local_slots, **local_shared)

    return jax.shard_map(local, mesh=mesh, in_specs=specs, out_specs=P(axes), check_vma=False)(
        *(leaves[i] for i in passed))
