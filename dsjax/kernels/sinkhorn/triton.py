"""mHC's Sinkhorn normalisation as a Pallas kernel for GPUs (Triton lowering; interpreted on CPU).

A program holds `block` whole `[n, n]` matrices and runs every round on them in registers: one launch
per normalisation, as XLA's fused unrolled rounds had, but a program XLA compiles in well under a second
(its priority fusion took 58 s over the unrolled rounds of the demo's decode step on an H200).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from dsjax.kernels.dispatch import CannotTile
from dsjax.kernels.sinkhorn.reference import rounds


def _kernel(c_ref, o_ref, *, iters, eps):
    o_ref[...] = rounds(c_ref[...], iters, eps)


@functools.partial(jax.jit, static_argnames=("iters", "eps", "block", "interpret"))
def sinkhorn_gpu(comb: jax.Array, iters: int, eps: float, *, block: int = 32, interpret: bool = False) -> jax.Array:
    """`reference.sinkhorn_reference` as a Pallas kernel (same arguments and result) for float32
    `comb [..., n, n]` with n a power of two (Triton's blocks are); raises CannotTile otherwise."""
    n = comb.shape[-1]
    if comb.ndim < 2 or comb.shape[-2] != n or n & (n - 1) or comb.dtype != jnp.float32:
        raise CannotTile(f"sinkhorn_gpu: takes float32 [..., n, n] with n a power of two, got "
                         f"{comb.dtype} {comb.shape}")
    if block < 1 or block & (block - 1):
        raise ValueError(f"sinkhorn_gpu: block must be a power of two, got {block}")
    lead = comb.shape[:-2]
    m = 1
    for d in lead:
        m *= d
    block = min(block, pl.next_power_of_2(max(m, 1)))
    flat = comb.reshape(m, n, n)
    padded = -(-m // block) * block
    if padded != m:  # whole matrices of ones: they normalise without dividing by zero, and are cut off
        flat = jnp.concatenate([flat, jnp.ones((padded - m, n, n), flat.dtype)])
    out = pl.pallas_call(
        functools.partial(_kernel, iters=iters, eps=eps),
        grid=(padded // block,),
        in_specs=[pl.BlockSpec((block, n, n), lambda i: (i, 0, 0))],
        out_specs=pl.BlockSpec((block, n, n), lambda i: (i, 0, 0)),
        out_shape=jax.ShapeDtypeStruct((padded, n, n), jnp.float32),
        compiler_params=pltriton.CompilerParams(num_warps=1, num_stages=1),
        interpret=interpret, name="dsjax_sinkhorn",
    )(flat)
    return out[:m].reshape(comb.shape)
