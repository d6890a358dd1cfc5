#!/usr/bin/env bash
# The GPU check: one command for a host with an NVIDIA GPU, a CUDA build of torch and no package
# registry (what its image lacks comes from .whl/, fetched beforehand by scripts/gpu_wheels.sh).
# It ends within 8 minutes: each part runs under its own time budget (printed first), the most
# informative first, and a part that fails or runs out of time does not stop the next:
#
#   0 wheels       the carried wheels into a scratch --target on PYTHONPATH (the machine's own
#                  Python is not touched); the repository's packages by path, nothing installed
#   1 env          nvidia-smi, Python, torch and CUDA, the versions of what we import
#   2 native       the copy kernel and the poll helper built there (scripts/gpu/build_native.py)
#   3 cuda-tests   pytest -m cuda tests/procs/test_cuda_gpu.py: CUDA IPC export and attach, pinned
#                  pools, D2H/H2D exact, layer events, every copy way (dma, batch, kernel)
#                  exact for every layout at page sizes 1/16/64 beside a neighbour's kernels,
#                  a dead worker's device memory released, an elastic budget's locked memory
#                  moving between two pools (keys exact), a copy over two registrations
#                  refused and cut, a pool over 1 GiB exact; VMM memory (cuMemCreate chunks)
#                  as cuda_vmm fds: the driver's address ranges and handle properties as the
#                  export counts on, MHA and MLA workers exact, nothing left mapped
#   4 bench-short  bench_cuda.py --short: per copy way, D2H/H2D GB/s beside a pinned copy_ of
#                  the same bytes, page sizes 1/16/64, the daemon's CPU and the kernel's SM
#                  time per batch, both directions at once, the enqueue rate of a 64-page batch
#   5 sglang       pytest -m cuda tests/integrations/sglang/test_sglang_gpu.py: the linker on SGLang's CUDA KV
#                  tensors with layer events, offload under set_sync_debug_mode("error")
#   6 vllm         pytest -m cuda tests/integrations/vllm/test_vllm_gpu.py: the vLLM spec's worker on vLLM's
#                  canonical CUDA KV tensors, a store behind a kernel still writing, a load
#                  back exact (vLLM's offloading interfaces from .vllm-gpu: carry it with .whl;
#                  the dry run makes it, scripts/gpu/vllm_subset.py)
#   7 extra        whatever time is left: bench_cuda.py over every layout, beside a pool locked
#                  in 2 MiB units (elastic), and what a growth step's registration costs
#
# Everything lands in OUTDIR (default /tmp/hicache-gpu-check), at most 9 files: summary.txt
# (printed at the end), env.txt, native.txt, cuda-tests.txt, bench-short.txt, bench-short.json,
# sglang.txt, vllm.txt, extra.txt. Exit status 0 when every part passed.
#
# --dry-run (no GPU): the same steps where they can run without one: wheels fetched if absent
# and installed into a scratch target with Python 3.12 (if present), the native modules built
# with it, vLLM's offloading interfaces copied into .vllm-gpu, the GPU tests collected,
# bench_cuda.py's control plane; then the budget.
# --budget: print the time budget and exit.
# Usage: bash scripts/gpu_check.sh [--dry-run | --budget] [OUTDIR]
set -uo pipefail
cd "$(dirname "$0")/.."
repo="$PWD"
mode=run
case "${1:-}" in
    --dry-run) mode=dry; shift ;;
    --budget) mode=budget; shift ;;
esac
out="${1:-/tmp/hicache-gpu-check}"

# seconds per part, each a ceiling; part 6 (extra) gets at least its share and at most what the
# others left of TOTAL
TOTAL=475
declare -A BUDGET=([wheels]=35 [env]=35 [native]=35 [cuda-tests]=160 [bench-short]=85
                   [sglang]=70 [vllm]=50)
PARTS=(wheels env native cuda-tests bench-short sglang vllm extra)
fixed=0
for p in "${!BUDGET[@]}"; do fixed=$((fixed + BUDGET[$p])); done
BUDGET[extra]=$((TOTAL - fixed))

print_budget() {
    echo "time budget (s), in order:"
    for p in "${PARTS[@]}"; do printf '  %-12s %4d\n' "$p" "${BUDGET[$p]}"; done
    printf '  %-12s %4d  (under 480; extra also gets what the others leave)\n' total "$TOTAL"
}
if [ "$mode" = budget ]; then print_budget; exit 0; fi

mkdir -p "$out"
rm -f "$out"/{summary,env,native,cuda-tests,bench-short,sglang,vllm,extra}.txt \
    "$out/bench-short.json"
summary="$out/summary.txt"
start=$SECONDS
status=0
{ echo "hicached GPU check ($mode), $(date -u +%FT%TZ), commit $(git rev-parse --short HEAD \
    2>/dev/null || echo unknown)"; print_budget; } | tee "$summary"

# part NAME LOGFILE CMD...: CMD under NAME's budget (never past TOTAL), output to LOGFILE too
part() {
    local name="$1" log="$out/$2" budget="${BUDGET[$1]}" t0=$SECONDS rc
    shift 2
    local left=$((TOTAL - (SECONDS - start) - 5))
    [ "$name" = extra ] && budget="$left"
    [ "$budget" -gt "$left" ] && budget="$left"
    if [ "$budget" -le 5 ]; then
        printf '%-12s SKIPPED  no time left\n' "$name" | tee -a "$summary"
        return 0
    fi
    echo "== part $name ($budget s) ==" | tee -a "$log"
    timeout -k 5 "$budget" "$@" 2>&1 | tee -a "$log"
    rc=${PIPESTATUS[0]}
    local verdict=ok
    if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then verdict="TIMEOUT"; status=1
    elif [ "$rc" -ne 0 ]; then verdict="FAILED rc=$rc"; status=1; fi
    printf '%-12s %-8s %4d s  %s\n' "$name" "$verdict" $((SECONDS - t0)) "$(summary_of "$log")" \
        | tee -a "$summary"
}

# the one line a part's log ends with that says most (pytest's tally, a benchmark's last row)
summary_of() {
    grep -E '(passed|failed|error|skipped|deselected)( |,|$)|^built |GB/s|calls/s|^FAILED' "$1" \
        2>/dev/null | tail -1 | cut -c1-100
}

python_for_image() {  # the interpreter that stands for the GPU machine's (Python 3.12)
    if [ "$mode" = run ]; then echo python3; return; fi
    local py
    for py in python3.12 "$(pyenv root 2>/dev/null)/versions/"3.12*/bin/python3.12; do
        if command -v "$py" >/dev/null 2>&1 && "$py" -c 'import sys' 2>/dev/null; then
            echo "$py"; return
        fi
    done
}
py312="$(python_for_image)"
site="/tmp/hicache-gpu-site"
export PYTHONUNBUFFERED=1

install_wheels() {
    ls .whl/*.whl >/dev/null 2>&1 || { echo "no wheels in .whl/ (scripts/gpu_wheels.sh)"; return 1; }
    rm -rf "$site"
    if [ -z "$py312" ]; then
        echo "no Python 3.12 here: the wheels are unpacked for 3.12 by this pip, not imported"
        python3 -m pip install -q --disable-pip-version-check --no-index --no-deps \
            --no-compile --only-binary=:all: --python-version 3.12 --implementation cp \
            --platform manylinux_2_34_x86_64 --target "$site" .whl/*.whl
        return
    fi
    "$py312" -m pip install -q --disable-pip-version-check --no-index --no-deps --no-compile \
        --no-cache-dir --upgrade --target "$site" .whl/*.whl || return 1
    echo "$(ls .whl/*.whl | wc -l) wheels into $site with $("$py312" --version)"
    if [ "$mode" = dry ]; then  # the image has typing-extensions (gRPC imports it); not here
        cp "$(python3 -c 'import typing_extensions as t; print(t.__file__)')" "$site/"
    fi
    # gRPC, protobuf and our generated stubs load with the carried versions
    PYTHONPATH="$site:$repo/clients/python" "$py312" -c '
import grpc, grpc_status, google.protobuf, google.rpc.status_pb2
import grpc_health.v1.health_pb2, grpc_reflection.v1alpha.reflection
from hicache.v1 import hicache_pb2, hicache_pb2_grpc
print("grpcio", grpc.__version__, "protobuf", google.protobuf.__version__, "stubs load")'
}

env_report() {
    nvidia-smi 2>&1 | head -20 || echo "no nvidia-smi"
    # SGLang JIT-compiles its page-hash binding (C++ and OpenSSL's libcrypto) on first use
    echo "c++: $(command -v g++ || command -v c++ || echo none);" \
        "openssl headers: $([ -f /usr/include/openssl/sha.h ] && echo yes || echo no);" \
        "ninja: $(command -v ninja || echo none)"
    python3 - <<'PY'
import importlib, os, platform, sys
sys.path.insert(0, os.environ["repo"])
try:  # what the SGLang tests install before importing it (IPython, sgl_kernel stand-ins)
    from tests.sglang_harness import install_stand_ins
    install_stand_ins()
except Exception as exc:
    print("sglang stand-ins FAILED", type(exc).__name__, exc)
print("python", platform.python_version(), platform.machine())
try:
    import torch
    print("torch", torch.__version__, "cuda", torch.version.cuda, "available",
          torch.cuda.is_available(), torch.cuda.get_device_name() if torch.cuda.is_available()
          else "")
except Exception as exc:
    print("torch FAILED", exc)
for name in ("numpy", "grpc", "google.protobuf", "grpc_status", "grpc_health.v1.health",
             "grpc_reflection.v1alpha.reflection", "prometheus_client", "xxhash", "zmq",
             "msgspec", "pytest", "hypothesis", "transformers", "sglang", "hicache",
             "hicache_client", "hicached.service.daemon", "hicache_sglang"):
    try:
        mod = importlib.import_module(name)
        print(f"  {name:38} {getattr(mod, '__version__', '')} {getattr(mod, '__file__', '')}")
    except Exception as exc:
        print(f"  {name:38} FAILED {type(exc).__name__}: {exc}")
PY
}

# parts that are shell functions run in a child bash, under timeout like the rest
export -f install_wheels env_report
export mode site py312 repo
# a test still running after 40 s prints every thread's stack (a hang shows where it waits)
pytest_args=(-q -p no:cacheprovider -rs -m cuda -o faulthandler_timeout=40)
if [ "$mode" = dry ]; then  # where a registry is reachable: the set, before the clock starts
    bash scripts/gpu_wheels.sh .whl 2>&1 | grep -v '^WARNING: ' || status=1
    start=$SECONDS
fi
if [ "$mode" = run ]; then
    export PYTHONPATH="$site:$repo/daemon:$repo/clients/python:$repo/tools:$repo${PYTHONPATH:+:$PYTHONPATH}"
    part wheels env.txt bash -c install_wheels
    part env env.txt bash -c env_report
    part native native.txt python3 scripts/gpu/build_native.py
    part cuda-tests cuda-tests.txt python3 -m pytest "${pytest_args[@]}" tests/procs/test_cuda_gpu.py
    part bench-short bench-short.txt python3 benchmarks/bench_cuda.py --short \
        --json "$out/bench-short.json"
    part sglang sglang.txt python3 -m pytest "${pytest_args[@]}" tests/integrations/sglang/test_sglang_gpu.py
    # vLLM's modules on the path of this part alone (SGLang changes its paths when it sees one)
    part vllm vllm.txt bash -c 'test -f .vllm-gpu/vllm/v1/kv_offload/base.py \
        || { echo "no .vllm-gpu (scripts/gpu/vllm_subset.py; carry it)"; exit 1; }
        PYTHONPATH="$repo/.vllm-gpu:$PYTHONPATH" exec python3 -m pytest "$@"' vllm \
        "${pytest_args[@]}" tests/integrations/vllm/test_vllm_gpu.py
    part extra extra.txt python3 benchmarks/bench_cuda.py --reps 5 --elastic
else
    part wheels env.txt bash -c install_wheels
    part env env.txt bash -c env_report
    if [ -n "$py312" ]; then
        part native native.txt "$py312" scripts/gpu/build_native.py --dest "$site/native"
    else
        part native native.txt python3 scripts/gpu/build_native.py --dest "$site/native"
    fi
    part cuda-tests cuda-tests.txt python3 -m pytest "${pytest_args[@]}" --collect-only \
        tests/procs/test_cuda_gpu.py
    part bench-short bench-short.txt python3 benchmarks/bench_cuda.py --plan-only --short \
        --quick --json "$out/bench-short.json"
    part sglang sglang.txt python3 -m pytest "${pytest_args[@]}" --collect-only \
        tests/integrations/sglang/test_sglang_gpu.py
    part vllm vllm.txt bash -c 'python3 scripts/gpu/vllm_subset.py \
        && PYTHONPATH="$repo/.vllm-gpu:$repo/clients/python" python3 -c "import hicache_vllm.worker" \
        && PYTHONPATH="$repo/.vllm-gpu" exec python3 -m pytest "$@"' vllm \
        "${pytest_args[@]}" --collect-only tests/integrations/vllm/test_vllm_gpu.py
    echo "extra: on a GPU, bench_cuda.py --elastic over every layout with what time is left" \
        | tee "$out/extra.txt"
fi
printf 'done in %d s of %d; files in %s\n' $((SECONDS - start)) "$TOTAL" "$out" | tee -a "$summary"
echo "---- summary ----"
cat "$summary"
exit "$status"
