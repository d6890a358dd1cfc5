#!/usr/bin/env bash
# Set up and run the daemon on its embedded default on a fresh machine:
# a 0600 Unix socket in the runtime directory, /dev/shm for worker buffers, metrics on
# 127.0.0.1:9464, half of the available memory as the pool budget.
# Usage: bash scripts/serve.sh [hicached serve flags...]
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/setup.sh
setup_hicached
exec python3 -m hicached serve "$@"
