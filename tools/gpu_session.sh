#!/usr/bin/env bash
# One call on the H200 for what the GPU chapters and issues measure, each step bounded so
# that a failure costs its own time only. Logs and JSON go under $OUT.
#   bash tools/gpu_session.sh checks   GPU tests, 7B bench (+ transformers baseline, and again with
#                                      prefill dequantizing per prompt),
#                                      INT8 vs FP16 bench and tests, 7B vs transformers
#   bash tools/gpu_session.sh book     graph tests, 7B bench for both activation paths,
#                                      then every chapter under nbval (carry .whl: see book/running.md)
#   bash tools/gpu_session.sh ab DIR   the 7B bench of this tree and of the tree in DIR (another commit,
#                                      e.g. `git archive COMMIT | tar -x -C DIR`, carried), alternating,
#                                      two runs each, then the GPU tests of this tree
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD  # absolute: chapters run in chapters/
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

case "${1:-checks}" in
  checks)
    step "GPU tests" 240 $PYTEST tests/test_cuda_graph.py tests/test_pdl.py tests/test_kernels_cuda.py tests/test_attention_cuda.py
    step "random 7B file" 60 python3 -m nanoqwen.random_model "$MODEL_7B" --preset qwen2.5-coder-7b
    step "bench 7B" 150 python3 -m nanoqwen bench "$MODEL_7B" --json "$OUT/bench-7b.json" --baseline
    step "bench 7B, prefill expanding" 60 python3 -m nanoqwen bench "$MODEL_7B" --prefill-weights expand \
      --json "$OUT/bench-7b-expand.json"
    step "int8 vs fp16 bench" 70 python3 tools/bench_int8_vs_fp16.py --json "$OUT/int8_vs_fp16.json"
    step "int8 tests" 45 $PYTEST tests/test_int8_path.py
    step "7B vs transformers" 170 python3 tools/check_vs_transformers.py --model "$MODEL_7B" --steps 32 \
      --json "$OUT/check_7b.json"
    ;;
  book)
    step "random 7B file" 45 python3 -m nanoqwen.random_model "$MODEL_7B" --preset qwen2.5-coder-7b
    step "bench 7B fp16" 60 python3 -m nanoqwen bench "$MODEL_7B" --json "$OUT/bench-7b.json"
    step "bench 7B int8" 60 python3 -m nanoqwen bench "$MODEL_7B" --activations int8 --json "$OUT/bench-7b-int8.json"
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site:$PWD NANOQWEN_REQUIRE_GPU=1
    step "book under nbval" 280 python3 -m pytest -q -p no:cacheprovider -k md --junitxml="$OUT/book-junit.xml"
    ;;
  ab)
    base=${2:?usage: gpu_session.sh ab DIR}
    step "random 7B file" 45 python3 -m nanoqwen.random_model "$MODEL_7B" --preset qwen2.5-coder-7b
    for run in 1 2; do
      step "bench 7B, this tree ($run)" 75 python3 -m nanoqwen bench "$MODEL_7B" --json "$OUT/bench-7b-this-$run.json"
      step "bench 7B, $base ($run)" 75 bash -c "cd '$base' && PYTHONPATH=\$PWD python3 -m nanoqwen bench '$MODEL_7B' \
        --json '$OUT/bench-7b-base-$run.json'"
    done
    step "GPU tests" 240 $PYTEST tests/test_kernels_cuda.py tests/test_cuda_graph.py tests/test_int8_path.py \
      tests/test_attention_cuda.py tests/test_pdl.py
    ;;
esac
echo "=== summary"
printf '%s\n' "${status[@]}"
