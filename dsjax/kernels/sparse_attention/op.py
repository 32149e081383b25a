"""Sparse decode attention as the model calls it: the GPU or TPU kernel where it applies, else the
pure-JAX reference (`dispatch.py`). V4.1's packed records (`cache_formats.Records`) reach the GPU kernels
unpacked by XLA (exactly: each record value is a bf16), at decode only the picked rows; the TPU kernels
do not read them (the reference runs there)."""

from __future__ import annotations

import functools

import jax

from dsjax.kernels.devices import TUNED_GPU, device_facts
from dsjax.cache_formats import Records
from dsjax.kernels.dispatch import dispatch, over_slots
from dsjax.kernels.sparse_attention.mosaic_gpu import sparse_decode_mosaic, sparse_decode_mosaic_packed
from dsjax.kernels.sparse_attention.mosaic_tpu import sparse_decode_tpu, sparse_prefill_tpu
from dsjax.kernels.sparse_attention.reference import (sparse_decode_reference, sparse_prefill_reference,
                                                      unpacked_picks)
from dsjax.kernels.sparse_attention.triton import sparse_decode_gpu, sparse_prefill_gpu

# Used only to decide when to split keys between programs: the tilings were measured on this GPU.
_GPU_CORES = device_facts(TUNED_GPU).cores


def gpu_tiling(b: int, h: int, n_keys: int, *, block_h: int = 32, block_k: int = 64, num_warps: int = 8,
               num_stages: int = 3) -> dict:
    """The GPU kernel's tiling for B slots, H heads and about `n_keys` keys per slot: by default the fastest
    of a sweep on an H200 at batch 64 and 128K context (`docs/benchmarks.md`); small batches split the
    keys between programs so that the grid still covers the chip."""
    block_h = block_h if h % block_h == 0 else 16
    programs = b * max(h // block_h, 1)
    splits = max(1, min(-(-n_keys // block_k) // 2, _GPU_CORES // programs))
    return dict(block_h=block_h, block_k=block_k, num_warps=num_warps, num_stages=num_stages, num_splits=splits)


def mosaic_splits(b: int, n_keys: int) -> int:
    """Programs per slot for the Mosaic GPU kernel: enough to cover the chip, at least two 32-row
    blocks each (64 slots × 640 keys: 2, the fastest measured, `docs/benchmarks.md`)."""
    return max(1, min(_GPU_CORES // b, n_keys // 64))


def prefill_tiling(entries, idx_bck: jax.Array | None) -> dict:
    """The GPU kernel's tiling for a prefill chunk: the fastest of a sweep on an H200 at 1M tokens of
    context, 2,048 queries, bf16 (`docs/benchmarks.md`): HCA's long prefixes of entries (and sliding
    layers) in blocks of 64 keys for 64 heads at once; CSA's 512 picks in blocks of 32 keys for 32 heads."""
    if entries is not None and idx_bck is not None:
        return dict(block_h=32, block_k=32, num_warps=4, num_stages=3)
    return dict(block_h=64, block_k=64, num_warps=8, num_stages=2)


def keys_per_query(window, entries, picks: jax.Array | None) -> int:
    """About how many keys one query reads: the window rows plus its picks or every entry row."""
    n = jax.tree.leaves(window)[0].shape[1]
    if entries is not None:
        n += picks.shape[-1] if picks is not None else jax.tree.leaves(entries)[0].shape[1]
    return n


def sparse_decode(q_bhd: jax.Array, window, window_len_b: jax.Array, entries, sinks_h: jax.Array, scale: float, *,
                  entries_len_b: jax.Array | None = None, idx_bk: jax.Array | None = None,
                  kernels: str = "auto") -> jax.Array:
    """`reference.sparse_decode_reference`'s result, by the kernel `kernels` selects for the platform
    (under a mesh, on each device's slots: `dispatch.over_slots`)."""
    return over_slots(functools.partial(_sparse_decode, scale=scale, kernels=kernels),
                      dict(q_bhd=q_bhd, window=window, window_len_b=window_len_b, entries=entries,
                           entries_len_b=entries_len_b, idx_bk=idx_bk), dict(sinks_h=sinks_h))


def _has_records(*stores) -> bool:
    return any(isinstance(s, Records) for s in stores)


def _sparse_decode(q_bhd, window, window_len_b, entries, sinks_h, scale, *, entries_len_b, idx_bk, kernels):
    args = (q_bhd, window, window_len_b, entries, sinks_h, scale)
    kw = dict(entries_len_b=entries_len_b, idx_bk=idx_bk)
    b, h, _ = q_bhd.shape
    n_keys = keys_per_query(window, entries, idx_bk)
    tiling = gpu_tiling(b, h, n_keys)
    # The Mosaic GPU kernel where it applies (64 bf16 heads of width 512, CSA picks or no entries; packed
    # rows unpacked by XLA first), else the Triton one (over V4.1's records: their picks unpacked first).
    splits = mosaic_splits(b, n_keys)
    records = _has_records(window, entries)

    def triton(interpret):
        if not records:
            return sparse_decode_gpu(*args, **kw, **tiling, interpret=interpret)
        w, e, idx = unpacked_picks(window, entries, idx_bk, q_bhd.dtype)
        return sparse_decode_gpu(q_bhd, w, window_len_b, e, sinks_h, scale, entries_len_b=entries_len_b,
                                 idx_bk=idx, **tiling, interpret=interpret)

    return dispatch(functools.partial(sparse_decode_reference, *args, **kw), kernels=kernels,
                    gpu=(lambda interpret: sparse_decode_mosaic(*args, **kw, num_splits=splits, interpret=interpret),
                         lambda interpret: sparse_decode_mosaic_packed(*args, **kw, num_splits=splits,
                                                                       interpret=interpret),
                         triton),
                    tpu=None if records else lambda: sparse_decode_tpu(*args, **kw))


def sparse_prefill(q_bchd: jax.Array, window, window_start_bc: jax.Array, window_end_bc: jax.Array, entries,
                   sinks_h: jax.Array, scale: float, *, entries_len_bc: jax.Array | None = None,
                   idx_bck: jax.Array | None = None, kernels: str = "auto") -> jax.Array:
    """`reference.sparse_prefill_reference`'s result, by the kernel `kernels` selects for the platform
    (under a mesh, on each device's slots: `dispatch.over_slots`)."""
    return over_slots(functools.partial(_sparse_prefill, scale=scale, kernels=kernels),
                      dict(q_bchd=q_bchd, window=window, window_start_bc=window_start_bc, window_end_bc=window_end_bc,
                           entries=entries, entries_len_bc=entries_len_bc, idx_bck=idx_bck), dict(sinks_h=sinks_h))


def _sparse_prefill(q_bchd, window, window_start_bc, window_end_bc, entries, sinks_h, scale, *, entries_len_bc,
                    idx_bck, kernels):
    args = (q_bchd, window, window_start_bc, window_end_bc, entries, sinks_h, scale)
    kw = dict(entries_len_bc=entries_len_bc, idx_bck=idx_bck)
    b, c, h, _ = q_bchd.shape
    tiling = gpu_tiling(b * c, h, keys_per_query(window, entries, idx_bck), **prefill_tiling(entries, idx_bck))
    records = _has_records(window, entries)

    def triton(interpret):
        if not records:
            return sparse_prefill_gpu(*args, **kw, **tiling, interpret=interpret)
        # A chunk's queries pick among all of the slot's entries: unpack them all (once per chunk), and
        # the window (its ring and the chunk's own rows).
        w, e, _ = unpacked_picks(window, entries, None, q_bchd.dtype)
        return sparse_prefill_gpu(q_bchd, w, window_start_bc, window_end_bc, e, sinks_h, scale, **kw, **tiling,
                                  interpret=interpret)

    return dispatch(functools.partial(sparse_prefill_reference, *args, **kw), kernels=kernels, gpu=triton,
                    tpu=None if records else lambda: sparse_prefill_tpu(*args, **kw))
