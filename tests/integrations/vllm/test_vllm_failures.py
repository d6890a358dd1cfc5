"""vLLM 0.33 with hicached when a load cannot be done as promised, and when the daemon comes
back: vLLM's real ``Scheduler`` and connector in engine processes (``tests/vllm_harness.py``),
each load checked into KV zeroed first.

- A daemon that hangs between a HIT and its load for longer than the session's lease and
  ``load_retry_s``: with ``hicache_vllm.connector.HicachedOffloadingConnector`` the load is
  given up and vLLM recomputes the request (never decodes on the zeroed blocks), but only once
  no copy of the session it timed out on can land (the link's fence: the daemon back and
  saying so), so the recompute cannot be overwritten by a copy the hang held; with vLLM's own
  ``OffloadingConnector`` the load waits for the daemon (the hold stands) and loads. Then new
  requests are stored and hit within about a second of the daemon being back.
- Keys gone before the load (``KEY_NOT_FOUND``, given up at once): recomputed or only that
  request failed (``kv_load_failure_policy``), for asynchronous and synchronous loads, the
  request beside it untouched; with vLLM's own connector the engine's step raises.
- (A daemon restarted: tests/integrations/vllm/test_vllm_offloading.py, hits within about a second.)
- ``reset_cache`` (vLLM's connector reset) drops this engine's holds, not the shared pages.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.daemon_proc import DaemonProc, Daemons
from tests.vllm_harness import model_dir
from tests.vllm_runs import BS, CLEAN, engine, result, run, wait_file

LEASE_S = 1
"""The daemon's session lease here: the hangs below outlast it."""
HANG_S = 2.5
"""How long the daemon stays stopped: past ``LEASE_S`` and the 1 s ``load_retry_s`` the
scenario sets."""
BACK_S = 1.2
"""New requests are stored and hit again within this long after the daemon is back."""


@pytest.fixture
def daemon(daemons: Daemons) -> DaemonProc:
    return daemons.start("--lease-seconds", str(LEASE_S))


@pytest.fixture
def model(tmp_path: Path) -> str:
    return str(model_dir(tmp_path))


@pytest.mark.parametrize("connector", ["hicached", "plain"])
def test_a_daemon_hung_between_hit_and_load_never_leaves_wrong_kv(
        tmp_path: Path, daemon: DaemonProc, model: str, connector: str) -> None:
    sync = tmp_path / "sync"
    sync.mkdir()
    proc = engine("hang_between_hit_and_load", model=model, target=daemon.target,
                  sync_dir=str(sync), connector=connector, policy="recompute",
                  daemon_pid=daemon.proc.pid)
    try:
        wait_file(sync / "loading", proc)
        daemon.pause()
        stopped = time.monotonic()
        (sync / "stopped").touch()
        time.sleep(max(HANG_S - (time.monotonic() - stopped), 0))
        daemon.resume()
        (sync / "continued").touch()
        wait_file(sync / "idle", proc)
        daemon.pause()  # (the engine resumes it, and sends a request at once)
        (sync / "stopped-idle").touch()
        got = result(proc)
    finally:
        daemon.resume()
        if proc.poll() is None:
            proc.kill()
    assert got["first"] == CLEAN and got["c"] == CLEAN  # the request beside it: untouched
    assert got["b"] == CLEAN, got["b"]  # never the zeroed rows it would have decoded on
    assert got["finish"]["b"] == "length" and got["emitted"]["b"] == 1
    if connector == "hicached":
        # given up after load_retry_s, and told to vLLM (which computed the request instead:
        # b ran with nothing loaded) only once the daemon was back and said no copy of the
        # session could land: before, a copy the stop held could land on the recompute
        assert not got["settled_before_continue"], got["settled_s"]
        assert got["worker"]["load_failures"] == 1 and got["invalid_blocks"] == 8
        assert got["worker"]["load_fence_waits"] == 1
        # told after the daemon was back, vLLM asks again: a hit now (its keys are still
        # there), loaded exact; or, if the link was not usable yet, computed (nothing loaded)
        assert (got["b_loaded"], got["worker"]["loads"]) in ((8 * BS, 1), (0, 0)), got["worker"]
    else:
        # vLLM's own connector cannot be told: the load waited for the daemon (longer than
        # load_retry_s: its hold stands), re-opened the session the lease had ended, loaded
        assert got["worker"]["load_failures"] == 0 and got["invalid_blocks"] == 0
        assert got["b_loaded"] == 8 * BS and got["worker"]["load_pages"] == 8
    after = got["after"]
    assert after["first_hit_s"] is not None and after["first_hit_s"] < BACK_S, after
    # the daemon stopped past the lease while the engine idled: the very first request after
    # it answers again is stored (the links re-open the sessions it ended) and then hits
    assert len(got["after_hang"]["tries"]) == 1, (got["after_hang"], got["manager"],
                                                  got["worker_after"])
    assert "Traceback" not in got["stderr"]


@pytest.mark.parametrize("policy, sync_load", [("recompute", False), ("fail", False),
                                               ("recompute", True), ("fail", True)],
                         ids=["recompute-async", "fail-async", "recompute-sync", "fail-sync"])
def test_keys_gone_before_the_load_recompute_or_fail_that_request_only(
        daemon: DaemonProc, model: str, policy: str, sync_load: bool) -> None:
    got = run("keys_gone_before_load", model=model, target=daemon.target,
              connector="hicached", policy=policy, sync_load=sync_load)
    assert got["removed"] == [6] and not got["raised"]
    assert got["worker"]["load_failures"] == 1 and got["invalid_blocks"] == 6
    assert got["took_s"] < 3  # given up at once (KEY_NOT_FOUND), not after load_retry_s
    assert got["c"] == CLEAN and got["finish"]["c"] == "length"  # the rest: untouched
    if policy == "recompute":
        assert got["b"] == CLEAN and got["finish"]["b"] == "length"
        assert got["emitted"]["b"] == 1
    else:  # vLLM fails that request: no token of it reaches its client
        assert got["finish"]["b"] == "error" and got["emitted"].get("b", 0) == 0


def test_keys_gone_before_the_load_stop_an_engine_that_cannot_be_told(
        daemon: DaemonProc, model: str) -> None:
    got = run("keys_gone_before_load", model=model, target=daemon.target, connector="plain")
    assert got["raised"].startswith("hicache_vllm.worker.LoadFailed: "), got["raised"]
    assert "KEY_NOT_FOUND" in got["raised"]
    assert got["b"] is None and "b" not in got["finish"]  # it never completed


def test_a_connector_reset_keeps_the_pages_other_engines_hit(daemon: DaemonProc,
                                                            model: str) -> None:
    first = run("store_only", model=model, target=daemon.target, blocks=4, seed=3)
    assert first["worker"]["store_pages"] == 4
    got = run("reset_keeps_shared_pages", model=model, target=daemon.target, blocks=4)
    assert got["held"] == 4 and got["manager"]["resets"] == 1
    assert got["manager"]["reset_holds_released"] == 4  # its own holds, let go
    assert got["loaded"] == 4 * BS and got["b"] == CLEAN  # its own pages: still there
    assert got["theirs_loaded"] == 4 * BS and got["theirs"] == CLEAN  # the other engine's
