#!/usr/bin/env bash
# The GPU checks and records, one mode per call on an H100/H200 machine (tests, checks and sizes each
# within ten minutes); each step is bounded so a failure costs its own time only. Logs and records go
# under $OUT; a summary table is printed last.
#   bash tools/gpu_session.sh tests    the GPU tests, then the attention kernels' checks
#   bash tools/gpu_session.sh checks   `nanoqwen bench` on the 7B's shapes (with the transformers
#                                      baseline), then the step's timeline
#   bash tools/gpu_session.sh records  compute-sanitizer over a whole generation, the kernels one at a
#                                      time, the check against transformers at every size
#   bash tools/gpu_session.sh sizes    the decode speed at every size, three forms of the step
#   bash tools/gpu_session.sh persistent  the persistent kernel's tests, then the step's timeline inside it
#   bash tools/gpu_session.sh speculative  the verify pass's tests, then its costs and acceptance
#   bash tools/gpu_session.sh book     every chapter under nbval, taking the CUDA path (carry .whl with
#                                      nbval, jupytext and their dependencies: book/running.md)
set -u
usage() {  # the modes, from the comment above
  echo "usage: bash tools/gpu_session.sh [MODE]   (default: checks)"
  sed -n 's/^#   /  /p' "${BASH_SOURCE[0]}"
}
MODE=${1:-checks}
case "$MODE" in
  tests|checks|records|sizes|persistent|speculative|book) ;;
  -h|--help) usage; exit 0 ;;
  *) echo "gpu_session.sh: unknown mode '$MODE'" >&2; usage >&2; exit 2 ;;
esac
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD NANOQWEN_REQUIRE_GPU=1  # absolute: chapters run in chapters/
OUT=${OUT:-/tmp/nanoqwen-out}
mkdir -p "$OUT"
MODEL_7B=/tmp/qwen2.5-coder-7b-random.nanoqwen
GPU_TESTS="tests/test_persistent_cuda.py tests/test_cuda_graph.py tests/test_pdl.py tests/test_kernels_cuda.py
           tests/test_attention_cuda.py tests/test_int8_path.py tests/test_shapes_cuda.py tests/test_check_vs_transformers.py
           tests/test_verify_cuda.py"
GPU=$(python3 -c "import sys; sys.path.insert(0, sys.argv[1]); import record; print(record.gpu_tag())" \
      "$(dirname "${BASH_SOURCE[0]}")" 2>/dev/null || echo gpu)  # h100, h200: the records' names
PYTEST="python3 -m pytest -q -rs -p no:cacheprovider --noconftest -o addopts="
status=()
failed=0
step() {  # step NAME SECONDS COMMAND...
  local name=$1 seconds=$2; shift 2
  local start=$SECONDS
  echo "=== $name" | tee -a "$OUT/session.log"
  timeout "$seconds" "$@" 2>&1 | tee -a "$OUT/session.log"
  local rc=${PIPESTATUS[0]}
  status+=("$(printf '%-32s rc=%-3s %4ss' "$name" "$rc" $((SECONDS - start)))")
  [ "$rc" -eq 0 ] || failed=1
}

case "$MODE" in
  tests)
    # shellcheck disable=SC2086
    step "GPU tests" 380 $PYTEST $GPU_TESTS --junitxml="$OUT/gpu-tests.xml"
    step "attention kernels" 200 python3 tools/gpu_check_attention.py
    ;;
  checks)
    step "random 7B file" 60 python3 -m nanoqwen.random_model "$MODEL_7B" --preset qwen2.5-coder-7b
    step "bench 7B" 200 bash -c "python3 -m nanoqwen bench '$MODEL_7B' --baseline --json '$OUT/bench-7b-$GPU.json' \
      | tee '$OUT/bench-7b-$GPU.txt'"
    step "step timeline 7B" 120 python3 tools/step_timeline.py "$MODEL_7B" --json "$OUT/step-timeline-$GPU.json"
    ;;
  records)
    step "sanitizers over a generation" 150 python3 tools/sanitize_engine.py --json "$OUT/sanitizer-engine-$GPU.json" \
      --logs "$OUT/sanitizer-logs"
    step "kernels one at a time" 120 python3 tools/bench_kernels.py --out "$OUT/kernels-$GPU.md" --json "$OUT/kernels-$GPU.json"
    step "check by size" 400 python3 tools/check_by_size.py --out "$OUT/check-by-size-$GPU" \
      --presets qwen2.5-coder-14b qwen2.5-coder-32b qwen2.5-coder-7b qwen2.5-coder-0.5b qwen2.5-coder-1.5b qwen2.5-coder-3b
    ;;
  speculative)
    step "verify tests" 300 $PYTEST tests/test_verify_cuda.py -x
    step "speculative record" 400 python3 tools/bench_speculative.py --out "$OUT/speculative-$GPU"
    ;;
  persistent)
    # shellcheck disable=SC2086
    step "persistent kernel tests" 240 $PYTEST tests/test_persistent_cuda.py tests/test_cuda_graph.py -x
    step "random 7B file" 60 python3 -m nanoqwen.random_model "$MODEL_7B" --preset qwen2.5-coder-7b
    step "step timeline 7B" 150 python3 tools/step_timeline.py "$MODEL_7B" --json "$OUT/step-timeline-$GPU.json"
    ;;
  sizes)
    step "decode by size" 570 python3 tools/decode_by_size.py --out "$OUT/decode-by-size-$GPU"
    ;;
  book)
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site:$PWD
    step "book under nbval" 400 python3 -m pytest -q -p no:cacheprovider -k md --junitxml="$OUT/book-junit.xml"
    ;;
esac
echo "=== summary"
printf '%s\n' "${status[@]}"
exit "$failed"  # 1 when any step failed
