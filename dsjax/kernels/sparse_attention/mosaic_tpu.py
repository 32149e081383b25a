"""Sparse decode attention as a Pallas kernel for TPUs (Mosaic lowering; runs on CPU under the TPU
interpreter, `interpret=pltpu.InterpretParams()`).

Grid `(slot, head block)`, both parallel. One program holds `block_h` query heads (all of them by
default, so the cache is read once per slot) and an online softmax whose running max starts at the
sink logit and whose running sum starts at 1 (the sink's own mass), as the GPU kernel's does. It walks:

1. the window ring: the whole `[W, ·]` window of the slot is one VMEM block (BlockSpec, pipelined by
   Pallas across slots), read in aligned slices of `block_k` rows up to `window_len[b]`;
2. the compressed entries, which stay in HBM (`memory_space=pl.ANY`) and are copied by manual DMA
   into a two-slot VMEM buffer, the copy of block e+1 in flight while block e is computed (block 0's
   copy overlaps the window): for HCA (`entries_len_b`) one DMA per storage array copies a contiguous
   `block_k`-row block; for CSA (`idx_bk`) one DMA per picked row gathers it, the picks read from
   SMEM (scalar prefetch); a −1 pick copies row 0, as the reference reads it, and is masked.

The lengths and the picks are scalar-prefetch arguments (SMEM); the picks also come as a small VMEM
block `[K/block_k, block_k]` per slot for the lane-major visibility mask.

Prefill (`sparse_prefill_tpu`) runs the same program over every (slot, query) row of a chunk: the
grid's first axis is the row, each row has its own window range `[start, end)`, entry count or picks,
and its window and entries blocks are its slot's (index map `row // C`).

Storage: rows arrive as the arrays they are stored in and are dequantized in VMEM exactly as
`quant.unpack_kv` does (fp32 product, one rounding to the query dtype), from integer bit operations
only (e4m3, e2m1 and ue8m0 are decoded from their bytes). Each row is used as column pieces, and the
queries and outputs are split the same way outside the kernel (they are small): float storage is
one piece; fp8 is `[codes | rope]`; fp4 is `[even columns | odd columns | rope]`, because the two
nibbles of a byte are adjacent columns: the kernel never interleaves lanes, the wrapper de-interleaves
q and re-interleaves the output instead. Window and entries must share one layout.

Numerics follow `reference.py`: scores `q·k` with fp32 sums (bf16 × bf16 products are exact on the
MXU; fp32 operands use `Precision.HIGHEST`), scaled in fp32, softmax in fp32. P·V: for bf16 queries
the fp32 probabilities are split into bf16 hi + lo parts (16 significant bits, relative error
≤ 2^-17) and the two bf16 dots are summed in fp32; fp32 queries use one fp32 dot at
`Precision.HIGHEST`.

Not yet run on TPU hardware (checked under the interpreter and by lowering with `jax.export`). The
step most likely to need work there is the CSA gather: each DMA starts at an arbitrary row, and in
TPU's tiled layouts a row of a packed dtype (bf16 packs 2 rows per 32-bit word, 8-bit codes and
scales 4) is a sub-word slice, which Mosaic may refuse (32-bit rows are what jax's own tests cover).
Gathering the 32-bit word row that holds the pick (`ref.bitcast(jnp.int32)`, 2-4x the bytes) and
shifting it out would avoid that, but this jax's TPU interpreter cannot run DMAs of bitcast refs.
The flat picks `[B·K]` must also fit in SMEM.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from dsjax.kernels.dispatch import CannotTile
from dsjax.quant import PackedKV

F32 = jnp.float32
_NT = (((1,), (1,)), ((), ()))  # a @ b.T
_NN = (((1,), (0,)), ((), ()))  # a @ b


# ------------------------------------------------------------------ exact decoders (integer ops)
def byte_values(x: jax.Array) -> jax.Array:
    """An 8-bit array (int8, uint8, e4m3, e8m0) → its bytes as int32 0…255."""
    if x.dtype != jnp.int8:
        x = jax.lax.bitcast_convert_type(x, jnp.int8)
    return x.astype(jnp.int32) & 0xFF


def _div(a: jax.Array, n: int) -> jax.Array:
    """`a // n` for non-negative int32 `a` (truncating division: Python's floor division lowers
    through `sign`, which Mosaic lowers only for a known TPU generation)."""
    return jax.lax.div(a, jnp.int32(n))


def _from_bits(bits: jax.Array) -> jax.Array:
    return jax.lax.bitcast_convert_type(bits, F32)


def e4m3_to_f32(byte: jax.Array) -> jax.Array:
    """e4m3fn bytes (int32) → fp32 values: 1 sign, 4 exponent (bias 7), 3 mantissa bits; 0x7F is NaN."""
    exponent, mantissa = (byte >> 3) & 0xF, byte & 0x7
    normal = _from_bits(((exponent + 120) << 23) | (mantissa << 20))  # 2^(e−7) · 1.m
    subnormal = mantissa.astype(F32) * (2.0 ** -9)  # 2^-6 · 0.m
    magnitude = jnp.where(exponent == 0, subnormal, normal)
    magnitude = jnp.where((byte & 0x7F) == 0x7F, jnp.nan, magnitude)
    return jnp.where(byte >= 0x80, -magnitude, magnitude)


def e2m1_to_f32(code: jax.Array) -> jax.Array:
    """e2m1 codes (int32 0…15) → fp32: sign bit 3, exponent bits 2-1 (bias 1), mantissa bit 0."""
    exponent, mantissa = (code >> 1) & 0x3, code & 0x1
    normal = _from_bits(((exponent + 126) << 23) | (mantissa << 22))  # 2^(e−1) · 1.m
    magnitude = jnp.where(exponent == 0, mantissa.astype(F32) * 0.5, normal)
    return jnp.where(code >= 8, -magnitude, magnitude)


def scales_to_f32(s: jax.Array) -> jax.Array:
    """Scales as fp32: 8-bit ones are ue8m0 bytes, 2^(b−127) (0: 2^-127, 255: NaN), as `quant.ue8m0_to_float`."""
    if jnp.dtype(s.dtype).itemsize != 1:
        return s.astype(F32)
    b = byte_values(s)
    bits = jnp.where(b == 0, 0x00400000, b << 23)
    return _from_bits(jnp.where(b == 255, 0x7FC00000, bits))


def expand_groups(scales: jax.Array, column_group: jax.Array) -> jax.Array:
    """`[r, G]` per-group scales → `[r, w]` per-column scales, column c taking `scales[:, column_group[c]]`."""
    out = jnp.zeros((scales.shape[0], column_group.shape[1]), F32)
    for g in range(scales.shape[1]):
        out = jnp.where(column_group == g, scales[:, g:g + 1], out)
    return out


# ------------------------------------------------------------------------------------ row layouts
@dataclasses.dataclass(frozen=True)
class Layout:
    """How one stored row of `width` channels is split into pieces: "float" (one piece), "fp8"
    (`[codes n | rope rd]`) or "fp4" (`[even n/2 | odd n/2 | rope rd]`)."""

    kind: str
    width: int
    rope: int = 0
    group: int = 0

    @property
    def body(self) -> int:
        return self.width - self.rope

    @property
    def piece_widths(self) -> tuple[int, ...]:
        if self.kind == "float":
            return (self.width,)
        body = (self.body,) if self.kind == "fp8" else (self.body // 2, self.body // 2)
        return body + ((self.rope,) if self.rope else ())

    def split(self, x: jax.Array) -> list[jax.Array]:
        """Columns `[..., width]` → the pieces, in the order the kernel uses them."""
        if self.kind == "float":
            return [x]
        n = self.body
        body = [x[..., :n]] if self.kind == "fp8" else [x[..., 0:n:2], x[..., 1:n:2]]
        return body + ([x[..., n:]] if self.rope else [])

    def merge(self, pieces: list[jax.Array]) -> jax.Array:
        """The inverse of `split`."""
        if self.kind == "float":
            return pieces[0]
        if self.kind == "fp8":
            body, rest = pieces[0], pieces[1:]
        else:
            even, odd = pieces[:2]
            body, rest = jnp.stack([even, odd], axis=-1).reshape(*even.shape[:-1], self.body), pieces[2:]
        return jnp.concatenate([body, *rest], axis=-1) if rest else body

    def arrays(self, rows) -> list[jax.Array]:
        """The storage arrays the kernel receives (a zero-width rope is left out)."""
        if self.kind == "float":
            return [rows]
        return [rows.codes, rows.scales] + ([rows.rope] if self.rope else [])

    def decode(self, values: list[jax.Array], dtype) -> list[jax.Array]:
        """Loaded storage blocks `[r, ·]` → the row's pieces in `dtype`, as `quant.unpack_kv` computes them."""
        if self.kind == "float":
            return [values[0].astype(dtype)]
        codes, scales = values[0], scales_to_f32(values[1])
        rope = [values[2].astype(dtype)] if self.rope else []
        if self.kind == "fp8":
            column = jax.lax.broadcasted_iota(jnp.int32, (1, self.body), 1)
            body = e4m3_to_f32(byte_values(codes)) * expand_groups(scales, _div(column, self.group))
            return [body.astype(dtype)] + rope
        byte = byte_values(codes)
        j = jax.lax.broadcasted_iota(jnp.int32, (1, self.body // 2), 1)
        even = e2m1_to_f32(byte & 0xF) * expand_groups(scales, _div(2 * j, self.group))
        odd = e2m1_to_f32(byte >> 4) * expand_groups(scales, _div(2 * j + 1, self.group))
        return [even.astype(dtype), odd.astype(dtype)] + rope


def layout_of(rows, width: int, what: str) -> Layout:
    """The layout of `rows` (array or PackedKV `[B, N, ·]`) holding rows of `width` channels."""
    if not isinstance(rows, PackedKV):
        if rows.ndim != 3 or rows.shape[-1] != width:
            raise ValueError(f"sparse attention TPU kernel: {what} rows {tuple(rows.shape)} must be [B, N, {width}]")
        return Layout("float", width)
    rd = rows.rope.shape[-1]
    n = width - rd
    fmt = rows.fmt
    n_codes, n_scales = (n, -(-n // rows.group)) if fmt == "fp8" else (n // 2, -(-n // rows.group))
    if fmt == "fp4" and n % 2:
        raise CannotTile(f"sparse attention TPU kernel: fp4 {what} rows need an even number of quantized channels, got {n}")
    if rows.codes.shape[-1] != n_codes or rows.scales.shape[-1] != n_scales:
        raise ValueError(f"sparse attention TPU kernel: {what} {fmt} rows of {width} channels ({rd} rotary) need codes "
                         f"[..., {n_codes}] and scales [..., {n_scales}], got {tuple(rows.codes.shape)} and "
                         f"{tuple(rows.scales.shape)}")
    return Layout(fmt, width, rd, rows.group)


def row_tile(dtype) -> int:
    """Rows per native (sublane) tile of `dtype` on TPU: 8 for 32-bit, 16 for 16-bit, 32 for 8-bit."""
    return 8 * (4 // jnp.dtype(dtype).itemsize)


def _block_rows(n_rows: int, block_k: int, arrays: list[jax.Array], what: str) -> int:
    """Rows per block over `n_rows` stored rows: all of them when they fit in `block_k`, else `block_k`,
    which must then divide them and be a multiple of every storage array's native row tile."""
    if n_rows <= block_k:
        return n_rows
    tile = max(row_tile(a.dtype) for a in arrays)
    if n_rows % block_k or block_k % tile:
        raise CannotTile(f"sparse attention TPU kernel: {n_rows} {what} rows cannot be tiled in blocks of "
                         f"block_k={block_k}: block_k must divide the rows and be a multiple of {tile} (the storage's "
                         "sublane tile)")
    return block_k


# ------------------------------------------------------------------------------------------ kernel
@dataclasses.dataclass(frozen=True)
class _Config:
    layout: Layout
    mode: str  # "none", "prefix" or "picks"
    scale: float
    n_window: int  # W
    block_w: int  # window rows per block
    n_entries: int  # T
    block_e: int  # entry rows per block (picks per block for "picks")
    n_picks: int  # K padded to a multiple of block_e
    rows_per_slot: int  # query rows per slot: 1 (decode) or the chunk's C (prefill)


def _kernel(*refs, cfg: _Config):
    lay = cfg.layout
    n_pieces = len(lay.piece_widths)
    n_arrays = 1 if lay.kind == "float" else 2 + (lay.rope > 0)
    refs = list(refs)

    def take(n):
        out = refs[:n]
        del refs[:n]
        return out

    window_start_ref, window_end_ref, entries_len_ref = take(3)
    picks_smem = take(1)[0] if cfg.mode == "picks" else None
    q_refs = take(n_pieces)
    (sinks_ref,) = take(1)
    window_refs = take(n_arrays)
    entry_hbm = take(n_arrays) if cfg.mode != "none" else []
    picks_vmem = take(1)[0] if cfg.mode == "picks" else None
    o_refs = take(n_pieces)
    acc_refs = take(n_pieces)
    m_ref, l_ref = take(2)
    if cfg.mode != "none":
        buffers = take(n_arrays)
        (sem,) = take(1)
    assert not refs

    i = pl.program_id(0)  # the query row; its keys are its slot's
    b = _div(i, cfg.rows_per_slot)
    dtype = q_refs[0].dtype
    exact = jax.lax.Precision.HIGHEST if dtype == jnp.float32 else None
    qs = [r[...] for r in q_refs]

    m_ref[...] = sinks_ref[...]  # running max starts at the sink logit, running sum at its mass 1
    l_ref[...] = jnp.ones_like(l_ref)
    for acc in acc_refs:
        acc[...] = jnp.zeros_like(acc)

    def pv(p, v):
        if dtype == jnp.float32:
            return jax.lax.dot_general(p, v, _NN, preferred_element_type=F32, precision=exact)
        hi = p.astype(jnp.bfloat16)
        lo = (p - hi.astype(F32)).astype(jnp.bfloat16)
        return (jax.lax.dot_general(hi, v, _NN, preferred_element_type=F32)
                + jax.lax.dot_general(lo, v, _NN, preferred_element_type=F32))

    def attend(values, valid):
        """One block: `values` the loaded storage blocks `[r, ·]`, `valid [1, r]` the visible keys."""
        keys = lay.decode(values, dtype)
        s = sum(jax.lax.dot_general(q, k, _NT, preferred_element_type=F32, precision=exact)
                for q, k in zip(qs, keys))
        s = jnp.where(valid, s * cfg.scale, -jnp.inf)
        m_prev = m_ref[...]
        m_new = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
        alpha = jnp.exp(m_prev - m_new)
        p = jnp.exp(s - m_new)
        l_ref[...] = alpha * l_ref[...] + jnp.sum(p, axis=1, keepdims=True)
        m_ref[...] = m_new
        for acc, k in zip(acc_refs, keys):
            acc[...] = alpha * acc[...] + pv(p, k)

    # 1. The window rows [start, end), from the slot's VMEM block.
    window_start = jnp.maximum(window_start_ref[i], 0)
    window_end = jnp.minimum(window_end_ref[i], cfg.n_window)
    bw = cfg.block_w

    def window_block(j, carry):
        first = pl.multiple_of(j * bw, bw)
        rows = first + jax.lax.broadcasted_iota(jnp.int32, (1, bw), 1)
        attend([r[pl.ds(first, bw), :] for r in window_refs], (rows >= window_start) & (rows < window_end))
        return carry

    # 2. The compressed entries, by double-buffered DMA from HBM.
    be = cfg.block_e
    if cfg.mode == "prefix":
        entries_len = jnp.minimum(entries_len_ref[i], cfg.n_entries)
        n_blocks = _div(entries_len + be - 1, be)

        def copies(e, slot):
            start = pl.multiple_of(e * be, be)
            return [pltpu.make_async_copy(h.at[b, pl.ds(start, be)], buf.at[slot], sem.at[slot])
                    for h, buf in zip(entry_hbm, buffers)]

        def start_block(e, slot):
            for c in copies(e, slot):
                c.start()

        def wait_block(e, slot):
            for c in copies(e, slot):
                c.wait()

        def visible(e):
            rows = e * be + jax.lax.broadcasted_iota(jnp.int32, (1, be), 1)
            return rows < entries_len

    elif cfg.mode == "picks":
        n_blocks = cfg.n_picks // be

        def row_copies(e, slot, r):
            pick = picks_smem[i * cfg.n_picks + e * be + r]
            row = jnp.clip(pick, 0, cfg.n_entries - 1)  # −1 (no pick) copies row 0 and is masked
            return [pltpu.make_async_copy(h.at[b, pl.ds(row, 1)], buf.at[slot, pl.ds(r, 1)], sem.at[slot])
                    for h, buf in zip(entry_hbm, buffers)]

        def each_row_copy(e, slot, act):
            def body(r, carry):
                for c in row_copies(e, slot, r):
                    act(c)
                return carry
            jax.lax.fori_loop(0, be, body, 0)

        def start_block(e, slot):
            each_row_copy(e, slot, lambda c: c.start())

        def wait_block(e, slot):
            each_row_copy(e, slot, lambda c: c.wait())

        def visible(e):
            return picks_vmem[pl.ds(e, 1), :] >= 0

    if cfg.mode != "none":
        @pl.when(n_blocks > 0)
        def _():
            start_block(0, 0)  # in flight while the window is computed

    jax.lax.fori_loop(_div(window_start, bw), _div(window_end + bw - 1, bw), window_block, 0)

    if cfg.mode != "none":
        def entry_block(e, carry):
            slot = jax.lax.rem(e, 2)

            @pl.when(e + 1 < n_blocks)
            def _():
                start_block(e + 1, 1 - slot)

            wait_block(e, slot)
            attend([buf[slot] for buf in buffers], visible(e))
            return carry

        jax.lax.fori_loop(0, n_blocks, entry_block, 0)

    l = l_ref[...]
    for o, acc in zip(o_refs, acc_refs):
        o[...] = (acc[...] / l).astype(o.dtype)


_STATIC = ("scale", "out_dtype", "block_k", "block_h", "interpret")


@functools.partial(jax.jit, static_argnames=_STATIC)
def sparse_decode_tpu(q_bhd: jax.Array, window, window_len_b: jax.Array, entries, sinks_h: jax.Array, scale: float,
                      *, entries_len_b: jax.Array | None = None, idx_bk: jax.Array | None = None, out_dtype=None,
                      block_k: int = 128, block_h: int | None = None, interpret=False) -> jax.Array:
    """`reference.sparse_decode_reference` as a Pallas TPU kernel (same arguments and result).

    `block_k`: key rows per block (window, HCA entries) and picks per gather block (CSA); a window or
    entry array longer than `block_k` must be a multiple of it, and `block_k` then a multiple of its
    storage's sublane tile (8 rows for 32-bit, 16 for bf16, 32 for 8-bit). `block_h`: query heads per
    program (default all: one read of the cache per slot), a multiple of 8 dividing H. Picks must be
    −1 or a row below T (a larger one reads row T−1).
    `interpret`: False on a TPU, or `pltpu.InterpretParams()` to run on CPU.
    """
    b = q_bhd.shape[0]
    return _attention(q_bhd, window, jnp.zeros((b,), jnp.int32), window_len_b, entries, sinks_h, scale, entries_len_b,
                      idx_bk, 1, out_dtype, block_k, block_h, interpret, "sparse_decode_tpu")


@functools.partial(jax.jit, static_argnames=_STATIC)
def sparse_prefill_tpu(q_bchd: jax.Array, window, window_start_bc: jax.Array, window_end_bc: jax.Array, entries,
                       sinks_h: jax.Array, scale: float, *, entries_len_bc: jax.Array | None = None,
                       idx_bck: jax.Array | None = None, out_dtype=None, block_k: int = 128,
                       block_h: int | None = None, interpret=False) -> jax.Array:
    """`reference.sparse_prefill_reference` as a Pallas TPU kernel: the decode kernel's grid over every
    (slot, query) row, each reading its slot's rows (`block_k`, `block_h`, `interpret` as
    `sparse_decode_tpu`'s)."""
    b, c, h, d = q_bchd.shape
    flat = lambda x: None if x is None else x.reshape(b * c, *x.shape[2:])  # noqa: E731
    out = _attention(flat(q_bchd), window, flat(window_start_bc), flat(window_end_bc), entries, sinks_h, scale,
                     flat(entries_len_bc), flat(idx_bck), c, out_dtype, block_k, block_h, interpret,
                     "sparse_prefill_tpu")
    return out.reshape(b, c, h, d)


def _attention(q_nhd, window, window_start_n, window_end_n, entries, sinks_h, scale, entries_len_n, idx_nk,
               rows_per_slot: int, out_dtype, block_k: int, block_h: int | None, interpret, what: str) -> jax.Array:
    """N query rows, row i reading slot i // rows_per_slot's window rows [start, end) and entries."""
    n, h, d = q_nhd.shape
    if q_nhd.dtype not in (jnp.bfloat16, jnp.float32):
        raise CannotTile(f"{what}: queries must be bfloat16 or float32, got {q_nhd.dtype}")
    if entries is not None and (entries_len_n is None) == (idx_nk is None):
        raise ValueError(f"{what}: give exactly one of the entry counts (attend a prefix) and the picks")
    block_h = block_h or h
    if h % block_h or (block_h != h and block_h % 8):
        raise CannotTile(f"{what}: heads ({h}) must be a multiple of block_h ({block_h}), "
                         "itself a multiple of 8 unless it is all of them")
    if block_k < 1:
        raise ValueError(f"{what}: block_k must be positive, got {block_k}")
    mode = "none" if entries is None else ("picks" if idx_nk is not None else "prefix")

    layout = layout_of(window, d, "window")
    window_arrays = layout.arrays(window)
    n_window = window_arrays[0].shape[1]
    block_w = _block_rows(n_window, block_k, window_arrays, "window")
    entry_arrays, n_entries, block_e, n_picks = [], 0, 1, 0
    if entries is not None:
        entry_layout = layout_of(entries, d, "entry")
        if entry_layout != layout:
            raise CannotTile(f"{what}: window and entries must be stored alike, got {layout} and {entry_layout}")
        entry_arrays = layout.arrays(entries)
        n_entries = entry_arrays[0].shape[1]
        if mode == "prefix":
            block_e = _block_rows(n_entries, block_k, entry_arrays, "entry")
        else:
            k = idx_nk.shape[1]
            block_e = block_k if k > block_k else -(-k // 8) * 8
            n_picks = -(-k // block_e) * block_e
            idx_nk = jnp.pad(idx_nk.astype(jnp.int32), ((0, 0), (0, n_picks - k)), constant_values=-1)

    cfg = _Config(layout, mode, float(scale), n_window, block_w, n_entries, block_e, n_picks, rows_per_slot)
    out_dtype = jnp.dtype(out_dtype or q_nhd.dtype)
    widths = layout.piece_widths

    scalars = [window_start_n.astype(jnp.int32), window_end_n.astype(jnp.int32),
               (entries_len_n if entries_len_n is not None else jnp.zeros((n,), jnp.int32)).astype(jnp.int32)]
    if mode == "picks":
        scalars.append(idx_nk.reshape(-1))  # flat: SMEM pads 2-D arrays
    per_head = lambda w: pl.BlockSpec((None, block_h, w), lambda i, j, *_: (i, j, 0))  # noqa: E731
    per_row = lambda a: pl.BlockSpec((None, *a.shape[1:]), lambda i, j, *_: (i,) + (0,) * (a.ndim - 1))  # noqa: E731

    def per_slot(a):
        return pl.BlockSpec((None, *a.shape[1:]),
                            lambda i, j, *_: (_div(i, rows_per_slot),) + (0,) * (a.ndim - 1))

    inputs = [*layout.split(q_nhd), sinks_h.astype(F32).reshape(h, 1), *window_arrays]
    in_specs = [*(per_head(w) for w in widths), pl.BlockSpec((block_h, 1), lambda i, j, *_: (j, 0)),
                *(per_slot(a) for a in window_arrays)]
    scratch = [*(pltpu.VMEM((block_h, w), F32) for w in widths), pltpu.VMEM((block_h, 1), F32),
               pltpu.VMEM((block_h, 1), F32)]
    if mode != "none":
        inputs += entry_arrays
        in_specs += [pl.BlockSpec(memory_space=pl.ANY)] * len(entry_arrays)
        scratch += [pltpu.VMEM((2, block_e, a.shape[2]), a.dtype) for a in entry_arrays]
        scratch.append(pltpu.SemaphoreType.DMA((2,)))
    if mode == "picks":
        picks = idx_nk.reshape(n, n_picks // block_e, block_e)
        inputs.append(picks)
        in_specs.append(per_row(picks))

    outs = pl.pallas_call(
        functools.partial(_kernel, cfg=cfg),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=len(scalars), grid=(n, h // block_h), in_specs=in_specs,
            out_specs=[per_head(w) for w in widths], scratch_shapes=scratch),
        out_shape=[jax.ShapeDtypeStruct((n, h, w), out_dtype) for w in widths],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel")),
        interpret=interpret, name="dsjax_sparse_decode_tpu" if rows_per_slot == 1 else "dsjax_sparse_prefill_tpu",
    )(*scalars, *inputs)
    return layout.merge(list(outs))
