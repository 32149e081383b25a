"""Time one layer's routed experts (two grouped matmuls and the SwiGLU) per expert storage format.

Experts at the preset's widths with random weights, stored bf16, FP8 (128 × 128 blocks, ue8m0
scales) or FP4 (e2m1, a ue8m0 scale per 32 inputs), as `RoutedExperts` holds them; random top-k
routing. For each token count it prints the time per call, the bytes of the experts the tokens touch
(codes and the scales the kernel reads), that over the time as a fraction of `--copy-tbps`, and the
largest difference from the same call on the experts dequantized to bf16 first.

    python scripts/bench_experts.py --preset v4-flash --tokens 1 32 128 512 --copy-tbps 4.28
"""

from __future__ import annotations

import argparse
import json
import sys
import time

FORMATS = ("bf16", "fp8", "fp4")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="v4-flash")
    p.add_argument("--experts", type=int, help="routed experts (default: the preset's)")
    p.add_argument("--formats", nargs="+", default=list(FORMATS), choices=FORMATS)
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 32, 128, 512])
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--sweep", nargs="*", default=[], metavar="JSON",
                   help="also time the FP8/FP4 kernel alone on the gate_up projection with each of these "
                        'tilings, e.g. \'{"block_n": 128, "num_warps": 8}\'')
    p.add_argument("--copy-tbps", type=float, help="copy bandwidth to compare with (default: measured)")
    p.add_argument("--json", help="append the rows here")
    args = p.parse_args(argv)

    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from dsjax.bench import measure_rates
    from dsjax.config import ModelConfig, QuantConfig
    from dsjax.kernels.expert_matmul.triton import expert_matmul_gpu
    from dsjax.layers.experts import RoutedExperts, dense_experts, grouped_mlp, matmul_experts

    base = ModelConfig.preset(args.preset)
    if args.experts:
        base = base.replace(n_routed_experts=args.experts)
    copy = args.copy_tbps * 1e12 if args.copy_tbps else measure_rates().copy_bytes_per_s
    rng = np.random.default_rng(0)
    e, k, h = base.n_routed_experts, base.num_experts_per_tok, base.hidden_size
    rows, sweep = [], []

    def timed(fn, iters):
        jax.block_until_ready(fn())
        best = float("inf")
        for _ in range(3):
            t0 = time.perf_counter()
            for _ in range(iters):
                out = fn()
            jax.block_until_ready(out)
            best = min(best, (time.perf_counter() - t0) / iters)
        return best

    for fmt in args.formats:
        quant = None if fmt == "bf16" else QuantConfig((128, 128), "ue8m0", fmt)
        cfg = base.replace(quantization=quant)
        experts = nnx.jit(lambda: RoutedExperts(cfg, rngs=nnx.Rngs(0), dtype=jnp.bfloat16))()
        stored = [experts.stored(n) for n in ("gate_up_proj", "down_proj")]
        fast = jax.jit(lambda st, x, w, i: grouped_mlp(
            x, w, i, *(matmul_experts(q, s, experts.storage, cfg) for q, s in st), cfg))
        dense = jax.jit(lambda st, x, w, i: grouped_mlp(
            x, w, i, *(dense_experts(q, s, experts.storage, cfg, x.dtype) for q, s in st), cfg))
        # What a call reads per touched expert: its codes (or bf16 weights) and scales, as stored.
        kernel_bytes = sum(q.nbytes + (0 if sc is None else sc.nbytes) for q, sc in stored) / e
        for n in args.tokens:
            idx = np.argsort(rng.random((n, e)), axis=-1)[:, :k]
            x = jnp.asarray(rng.normal(size=(n, h)), jnp.bfloat16)
            w = jnp.asarray(rng.random(idx.shape), jnp.float32)
            i = jnp.asarray(idx, jnp.int32)
            y = fast(stored, x, w, i).block_until_ready()
            ref = np.asarray(dense(stored, x, w, i), np.float32)
            best = timed(lambda: fast(stored, x, w, i), args.iters)
            touched = len(np.unique(idx)) * kernel_bytes
            for spec in (args.sweep if fmt != "bf16" else []):
                (q, sc), tiling = stored[0], json.loads(spec)
                rows_p = n * k
                xs = jnp.asarray(rng.normal(size=(rows_p, h)), jnp.bfloat16)
                sizes = jnp.asarray(np.bincount(idx.reshape(-1), minlength=e), jnp.int32)
                sec = timed(lambda: expert_matmul_gpu(xs, q, sc, sizes, fmt, **tiling), args.iters)
                part = len(np.unique(idx)) * (q.nbytes + sc.nbytes) / e
                sweep.append({"format": fmt, "tokens": n, "tiling": tiling, "ms": sec * 1e3,
                              "of_copy_bw": part / sec / copy})
                print(json.dumps(sweep[-1]), file=sys.stderr, flush=True)
            rows.append({"format": fmt, "tokens": n, "ms": best * 1e3, "touched_gb": touched / 1e9,
                         "of_copy_bw": touched / best / copy,
                         "max_abs_diff": float(np.max(np.abs(np.asarray(y, np.float32) - ref))),
                         "max_abs": float(np.max(np.abs(ref)))})
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    print(f"{jax.devices()[0].device_kind}: {args.preset} experts (E={e}, k={k}, H={h}, "
          f"I={base.moe_intermediate_size}), copy bandwidth {copy / 1e12:.2f} TB/s")
    print(f"{'format':>6} {'tokens':>7} {'ms':>8} {'touched GB':>11} {'of copy BW':>11} {'max |diff|':>11}")
    for r in rows:
        print(f"{r['format']:>6} {r['tokens']:>7} {r['ms']:>8.3f} {r['touched_gb']:>11.3f} "
              f"{r['of_copy_bw']:>10.1%} {r['max_abs_diff']:>11.3g}")
    if sweep:
        print(f"{'format':>6} {'tokens':>7} {'ms':>8} {'of copy BW':>11}  gate_up kernel alone, tiling")
        for r in sweep:
            print(f"{r['format']:>6} {r['tokens']:>7} {r['ms']:>8.3f} {r['of_copy_bw']:>10.1%}  "
                  f"{json.dumps(r['tiling'])}")
    if args.json:
        with open(args.json, "a") as f:
            for r in rows:
                f.write(json.dumps({"preset": args.preset, **r}) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
