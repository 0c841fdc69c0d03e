#!/usr/bin/env bash
# The GPU checks, in one call on a CUDA machine: the GPU tests (bf16 included), the Triton kernel test files
# on compiled kernels, and the GPU benchmarks. Logs and results go to $OUT (default: gpu_out).
# Usage: bash scripts/gpu_check.sh   (on a machine with a CUDA torch and Triton)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0 FASTARCH_FAILURE_LOG="$OUT/failures.log"
STAMP=$(date +%F)

{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  "$PY" -c "import sys, torch, triton; print(sys.version.split()[0], 'torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
  nproc; } 2>&1 | tee "$OUT/device.txt"

# fastarch runs from the checkout; the CUDA extension is built just in time (the CPU ones are not needed
# for CUDA tensors).
( time "$PY" -m fastarch build --kind cuda ) > "$OUT/build_cuda.log" 2>&1 &
BUILD=$!

# Every GPU test (the conformance suite's CUDA cases with bf16, the gpu-marked tests), and beside it the
# Triton kernel test files with CUDA as the default device.
timeout "${GPU_TEST_TIMEOUT:-240}" "$PY" -m pytest tests -k "cuda or gpu" -q -p no:cacheprovider -p no:benchmark -n 6 \
  --timeout 120 --continue-on-collection-errors > "$OUT/gpu_tests.log" 2>&1 &
TESTS=$!
FASTARCH_KERNEL_TEST_DEVICE=cuda timeout "${GPU_TEST_TIMEOUT:-240}" "$PY" -m pytest tests/kernels/test_triton_attention.py \
  tests/kernels/test_triton_ssd_scan.py -q -p no:cacheprovider -p no:benchmark -n 4 --timeout 120 > "$OUT/kernel_tests_cuda.log" 2>&1
echo "kernel tests on cuda: rc=$?"; tail -25 "$OUT/kernel_tests_cuda.log"
wait $TESTS; echo "gpu tests: rc=$?"; tail -40 "$OUT/gpu_tests.log"
wait $BUILD; tail -5 "$OUT/build_cuda.log"

# Benchmarks, alone on the GPU: the Triton attention kernels against SDPA's flash backend, then the suites
# at their quick sizes in bf16.
BENCH=/tmp/fastarch-bench-gpu
rm -rf "$BENCH"
timeout "${GPU_BENCH1_TIMEOUT:-130}" "$PY" -m fastarch bench --device cuda --dtype bfloat16 --case triton-attention-gpu \
  --no-plot --out "$BENCH/triton-attention" > "$OUT/bench_kernels.log" 2>&1
echo "bench kernels: rc=$?"; tail -45 "$OUT/bench_kernels.log"
timeout "${GPU_BENCH2_TIMEOUT:-130}" "$PY" -m fastarch bench --device cuda --dtype bfloat16 --quick --time-limit 100 \
  --suite attention,attention_features,sliding_window,selective_scan,ssd,norms,linear_attention,lsh,s4 \
  --no-plot --out "$BENCH/suites" > "$OUT/bench_suites.log" 2>&1
echo "bench suites: rc=$?"; tail -60 "$OUT/bench_suites.log"
tar czf "$OUT/bench-gpu-$STAMP.tgz" -C "$BENCH" . 2>/dev/null
