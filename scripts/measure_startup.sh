#!/usr/bin/env bash
# Start-up of `dsjax generate`, cold (an empty compile cache) and warm (the same command again), for the
# demo and for 512 requests on a synthetic 4-layer V4-Flash FP8/FP4 checkpoint; then `dsjax bench --model`
# on that checkpoint. Each run's summary JSON and log go to OUT (default: a temporary folder); the compile
# cache is a fresh folder outside it (so that OUT stays a few files), removed at the end.
#
#   bash scripts/measure_startup.sh [OUT] [BENCH_SECONDS] [all|demo|job]
#
# `demo` runs only the demo's two runs; `job` only the checkpoint's two runs and the benchmark.
set -uo pipefail
out=${1:-$(mktemp -d)}
bench_s=${2:-120}
what=${3:-all}
case "$what" in all|demo|job) ;; *) echo "usage: measure_startup.sh [OUT] [BENCH_SECONDS] [all|demo|job]" >&2; exit 2 ;; esac
mkdir -p "$out"
export DSJAX_CACHE_DIR=$(mktemp -d)
trap 'rm -rf "$DSJAX_CACHE_DIR"' EXIT
py=${PYTHON:-python3}
dsjax() { "$py" -m dsjax.cli "$@"; }
timed() {  # name, command...: wall seconds into $out/<name>.wall, output into $out/<name>.log
  local name=$1; shift
  local t0; t0=$(date +%s.%N)
  "$@" > "$out/$name.log" 2>&1
  echo "rc $?" >> "$out/$name.log"
  awk "BEGIN{print $(date +%s.%N) - $t0}" > "$out/$name.wall"
}
if [ "$what" != job ]; then
  timed demo_cold dsjax generate --demo --output "$out/demo_cold.jsonl"
  timed demo_warm dsjax generate --demo --output "$out/demo_warm.jsonl"
fi
if [ "$what" != demo ]; then
  "$py" scripts/make_synthetic_checkpoint.py /tmp/v4f4 --preset v4-flash --layers 4 > "$out/checkpoint.log" 2>&1
  "$py" scripts/make_requests.py /tmp/req.jsonl --count 512 >> "$out/checkpoint.log" 2>&1
  for run in cold warm; do
    timed "job_$run" dsjax generate --model /tmp/v4f4 --input /tmp/req.jsonl --output "$out/job_$run.jsonl" \
      --slots 64 --max-len 1024
  done
  timeout "$bench_s" "$py" -m dsjax.cli bench --model /tmp/v4f4 --weights keep --slots 64 --prompt-len 256 \
    --gen-len 64 --no-breakdown --json "$out/bench.jsonl" > "$out/bench.log" 2>&1
  echo "bench rc $?" >> "$out/bench.log"
fi
# One row per run: from its summary, and the warning lines its output holds (absl's, XLA's C++ ones).
"$py" - "$out" <<'PY'
import json, os, re, sys
out = sys.argv[1]
print(f"{'run':<10} {'wall':>6} {'load':>5} {'precomp':>7} {'1st after load':>14} {'loaded':>6} "
      f"{'jax cache':>9} {'bg':>3} {'gen tok/s':>9} {'warnings':>8}")
for name in ("demo_cold", "demo_warm", "job_cold", "job_warm"):
    path = os.path.join(out, name + ".summary.json")
    if not os.path.exists(path):
        continue
    s = json.load(open(path))
    wall = float(open(os.path.join(out, name + ".wall")).read())
    log = open(os.path.join(out, name + ".log"), errors="replace").read()
    warnings = len(re.findall(r"^(WARNING:|W\d{4} )", log, re.M))
    print(f"{name:<10} {wall:6.1f} {s['load_seconds']:5.1f} {s['precompile_seconds']:7.1f} "
          f"{s['first_result_after_load_seconds'] or 0:14.1f} {s.get('programs_loaded', 0):6d} "
          f"{s['programs_from_cache']:4d}/{s['programs_compiled']:<4d} {s.get('programs_compiled_in_background', 0):3d} "
          f"{s['generated_tokens_per_second']:9.0f} {warnings:8d}")
PY
[ -f "$out/bench.log" ] && grep -v "^WARNING" "$out/bench.log" | tail -3
