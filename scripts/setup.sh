#!/usr/bin/env bash
# Installs what hicached needs on a fresh machine; sourced by test.sh and serve.sh.
# Usage: setup_hicached [--test]   (--test adds the test extras and a Prometheus server)
setup_hicached() {
    local extras="" missing=()
    command -v cc >/dev/null 2>&1 || missing+=(gcc)  # the native copy kernel is C
    if [ "${1:-}" = "--test" ]; then
        extras="[test,sglang,mooncake-cpu]"
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
    if [ ${#missing[@]} -gt 0 ] && [ "$(id -u)" = 0 ]; then
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
            "${missing[@]}"
    fi
    # the CPU build of torch, pinned: a bare "torch" could pull a multi-GB CUDA build. Where the
    # configured index lacks it, point pip at one that has it (PIP_EXTRA_INDEX_URL).
    python3 -m pip install -q --disable-pip-version-check "torch==2.13.0+cpu"
    python3 -m pip install -q --disable-pip-version-check -e ".${extras}"
    if [ "${1:-}" = "--test" ]; then
        # SGLang's own code is what the linker's integration tests run against; its own
        # dependencies are the GPU serving stack, so the package comes without them and the
        # [sglang] extra brings what its cache modules import
        python3 -m pip install -q --disable-pip-version-check --no-deps "sglang==0.5.23"
    fi
}
