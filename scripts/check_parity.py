"""Check dsjax against a dump of the Hugging Face reference on whatever accelerator JAX sees.

The dump is the output folder of `tests/reference/run_reference.py` (made on a CPU machine with
torch + transformers); this script needs only dsjax. It reports, per reference case:
  - the full-sequence fp32 logits error (max |diff| / max |ref|), at JAX's default matmul precision
    and at "highest";
  - whether greedy generation through the cache reproduces the reference's tokens.

    python scripts/check_parity.py --reference REF_DIR [--json OUT.json]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import time

import jax
import jax.numpy as jnp
import numpy as np

import dsjax


def rel_err(a, b) -> float:
    return float(np.abs(np.asarray(a, np.float64) - b).max() / np.abs(b).max())


def check_case(folder: pathlib.Path) -> dict:
    model = dsjax.load_model(folder / "hf")
    out = {"case": folder.name, "logits": {}}
    for ids_path in sorted(folder.glob("input_ids_*.npy"), key=lambda p: int(p.stem.split("_")[-1])):
        t = int(ids_path.stem.split("_")[-1])
        ids = jnp.asarray(np.load(ids_path))
        ref = np.load(folder / f"logits_{t}.npy")
        default = rel_err(model(ids), ref)
        with jax.default_matmul_precision("highest"):
            highest = rel_err(model(ids), ref)
        out["logits"][t] = {"default": default, "highest": highest}
    runs = [np.load(p) for p in sorted(folder.glob("generate_*.npz"))]
    if runs:
        engine = dsjax.Engine(model, dsjax.RunConfig(slots=4, max_len=96, chunk_size=8))
        sp = dsjax.SamplingParams(temperature=0.0, max_tokens=len(runs[0]["tokens"]), stop_token_ids=[])
        t0 = time.perf_counter()
        res = dsjax.generate(model, [r["prompt"].tolist() for r in runs], sp, engine=engine)
        out["generate_seconds"] = time.perf_counter() - t0
        out["greedy_match"] = [r.tokens == run["tokens"].tolist() for r, run in zip(res, runs)]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reference", required=True, type=pathlib.Path)
    ap.add_argument("--json", type=pathlib.Path)
    args = ap.parse_args()
    cases = sorted(p for p in args.reference.iterdir() if (p / "hf").is_dir())
    if not cases:
        raise SystemExit(f"{args.reference}: no reference cases (folders with an hf/ checkpoint)")
    results = {"devices": [str(d) for d in jax.devices()], "cases": [check_case(c) for c in cases]}
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    print(f"devices: {results['devices']}")
    print(f"{'case':<8} {'T':>4} {'err default':>12} {'err highest':>12}")
    for c in results["cases"]:
        for t, e in c["logits"].items():
            print(f"{c['case']:<8} {t:>4} {e['default']:>12.2e} {e['highest']:>12.2e}")
        if "greedy_match" in c:
            print(f"{c['case']:<8} greedy tokens match reference: {sum(c['greedy_match'])}/{len(c['greedy_match'])}")


if __name__ == "__main__":
    main()
