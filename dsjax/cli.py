"""The `dsjax` command: one entry point, one sub-command per job."""

from __future__ import annotations

import argparse
import sys

from dsjax.config import ModelConfig


def _info(args: argparse.Namespace) -> int:
    from dsjax.cache import cache_bytes_per_token
    from dsjax.info import COMPONENTS, model_info

    cfg = ModelConfig.preset(args.preset) if args.preset else ModelConfig.from_hf(args.model)
    info = model_info(cfg)
    name = args.preset or args.model
    print(f"{name}: {info.summary()}")
    for comp in COMPONENTS:
        n = info.by_component[comp]
        print(f"  {comp:<15} {n:>18,}  {100 * n / info.total:5.1f}%")
    print(f"  layers: {cfg.num_hidden_layers} ({', '.join(f'{t}×{cfg.layer_types.count(t)}' for t in sorted(set(cfg.layer_types)))})")
    context = args.context or cfg.max_position_embeddings
    per_type = cache_bytes_per_token(cfg, context)
    whole = sum(per_type[t] * cfg.layer_types.count(t) for t in per_type)
    print(f"  cache per token of context at {context:,} tokens (bf16): "
          + ", ".join(f"{t} {b:,.0f} B/layer" for t, b in per_type.items())
          + f"; whole model {whole / 1024:,.1f} KiB/token")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dsjax", description="DeepSeek-V4 offline inference in JAX")
    sub = parser.add_subparsers(dest="command", required=True)
    info = sub.add_parser("info", help="parameter counts and memory of a model, without loading it")
    src = info.add_mutually_exclusive_group(required=True)
    src.add_argument("--preset", help="tiny, v4-flash or v4.1-flash")
    src.add_argument("--model", help="a Hugging Face model folder (its config.json is read)")
    info.add_argument("--context", type=int, help="context length for the cache report "
                      "(default: max_position_embeddings)")
    info.set_defaults(func=_info)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, OSError) as e:
        print(f"dsjax {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
