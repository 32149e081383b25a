"""Where XLA spends a program's compile time: compile the engine's decode step and one prefill chunk, one
at a time under jax's profiler, and add up XLA's own trace events (HLO passes, code generation, ptxas) by
name. For the embedded demo model by default, or a checkpoint folder.

    python scripts/compile_passes.py [--model FOLDER] [--slots 8] [--max-len 384] [--chunk 128]
                                     [--dtype float32] [--top 30] [--json OUT.json] [--hlo DIR]

`--hlo DIR` also writes each program's optimized HLO there. With `--dtype float32` on a GPU, the engine's
float32 XLA flags (`dsjax.compile_cache.FLOAT32_GPU_FLAGS`) apply, as in `dsjax generate --demo`.
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import sys
import tempfile
import time


def xla_events(trace_dir: str) -> tuple[collections.Counter, collections.Counter]:
    """Total seconds and count of each host event in the profile under `trace_dir`, Python frames
    (jax's `$file:line name` events) left out."""
    from jax.profiler import ProfileData

    seconds: collections.Counter = collections.Counter()
    count: collections.Counter = collections.Counter()
    for path in glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True):
        for plane in ProfileData.from_file(path).planes:
            if not plane.name.startswith("/host"):
                continue
            for line in plane.lines:
                for ev in line.events:
                    if not ev.name.startswith("$"):
                        seconds[ev.name] += ev.duration_ns / 1e9
                        count[ev.name] += 1
    return seconds, count


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="checkpoint folder (default: the embedded demo model)")
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--max-len", type=int, default=384)
    ap.add_argument("--chunk", type=int, default=128)
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--json", default=None)
    ap.add_argument("--hlo", default=None)
    args = ap.parse_args()

    from dsjax.compile_cache import use_float32_gpu_flags

    if args.dtype == "float32":
        use_float32_gpu_flags()
    import jax
    import jax.numpy as jnp
    import numpy as np

    import dsjax
    from dsjax.embedded import MODEL_DIR

    t0 = time.perf_counter()
    model = dsjax.load_model(args.model or MODEL_DIR, dtype=getattr(jnp, args.dtype))
    engine = dsjax.Engine(model, dsjax.RunConfig(slots=args.slots, max_len=args.max_len, chunk_size=args.chunk))
    cache = engine.new_cache()
    print(f"loaded in {time.perf_counter() - t0:.1f} s on {jax.devices()[0].device_kind}; "
          f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}", flush=True)
    n = args.slots
    programs = {
        "decode": lambda: engine.lower_decode(cache, np.zeros(n, np.int32), np.zeros(n, bool)),
        f"prefill_{n}": lambda: engine.lower_prefill(cache, n),
    }
    report = {}
    for name, lower in programs.items():
        t = time.perf_counter()
        lowered = lower()
        t_lower = time.perf_counter() - t
        with tempfile.TemporaryDirectory() as d:
            t = time.perf_counter()
            with jax.profiler.trace(d):
                compiled = lowered.compile()
            t_compile = time.perf_counter() - t
            seconds, count = xla_events(d)
        if args.hlo:
            os.makedirs(args.hlo, exist_ok=True)
            with open(os.path.join(args.hlo, f"{name}.hlo.txt"), "w") as f:
                f.write(compiled.as_text())
        report[name] = {"lower_seconds": t_lower, "compile_seconds": t_compile,
                        "events": {k: [round(v, 4), count[k]] for k, v in seconds.most_common(200)}}
        print(f"\n{name}: lowered in {t_lower:.1f} s, compiled in {t_compile:.1f} s; XLA events by total time:")
        for k, v in seconds.most_common(args.top):
            print(f"  {v:9.3f} s {count[k]:6d} × {k[:110]}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
