#!/usr/bin/env bash
# Issue 36 on one GPU: the low-precision decode kernels' native tests, each kernel against what the model
# runs now, and the model's decode with each candidate switched on (the op's constants, set for one run from
# Python, nothing edited). Rows and logs go to OUT; a short table is printed last.
#
#   bash scripts/measure_lowprec_decode.sh OUT [tests|kernels|model|v41|v41model|all]
#
# - tests:   the native kernel tests (`-k native`) of the expert kernel and dense_fp8_matmul.
# - kernels: bench_kernels.py fp4-experts (rows copied or aligned, checkpoint or repacked codes), fp8-experts
#            (Mosaic against Triton), dense-fp8 (the kernel against XLA's dequantize-then-GEMM).
# - model:   dsjax bench, V4-Flash width, 4 layers, release storage, batch 32 and 128, 512-token prompts:
#            as committed, then with the dense FP8 kernel off (op.DENSE_MAX_ROWS = 0: its effect on the model).
# - v41:     V4.1-Flash's kernels in its released storage: dense-fp8 at its widths (32 × 32 FP8 blocks), decode
#            attention and the indexer at batch 64 × 128K over bf16 rows and the release's cache records.
# - v41model: dsjax bench on the 8-layer V4.1 slice of docs/benchmarks.md with --kv-dtype fp4, as committed and
#            with the dense FP8 kernel off.
set -uo pipefail
usage="usage: measure_lowprec_decode.sh OUT [tests|kernels|model|v41|v41model|all]"
out=${1:?$usage}
what=${2:-all}
case "$what" in all|tests|kernels|model|v41|v41model) ;; *) echo "$usage" >&2; exit 2 ;; esac
mkdir -p "$out"
py=${PYTHON:-python3}
run() {  # name, seconds, command...: output into $out/<name>.log, exit status appended
  local name=$1 limit=$2; shift 2
  timeout "$limit" "$@" > "$out/$name.log" 2>&1
  echo "rc $?" >> "$out/$name.log"
}
if [ "$what" = all ] || [ "$what" = tests ]; then
  run native_tests 420 "$py" -m pytest -q -p no:cacheprovider tests/kernels/test_expert_matmul_mosaic_gpu.py \
    tests/kernels/test_expert_matmul_op.py -k native
fi
if [ "$what" = all ] || [ "$what" = kernels ]; then
  run fp4_experts 300 "$py" scripts/bench_kernels.py fp4-experts --preset v4-flash --tokens 32 128 256 --block-m 16 \
    --rows copied aligned --code-layout checkpoint repacked --no-reference --json "$out/kernels.jsonl"
  run fp8_experts 200 "$py" scripts/bench_kernels.py fp8-experts --preset v4-flash --tokens 32 128 --block-m 16 \
    --rows copied aligned --triton --no-reference --json "$out/kernels.jsonl"
  run dense_fp8 200 "$py" scripts/bench_kernels.py dense-fp8 --preset v4-flash --tokens 1 32 128 256 \
    --json "$out/kernels.jsonl"
fi
model() {  # name, "python statement setting op's switches", bench arguments...: one dsjax bench run
  local name=$1 set_op=$2; shift 2
  local args; args=$(printf "'%s', " "$@")
  run "$name" 400 "$py" -c "
import sys
import dsjax.kernels.expert_matmul.op as op
$set_op
from dsjax.cli import main
sys.exit(main(['bench', $args '--slots', '32', '128', '--prompt-len', '512', '--gen-len', '64',
               '--chunk-size', 'auto', '--json', '$out/$name.jsonl']))"
}
if [ "$what" = all ] || [ "$what" = model ]; then
  v4=(--preset v4-flash --layers 4 --weights keep)
  model model_committed "" "${v4[@]}"
  model model_dense_off "op.DENSE_MAX_ROWS = 0" "${v4[@]}"
fi
if [ "$what" = all ] || [ "$what" = v41 ]; then
  run dense_fp8_v41 200 "$py" scripts/bench_kernels.py dense-fp8 --preset v4.1-flash --tokens 1 32 128 256 \
    --json "$out/kernels.jsonl"
  run attention_v41 150 "$py" scripts/bench_kernels.py attention --preset v4.1-flash --kv-dtype bfloat16 fp8 fp4 \
    --layer csa --batch 64 --context 131072 --json "$out/kernels.jsonl"
  run indexer_v41 150 "$py" scripts/bench_kernels.py indexer --preset v4.1-flash --kv-dtype bfloat16 fp4 \
    --batch 64 --context 131072 --json "$out/kernels.jsonl"
fi
if [ "$what" = all ] || [ "$what" = v41model ]; then
  v41=(--preset v4.1-flash --layers 0,1,2,3,20,21,24,25 --engram-rows 4194304 --weights keep --kv-dtype fp4)
  model model_v41_committed "" "${v41[@]}"
  model model_v41_dense_off "op.DENSE_MAX_ROWS = 0" "${v41[@]}"
fi
"$py" - "$out" <<'PY'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
for log in sorted(out.glob("*.log")):
    print(f"{log.stem:16s} {log.read_text().strip().splitlines()[-1]}")
if (out / "kernels.jsonl").exists():
    for line in (out / "kernels.jsonl").read_text().splitlines():
        r = json.loads(line)
        what = r.get("matmul") or r.get("linear") or r.get("kv")
        how = " ".join(str(r[k]) for k in ("impl", "block", "row_source", "code_layout") if k in r)
        ms = r["kernel_ms"] if "kernel_ms" in r else r["kernel_us"] / 1e3
        size = r.get("tokens", r.get("rows", r.get("batch")))
        diff = r.get("max_diff", r.get("rel_err", float("nan")))
        print(f"{r['op']:12s} {what:12s} {size:>4} {how:38s} {ms:8.3f} ms {100 * r['of_copy']:5.1f}% diff {diff:.3g}")
for rows in sorted(out.glob("model_*.jsonl")):
    for line in rows.read_text().splitlines():
        r = json.loads(line)
        print(f"{rows.stem:16s} batch {r['batch']:>4} {r['decode_tokens_per_s']:9.0f} tok/s "
              f"{100 * r.get('decode_of_roofline', 0):5.1f}% of roofline")
PY
