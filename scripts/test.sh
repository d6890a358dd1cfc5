#!/usr/bin/env bash
# Set up and run the whole test suite on a fresh machine: dependencies, the native copy kernel,
# lint, type checks, import rules, tests. Usage: bash scripts/test.sh [extra pytest args]
# (HICACHE_TEST_WORKERS: test files run at once, default 3)
#
# bash scripts/test.sh --quick: the same set-up, lint and the import rules, then the unit and
# model tests (tests/daemon, tests/client, without those marked slow) and one end-to-end test
# per front end (the fast path, gRPC) and per engine (SGLang, vLLM) with real daemon and worker
# processes, in two pytest processes side by side: a few minutes, for the edit-test loop. The
# whole suite is what CI runs.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/setup.sh
setup_hicached --test

QUICK_E2E=(
    # the fast path and gRPC, one real daemon each, holds and a disk tier below
    "tests/procs/test_holds_e2e.py::test_a_hit_on_disk_is_promised_up_to_the_session_s_share"
    # worker processes sharing a daemon, each page exact
    "tests/procs/test_daemon_e2e.py::test_two_workers_back_up_and_load_their_own_pages_exactly"
    # SGLang's cache classes through the linker, another instance hitting the first's pages
    "tests/integrations/sglang/test_sglang_linker.py::test_another_instance_hits_what_the_first_stored"
    # vLLM's own scheduler through the connector, a prompt coming back exact
    "tests/integrations/vllm/test_vllm_offloading.py::test_a_prompt_stored_comes_back_exact_after_a_prefix_cache_reset"
)

if [[ "${1:-}" == "--quick" ]]; then
    shift
    started=$SECONDS
    logs=$(mktemp -d)
    python3 -m ruff check .
    # the import rules, over what setup_hicached just installed from this checkout
    lint-imports --no-cache > "$logs/imports.log" || { cat "$logs/imports.log"; exit 1; }
    python3 -m pytest -q -p no:cacheprovider -m "not slow" tests/daemon "$@" \
        > "$logs/units.log" 2>&1 &
    units=$!
    status=0
    python3 -m pytest -q -p no:cacheprovider -m "not slow" tests/client "${QUICK_E2E[@]}" \
        "$@" > "$logs/rest.log" 2>&1 || status=$?
    wait "$units" || status=$?
    tail -n 15 "$logs/units.log"
    tail -n 15 "$logs/rest.log"
    echo "quick tier: $((SECONDS - started)) s of tests (logs: $logs), exit $status"
    exit "$status"
fi

python3 -m ruff check .
python3 -m mypy
lint-imports --no-cache  # the layer and import rules in pyproject.toml
# the GPU check's steps without a GPU: its wheels fetched and installed for Python 3.12, the
# native modules built with it, the GPU tests collected, its budget (docs/operations.md)
bash scripts/gpu_check.sh --dry-run "${TMPDIR:-/tmp}/hicache-gpu-check-dry"
# Test files run side by side, HICACHE_TEST_WORKERS at once (default 3, 1 runs them in this
# process; on two cores a test process then stalls now and then: the test daemons' lease,
# tests/daemon_proc.py LEASE_S, outlasts that): a file stays on one worker, so a module's
# shared daemon or engine server starts once. The run's processes share the lock-order reports
# and the figures (tests/conftest.py). Then the tests marked alone (a wall-clock bound: an
# engine's wait against its compute time measured a moment earlier, a deadline's tenth of a
# second of margin, the README example's run, the copy threads' spin) run with nothing beside
# them; the run fails if either part does.
workers=${HICACHE_TEST_WORKERS:-3}
parallel=()
[ "$workers" -gt 1 ] && parallel=(-n "$workers" --dist loadfile)
status=0 empty=0
part() {  # a part that selects no test (pytest's 5) is not a failure unless both are
    python3 -m pytest -q -p no:cacheprovider "$@" || {
        local rc=$?
        if [ "$rc" -eq 5 ]; then empty=$((empty + 1)); else status=$rc; fi
    }
}
part --durations=20 "${parallel[@]}" -m "not alone" "$@"
part --durations=5 -m alone "$@"
[ "$empty" -lt 2 ] || status=5
exit "$status"
