"""Where a `dsjax` command's start-up goes: run it in this process and record every program jax traces,
lowers, compiles (or loads from the persistent cache), by function name, and every warning logged.

    python scripts/startup_profile.py OUT.json [--ragged-dot xla] -- generate --demo --quiet

`--ragged-dot xla` makes float-expert grouped matmuls take XLA's ragged_dot instead of tokamax's
default kernel choice (to measure what that kernel costs to compile). Prints the slowest functions.
"""

from __future__ import annotations

import argparse
import collections
import json
import logging
import sys
import time

PHASES = {"/jax/core/compile/jaxpr_trace_duration": "trace",
          "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower",
          "/jax/core/compile/backend_compile_duration": "compile"}


def main() -> int:
    argv = sys.argv[1:]
    rest = argv[argv.index("--") + 1:] if "--" in argv else []
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--ragged-dot", choices=("default", "xla"), default="default")
    args = ap.parse_args(argv[:argv.index("--")] if "--" in argv else argv)

    import jax

    by_fun: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    events: collections.Counter = collections.Counter()

    def span(event, start, end, **kw):
        if event in PHASES:
            c = by_fun[kw.get("fun_name", "?")]
            c[PHASES[event]] += end - start
            c[PHASES[event] + "_n"] += 1

    jax.monitoring.register_event_time_span_listener(span)
    jax.monitoring.register_event_listener(lambda event, **kw: events.update([event]))

    warnings: collections.Counter = collections.Counter()

    class Count(logging.Handler):
        def emit(self, record):
            if record.levelno >= logging.WARNING:
                warnings[f"{record.name}: {record.getMessage()[:90]}"] += 1

    logging.getLogger().addHandler(Count())

    if args.ragged_dot == "xla":
        import tokamax

        original = tokamax.ragged_dot

        def xla_ragged_dot(*a, **k):
            k.setdefault("implementation", "xla")
            return original(*a, **k)

        tokamax.ragged_dot = xla_ragged_dot

    from dsjax import cli

    t0 = time.perf_counter()
    rc = cli.main(rest)
    wall = time.perf_counter() - t0
    rows = sorted(by_fun.items(), key=lambda kv: -(kv[1]["trace"] + kv[1]["lower"] + kv[1]["compile"]))
    report = {"argv": rest, "ragged_dot": args.ragged_dot, "rc": rc, "wall_seconds": wall,
              "events": dict(events), "warnings": dict(warnings),
              "functions": {k: dict(v) for k, v in rows}}
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    total = {p: sum(c[p] for c in by_fun.values()) for p in ("trace", "lower", "compile")}
    print(f"\n{' '.join(rest)} (ragged_dot {args.ragged_dot}): wall {wall:.1f} s; trace {total['trace']:.1f} s, "
          f"lower {total['lower']:.1f} s, compile {total['compile']:.1f} s over "
          f"{sum(c['compile_n'] for c in by_fun.values())} programs; "
          f"{sum(warnings.values())} warnings; cache hits {events.get('/jax/compilation_cache/cache_hits', 0)}")
    print(f"{'function':<40} {'n':>4} {'trace':>7} {'lower':>7} {'compile':>8}")
    for name, c in rows[:20]:
        print(f"{name[:40]:<40} {c['compile_n']:>4} {c['trace']:>7.2f} {c['lower']:>7.2f} {c['compile']:>8.2f}")
    for w, n in warnings.most_common(4):
        print(f"  {n} × {w}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
