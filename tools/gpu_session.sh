#!/usr/bin/env bash
# One call on the H200 for what issues 6, 7 and 9 measure, most important first, each step
# bounded so that a failure costs its own time only. Usage on the device machine:
#   bash tools/gpu_session.sh            (writes logs and JSON under $OUT)
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=.
OUT=${OUT:-/tmp/nanoqwen-out}
mkdir -p "$OUT"
MODEL_7B=/tmp/qwen2.5-coder-7b-random.nanoqwen
PYTEST="python3 -m pytest -q -rs -p no:cacheprovider --noconftest -o addopts="
status=()
step() {  # step NAME SECONDS COMMAND...
  local name=$1 seconds=$2; shift 2
  local start=$SECONDS
  echo "=== $name" | tee -a "$OUT/session.log"
  timeout "$seconds" "$@" 2>&1 | tee -a "$OUT/session.log"
  local rc=${PIPESTATUS[0]}
  status+=("$(printf '%-28s rc=%-3s %4ss' "$name" "$rc" $((SECONDS - start)))")
}
step "graph tests (nano-coder)" 75 $PYTEST tests/test_cuda_graph.py
step "random 7B file" 60 python3 -m nanoqwen.random_model "$MODEL_7B" --preset qwen2.5-coder-7b
step "bench 7B" 150 python3 -m nanoqwen bench "$MODEL_7B" --json "$OUT/bench-7b.json" --baseline
step "int8 vs fp16 bench" 70 python3 tools/bench_int8_vs_fp16.py --json "$OUT/int8_vs_fp16.json"
step "int8 tests" 45 $PYTEST tests/test_int8_path.py
step "7B vs transformers" 170 python3 tools/check_vs_transformers.py --model "$MODEL_7B" --steps 32 --json "$OUT/check_7b.json"
echo "=== summary"
printf '%s\n' "${status[@]}"
