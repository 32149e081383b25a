"""Time and memory of the V4.1 image encoder per image, as `Engine.encode_image` runs it (padded to its
cell bucket, one image per call), with the attention's queries in blocks and dense.

    python scripts/bench_vision.py [--preset v4-flash] [--sizes 546x546 1036x770 1708x966 1512x1134]
        [--attention fused 1024 0] [--dtype bfloat16] [--repeats 5] [--json rows.jsonl]

Sizes are the recipe's preprocessed W×H (multiples of the patch size; the defaults are what
deepseek-recipe 0.2.0 makes of 224×224, 1024×768, 1920×1080 and 4000×3000 pictures). `--attention`:
`fused` is cuDNN's fused attention (NVIDIA GPUs, what the engine takes there), a number the queries per
block of the XLA attention, 0 the dense one (default: fused where it runs, then 1024 and 0). Weights are
random (the cost does not depend on them). Per row: ms per image (best of the repeats, after a warm-up
call), the encoder's matmul FLOPs and the rate they ran at,
XLA's temporaries for the compiled program, and the largest difference of its cell embeddings from the
first attention's (relative to their largest value). The last lines are a table.
"""

from __future__ import annotations

import argparse
import json
import sys
import time


def encoder_flops(vision, hidden: int, patches: int) -> float:
    """Matmul FLOPs of encoding `patches` patches (padding included: it is computed): patch embedding,
    per block the qkv/out projections, the MLP and the attention's two products, then the cell merge."""
    d, i, p = vision.hidden_size, vision.intermediate_size, vision.patch_size
    per_block = 2 * patches * d * (4 * d + 2 * i) + 4 * patches * patches * d
    cells = patches // vision.merge_size ** 2
    merge = 2 * cells * (vision.merge_size ** 2 * d * hidden + hidden * hidden)
    return 2 * patches * 3 * p * p * d + vision.num_layers * per_block + merge


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="v4-flash")
    ap.add_argument("--sizes", nargs="+", default=["546x546", "1036x770", "1708x966", "1512x1134"])
    ap.add_argument("--attention", nargs="+",
                    help="'fused' (cuDNN), or queries per block of the XLA attention, 0 for dense")
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", help="append one JSON row per size and block")
    args = ap.parse_args(argv)

    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from dsjax.config import ModelConfig
    from dsjax.engine.pixels import cell_bucket, pad_cells, patchify
    from dsjax.layers.vision import QUERY_BLOCK, VisionEncoder, fused_attention_fits

    try:
        cfg = ModelConfig.preset(args.preset)
        vision = cfg.vision
        if vision is None:
            raise ValueError(f"the preset {args.preset!r} has no image encoder")
        sizes = []
        for text in args.sizes:
            w, _, h = text.partition("x")
            if not (w.isdigit() and h.isdigit()) or int(w) % vision.patch_size or int(h) % vision.patch_size \
                    or min(int(w), int(h)) < vision.patch_size:
                raise ValueError(f"--sizes {text}: must be WxH, both positive multiples of {vision.patch_size} "
                                 "(the recipe's preprocessed size)")
            sizes.append((int(w), int(h)))
        if args.repeats < 1:
            raise ValueError("--repeats must be positive")
        dtype = getattr(jnp, args.dtype)
        fits = jax.default_backend() == "gpu" and fused_attention_fits(dtype, vision.hidden_size // vision.num_heads)
        kinds = args.attention or (["fused"] if fits else []) + ["1024", "0"]
        for kind in kinds:
            if kind == "fused" and not fits:
                raise ValueError("--attention fused: cuDNN's fused attention needs an NVIDIA GPU and bf16 heads "
                                 "of at most 128 channels, a multiple of 8")
            if kind != "fused" and not (kind.isdigit()):
                raise ValueError(f"--attention {kind}: must be 'fused' or a number of queries (0: dense)")
    except ValueError as e:
        print(f"bench_vision: error: {e}", file=sys.stderr)
        return 2

    encoder = VisionEncoder(cfg, rngs=nnx.Rngs(0), dtype=dtype)
    graphdef, state = nnx.split(encoder)
    params = sum(x.size for x in jax.tree.leaves(state))

    @jax.jit(static_argnums=(0, 1))
    def cells(query_block, fused, state, patches, row, col, valid):
        return nnx.merge(graphdef, state).cells(patches, row, col, valid, query_block, fused)

    device = jax.devices()[0]
    print(f"{args.preset} encoder: {params / 1e6:.0f}M parameters, {args.dtype}, on {device.device_kind}", flush=True)
    rng = np.random.default_rng(0)
    rows = []
    for w, h in sizes:
        pixels = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
        grid_rows, grid_cols = vision.grid(w, h)
        a = pad_cells(patchify(pixels, vision), cell_bucket(grid_rows * grid_cols), vision)
        inputs = [jax.device_put(a[k]) for k in ("patches", "row", "col", "valid")]
        n = len(a["valid"])
        first = None
        for kind in kinds:
            fused = kind == "fused"
            static = (QUERY_BLOCK if fused else int(kind)) or n, fused
            compiled = cells.lower(*static, state, *inputs).compile()
            temp = compiled.memory_analysis().temp_size_in_bytes
            out = np.asarray(cells(*static, state, *inputs), np.float32)[:grid_rows * grid_cols]  # warm-up
            first = out if first is None else first
            best = float("inf")
            for _ in range(args.repeats):
                t = time.perf_counter()
                jax.block_until_ready(cells(*static, state, *inputs))
                best = min(best, time.perf_counter() - t)
            flops = encoder_flops(vision, cfg.hidden_size, n)
            row = {"preset": args.preset, "dtype": args.dtype, "device": device.device_kind, "size": f"{w}x{h}",
                   "patches": int(a["valid"].sum()), "padded_patches": n,
                   "image_tokens": vision.image_tokens(w, h),
                   "attention": "fused" if fused else f"blocks of {kind}" if int(kind) else "dense", "ms": best * 1e3,
                   "tflop": flops / 1e12, "tflops_per_s": flops / best / 1e12, "temp_bytes": temp,
                   # against the first block size's cells: the same attention, summed in other shapes
                   "max_rel_diff": float(np.abs(out - first).max() / max(np.abs(first).max(), 1e-30))}
            rows.append(row)
            print(json.dumps(row), flush=True)
            if args.json:
                with open(args.json, "a") as f:
                    f.write(json.dumps(row) + "\n")

    print("\nsize | patches (padded) | tokens | attention | ms/image | TFLOP | TFLOP/s | XLA temporaries | "
          "max diff vs first")
    for r in rows:
        print(f"{r['size']} | {r['patches']:,} ({r['padded_patches']:,}) | {r['image_tokens']:,} | "
              f"{r['attention']} | {r['ms']:.2f} | {r['tflop']:.2f} | {r['tflops_per_s']:.0f} | "
              f"{r['temp_bytes'] / 2**30:.2f} GiB | {r['max_rel_diff']:.2g}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
