#!/usr/bin/env bash
# Set up and run the daemon on its embedded default on a fresh machine:
# a 0600 Unix socket in the runtime directory, /dev/shm for worker buffers, metrics on
# 127.0.0.1:9464, half of the available memory as the pool budget.
# Usage: bash scripts/serve.sh [hicached serve flags...]
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v cc >/dev/null 2>&1; then
    if [ "$(id -u)" = 0 ]; then apt-get update -qq && apt-get install -y -qq gcc; fi
fi
python3 -m pip install -q --disable-pip-version-check "torch==2.13.0+cpu" 2>/dev/null \
    || python3 -m pip install -q --disable-pip-version-check "torch==2.13.0+cpu" \
        --index-url https://download.pytorch.org/whl/cpu
python3 -m pip install -q --disable-pip-version-check -e .
exec python3 -m hicached serve "$@"
