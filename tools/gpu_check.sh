#!/usr/bin/env bash
# One prepared GPU check (run on the device machine, from the repository root): builds the
# extension with the machine's own Python (it has torch, triton, pybind11, pytest, transformers;
# nothing can be fetched there and it has no Ray), runs the tests marked gpu (compiled Triton on
# CUDA, engine parity on cuda), the GPU attention benchmark, the end-to-end benchmark on cuda, the
# split sweep and the mid-run contention on the paper-shaped preset, one 1M-token sequence, 32 x 32K
# of the paper-shaped preset where host memory allows, DeepSeek-V4's sparse step, and the CPU-side
# suites with CUDA present (pinned regions). Arguments name the steps to run (the
# install always runs): `bash tools/gpu_check.sh gpu_tests e2e`. Each step has its own time cap and a
# failing step does not stop the later ones; $OUT/summary.txt says how each ended.
set -uo pipefail
OUT=${OUT:-bench_results}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
unset TRITON_INTERPRET

ONLY=" $* "  # step names to run (all when none): `bash tools/gpu_check.sh gpu_tests e2e`

step() {  # step NAME CAP_S COMMAND...: runs COMMAND under a time cap, logs to $OUT/NAME.log
    local name=$1 cap=$2
    shift 2
    if [[ "$ONLY" != "  " && "$ONLY" != *" $name "* && $name != install ]]; then return; fi
    local begin=$SECONDS
    timeout "$cap" "$@" >"$OUT/$name.log" 2>&1
    local rc=$?
    echo "$name rc=$rc ${cap}s-cap took=$((SECONDS - begin))s" | tee -a "$OUT/summary.txt"
    tail -n 25 "$OUT/$name.log"
}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/summary.txt"
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__,
'transformers', transformers.__version__)" | tee -a "$OUT/summary.txt"
step install 150 python3 -m pip install --no-index --no-deps --no-build-isolation -e .
step gpu_tests 170 python3 -m pytest -q -m gpu -p no:cacheprovider --timeout 60 \
    tests/core/test_triton_attention.py tests/core/test_moe_model.py tests/engine/test_parity.py \
    tests/engine/test_deepseek_v4.py
step gpu_bench 60 python3 tools/bench_gpu_attention.py --repeats 20 --out "$OUT/gpu_attention.json"
step e2e 200 python3 tools/bench_e2e.py --device cuda --contexts 8192 32768 --batches 1 4 --new-tokens 12 \
    --out "$OUT/e2e.json"
# The split against a sweep of fixed shares on the paper-shaped preset, the device KV capped as in
# the paper (window + ping-pong ~ 2 GB), then a host-to-device copy started mid-run (does r* rise?).
step split 240 python3 tools/bench_split.py --preset qwen3-30b-a3b-shape --device cuda --device-kv-gb 2 \
    --contexts 32768 131072 --batches 1 --new-tokens 8 --rounds 1 --share-step 0.25 --out "$OUT/split.json"
step contention 90 python3 tools/bench_contention.py --preset qwen3-30b-a3b-shape --device cuda --hog h2d \
    --context 32768 --batch 1 --steps 60 --hog-step 20 --window-tokens 256 --out "$OUT/contention_h2d.json"
# One 1M-token sequence, prefilled in 4096-token chunks and decoded with exact attention on the GPU,
# the KV spilled to the host, the device's KV capped as in the paper (window + ping-pong 2 GB); peak
# device memory in the JSON.
step long_sequence 300 python3 tools/bench_long_sequence.py --context 1048576 --new-tokens 16 --device cuda \
    --device-kv-gb 2 --policy writescope --out "$OUT/long_sequence_1m.json"
# 32 x 32K of the paper-shaped preset (1M tokens; 96 KiB of KV a token) where host memory allows: as
# many 32K sequences as fit in 80% of MemAvailable, at most 32; one prefill chunk per sequence, the
# device's KV capped at 2 GB; host bytes against the raw KV, decode tok/s, peak device memory.
CAPACITY_BATCH=$(python3 -c "
from writescope.tools.bench_capacity import kv_bytes_per_token
available = int(next(l for l in open('/proc/meminfo') if l.startswith('MemAvailable')).split()[1]) * 1024
print(max(1, min(32, int(0.8 * available / (32768 * kv_bytes_per_token('qwen3-30b-a3b-shape'))))))" 2>/dev/null || echo 1)
step capacity 420 python3 tools/bench_capacity.py --preset qwen3-30b-a3b-shape --executor local --device cuda \
    --device-kv-gb 2 --policy writescope --batch "$CAPACITY_BATCH" --context 32768 --new-tokens 8 \
    --prefill-chunk-tokens 32768 --out "$OUT/capacity.json"
# DeepSeek-V4's sparse step against the selection disabled, the entries split (fixed_half) with the
# device's share on the GPU: KV read and moved per step, gather time, decode tok/s.
step sparse 240 python3 tools/bench_sparse.py --device cuda --contexts 32768 131072 --steps 8 \
    --out "$OUT/sparse.json"
step cpu_suites_with_cuda 60 python3 -m pytest -q -x -p no:cacheprovider --timeout 60 -m "not gpu and not ray" \
    tests/core/test_kv_regions.py tests/core/test_inplace_kv_cache.py tests/core/test_calibration.py
exit 0
