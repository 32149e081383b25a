"""The pure-JAX reference of the grouped matmul over low-precision experts (and the fallback where no
kernel applies): the experts dequantized to the activations' dtype, then one grouped matmul.

`x [P, K]` holds rows sorted by expert: the first `group_sizes[0]` rows go to expert 0, the next
`group_sizes[1]` to expert 1, and so on; rows past `Σ group_sizes` belong to no expert and their
results are undefined. Experts are stored as `layers.experts.RoutedExperts` holds them:
`[E, N, K]` e4m3 with block scales, or `[E, N, K/2]` packed e2m1 with a ue8m0 scale per 32 inputs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dsjax.kernels.grouped_dot import grouped_dot
from dsjax.quant import FP4_GROUP, dequantize_fp8, ue8m0_to_float, unpack_fp4


def dequantized(w_enk: jax.Array, scale: jax.Array, storage: str, dtype,
                block: tuple[int, int] = (128, 128)) -> jax.Array:
    """Stored experts → `[E, K, N]` in `dtype` (each weight rounded once, as the checkpoint's reader does).

    The stored codes are transposed, not the dequantized weights: a byte per weight (e4m3) or per two
    (e2m1) moves instead of two, and the output's minor axis is N from the start, so the unpacking and
    scaling stay elementwise (XLA:GPU ran the transpose of the dequantized FP4 experts at a quarter of
    the copy bandwidth)."""
    if storage == "fp4":
        codes_ehn = jnp.swapaxes(jnp.asarray(w_enk), -1, -2)  # [E, K/2, N]: two K-neighbours a byte
        values = unpack_fp4(codes_ehn[..., None]).astype(jnp.float32)  # [E, K/2, N, 2]
        e, half, n = codes_ehn.shape
        values = jnp.swapaxes(values, -1, -2).reshape(e, 2 * half, n)  # K-neighbours in order along K
        s = ue8m0_to_float(jnp.swapaxes(jnp.asarray(scale), -1, -2))  # [E, K/group, N]
        if s.shape != (e, -(-2 * half // FP4_GROUP), n):
            raise ValueError(f"FP4 experts {tuple(jnp.shape(w_enk))} need scales {(e, n, -(-2 * half // FP4_GROUP))}, "
                             f"got {tuple(jnp.shape(scale))}")
        return (values * jnp.repeat(s, FP4_GROUP, axis=-2)[:, : 2 * half]).astype(dtype)
    if storage == "fp8":
        return dequantize_fp8(jnp.swapaxes(jnp.asarray(w_enk), -1, -2), jnp.swapaxes(jnp.asarray(scale), -1, -2),
                              dtype, (block[1], block[0]))
    raise ValueError(f"expert storage must be 'fp8' or 'fp4', got {storage!r}")


def expert_matmul_reference(x_pk: jax.Array, w_enk: jax.Array, scale: jax.Array, group_sizes_e: jax.Array,
                            storage: str, block: tuple[int, int] = (128, 128), *, kernels: str = "auto") -> jax.Array:
    """`y[p] = x[p] @ W_{expert(p)}ᵀ` in x's dtype (fp32 sums), for the stored experts `w_enk`; the float
    grouped matmul as `kernels` picks it (`grouped_dot`)."""
    return grouped_dot(x_pk, dequantized(w_enk, scale, storage, x_pk.dtype, block), group_sizes_e,
                       kernels=kernels)
