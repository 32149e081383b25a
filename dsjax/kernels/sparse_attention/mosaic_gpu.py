"""Sparse decode attention as a Mosaic GPU (Hopper, wgmma) kernel, for 64 bf16 query heads of width
512 over bf16 window rows and CSA picks: the shape of V4's attention layers, where it replaces the
Triton kernel (`triton.py`; `op.sparse_decode` takes this one wherever it applies). On the H200 it
attends a batch of 64 at 128K context in 24.5 µs where the Triton kernel takes 50.8 µs
(docs/benchmarks.md, 2026-11-30, third session).

Grid (slot, split); three warpgroups per program:
- the memory warpgroup gathers each block of 32 rows (Hopper has no row-gather copy). Natively
  (`gather="cp_async"`) each of its threads copies 16-byte pieces of the rows straight into the
  tiled, swizzled layout that wgmma reads, with `cp.async`, two blocks ahead. Mosaic GPU's
  interpreter cannot run that (it is inline Mosaic GPU code), so there, and on request natively,
  `gather="bulk"` copies each row with a bulk copy into an untiled staging buffer and rewrites each
  8-row group through registers into the tiles (a one-row slice of a swizzled tile does not lower as
  a copy destination). Both fill the same tiles, which the rest of the kernel reads alike;
- two compute warpgroups each own 256 of the 512 output channels (a [64, 256] fp32 accumulator is
  128 registers per thread). Each computes the scores over its half of the channels, the halves are
  summed through shared memory, and both run the same online softmax on the sum.

Numerics: scores, softmax and sums in fp32 (exp2 on scores pre-scaled by log2 e); probabilities are
rounded to bf16 for P·V (wgmma takes both operands in one type), so outputs carry about 1e-3
relative error against the fp32 reference. Each split returns its normalised output in fp16 and its
running max and mass (natural-log units, the sink's mass in split 0), merged by `triton.merge_splits`.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
from jax.experimental.mosaic import gpu as mgpu
from jax.extend.mlir import ir
from jax.extend.mlir.dialects import arith, memref
from jax._src.lib.mlir.dialects import llvm, nvvm  # not in jax.extend; Mosaic GPU's own kernels use them

from dsjax.kernels.devices import TUNED_GPU, device_facts
from dsjax.kernels.dispatch import CannotTile
from dsjax.cache import is_packed
from dsjax.kernels.sparse_attention.reference import unpacked_picks
from dsjax.kernels.sparse_attention.triton import merge_splits

HEADS, WIDTH = 64, 512
_HALF = WIDTH // 2
_LOG2E = math.log2(math.e)
# An [8, 512] group of staged rows in registers: each warp holds two rows, each lane 8 consecutive
# columns of a 256-column half, so the untiled loads and the swizzled stores are 16-byte vectors.
_ROWS_LAYOUT = plgpu.Layout.TILED(plgpu.Tiling(((8, 256), (2, 256), (8,))), warp_dims=(-5,), lane_dims=(-2,),
                                  vector_dim=-1)
_SMEM_BYTES = device_facts(TUNED_GPU).smem_bytes  # a Hopper's, as every GPU this kernel runs on
# Rows per block: at 32 the query, four tiled blocks and the score halves fill 208 KB of the 227 KB of
# shared memory (two staged and two tiled blocks with the bulk gather: 210 KB); at 64 even two tiled
# blocks leave no room for the larger score halves.
_BLOCK_K = 32
# wgmma's operand layout for bf16 rows: (8, 32) tiles, 64-byte swizzle (a 128-byte swizzle needs blocks
# of 64 rows).
_TILED = (plgpu.TilingTransform((8, 32)), plgpu.SwizzleTransform(64))
# Blocks of the native gather in flight beyond the one handed over (4 tiled blocks: 128 KB).
_LOOKAHEAD = 2


def _body(q_ref, window_ref, entries_ref, rows_ref, sinks_ref, acc_ref, ml_ref, q_smem, blocks_or_out, exch,
          rows_smem, q_bar, rows_bar, ready, consumed, xbar, xread, done, *gather_scratch, scale, block_k, n_blocks,
          n_window_blocks, gather):
    slot_b, split = lax.axis_index("b"), lax.axis_index("s")
    wg = lax.axis_index("wg")
    (tiled, *stage), out_smem = blocks_or_out  # the output's staging reuses the blocks' memory
    n_buf = tiled.shape[0]
    interp_p = gather_scratch[1:] if gather == "bulk" else ()

    @pl.when(wg < 2)
    def _compute():
        plgpu.set_max_registers(232, action="increase")

        @pl.when(wg == 0)
        def _():
            plgpu.copy_gmem_to_smem(q_ref.at[slot_b], q_smem, q_bar)
        plgpu.barrier_wait(q_bar)
        plgpu.barrier_wait(rows_bar)
        cols = pl.ds(wg * _HALF, _HALF)
        # Every split starts its running max at the sink logit (finite, so a block with no valid row
        # gives p = 0, never NaN); split 0 alone counts the sink's mass.
        m_h = plgpu.load(sinks_ref, layout=plgpu.Layout.WGMMA.reduce(1), optimized=False) * _LOG2E
        l_h = jnp.where(split == 0, 1.0, 0.0) * jnp.ones_like(m_h)
        acc = plgpu.layout_cast(jnp.zeros((HEADS, _HALF), jnp.float32), plgpu.Layout.WGMMA)

        def block(j, carry):
            acc, m_h, l_h = carry
            buf = lax.rem(j, n_buf)
            plgpu.barrier_wait(ready.at[buf])
            keys = tiled.at[buf]

            def scores(r):
                plgpu.wgmma(r, q_smem.at[:, cols], keys.at[:, cols].transpose((1, 0)))
                return r[...]
            s_part = pl.run_scoped(scores, plgpu.ACC((HEADS, block_k), jnp.float32))

            @pl.when(j > 0)
            def _():
                plgpu.barrier_wait(xread)  # the other warpgroup has read the previous block's halves
            # No fence: every thread arrives itself (release) and the reader waits (acquire).
            exch[wg] = s_part
            plgpu.barrier_arrive(xbar)
            plgpu.barrier_wait(xbar)
            s_hk = exch[0] + exch[1]
            plgpu.barrier_arrive(xread)
            ids = plgpu.load(rows_smem.at[j], layout=plgpu.Layout.WGMMA.reduce(0), optimized=False)
            valid = lax.broadcast_in_dim(ids >= 0, s_hk.shape, [1])
            s_hk = jnp.where(valid, s_hk * (scale * _LOG2E), -jnp.inf)
            m_new = jnp.maximum(m_h, s_hk.max(axis=1))
            alpha = jnp.exp2(m_h - m_new)
            p_hk = jnp.exp2(s_hk - lax.broadcast_in_dim(m_new, s_hk.shape, [0]))
            l_h = l_h * alpha + p_hk.sum(axis=1)
            acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
            if interp_p:  # the interpreter takes wgmma's A from SMEM only and cannot carry an accumulator
                p_smem = interp_p[0].at[wg]
                p_smem[...] = p_hk.astype(jnp.bfloat16)
                plgpu.commit_smem()

                def pv(r):
                    plgpu.wgmma(r, p_smem, keys.at[:, cols])
                    return r[...]
                acc = acc + pl.run_scoped(pv, plgpu.ACC((HEADS, _HALF), jnp.float32))
            else:
                def pv(r):
                    plgpu.wgmma(r, p_hk.astype(jnp.bfloat16), keys.at[:, cols])
                acc = pl.run_state(pv)(plgpu.ACC.init(acc))
            plgpu.barrier_arrive(consumed.at[buf])
            return acc, m_new, l_h

        acc, m_h, l_h = lax.fori_loop(0, n_blocks, block, (acc, m_h, l_h))
        plgpu.barrier_wait(xread)  # the last block's, so that every completion is observed
        # Through shared memory and one TMA store, as jax's FA3 kernel does (with the bulk gather
        # 30.5 µs against 31.7 storing the wgmma fragments directly; the same with cp.async).
        plgpu.barrier_arrive(done)
        plgpu.barrier_wait(done)  # neither warpgroup still reads a block: their memory is free
        # Normalised fp16 halves: half the bytes of fp32 sums (25.5 µs against 27.3 at 64 slots ×
        # 128K), 2^-11 relative rounding; a split that saw no row has l = 0 and acc = 0.
        out_smem[wg] = (acc / lax.broadcast_in_dim(jnp.where(l_h > 0, l_h, 1.0), acc.shape, [0])).astype(jnp.float16)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(out_smem.at[wg], acc_ref.at[slot_b, split, :, cols])

        @pl.when(wg == 0)
        def _():
            ml_ref[slot_b, split, 0] = m_h / _LOG2E
            ml_ref[slot_b, split, 1] = l_h
        plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == 2)
    def _memory():
        plgpu.set_max_registers(40, action="decrease")
        plgpu.copy_gmem_to_smem(rows_ref.at[slot_b, pl.ds(split * n_blocks, n_blocks)], rows_smem, rows_bar)
        plgpu.barrier_wait(rows_bar)
        in_window = lambda j: split * n_blocks + j < n_window_blocks  # a slot's blocks: window rows, then entries
        tables = (window_ref, entries_ref)
        if gather == "bulk":
            _gather_bulk(tables, in_window, rows_smem, tiled, ready, consumed, stage[0], gather_scratch[0],
                         n_blocks=n_blocks, block_k=block_k)
        else:
            _gather_cp_async(tables, in_window, rows_smem, tiled, ready, consumed, n_blocks=n_blocks)
        for j in range(max(n_blocks - n_buf, 0), n_blocks):  # observe the last consumptions
            plgpu.barrier_wait(consumed.at[j % n_buf])


def _gather_bulk(tables, in_window, rows_smem, tiled, ready, consumed, stage, staged, *, n_blocks, block_k):
    """The interpretable gather: one bulk copy per row into an untiled staging buffer, then each 8-row
    group rewritten through registers into the swizzled tiles (a one-row slice of a swizzled tile does
    not lower as a copy destination)."""
    def fetch(j):
        buf = lax.rem(j, 2)
        rows = [jnp.maximum(rows_smem[j, r], 0) for r in range(block_k)]  # read them all, then copy
        for table_ref, here in zip(tables, (in_window(j), ~in_window(j))):
            @pl.when(here)
            def _():
                for r in range(block_k):
                    plgpu.copy_gmem_to_smem(table_ref.at[pl.ds(rows[r], 1)], stage.at[buf, pl.ds(r, 1)],
                                            staged.at[buf], oob_mode=plgpu.OOBFillMode.PROMISE_IN_BOUNDS)

    fetch(0)

    @pl.loop(0, n_blocks)
    def _(j):
        buf = lax.rem(j, 2)

        @pl.when(j + 1 < n_blocks)
        def _():
            fetch(j + 1)
        plgpu.barrier_wait(staged.at[buf])

        @pl.when(j >= 2)
        def _():
            plgpu.barrier_wait(consumed.at[buf])
        for g in range(block_k // 8):
            tiled[buf, pl.ds(8 * g, 8)] = plgpu.load(stage.at[buf, pl.ds(8 * g, 8)], layout=_ROWS_LAYOUT)
        plgpu.commit_smem()
        plgpu.barrier_arrive(ready.at[buf])


def _gather_cp_async(tables, in_window, rows_smem, tiled, ready, consumed, *, n_blocks):
    """The native gather: every thread of the memory warpgroup copies its 16-byte pieces of the rows
    straight into wgmma's swizzled tiles with `cp.async` (no staging, no re-layout), `_LOOKAHEAD`
    blocks in flight. Each thread hands a block over once its own copies have landed
    (`cp.async.wait_group`, then a proxy fence)."""
    n_buf = tiled.shape[0]

    def done(j, newer):
        _cp_async_landed(newer)
        plgpu.barrier_arrive(ready.at[lax.rem(j, n_buf)])  # every thread arrives once its pieces landed

    @pl.loop(0, n_blocks)
    def _(j):
        buf = lax.rem(j, n_buf)

        @pl.when(j >= n_buf)
        def _():
            plgpu.barrier_wait(consumed.at[buf])
        for table_ref, here in zip(tables, (in_window(j), ~in_window(j))):
            @pl.when(here)
            def _():
                _cp_async_rows(table_ref, rows_smem.at[j], tiled.at[buf])
        _cp_async_commit()

        @pl.when(j >= _LOOKAHEAD)
        def _():
            done(j - _LOOKAHEAD, _LOOKAHEAD)
    for j in range(max(n_blocks - _LOOKAHEAD, 0), n_blocks):
        done(j, n_blocks - 1 - j)


@plgpu.inline_mgpu(arg_types=(plgpu.RefType(), plgpu.RefType(), plgpu.RefType(_TILED)))
def _cp_async_rows(ctx, table, rows, dst):
    """Copy the 32 rows `table[rows]` (negative ids: row 0, masked later) into `dst`, a [32, 512]
    bf16 block in (8, 32) tiles with the 64-byte swizzle. Warp w, lane l: tile-row rr = l // 4 and
    16-byte piece cc = l % 4 of tiles i * 4 + w, so that a warp writes one whole 512-byte tile per
    copy (no bank conflicts) and reads 64 contiguous bytes of each of 8 rows."""
    del ctx
    i32, i64, i8 = (ir.IntegerType.get_signless(n) for n in (32, 64, 8))
    c = lambda v, t=i32: arith.constant(t, v)
    t = arith.remui(mgpu.utils.thread_idx(), c(128))
    w, lane = arith.divui(t, c(32)), arith.remui(t, c(32))
    rr, cc = arith.divui(lane, c(4)), arith.remui(lane, c(4))
    # The 64-byte swizzle XORs a 16-byte piece's index with bits 7-8 of its offset in the tile.
    piece = arith.xori(cc, arith.andi(arith.shrui(rr, c(1)), c(3)))
    smem_thread = arith.addi(arith.addi(arith.muli(w, c(512)), arith.muli(rr, c(64))), arith.muli(piece, c(16)))
    gmem_thread = arith.muli(arith.addi(arith.muli(w, c(4)), cc), c(16))
    smem = mgpu.utils.memref_ptr(dst)
    gmem = llvm.addrspacecast(llvm.PointerType.get(address_space=1), mgpu.utils.memref_ptr(table))
    for rt in range(_BLOCK_K // 8):
        row = arith.index_cast(ir.IndexType.get(), arith.addi(rr, c(8 * rt)))
        row_id = arith.maxsi(memref.load(rows, [row]), c(0))
        row_ptr = mgpu.utils.getelementptr(gmem, [arith.muli(arith.extsi(i64, row_id), c(2 * WIDTH, i64))], i8)
        for k in range(4):  # tiles rt * 16 + k * 4 + w: columns (k * 4 + w) * 32 …
            dst_ptr = mgpu.utils.getelementptr(smem, [arith.addi(smem_thread, c((rt * 16 + k * 4) * 512))], i8)
            src_ptr = mgpu.utils.getelementptr(row_ptr, [arith.addi(gmem_thread, c(k * 256))], i8)
            nvvm.cp_async_shared_global(dst_ptr, src_ptr, 16, nvvm.LoadCacheModifierKind.CG)


@plgpu.inline_mgpu()
def _cp_async_commit(ctx):
    del ctx
    nvvm.cp_async_commit_group()


def _cp_async_landed(newer: int) -> None:
    """Wait until at most `newer` of this thread's cp.async groups are in flight, then make what
    landed visible to wgmma (the async proxy) — per thread, so no warpgroup barrier is needed."""
    @plgpu.inline_mgpu()
    def landed(ctx):
        del ctx
        nvvm.cp_async_wait_group(newer)
        nvvm.fence_proxy(nvvm.ProxyKind.async_shared, space=nvvm.SharedSpace.shared_cta)
    landed()


def _table(rows, name: str) -> jax.Array:
    """The rows `[B, N, 512]` as one bf16 table `[B·N, 512]`; other storages are the Triton kernel's."""
    if not isinstance(rows, jax.Array) or rows.dtype != jnp.bfloat16 or rows.ndim != 3 or rows.shape[2] != WIDTH:
        raise CannotTile(f"sparse attention (Mosaic GPU): {name} must be a bf16 array [B, N, {WIDTH}], got "
                         f"{type(rows).__name__} {getattr(rows, 'dtype', '')} {getattr(rows, 'shape', '')}")
    return rows.reshape(-1, WIDTH)


def _on_hopper():
    """Raise CannotTile where the local GPU is not a Hopper (sm90): wgmma exists only there (Blackwell has
    tcgen05 instead). Lowering without a GPU (`jax.export` on a CPU machine) targets Hopper."""
    gpus = [d for d in jax.local_devices() if d.platform == "gpu"]
    if gpus and not str(getattr(gpus[0], "compute_capability", "9.0")).startswith("9."):
        raise CannotTile(f"sparse attention (Mosaic GPU): needs a Hopper GPU (sm90), got {gpus[0].device_kind}")


@functools.partial(jax.jit, static_argnames=("scale", "num_splits", "out_dtype", "gather", "interpret"))
def sparse_decode_mosaic(q_bhd: jax.Array, window, window_len_b: jax.Array, entries, sinks_h: jax.Array,
                         scale: float, *, entries_len_b: jax.Array | None = None, idx_bk: jax.Array | None = None,
                         out_dtype=None, num_splits: int = 2, gather: str | None = None,
                         interpret: bool = False) -> jax.Array:
    """`reference.sparse_decode_reference` as a Mosaic GPU kernel, for what it covers: 64 bf16 query
    heads of width 512, bf16 window and entry rows, CSA picks (-1: no row) or no entries. Entry
    prefixes (HCA) are the Triton kernel's: this kernel reads a fixed number of rows per slot, and a
    prefix is as long as the cache. Raises CannotTile on anything else (`dispatch` then takes the
    Triton kernel). `num_splits` programs per slot share its rows; `interpret` runs Mosaic GPU's
    interpreter (CPU)."""
    b, h, d = q_bhd.shape
    if (h, d) != (HEADS, WIDTH) or q_bhd.dtype != jnp.bfloat16:
        raise CannotTile(f"sparse attention (Mosaic GPU): needs {HEADS} bf16 query heads of width {WIDTH}, got "
                         f"{q_bhd.dtype} {q_bhd.shape}")
    if entries_len_b is not None:
        raise CannotTile("sparse attention (Mosaic GPU): entry prefixes (HCA) are not covered")
    if entries is not None and idx_bk is None:
        raise ValueError("sparse attention: give exactly one of the entry counts (attend a prefix) and the picks")
    if not interpret:
        _on_hopper()
    block_k = _BLOCK_K
    window_nd = _table(window, "the window")
    w = window.shape[1]
    # Each slot's rows: its window ring rows [0, window_len), then its picks; -1 marks no row.
    r_w = jnp.arange(-(-w // block_k) * block_k, dtype=jnp.int32)
    slot = jnp.arange(b, dtype=jnp.int32)[:, None]
    rows_bk = jnp.where((r_w < window_len_b[:, None]) & (r_w < w), slot * w + r_w, -1)
    n_window_blocks = rows_bk.shape[1] // block_k
    entries_nd = window_nd
    if entries is not None:
        entries_nd, t = _table(entries, "the entries"), entries.shape[1]
        idx_bk = idx_bk.astype(jnp.int32)
        picks = jnp.where((idx_bk >= 0) & (idx_bk < t), slot * t + idx_bk, -1)
        rows_bk = jnp.concatenate([rows_bk, picks], axis=1)
    k = rows_bk.shape[1]
    n_blocks = -(-k // (block_k * num_splits))
    pad = n_blocks * block_k * num_splits - k
    rows = jnp.pad(rows_bk, ((0, 0), (0, pad)), constant_values=-1).reshape(b, num_splits * n_blocks, block_k)
    if gather is None:
        gather = "bulk" if interpret else "cp_async"
    if gather not in ("bulk", "cp_async") or (interpret and gather != "bulk"):
        raise ValueError(f"sparse attention (Mosaic GPU): gather must be 'cp_async' (native) or 'bulk' "
                         f"(native or interpreted), got {gather!r}{' in the interpreter' if interpret else ''}")
    n_buf = 2 if gather == "bulk" else _LOOKAHEAD + 2
    blocks = [plgpu.SMEM((n_buf, block_k, WIDTH), jnp.bfloat16, transforms=_TILED)]  # rows for wgmma
    if gather == "bulk":
        blocks.append(plgpu.SMEM((2, block_k, WIDTH), jnp.bfloat16))                # staged rows
    scratch = [
        plgpu.SMEM((HEADS, WIDTH), jnp.bfloat16, transforms=_TILED),                # q
        plgpu.RefUnion(blocks, plgpu.SMEM((2, HEADS, _HALF), jnp.float16)),         # blocks | output halves
        plgpu.SMEM((2, HEADS, block_k), jnp.float32),                               # score halves
        plgpu.SMEM((n_blocks, block_k), jnp.int32),                                 # this split's rows
        plgpu.Barrier(), plgpu.Barrier(),                                           # q, rows
        plgpu.Barrier(num_barriers=n_buf),                                          # ready
        plgpu.Barrier(num_arrivals=2, num_barriers=n_buf),                          # consumed
        plgpu.Barrier(num_arrivals=2), plgpu.Barrier(num_arrivals=2),               # xbar, xread
        plgpu.Barrier(num_arrivals=2),                                              # done
    ]
    if gather == "bulk":
        scratch.append(plgpu.Barrier(num_arrivals=block_k, num_barriers=2))         # staged
    if interpret:
        scratch.append(plgpu.SMEM((2, HEADS, block_k), jnp.bfloat16, transforms=_TILED))
    used = 2 * HEADS * WIDTH + max(2 * (n_buf + 2 * (gather == "bulk")) * block_k * WIDTH, 2 * HEADS * WIDTH) + 4 * (
        2 * HEADS * block_k + n_blocks * block_k)
    if not interpret and used > _SMEM_BYTES - 1024:
        raise CannotTile(f"sparse attention (Mosaic GPU): {n_blocks * block_k} rows per split need "
                         f"{used} bytes of shared memory (of {_SMEM_BYTES}); raise num_splits")

    def dsjax_sparse_decode_mosaic(*refs):  # the kernel's name in profiles and lowered modules
        _body(*refs, scale=scale, block_k=block_k, n_blocks=n_blocks, n_window_blocks=n_window_blocks,
              gather=gather)

    kernel = plgpu.kernel(
        dsjax_sparse_decode_mosaic,
        out_type=(jax.ShapeDtypeStruct((b, num_splits, HEADS, WIDTH), jnp.float16),
                  jax.ShapeDtypeStruct((b, num_splits, 2, HEADS), jnp.float32)),
        scratch_types=scratch, grid=(b, num_splits), grid_names=("b", "s"), num_threads=3, thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True, unsafe_no_auto_barriers=True),
        interpret=plgpu.InterpretGPUParams() if interpret else None)
    acc, ml = kernel(q_bhd, window_nd, entries_nd, rows, sinks_h.astype(jnp.float32))
    return merge_splits(acc.astype(jnp.float32) * ml[:, :, 1, :, None], ml, out_dtype or q_bhd.dtype)


def sparse_decode_mosaic_packed(q_bhd: jax.Array, window, window_len_b: jax.Array, entries, sinks_h: jax.Array,
                                scale: float, *, entries_len_b: jax.Array | None = None,
                                idx_bk: jax.Array | None = None, out_dtype=None, num_splits: int = 2,
                                interpret: bool = False) -> jax.Array:
    """`sparse_decode_mosaic` over packed rows (V4's fp8/fp4 `PackedKV`, V4.1's `Records`): XLA first
    gathers each slot's picks and dequantizes them and the window ring to bf16 as `cache.read_rows` does
    (the rounding the Triton kernel applies in registers; V4.1's records hold bf16 values exactly), then
    the kernel attends them with the picks renumbered 0..k-1 (`reference.unpacked_picks`).
    That costs a second pass over the picked rows, which the Triton kernel avoids, and is still 2.3×
    faster (fp8, 64 slots × 128K on the H200: 71 µs against 162). Raises CannotTile where no row is
    packed (the kernel takes bf16 rows directly) and on what the kernel does not cover."""
    if not (is_packed(window) or is_packed(entries)):
        raise CannotTile("sparse attention (Mosaic GPU, packed rows): no packed rows; the kernel takes these")
    if entries_len_b is not None:
        raise CannotTile("sparse attention (Mosaic GPU): entry prefixes (HCA) are not covered")
    if entries is not None and idx_bk is None:
        raise ValueError("sparse attention: give exactly one of the entry counts (attend a prefix) and the picks")
    window, entries, idx_bk = unpacked_picks(window, entries, idx_bk, jnp.bfloat16)
    return sparse_decode_mosaic(q_bhd, window, window_len_b, entries, sinks_h, scale, idx_bk=idx_bk,
                                out_dtype=out_dtype, num_splits=num_splits, interpret=interpret)
