"""mHC's Sinkhorn normalisation as the model calls it: the GPU kernel where it applies, else the
pure-JAX reference (`dispatch.py`). Differentiated (training), it runs the reference: Pallas calls have
no derivative rules."""

from __future__ import annotations

import functools

import jax

from dsjax.kernels.dispatch import dispatch, over_slots
from dsjax.kernels.sinkhorn.reference import sinkhorn_reference
from dsjax.kernels.sinkhorn.triton import sinkhorn_gpu


def sinkhorn(comb: jax.Array, iters: int, eps: float, *, kernels: str = "auto") -> jax.Array:
    """`reference.sinkhorn_reference`'s result for `comb [B, ..., n, n]`, by the kernel `kernels` selects
    for the platform (under a mesh, on each device's rows: `dispatch.over_slots`)."""
    return over_slots(lambda comb: _sinkhorn(comb, iters, eps, kernels), dict(comb=comb))


@functools.partial(jax.custom_jvp, nondiff_argnums=(1, 2, 3))
def _sinkhorn(comb, iters, eps, kernels):
    return dispatch(functools.partial(sinkhorn_reference, comb, iters, eps), kernels=kernels,
                    gpu=lambda interpret: sinkhorn_gpu(comb, iters, eps, interpret=interpret))


@_sinkhorn.defjvp
def _sinkhorn_jvp(iters, eps, kernels, primals, tangents):
    return jax.jvp(lambda c: sinkhorn_reference(c, iters, eps), primals, tangents)
