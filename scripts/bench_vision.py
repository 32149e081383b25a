"""Time and memory of DeepSeek-V4.1's image encoder (ViT and aligner, `layers/vision_v41.py`) per image, as
`Engine.encode_images` runs it: images padded to their cell bucket, several images of one size per call
or one at a time, the attention through cuDNN or in query blocks or dense.

    python scripts/bench_vision.py [--preset v4.1-flash] [--sizes 546x546 1036x770 1708x966 1512x1134]
        [--batch 1 8] [--attention fused 1024 0] [--dtype bfloat16] [--repeats 5] [--json rows.jsonl]

Sizes are the recipe's preprocessed W×H (multiples of the patch size; the defaults are what
deepseek-recipe 0.2.0 makes of 224×224, 1024×768, 1920×1080 and 4000×3000 pictures). `--batch`: images
per call (copies of one random image). `--attention`: `fused` is cuDNN's fused attention (NVIDIA GPUs,
what the engine takes there), a number the queries per block of the XLA attention, 0 the dense one
(default: fused where it runs, then 1024 and 0). Weights are random (the cost does not depend on them).
Per row: ms per call and per image (best of the repeats, after a warm-up call), the encoder's matmul
FLOPs and the rate they ran at, XLA's temporaries for the compiled program, and the largest difference
of its first image's rows from the first row's of that size (relative to their largest value). The last
lines are a table.
"""

from __future__ import annotations

import argparse
import json
import sys
import time


def encoder_flops(vision, hidden: int, patches: int) -> float:
    """Matmul FLOPs of encoding one image of `patches` patches (padding included: it is computed): patch
    embedding, per block the qkv/out projections, the SwiGLU MLP and the attention's two products, then
    the aligner."""
    d, i, p = vision.hidden_size, vision.intermediate_size, vision.patch_size
    per_block = 2 * patches * d * (4 * d + 3 * i) + 4 * patches * patches * d
    cells = patches // vision.merge_size ** 2
    aligner = 2 * cells * (vision.merge_size ** 2 * d * hidden + hidden * hidden)
    return 2 * patches * 3 * p * p * d + vision.num_hidden_layers * per_block + aligner


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="v4.1-flash")
    ap.add_argument("--sizes", nargs="+", default=["546x546", "1036x770", "1708x966", "1512x1134"])
    ap.add_argument("--batch", nargs="+", type=int, default=[1, 8], help="images per call")
    ap.add_argument("--attention", nargs="+",
                    help="'fused' (cuDNN), or queries per block of the XLA attention, 0 for dense")
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", help="append one JSON row per size, attention and batch")
    args = ap.parse_args(argv)

    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from dsjax.config import ConfigError
    from dsjax.config_v41 import V41Config
    from dsjax.engine.pixels import cell_bucket, pad_cells, patchify
    from dsjax.layers.patch_attention import QUERY_BLOCK, fused_attention_fits
    from dsjax.layers.vision_v41 import Aligner, ViT

    try:
        try:
            cfg = V41Config.preset(args.preset)
        except (ConfigError, KeyError, ValueError) as e:
            raise ValueError(f"--preset {args.preset}: {e}") from None
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
        if args.repeats < 1 or min(args.batch) < 1:
            raise ValueError("--repeats and --batch must be positive")
        dtype = getattr(jnp, args.dtype)
        fits = jax.default_backend() == "gpu" and fused_attention_fits(dtype, vision.head_dim)
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

    class Encoder(nnx.Module):
        def __init__(self):
            rngs = nnx.Rngs(0)
            self.vision = ViT(vision, rngs=rngs, dtype=dtype)
            self.aligner = Aligner(vision, cfg.hidden_size, rngs=rngs, dtype=dtype)

    graphdef, state = nnx.split(Encoder())
    params = sum(x.size for x in jax.tree.leaves(state))

    @jax.jit(static_argnums=(0, 1))
    def cells(query_block, fused, state, patches, row, col, valid):
        enc = nnx.merge(graphdef, state)
        return enc.aligner(enc.vision(patches, row, col, valid, query_block, fused))

    device = jax.devices()[0]
    print(f"{args.preset} encoder: {params / 1e6:.0f}M parameters, {args.dtype}, on {device.device_kind}", flush=True)
    rng = np.random.default_rng(0)
    rows = []
    for w, h in sizes:
        pixels = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
        grid_rows, grid_cols = vision.grid(w, h)
        a = pad_cells(patchify(pixels, vision), cell_bucket(grid_rows * grid_cols), vision)
        n = len(a["valid"])
        first = None
        for kind in kinds:
            fused = kind == "fused"
            static = (QUERY_BLOCK if fused else int(kind)) or n, fused
            for batch in args.batch:
                inputs = [jax.device_put(np.repeat(a[k][None], batch, axis=0)) for k in ("patches", "row", "col",
                                                                                        "valid")]
                compiled = cells.lower(*static, state, *inputs).compile()
                temp = compiled.memory_analysis().temp_size_in_bytes
                out = np.asarray(cells(*static, state, *inputs), np.float32)[0, :grid_rows * grid_cols]  # warm-up
                first = out if first is None else first
                best = float("inf")
                for _ in range(args.repeats):
                    t = time.perf_counter()
                    jax.block_until_ready(cells(*static, state, *inputs))
                    best = min(best, time.perf_counter() - t)
                flops = encoder_flops(vision, cfg.hidden_size, n)
                row = {"preset": args.preset, "dtype": args.dtype, "device": device.device_kind, "size": f"{w}x{h}",
                       "patches": int(a["valid"].sum()), "padded_patches": n, "image_tokens": vision.image_tokens(w, h),
                       "attention": "fused" if fused else f"blocks of {kind}" if int(kind) else "dense",
                       "batch": batch, "ms_per_call": best * 1e3, "ms": best * 1e3 / batch, "tflop": flops / 1e12,
                       "tflops_per_s": flops * batch / best / 1e12, "temp_bytes": temp,
                       # against the size's first row: the same encoder, summed in other shapes
                       "max_rel_diff": float(np.abs(out - first).max() / max(np.abs(first).max(), 1e-30))}
                rows.append(row)
                print(json.dumps(row), flush=True)
                if args.json:
                    with open(args.json, "a") as f:
                        f.write(json.dumps(row) + "\n")

    print("\nsize | patches (padded) | tokens | attention | images/call | ms/image | TFLOP/image | TFLOP/s | "
          "XLA temporaries | max diff vs first")
    for r in rows:
        print(f"{r['size']} | {r['patches']:,} ({r['padded_patches']:,}) | {r['image_tokens']:,} | "
              f"{r['attention']} | {r['batch']} | {r['ms']:.2f} | {r['tflop']:.2f} | {r['tflops_per_s']:.0f} | "
              f"{r['temp_bytes'] / 2**30:.2f} GiB | {r['max_rel_diff']:.2g}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
