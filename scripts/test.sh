#!/usr/bin/env bash
# Set up and run the whole test suite on a fresh machine: dependencies, the native copy kernel,
# lint, type checks, import rules, tests. Usage: bash scripts/test.sh [extra pytest args]
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/setup.sh
setup_hicached --test

python3 -m ruff check .
python3 -m mypy
lint-imports --no-cache  # the layer and import rules in pyproject.toml
# the GPU check's steps without a GPU: its wheels fetched and installed for Python 3.12, the
# native modules built with it, the GPU tests collected, its budget (docs/operations.md)
bash scripts/gpu_check.sh --dry-run "${TMPDIR:-/tmp}/hicache-gpu-check-dry"
python3 -m pytest -q -p no:cacheprovider --durations=25 "$@"
