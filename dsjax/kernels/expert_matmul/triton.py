"""The grouped matmul over FP8 or FP4 experts as a Pallas kernel for GPUs (Triton lowering;
interpreted on CPU), reading each touched expert's codes once, as stored, and never writing them out
dequantized.

Rows sorted by expert are cut into tiles of `block_m` rows of one expert (`group_tiles`); a program
holds one tile and `block_n` output columns and walks the expert's inputs a step at a time:

- **fp8** (`[E, N, K]` e4m3, ue8m0 scale per 128 × 128 block, read as int16 pairs): a `[block_n, 128]`
  code block becomes fp16 `e4m3 · 2^-8` by moving its bits (exact; subnormals land on subnormals),
  products on fp16 tensor cores, times the block's scale.
- **fp4** (`[E, N, K/2]` two e2m1 codes per byte, low nibble first, ue8m0 scale per row per 32 inputs),
  read as int32 words of eight codes and their scales as int32 words of four: 256 inputs (eight
  groups) per step. Codes p and p+4 of a word sit 16 bits apart, so a few 32-bit operations place
  both as the fp16 `e2m1 · 2^-14` (`fp4_codes.fp16_pairs`, from the checkpoint's layout or the
  repacked one). Each code is then
  multiplied in fp16 by `2^(s - s_max + 15)`, its group's scale relative to the largest of the step's
  eight: exact while that is at least 2^-24 (below it, the weight rounds to a multiple of 2^-24 of
  the step's largest scale). Eight products per step, code p of every word against inputs
  `8j + p`, times `2^s_max`.

The activations are converted to fp16 exactly (`kernels.gpu_fp16.fp16_rows`: each row scaled by a power of
two first, undone on the sums). So every product is exact and only the fp32 summation order differs
from the reference, which dequantizes to bf16 first: a ue8m0 scale times a code is exact in bf16.
Float (non power-of-two) scales would round there; they are not taken here (`CannotTile`).

Reading codes as 2- or 4-byte words also keeps every array addressable: Pallas's Triton lowering
computes offsets in int32 unless an array spans more than 2^32 bytes, which an array of more than
2^31 such words always does.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from dsjax.kernels.dispatch import CannotTile
from dsjax.kernels.expert_matmul.fp4_codes import check_layout, fp16_pairs
from dsjax.kernels.gpu_fp16 import fp16_of_bits, fp16_rows, pow2
from dsjax.quant import FP4_GROUP, ue8m0_bytes_to_float, ue8m0_to_float

_FP8_BLOCK = 128
FEW_ROWS = 8  # rows up to which FP4 takes column blocks of 64: a decode step of one sequence has 6


def group_tiles(group_sizes_e: jax.Array, n_rows: int, block_m: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Tiles of at most `block_m` consecutive rows of one group, for rows sorted by group: per tile its
    group, first row and number of rows. There are at most `⌈n_rows / block_m⌉ + E` tiles, and at most
    `n_rows` (each holds a row; the static count returned is the lesser: at decode, with fewer rows than
    experts, most experts have none, and every tile is a program and, in the Mosaic kernel, a copy of
    `block_m` rows); tiles past the last hold 0 rows."""
    e = group_sizes_e.shape[0]
    sizes = group_sizes_e.astype(jnp.int32)
    offsets = jnp.cumsum(sizes) - sizes
    counts = -(-sizes // block_m)
    ends = jnp.cumsum(counts)
    t = jnp.arange(max(1, min(-(-n_rows // block_m) + e, n_rows)), dtype=jnp.int32)
    g = jnp.searchsorted(ends, t, side="right").astype(jnp.int32)
    g_c = jnp.minimum(g, e - 1)
    j = t - (ends[g_c] - counts[g_c])
    rows = jnp.where(g < e, jnp.clip(sizes[g_c] - j * block_m, 0, block_m), 0)
    return g_c, offsets[g_c] + j * block_m, rows


def fold_layer(w_enk: jax.Array, scale: jax.Array, group_sizes_e: jax.Array, layer: jax.Array | None,
               kernel: str) -> tuple[jax.Array, jax.Array, jax.Array | int]:
    """Experts and scales as the kernels index them, and the first expert of `layer`: with a layer, entry
    `layer` of L stacks of E experts is experts `layer·E …` of the stack folded to `[L·E, …]` (a free
    view); without one, as they are (first expert 0). Raises ValueError, naming `kernel`, for stacks
    that do not match."""
    if layer is None:
        return w_enk, scale, 0
    if w_enk.ndim != 4 or scale.shape[:2] != w_enk.shape[:2]:
        raise ValueError(f"{kernel}: a layer of stacked experts needs [L, E, …] experts and scales, "
                         f"got {w_enk.shape} and {scale.shape}")
    if group_sizes_e.shape[0] != w_enk.shape[1]:
        raise ValueError(f"{kernel}: {group_sizes_e.shape[0]} group sizes for {w_enk.shape[1]} experts")
    first_expert = jnp.asarray(layer, jnp.int32) * w_enk.shape[1]
    return w_enk.reshape(-1, *w_enk.shape[2:]), scale.reshape(-1, *scale.shape[2:]), first_expert


def addressable(codes: jax.Array) -> bool:
    """Whether the kernel can address every element of `codes` as it reads them. Pallas's Triton
    lowering computes element offsets in int32 unless the array spans more than 2^32 bytes, where it
    switches to int64; so an array of more than 2^31 elements but at most 2^32 bytes is out of reach.
    Read as int16 pairs (e4m3) or int32 words (e2m1), as the kernel does, no array is."""
    return codes.size <= 2 ** 31 or codes.size * codes.dtype.itemsize > 2 ** 32


def _e4m3_pair_as_fp16(pair):
    """Two e4m3 codes in the low 16 bits of int32s (first code low) → two fp16 `e4m3 · 2^-8`, exactly,
    by moving the bits: the exponent's four and the mantissa's three land at the bottom of fp16's, so
    subnormals land on subnormals. The codes are read as int16 pairs because Triton's offsets are
    int32: V4-Flash's gate_up experts hold 2^32 bytes, and reading them as bytes went out of bounds."""
    first = ((pair & 0x80) << 8) | ((pair & 0x7F) << 7)
    second = (pair & 0x8000) | ((pair >> 1) & 0x3F80)
    return fp16_of_bits(first), fp16_of_bits(second)


def _fp8_step(w_ref, s_ref, x_ref, g, n0, row0, kb, *, block_m, block_n):
    """One 128-input block: `[block_m, block_n]` products."""
    half = _FP8_BLOCK // 2
    k0 = pl.multiple_of(kb * half, half)
    # Inputs 2j and 2j+1 are the bytes of one int16: one product with the even inputs, one with the odd.
    w_even, w_odd = _e4m3_pair_as_fp16(w_ref[g, pl.ds(n0, block_n), pl.ds(k0, half)].astype(jnp.int32))
    part = sum(jnp.dot(x_ref[i, pl.ds(row0, block_m), pl.ds(k0, half)], w.T, preferred_element_type=jnp.float32)
               for i, w in enumerate((w_even, w_odd)))
    return part * (s_ref[g, n0 // _FP8_BLOCK, kb] * 2.0 ** 8)


def _fp4_step(w_ref, s_ref, x_ref, g, n0, row0, kb, *, block_m, block_n, words, code_layout):
    """One step of `words` int32 words per row (`words / 4` 32-input groups): `[block_m, block_n]`
    products."""
    k0 = pl.multiple_of(kb * words, words)
    rows = pl.ds(n0, block_n)
    codes = w_ref[g, rows, pl.ds(k0, words)]  # [block_n, words] int32
    # Four groups' ue8m0 exponents per scale word; word j of the codes belongs to group j // 4.
    scale_words = [s_ref[g, rows, kb * (words // 16) + i] for i in range(words // 16)]
    top = functools.reduce(jnp.maximum, [(sw >> (8 * q)) & 0xFF for sw in scale_words for q in range(4)])
    j = jax.lax.broadcasted_iota(jnp.int32, (block_n, words), 1)
    group = (scale_words[0][:, None] >> (8 * (j // 4))) & 0xFF
    for i, sw in enumerate(scale_words[1:], 1):
        group = jnp.where(j < 16 * i, group, (sw[:, None] >> (8 * (j // 4 - 4 * i))) & 0xFF)
    # 2^(s − s_max + 15) in fp16 (0 below 2^-24): the codes (· 2^-14) become `e2m1 · 2^(s − s_max + 1)`.
    relative = jnp.maximum(group - top[:, None] + 15, -40)
    relative = pow2(relative).astype(jnp.float16)
    part = jnp.zeros((block_m, block_n), jnp.float32)
    for p, both in enumerate(fp16_pairs(codes, code_layout)):
        for i, w in zip((p, p + 4), (fp16_of_bits(both), fp16_of_bits(both >> 16))):
            x = x_ref[i, pl.ds(row0, block_m), pl.ds(k0, words)]
            part += jnp.dot(x, (w * relative).T, preferred_element_type=jnp.float32)
    return part * (ue8m0_bytes_to_float(top) * 0.5)[None, :]


def _kernel(group_ref, row0_ref, rows_ref, unscale_ref, w_ref, s_ref, x_ref, o_ref, *, storage, block_m, block_n,
            words, n_k, code_layout):
    t, nb = pl.program_id(0), pl.program_id(1)
    rows = rows_ref[t]

    @pl.when(rows > 0)
    def _():
        g, row0 = group_ref[t], row0_ref[t]
        n0 = pl.multiple_of(nb * block_n, block_n)
        blocks = dict(block_m=block_m, block_n=block_n)
        step = (functools.partial(_fp8_step, **blocks) if storage == "fp8"
                else functools.partial(_fp4_step, words=words, code_layout=code_layout, **blocks))
        step = functools.partial(step, w_ref, s_ref, x_ref, g, n0, row0)
        acc = jax.lax.fori_loop(0, n_k, lambda kb, acc: acc + step(kb),
                                jnp.zeros((block_m, block_n), jnp.float32))
        acc = acc * unscale_ref[pl.ds(row0, block_m)][:, None]  # undo the rows' fp16 scaling
        mine = jax.lax.broadcasted_iota(jnp.int32, (block_m, block_n), 0) < rows
        pltriton.store(o_ref.at[pl.ds(row0, block_m), pl.ds(n0, block_n)], acc.astype(o_ref.dtype), mask=mine)


@functools.partial(jax.jit, static_argnames=("storage", "block_m", "block_n", "num_warps", "num_stages",
                                             "code_layout", "interpret"))
def expert_matmul_gpu(x_pk: jax.Array, w_enk: jax.Array, scale: jax.Array, group_sizes_e: jax.Array,
                      storage: str, layer: jax.Array | None = None, *, block_m: int = 16, block_n: int | None = None,
                      num_warps: int = 4, num_stages: int = 3, code_layout: str = "checkpoint",
                      interpret: bool = False) -> jax.Array:
    """`reference.expert_matmul_reference` (same arguments but the block, which is 128 × 128 here) as a
    Pallas kernel. With `layer`, `w_enk` and `scale` are a stack of such experts and scales (`[L, E, …]`)
    and the kernel reads entry `layer` where it lies. `block_n` defaults to 64 for FP8 (at most its
    128-block) and to 128 for FP4 where it tiles and there are more than `FEW_ROWS` rows (measured best
    on the H200), else 64. `code_layout` (FP4): the codes as checkpoints hold them or repacked
    (`fp4_codes.repack_codes`). Raises CannotTile for what it does not take: non-bf16 activations, float
    scales, widths that do not tile, experts it cannot address."""
    p, k = x_pk.shape
    w_enk, scale, first_expert = fold_layer(w_enk, scale, group_sizes_e, layer, "expert_matmul_gpu")
    e, n = w_enk.shape[:2]  # e: every expert of the stack
    # FP4: 128 columns per program measured best from 48 rows on; at 6 rows (one token), 64 (more programs):
    # 0.25 against 0.31 ms on V4-Flash's gate_up.
    block_n = block_n or (128 if storage == "fp4" and n % 128 == 0 and p > FEW_ROWS else 64)
    if x_pk.dtype != jnp.bfloat16:
        raise CannotTile(f"expert_matmul_gpu: activations must be bf16, got {x_pk.dtype}")
    if block_m % 16 or block_n % 16:
        raise CannotTile(f"expert_matmul_gpu: block_m ({block_m}) and block_n ({block_n}) must be multiples of 16")
    if n % block_n:
        raise CannotTile(f"expert_matmul_gpu: {n} output columns do not tile by {block_n}")
    if storage not in ("fp8", "fp4"):
        raise ValueError(f"expert_matmul_gpu: storage must be 'fp8' or 'fp4', got {storage!r}")
    check_layout(code_layout, "expert_matmul_gpu", storage)
    if scale.dtype not in (jnp.uint8, jnp.float8_e8m0fnu):
        raise CannotTile(f"expert_matmul_gpu: {storage.upper()} experts need ue8m0 (power-of-two) scales, got "
                         f"{scale.dtype}: bf16 dequantization would round float scales")
    scale = jax.lax.bitcast_convert_type(scale, jnp.uint8)
    pieces, unscale_p = fp16_rows({0: x_pk})
    # Every tile reads block_m rows from its first: pad so that the last tile's stay inside.
    x16 = jnp.pad(pieces[0], ((0, block_m), (0, 0)))
    if storage == "fp8":
        if k % _FP8_BLOCK or _FP8_BLOCK % block_n or w_enk.shape[2] != k:
            raise CannotTile(f"expert_matmul_gpu: FP8 experts [{e}, {n}, {w_enk.shape[2]}] against {k} inputs "
                             f"do not tile by 128-blocks and block_n {block_n}")
        if scale.shape != (e, -(-n // _FP8_BLOCK), k // _FP8_BLOCK):
            raise CannotTile(f"expert_matmul_gpu: FP8 scales {scale.shape} are not 128 × 128 blocks of {w_enk.shape}")
        words, n_k, scale = None, k // _FP8_BLOCK, ue8m0_to_float(scale)
        w_enk = jax.lax.bitcast_convert_type(w_enk.reshape(e, n, k // 2, 2), jnp.int16)  # a free view
        x_parts = jnp.stack([x16[:, 0::2], x16[:, 1::2]])  # even and odd inputs
    else:
        if k % 128 or w_enk.shape[2] * 2 != k or scale.shape != (e, n, k // FP4_GROUP):
            raise CannotTile(f"expert_matmul_gpu: FP4 experts {w_enk.shape} with scales {scale.shape} against {k} "
                             f"inputs do not make whole steps of 128 inputs in groups of {FP4_GROUP}")
        words = 32 if k % 256 == 0 else 16  # 256 inputs per step measured best; 128 where K needs it
        n_k = k // (8 * words)
        # Free views: eight codes per int32 word, four groups' scales per int32 word (little-endian).
        w_enk = jax.lax.bitcast_convert_type(w_enk.reshape(e, n, k // 8, 4), jnp.int32)
        scale = jax.lax.bitcast_convert_type(scale.reshape(e, n, k // 128, 4), jnp.int32)
        x_parts = jnp.stack([x16[:, i::8] for i in range(8)])  # code i of word j multiplies input 8j + i
    if not addressable(w_enk):
        raise CannotTile(f"expert_matmul_gpu: experts of {w_enk.size} elements of {w_enk.dtype.itemsize} bytes "
                         "are past Triton's int32 offsets (more than 2^31 elements in at most 2^32 bytes)")
    unscale_p = jnp.pad(unscale_p, (0, block_m))
    group_t, row0_t, rows_t = group_tiles(group_sizes_e, p, block_m)
    tiles = (group_t + first_expert, row0_t, rows_t)
    out = pl.pallas_call(
        functools.partial(_kernel, storage=storage, block_m=block_m, block_n=block_n, words=words, n_k=n_k,
                          code_layout=code_layout),
        grid=(tiles[0].shape[0], n // block_n),
        out_shape=jax.ShapeDtypeStruct((p + block_m, n), x_pk.dtype),
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret, name="dsjax_expert_matmul",
    )(*tiles, unscale_p, w_enk, scale, x_parts)
    return out[:p]
