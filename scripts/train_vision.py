"""Teach the embedded model to see: train an image encoder in front of its frozen decoder.

    python scripts/train_vision.py --out /tmp/seeing            # about N minutes on 2 CPU cores
    python scripts/train_vision.py --out dsjax/embedded/model   # replace the shipped model

The task and the method are in `dsjax/training/vision.py`. The decoder's weights are copied from
`--base` unchanged, so text requests are answered as before. Writes the model (bf16, DeepSeek's original
tensor names, as the embedded model is stored) and its tokenizer into `--out`, with `vision_log.jsonl`
and the final numbers in `vision_metrics.json`.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="folder to write the model into (created or replaced)")
    ap.add_argument("--base", help="the text model whose decoder is kept (default: the embedded model)")
    ap.add_argument("--preset", default="demo-vision", help="whose vision_config the encoder takes")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--learning-rate", type=float, default=2e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--eval-every", type=int, default=50)
    ap.add_argument("--max-shard-mb", type=float, default=12.0, help="safetensors shard size limit")
    args = ap.parse_args(argv)

    import jax.numpy as jnp
    from flax import nnx

    from dsjax.batch.recipe import Recipe
    from dsjax.checkpoint.load import load_model
    from dsjax.checkpoint.save import save_model
    from dsjax.config import ModelConfig
    from dsjax.embedded import MODEL_DIR
    from dsjax.model import DeepseekV4
    from dsjax.training.train import cast_like
    from dsjax.training.vision import ShapeData, train_encoder

    base_dir = args.base or MODEL_DIR
    base = load_model(base_dir, dtype=jnp.float32)
    vision = ModelConfig.preset(args.preset).vision
    if vision is None:
        raise SystemExit(f"preset {args.preset!r} has no vision_config")
    model = DeepseekV4(base.cfg.replace(vision=vision), rngs=nnx.Rngs(args.seed), dtype=jnp.float32)
    decoder = {p: v for p, v in nnx.to_flat_state(nnx.state(base))}
    for path, var in nnx.to_flat_state(nnx.state(model)):
        if path[0] != "vision":
            var.set_value(decoder[path].get_value())
    tokenizer = os.path.join(base_dir, "tokenizer.json")
    recipe = Recipe(tokenizer, model.cfg.max_position_embeddings, model.cfg.eos_token_id, vision=vision)
    data = ShapeData(recipe, model.cfg.eos_token_id[0], args.seed)

    staging = args.out.rstrip("/") + ".partial"
    shutil.rmtree(staging, ignore_errors=True)
    os.makedirs(staging)
    log_path = os.path.join(staging, "vision_log.jsonl")

    def log(row: dict) -> None:
        print(json.dumps(row), flush=True)
        with open(log_path, "a") as f:
            f.write(json.dumps(row) + "\n")

    t0 = time.perf_counter()
    log({"config": vars(args), "vision_config": vision.to_hf()})
    model = train_encoder(model, data, args.steps, args.batch_size, args.learning_rate, log, args.eval_every)
    seconds = time.perf_counter() - t0
    save_model(cast_like(model, jnp.bfloat16), staging, max_shard_bytes=int(args.max_shard_mb * 2**20),
               naming="original")
    written = set(os.listdir(staging))
    for name in os.listdir(base_dir):  # the tokenizer, README and the decoder's training records
        src = os.path.join(base_dir, name)
        if os.path.isfile(src) and name not in written and not name.startswith("model"):
            shutil.copy(src, os.path.join(staging, name))
    with open(os.path.join(staging, "vision_metrics.json"), "w") as f:
        json.dump({"train_seconds": round(seconds, 1), "steps": args.steps, "batch_size": args.batch_size}, f,
                  indent=1)
    if os.path.abspath(args.out) == os.path.abspath(base_dir) or os.path.exists(args.out):
        shutil.rmtree(args.out)
    os.replace(staging, args.out)
    print(f"wrote {args.out} in {seconds:.0f} s of training")
    return 0


if __name__ == "__main__":
    sys.exit(main())
