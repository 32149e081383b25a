"""The V4 cache: fixed-shape device arrays for `num_slots` sequences of up to `max_len` tokens, and the
functions through which the layers read and write it.

Per layer it holds
- `window [B, W, D]`: the last W = sliding_window shared K=V vectors, a ring indexed by position % W;
- for CSA/HCA layers a `CompressorState`: the raw kv/gate projections of the current partial window
  (a ring of m tokens), for CSA the previous complete window's Ca half (the overlap), and the
  compressed entries `[B, max_len // m, width]`;
- for CSA layers a second `CompressorState` for the lightning indexer's keys.
Entry counts are never stored: a slot of length L has exactly `num_entries(L, m)` = L // m entries.

The cache mirrors the model's layer groups (stacked over each group's repeats) so one `lax.scan` walks
weights and cache.

`kv_dtype` "fp8" or "fp4" stores the window and the compressed entries as `PackedKV` (codes + scales,
rotary slice bf16) and the indexer's keys as fp8; the partial-window buffers stay in the float dtype.

Access. The layers compute (projections, pooling, attention) and never index these arrays; where rows
are stored, and how (packing through `as_rows`, unpacking through `read_rows`), is decided here. A
cached step of C new tokens per slot at positions start … start + C − 1, the first n_valid real:
- window: `extend_window` packs the chunk's K=V rows, writes the real ones at their ring slots and
  returns the `WindowKeys` the chunk's queries attend (`write_window` writes only; `ring_positions`
  says which position a slot holds);
- compressor: `gather_windows` lays the buffered partial window and the chunk's raw kv/gate out as
  whole windows (`Windows`, with the CSA overlap of the window before them); the layer pools them;
  `store_windows` writes the entries of the windows that completed (`write_entries`) and keeps the
  new partial window (and overlap) in the buffer;
- entries: `write_entries` and `read_entries` take the entries store itself (any `[B, T, width]`
  rows, float or `PackedKV`), and the attention and indexer kernels read a store as it is, so no entry
  access assumes that the store belongs to the layer reading it.

Sharing entries between layers (DeepSeek-V4.1's CSA2: a source layer owns a compressor and the index
keys; later "Reindex" and "Reuse" layers attend its entries, with picks of their own or the source's).
All a reader needs are values: the entries store (`CompressorState.entries`, or any rows) and a
`layers.compression.Selection`. The source writes its store as a V4 layer does (`store_windows`,
`write_entries`); the compressors' `extend` returns `(entries, selection, layer cache)`, and a later
layer of the same step that is handed those (threaded through the layer loop, e.g. in the scan carry)
reads them with `read_entries` or the kernels exactly as it would its own. Between steps the store stays
in the source layer's cache; a layer that only reads would hold no `CompressorState`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from dsjax.cache_formats import V41_STORAGE, Records
from dsjax.config import HCA, SLIDING, ModelConfig
from dsjax.quant import INDEX_FP8_GROUP, KV_DTYPES, KV_FP8_GROUP, PackedKV, empty_kv, pack_kv, unpack_kv
from dsjax.run_config import check_choice

Rows = jax.Array | PackedKV | Records


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class CompressorState:
    buffer_kv: jax.Array  # [B, m, n] raw kv of the partial window, slot = position % m
    buffer_gate: jax.Array  # [B, m, n] raw gate (position_bias not yet added)
    entries: jax.Array | PackedKV  # [B, max_len // m, width]
    overlap_kv: jax.Array | None = None  # CSA: [B, m, width] Ca kv of the last complete window
    overlap_gate: jax.Array | None = None  # CSA: [B, m, width] its raw Ca gate


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class LayerCache:
    window: jax.Array | PackedKV  # [B, W, D]
    compressor: CompressorState | None = None
    indexer: CompressorState | None = None
    keys: jax.Array | None = None  # V4.1 KV source: the index keys of its entries [B, max_len // m, c]


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Cache:
    lengths: jax.Array  # [B] tokens already in each slot
    groups: tuple  # per layer group, per pattern position: a LayerCache stacked over the group's repeats
    # V4.1 with Engram: [B, max_ngram − 1] compressed ids of each slot's last tokens, −1 none or not text
    history: jax.Array | None = None

    @property
    def num_slots(self) -> int:
        return self.lengths.shape[0]


# ------------------------------------------------------------------------------------------- storage

def kv_rows(shape, dtype, kv_dtype: str | None, rope_dim: int, group: int = KV_FP8_GROUP) -> Rows:
    """Zeroed cache rows: a float array, or PackedKV for kv_dtype "fp8"/"fp4"."""
    if kv_dtype in (None, "bfloat16"):
        return jnp.zeros(shape, jnp.bfloat16 if kv_dtype else dtype)
    return empty_kv(shape, kv_dtype, rope_dim, group)


def read_rows(stored: Rows, dtype) -> jax.Array:
    """Cache rows as `dtype` values."""
    if isinstance(stored, PackedKV):
        return unpack_kv(stored, dtype)
    if isinstance(stored, Records):
        return stored.values(dtype)
    return stored.astype(dtype)


def as_rows(x: jax.Array, like: Rows) -> Rows:
    """New rows `x` in the storage of `like` (to be written into it)."""
    if isinstance(like, PackedKV):
        return pack_kv(x, like.fmt, like.rope.shape[-1], like.group)
    if isinstance(like, Records):
        return Records.of(x, like.fmt)
    return x.astype(like.dtype)


def is_packed(stored: Rows | None) -> bool:
    """Whether writing rows into `stored` rounds them (packed storage)."""
    return isinstance(stored, (PackedKV, Records))


def _along_rows(index_bn: jax.Array, x: jax.Array) -> jax.Array:
    """`index_bn` shaped to pick rows (axis 1) of `x` with `take_along_axis`."""
    return index_bn.reshape(index_bn.shape + (1,) * (x.ndim - 2))


# --------------------------------------------------------------------------------------- window ring

@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class WindowKeys:
    """The window keys of a chunk's C queries: query c sees rows `start_bc[b, c] … end_bc[b, c] − 1` of
    `rows`, exactly the real positions `q − W < k ≤ q` of its own position q."""

    rows: Rows  # [B, N, D] in the ring's storage: C = 1 the ring itself (start 0), else W ring rows + C
    start_bc: jax.Array  # [B, C] int
    end_bc: jax.Array  # [B, C] int


def ring_positions(last_b: jax.Array, window: int) -> jax.Array:
    """`[B, W]`: the position held by ring slot i when `last` is the newest position written
    (the largest p ≤ last with p ≡ i mod W); negative where nothing was written yet."""
    i = jnp.arange(window)[None, :]
    return last_b[:, None] - jnp.mod(last_b[:, None] - i, window)


def _write_ring(ring: Rows, stored_bcd: Rows, start_b: jax.Array, n_valid_b: jax.Array) -> Rows:
    """`ring` with the first n_valid of the chunk's stored rows (positions start …) at their slots."""
    w = jax.tree.leaves(ring)[0].shape[1]
    c_len = jax.tree.leaves(stored_bcd)[0].shape[1]
    if c_len == 1:
        rows = jnp.arange(start_b.shape[0])
        target_b = jnp.where(n_valid_b > 0, jnp.mod(start_b, w), w)  # out of range: dropped
        return jax.tree.map(lambda r, new: r.at[rows, target_b].set(new[:, 0], mode="drop"), ring, stored_bcd)
    # Each slot keeps the newest real position ≡ slot (mod W): from the chunk where that is in it.
    new_pos_bw = ring_positions(start_b + n_valid_b - 1, w)
    from_chunk = new_pos_bw >= start_b[:, None]
    idx = jnp.clip(new_pos_bw - start_b[:, None], 0, c_len - 1)
    new_rows = jax.tree.map(lambda x: jnp.take_along_axis(x, _along_rows(idx, x), 1), stored_bcd)
    return jax.tree.map(lambda new, old: jnp.where(_along_rows(from_chunk, old), new, old), new_rows, ring)


def write_window(ring: Rows, kv_bcd: jax.Array, start_b: jax.Array, n_valid_b: jax.Array) -> Rows:
    """`ring [B, W, D]` with the first n_valid of the chunk's rows `kv [B, C, D]` (positions start …)
    written at slots position % W, in the ring's storage; rows with n_valid = 0 are unchanged."""
    return _write_ring(ring, as_rows(kv_bcd, ring), start_b, n_valid_b)


def extend_window(ring: Rows, kv_bcd: jax.Array, start_b: jax.Array, n_valid_b: jax.Array,
                  floor_b: jax.Array | None = None) -> tuple[WindowKeys, Rows]:
    """The chunk's window keys and the ring with its rows written (`write_window`); the chunk's own keys
    are its rows as the ring stores them.

    C = 1: the keys are the new ring; after the write, slots 0 … min(start + 1, W) − 1 are exactly the
    window of the query at start. C > 1: the old ring's W rows in position order (positions start − W …
    start − 1) then the chunk's C; query c sees rows c+1 … c+W, of which ring rows need a position ≥ 0
    and chunk rows must be real. `floor_b` (C > 1 only) hides positions below it from the chunk's queries
    (DeepSeek-V4.1's bounded replay cuts the decoder's windows so).
    """
    w = jax.tree.leaves(ring)[0].shape[1]
    c_len = kv_bcd.shape[1]
    stored_bcd = as_rows(kv_bcd, ring)
    new_ring = _write_ring(ring, stored_bcd, start_b, n_valid_b)
    if c_len == 1:
        if floor_b is not None:
            raise ValueError("a window floor applies to prefill chunks (C > 1), not to decode")
        end_b1 = jnp.minimum(start_b + 1, w)[:, None]
        return WindowKeys(new_ring, jnp.zeros_like(end_b1), end_b1), new_ring
    slots_bw = jnp.mod(start_b[:, None] - w + jnp.arange(w)[None, :], w)
    rows = jax.tree.map(lambda r, new: jnp.concatenate([jnp.take_along_axis(r, _along_rows(slots_bw, r), axis=1),
                                                        new], axis=1), ring, stored_bcd)
    c = jnp.arange(c_len)[None, :]
    start_bc = jnp.maximum(c + 1, w - start_b[:, None])
    if floor_b is not None:
        start_bc = jnp.maximum(start_bc, w + floor_b[:, None] - start_b[:, None])
    end_bc = jnp.minimum(c + w + 1, w + n_valid_b[:, None])
    return WindowKeys(rows, start_bc, end_bc), new_ring


def overwritten_rows(ring: Rows, start_b: jax.Array, c_len: int) -> Rows:
    """`[B, C, D]`: the ring's rows at the slots a chunk of C positions start … will write, before it does."""
    w = jax.tree.leaves(ring)[0].shape[1]
    if c_len > w:
        raise ValueError(f"a chunk of {c_len} positions overwrites itself in a window of {w}; nothing to restore")
    slots_bc = jnp.mod(start_b[:, None] + jnp.arange(c_len)[None, :], w)
    return jax.tree.map(lambda r: jnp.take_along_axis(r, _along_rows(slots_bc, r), axis=1), ring)


def restore_rows(ring: Rows, saved_bcd: Rows, start_b: jax.Array, n_valid_b: jax.Array,
                 n_kept_b: jax.Array) -> Rows:
    """`ring` after a chunk's first n_valid rows were written at positions start …, with the slots of positions
    start + n_kept … start + n_valid − 1 given back their `overwritten_rows`: the ring of a chunk of n_kept rows."""
    w = jax.tree.leaves(ring)[0].shape[1]
    c = jnp.arange(jax.tree.leaves(saved_bcd)[0].shape[1])[None, :]
    undo_bc = (c >= n_kept_b[:, None]) & (c < n_valid_b[:, None])
    target_bc = jnp.where(undo_bc, jnp.mod(start_b[:, None] + c, w), w)  # out of range: dropped
    slots = jnp.arange(start_b.shape[0])[:, None]
    return jax.tree.map(lambda r, saved: r.at[slots, target_bc].set(saved, mode="drop"), ring, saved_bcd)


# -------------------------------------------------------------------- compressor buffers and entries

def num_entries(length, rate: int):
    """Compressed entries of a slot holding `length` tokens (one per complete window of `rate`); the
    query at position t sees `num_entries(t + 1, rate)`."""
    return length // rate


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Windows:
    """K consecutive compression windows of raw projections (no position bias), window k being window
    `first_b + k` of its slot; those past the slot's real tokens hold filler and are never stored."""

    kv_bkmn: jax.Array  # [B, K, m, n]
    gate_bkmn: jax.Array  # [B, K, m, n]
    first_b: jax.Array  # [B] int: start // m
    prev_kv_bmc: jax.Array | None  # CSA: [B, m, width] Ca kv of window first − 1 (None for HCA)
    prev_gate_bmc: jax.Array | None  # CSA: [B, m, width] its raw Ca gate
    has_prev_b: jax.Array  # [B] bool: window first − 1 exists


def gather_windows(state: CompressorState, kv_bcn: jax.Array, gate_bcn: jax.Array, start_b: jax.Array) -> Windows:
    """The buffer's partial window followed by the C chunk rows (positions start …), as the whole windows
    covering `[first·m, start + C)`, first = start // m, with the CSA overlap of window first − 1."""
    b, c_len, n = kv_bcn.shape
    m = state.buffer_kv.shape[1]
    n_win = -(-(m - 1 + c_len) // m)
    span = n_win * m
    first_b = start_b // m
    off_b = start_b - first_b * m
    j = jnp.arange(span)[None, :]
    from_buf = j < off_b[:, None]
    buf_idx = jnp.minimum(j, m - 1)
    chunk_idx = jnp.clip(j - off_b[:, None], 0, c_len - 1)

    def aligned(buf_bmn, new_bcn):
        a = jnp.take_along_axis(buf_bmn, jnp.broadcast_to(buf_idx, (b, span))[..., None], axis=1)
        c = jnp.take_along_axis(new_bcn, chunk_idx[..., None], axis=1)
        return jnp.where(from_buf[..., None], a, c.astype(a.dtype))

    kv_bkmn = aligned(state.buffer_kv, kv_bcn).reshape(b, n_win, m, n)
    gate_bkmn = aligned(state.buffer_gate, gate_bcn).reshape(b, n_win, m, n)
    return Windows(kv_bkmn, gate_bkmn, first_b, state.overlap_kv, state.overlap_gate, first_b > 0)


def _take_window(a_bkmx: jax.Array, k_b: jax.Array) -> jax.Array:
    """Window k_b[b] of each row: `[B, K, m, x] -> [B, m, x]`."""
    return jnp.take_along_axis(a_bkmx, k_b[:, None, None, None], axis=1)[:, 0]


def store_windows(state: CompressorState, windows: Windows, pooled_bkc: jax.Array,
                  end_b: jax.Array) -> CompressorState:
    """`state` after its slot's tokens reach `end` (exclusive): the entries `pooled [B, K, width]` of the
    windows complete by then written (`write_entries`), the partial window holding `end` kept in the
    buffer, and (CSA) the last complete window's Ca half kept as the overlap. A row whose `end` is its
    old length keeps its entries, its overlap and the buffered rows of its tokens (buffer slots past
    `end` hold whatever the span had there: they are written before they are read)."""
    n_win, m = windows.kv_bkmn.shape[1:3]
    first_b = windows.first_b
    entries = write_entries(state.entries, pooled_bkc, first_b, num_entries(end_b, m) - first_b)
    w_end_b = end_b // m
    tail_k = jnp.clip(w_end_b - first_b, 0, n_win - 1)  # window (within the span) holding the new tail
    new = dataclasses.replace(state, entries=entries, buffer_kv=_take_window(windows.kv_bkmn, tail_k),
                              buffer_gate=_take_window(windows.gate_bkmn, tail_k))
    if state.overlap_kv is None:
        return new
    last_k = jnp.clip(w_end_b - 1 - first_b, 0, n_win - 1)
    moved = (w_end_b > first_b)[:, None, None]
    c = state.overlap_kv.shape[-1]
    return dataclasses.replace(
        new, overlap_kv=jnp.where(moved, _take_window(windows.kv_bkmn, last_k)[..., :c], state.overlap_kv),
        overlap_gate=jnp.where(moved, _take_window(windows.gate_bkmn, last_k)[..., :c], state.overlap_gate))


def buffer_at(state: CompressorState, windows: Windows, end_b: jax.Array) -> CompressorState:
    """`state` (written through the windows' span) with the partial window holding `end` in its buffer, as
    `store_windows` would have left it for a chunk ending there. Entries are not touched: past `num_entries(end)`
    they are never read. (No overlap: DeepSeek-V4.1's compressors have none.)"""
    if state.overlap_kv is not None:
        raise ValueError("buffer_at does not rewind a CSA overlap")
    n_win, m = windows.kv_bkmn.shape[1:3]
    tail_k = jnp.clip(end_b // m - windows.first_b, 0, n_win - 1)
    return dataclasses.replace(state, buffer_kv=_take_window(windows.kv_bkmn, tail_k),
                               buffer_gate=_take_window(windows.gate_bkmn, tail_k))


def write_entries(entries: Rows, rows_bkc: jax.Array, first_b: jax.Array, count_b: jax.Array) -> Rows:
    """The store `entries [B, T, width]` with rows `rows [B, K, width]` k < count[b] written at entry
    first[b] + k in its storage; the rest (and any past T) are dropped."""
    b, k = rows_bkc.shape[:2]
    capacity = jax.tree.leaves(entries)[0].shape[1]
    index_bk = first_b[:, None] + jnp.arange(k)[None, :]
    written_bk = (jnp.arange(k)[None, :] < count_b[:, None]) & (index_bk < capacity)
    target_bk = jnp.where(written_bk, index_bk, capacity)  # out of range: dropped
    slots = jnp.arange(b)[:, None]
    return jax.tree.map(lambda e, p: e.at[slots, target_bk].set(p, mode="drop"), entries,
                        as_rows(rows_bkc, entries))


def read_entries(entries: Rows, dtype) -> jax.Array:
    """Every row of the store `entries [B, T, width]` as `dtype` values; rows past a slot's
    `num_entries` hold nothing of its tokens, so the reader masks them."""
    return read_rows(entries, dtype)


# -------------------------------------------------------------------------------------------- layout

def _compressor_state(b: int, rate: int, width: int, overlap: bool, max_len: int, dtype, kv_dtype, rope_dim,
                      group=KV_FP8_GROUP) -> CompressorState:
    n = 2 * width if overlap else width
    z = lambda *shape: jnp.zeros(shape, dtype)  # noqa: E731
    return CompressorState(
        buffer_kv=z(b, rate, n), buffer_gate=z(b, rate, n),
        entries=kv_rows((b, max_len // rate, width), dtype, kv_dtype, rope_dim, group),
        overlap_kv=z(b, rate, width) if overlap else None, overlap_gate=z(b, rate, width) if overlap else None)


def layer_cache(cfg: ModelConfig, attention_type: str, num_slots: int, max_len: int, dtype,
                kv_dtype: str | None = None) -> LayerCache:
    """One layer's empty cache. `kv_dtype` None keeps rows in `dtype`; "bfloat16", "fp8" or "fp4" as the
    module docstring says."""
    check_choice("kv_dtype", kv_dtype, KV_DTYPES, none="dtype")
    rd_window = cfg.rope_for(attention_type).rope_dim(cfg.head_dim)
    rd_entries = cfg.rope_compress.rope_dim(cfg.head_dim)
    window = kv_rows((num_slots, cfg.sliding_window, cfg.head_dim), dtype, kv_dtype, rd_window)
    if attention_type == SLIDING:
        return LayerCache(window)
    if attention_type == HCA:
        return LayerCache(window, _compressor_state(num_slots, cfg.compress_rate_hca, cfg.head_dim, False,
                                                    max_len, dtype, kv_dtype, rd_entries))
    m = cfg.compress_rate_csa
    index_kv = "fp8" if kv_dtype in ("fp8", "fp4") else kv_dtype
    index_group = min(INDEX_FP8_GROUP, cfg.index_head_dim)
    return LayerCache(window, _compressor_state(num_slots, m, cfg.head_dim, True, max_len, dtype, kv_dtype,
                                                rd_entries),
                      _compressor_state(num_slots, m, cfg.index_head_dim, True, max_len, dtype, index_kv, 0,
                                        index_group))


def v41_layer_cache(cfg, role, num_slots: int, max_len: int, dtype, kv_dtype: str | None = None) -> LayerCache:
    """One DeepSeek-V4.1 layer's empty cache: its window ring; a KV source (Full layer) adds its compressed
    entries, their index keys and (ratio 2) the raw projections of a token waiting for its pair (fp32).
    Reindex and Reuse layers read their source's. `kv_dtype` None keeps rows in `dtype`, "bfloat16" in
    bf16; "fp4" stores them as the release does (window MXFP8, entries NVFP4, index keys MXFP4, as
    `cache_formats.Records`), "fp8" the same with MXFP8 entries (`cache_formats.V41_STORAGE`)."""
    check_choice("kv_dtype", kv_dtype, KV_DTYPES, none="dtype")

    def rows(shape, part: int):
        if kv_dtype in V41_STORAGE:
            return Records.zeros(shape, V41_STORAGE[kv_dtype][part])
        return jnp.zeros(shape, jnp.bfloat16 if kv_dtype else dtype)

    window = rows((num_slots, cfg.sliding_window, cfg.head_dim), 0)
    if role.mode != "full":
        return LayerCache(window)
    m, t = role.ratio, max_len // role.ratio
    f32 = lambda *shape: jnp.zeros(shape, jnp.float32)  # noqa: E731
    state = CompressorState(buffer_kv=f32(num_slots, m, cfg.head_dim), buffer_gate=f32(num_slots, m, cfg.head_dim),
                            entries=rows((num_slots, t, cfg.head_dim), 1))
    return LayerCache(window, compressor=state, keys=rows((num_slots, t, cfg.index_head_dim), 2))


def init_cache(model, num_slots: int, max_len: int, dtype=None, kv_dtype: str | None = None) -> Cache:
    """An empty cache for `model` (a DeepseekV4 or DeepseekV41); `dtype` (of the float parts) defaults to
    the model's activation dtype; `kv_dtype` as in `layer_cache`. A V4.1 cache has one group per layer
    (a stacked axis of one), so the slot axis is axis 1 throughout, as for V4."""
    cfg = model.cfg
    dtype = dtype or model.dtype
    if cfg.family == "v4.1":
        groups = tuple((jax.tree.map(lambda x: x[None], v41_layer_cache(cfg, role, num_slots, max_len, dtype,
                                                                         kv_dtype)),)
                       for role in cfg.layer_roles())
        history = (jnp.full((num_slots, cfg.engram_max_ngram_size - 1), -1, jnp.int32) if cfg.engram_layer_ids
                   else None)
        return Cache(lengths=jnp.zeros((num_slots,), jnp.int32), groups=groups, history=history)
    groups = []
    for meta in model.groups_meta:
        per_position = []
        for attention_type, _ in meta.pattern:
            one = layer_cache(cfg, attention_type, num_slots, max_len, dtype, kv_dtype)
            per_position.append(jax.tree.map(lambda x: jnp.broadcast_to(x, (meta.repeats, *x.shape)), one))
        groups.append(tuple(per_position))
    return Cache(lengths=jnp.zeros((num_slots,), jnp.int32), groups=tuple(groups))


def cache_bytes_per_token(cfg: ModelConfig, max_len: int, dtype=jnp.bfloat16,
                          kv_dtype: str | None = None) -> dict[str, float]:
    """Cache bytes per token of context, per layer type, for one sequence of `max_len` tokens
    (fixed-size parts such as the window ring are spread over max_len)."""
    out = {}
    for t in sorted(set(cfg.layer_types)):
        one = jax.eval_shape(lambda t=t: layer_cache(cfg, t, 1, max_len, dtype, kv_dtype))
        total = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(one))
        out[t] = total / max_len
    return out
