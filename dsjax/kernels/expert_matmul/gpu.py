"""The grouped matmul over FP8 or FP4 experts as a Pallas kernel for GPUs (Triton lowering;
interpreted on CPU), reading each touched expert's codes once, as stored, and never writing them out
dequantized.

Rows sorted by expert are cut into tiles of `block_m` rows of one expert (`group_tiles`); a program
holds one tile and `block_n` output columns and walks the expert's inputs `block_k` at a time:

- **fp8** (`[E, N, K]` e4m3, ue8m0 scale per 128 × 128 block, read as int16 pairs): a `[block_n, 128]`
  code block becomes fp16 `e4m3 · 2^-8` by moving its bits (exact; subnormals land on subnormals),
  products on fp16 tensor cores, times the block's scale.
- **fp4** (`[E, N, K/2]` two e2m1 codes per byte, low nibble first, ue8m0 scale per row per 32 inputs):
  each code's three magnitude bits placed as the exponent's low bits and the mantissa's top bit of an
  fp16 make exactly `e2m1 · 2^-14` (the e2m1 subnormal 0.5 lands on the fp16 subnormal 2^-15), with
  shifts and masks only. Per 32 inputs, one product of the low nibbles with the even inputs and one of
  the high nibbles with the odd inputs (the codes are never interleaved), times each column's scale.

The activations are converted to fp16 exactly (`kernels.fp16.fp16_rows`: each row scaled by a power of
two first, undone on the sums). So every product is exact and only the fp32 summation order differs
from the reference, which dequantizes to bf16 first: a ue8m0 scale times a code is exact in bf16.
Float (non power-of-two) scales would round there; they are not taken here (`ValueError`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from dsjax.kernels.fp16 import fp16_rows
from dsjax.quant import FP4_GROUP, ue8m0_bytes_to_float, ue8m0_to_float

_FP8_BLOCK = 128


def group_tiles(group_sizes_e: jax.Array, n_rows: int, block_m: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Tiles of at most `block_m` consecutive rows of one group, for rows sorted by group: per tile its
    group, first row and number of rows. There are at most `⌈n_rows / block_m⌉ + E` tiles (the static
    count returned); tiles past the last hold 0 rows."""
    e = group_sizes_e.shape[0]
    sizes = group_sizes_e.astype(jnp.int32)
    offsets = jnp.cumsum(sizes) - sizes
    counts = -(-sizes // block_m)
    ends = jnp.cumsum(counts)
    t = jnp.arange(-(-n_rows // block_m) + e, dtype=jnp.int32)
    g = jnp.searchsorted(ends, t, side="right").astype(jnp.int32)
    g_c = jnp.minimum(g, e - 1)
    j = t - (ends[g_c] - counts[g_c])
    rows = jnp.where(g < e, jnp.clip(sizes[g_c] - j * block_m, 0, block_m), 0)
    return g_c, offsets[g_c] + j * block_m, rows


def addressable(codes: jax.Array) -> bool:
    """Whether the kernel can address every element of `codes` (as it reads them: int16 pairs of e4m3,
    bytes of e2m1). Pallas's Triton lowering computes element offsets in int32 unless the array spans
    more than 2^32 bytes, where it switches to int64; so an array of more than 2^31 elements but at
    most 2^32 bytes is out of reach."""
    return codes.size <= 2 ** 31 or codes.size * codes.dtype.itemsize > 2 ** 32


def _fp16_of_bits(bits):
    """The low 16 bits of int32s as fp16."""
    return jax.lax.bitcast_convert_type(bits.astype(jnp.int16), jnp.float16)


def _e2m1_as_fp16(code):
    """e2m1 codes (the low four bits of int32s) → fp16 `e2m1 · 2^-14`, exactly, by placing the bits."""
    return _fp16_of_bits(((code & 8) << 12) | ((code & 7) << 9))


def _e4m3_pair_as_fp16(pair):
    """Two e4m3 codes in the low 16 bits of int32s (first code low) → two fp16 `e4m3 · 2^-8`, exactly,
    by moving the bits: the exponent's four and the mantissa's three land at the bottom of fp16's, so
    subnormals land on subnormals. The codes are read as int16 pairs because Triton's offsets are
    int32: V4-Flash's gate_up experts hold 2^32 bytes, and reading them as bytes went out of bounds."""
    first = ((pair & 0x80) << 8) | ((pair & 0x7F) << 7)
    second = (pair & 0x8000) | ((pair >> 1) & 0x3F80)
    return _fp16_of_bits(first), _fp16_of_bits(second)


def _kernel(group_ref, row0_ref, rows_ref, unscale_ref, w_ref, s_ref, *refs, storage, block_m, block_n,
            block_k, n_k):
    *x_refs, o_ref = refs  # x's even and odd inputs, [P, K/2] each
    t, nb = pl.program_id(0), pl.program_id(1)
    rows = rows_ref[t]

    @pl.when(rows > 0)
    def _():
        g, row0 = group_ref[t], row0_ref[t]
        n0 = pl.multiple_of(nb * block_n, block_n)
        f32 = jnp.float32

        def step(kb, acc):
            # Both formats hold inputs 2j and 2j+1 side by side (bytes of an int16 for e4m3, nibbles of
            # a byte for e2m1): one product with the even inputs, one with the odd, so the codes are
            # never interleaved.
            half = block_k // 2
            k0 = pl.multiple_of(kb * half, half)
            packed = w_ref[g, pl.ds(n0, block_n), pl.ds(k0, half)].astype(jnp.int32)
            even = x_refs[0][pl.ds(row0, block_m), pl.ds(k0, half)]
            odd = x_refs[1][pl.ds(row0, block_m), pl.ds(k0, half)]
            if storage == "fp8":
                w_even, w_odd = _e4m3_pair_as_fp16(packed)
            else:
                w_even, w_odd = _e2m1_as_fp16(packed), _e2m1_as_fp16(packed >> 4)
            part = (jnp.dot(even, w_even.T, preferred_element_type=f32)
                    + jnp.dot(odd, w_odd.T, preferred_element_type=f32))
            if storage == "fp8":
                return acc + part * s_ref[g, n0 // _FP8_BLOCK, kb]
            scale_n = ue8m0_bytes_to_float(s_ref[g, pl.ds(n0, block_n), kb].astype(jnp.int32) & 0xFF)
            return acc + part * scale_n[None, :]

        acc = jax.lax.fori_loop(0, n_k, step, jnp.zeros((block_m, block_n), f32))
        # Undo the codes' placement (2^-8 for e4m3, 2^-14 for e2m1) and the rows' fp16 scaling.
        acc = acc * (2.0 ** 8 if storage == "fp8" else 2.0 ** 14)
        acc = acc * unscale_ref[pl.ds(row0, block_m)][:, None]
        mine = jax.lax.broadcasted_iota(jnp.int32, (block_m, block_n), 0) < rows
        pltriton.store(o_ref.at[pl.ds(row0, block_m), pl.ds(n0, block_n)], acc.astype(o_ref.dtype), mask=mine)


@functools.partial(jax.jit, static_argnames=("storage", "block_m", "block_n", "num_warps", "num_stages",
                                             "interpret"))
def expert_matmul_gpu(x_pk: jax.Array, w_enk: jax.Array, scale: jax.Array, group_sizes_e: jax.Array,
                      storage: str, layer: jax.Array | None = None, *, block_m: int = 16, block_n: int = 64,
                      num_warps: int = 4, num_stages: int = 3, interpret: bool = False) -> jax.Array:
    """`reference.expert_matmul_reference` (same arguments but the block, which is 128 × 128 here) as a
    Pallas kernel. With `layer`, `w_enk` and `scale` are a stack of such experts and scales (`[L, E, …]`)
    and the kernel reads entry `layer` where it lies. Raises ValueError for what it does not take:
    non-bf16 activations, float FP8 scales, widths that do not tile, experts it cannot address."""
    p, k = x_pk.shape
    first_expert = 0
    if layer is not None:  # entry `layer` of L stacks of E experts: experts layer·E … of L·E
        if w_enk.ndim != 4 or scale.shape[:2] != w_enk.shape[:2]:
            raise ValueError(f"expert_matmul_gpu: a layer of stacked experts needs [L, E, …] experts and scales, "
                             f"got {w_enk.shape} and {scale.shape}")
        first_expert = jnp.asarray(layer, jnp.int32) * w_enk.shape[1]
        if group_sizes_e.shape[0] != w_enk.shape[1]:
            raise ValueError(f"expert_matmul_gpu: {group_sizes_e.shape[0]} group sizes for {w_enk.shape[1]} experts")
        w_enk, scale = w_enk.reshape(-1, *w_enk.shape[2:]), scale.reshape(-1, *scale.shape[2:])
    e, n = w_enk.shape[:2]  # e: every expert of the stack
    if x_pk.dtype != jnp.bfloat16:
        raise ValueError(f"expert_matmul_gpu: activations must be bf16, got {x_pk.dtype}")
    if block_m % 16 or block_n % 16:
        raise ValueError(f"expert_matmul_gpu: block_m ({block_m}) and block_n ({block_n}) must be multiples of 16")
    if n % block_n:
        raise ValueError(f"expert_matmul_gpu: {n} output columns do not tile by {block_n}")
    if storage == "fp8":
        if scale.dtype not in (jnp.uint8, jnp.float8_e8m0fnu):
            raise ValueError("expert_matmul_gpu: FP8 experts need ue8m0 (power-of-two) scales, got "
                             f"{scale.dtype}: bf16 dequantization would round float scales")
        if k % _FP8_BLOCK or _FP8_BLOCK % block_n or w_enk.shape[2] != k:
            raise ValueError(f"expert_matmul_gpu: FP8 experts [{e}, {n}, {w_enk.shape[2]}] against {k} inputs "
                             f"do not tile by 128-blocks and block_n {block_n}")
        if scale.shape != (e, -(-n // _FP8_BLOCK), k // _FP8_BLOCK):
            raise ValueError(f"expert_matmul_gpu: FP8 scales {scale.shape} are not 128 × 128 blocks of {w_enk.shape}")
        block_k, scale = _FP8_BLOCK, ue8m0_to_float(scale)
        w_enk = jax.lax.bitcast_convert_type(w_enk.reshape(e, n, k // 2, 2), jnp.int16)  # a free view
    elif storage == "fp4":
        if k % FP4_GROUP or w_enk.shape[2] * 2 != k or scale.shape != (e, n, k // FP4_GROUP):
            raise ValueError(f"expert_matmul_gpu: FP4 experts {w_enk.shape} with scales {scale.shape} do not "
                             f"match {k} inputs in groups of {FP4_GROUP}")
        if scale.dtype not in (jnp.uint8, jnp.float8_e8m0fnu):
            raise ValueError(f"expert_matmul_gpu: FP4 scales are ue8m0 bytes, got {scale.dtype}")
        block_k = FP4_GROUP
        scale = jax.lax.bitcast_convert_type(scale, jnp.uint8) if scale.dtype != jnp.uint8 else scale
    else:
        raise ValueError(f"expert_matmul_gpu: storage must be 'fp8' or 'fp4', got {storage!r}")
    if not addressable(w_enk):
        raise ValueError(f"expert_matmul_gpu: experts of {w_enk.size} elements of {w_enk.dtype.itemsize} bytes "
                         "are past Triton's int32 offsets (more than 2^31 elements in at most 2^32 bytes)")
    pieces, unscale_p = fp16_rows({0: x_pk})
    # Every tile reads block_m rows from its first: pad so that the last tile's stay inside.
    x16 = jnp.pad(pieces[0], ((0, block_m), (0, 0)))
    x_parts = (x16[:, 0::2], x16[:, 1::2])
    unscale_p = jnp.pad(unscale_p, (0, block_m))
    group_t, row0_t, rows_t = group_tiles(group_sizes_e, p, block_m)
    tiles = (group_t + first_expert, row0_t, rows_t)
    out = pl.pallas_call(
        functools.partial(_kernel, storage=storage, block_m=block_m, block_n=block_n, block_k=block_k,
                          n_k=k // block_k),
        grid=(tiles[0].shape[0], n // block_n),
        out_shape=jax.ShapeDtypeStruct((p + block_m, n), x_pk.dtype),
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret, name="dsjax_expert_matmul",
    )(*tiles, unscale_p, w_enk, scale, *x_parts)
    return out[:p]
