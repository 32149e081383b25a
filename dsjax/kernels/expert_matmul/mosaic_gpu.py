"""The grouped matmul over FP4 experts as a Mosaic GPU (Hopper wgmma) kernel, where the decoded codes
are wgmma's register operand A: for 128 rows or more (decode at 32 sequences and up) it replaces the
Triton kernel (`triton.py`), which it beats by 1.18× at 32 tokens and 1.27× at 128 on V4-Flash's gate_up
(docs/benchmarks.md, 2026-11-30, eighth session). Same arguments, same arithmetic, same result.

Each program holds one tile of `block_m` rows of one expert (`triton.group_tiles`) and `features` output
features, computes `outᵀ[features, rows] = W · xᵀ` (wgmma's M is 64: the features, its N the rows)
and walks the inputs `8 · WORDS` at a time:

- the codes stream in as int32 words of eight through a TMA pipeline and are loaded in wgmma's 32-bit
  register layout: a thread holds words 2t and 2t+1 of every eight, of rows r and r+8. Codes p and
  p+4 of a word, moved into the two halves as fp16 `e2m1 · 2^-14` (three 32-bit operations, as in
  `triton.py`), then already form a register of the 16-bit A fragment, with no data movement, provided
  the inputs are renumbered: fp16 column `16b + 8s + 2t + h` of pair p holds code `p + 4h` of word
  `8b + 2t + s` (`input_order`). The activations are renumbered to match outside the kernel;
- each code is multiplied in fp16 by `2^(s − s_max + 15)`, its 32-input group's ue8m0 scale relative
  to the largest of its row (all of K), exact while that is at least 2^-24 of the largest; the sums
  are scaled by `2^(s_max − 128)` once at the end;
- the activations are fp16 exactly (`kernels.gpu_fp16.fp16_rows`), so, as in `triton.py`, every product is
  exact and only the fp32 summation order differs from the reference.

The register reinterpretation is inline Mosaic GPU code, which Mosaic GPU's interpreter cannot run,
nor can it take wgmma's A from registers: interpreted (`interpret=True`, the CPU tests), the same
fragments are built with jnp (bitcast and transpose) and pass through shared memory.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.mosaic import gpu as mgpu
from jax.experimental.mosaic.gpu import fragmented_array as fa
from jax.experimental.pallas import mosaic_gpu as plgpu
from jax.extend.mlir import ir
from jax.extend.mlir.dialects import vector

from dsjax.kernels.dispatch import CannotTile
from dsjax.kernels.expert_matmul.fp4_codes import SIGNS, check_layout, fp16_pairs
from dsjax.kernels.expert_matmul.triton import fold_layer, group_tiles
from dsjax.kernels.gpu_fp16 import fp16_rows, pow2
from dsjax.quant import FP4_GROUP

WORDS = 32      # int32 code words per row per step (256 inputs): measured best against 64, and against 16 in prefill
FEATURES = 64   # output features per program (wgmma's M): measured best against 128
BLOCK_M = 16    # rows per tile (wgmma's N): measured best against 8 and 32 from 128 rows on
# Rows per tile by rows per expert, on V4.1-Flash's widths on the H200 (docs/benchmarks.md, 2026-12-03):
# at 16 rows per expert (1,024 tokens) 32-row tiles are fastest (gate_up 2.46 ms; 16 rows: 2.80; 64: 3.31),
# at 128 (8,192 tokens) 64-row tiles (8.77 ms; 32 rows: 11.4; 16 rows: 16.5; 128 rows: 10.5). The switches
# sit between the measured points: (from rows per expert, rows per tile), the first that applies.
TILE_ROWS = ((48, 64), (8, 32))
MAX_BLOCK_M = 256  # wgmma's largest N; shared memory bounds it further (`SMEM_BYTES`)
MAX_DENSE_BLOCK_M = 128  # rows per tile for dense FP8 linears (`op.dense_fp8_matmul`): more rows, more tiles
SMEM_BYTES = 227 * 1024  # shared memory one program may hold on Hopper
STAGES = 2      # steps in flight: measured best against 3 and 4
MIN_ROWS = 128  # below, the Triton kernel is faster (8 tokens × 6 experts: 0.37 ms against 0.46)
_WGMMA = plgpu.Layout.WGMMA
_ROW = plgpu.Layout.WGMMA.reduce(1)
_E4M3_MAGNITUDES = 0x3F803F80  # where an e4m3's exponent and mantissa sit in each of two fp16s (`e4m3 · 2^-8`)
_SCALE_WORD_INPUTS = 128  # inputs whose scales one int32 scale word holds: four groups of 32
FP8_BLOCKS = (128, 32)  # the square FP8 scale blocks the kernel reads: V4's 128 × 128 and V4.1's 32 × 32
ROW_SOURCES = ("copied", "window", "aligned")  # where a program reads its tile's rows (`expert_matmul_mosaic`)
_INT_MIN = int(np.iinfo(np.int32).min)


def _pairs_per_word(storage: str) -> int:
    """fp16 pairs one int32 code word makes: eight e2m1 codes, or four e4m3."""
    return 4 if storage == "fp4" else 2


def input_order(k: int, storage: str = "fp4") -> np.ndarray:
    """`[pairs, K/pairs]`: for pair p and fp16 column c of its A fragments, the input that column
    multiplies (pairs: 4 for FP4, 2 for FP8)."""
    pairs = _pairs_per_word(storage)
    c = np.arange(k // pairs)
    b, rest = np.divmod(c, 16)
    s, rest = np.divmod(rest, 8)
    t, h = np.divmod(rest, 2)
    word = 8 * b + 2 * t + s
    return np.stack([2 * pairs * word + p + pairs * h for p in range(pairs)])


def renumbered(x_pk: jax.Array, storage: str = "fp4") -> jax.Array:
    """`[P, K]` → `[pairs, P, K/pairs]`: `x[:, input_order(K, storage)]` with the pairs first, as a
    transpose (FP4: within each 64 inputs, input `16t + 8s + 4h + p` goes to pair p, column
    `8s + 2t + h`; FP8 likewise within 32 with `8t + 4s + 2h + p`): XLA moves it at copy speed, where
    the same permutation as a gather is an element-wise one."""
    p, k = x_pk.shape
    pairs = _pairs_per_word(storage)
    x = x_pk.reshape(p, k // (16 * pairs), 4, 2, 2, pairs)
    return jnp.transpose(x, (5, 0, 1, 3, 2, 4)).reshape(pairs, p, k // pairs)


def tile_rows(rows: int, experts: int) -> int:
    """Rows per tile for `rows` rows over `experts` experts (`TILE_ROWS`, else `BLOCK_M`)."""
    return next((block_m for least, block_m in TILE_ROWS if rows >= least * experts), BLOCK_M)


def _as_fp16(words, interpret: bool):
    """int32 `[64, 8m]` → fp16 `[64, 16m]`: fp16 column `16b + 8s + 2t + h` is half h (low first) of
    element `8b + 2t + s`. In wgmma's layouts that is every register as it is."""
    rows, cols = words.shape
    if interpret:
        halves = lax.bitcast_convert_type(words, jnp.float16).reshape(rows, cols // 8, 4, 2, 2)  # b, t, s, h
        return jnp.swapaxes(halves, 2, 3).reshape(rows, 2 * cols)

    @plgpu.inline_mgpu(arg_types=(_WGMMA,),
                       return_type=plgpu.ShapeDtypeStruct((rows, 2 * cols), jnp.float16, layout=_WGMMA))
    def reinterpret(ctx, arr):
        del ctx
        regs = arr.registers
        f16x4 = ir.VectorType.get((4,), ir.F16Type.get())
        f16x2 = ir.VectorType.get((2,), ir.F16Type.get())
        out = np.empty((regs.shape[0], 2 * regs.shape[1], *regs.shape[2:]), dtype=object)
        for idx in np.ndindex(regs.shape):
            both = vector.bitcast(f16x4, regs[idx])  # a thread's two int32 of a row → four fp16
            for s in range(2):
                out[(idx[0], 2 * idx[1] + s, *idx[2:])] = vector.extract_strided_slice(f16x2, both, [2 * s], [2], [1])
        return mgpu.FragmentedArray(_registers=out, _layout=fa.WGMMA_LAYOUT, _is_signed=None)

    return reinterpret(words)


def _e4m3_pairs(words):
    """Two int32 arrays: bytes 0 and 2, then 1 and 3, of each word of four e4m3 codes as two fp16
    `e4m3 · 2^-8` (bit moves only: the four exponent and three mantissa bits land at the bottom of
    fp16's, so subnormals land on subnormals)."""
    low = ((words << 8) & SIGNS) | ((words << 7) & _E4M3_MAGNITUDES)
    high = (words & SIGNS) | (lax.shift_right_logical(words, 1) & _E4M3_MAGNITUDES)
    return [low, high]


def _column(block, c):
    """Column c (a traced index) of an int32 `[64, 8]` block, as one value per row."""
    col = plgpu.broadcasted_iota(jnp.int32, block.shape, 1, layout=_WGMMA)
    return jnp.max(jnp.where(col == c, block, _INT_MIN), axis=1)


def _tiled(columns: int, itemsize: int) -> tuple:
    """Shared-memory transforms for blocks `columns` wide: tiles of 8 rows by at most 128 bytes, swizzled
    by a row's bytes up to 128 (TMA's and wgmma's widest)."""
    row_bytes = min(columns * itemsize, 128)
    return plgpu.TilingTransform((8, row_bytes // itemsize)), plgpu.SwizzleTransform(row_bytes)


def _body(tiles_ref, x_ref, w_ref, s_ref, out_ref, tiles_smem, s_smem, out_smem, bar, *a_smem, n_k: int,
          window: int, features: int, words: int, stages: int, in_place: bool, code_layout: str, storage: str,
          interpret: bool):
    """One program: `window` rows of one expert (the tile's copy, or `in_place` the sorted rows from the
    multiple of 8 at or before its first) against `features` of its outputs. The scales arrive as FP4's,
    a ue8m0 byte per row and 32 inputs (FP8's blocks repeated so by the wrapper)."""
    t, nb = lax.axis_index("t"), lax.axis_index("n")
    plgpu.copy_gmem_to_smem(tiles_ref.at[pl.ds(t, 1)], tiles_smem, bar)  # [1, 4]: 16 bytes, TMA's least
    plgpu.barrier_wait(bar)
    g, row0, rows, g_scale = tiles_smem[0, 0], tiles_smem[0, 1], tiles_smem[0, 2], tiles_smem[0, 3]
    n0 = pl.multiple_of(nb * features, features)
    pairs = _pairs_per_word(storage)
    if in_place:  # the tile's rows where they lie, from the multiple of 8 at or before its first
        x_rows = [x_ref.at[p, pl.ds(pl.multiple_of(row0 - lax.rem(row0, 8), 8), window)] for p in range(pairs)]
    else:  # the tile's own copy
        x_rows = [x_ref.at[p, t] for p in range(pairs)]

    @pl.when(rows > 0)
    def _():
        j = plgpu.broadcasted_iota(jnp.int32, (features, words), 1, layout=_WGMMA)
        plgpu.copy_gmem_to_smem(s_ref.at[g_scale, pl.ds(n0, features)], s_smem, bar)  # [64, K/128] scale words
        plgpu.barrier_wait(bar)
        everything = plgpu.load(s_smem, layout=_WGMMA, optimized=False)
        top = functools.reduce(jnp.maximum, [lax.shift_right_logical(everything, 8 * q) & 0xFF for q in range(4)])
        top = jnp.max(top, axis=1)  # each row's largest ue8m0 exponent
        # A scale word holds four 32-input groups: 16 code words of FP4, 32 of FP8. A step spans
        # `per_step` scale words, or (FP8, 16 words a step) half of one.
        per_scale_word = 16 if storage == "fp4" else 32
        per_step = max(1, words // per_scale_word)
        per_group = per_scale_word // 4

        def step(idx, codes_smem, *x_smem):
            (kb,) = idx
            codes = plgpu.load(codes_smem, layout=_WGMMA)  # [64, words] int32
            first = kb * words // per_scale_word
            c8 = pl.multiple_of(first // 8 * 8, 8)
            block = plgpu.load(s_smem.at[:, pl.ds(c8, 8)], layout=_WGMMA, optimized=False)
            # word j's place from the start of its step's first scale word
            at = j if words % per_scale_word == 0 else j + lax.rem(kb * words, per_scale_word)
            group = jnp.zeros((features, words), jnp.int32)
            for i in range(per_step):  # word j's group: byte (at // per_group) % 4 of scale word at // per_scale_word
                sw = lax.broadcast_in_dim(_column(block, first + i - c8), (features, words), (0,))
                group = jnp.where(at // per_scale_word == i,
                                  lax.shift_right_logical(sw, 8 * ((at // per_group) % 4)) & 0xFF, group)
            # 2^(s − s_max + 15) as fp16 bits (0 below 2^-14), twice per int32
            biased = jnp.clip(group - lax.broadcast_in_dim(top, (features, words), (0,)) + 30, 0, 31) << 10
            relative = _as_fp16(biased | (biased << 16), interpret)
            decoded = _e4m3_pairs(codes) if storage == "fp8" else fp16_pairs(codes, code_layout)
            for p, pair in enumerate(decoded):
                a = _as_fp16(pair, interpret) * relative
                if interpret:  # the interpreter takes wgmma's A from shared memory only
                    a_smem[0][...] = a
                    plgpu.commit_smem()
                    a = a_smem[0]
                plgpu.wgmma(acc_ref, a, x_smem[p].T)
            plgpu.wgmma_wait(0)

        def pipelined(acc):
            nonlocal acc_ref
            acc_ref = acc
            plgpu.emit_pipeline(
                step, grid=(n_k,),
                in_specs=[
                    plgpu.BlockSpec((features, words), lambda kb: (0, kb), transforms=_tiled(words, 4)),
                    *[plgpu.BlockSpec((window, 2 * words), lambda kb: (0, kb), transforms=_tiled(2 * words, 2))] * pairs,
                ],
                max_concurrent_steps=stages,
            )(w_ref.at[g, pl.ds(n0, features)], *x_rows)
            return acc[...]

        acc_ref = None
        acc = pl.run_scoped(pipelined, plgpu.ACC((features, window), jnp.float32))
        if storage == "fp8":  # e4m3 · 2^-8 · 2^(s − s_max + 15) · 2^(s_max − 127) · 2^-7 = e4m3 · 2^(s − 127)
            acc = acc * lax.broadcast_in_dim(pow2(top - 127) * 2.0 ** -7, acc.shape, (0,))
        else:  # e2m1 · 2^-14 · 2^(s − s_max + 15) · 2^(s_max − 128) = e2m1 · 2^(s − 127)
            acc = acc * lax.broadcast_in_dim(pow2(top - 128), acc.shape, (0,))
        out_smem[...] = acc
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(out_smem, out_ref.at[t, pl.ds(n0, features)])
        plgpu.wait_smem_to_gmem(0)


@functools.partial(jax.jit, static_argnames=("storage", "block_m", "features", "words", "stages", "row_source",
                                             "code_layout", "fp8_block", "interpret"))
def expert_matmul_mosaic(x_pk: jax.Array, w_enk: jax.Array, scale: jax.Array, group_sizes_e: jax.Array,
                         layer: jax.Array | None = None, *, storage: str = "fp4", block_m: int = BLOCK_M,
                         features: int = FEATURES, words: int = WORDS, stages: int = STAGES, row_source: str = "copied",
                         code_layout: str = "checkpoint", fp8_block: int = 128, interpret: bool = False) -> jax.Array:
    """`reference.expert_matmul_reference(x_pk, w_enk, scale, group_sizes_e, storage)` as a Mosaic GPU
    kernel, for FP4 experts (`[E, N, K/2]` e2m1 pairs, a ue8m0 scale per row and 32 inputs) or FP8 ones
    (`[E, N, K]` e4m3, a ue8m0 scale per `fp8_block` × `fp8_block` block: 128 as V4 stores them, or 32 as
    V4.1 does; the scales are repeated here to FP4's layout, a byte per row and 32 inputs: 1/32 of the codes'
    bytes, rewritten each call). With `layer`, `w_enk` and `scale` are a stack
    of such experts and scales (`[L, E, …]`) and the kernel reads entry `layer` where it lies. `block_m`
    rows of one expert per program (wgmma's N): an expert's codes are decoded once per `block_m` of its
    rows, so prefill wants many; `features` output features per program (64 or 128: one or two wgmma row
    blocks); `words` int32 code words (8 · words inputs for FP4, 4 · words for FP8, where a step must
    stay within one 128-block: 16 or 32) per pipeline step, `stages` steps in flight. `row_source`, where a
    program reads its tile's rows (TMA needs row offsets that are multiples of 8; a tile starts wherever its
    expert's rows do): "copied", each tile's `block_m` rows copied out beforehand; "window", the sorted
    rows where they lie, `block_m + 8` of them from the multiple of 8 at or before the tile's first, the
    tile's `block_m` kept (on the H200 slower than "copied" for gate_up at every tiling measured,
    docs/kernels.md); "aligned", the sorted rows scattered once into a buffer where each expert's rows
    start at a multiple of 8, then read where they lie, `block_m` of them. `code_layout` (FP4): "checkpoint" for
    `w_enk` as checkpoints hold it, "repacked" for `repack_codes(w_enk)` (fewer decode operations; same
    result bit for bit). FP8 scales are taken relative to the largest of their row of blocks in fp16:
    exact while a block's scale is at least 2^-22 of it (FP4's: 2^-24). Raises CannotTile for what it does not take:
    non-bf16 activations, float scales, widths that do not tile (FP4: K a multiple of 256, FP8: of 128;
    N of 64)."""
    p, k = x_pk.shape
    if storage not in ("fp4", "fp8"):
        raise ValueError(f"expert_matmul_mosaic: storage must be 'fp4' or 'fp8', got {storage!r}")
    if block_m % 8 or not 8 <= block_m <= MAX_BLOCK_M:
        raise ValueError(f"expert_matmul_mosaic: block_m must be a multiple of 8 from 8 to {MAX_BLOCK_M}, "
                         f"got {block_m}")
    if features not in (64, 128):
        raise ValueError(f"expert_matmul_mosaic: features must be 64 or 128, got {features}")
    if row_source not in ROW_SOURCES:
        raise ValueError(f"expert_matmul_mosaic: row_source must be one of {ROW_SOURCES}, got {row_source!r}")
    if row_source == "window" and block_m + 8 > MAX_BLOCK_M:
        raise ValueError(f"expert_matmul_mosaic: from a window, a program reads block_m + 8 rows, at most "
                         f"{MAX_BLOCK_M}: block_m={block_m} is too many")
    if words not in ((16, 32, 64) if storage == "fp4" else (16, 32)):
        raise ValueError(f"expert_matmul_mosaic: words must be 16, 32 or 64 (FP8: 16 or 32, a step within one "
                         f"128-block), got {words} for {storage.upper()}")
    if stages < 1:
        raise ValueError(f"expert_matmul_mosaic: stages must be at least 1, got {stages}")
    check_layout(code_layout, "expert_matmul_mosaic", storage)
    if fp8_block not in FP8_BLOCKS:
        raise ValueError(f"expert_matmul_mosaic: fp8_block must be one of {FP8_BLOCKS}, got {fp8_block}")
    w_enk, scale, first_expert = fold_layer(w_enk, scale, group_sizes_e, layer, "expert_matmul_mosaic")
    e, n = w_enk.shape[:2]  # e: every expert of the stack
    if x_pk.dtype != jnp.bfloat16:
        raise CannotTile(f"expert_matmul_mosaic: activations must be bf16, got {x_pk.dtype}")
    if scale.dtype not in (jnp.uint8, jnp.float8_e8m0fnu):
        raise CannotTile(f"expert_matmul_mosaic: {storage.upper()} experts need ue8m0 (power-of-two) scales, got "
                         f"{scale.dtype}")
    pairs = _pairs_per_word(storage)
    codes_per_word = 2 * pairs
    if storage == "fp4":
        stored_k, scale_shape = k // 2, (e, n, k // FP4_GROUP)
    else:
        stored_k, scale_shape = k, (e, -(-n // fp8_block), -(-k // fp8_block))
    if (k % (codes_per_word * words) or k % _SCALE_WORD_INPUTS or n % features or w_enk.shape[2] != stored_k
            or jnp.dtype(w_enk.dtype).itemsize != 1 or scale.shape != scale_shape):
        raise CannotTile(f"expert_matmul_mosaic: {storage.upper()} experts {w_enk.dtype} {w_enk.shape} with scales "
                         f"{scale.shape} against {k} inputs do not tile (inputs by {codes_per_word * words}, "
                         f"outputs by {features})")
    window = block_m + 8 if row_source == "window" else block_m  # rows each program reads and computes
    group_t, row0_t, rows_t = group_tiles(group_sizes_e, p, block_m)
    scale_t = group_t + first_expert
    scale_words = -(-k // 1024) * 8
    if layer is not None and (storage == "fp8" or scale_words != k // 128):
        # the scales are rewritten below: this layer's only
        scale = lax.dynamic_slice_in_dim(scale, first_expert, group_sizes_e.shape[0], axis=0)
        scale_t = group_t
    scale = lax.bitcast_convert_type(scale, jnp.uint8)
    if storage == "fp8":  # each row its blocks' scales, each 32 inputs' own: FP4's layout, a byte per row and 32 inputs
        scale = jnp.repeat(jnp.repeat(scale, fp8_block, axis=1)[:, :n], fp8_block // FP4_GROUP, axis=2)
    # Free view: four groups' scales per int32 word (little-endian).
    scale = lax.bitcast_convert_type(scale.reshape(scale.shape[0], n, k // 128, 4), jnp.int32)
    if scale_words != k // 128:  # V4.1's down_proj (2,304 inputs: 18 words a row)
        # The scales' TMA copy and their WGMMA-layout load take rows of whole 8-word tiles: pad with zero
        # bytes (2^-127, under every real scale, so each row's largest is unchanged).
        scale = jnp.pad(scale, ((0, 0), (0, 0), (0, scale_words - k // 128)))
    scale_smem = (features, scale_words)
    smem = (stages * (features * words * 4 + pairs * window * 2 * words * 2)  # the pipeline's codes and inputs
            + scale_smem[0] * scale_smem[1] * 4 + features * window * 4 + 16)  # scales, results, tile
    if smem > SMEM_BYTES:
        raise ValueError(f"expert_matmul_mosaic: block_m={block_m}, features={features}, words={words} and "
                         f"stages={stages} need {smem} bytes of shared memory, more than {SMEM_BYTES}")
    # Free view: eight FP4 or four FP8 codes per int32 word (little-endian).
    code_words = lax.bitcast_convert_type(
        lax.bitcast_convert_type(w_enk, jnp.uint8).reshape(e, n, stored_k // 4, 4), jnp.int32)
    pieces, unscale_p = fp16_rows({0: x_pk})
    read_t = row0_t  # where the kernel reads each tile's rows ("window": from the multiple of 8 at or before)
    if row_source == "aligned":
        # Each expert's rows moved to start at a multiple of 8: at most 7 more rows for each expert that has
        # any, and `window` more so that the last tile's read stays inside. Rows past Σ sizes (routed
        # nowhere) are dropped. A scatter of the P rows, instead of T · block_m rows gathered.
        groups = group_sizes_e.shape[0]
        sizes = group_sizes_e.astype(jnp.int32)
        padded = (sizes + 7) // 8 * 8
        moved_g = (jnp.cumsum(padded) - padded) - (jnp.cumsum(sizes) - sizes)
        group_p = jnp.searchsorted(jnp.cumsum(sizes), jnp.arange(p), side="right")
        n_rows = -(-(p + 7 * min(groups, p) + window) // 8) * 8  # TMA's tiled reads: a multiple of 8 rows
        # (dropped rows get distinct indices past the end, so that the indices stay unique and sorted)
        to_p = jnp.where(group_p < groups, jnp.arange(p) + moved_g[jnp.minimum(group_p, groups - 1)],
                         n_rows + jnp.arange(p))
        x_in = jnp.zeros((pairs, n_rows, k // pairs), jnp.float16).at[:, to_p].set(
            renumbered(pieces[0], storage), mode="drop", unique_indices=True, indices_are_sorted=True)
        read_t = row0_t + moved_g[group_t]
        shift_t = jnp.zeros_like(row0_t)
    elif row_source == "window":
        # [pairs, P + window (and up to a multiple of 8, as TMA's tiled reads need), K/pairs]
        x_in = renumbered(jnp.pad(pieces[0], ((0, window + (-(p + window) % 8)), (0, 0))), storage)
        shift_t = lax.rem(row0_t, 8)  # a tile's row i is row shift + i of its window
    else:
        x_qpc = renumbered(jnp.pad(pieces[0], ((0, window), (0, 0))), storage)  # [pairs, P + window, K/pairs]
        # Each tile's rows copied out ([pairs, T, block_m, K/pairs]): TMA into tiled shared memory needs row offsets
        # that are multiples of 8, and a tile starts wherever its expert's rows do. On the H200 these copies
        # (T ≥ E tiles, mostly of padding rows) cost 0.76 ms of a 7.0 ms decode step at 32 sequences, whether
        # gathered row by row or as slabs (docs/kernels.md); "window" and "aligned" drop them.
        x_in = jax.vmap(lambda r: lax.dynamic_slice_in_dim(x_qpc, r, block_m, axis=1), out_axes=1)(row0_t)
        shift_t = jnp.zeros_like(row0_t)
    tiles = jnp.stack([group_t + first_expert, read_t, rows_t, scale_t], axis=1)  # [T, 4]
    n_tiles = tiles.shape[0]
    scratch = [plgpu.SMEM((1, 4), jnp.int32), plgpu.SMEM(scale_smem, jnp.int32),
               plgpu.SMEM((features, window), jnp.float32), plgpu.Barrier()]
    if interpret:
        scratch.append(plgpu.SMEM((features, 2 * words), jnp.float16))

    def dsjax_expert_matmul_mosaic(*refs):  # the kernel's name in profiles and lowered modules
        _body(*refs, n_k=k // (codes_per_word * words), window=window, features=features, words=words,
              stages=stages, in_place=row_source != "copied", code_layout=code_layout, storage=storage,
              interpret=interpret)

    kernel = plgpu.kernel(
        dsjax_expert_matmul_mosaic, out_type=jax.ShapeDtypeStruct((n_tiles, n, window), jnp.float32),
        scratch_types=scratch, grid=(n_tiles, n // features), grid_names=("t", "n"),
        interpret=plgpu.InterpretGPUParams() if interpret else None)
    out_tnm = kernel(tiles, x_in, code_words, scale)
    # Row i of the expert-sorted rows is row i - row0 of its tile; tiles holding rows come first, in order.
    tile_p = jnp.searchsorted(jnp.where(rows_t > 0, row0_t + rows_t, p + 1), jnp.arange(p), side="right")
    tile_p = jnp.minimum(tile_p, n_tiles - 1)
    within_p = jnp.arange(p) - row0_t[tile_p] + shift_t[tile_p]  # the row's column of its tile's window
    if block_m < 32:  # few rows a tile (decode): pick the P · N results out of the tiles
        return (out_tnm[tile_p, :, within_p] * unscale_p[:, None]).astype(x_pk.dtype)
    # Most of the tiles' results are wanted (prefill): unscale, round and transpose them in one pass at
    # copy speed, then take whole rows. Rows past the tile's own are scaled by some row's factor: unused.
    unscale_tm = unscale_p[jnp.clip(row0_t[:, None] - shift_t[:, None] + jnp.arange(window), 0, p - 1)]
    out_tmn = (jnp.swapaxes(out_tnm, 1, 2) * unscale_tm[:, :, None]).astype(x_pk.dtype)
    return jnp.take(out_tmn.reshape(n_tiles * window, n), tile_p * window + within_p, axis=0)
