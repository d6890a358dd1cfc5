#!/usr/bin/env bash
# The GPU half of the checks, for a host with an NVIDIA GPU and a CUDA build of torch already
# installed: the `cuda` tests with real worker processes, the fake-driver CUDA tests for
# comparison, the SGLang linker on SGLang's real CUDA KV tensors (when SGLang 0.5.23 can be
# installed or is present), benchmarks/bench_cuda.py, and — when HICACHE_GPU_MODEL names a
# local model directory and a full SGLang install is present — TTFT and throughput of SGLang with
# the linker vs its stock --enable-hierarchical-cache (benchmarks/bench_sglang_server.py). Everything lands in OUTDIR (default $OUT or
# /tmp/hicache-gpu-check): nvidia-smi, versions, pytest output, benchmark table and JSON.
# Usage: bash scripts/gpu_check.sh [OUTDIR]
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-${OUT:-/tmp/hicache-gpu-check}}"
mkdir -p "$out"
status=0

nvidia-smi > "$out/nvidia-smi.txt" 2>&1 || true
python3 - > "$out/versions.txt" 2>&1 <<'PY' || status=1
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "available",
      torch.cuda.is_available(), torch.cuda.get_device_name() if torch.cuda.is_available() else "")
PY
cat "$out/versions.txt"

# the package (and its native module) without touching the installed CUDA torch
python3 -m pip install -q --no-build-isolation --no-deps -e . > "$out/install.txt" 2>&1 \
    || python3 -m pip install -q -e . >> "$out/install.txt" 2>&1 || status=1

# SGLang's code for the linker tests: without its GPU stack (--no-deps) when it is missing
python3 -c "import sglang" 2>/dev/null || {
    python3 -m pip install -q --no-deps "sglang==0.5.23" && python3 -m pip install -q ".[sglang]"
} > "$out/install-sglang.txt" 2>&1 || echo "SGLang not installable here: linker GPU test skipped"

timeout 1200 python3 -m pytest -q -p no:cacheprovider -rs tests/test_cuda_gpu.py \
    tests/test_sglang_gpu.py tests/test_cuda_path.py tests/test_cuda_e2e.py 2>&1 \
    | tee "$out/pytest.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

timeout 600 python3 benchmarks/bench_cuda.py --json "$out/bench_cuda.json" 2>&1 \
    | tee "$out/bench_cuda.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
if [ -n "${HICACHE_GPU_MODEL:-}" ]; then
    timeout 1500 python3 benchmarks/bench_sglang_server.py --model-path "$HICACHE_GPU_MODEL" \
        --json "$out/bench_sglang_server.json" 2>&1 | tee "$out/bench_sglang_server.txt"
    [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
else
    echo "HICACHE_GPU_MODEL unset: SGLang TTFT comparison not run" | tee "$out/bench_sglang_server.txt"
fi
exit "$status"
