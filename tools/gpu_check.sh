#!/usr/bin/env bash
# One prepared GPU check (run on the device machine, from the repository root): builds the
# extension with the machine's own Python (it has torch, triton, pybind11, pytest; nothing can be
# fetched there), runs the tests marked gpu (compiled Triton on CUDA) and the GPU benchmark, and
# writes everything under $OUT. Well inside 10 minutes on an H200.
set -euo pipefail
OUT=${OUT:-bench_results}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
unset TRITON_INTERPRET
python3 -m pip install --quiet --no-index --no-deps --no-build-isolation -e . 2>&1 | tee "$OUT/install.log"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/device.csv"
python3 -m pytest -q -m gpu -p no:cacheprovider tests/core/test_triton_attention.py tests/engine/test_parity.py \
    2>&1 | tee "$OUT/gpu_tests.log"
python3 tools/bench_gpu_attention.py --out "$OUT/gpu_attention.json" 2>&1 | tee "$OUT/gpu_bench.log"
python3 tools/bench_e2e.py --device cuda --contexts 8192 32768 --batches 4 --out "$OUT/e2e.json" 2>&1 \
    | tee "$OUT/e2e.log"
