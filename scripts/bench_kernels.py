"""Time dsjax's Pallas kernels against their pure-JAX references on one GPU, with achieved bandwidth.

For each size it reports the kernel's and the reference's time per call, the bytes the kernel must
read and write (each input row it needs once, the output once) over the kernel's time, that rate as a
share of the measured device copy bandwidth, and the kernel's FLOP/s. Timing: several independent
input sets (so the L2 cache does not serve repeats) run back to back inside one jitted call; the time
per call is the difference between the fastest of 9 calls over 24 sets and over 8, over 16 (launch and host
overhead cancel; host jitter only adds time, so the fastest call is kept). For single kernels, ncu's
`gpu__time_duration` is the steadier number (`docs/benchmarks.md`).

    python scripts/bench_kernels.py attention --batch 1 64 256 --context 4096 131072 1048576
    python scripts/bench_kernels.py tune --batch 64 --context 131072
    python scripts/bench_kernels.py indexer --batch 1 64 --context 131072
    python scripts/bench_kernels.py attention --preset v4.1-flash --kv-dtype fp4 --layer csa --batch 64 --context 131072
    python scripts/bench_kernels.py prefill-indexer --context 131072 1048576 --chunk 2048 --block-q 2 4 8
    python scripts/bench_kernels.py prefill-attention --context 1048576 --chunk 2048 --block-h 32 64
    python scripts/bench_kernels.py grouped-matmul --tokens 65536 --block-m 64 128 --block-n 64 128
    python scripts/bench_kernels.py fp4-experts --preset v4.1-flash --tokens 8192 --block-m 16 64 128
    python scripts/bench_kernels.py fp8-experts --tokens 32 128 --block-m 16 --triton --no-reference
    python scripts/bench_kernels.py dense-fp8 --tokens 1 32 128 256
    dsjax export --preset tiny-kernels --platform cuda --weights bf16 --out build/export-cuda   # (on CPU)
    python scripts/bench_kernels.py export --artifact build/export-cuda
    ncu --clock-control none --kernel-name regex:dsjax --metrics gpu__time_duration.sum --csv \
        python scripts/bench_kernels.py variants --variant '{"op": "attention", "kv": "fp8", "batch": 64, \
        "context": 131072}' '{"op": "indexer", "kv": "fp8", "batch": 64, "context": 131072}' > ncu.log
    python scripts/bench_kernels.py ncu --ncu-log ncu.log --copy-tbps 4.28   # the kernels' own times
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from dsjax.bench import copy_bandwidth
from dsjax.cache_formats import V41_STORAGE, Records, record_bytes
from dsjax.config import CSA, HCA, ModelConfig
from dsjax.config_v41 import model_config
from dsjax.presets import PRESETS
from dsjax.quant import FP8, KV_FP8_GROUP, FP4_GROUP, PackedKV

KV_DTYPES = ("bfloat16", "fp8", "fp4")


def emit(args, rows: list, row: dict, bandwidth: float) -> None:
    """Keep a result row: print it and append it to `--json` at once, so a run cut short keeps its rows."""
    rows.append(row)
    print(json.dumps(row), flush=True)
    if args.json:
        with open(args.json, "a") as f:
            f.write(json.dumps({"device": jax.devices()[0].device_kind, "copy_TBps": bandwidth / 1e12, **row}) + "\n")


def timed(fn, make_sets, shared=(), few: int = 8, many: int = 24, repeats: int = 9) -> float:
    """Seconds per call of `fn(*shared, *set)`, by differencing one jitted call over `many` sets and over
    `few`. `shared` arrays (a big cache) are arguments, not constants captured in the executable."""
    sets = [make_sets(i) for i in range(many)]
    times = {}
    for n in (few, many):
        run = jax.jit(lambda shared, sets, n=n: [fn(*shared, *one) for one in sets[:n]])
        jax.block_until_ready(run(shared, sets))
        samples = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            jax.block_until_ready(run(shared, sets))
            samples.append(time.perf_counter() - t0)
        times[n] = min(samples)  # host jitter only ever adds time
    if times[many] <= times[few]:  # the difference drowned in jitter: no number rather than a wrong one
        raise RuntimeError(f"timing did not resolve: {many} calls took {times[many] * 1e3:.3f} ms, {few} took "
                           f"{times[few] * 1e3:.3f} ms; time more calls")
    return (times[many] - times[few]) / (many - few)


def random_records(key, shape, fmt: str) -> Records:
    """Random V4.1 cache records (`cache_formats.Records`, "mxfp8", "nvfp4" or "mxfp4") of `shape` rows,
    built directly: codes of any value but e4m3's NaN, scales near 1."""
    *lead, dim = shape
    n_data = dim if fmt == "mxfp8" else dim // 2
    k1, k2 = jax.random.split(key)
    codes = jax.random.randint(k1, (*lead, n_data), 0, 256, jnp.int32)
    if fmt == "mxfp8":
        codes = jnp.where(codes & 0x7F == 0x7F, codes ^ 1, codes)
    low, high = (0x30, 0x41) if fmt == "nvfp4" else (124, 130)  # e4m3 0.5 … 2, or ue8m0 2^-3 … 2^2
    scales = jax.random.randint(k2, (*lead, record_bytes(fmt, dim) - n_data), low, high, jnp.int32)
    return Records(jnp.concatenate([codes, scales], axis=-1).astype(jnp.uint8), fmt, dim)


def is_v41(cfg) -> bool:
    return getattr(cfg, "family", "v4") == "v4.1"


def random_rows(key, shape, kv_dtype: str, rope_dim: int):
    """Random cache rows in `kv_dtype` storage, built directly (no quantization pass): finite codes,
    scales near 1. A V4.1 format name ("mxfp8", "nvfp4", "mxfp4") gives its records."""
    if kv_dtype in ("mxfp8", "nvfp4", "mxfp4"):
        return random_records(key, shape, kv_dtype)
    k1, k2, k3 = jax.random.split(key, 3)
    if kv_dtype == "bfloat16":
        return jax.random.normal(k1, shape, jnp.bfloat16)
    *lead, width = shape
    body = width - rope_dim
    rope = jax.random.normal(k3, (*lead, rope_dim), jnp.bfloat16)
    if kv_dtype == "fp8":
        codes = jax.random.normal(k1, (*lead, body), jnp.float32).astype(FP8)
        scales = jax.random.uniform(k2, (*lead, body // KV_FP8_GROUP), jnp.float32, 0.5, 2.0)
        return PackedKV(codes, scales, rope, KV_FP8_GROUP)
    codes = jax.random.randint(k1, (*lead, body // 2), -128, 128, jnp.int32).astype(jnp.int8)
    scales = jax.random.randint(k2, (*lead, body // FP4_GROUP), 124, 130, jnp.int32).astype(jnp.uint8)
    return PackedKV(codes, scales, rope, FP4_GROUP)


def row_bytes(rows) -> int:
    return sum(a.dtype.itemsize * a.shape[-1] for a in jax.tree.leaves(rows))


def attention_case(cfg: ModelConfig, batch: int, context: int, kv_dtype: str, layer: str, seed: int = 0):
    """(shared entries, make_set(i) → the kernel's positional/keyword inputs, bytes, flops). For V4.1 (CSA
    only: every compressed layer picks) a decoder layer's: an entry per token, window and entries in the
    release's formats for `kv_dtype` ("fp4": MXFP8 window, NVFP4 entries; "fp8": MXFP8 both)."""
    h, d, w = cfg.num_attention_heads, cfg.head_dim, cfg.sliding_window
    window_fmt = entries_fmt = kv_dtype
    if is_v41(cfg):
        if layer != CSA:
            raise ValueError("attention: V4.1's compressed layers all pick their entries (--layer csa)")
        rd, rate = 0, 1
        if kv_dtype in V41_STORAGE:
            window_fmt, entries_fmt, _ = V41_STORAGE[kv_dtype]
    else:
        rd = cfg.rope_compress.rope_dim(d)
        rate = cfg.compress_rate_csa if layer == CSA else cfg.compress_rate_hca
    t = context // rate
    entries = random_rows(jax.random.key(seed), (batch, t, d), entries_fmt, rd)
    n_keys = w + (min(cfg.index_topk, t) if layer == CSA else t)

    def make_set(i):
        key = jax.random.key(1000 + i)
        kq, kw, ki, ks = jax.random.split(key, 4)
        q = jax.random.normal(kq, (batch, h, d), jnp.bfloat16)
        window = random_rows(kw, (batch, w, d), window_fmt, rd)
        sinks = jax.random.normal(ks, (h,), jnp.float32)
        if layer == CSA:
            k = min(cfg.index_topk, t)
            idx = jnp.argsort(jax.random.uniform(ki, (batch, t)), axis=1)[:, :k].astype(jnp.int32)
            extra = {"idx_bk": idx}
        else:
            extra = {"entries_len_b": jnp.full((batch,), t, jnp.int32)}
        return q, window, jnp.full((batch,), w, jnp.int32), sinks, extra

    window_row = row_bytes(random_rows(jax.random.key(0), (1, 1, d), window_fmt, rd))
    per_slot = (w * window_row + (n_keys - w) * row_bytes(entries) + 2 * h * d * 2
                + (4 * min(cfg.index_topk, t) if layer == CSA else 0))
    return entries, make_set, batch * per_slot, batch * 4 * h * d * n_keys


def model_tiling(cfg: ModelConfig, entries, one_set, **overrides) -> dict:
    """The GPU tiling `op.sparse_decode` chooses for these inputs (with `overrides` of its defaults)."""
    from dsjax.kernels.sparse_attention.op import gpu_tiling, keys_per_query

    q, window, _, _, extra = one_set
    return gpu_tiling(q.shape[0], cfg.num_attention_heads, keys_per_query(window, entries, extra.get("idx_bk")),
                      **overrides)


def bench_attention(args, cfg, bandwidth):
    """Decode attention as the model runs it (`--path op`) or the Triton kernel alone (`--path triton`),
    against the XLA reference, host-timed."""
    from dsjax.kernels.sparse_attention.op import sparse_decode
    from dsjax.kernels.sparse_attention.reference import sparse_decode_reference
    from dsjax.kernels.sparse_attention.triton import sparse_decode_gpu

    if is_v41(cfg) and args.path == "triton" and set(args.kv_dtype) - {"bfloat16"}:
        raise SystemExit("attention: the Triton kernel alone takes V4's storage; V4.1's records go through the "
                         "operation (--path op), which unpacks them first")
    rows = []
    scale = cfg.head_dim ** -0.5
    for batch, context, kv_dtype, layer in itertools.product(args.batch, args.context, args.kv_dtype, args.layer):
        if batch * context > args.max_tokens:
            continue
        entries, make_set, n_bytes, flops = attention_case(cfg, batch, context, kv_dtype, layer)

        tiling = model_tiling(cfg, entries, make_set(0), **json.loads(args.tiling))

        def kernel(entries, q, window, wlen, sinks, extra):
            if args.path == "op":  # what the model runs: the Mosaic kernel where it applies, else Triton
                return sparse_decode(q, window, wlen, entries, sinks, scale, **extra,
                                     kernels="interpret" if args.interpret else "auto")
            return sparse_decode_gpu(q, window, wlen, entries, sinks, scale, **extra, **tiling,
                                     interpret=args.interpret)

        def reference(entries, q, window, wlen, sinks, extra):
            return sparse_decode_reference(q, window, wlen, entries, sinks, scale, **extra)

        one = make_set(0)
        want = np.asarray(jax.jit(reference)(entries, *one), np.float32)
        got = np.asarray(jax.jit(kernel)(entries, *one), np.float32)
        rel = float(np.linalg.norm(got - want) / np.linalg.norm(want))
        t_kernel = timed(kernel, make_set, (entries,))
        t_ref = timed(reference, make_set, (entries,)) if not args.no_reference else float("nan")
        emit(args, rows, {"op": "attention", "path": args.path, "layer": "CSA" if layer == CSA else "HCA",
                          "batch": batch,
                          "context": context, "kv": kv_dtype, "kernel_us": t_kernel * 1e6,
                          "reference_us": t_ref * 1e6, "speedup": t_ref / t_kernel,
                          **({"splits": tiling["num_splits"]} if args.path == "triton" else {}),
                          "MB": n_bytes / 1e6, "GBps": n_bytes / t_kernel / 1e9,
                          "of_copy": n_bytes / t_kernel / bandwidth, "TFLOPs": flops / t_kernel / 1e12,
                          "rel_err": rel}, bandwidth)
        del entries
    return rows


def bench_tune(args, cfg, bandwidth):
    from dsjax.kernels.sparse_attention.triton import sparse_decode_gpu

    if is_v41(cfg) and set(args.kv_dtype) - {"bfloat16"}:
        raise SystemExit("tune: the Triton kernel's tilings over V4's storage or bf16 rows (--kv-dtype bfloat16)")
    rows = []
    scale = cfg.head_dim ** -0.5
    for batch, context, kv_dtype in itertools.product(args.batch, args.context, args.kv_dtype):
        entries, make_set, n_bytes, flops = attention_case(cfg, batch, context, kv_dtype, CSA)
        from dsjax.kernels.sparse_attention.reference import sparse_decode_reference
        one = make_set(0)
        want = np.asarray(jax.jit(lambda entries, q, window, wlen, sinks, extra: sparse_decode_reference(
            q, window, wlen, entries, sinks, scale, **extra))(entries, *one), np.float32)
        for bh, bk, warps, stages, splits, extra in itertools.product(args.block_h, args.block_k, args.num_warps,
                                                                      args.num_stages, args.splits, args.extra):
            tiling = dict(block_h=bh, block_k=bk, num_warps=warps, num_stages=stages, num_splits=splits,
                          **json.loads(extra))

            def kernel(entries, q, window, wlen, sinks, extra, tiling=tiling):
                return sparse_decode_gpu(q, window, wlen, entries, sinks, scale, **extra, **tiling,
                                         interpret=args.interpret)

            try:
                got = np.asarray(jax.jit(kernel)(entries, *one), np.float32)
                t = timed(kernel, make_set, (entries,), few=4, many=20, repeats=7)
            except Exception as e:  # a tiling the compiler refuses (registers, shared memory)
                print(f"{tiling}: {type(e).__name__}: {str(e)[:120]}", flush=True)
                continue
            emit(args, rows, {"op": "tune", "batch": batch, "context": context, "kv": kv_dtype, **tiling,
                         "kernel_us": t * 1e6, "of_copy": n_bytes / t / bandwidth, "TFLOPs": flops / t / 1e12,
                         "rel_err": float(np.linalg.norm(got - want) / np.linalg.norm(want))}, bandwidth)
    return rows


def indexer_case(cfg: ModelConfig, batch: int, context: int, kv_dtype: str):
    """(index keys, make_set(i) → (q, weights, keys_len), bytes, flops) for one indexer size. V4.1: a decoder
    layer's (a key per token), stored packed as MXFP4 records for `kv_dtype` "fp8" or "fp4"."""
    from dsjax.quant import INDEX_FP8_GROUP

    nh, c = cfg.index_n_heads, cfg.index_head_dim
    t = context if is_v41(cfg) else context // cfg.compress_rate_csa
    k1, k2 = jax.random.split(jax.random.key(0))
    if is_v41(cfg) and kv_dtype in V41_STORAGE:
        keys = random_records(k1, (batch, t, c), V41_STORAGE[kv_dtype][2])
    elif kv_dtype == "fp8":
        keys = PackedKV(jax.random.normal(k1, (batch, t, c), jnp.float32).astype(FP8),
                        jax.random.uniform(k2, (batch, t, c // INDEX_FP8_GROUP), jnp.float32, 0.5, 2.0),
                        jnp.zeros((batch, t, 0), jnp.bfloat16), INDEX_FP8_GROUP)
    else:
        keys = jax.random.normal(k1, (batch, t, c), jnp.bfloat16)

    def make_set(i):
        kq, kw = jax.random.split(jax.random.key(1000 + i))
        return (jax.random.normal(kq, (batch, nh, c), jnp.bfloat16), jax.random.normal(kw, (batch, nh), jnp.float32),
                jnp.full((batch,), t, jnp.int32))

    n_bytes = batch * (t * (row_bytes(keys) + 4) + nh * c * 2 + nh * 4)
    return keys, make_set, n_bytes, batch * 2 * nh * c * t


def bench_indexer(args, cfg, bandwidth):
    from dsjax.kernels.indexer.reference import index_scores_reference
    from dsjax.kernels.indexer.triton import index_scores_gpu

    rows = []
    scale = cfg.index_head_dim ** -0.5
    for batch, context, kv_dtype in itertools.product(args.batch, args.context, args.kv_dtype):
        if batch * context > args.max_tokens or (kv_dtype == "fp4" and not is_v41(cfg)):  # V4's keys are never fp4
            continue
        keys, make_set, n_bytes, flops = indexer_case(cfg, batch, context, kv_dtype)
        ref = lambda keys, q, w, n: index_scores_reference(q, w, keys, n, scale)  # noqa: E731
        want = np.asarray(jax.jit(ref)(keys, *make_set(0)))
        t_ref = float("nan") if args.no_reference else timed(ref, make_set, (keys,))
        for block_t, tiles, warps, extra in itertools.product(args.block_t, args.tiles, args.num_warps, args.extra):
            def kernel(keys, q, w, n, block_t=block_t, tiles=tiles, warps=warps, extra=json.loads(extra)):
                return index_scores_gpu(q, w, keys, n, scale, block_t=block_t, tiles=tiles, num_warps=warps,
                                        interpret=args.interpret, **extra)

            got = np.asarray(jax.jit(kernel)(keys, *make_set(0)))
            rel = float(np.linalg.norm(got - want) / np.linalg.norm(want))
            t_kernel = timed(kernel, make_set, (keys,))
            emit(args, rows, {"op": "indexer", "batch": batch, "context": context, "kv": kv_dtype,
                              "block_t": block_t, "tiles": tiles, "warps": warps, **json.loads(extra),
                              "kernel_us": t_kernel * 1e6,
                              "reference_us": t_ref * 1e6, "speedup": t_ref / t_kernel, "MB": n_bytes / 1e6,
                              "GBps": n_bytes / t_kernel / 1e9, "of_copy": n_bytes / t_kernel / bandwidth,
                              "TFLOPs": flops / t_kernel / 1e12, "rel_err": rel}, bandwidth)
        del keys
    return rows


def bench_prefill_indexer(args, cfg, bandwidth):
    """A prefill chunk's indexer at long context: the chunk kernel's scores (each tiling) against the
    reference's, then the top-k pick of them, one `lax.top_k` against `layers.topk`'s two steps. The
    chunk's queries sit at the context's end (each sees about context / 4 keys). The picks of a few
    queries from the kernel's scores are compared with the reference's (the reference materialises
    `[C, heads, T]`, so only a few queries fit at 1M)."""
    from dsjax.kernels.indexer.reference import index_scores_chunk_reference
    from dsjax.kernels.indexer.triton import index_scores_chunk_gpu
    from dsjax.layers.topk import top_picks

    rows = []
    nh, c, k = cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk
    scale = c ** -0.5
    # V4's CSA rate; V4.1's encoder layers (rate 2; its decoder's is 1)
    rate = args.rate or getattr(cfg, "compress_rate_csa", None) or max(cfg.compress_ratios)
    for context, chunk in itertools.product(args.context, args.chunk):
        t = context // rate
        keys = jax.random.normal(jax.random.key(0), (1, t, c), jnp.bfloat16)
        lens = jnp.asarray(((context - chunk + np.arange(chunk) + 1) // rate)[None], jnp.int32)
        flops = 2 * nh * c * int(np.asarray(lens).sum())

        def make_set(i, n=chunk):
            kq, kw = jax.random.split(jax.random.key(1000 + i))
            return (jax.random.normal(kq, (1, n, nh, c), jnp.bfloat16), jax.random.normal(kw, (1, n, nh), jnp.float32))

        few, many = 2, 5
        t_ref = float("nan")
        if chunk * nh * t * 4 <= args.reference_bytes and not args.no_reference:
            t_ref = timed(lambda keys, lens, q, w: index_scores_chunk_reference(q, w, keys, lens, scale), make_set,
                          (keys, lens), few=few, many=many)
        check = min(chunk, max(1, args.reference_bytes // (nh * t * 4)))
        q, w = make_set(0)
        want = jax.jit(lambda q, w: top_picks(index_scores_chunk_reference(q, w, keys, lens[:, -check:], scale), k))(
            q[:, -check:], w[:, -check:])
        for block_q, block_t, tiles, warps, fuse in itertools.product(args.block_q, args.block_t, args.tiles,
                                                                      args.num_warps, args.fuse):
            fuse = fuse == "on"

            def kernel(keys, lens, q, w, block_q=block_q, block_t=block_t, tiles=tiles, warps=warps, fuse=fuse):
                return index_scores_chunk_gpu(q, w, keys, lens, scale, block_q=block_q, block_t=block_t, tiles=tiles,
                                              fuse=fuse, num_warps=warps, interpret=args.interpret)

            try:
                scores = jax.jit(kernel)(keys, lens, q, w)
                t_kernel = timed(kernel, make_set, (keys, lens), few=few, many=many)
            except Exception as e:  # a tiling the GPU cannot compile: say so and go on
                print(f"block_q={block_q} block_t={block_t} tiles={tiles} warps={warps} fuse={fuse}: {type(e).__name__}: "
                      f"{str(e)[:200]}", flush=True)
                continue
            got = top_picks(scores[:, -check:], k)
            same = float(np.mean([len(set(a[a >= 0]) & set(b[b >= 0])) / max(1, len(set(b[b >= 0])))
                                  for a, b in zip(np.asarray(got)[0], np.asarray(want)[0])]))
            emit(args, rows, {"op": "prefill_indexer", "heads": nh, "rate": rate, "context": context, "chunk": chunk,
                              "block_q": block_q, "block_t": block_t, "tiles": tiles, "warps": warps, "fuse": fuse,
                              "kernel_ms": t_kernel * 1e3,
                              "reference_ms": t_ref * 1e3, "TFLOPs": flops / t_kernel / 1e12,
                              "picks_same": same, "checked_queries": check}, bandwidth)
        one = timed(lambda s: jax.lax.top_k(s, k)[1], lambda i: (scores + i,), few=few, many=many)
        two = timed(lambda s: top_picks(s, k), lambda i: (scores + i,), few=few, many=many)
        emit(args, rows, {"op": "prefill_topk", "context": context, "chunk": chunk, "entries": t,
                          "lax_top_k_ms": one * 1e3, "two_step_ms": two * 1e3}, bandwidth)
        del keys, scores
    return rows


def bench_prefill_attention(args, cfg, bandwidth):
    """A prefill chunk's sparse attention at long context through the GPU kernel, each tiling: C queries
    at the context's end, each over its 128 window rows (the ring and the chunk, as `cache.extend_window`
    lays them out) and its layer's entries (HCA: every complete window; CSA: 512 random picks), bf16. The
    first queries' outputs are compared with the reference's."""
    from dsjax.kernels.sparse_attention.reference import sparse_prefill_reference
    from dsjax.kernels.sparse_attention.triton import sparse_prefill_gpu

    rows = []
    h, d, w = cfg.num_attention_heads, cfg.head_dim, cfg.sliding_window
    scale = d ** -0.5
    for context, chunk, layer in itertools.product(args.context, args.chunk, args.layer):
        rate = cfg.compress_rate_csa if layer == CSA else cfg.compress_rate_hca
        t = context // rate
        k0, k1, k2, k3 = jax.random.split(jax.random.key(0), 4)
        entries = jax.random.normal(k0, (1, t, d), jnp.bfloat16)
        window = jax.random.normal(k1, (1, w + chunk, d), jnp.bfloat16)
        sinks = jax.random.normal(k2, (h,), jnp.float32)
        c = np.arange(chunk)
        start, end = jnp.asarray((c + 1)[None], jnp.int32), jnp.asarray((c + 1 + w)[None], jnp.int32)
        visible = (context - chunk + c + 1) // rate
        if layer == CSA:
            k = min(cfg.index_topk, t)
            idx = (jax.random.uniform(k3, (1, chunk, k)) * visible[None, :, None]).astype(jnp.int32)
            extra = {"idx_bck": idx}
            n_keys = chunk * (w + k)
        else:
            extra = {"entries_len_bc": jnp.asarray(visible[None], jnp.int32)}
            n_keys = chunk * w + int(visible.sum())
        flops = 4 * h * d * n_keys

        def make_set(i):
            return (jax.random.normal(jax.random.key(1000 + i), (1, chunk, h, d), jnp.bfloat16),)

        (q,) = make_set(0)
        few_ = {key: v[:, :8] for key, v in extra.items()}
        want = np.asarray(jax.jit(lambda q: sparse_prefill_reference(
            q[:, :8], window, start[:, :8], end[:, :8], entries, sinks, scale, **few_, out_dtype=jnp.float32))(q))
        for block_h, block_k, warps, stages in itertools.product(args.block_h, args.block_k, args.num_warps,
                                                                 args.num_stages):
            tiling = dict(block_h=block_h, block_k=block_k, num_warps=warps, num_stages=stages)

            def kernel(entries, window, sinks, q, tiling=tiling):
                return sparse_prefill_gpu(q, window, start, end, entries, sinks, scale, **extra, **tiling,
                                          interpret=args.interpret)

            try:
                got = np.asarray(jax.jit(kernel)(entries, window, sinks, q)[:, :8], np.float32)
                t_kernel = timed(kernel, make_set, (entries, window, sinks), few=2, many=5)
            except Exception as e:  # a tiling the GPU cannot compile: say so and go on
                print(f"{tiling}: {type(e).__name__}: {str(e)[:200]}", flush=True)
                continue
            emit(args, rows, {"op": "prefill_attention", "layer": layer, "context": context, "chunk": chunk,
                              **tiling, "kernel_ms": t_kernel * 1e3, "TFLOPs": flops / t_kernel / 1e12,
                              "rel_err": float(np.linalg.norm(got - want) / np.linalg.norm(want))}, bandwidth)
        del entries
    return rows


def bench_grouped_matmul(args, cfg, bandwidth):
    """The MoE's two bf16 grouped matmuls (gate_up `[M, hidden] × [E, hidden, 2·inter]`, down
    `[M, inter] × [E, inter, hidden]`, M = tokens × experts per token, routed uniformly at random) through
    tokamax's ragged_dot: its default choice and its Mosaic GPU kernel in each
    configuration of the grid. Outputs are compared with the default's."""
    import tokamax
    # tokamax.ops.gpu would also import its Triton kernels, which need jax_triton.
    # XLA's own ragged_dot is left out: on the H200 its autotuner asked for 384 GiB at these sizes.
    from tokamax._src.ops.ragged_dot.pallas_mosaic_gpu import Config, PallasMosaicGpuRaggedDot

    rows = []
    e, h, inter, k = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts_per_tok
    grid = [None] + [
        dict(block_m=bm, block_n=bn, block_k=bk, num_stages=st, persistent=pe, grid_tile_width=gw, split_k=1)
        for bm, bn, bk, st, pe, gw in itertools.product(args.block_m, args.block_n, args.block_k_mm, args.num_stages,
                                                        (True, False), args.grid_tile_width)]
    for tokens, (name, k_dim, n_dim) in itertools.product(args.tokens, (("gate_up", h, 2 * inter), ("down", inter, h))):
        m = tokens * k
        k0, k1, k2 = jax.random.split(jax.random.key(tokens), 3)
        w = (jax.random.normal(k0, (e, k_dim, n_dim), jnp.float32) * k_dim ** -0.5).astype(jnp.bfloat16)
        sizes = jnp.bincount(jax.random.randint(k1, (m,), 0, e), length=e).astype(jnp.int32)

        def make_set(i, m=m, k_dim=k_dim):
            return (jax.random.normal(jax.random.key(100 + i), (m, k_dim), jnp.bfloat16),)

        (x,) = make_set(0)
        want = None
        for choice in grid:
            if choice is None:
                impl, label = None, {"impl": "default"}
            else:
                impl, label = [PallasMosaicGpuRaggedDot(config=Config(**choice))], {"impl": "mosaic", **choice}

            def kernel(w, sizes, x, impl=impl):
                return tokamax.ragged_dot(x, w, sizes, preferred_element_type=jnp.bfloat16, implementation=impl)

            try:
                got = np.asarray(jax.jit(kernel)(w, sizes, x)[:4096], np.float32)
                t_kernel = timed(kernel, make_set, (w, sizes), few=1, many=3, repeats=5)
            except Exception as ex:  # a configuration this GPU cannot compile: say so and go on
                print(f"{label}: {type(ex).__name__}: {str(ex)[:200]}", flush=True)
                continue
            want = got if want is None else want
            emit(args, rows, {"op": "grouped_matmul", "matmul": name, "tokens": tokens, "rows": m, **label,
                              "kernel_ms": t_kernel * 1e3, "TFLOPs": 2 * m * k_dim * n_dim / t_kernel / 1e12,
                              "rel_err": float(np.linalg.norm(got - want) / np.linalg.norm(want))}, bandwidth)
        del w
    return rows


def random_codes(key, shape, storage: str):
    """Random stored weight bytes of `shape` (last axis a multiple of 4): FP4 pairs as int8, or e4m3 codes
    but NaN (S.1111.111, moved one step down)."""
    codes = jax.lax.bitcast_convert_type(jax.random.bits(key, (*shape[:-1], shape[-1] // 4), jnp.uint32),
                                         jnp.uint8).reshape(shape)
    if storage == "fp8":
        return jax.lax.bitcast_convert_type(jnp.where(codes & 0x7F == 0x7F, codes - 1, codes), jnp.float8_e4m3fn)
    return jax.lax.bitcast_convert_type(codes, jnp.int8)


def bench_fp4_experts(args, cfg, bandwidth, storage: str = "fp4"):
    """The MoE's two grouped matmuls over FP4 experts (random e2m1 codes, ue8m0 scales spread over 2^10,
    new scales for each input set), or with `fp8-experts` over FP8 ones (random e4m3 codes but NaN, a scale
    per 128 × 128 block),
    `--tokens` tokens routed uniformly at random: the reference as the model runs it for many rows per
    expert (every expert dequantized to bf16, then the tuned grouped matmul) against the Mosaic GPU FP4
    kernel with each `--block-m` (rows of one expert per program), `--features` (outputs per program),
    `--words` (code words per step), `--stages` (steps in flight), `--rows` and `--code-layout` (the
    checkpoint's or the repacked one, repacked before the timing as a load would), and with `--triton` the
    Triton kernel (what the model takes below `mosaic_gpu.MIN_ROWS` rows, and for FP8). Each row has the bytes a kernel
    must move at least (the codes and scales of the experts with rows, the rows in and out) and their share of
    the copy bandwidth.
    Errors are against the reference."""
    from dsjax.kernels.expert_matmul.fp4_codes import repack_codes
    from dsjax.kernels.expert_matmul.mosaic_gpu import expert_matmul_mosaic
    from dsjax.kernels.expert_matmul.reference import expert_matmul_reference
    from dsjax.kernels.expert_matmul.triton import expert_matmul_gpu

    rows = []
    e, h, inter, k = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts_per_tok
    for tokens, (name, k_dim, n_dim) in itertools.product(args.tokens, (("gate_up", h, 2 * inter), ("down", inter, h))):
        m = tokens * k
        k0, k2 = jax.random.split(jax.random.key(tokens))
        per_byte = 2 if storage == "fp4" else 1  # codes per byte
        codes = random_codes(k0, (e, n_dim, k_dim // per_byte), storage)
        scale_shape = ((e, n_dim, k_dim // FP4_GROUP) if storage == "fp4"
                       else (e, -(-n_dim // 128), k_dim // 128))
        sizes = jnp.bincount(jax.random.randint(k2, (m,), 0, e), length=e).astype(jnp.int32)

        def make_set(i, m=m, k_dim=k_dim, scale_shape=scale_shape):  # scales too: no dequantization is shared
            x = jax.random.normal(jax.random.key(100 + i), (m, k_dim), jnp.bfloat16)
            scale = jax.random.randint(jax.random.key(200 + i), scale_shape, 119, 129)
            return x, scale.astype(jnp.uint8)

        x, scale = make_set(0)
        want = np.asarray(jax.jit(expert_matmul_reference, static_argnums=4)(x, codes, scale, sizes, storage),
                          np.float32)
        # What a kernel must move at least: the codes and scales of the experts with rows, the rows in and out.
        per_expert = n_dim * (k_dim // 2 + k_dim // FP4_GROUP) if storage == "fp4" else codes[0].size + scale[0].size
        n_bytes = int(np.count_nonzero(np.asarray(sizes))) * per_expert + m * (k_dim + n_dim) * 2
        tilings = list(itertools.product(args.block_m, args.features, args.words, args.stages,
                                         args.row_source,
                                         args.code_layout if storage == "fp4" else ["checkpoint"]))
        code_sets = {"checkpoint": codes}
        if "repacked" in args.code_layout and storage == "fp4":
            code_sets["repacked"] = jax.jit(repack_codes)(codes)
        for choice in ([] if args.no_reference else [None]) + (["triton"] if args.triton else []) + tilings:
            if choice is None:
                label = {"impl": "dequantize+grouped_dot"}
                def kernel(codes, sizes, x, scale):
                    return expert_matmul_reference(x, codes, scale, sizes, storage)
            elif choice == "triton":
                label = {"impl": f"triton_{storage}"}
                def kernel(codes, sizes, x, scale):
                    return expert_matmul_gpu(x, codes, scale, sizes, storage, interpret=args.interpret)
            else:
                label = {"impl": f"mosaic_{storage}",
                         **dict(zip(("block_m", "features", "words", "stages", "row_source", "code_layout"), choice))}
                def kernel(codes, sizes, x, scale, choice=choice):
                    return expert_matmul_mosaic(x, codes, scale, sizes, storage=storage, block_m=choice[0],
                                                features=choice[1],
                                                words=choice[2], stages=choice[3], row_source=choice[4],
                                                code_layout=choice[5], interpret=args.interpret)
            its_codes = code_sets[choice[5]] if isinstance(choice, tuple) else codes
            try:
                got = np.asarray(jax.jit(kernel)(its_codes, sizes, x, scale), np.float32)
                t_kernel = timed(kernel, make_set, (its_codes, sizes), few=2, many=8, repeats=5)
            except Exception as ex:  # e.g. widths the kernel does not tile: say so and go on
                print(f"{name} {label}: {type(ex).__name__}: {str(ex)[:200]}", flush=True)
                continue
            emit(args, rows, {"op": f"{storage}_experts", "matmul": name, "tokens": tokens, "rows": m, **label,
                              "kernel_ms": t_kernel * 1e3, "MB": n_bytes / 1e6, "GBps": n_bytes / t_kernel / 1e9,
                              "of_copy": n_bytes / t_kernel / bandwidth,
                              "TFLOPs": 2 * m * k_dim * n_dim / t_kernel / 1e12,
                              "rel_err": float(np.linalg.norm(got - want) / np.linalg.norm(want)),
                              "max_diff": float(np.max(np.abs(got - want)))}, bandwidth)
        del codes, scale, code_sets
    return rows


def dense_fp8_shapes(cfg) -> list[tuple[str, int, int, int]]:
    """(name, G, N, K) of the preset's FP8 linears that a decode step runs, largest first: attention's
    query up-projection, grouped output projection and output projection, the query down-projection
    and the shared experts'."""
    h, heads, d = cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim
    shared = cfg.moe_intermediate_size * max(1, getattr(cfg, "n_shared_experts", 1))  # V4.1: one shared expert
    return [("q_b", 1, heads * d, cfg.q_lora_rank), ("o_a", cfg.o_groups, cfg.o_lora_rank, heads * d // cfg.o_groups),
            ("o_b", 1, h, cfg.o_groups * cfg.o_lora_rank), ("shared_gate", 1, shared, h), ("shared_down", 1, h, shared),
            ("q_a", 1, cfg.q_lora_rank, h)]


def bench_dense_fp8(args, cfg, bandwidth):
    """Dense FP8 linears at decode (`--tokens` rows), in the preset's block size (random e4m3 codes but NaN,
    ue8m0 scales spread over 2^10, new weights for each input set so that L2 serves no repeat): XLA on the
    dequantized weight as the model runs them (`xla`) against the Mosaic GPU expert kernel reading the codes
    (`op.dense_fp8_mosaic`, `mosaic_fp8`; V4's 128 × 128 blocks and V4.1's 32 × 32). Each row has the bytes a kernel
    must move at least (codes, scales, rows in and out) and their share of the copy bandwidth; errors are
    against the `xla` row."""
    from dsjax.kernels.expert_matmul.op import dense_fp8_matmul, dense_fp8_mosaic

    block = tuple(cfg.quantization.weight_block_size) if cfg.quantization else (128, 128)
    rows = []
    for tokens, (name, g, n, k) in itertools.product(args.tokens, dense_fp8_shapes(cfg)):
        scale_shape = (g, -(-n // block[0]), -(-k // block[1]))

        def make_set(i, g=g, n=n, k=k, tokens=tokens, scale_shape=scale_shape):
            key_w, key_s, key_x = jax.random.split(jax.random.key(1000 * tokens + i), 3)
            codes = random_codes(key_w, (g, n, k), "fp8")
            scale = jax.random.randint(key_s, scale_shape, 119, 129).astype(jnp.uint8)
            return jax.random.normal(key_x, (g, tokens, k), jnp.bfloat16), codes, scale

        x, codes, scale = make_set(0)
        n_bytes = codes.size + scale.size + g * tokens * (k + n) * 2
        want = None
        impls = {"xla": functools.partial(dense_fp8_matmul, block=block, kernels="reference"),
                 "mosaic_fp8": functools.partial(dense_fp8_mosaic, block=block, interpret=args.interpret)}  # raises where it cannot
        for impl, kernel in impls.items():
            try:
                got = np.asarray(jax.jit(kernel)(x, codes, scale), np.float32)
                t_kernel = timed(kernel, make_set, few=2, many=8, repeats=5)
            except Exception as ex:  # e.g. another block size: say so and go on
                print(f"{name} {impl}: {type(ex).__name__}: {str(ex)[:200]}", flush=True)
                continue
            want = got if want is None else want
            emit(args, rows, {"op": "dense_fp8", "linear": name, "groups": g, "N": n, "K": k, "rows": tokens,
                              "impl": impl, "block": f"{block[0]}x{block[1]}", "kernel_ms": t_kernel * 1e3,
                              "MB": n_bytes / 1e6, "GBps": n_bytes / t_kernel / 1e9,
                              "of_copy": n_bytes / t_kernel / bandwidth,
                              "max_diff": float(np.max(np.abs(got - want)))}, bandwidth)
    return rows


def bench_export(args, cfg, bandwidth):
    """Load a `dsjax export` artifact, run its prefill and decode steps with random weights, check them
    against the engine's own jitted steps (greedy tokens equal, logprobs close) and time a decode step."""
    from flax import nnx

    from dsjax.engine.sampling import SamplingArrays, SamplingParams
    from dsjax.engine.engine import Engine
    from dsjax.export import load_steps
    from dsjax.model import DeepseekV4

    steps = load_steps(args.artifact)
    m = steps.manifest
    if m["weights"] != "bf16":
        raise SystemExit(f"{args.artifact}: exported for {m['weights']} weights; this check builds random "
                         "float weights (export with --weights bf16)")
    model = DeepseekV4(steps.config(), rngs=nnx.Rngs(0), dtype=jnp.dtype(m["dtype"]))
    engine = Engine(model, RunConfig(slots=m["slots"], max_len=m["max_len"], chunk_size=m["chunk_size"],
                                     kv_dtype=m["kv_dtype"]))
    n = m["prefill_rows"]
    rng = np.random.default_rng(0)
    prompts = [list(rng.integers(0, model.cfg.vocab_size, int(rng.integers(1, m["chunk_size"] + 1))))
               for _ in range(n)]
    decode_sampling = SamplingArrays.of([SamplingParams(temperature=0.0, logprobs=1)] * m["slots"],
                                        list(range(m["slots"])))
    cache, first = engine.prefill(engine.new_cache(), prompts, list(range(n)), decode_sampling)  # rows by slot
    active = jnp.arange(m["slots"]) < n
    last = jnp.zeros((m["slots"],), jnp.int32).at[:n].set(first.token[:n])
    runs = {}
    for who in ("engine", "artifact"):
        c, tokens, logprobs = jax.tree.map(jnp.copy, cache), last, []
        step = engine.decode if who == "engine" else functools.partial(steps.decode, engine.params)
        out_tokens = []
        for i in range(args.steps):
            if i == 2:  # the first calls compile
                jax.block_until_ready(c)
                t0 = time.perf_counter()
            c, sampled = step(c, tokens, active, decode_sampling)
            tokens = sampled.token
            out_tokens.append(np.asarray(tokens[:n]))
            logprobs.append(np.asarray(sampled.logprob[:n]))
        jax.block_until_ready(c)
        runs[who] = (np.stack(out_tokens), np.stack(logprobs), (time.perf_counter() - t0) / (args.steps - 2))
    same = bool(np.array_equal(runs["engine"][0], runs["artifact"][0]))
    row = {"op": "export", "artifact": args.artifact, "platform": m["platform"], "model": m["model"],
           "slots": m["slots"], "max_len": m["max_len"], "steps": args.steps, "same_tokens": same,
           "max_logprob_diff": float(np.max(np.abs(runs["engine"][1] - runs["artifact"][1]))),
           "engine_step_ms": runs["engine"][2] * 1e3, "artifact_step_ms": runs["artifact"][2] * 1e3}
    rows = []
    emit(args, rows, row, bandwidth)
    if not same:
        raise SystemExit("the exported decode step gave other tokens than the engine's")
    return rows


def run_variants(args, cfg, bandwidth):
    """Run each `--variant` kernel twice (compile, then the measured launch) and print `VARIANT …` after it,
    for a profiler to time: `ncu --metrics gpu__time_duration.sum --csv … variants …`, then `ncu`.
    Attention variants start from the model's tiling (`gpu_tiling`) for their size; `"kernel": "mosaic"`
    runs the Mosaic GPU kernel instead (bf16 cache), with the op's `num_splits` unless given."""
    from dsjax.kernels.indexer.triton import index_scores_gpu
    from dsjax.kernels.sparse_attention.mosaic_gpu import sparse_decode_mosaic
    from dsjax.kernels.sparse_attention.op import keys_per_query, mosaic_splits
    from dsjax.kernels.sparse_attention.triton import sparse_decode_gpu

    for text in args.variant:
        spec = json.loads(text)
        op, kv, batch, context = spec.pop("op"), spec.pop("kv"), spec.pop("batch"), spec.pop("context")
        if op == "attention":
            layer = CSA if spec.pop("layer", "csa") == "csa" else HCA
            entries, make_set, n_bytes, flops = attention_case(cfg, batch, context, kv, layer)
            q, window, wlen, sinks, extra = make_set(0)
            scale = cfg.head_dim ** -0.5
            if spec.pop("kernel", "triton") == "mosaic":  # the Mosaic GPU kernel, with the op's splits
                splits = spec.pop("num_splits", mosaic_splits(batch, keys_per_query(window, entries,
                                                                                   extra.get("idx_bk"))))
                fn = jax.jit(lambda e, q, w, n, s, x: sparse_decode_mosaic(q, w, n, e, s, scale, **x, **spec,
                                                                           num_splits=splits,
                                                                           interpret=args.interpret))
            else:
                tiling = {**model_tiling(cfg, entries, (q, window, wlen, sinks, extra)), **spec}
                fn = jax.jit(lambda e, q, w, n, s, x: sparse_decode_gpu(q, w, n, e, s, scale, **x, **tiling,
                                                                        interpret=args.interpret))
            inputs = (entries, q, window, wlen, sinks, extra)
        else:
            keys, make_set, n_bytes, flops = indexer_case(cfg, batch, context, kv)
            scale = cfg.index_head_dim ** -0.5
            fn = jax.jit(lambda k, q, w, n: index_scores_gpu(q, w, k, n, scale, **spec, interpret=args.interpret))
            inputs = (keys, *make_set(0))
        for _ in range(2):
            jax.block_until_ready(fn(*inputs))
        print("VARIANT " + json.dumps({"variant": json.loads(text), "bytes": n_bytes, "flops": flops}), flush=True)
        del inputs
    return []


def read_ncu(args, cfg, bandwidth):
    """Rows from a `variants` run under `ncu --csv --metrics gpu__time_duration.sum` (its whole output in
    `--ncu-log`): each variant's second launch, whose duration the GPU itself measured."""
    import csv

    lines = open(args.ncu_log).read().splitlines()
    variants = [json.loads(line.split("VARIANT ", 1)[1]) for line in lines if line.startswith("VARIANT ")]
    table = [r for r in csv.reader(line for line in lines if line.startswith('"')) if len(r) > 5]
    if not table:
        raise SystemExit(f"{args.ncu_log}: no ncu CSV rows")
    ix = {h: i for i, h in enumerate(table[0])}
    per_unit = {"ns": 1e-9, "nsecond": 1e-9, "us": 1e-6, "usecond": 1e-6, "ms": 1e-3, "msecond": 1e-3}
    seconds = [float(r[ix["Metric Value"]].replace(",", "")) * per_unit[r[ix["Metric Unit"]]]
               for r in table[1:] if r[ix["Metric Name"]] == "gpu__time_duration.sum"]
    if len(seconds) != 2 * len(variants):
        raise SystemExit(f"{args.ncu_log}: {len(seconds)} kernel launches for {len(variants)} variants (want 2 each;"
                         " profile with --kernel-name regex:dsjax and one split)")
    rows = []
    for v, t in zip(variants, seconds[1::2]):
        emit(args, rows, {**v["variant"], "kernel_us": t * 1e6, "GBps": v["bytes"] / t / 1e9,
                          "of_copy": v["bytes"] / t / bandwidth, "TFLOPs": v["flops"] / t / 1e12}, bandwidth)
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("what", choices=("attention", "tune", "indexer", "prefill-indexer", "prefill-attention",
                                      "grouped-matmul", "fp4-experts", "fp8-experts", "dense-fp8", "export",
                                      "variants", "ncu"))
    p.add_argument("--variant", nargs="+", default=[], help="variants: JSON kernel specs, e.g. "
                   '\'{"op": "attention", "kv": "fp8", "batch": 64, "context": 131072, "block_h": 32}\'')
    p.add_argument("--ncu-log", help="ncu: the output of a `variants` run under ncu")
    p.add_argument("--copy-tbps", type=float, help="ncu: the copy bandwidth to compare with (else measured here)")
    p.add_argument("--artifact", help="export: a `dsjax export` folder for this platform")
    p.add_argument("--steps", type=int, default=32, help="export: decode steps to compare and time")
    p.add_argument("--preset", default="v4-flash")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 64, 256])
    p.add_argument("--context", type=int, nargs="+", default=[4096, 131072, 1048576])
    p.add_argument("--kv-dtype", nargs="+", default=list(KV_DTYPES), choices=KV_DTYPES)
    p.add_argument("--layer", nargs="+", default=["csa", "hca"], choices=("csa", "hca"))
    p.add_argument("--splits", type=int, nargs="+", default=[1])
    p.add_argument("--block-h", type=int, nargs="+", default=[16, 32, 64])
    p.add_argument("--block-k", type=int, nargs="+", default=[16, 32, 64])
    p.add_argument("--num-warps", type=int, nargs="+", default=[4, 8], help="tune: attention; indexer: first")
    p.add_argument("--num-stages", type=int, nargs="+", default=[1, 2, 3])
    p.add_argument("--block-t", type=int, nargs="+", default=[64], help="indexer keys per block")
    p.add_argument("--tiles", type=int, nargs="+", default=[16], help="indexer blocks per program")
    p.add_argument("--chunk", type=int, nargs="+", default=[2048], help="prefill-indexer: queries per chunk")
    p.add_argument("--block-q", type=int, nargs="+", default=[4], help="prefill-indexer: queries per program")
    p.add_argument("--fuse", nargs="+", default=["on"], choices=("on", "off"),
                   help="prefill-indexer: one product of all a block's queries' heads (on) or one per query (off)")
    p.add_argument("--rate", type=int, help="prefill-indexer: tokens per index key (default: the preset's CSA rate)")
    p.add_argument("--tokens", type=int, nargs="+", default=[65536],
                   help="grouped-matmul, fp4-experts, fp8-experts: tokens routed; dense-fp8: rows")
    p.add_argument("--block-m", type=int, nargs="+", default=[64, 128],
                   help="grouped-matmul, fp4-experts, fp8-experts: rows per tile")
    p.add_argument("--block-n", type=int, nargs="+", default=[64, 128], help="grouped-matmul: columns per tile")
    p.add_argument("--features", type=int, nargs="+", default=[64], help="fp4-experts, fp8-experts: outputs per program")
    p.add_argument("--words", type=int, nargs="+", default=[32], help="fp4-experts, fp8-experts: int32 code words per step")
    p.add_argument("--stages", type=int, nargs="+", default=[2], help="fp4-experts, fp8-experts: steps in flight")
    p.add_argument("--triton", action="store_true", help="fp4-experts, fp8-experts: time the Triton kernel too")
    p.add_argument("--rows", dest="row_source", nargs="+", choices=("copied", "window", "aligned"),
                   default=["copied"], help="fp4-experts, fp8-experts: where a program reads its tile's rows: copied "
                   "out first, in place from a window, or in place after moving each expert to a multiple of 8")
    p.add_argument("--code-layout", nargs="+", choices=("checkpoint", "repacked"), default=["checkpoint"],
                   help="fp4-experts: the FP4 codes in the checkpoint's order or repacked for the kernel")
    p.add_argument("--block-k-mm", dest="block_k_mm", type=int, nargs="+", default=[64, 128],
                   help="grouped-matmul: contraction per step")
    p.add_argument("--grid-tile-width", type=int, nargs="+", default=[1, 8], help="grouped-matmul")
    p.add_argument("--reference-bytes", type=int, default=4 << 30,
                   help="prefill-indexer: time the reference where its [C, heads, T] scores take at most this")
    p.add_argument("--max-tokens", type=int, default=64 * 1048576, help="skip sizes of more batch × context")
    p.add_argument("--no-reference", action="store_true")
    p.add_argument("--tiling", default="{}", help="attention: JSON overrides of gpu_tiling's defaults")
    p.add_argument("--path", default="op", choices=("op", "triton"),
                   help="attention: the operation as the model runs it, or the Triton kernel alone")
    p.add_argument("--extra", nargs="+", default=["{}"], help="tune, indexer: JSON dicts of further kernel options")
    p.add_argument("--interpret", action="store_true", help="run the kernels interpreted (a CPU smoke test)")
    p.add_argument("--json", help="append the rows here")
    args = p.parse_args(argv)
    args.layer = [CSA if x == "csa" else HCA for x in args.layer]
    cfg = model_config(PRESETS[args.preset])  # either family: fp4-experts reads V4.1's widths
    if args.copy_tbps:
        bandwidth = args.copy_tbps * 1e12
    else:
        bandwidth = copy_bandwidth(32 << 20 if args.interpret else 2 << 30)
    print(f"{jax.devices()[0].device_kind}: copy {bandwidth / 1e12:.2f} TB/s", flush=True)
    rows = {"attention": bench_attention, "tune": bench_tune, "indexer": bench_indexer,
            "prefill-indexer": bench_prefill_indexer, "prefill-attention": bench_prefill_attention,
            "grouped-matmul": bench_grouped_matmul, "fp4-experts": bench_fp4_experts,
            "fp8-experts": functools.partial(bench_fp4_experts, storage="fp8"), "dense-fp8": bench_dense_fp8,
            "export": bench_export, "variants": run_variants,
            "ncu": read_ncu}[args.what](args, cfg, bandwidth)
    keys = list(dict.fromkeys(k for r in rows for k in r if k != "op"))
    print(" ".join(f"{k:>10}" for k in keys))
    for r in sorted(rows, key=lambda r: r.get("kernel_us", 0)) if args.what == "tune" else rows:
        print(" ".join(f"{v:>10.4g}" if isinstance(v, float) else f"{v!s:>10}" for v in (r.get(k, "") for k in keys)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
