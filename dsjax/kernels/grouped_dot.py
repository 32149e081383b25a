"""The MoE's grouped matmul of float rows sorted by expert against float experts (`[E, K, N]`):
tokamax's ragged_dot, in the Mosaic GPU tiling measured fastest on the H200 where the groups are large
(prefill), else as tokamax chooses (`docs/kernels.md`); XLA's ragged_dot as the reference."""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

from dsjax.kernels.dispatch import CannotTile, dispatch
from dsjax.numerics import precision

# From `scripts/bench_kernels.py grouped-matmul` on the H200 (docs/benchmarks.md, 2026-12-03, 21st
# session): the MoE's gate_up at 65,536 tokens in 23.1 ms (572 TFLOP/s) against 45.7 ms in tokamax's
# Hopper default (64 × 64 × 128 tiles, 2 stages).
PREFILL_TILING = dict(block_m=128, block_n=128, block_k=64, num_stages=4, persistent=True, grid_tile_width=8,
                      split_k=1)
# Below this many rows per expert on average (decode, short chunks) tokamax's own choice stays.
MIN_ROWS_PER_EXPERT = 64
# The GPU kernels get a row count that is a multiple of this: the backward of tokamax's Mosaic GPU kernel (the
# weights' gradient, rows contracted) loads the rows through TMA in tiles of 64 and fails to lower otherwise
# (tokamax 0.1.x; seen training at 8 × 511 × 2 = 8,176 rows, docs/benchmarks.md, 36th session).
ROW_MULTIPLE = 128


def padded_rows(matmul: Callable[[jax.Array], jax.Array], x_pk: jax.Array, multiple: int = ROW_MULTIPLE) -> jax.Array:
    """`matmul(x)` computed on x with zero rows appended up to a multiple of `multiple`, cut back to x's rows. The
    rows appended lie past `Σ group_sizes`, in no group, so neither the product nor the gradients see them."""
    p = x_pk.shape[0]
    pad = -p % multiple
    if pad == 0:
        return matmul(x_pk)
    return matmul(jnp.pad(x_pk, ((0, pad), (0, 0))))[:p]


def grouped_dot(x_pk: jax.Array, w_ekn: jax.Array, group_sizes_e: jax.Array, *, kernels: str = "auto") -> jax.Array:
    """`y[p] = x[p] @ w[expert(p)]` in x's dtype: the first `group_sizes[0]` rows against expert 0, and so
    on; rows past `Σ group_sizes` are undefined. `kernels` as `dispatch` reads it."""
    import tokamax  # over a second to import; a model imports it when built, ahead of any trace (`RoutedExperts`)

    def run(implementation, x=x_pk):
        return tokamax.ragged_dot(x, w_ekn.astype(x.dtype), group_sizes_e.astype("int32"),
                                  precision=precision(x), preferred_element_type=x.dtype,
                                  implementation=implementation)

    def tuned(interpret: bool) -> jax.Array:
        from tokamax._src.ops.ragged_dot.pallas_mosaic_gpu import Config, PallasMosaicGpuRaggedDot

        if interpret:
            raise CannotTile("tokamax's Mosaic GPU kernel has no interpreted form")
        try:
            return padded_rows(lambda x: run([PallasMosaicGpuRaggedDot(config=Config(**PREFILL_TILING))], x), x_pk)
        except NotImplementedError as e:  # not a Hopper GPU, or shapes the kernel does not take
            raise CannotTile(str(e)) from None

    def tokamax_choice(interpret: bool) -> jax.Array:  # Mosaic GPU, else Triton, else XLA: tokamax's order
        if interpret:
            raise CannotTile("tokamax's own choice has no interpreted form")
        return padded_rows(lambda x: run(None, x), x_pk)

    large = x_pk.shape[0] >= MIN_ROWS_PER_EXPERT * w_ekn.shape[0]
    return dispatch(lambda: run("xla"), kernels=kernels, gpu=[tuned, tokamax_choice] if large else [tokamax_choice])
