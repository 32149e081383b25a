"""Train the embedded default model (or the small V4.1 and its DSpark drafter) and write it in DeepSeek's format.

    python scripts/train_tiny.py --out dsjax/embedded/model
    python scripts/train_tiny.py --preset demo-v4.1 --drafter-steps 1500 --out dsjax/embedded/model_v41

Steps: derive the tokenizer from DeepSeek-V4's (`dsjax.training.tokenizer`), render the Python
standard library as chat conversations (`dsjax.training.corpus`), train the preset from the
seed (`dsjax.training.train`), for a V4.1 preset then train its DSpark stages against the frozen target
(`dsjax.training.dspark`), store the weights in bf16 under the release's names, reload them from
disk and measure the held-out loss twice: with the training code (no cache) and through the
inference path (prefill + cached decode), and the drafter's held-out figures. Writes `tokenizer.json`,
`config.json`, the safetensors, `heldout.npy`, `train_log.jsonl` and `metrics.json` into `--out`.

`--no-measure` skips the held-out figures and `--measure FOLDER` adds them later, on another machine: a GPU
run then spends no time compiling the measurement, and a CPU's fp32 figures are exact.

    python scripts/train_tiny.py --preset demo-v4.1 --out m --time-budget 440 --no-measure   # on the GPU
    python scripts/train_tiny.py --measure m                                                # on a CPU
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import subprocess
import sys
import time

import numpy as np


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip() or "unknown"
    except OSError:
        return "unknown"


def heldout_figures(folder: str, drafter: bool) -> dict:
    """The held-out figures of the model in `folder` (its own `heldout.npy`): its bf16 weights read back in fp32,
    the loss through the training code and through the inference path, and with `drafter` the drafter's."""
    import dsjax
    from dsjax.engine.scoring import teacher_forced_logprobs
    from dsjax.training.dspark import evaluate_drafter
    from dsjax.training.loss import evaluate, unigram_entropy

    heldout = np.load(os.path.join(folder, "heldout.npy"))
    shipped = dsjax.load_model(folder)  # what users get: bf16 weights read back in fp32
    prefill = heldout.shape[1] // 4
    return {
        "heldout_ce_training_code": round(evaluate(shipped, heldout), 5),
        "heldout_ce_inference_path": round(
            float(-teacher_forced_logprobs(shipped, heldout, prefill).astype(np.float64).mean()), 5),
        "heldout_unigram_entropy": round(unigram_entropy(heldout, shipped.cfg.vocab_size), 5),
        "heldout_rows": list(heldout.shape), "inference_path_prefill_tokens": prefill,
        **(evaluate_drafter(shipped, heldout) if drafter else {}),
    }


def measure(folder: str, command: str) -> int:
    """Add the held-out figures to a `--no-measure` run's `metrics.json` (and its log), measured here."""
    import jax

    path = os.path.join(folder, "metrics.json")
    try:
        with open(path) as f:
            metrics = json.load(f)
    except (OSError, ValueError) as e:
        raise SystemExit(f"--measure {folder}: no readable metrics.json of a train_tiny.py run there ({e})")
    if not os.path.exists(os.path.join(folder, "heldout.npy")):
        raise SystemExit(f"--measure {folder}: no heldout.npy there")
    figures = heldout_figures(folder, drafter=metrics.get("drafter_seconds") is not None)
    metrics.update(figures, measured_device=str(jax.devices()[0].device_kind), measured_commit=_commit(),
                   measure_command=command)
    with open(os.path.join(folder, "train_log.jsonl"), "a") as f:
        f.write(json.dumps({"final": metrics}) + "\n")
    print(json.dumps({"final": metrics}), flush=True)
    with open(path, "w") as f:
        json.dump(metrics, f, indent=1)
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help="folder to write the model into")
    ap.add_argument("--no-measure", action="store_true",
                    help="skip the held-out figures (add them later with --measure)")
    ap.add_argument("--measure", metavar="FOLDER",
                    help="only measure the held-out figures of a --no-measure run's folder, on this machine")
    ap.add_argument("--preset", default="demo")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=4000)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--learning-rate", type=float, default=3e-3)
    ap.add_argument("--eval-every", type=int, default=500)
    ap.add_argument("--time-budget", type=float, metavar="SECONDS",
                    help="end the target's training when this many seconds (compilation and evaluations included) "
                    "run out, its learning-rate schedule fitted to the steps that fit; --steps is then the most")
    ap.add_argument("--drafter-time-budget", type=float, metavar="SECONDS", help="the same for the drafter's training")
    ap.add_argument("--kernels", default="auto", choices=("auto", "reference", "interpret"),
                    help="how training's forward runs its kernel-backed operations (auto: the platform's kernels)")
    ap.add_argument("--corpus", help="an .npz written by an earlier run's --save-corpus (skips rendering)")
    ap.add_argument("--save-corpus", help="also write the rendered corpus to this .npz")
    ap.add_argument("--stdlib", help="Python standard library folder (default: this interpreter's)")
    ap.add_argument("--max-shard-mb", type=float, default=12.0, help="safetensors shard size limit")
    ap.add_argument("--corpus-only", action="store_true", help="stop after writing the tokenizer and corpus")
    ap.add_argument("--drafter-steps", type=int, default=0,
                    help="a V4.1 preset: then train the DSpark stages this many steps against the frozen target")
    ap.add_argument("--drafter-learning-rate", type=float, default=1e-3)
    ap.add_argument("--anchors", type=int, default=32, help="draft blocks per training row")
    ap.add_argument("--target", help="a V4.1 model folder this script wrote: train only its DSpark stages "
                                     "(with --drafter-steps), the rest of it frozen as it is")
    args = ap.parse_args(argv)
    command = "python scripts/train_tiny.py " + " ".join(argv if argv is not None else sys.argv[1:])
    if args.measure:
        if args.out or args.no_measure:
            ap.error("--measure measures an existing folder: give neither --out nor --no-measure")
        return measure(args.measure, command)
    if not args.out:
        ap.error("--out is required (the folder to write the model into)")

    import jax
    import jax.numpy as jnp

    import dsjax
    from dsjax.checkpoint.save import save_model
    from dsjax.checkpoint.save_v41 import save_v41
    from dsjax.config import ModelConfig
    from dsjax.config_v41 import V41Config, is_v41
    from dsjax.engram_hash import tokenizer_token_map
    from dsjax.presets import PRESETS
    from dsjax.training.corpus import build_corpus
    from dsjax.training.dspark import DraftLossWeights, train_drafter
    from dsjax.training.tokenizer import write_tokenizer
    from dsjax.training.train import TrainConfig, cast_like, train

    out = args.out
    v41 = is_v41(PRESETS.get(args.preset, {}))
    cfg = V41Config.preset(args.preset) if v41 else ModelConfig.preset(args.preset)
    if args.drafter_steps and not (v41 and cfg.num_nextn_predict_layers):
        ap.error(f"--drafter-steps: preset {args.preset!r} has no DSpark stages to train")
    if args.target and not args.drafter_steps:
        ap.error("--target trains only the drafter: give --drafter-steps too")
    if args.target and args.time_budget is not None:
        ap.error("--time-budget times the target's training, which --target skips: give --drafter-time-budget")
    for flag, seconds in (("--time-budget", args.time_budget), ("--drafter-time-budget", args.drafter_time_budget)):
        if seconds is not None and not seconds > 0:
            ap.error(f"{flag} must be a positive number of seconds, got {seconds}")
    os.makedirs(out, exist_ok=True)
    tok_path = os.path.join(out, "tokenizer.json")
    write_tokenizer(tok_path, cfg.vocab_size)
    token_map = None
    if v41 and cfg.engram_layer_ids:
        with open(tok_path) as f:
            token_map = tokenizer_token_map(json.load(f))[0]
    log_path = os.path.join(out, "train_log.jsonl")
    log_file = open(log_path, "a" if args.target and os.path.samefile(args.target, out) else "w")

    last_step: dict = {}

    def log(entry: dict) -> None:
        if "step" in entry:
            last_step.update(entry)
        print(json.dumps(entry), flush=True)
        log_file.write(json.dumps(entry) + "\n")
        log_file.flush()

    t0 = time.perf_counter()
    if args.corpus:
        data = np.load(args.corpus)
        train_rows, heldout = data["train"], data["heldout"]
        stats = json.loads(str(data["stats"]))
    else:
        corpus = build_corpus(tok_path, args.seq_len, args.seed, root=args.stdlib)
        train_rows, heldout, stats = corpus.train, corpus.heldout, corpus.stats
        stats["python"] = platform.python_version()
    if args.save_corpus:
        np.savez(args.save_corpus, train=train_rows, heldout=heldout, stats=json.dumps(stats))
    log({"corpus": stats, "seconds": round(time.perf_counter() - t0, 1)})
    np.save(os.path.join(out, "heldout.npy"), heldout)
    if args.corpus_only:
        return 0

    tc = TrainConfig(steps=args.steps, batch_size=args.batch_size, learning_rate=args.learning_rate,
                     seed=args.seed, eval_every=args.eval_every, kernels=args.kernels, time_budget=args.time_budget)
    log({"preset": args.preset, "devices": str(jax.devices()),
         **({} if args.target else {"train_config": dataclasses.asdict(tc)})})
    t_train = time.perf_counter()
    target_metrics = {}
    if args.target:
        model = dsjax.load_model(args.target)  # its weights as shipped (bf16), its stages included
        if model.cfg != cfg:
            ap.error(f"--target {args.target}: its config is not preset {args.preset!r}'s")
        with open(os.path.join(args.target, "metrics.json")) as f:
            target_metrics = json.load(f)
        log({"target": args.target, "metrics": target_metrics})
        train_seconds, train_tokens = target_metrics["train_seconds"], target_metrics["train_tokens"]
    else:
        model = train(cfg, tc, train_rows, heldout, log, token_map=token_map)
        train_seconds, train_tokens = time.perf_counter() - t_train, last_step["tokens"]
    drafter_seconds = None
    if args.drafter_steps:
        dc = dataclasses.replace(tc, steps=args.drafter_steps, learning_rate=args.drafter_learning_rate,
                                 time_budget=args.drafter_time_budget)
        weights = DraftLossWeights(anchors=args.anchors)
        log({"drafter_config": dataclasses.asdict(dc), "loss_weights": dataclasses.asdict(weights)})
        t_draft = time.perf_counter()
        model = train_drafter(model, dc, train_rows, heldout, weights, log)
        drafter_seconds = round(time.perf_counter() - t_draft, 1)

    shard_bytes = int(args.max_shard_mb * 2**20)
    if v41:
        save_v41(cast_like(model, jnp.bfloat16), out, max_shard_bytes=shard_bytes)
    else:
        save_model(cast_like(model, jnp.bfloat16), out, max_shard_bytes=shard_bytes, naming="original")
    metrics = {
        **({} if args.no_measure else heldout_figures(out, drafter=bool(args.drafter_steps))),
        "train_seconds": round(train_seconds, 1), "train_tokens": train_tokens,
        "device": str(jax.devices()[0].device_kind), "commit": _commit(),
        **({"drafter_seconds": drafter_seconds} if args.drafter_steps else {}),
        "command": command,
        **({"target_command": target_metrics["command"], "target_commit": target_metrics["commit"],
            "target_device": target_metrics["device"]} if target_metrics else {}),
    }
    log({"final": metrics})
    with open(os.path.join(out, "metrics.json"), "w") as f:
        json.dump(metrics, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
