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
python3 -m pytest -q -p no:cacheprovider "$@"
