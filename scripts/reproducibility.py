"""Batch invariance and deterministic sampling, measured on any checkpoint (the GPU's records in docs/benchmarks.md).

    python scripts/reproducibility.py invariance --model DIR [--slots 32] [--dtype bfloat16] [--modes M]
    python scripts/reproducibility.py determinism --model DIR --work DIR [--count 64] [--slots 16] [--max-len 512]
        [--modes M]

`invariance`: one request alone, then inside batches of 2, 7 and 32 at their first, middle and last places,
greedy and at temperature 0.7 / top_p 0.9 (seeded), in the default mode and with `--batch-invariant`: are its
tokens the same and its logprobs (and top alternatives) bitwise equal? `determinism`: `dsjax generate` on the
same input three times per mode (temperature 0.7, top_p 0.9, half the requests seeded), the third run killed
with SIGKILL after a quarter of its records and resumed: are the output files identical apart from ids and
timestamps? `--modes` picks the modes (`default`, `batch-invariant`; both unless given). Each prints a table;
exit status 1 where the batch-invariant mode is not invariant or deterministic.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time

from dsjax.batch.results import comparable

MODES = ("default", "batch-invariant")


def invariance(model_dir: str, slots: int, dtype: str, max_tokens: int = 16, modes: tuple[str, ...] = MODES) -> bool:
    """The table of the module docstring's `invariance`; True where the batch-invariant mode held everywhere."""
    import jax.numpy as jnp
    import numpy as np

    import dsjax
    from dsjax.engine.engine import Engine
    from dsjax.engine.generate import generate
    from dsjax.engine.sampling import SamplingParams
    from dsjax.run_config import RunConfig

    model = dsjax.load_model(model_dir, dtype=getattr(jnp, dtype))
    rng = np.random.default_rng(3)
    prompts = [list(map(int, rng.integers(0, model.cfg.vocab_size, n))) for n in rng.integers(2, 300, 32)]
    params = {"greedy": SamplingParams(temperature=0.0, max_tokens=max_tokens, stop_token_ids=[], logprobs=2),
              "t0.7/p0.9": SamplingParams(temperature=0.7, top_p=0.9, seed=77, max_tokens=max_tokens,
                                          stop_token_ids=[], logprobs=2)}
    print("| mode | sampling | batch | place | same tokens | bitwise logprobs | max abs logprob diff |")
    print("|---|---|---|---:|---|---|---:|")
    held = True
    for mode in (m == "batch-invariant" for m in modes):
        engine = Engine(model, RunConfig(slots=slots, max_len=512, chunk_size=256, dtype=dtype, batch_invariant=mode))
        for name, sp in params.items():
            alone = generate(model, [prompts[0]], sp, engine=engine)[0]
            for size in (2, 7, 32):
                for at in sorted({0, size // 2, size - 1}):
                    batch = prompts[1:size]
                    batch.insert(at, prompts[0])
                    res = generate(model, batch, sp, engine=engine)[at]
                    same = res.tokens == alone.tokens
                    bitwise = same and ([(lp.logprob, lp.top) for lp in res.logprobs]
                                        == [(lp.logprob, lp.top) for lp in alone.logprobs])
                    n = min(len(res.logprobs), len(alone.logprobs))
                    diff = max((abs(a.logprob - b.logprob) for a, b in zip(res.logprobs[:n], alone.logprobs[:n])),
                               default=0.0)
                    held &= bitwise or not mode
                    print(f"| {'batch-invariant' if mode else 'default'} | {name} | {size} | {at} | "
                          f"{'yes' if same else 'no'} | {'yes' if bitwise else 'no'} | {diff:.3g} |", flush=True)
    return held


def _requests(path: str, count: int, max_tokens: int, model: str) -> None:
    words = "alpha beta gamma delta river stone light cloud paper engine garden window silver quiet orbit".split()
    with open(path, "w") as f:
        for i in range(count):
            topic = " ".join(words[(i * 7 + j * 3) % len(words)] for j in range(5 + i % 40))
            body = {"model": model, "messages": [{"role": "user", "content": f"Write about {topic}."}],
                    "max_tokens": max_tokens // 2 + i % 4 * max_tokens // 8, "temperature": 0.7, "top_p": 0.9, "thinking": {"type": "disabled"}}
            if i % 2:
                body["seed"] = i
            f.write(json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions",
                                "body": body}) + "\n")


def _lines(path: str) -> int:
    return sum(1 for _ in open(path)) if os.path.exists(path) else 0


def _records(path: str) -> dict:
    with open(path) as f:
        return {r["custom_id"]: comparable(r) for r in map(json.loads, f)}


def determinism(model_dir: str, work: str, count: int, slots: int, max_tokens: int, max_len: int = 512,
                modes: tuple[str, ...] = MODES) -> bool:
    """The table of the module docstring's `determinism`; True where the batch-invariant mode held."""
    os.makedirs(work, exist_ok=True)
    inp = os.path.join(work, "in.jsonl")
    _requests(inp, count, max_tokens, os.path.basename(os.path.normpath(model_dir)))
    print("| mode | run 2 = run 1 | killed after | resumed = run 1 | generation s (run 1) |")
    print("|---|---|---:|---|---:|")
    held = True
    for flags in ([] if m == "default" else ["--batch-invariant"] for m in modes):
        mode = "batch-invariant" if flags else "default"
        outs = [os.path.join(work, f"{mode}-{k}.jsonl") for k in range(3)]
        for p in outs:
            for q in (p, p[:-6] + ".summary.json"):
                if os.path.exists(q):
                    os.remove(q)

        def cmd(out):
            return [sys.executable, "-m", "dsjax.cli", "generate", "--model", model_dir, "--input", inp, "--output",
                    out, "--slots", str(slots), "--max-len", str(max_len), "--quiet", *flags]

        for out in outs[:2]:
            subprocess.run(cmd(out), check=True)
        proc = subprocess.Popen(cmd(outs[2]))
        while proc.poll() is None and _lines(outs[2]) < count // 4:
            time.sleep(0.02)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        killed = _lines(outs[2])
        subprocess.run(cmd(outs[2]), check=True)
        ref = _records(outs[0])
        failed = sum(r["error"] is not None for r in ref.values())
        if failed:
            raise SystemExit(f"{failed} of {count} requests failed in {outs[0]}")
        again, resumed = _records(outs[1]) == ref, _records(outs[2]) == ref
        held &= again and resumed or not flags
        seconds = json.load(open(outs[0][:-6] + ".summary.json"))["generation_seconds"]
        print(f"| {mode} | {'yes' if again else 'no'} | {killed} of {count} | {'yes' if resumed else 'no'} | "
              f"{seconds} |", flush=True)
    return held


def _modes(text: str) -> tuple[str, ...]:
    modes = tuple(dict.fromkeys(m.strip() for m in text.split(",") if m.strip()))
    wrong = [m for m in modes if m not in MODES]
    if wrong or not modes:
        raise argparse.ArgumentTypeError(f"modes must be some of {', '.join(MODES)}; got {text!r}")
    return modes


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="what", required=True)
    inv = sub.add_parser("invariance")
    inv.add_argument("--model", required=True)
    inv.add_argument("--slots", type=int, default=32)
    inv.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    inv.add_argument("--max-tokens", type=int, default=16)
    det = sub.add_parser("determinism")
    det.add_argument("--model", required=True)
    det.add_argument("--work", required=True)
    det.add_argument("--count", type=int, default=64)
    det.add_argument("--slots", type=int, default=16)
    det.add_argument("--max-tokens", type=int, default=64)
    det.add_argument("--max-len", type=int, default=512)
    for p in (inv, det):
        p.add_argument("--modes", default=",".join(MODES), type=_modes,
                       help="comma-separated modes to measure, of " + ", ".join(MODES) + " (default: both)")
    a = ap.parse_args(argv)
    if a.what == "invariance":
        ok = invariance(a.model, a.slots, a.dtype, a.max_tokens, a.modes)
    else:
        ok = determinism(a.model, a.work, a.count, a.slots, a.max_tokens, a.max_len, a.modes)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
