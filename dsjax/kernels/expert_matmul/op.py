"""The grouped matmul over low-precision experts as the MoE calls it: a GPU kernel where one applies,
else the reference (`dispatch.py`). FP4 experts from `mosaic_gpu.MIN_ROWS` rows on: the Mosaic GPU kernel,
in tiles of many rows for prefill; below, and FP8 experts for decode, the Triton kernel."""

from __future__ import annotations

import jax

from dsjax.kernels.dispatch import dispatch
from dsjax.kernels.expert_matmul import mosaic_gpu
from dsjax.kernels.expert_matmul.reference import expert_matmul_reference
from dsjax.kernels.expert_matmul.triton import expert_matmul_gpu
from dsjax.stacked import StackedSlice, as_array

# Rows per expert above which dequantizing the experts once (reference) beats the Triton kernel, which
# reads an expert's codes again for every 16 of its rows; decode steps have a few rows per expert.
KERNEL_MAX_ROWS_PER_EXPERT = 64


def expert_matmul(x_pk: jax.Array, w_enk: jax.Array | StackedSlice, scale: jax.Array | StackedSlice,
                  group_sizes_e: jax.Array, storage: str, block: tuple[int, int] = (128, 128), *,
                  kernels: str = "auto") -> jax.Array:
    """`reference.expert_matmul_reference`'s result, by the kernel `kernels` selects for the platform.
    Experts given as a `StackedSlice` (with their scales) are read in place by the kernel; the
    reference cuts their layer out."""
    reference = lambda: expert_matmul_reference(x_pk, as_array(w_enk), as_array(scale),  # noqa: E731
                                                group_sizes_e, storage, block, kernels=kernels)
    gpu = []
    e = w_enk.shape[0]
    if isinstance(w_enk, StackedSlice) and isinstance(scale, StackedSlice):
        stacks = dict(w_enk=w_enk.stack, scale=scale.stack, layer=w_enk.index)
    else:
        stacks = dict(w_enk=as_array(w_enk), scale=as_array(scale))
    if storage == "fp4" and x_pk.shape[0] >= mosaic_gpu.MIN_ROWS:
        block_m = mosaic_gpu.tile_rows(x_pk.shape[0], e)
        gpu.append(lambda interpret: mosaic_gpu.expert_matmul_mosaic(x_pk, group_sizes_e=group_sizes_e, block_m=block_m,
                                                                     interpret=interpret, **stacks))
    few_rows = x_pk.shape[0] <= KERNEL_MAX_ROWS_PER_EXPERT * e
    if few_rows and (storage == "fp4" or tuple(block) == (128, 128)):
        gpu.append(lambda interpret: expert_matmul_gpu(x_pk, group_sizes_e=group_sizes_e, storage=storage,
                                                       interpret=interpret, **stacks))
    return dispatch(reference, kernels=kernels, gpu=gpu)
