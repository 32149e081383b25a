#!/usr/bin/env bash
# Issue 36 on one GPU: the low-precision decode kernels' native tests, each kernel against what the model
# runs now, and the model's decode with each candidate switched on (the op's constants, set for one run from
# Python, nothing edited). Rows and logs go to OUT; a short table is printed last.
#
#   bash scripts/measure_lowprec_decode.sh OUT [tests|kernels|model|all]
#
# - tests:   the native kernel tests (`-k native`) of the expert kernel and dense_fp8_matmul.
# - kernels: bench_kernels.py fp4-experts (rows copied or aligned, checkpoint or repacked codes), fp8-experts
#            (Mosaic against Triton), dense-fp8 (the kernel against XLA's dequantize-then-GEMM).
# - model:   dsjax bench, V4-Flash width, 4 layers, release storage, batch 32 and 128, 512-token prompts:
#            as committed, then with op.DENSE_MAX_ROWS = 256, then with op.ROW_SOURCE = "aligned".
set -uo pipefail
out=${1:?usage: measure_lowprec_decode.sh OUT [tests|kernels|model|all]}
what=${2:-all}
case "$what" in all|tests|kernels|model) ;; *) echo "usage: measure_lowprec_decode.sh OUT [tests|kernels|model|all]" >&2; exit 2 ;; esac
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
if [ "$what" = all ] || [ "$what" = model ]; then
  for variant in committed dense256 aligned; do
    case $variant in
      committed) set_op="" ;;
      dense256) set_op="op.DENSE_MAX_ROWS = 256" ;;
      aligned) set_op="op.ROW_SOURCE = 'aligned'" ;;
    esac
    run "model_$variant" 400 "$py" -c "
import sys
import dsjax.kernels.expert_matmul.op as op
$set_op
from dsjax.cli import main
sys.exit(main(['bench', '--preset', 'v4-flash', '--layers', '4', '--weights', 'keep', '--slots', '32', '128',
               '--prompt-len', '512', '--gen-len', '64', '--chunk-size', 'auto', '--json', '$out/model_$variant.jsonl']))"
  done
fi
"$py" - "$out" <<'PY'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
for log in sorted(out.glob("*.log")):
    print(f"{log.stem:16s} {log.read_text().strip().splitlines()[-1]}")
if (out / "kernels.jsonl").exists():
    for line in (out / "kernels.jsonl").read_text().splitlines():
        r = json.loads(line)
        what = r.get("matmul") or r.get("linear")
        how = " ".join(str(r[k]) for k in ("impl", "row_source", "code_layout") if k in r)
        print(f"{r['op']:12s} {what:12s} {r.get('tokens', r.get('rows')):>4} {how:38s} {r['kernel_ms']:8.3f} ms "
              f"{100 * r['of_copy']:5.1f}% max_diff {r['max_diff']:.3g}")
for rows in sorted(out.glob("model_*.jsonl")):
    for line in rows.read_text().splitlines():
        r = json.loads(line)
        print(f"{rows.stem:16s} batch {r['batch']:>4} {r['decode_tokens_per_s']:9.0f} tok/s "
              f"{100 * r.get('decode_of_roofline', 0):5.1f}% of roofline")
PY
