"""The pure-JAX reference of the grouped matmul over low-precision experts (and the fallback where no
kernel applies): the experts dequantized to the activations' dtype, then one grouped matmul.

`x [P, K]` holds rows sorted by expert: the first `group_sizes[0]` rows go to expert 0, the next
`group_sizes[1]` to expert 1, and so on; rows past `Σ group_sizes` belong to no expert and their
results are undefined. Experts are stored as `layers.experts.RoutedExperts` holds them:
`[E, N, K]` e4m3 with block scales, or `[E, N, K/2]` packed e2m1 with a ue8m0 scale per 32 inputs (in the
checkpoint's code layout or the kernels' repacked one, `fp4_codes`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dsjax.kernels.expert_matmul.fp4_codes import check_layout, in_checkpoint_layout
from dsjax.kernels.grouped_dot import grouped_dot
from dsjax.quant import dequantize_fp4, dequantize_fp8


def dequantized(w_enk: jax.Array, scale: jax.Array, storage: str, dtype,
                block: tuple[int, int] = (128, 128), code_layout: str = "checkpoint") -> jax.Array:
    """Stored experts → `[E, K, N]` in `dtype` (each weight rounded once, as the checkpoint's reader does).
    `code_layout`: FP4 codes as checkpoints hold them or repacked for the kernels."""
    # Transposing the stored codes first instead (fewer bytes) measured slower on the H200: XLA fused the
    # K-interleave of the unpacked nibbles into a concatenate at a fraction of the copy bandwidth.
    check_layout(code_layout, "dequantized", storage)
    if storage == "fp4":
        w = dequantize_fp4(in_checkpoint_layout(w_enk, code_layout), scale, dtype)
    elif storage == "fp8":
        w = dequantize_fp8(w_enk, scale, dtype, block)
    else:
        raise ValueError(f"expert storage must be 'fp8' or 'fp4', got {storage!r}")
    return jnp.swapaxes(w, -1, -2)


def expert_matmul_reference(x_pk: jax.Array, w_enk: jax.Array, scale: jax.Array, group_sizes_e: jax.Array,
                            storage: str, block: tuple[int, int] = (128, 128), *, code_layout: str = "checkpoint",
                            kernels: str = "auto") -> jax.Array:
    """`y[p] = x[p] @ W_{expert(p)}ᵀ` in x's dtype (fp32 sums), for the stored experts `w_enk` (FP4 codes in
    `code_layout`); the float grouped matmul as `kernels` picks it (`grouped_dot`)."""
    return grouped_dot(x_pk, dequantized(w_enk, scale, storage, x_pk.dtype, block, code_layout), group_sizes_e,
                       kernels=kernels)
