"""Quality of the quantized cache and weights on the embedded model, measured through the inference path.

    .venv/bin/python scripts/quant_quality.py [--rows 8] [--prompt 128] [--steps 256] [--json OUT]

1. Greedy-decode `--steps` tokens after `--prompt`-token held-out prompts with the bf16 cache: that
   trajectory is the reference.
2. Teacher-force the same trajectory with each cache format (and with FP8/FP4 weights) and compare each
   decode step's next-token distribution with the bf16 cache's: KL(bf16 ‖ other) and whether the
   argmax agrees.
3. Free-running greedy decoding with each format: the fraction of the `--steps` tokens equal to the bf16
   run's, and the step of the first difference.
4. Held-out cross-entropy of the 16 × 512 held-out rows scored through the cache (64-token prefill,
   then one decode step per token), per format.
Prints a Markdown table (docs/quantization.md holds the last run).
"""

from __future__ import annotations

import argparse
import json
import time

import jax.numpy as jnp
import numpy as np

import dsjax
from dsjax.embedded import MODEL_DIR
from dsjax.engine.engine import Engine
from dsjax.engine.generate import generate
from dsjax.engine.sampling import SamplingParams
from dsjax.engine.scoring import teacher_forced_logprobs
from dsjax.quantize import V4_QUANT, quantize_model
from dsjax.run_config import RunConfig

BASE = "bfloat16"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--steps", type=int, default=256)
    ap.add_argument("--json", help="write the numbers here too")
    args = ap.parse_args()
    t0 = time.time()
    model = dsjax.load_model(MODEL_DIR)  # fp32 activations: the cache format is the only change
    heldout = np.load(f"{MODEL_DIR}/heldout.npy")
    prompts = heldout[:args.rows, :args.prompt]
    variants = {"float32 cache": (model, None), "bfloat16": (model, "bfloat16"), "fp8": (model, "fp8"),
                "fp4": (model, "fp4"), "FP8+FP4 weights, bf16 cache": (quantize_model(model, V4_QUANT), "bfloat16")}
    greedy = SamplingParams(max_tokens=args.steps, temperature=0.0, stop_token_ids=[])
    max_len = args.prompt + args.steps

    def free_run(m, kv):
        eng = Engine(m, RunConfig(slots=args.rows, max_len=max_len, chunk_size=64, kv_dtype=kv))
        return np.asarray([r.tokens for r in generate(m, prompts.tolist(), greedy, engine=eng)])

    runs = {name: free_run(m, kv) for name, (m, kv) in variants.items()}
    seqs = np.concatenate([prompts, runs[BASE]], axis=1)

    def decode_steps(m, kv):
        full = teacher_forced_logprobs(m, seqs, args.prompt, chunk_size=64, kv_dtype=kv, full=True)
        return full[:, args.prompt - 1:]  # the predictions of the `steps` generated tokens

    base = decode_steps(model, BASE)
    results = {}
    for name, (m, kv) in variants.items():
        lp = base if name == BASE else decode_steps(m, kv)
        kl = np.sum(np.exp(base) * (base - lp), axis=-1)  # [rows, steps]
        same = runs[name] == runs[BASE]
        first = [int(np.argmin(r)) if not r.all() else args.steps for r in same]
        ce = -teacher_forced_logprobs(m, heldout, 64, chunk_size=64, kv_dtype=kv).mean()
        results[name] = {"kl_mean": float(kl.mean()), "kl_p99": float(np.quantile(kl, 0.99)),
                         "kl_max": float(kl.max()),
                         "top1_agreement": float((lp.argmax(-1) == base.argmax(-1)).mean()),
                         "free_run_token_match": float(same.mean()), "first_difference_median": float(np.median(first)),
                         "heldout_ce": float(ce)}
    print(f"embedded model, {args.rows} held-out prompts of {args.prompt} tokens, {args.steps} greedy decode steps "
          f"({time.time() - t0:.0f} s)\n")
    print("| variant | KL mean | KL p99 | KL max | top-1 agreement | free-run tokens equal "
          "| first difference (median step) | held-out CE |")
    print("|---|---|---|---|---|---|---|---|")
    for name, r in results.items():
        print(f"| {name} | {r['kl_mean']:.2e} | {r['kl_p99']:.2e} | {r['kl_max']:.2e} "
              f"| {100 * r['top1_agreement']:.2f}% | {100 * r['free_run_token_match']:.1f}% "
              f"| {r['first_difference_median']:.0f} | {r['heldout_ce']:.5f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=1)


if __name__ == "__main__":
    jnp.zeros(())  # start the backend before timing
    main()
