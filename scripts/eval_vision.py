"""The embedded model's image task, end to end: `dsjax generate` on fresh generated images, and the share
of answers that name the shape's colour (chance: one in six).

    python scripts/eval_vision.py [--model dsjax/embedded/model] [--images 100] [--seed 1000] [--dtype float32]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(argv: list[str] | None = None) -> int:
    from dsjax.embedded import MODEL_DIR
    from dsjax.run_config import RunConfig
    from dsjax.training.vision import task_accuracy

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=MODEL_DIR)
    ap.add_argument("--images", type=int, default=100)
    ap.add_argument("--seed", type=int, default=1000, help="images (training draws from seed 0)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        run = RunConfig(slots=16, max_len=256, chunk_size=128, dtype=args.dtype)
        result = task_accuracy(args.model, args.images, args.seed, tmp, run=run, progress=False)
    result.pop("records")
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
