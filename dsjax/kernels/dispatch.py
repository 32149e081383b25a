"""One place that decides how a kernel-backed operation runs: the Pallas kernel for the platform
being lowered for, chosen with `jax.lax.platform_dependent`, or the pure-JAX reference."""

from __future__ import annotations

from typing import Callable

import jax


def dispatch(reference: Callable[[], jax.Array], *, kernels: str, gpu: Callable[[bool], jax.Array] | None,
             tpu: Callable[[], jax.Array] | None = None) -> jax.Array:
    """Run one operation. `kernels` is `ModelConfig.kernels`; `gpu(interpret)` / `tpu()` build the
    kernel's result, or are None where the kernel cannot take these shapes. "auto" lowers the CUDA
    kernel for cuda, the TPU kernel for tpu and the reference for everything else (CPU, ROCm, other
    plugins): `platform_dependent` lowers only the branch of the platform being compiled for, so a
    Pallas call never reaches a backend that cannot compile it."""
    if kernels == "reference":
        return reference()
    if kernels == "interpret":
        return gpu(True) if gpu is not None else reference()
    branches = {}
    if gpu is not None:
        branches["cuda"] = lambda: gpu(False)
    if tpu is not None:
        branches["tpu"] = tpu
    if not branches:
        return reference()
    return jax.lax.platform_dependent(**branches, default=reference)
