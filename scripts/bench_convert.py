"""Measure `dsjax convert` at scale on a synthetic release-format checkpoint (docs/convert.md).

    python scripts/bench_convert.py WORK [--preset v4-flash] [--layers 2] [--shard-mb 1200] [--kill-at 0.5]

1. writes WORK/src (skipped if present): a random checkpoint in DeepSeek's release format;
2. converts it under `/usr/bin/time -v`: peak RSS against the bound (largest shard + 2 GB) and MB/s;
3. converts it again, SIGKILLs the run once `--kill-at` of its arrays are journaled, checks that the
   destination does not exist, re-runs with `--verify` and checks the result equals step 2's;
4. writes it back with `--to-hf` and compares every tensor with the source (sha256, one at a time).
Prints a table and writes WORK/bench_convert.json.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from dsjax.checkpoint.safetensors_io import iter_tensors  # noqa: E402
from dsjax.checkpoint.synthetic import write_synthetic  # noqa: E402
from dsjax.config import ModelConfig  # noqa: E402
from scripts.make_synthetic_checkpoint import sized  # noqa: E402


def timed(args: list[str]) -> dict:
    """Run `python -m dsjax.cli ...` under /usr/bin/time -v; its peak RSS, wall time and summary line."""
    cmd = ["/usr/bin/time", "-v", sys.executable, "-m", "dsjax.cli", *args, "--quiet"]
    run = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if run.returncode:
        raise SystemExit(f"{' '.join(args)} failed:\n{run.stderr[-3000:]}")
    rss = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", run.stderr).group(1)) * 1024
    wall = re.search(r"Elapsed \(wall clock\) time \(h:mm:ss or m:ss\): ([\d:.]+)", run.stderr).group(1)
    seconds = sum(float(x) * 60 ** i for i, x in enumerate(reversed(wall.split(":"))))
    return {"peak_rss": rss, "wall_s": seconds, "summary": run.stdout.strip().splitlines()[-1]}


def digests(folder: str) -> dict[str, str]:
    return {name: hashlib.sha256(memoryview(value.reshape(-1).view("uint8"))).hexdigest()
            for name, _, value in iter_tensors(folder)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("work")
    ap.add_argument("--preset", default="v4-flash")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--shard-mb", type=float, default=1200)
    ap.add_argument("--kill-at", type=float, default=0.5, help="fraction of arrays saved when the run is killed")
    args = ap.parse_args()
    src, dst, killed, back = (os.path.join(args.work, x) for x in ("src", "orbax", "orbax-killed", "back"))
    for path in (dst, killed, back):
        if os.path.exists(path) or os.path.exists(path + ".partial"):
            raise SystemExit(f"{path} (or {path}.partial) exists: remove it first")
    if not os.path.exists(src):
        t = time.time()
        cfg = sized(ModelConfig.preset(args.preset), args.layers, None)
        write_synthetic(src, cfg, max_shard_bytes=int(args.shard_mb * 1e6))
        print(f"wrote {src} in {time.time() - t:.1f} s")
    shards = [os.path.join(src, f) for f in os.listdir(src) if f.endswith(".safetensors")]
    total, largest = sum(map(os.path.getsize, shards)), max(map(os.path.getsize, shards))
    bound = largest + 2e9

    plain = timed(["convert", src, dst])

    proc = subprocess.Popen([sys.executable, "-m", "dsjax.cli", "convert", src, killed, "--quiet"], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    with open(os.path.join(dst, "dsjax_checkpoint.json")) as f:
        n_arrays = len(json.load(f)["pieces"])
    journal = os.path.join(killed + ".partial", "journal.jsonl")
    while proc.poll() is None:
        if os.path.exists(journal) and sum(1 for _ in open(journal)) >= args.kill_at * n_arrays:
            proc.send_signal(signal.SIGKILL)
            break
        time.sleep(0.05)
    proc.wait()
    if proc.returncode != -signal.SIGKILL:
        raise SystemExit(f"the conversion ended (rc {proc.returncode}) before it could be killed")
    journaled = sum(1 for _ in open(journal))
    half_written = os.path.exists(killed)
    resumed = timed(["convert", src, killed, "--verify"])
    with open(os.path.join(dst, "dsjax_checkpoint.json")) as f:
        a = json.load(f)["pieces"]
    with open(os.path.join(killed, "dsjax_checkpoint.json")) as f:
        b = json.load(f)["pieces"]

    hf = timed(["convert", dst, back, "--to-hf", "--shard-mb", str(args.shard_mb)])
    same = digests(src) == digests(back)

    rows = [("source", f"{total / 1e9:.2f} GB in {len(shards)} shards, largest {largest / 1e9:.2f} GB"),
            ("convert", f"{plain['wall_s']:.1f} s, {total / 1e6 / plain['wall_s']:.0f} MB/s end to end, "
                        f"peak RSS {plain['peak_rss'] / 1e9:.2f} GB (bound {bound / 1e9:.2f} GB: "
                        f"{'ok' if plain['peak_rss'] < bound else 'EXCEEDED'})"),
            ("killed", f"SIGKILL with {journaled}/{n_arrays} arrays saved; destination "
                       f"{'EXISTED' if half_written else 'absent'}"),
            ("resumed + verify", f"{resumed['wall_s']:.1f} s, peak RSS {resumed['peak_rss'] / 1e9:.2f} GB; arrays "
                                 f"{'identical to' if a == b else 'DIFFERENT from'} the uninterrupted run"),
            ("--to-hf", f"{hf['wall_s']:.1f} s, peak RSS {hf['peak_rss'] / 1e9:.2f} GB; tensors "
                        f"{'byte-identical to' if same else 'DIFFERENT from'} the source")]
    result = {"total_bytes": total, "largest_shard": largest, "convert": plain, "killed_at": journaled,
              "arrays": n_arrays, "resumed": resumed, "to_hf": hf, "identical_after_resume": a == b,
              "round_trip_identical": same, "dst_existed_after_kill": half_written}
    with open(os.path.join(args.work, "bench_convert.json"), "w") as f:
        json.dump(result, f, indent=1)
    width = max(len(r[0]) for r in rows)
    for name, text in rows:
        print(f"{name:<{width}}  {text}")
    ok = plain["peak_rss"] < bound and a == b and same and not half_written
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
