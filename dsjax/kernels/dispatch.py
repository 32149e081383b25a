"""One place that decides how a kernel-backed operation runs: the Pallas kernel for the platform
being lowered for, chosen with `jax.lax.platform_dependent`, or the pure-JAX reference."""

from __future__ import annotations

from typing import Callable

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


def dispatch(reference: Callable[[], jax.Array], *, kernels: str,
             gpu: Callable[[bool], jax.Array] | None = None, tpu: Callable[[], jax.Array] | None = None) -> jax.Array:
    """Run one operation. `kernels` is `ModelConfig.kernels`; `gpu(interpret)` and `tpu()` build the
    kernels' results. "auto" lowers the CUDA kernel for cuda, the TPU kernel for tpu and the reference
    for every other backend (CPU, ROCm, other plugins), and the reference wherever a kernel cannot
    tile the shapes or a mesh of several devices is in use; "reference" always uses the reference;
    "interpret" runs the GPU kernel interpreted on any backend."""
    mesh = jax.sharding.get_abstract_mesh()
    if kernels == "reference" or (not mesh.empty and mesh.size > 1):
        # Under a mesh of several devices XLA partitions the reference; a Pallas call would need a
        # shard_map over the slots (not done yet: Mosaic calls cannot be partitioned automatically).
        return reference()
    if kernels == "interpret":
        interpreted = _tiles(gpu and (lambda: gpu(True)))
        return (interpreted or reference)()
    branches = {name: fn for name, fn in (("cuda", _tiles(gpu and (lambda: gpu(False)))), ("tpu", _tiles(tpu)))
                if fn is not None}
    if not branches:
        return reference()
    return jax.lax.platform_dependent(**branches, default=reference)
