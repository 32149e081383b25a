"""The grouped matmul over low-precision experts as the MoE calls it: the GPU kernel where it applies,
else the reference (`dispatch.py`)."""

from __future__ import annotations

import functools

import jax

from dsjax.kernels.dispatch import dispatch
from dsjax.kernels.expert_matmul.gpu import expert_matmul_gpu
from dsjax.kernels.expert_matmul.reference import expert_matmul_reference

# Rows per expert above which dequantizing the experts once (reference) beats the kernel, which reads
# an expert's codes again for every 16 of its rows; decode steps have a few rows per expert.
KERNEL_MAX_ROWS_PER_EXPERT = 64


def expert_matmul(x_pk: jax.Array, w_enk: jax.Array, scale: jax.Array, group_sizes_e: jax.Array, storage: str,
                  block: tuple[int, int] = (128, 128), *, kernels: str = "auto") -> jax.Array:
    """`reference.expert_matmul_reference`'s result, by the kernel `kernels` selects for the platform."""
    reference = functools.partial(expert_matmul_reference, x_pk, w_enk, scale, group_sizes_e, storage, block)
    gpu = ()
    few_rows = x_pk.shape[0] <= KERNEL_MAX_ROWS_PER_EXPERT * w_enk.shape[0]
    if few_rows and (storage == "fp4" or tuple(block) == (128, 128)):
        gpu = lambda interpret: expert_matmul_gpu(x_pk, w_enk, scale, group_sizes_e, storage,  # noqa: E731
                                                  interpret=interpret)
    return dispatch(reference, kernels=kernels, gpu=gpu)
