#!/usr/bin/env bash
# Set up and run the whole test suite on a fresh machine: dependencies, the native copy kernel,
# lint, type checks, tests. Usage: bash scripts/test.sh [extra pytest args]
set -euo pipefail
cd "$(dirname "$0")/.."

# The native kernel is C (the image normally has a compiler); the observability tests run a
# real Prometheus server and promtool (Debian package prometheus).
missing=()
command -v cc >/dev/null 2>&1 || missing+=(gcc)
command -v prometheus >/dev/null 2>&1 && command -v promtool >/dev/null 2>&1 \
    || missing+=(prometheus)
if [ ${#missing[@]} -gt 0 ] && [ "$(id -u)" = 0 ]; then
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

python3 -m pip install -q --disable-pip-version-check "torch==2.13.0+cpu" 2>/dev/null \
    || python3 -m pip install -q --disable-pip-version-check "torch==2.13.0+cpu" \
        --index-url https://download.pytorch.org/whl/cpu
python3 -m pip install -q --disable-pip-version-check -e ".[test]"

python3 -m ruff check .
python3 -m mypy
python3 -m pytest -q -p no:cacheprovider "$@"
