"""The grouped matmul over low-precision experts as the MoE calls it: a GPU kernel where one applies,
else the reference (`dispatch.py`). FP4 experts from `mosaic_gpu.MIN_ROWS` rows on: the Mosaic GPU kernel,
in tiles of many rows for prefill; below, and FP8 experts for decode, the Triton kernel. And the same
kernel for dense FP8 linears at decode (`dense_fp8_matmul`): a linear is one expert that every row uses."""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from dsjax.kernels.dispatch import CannotTile, dispatch
from dsjax.kernels.expert_matmul import mosaic_gpu
from dsjax.kernels.expert_matmul.reference import expert_matmul_reference
from dsjax.kernels.expert_matmul.triton import expert_matmul_gpu
from dsjax.numerics import einsum
from dsjax.quant import dequantize_fp8
from dsjax.stacked import StackedSlice, as_array

# Rows per expert above which dequantizing the experts once (reference) beats the Triton kernel, which
# reads an expert's codes again for every 16 of its rows; decode steps have a few rows per expert.
KERNEL_MAX_ROWS_PER_EXPERT = 64
# Where the Mosaic kernel's tiles read their rows: "copied" out first, or "aligned" (no tile copies). On the
# H200 (docs/benchmarks.md, 2026-12-05) "aligned" was slower in 8 of 12 cells at 32-256 tokens and faster in
# none by more than the noise. FP8 experts at decode: the Mosaic kernel measured 2-6% ahead of the Triton
# one in single runs (inside the runs' spread) while it rewrites the experts' scales on every call: Triton.
ROW_SOURCE = "copied"
FP8_MOSAIC = False


def expert_matmul(x_pk: jax.Array, w_enk: jax.Array | StackedSlice, scale: jax.Array | StackedSlice,
                  group_sizes_e: jax.Array, storage: str, block: tuple[int, int] = (128, 128), *,
                  code_layout: str = "checkpoint", kernels: str = "auto") -> jax.Array:
    """`reference.expert_matmul_reference`'s result, by the kernel `kernels` selects for the platform.
    Experts given as a `StackedSlice` (with their scales) are read in place by the kernel; the
    reference cuts their layer out. `code_layout`: FP4 codes as checkpoints hold them or repacked
    (`fp4_codes`), which the GPU kernels decode in fewer operations."""
    reference = lambda: expert_matmul_reference(x_pk, as_array(w_enk), as_array(scale),  # noqa: E731
                                                group_sizes_e, storage, block, code_layout=code_layout,
                                                kernels=kernels)
    gpu = []
    e = w_enk.shape[0]
    if isinstance(w_enk, StackedSlice) and isinstance(scale, StackedSlice):
        stacks = dict(w_enk=w_enk.stack, scale=scale.stack, layer=w_enk.index)
    else:
        stacks = dict(w_enk=as_array(w_enk), scale=as_array(scale))
    few_rows = x_pk.shape[0] <= KERNEL_MAX_ROWS_PER_EXPERT * e
    if (storage == "fp4" and x_pk.shape[0] >= mosaic_gpu.MIN_ROWS) or (
            storage == "fp8" and FP8_MOSAIC and few_rows and _mosaic_fp8_block(block)):
        block_m = mosaic_gpu.tile_rows(x_pk.shape[0], e)
        fp8_block = _mosaic_fp8_block(block) or 128
        gpu.append(lambda interpret: mosaic_gpu.expert_matmul_mosaic(
            x_pk, group_sizes_e=group_sizes_e, storage=storage, block_m=block_m, row_source=ROW_SOURCE,
            fp8_block=fp8_block, code_layout=code_layout, interpret=interpret, **stacks))
    if few_rows and (storage == "fp4" or tuple(block) == (128, 128)):
        gpu.append(lambda interpret: expert_matmul_gpu(x_pk, group_sizes_e=group_sizes_e, storage=storage,
                                                       code_layout=code_layout, interpret=interpret, **stacks))
    return dispatch(reference, kernels=kernels, gpu=gpu)


def _mosaic_fp8_block(block: tuple[int, int]) -> int | None:
    """The Mosaic kernel's `fp8_block` for FP8 scale blocks of `block`, or None where it reads no such blocks."""
    return block[0] if block[0] == block[1] and block[0] in mosaic_gpu.FP8_BLOCKS else None


# Where `dense_fp8_matmul` takes the kernel: up to DENSE_MAX_ROWS rows (decode) and for a linear of at least
# DENSE_MIN_CODES weights (per group). Measured on the H200 against XLA's dequantize-then-GEMM
# (`bench_kernels.py dense-fp8`, docs/benchmarks.md 2026-12-05): the kernel takes V4's and V4.1's q_b and o_b
# (32M-42M codes) from 0.073-0.105 ms to 0.035-0.081 ms at 1 and 32 rows and ties at 128 rows; on the linears
# of 4M-12M codes (q_a, the shared expert, o_a's groups), where XLA's fused GEMM takes 0.010-0.044 ms, it lost
# 12 of 16 cells (o_a at 32 rows, which it won, is left to XLA with the rest).
DENSE_MAX_ROWS = 32
DENSE_MIN_CODES = 1 << 24


def dense_fp8_matmul(x_gpk: jax.Array, w_gnk: jax.Array, scale: jax.Array, block: tuple[int, int] = (128, 128), *,
                     kernels: str = "auto", reference: Callable[[], jax.Array] | None = None,
                     max_rows: int | None = None, min_codes: int | None = None) -> jax.Array:
    """`[G, P, K] · [G, N, K]ᵀ → [G, P, N]`: G dense FP8 linears (e4m3 with a scale per `block`,
    `scale [G, ⌈N/b0⌉, ⌈K/b1⌉]`), each over its own P rows (G = 1: one linear; G > 1: a grouped
    projection such as attention's output). Up to `DENSE_MAX_ROWS` rows of linears of at least
    `DENSE_MIN_CODES` weights (each) on GPUs, with ue8m0 scales over
    128 × 128 blocks (V4) or 32 × 32 (V4.1), the Mosaic GPU expert kernel reads the codes once, as they are stored (each linear
    an expert that all its rows use), so no dequantized copy of the weight is written; elsewhere, and
    where it does not tile, the weight is dequantized to x's dtype for one batched matmul, or `reference()`
    if given (a caller's own form of the same product). `max_rows` and `min_codes` override the two."""
    g, p, k = x_gpk.shape
    if w_gnk.shape[0] != g or w_gnk.shape[2] != k:
        raise ValueError(f"dense_fp8_matmul: weights {w_gnk.shape} do not match inputs {x_gpk.shape} ([G, N, K] "
                         "against [G, P, K])")

    def dequantized():
        return einsum("gpk,gnk->gpn", x_gpk, dequantize_fp8(w_gnk, scale, x_gpk.dtype, block))

    def mosaic(interpret: bool) -> jax.Array:
        return dense_fp8_mosaic(x_gpk, w_gnk, scale, block, interpret=interpret)

    takes = (p <= (DENSE_MAX_ROWS if max_rows is None else max_rows)
             and w_gnk.shape[1] * k >= (DENSE_MIN_CODES if min_codes is None else min_codes)
             and _mosaic_fp8_block(block) is not None)
    return dispatch(reference or dequantized, kernels=kernels, gpu=[mosaic] if takes else [])


def dense_fp8_mosaic(x_gpk: jax.Array, w_gnk: jax.Array, scale: jax.Array, block: tuple[int, int] = (128, 128), *,
                     interpret: bool = False) -> jax.Array:
    """`dense_fp8_matmul` by the Mosaic GPU kernel alone (CannotTile where it does not apply): the G
    linears as G experts, P rows each, in tiles of up to `mosaic_gpu.MAX_DENSE_BLOCK_M` rows."""
    g, p, k = x_gpk.shape
    fp8_block = _mosaic_fp8_block(tuple(block))
    if fp8_block is None:
        raise CannotTile(f"dense_fp8_mosaic: the kernel reads square scale blocks of {mosaic_gpu.FP8_BLOCKS}, "
                         f"not {tuple(block)}")
    block_m = min(mosaic_gpu.MAX_DENSE_BLOCK_M, -(-p // 8) * 8)
    y = mosaic_gpu.expert_matmul_mosaic(x_gpk.reshape(g * p, k), w_gnk, scale, jnp.full((g,), p, jnp.int32),
                                        storage="fp8", block_m=block_m, fp8_block=fp8_block, interpret=interpret)
    return y.reshape(g, p, -1)
