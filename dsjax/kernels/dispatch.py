"""One place that decides how a kernel-backed operation runs: the Pallas kernel for the platform
being lowered for, chosen with `jax.lax.platform_dependent`, or the pure-JAX reference."""

from __future__ import annotations

from typing import Callable, Sequence

import jax


def _tiles(kernel: Callable[[], jax.Array] | None) -> Callable[[], jax.Array] | None:
    """`kernel` if it can be traced for these shapes (kernels raise ValueError on shapes they cannot
    tile), else None. `platform_dependent` traces every branch on every platform, so an untileable
    kernel must be left out, not merely never lowered."""
    if kernel is None:
        return None
    try:
        jax.eval_shape(kernel)
    except ValueError:
        return None
    return kernel


def _first_that_tiles(kernels: Sequence[Callable[[], jax.Array]]) -> Callable[[], jax.Array] | None:
    return next((k for k in map(_tiles, kernels) if k is not None), None)


def dispatch(reference: Callable[[], jax.Array], *, kernels: str,
             gpu: Callable[[bool], jax.Array] | Sequence[Callable[[bool], jax.Array]] = (),
             tpu: Callable[[], jax.Array] | None = None) -> jax.Array:
    """Run one operation. `kernels` is `ModelConfig.kernels`; `gpu(interpret)` and `tpu()` build the
    kernels' results (`gpu` may list several GPU kernels, most specialised first: the first that
    tiles the shapes runs). "auto" lowers the CUDA kernel for cuda, the TPU kernel for tpu and the reference
    for every other backend (CPU, ROCm, other plugins), and the reference wherever a kernel cannot
    tile the shapes or a mesh of several devices is in use; "reference" always uses the reference;
    "interpret" runs the GPU kernel interpreted on any backend. Under a mesh of several devices the kernels
    run only inside a shard_map over all of its axes."""
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
