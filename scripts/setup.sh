#!/usr/bin/env bash
# Installs what hicached needs on a fresh machine; sourced by test.sh and serve.sh.
#
# Usage: setup_hicached [--test]
#   (no flag)  the daemon: the package and its pure-Python dependencies (no torch)
#   --test     also the test extras, torch (CPU build, only where none is present), SGLang's
#              code (--no-deps), vLLM's code (--no-deps, each release the suite runs into
#              .vllm-<release>/: its scheduler, offloading connector and KV event decoder),
#              Prometheus, Mooncake's wheel and the Debian packages they need
#
# Where it installs: a virtual environment of the project's own, .venv/ in the checkout
# (created with python3 if missing, then activated for the rest of the calling script), unless
# HICACHED_USE_ACTIVE_PYTHON=1: then into whatever python3 is active (a GPU host's environment
# with its CUDA torch, a container's system Python). It says what it installs before doing it.
# apt-get runs only as root, only for what is missing.

_hicached_say() { printf 'setup: %s\n' "$*" >&2; }

_hicached_python_ok() {
    "$1" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null
}

_hicached_apt() {
    [ $# -gt 0 ] || return 0
    if [ "$(id -u)" != 0 ]; then
        _hicached_say "missing, and not root to install them: $* (install them, or run as root)"
        return 0
    fi
    _hicached_say "apt-get install (root): $*"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$@"
}

_hicached_env() {
    local py="${HICACHED_PYTHON:-python3}"
    if ! _hicached_python_ok "$py"; then
        _hicached_say "hicached needs Python >= 3.11; '$py' is $("$py" --version 2>&1 || echo missing)" \
            "(set HICACHED_PYTHON to another interpreter)"
        return 1
    fi
    if [ "${HICACHED_USE_ACTIVE_PYTHON:-0}" = 1 ]; then
        _hicached_say "installing into the active Python: $(command -v "$py") (its own versions" \
            "kept where they satisfy pyproject.toml; scripts/constraints.txt not applied)"
        _hicached_pins=()
        return 0
    fi
    if [ ! -x .venv/bin/python3 ]; then
        if ! "$py" -c 'import ensurepip, venv' 2>/dev/null; then
            _hicached_apt "python3-venv"
        fi
        _hicached_say "creating the project's virtual environment: $PWD/.venv ($("$py" --version))"
        "$py" -m venv .venv
    fi
    # shellcheck disable=SC1091
    . .venv/bin/activate
    _hicached_say "installing into $PWD/.venv at the versions hicached is tested with" \
        "(scripts/constraints.txt; HICACHED_USE_ACTIVE_PYTHON=1: the active Python instead)"
    _hicached_pins=(-c scripts/constraints.txt)
}

_hicached_torch() {
    # worker-side parts (hicache_client's buffers, the SGLang linker, the tests) need torch;
    # one already there (a GPU host's CUDA build) is never replaced
    if python3 -c 'import torch' 2>/dev/null; then
        _hicached_say "torch $(python3 -c 'import torch; print(torch.__version__)') is present: kept"
        return 0
    fi
    _hicached_say "pip install torch==2.13.0+cpu (the CPU build: a bare 'torch' can pull a multi-GB CUDA build)"
    if ! python3 -m pip install -q --disable-pip-version-check "torch==2.13.0+cpu"; then
        _hicached_say "no CPU build of torch 2.13.0 on the configured index; point pip at one that" \
            "has it, e.g. PIP_EXTRA_INDEX_URL=<your PyTorch CPU wheel index>, or install a torch" \
            "yourself and rerun"
        return 1
    fi
}

setup_hicached() {
    local extras="" missing=()
    command -v cc >/dev/null 2>&1 || missing+=(gcc)  # the native copy kernel is C
    if [ "${1:-}" = "--test" ]; then
        extras="[test,sglang-cpu-test,mooncake-cpu,router-test]"
        # the observability tests run a real Prometheus server and promtool
        command -v prometheus >/dev/null 2>&1 && command -v promtool >/dev/null 2>&1 \
            || missing+=(prometheus)
        # the key tests compile SGLang's own page-hash binding (C++, OpenSSL)
        command -v g++ >/dev/null 2>&1 || missing+=(g++)
        [ -f /usr/include/openssl/sha.h ] || missing+=(libssl-dev)
        # the cluster-tier tests run a real Mooncake master and daemons in a private network
        # namespace (unshare, nsenter, ip); the Mooncake wheel links these libraries
        command -v ip >/dev/null 2>&1 || missing+=(iproute2)
        command -v nsenter >/dev/null 2>&1 || missing+=(util-linux)
        for lib in libibverbs.so.1:libibverbs1 libnuma.so.1:libnuma1 libcurl.so.4:libcurl4; do
            ldconfig -p | grep -q "${lib%%:*}" || missing+=("${lib##*:}")
        done
    fi
    _hicached_apt ${missing[@]+"${missing[@]}"}
    _hicached_env || return 1
    if [ "${1:-}" = "--test" ]; then
        _hicached_torch || return 1
    fi
    local what="numpy, grpcio, protobuf, prometheus-client, xxhash, pyzmq, msgspec"
    [ -z "$extras" ] || what="$what; the extras of pyproject.toml: test tools, SGLang's cache-path imports, Mooncake's wheel, Dynamo's KV indexer"
    # not editable: the environment runs what a user's `pip install .` installs (a wheel built
    # from this tree); the tests refuse to run while it differs from the checkout
    _hicached_say "pip install .${extras} (hicached, hicache, hicache_client, hicache_sglang," \
        "hicache_vllm, hicache_bench: $what)"
    python3 -m pip install -q --disable-pip-version-check ${_hicached_pins[@]+"${_hicached_pins[@]}"} \
        ".${extras}"
    if [ "${1:-}" = "--test" ]; then
        # SGLang's own code is what the linker's and the real server's tests run against; its
        # own dependencies are the GPU serving stack, so the package comes without them and
        # the [sglang-cpu-test] extra brings what its cache modules and HTTP server import
        _hicached_say "pip install --no-deps sglang==0.5.23 (its code only)"
        python3 -m pip install -q --disable-pip-version-check --no-deps "sglang==0.5.23"
        _hicached_vllm
    fi
}

_hicached_vllm() {
    # vLLM's own scheduler, offloading connector and KV event decoder run in the tests (the
    # vLLM spec, the daemon's event stream), on every release hicache.engines tests (its
    # table: 0.33.0, 0.34.0). Each release's code and what those modules import go into a
    # directory of its own, .vllm-<release>/, never into the environment: SGLang probes for
    # an installed vLLM and would change its paths. The tests put it on PYTHONPATH of a
    # subprocess, with VLLM_TARGET_DEVICE=cpu. What comes beside vLLM is pyproject.toml's
    # [vllm-cpu-test] extra (one place for the pins); the marker file keeps a directory, so a
    # changed list installs again.
    local releases pins release
    releases=$(python3 -c 'from hicache import engines; print(" ".join(x.tested for x in engines.lines("vllm")))') || return 1
    pins=$(python3 -c 'import tomllib; x = tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]; print(" ".join(x["vllm-cpu-test"]))') || return 1
    for release in $releases; do
        _hicached_vllm_release "$PWD/.vllm-$release" "vllm==$release $pins" || return 1
    done
}

_hicached_vllm_release() {
    local dir=$1 pins=$2
    if [ "$(cat "$dir/.complete" 2>/dev/null)" = "$pins" ]; then
        return 0
    fi
    _hicached_say "pip install --no-deps --target $dir $pins (vLLM's code and what its" \
        "scheduler, offloading connector and kv_events modules import, apart from the" \
        "environment)"
    # shellcheck disable=SC2086
    python3 -m pip install -q --disable-pip-version-check --no-deps --upgrade \
        --target "$dir" $pins || return 1
    # pip --target --upgrade replaces a package's files but leaves the metadata of what it
    # replaced: only the listed packages' own *.dist-info stay (nothing else is installed here)
    # shellcheck disable=SC2086
    python3 - "$dir" $pins <<'PY' || return 1
import pathlib, re, shutil, sys
norm = lambda n: re.sub(r"[-_.]+", "-", n).lower()
listed = {(norm(name), version) for name, _, version in (p.partition("==") for p in sys.argv[2:])}
for d in pathlib.Path(sys.argv[1]).glob("*.dist-info"):
    name, _, version = d.name[:-len(".dist-info")].rpartition("-")
    if (norm(name), version) not in listed:
        shutil.rmtree(d)
PY
    echo "$pins" > "$dir/.complete"
}
