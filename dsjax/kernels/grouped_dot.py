"""The MoE's grouped matmul of float rows sorted by expert against float experts (`[E, K, N]`):
tokamax's ragged_dot, in the Mosaic GPU tiling measured fastest on the H200 where the groups are large
(prefill), else as tokamax chooses (`docs/kernels.md`)."""

from __future__ import annotations

import jax

from dsjax.kernels.dispatch import CannotTile, dispatch
from dsjax.numerics import precision

# From `scripts/bench_kernels.py grouped-matmul` on the H200 (docs/benchmarks.md, 2026-12-03, 21st
# session): the MoE's gate_up at 65,536 tokens in 23.1 ms (572 TFLOP/s) against 45.7 ms in tokamax's
# Hopper default (64 × 64 × 128 tiles, 2 stages).
PREFILL_TILING = dict(block_m=128, block_n=128, block_k=64, num_stages=4, persistent=True, grid_tile_width=8,
                      split_k=1)
# Below this many rows per expert on average (decode, short chunks) tokamax's own choice stays.
MIN_ROWS_PER_EXPERT = 64


def grouped_dot(x_pk: jax.Array, w_ekn: jax.Array, group_sizes_e: jax.Array, *, kernels: str = "auto") -> jax.Array:
    """`y[p] = x[p] @ w[expert(p)]` in x's dtype: the first `group_sizes[0]` rows against expert 0, and so
    on; rows past `Σ group_sizes` are undefined. `kernels` as `dispatch` reads it."""
    import tokamax  # imported on first use: it takes over a second, and `dsjax info` never needs it

    def run(implementation=None):
        return tokamax.ragged_dot(x_pk, w_ekn.astype(x_pk.dtype), group_sizes_e.astype("int32"),
                                  precision=precision(x_pk), preferred_element_type=x_pk.dtype,
                                  implementation=implementation)

    def tuned(interpret: bool) -> jax.Array:
        from tokamax._src.ops.ragged_dot.pallas_mosaic_gpu import Config, PallasMosaicGpuRaggedDot

        if interpret:
            raise CannotTile("tokamax's Mosaic GPU kernel has no interpreted form")
        try:
            return run([PallasMosaicGpuRaggedDot(config=Config(**PREFILL_TILING))])
        except NotImplementedError as e:  # not a Hopper GPU, or shapes the kernel does not take
            raise CannotTile(str(e)) from None

    large = x_pk.shape[0] >= MIN_ROWS_PER_EXPERT * w_ekn.shape[0]
    return dispatch(run, kernels=kernels, gpu=[tuned] if large else [])
