#!/usr/bin/env bash
# Issue 36 on one GPU: the low-precision decode kernels' native tests, each kernel against what the model
# runs now, and the model's decode with each candidate switched on (the op's constants, set for one run from
# Python, nothing edited). Rows and logs go to OUT; a short table is printed last.
#
#   bash scripts/measure_lowprec_decode.sh OUT [tests|kernels|model|v41|v41model|all]
#   bash scripts/measure_lowprec_decode.sh OUT accept v4|v41 bf16|keep bfloat16|fp8|fp4 PROMPT_LEN SLOTS...
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
# - accept:  one run of the issue's acceptance table, as committed: dsjax bench on V4-Flash (4 layers) or the V4.1
#            slice above, the given weights and cache storage, PROMPT_LEN-token prompts, 64 generated, each of
#            SLOTS in turn; rows appended to OUT/accept.jsonl. One call of the device runs one or a few of these
#            (each batch size compiles its own programs), e.g. `OUT accept v4 keep fp8 32768 1 32`.
set -uo pipefail
usage="usage: measure_lowprec_decode.sh OUT [tests|kernels|model|v41|v41model|all]
       measure_lowprec_decode.sh OUT accept v4|v41 bf16|keep bfloat16|fp8|fp4 PROMPT_LEN SLOTS..."
out=${1:?$usage}
what=${2:-all}
case "$what" in all|tests|kernels|model|v41|v41model|accept) ;; *) echo "$usage" >&2; exit 2 ;; esac
if [ "$what" = accept ]; then
  [ $# -ge 7 ] || { echo "$usage" >&2; exit 2; }
  accept_model=$3 accept_weights=$4 accept_kv=$5 accept_prompt=$6
  shift 6
  accept_slots=("$@")
  case "$accept_model" in v4|v41) ;; *) echo "accept: the model is v4 or v41, got '$accept_model'" >&2; exit 2 ;; esac
  case "$accept_weights" in bf16|keep) ;; *) echo "accept: weights are bf16 or keep, got '$accept_weights'" >&2; exit 2 ;; esac
  case "$accept_kv" in bfloat16|fp8|fp4) ;; *) echo "accept: the cache is bfloat16, fp8 or fp4, got '$accept_kv'" >&2; exit 2 ;; esac
  for n in "$accept_prompt" "${accept_slots[@]}"; do
    [[ "$n" =~ ^[1-9][0-9]*$ ]] || { echo "accept: PROMPT_LEN and SLOTS are positive integers, got '$n'" >&2; exit 2; }
  done
fi
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
model() {  # name, "python statement setting op's switches", bench arguments...: one dsjax bench run (rows into
  # $out/<name>.jsonl, or $json where set; slots and prompt length from $slots and $prompt, else 32 128 and 512)
  local name=$1 set_op=$2; shift 2
  local args; args=$(printf "'%s', " "$@" --slots ${slots:-32 128} --prompt-len "${prompt:-512}")
  run "$name" "${limit:-400}" "$py" -c "
import sys
import dsjax.kernels.expert_matmul.op as op
$set_op
from dsjax.cli import main
sys.exit(main(['bench', $args '--gen-len', '64', '--chunk-size', 'auto', '--json', '${json:-$out/$name.jsonl}']))"
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
v41_slice=(--preset v4.1-flash --layers 0,1,2,3,20,21,24,25 --engram-rows 4194304)
if [ "$what" = accept ]; then
  if [ "$accept_model" = v4 ]; then base=(--preset v4-flash --layers 4); else base=("${v41_slice[@]}"); fi
  slots="${accept_slots[*]}" prompt=$accept_prompt json=$out/accept.jsonl limit=580 \
    model "accept_${accept_model}_${accept_weights}_${accept_kv}_${accept_prompt}_$(IFS=-; echo "${accept_slots[*]}")" "" \
    "${base[@]}" --weights "$accept_weights" --kv-dtype "$accept_kv"
fi
if [ "$what" = all ] || [ "$what" = v41model ]; then
  v41=("${v41_slice[@]}" --weights keep --kv-dtype fp4)
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
for rows in sorted(out.glob("model_*.jsonl")) + sorted(out.glob("accept.jsonl")):
    for line in rows.read_text().splitlines():
        r = json.loads(line)
        print(f"{rows.stem:16s} {r['model']:10s} {r['weights']:4s} {r['kv_dtype']:8s} prompt {r['prompt_len']:>6} "
              f"batch {r['batch']:>4} {r['decode_tokens_per_s']:9.0f} tok/s "
              f"{100 * r.get('decode_of_roofline', 0):5.1f}% of roofline")
PY
