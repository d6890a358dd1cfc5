"""vLLM with hicached when a load cannot be done as promised, and when the daemon comes back:
vLLM's real ``Scheduler`` and connector in engine processes (``tests/vllm_harness.py``), each
load checked into KV zeroed first; the hang on every release served (``CORE``), the rest on
the newest.

- A daemon that hangs between a HIT and its load for longer than the session's lease and
  ``load_retry_s``: the load is given up and vLLM recomputes the request (never decodes on the
  zeroed blocks), but only once no copy of the session it timed out on can land (the link's
  fence: the daemon back and saying so), so the recompute cannot be overwritten by a copy the
  hang held. vLLM 0.34 is told by the job's failure (``TransferResult.success = False``: the
  request recomputed) under either connector; 0.33 through
  ``hicache_vllm.connector.HicachedOffloadingConnector``'s load-error path (the blocks), and
  with vLLM 0.33's own ``OffloadingConnector``, which cannot be told, the load waits for the
  daemon (the hold stands) and loads. Then new requests are stored and hit within about a
  second of the daemon being back. The same with the spec's defaults and a 13 s hang.
- Keys gone before the load (``KEY_NOT_FOUND``, given up at once): recomputed or only that
  request failed (``kv_load_failure_policy``), for asynchronous and synchronous loads, the
  request beside it untouched; with vLLM's own connector a synchronous load's failure stops
  the engine (an asynchronous one fails only its request).
- (A daemon restarted: tests/integrations/vllm/test_vllm_offloading.py, hits within about a second.)
- ``reset_cache`` (vLLM's connector reset) drops this engine's holds, not the shared pages.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from tests.daemon_proc import DaemonProc, Daemons
from tests.vllm_harness import model_dir
from tests.vllm_runs import (
    BS,
    CLEAN,
    CORE,
    NEWEST,
    engine,
    reports_failures,
    result,
    run,
    wait_file,
)

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


def hang(tmp_path: Path, daemon: DaemonProc, model: str, vllm: str, connector: str,
         hang_s: float, **args: object) -> dict[str, object]:
    """The scenario ``hang_between_hit_and_load`` with the daemon stopped ``hang_s`` between
    the hit and its load."""
    sync = tmp_path / "sync"
    sync.mkdir()
    proc = engine("hang_between_hit_and_load", vllm=vllm, model=model, target=daemon.target,
                  sync_dir=str(sync), connector=connector, policy="recompute",
                  daemon_pid=daemon.proc.pid, **args)
    try:
        wait_file(sync / "loading", proc)
        daemon.pause()
        stopped = time.monotonic()
        (sync / "stopped").touch()
        time.sleep(max(hang_s - (time.monotonic() - stopped), 0))
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
    return got


@CORE
@pytest.mark.parametrize("connector", ["hicached", "plain"])
def test_a_daemon_hung_between_hit_and_load_never_leaves_wrong_kv(
        tmp_path: Path, daemon: DaemonProc, model: str, connector: str, vllm: str) -> None:
    got: dict[str, Any] = hang(tmp_path, daemon, model, vllm, connector, HANG_S)
    assert got["first"] == CLEAN and got["c"] == CLEAN  # the request beside it: untouched
    assert got["b"] == CLEAN, got["b"]  # never the zeroed rows it would have decoded on
    assert got["finish"]["b"] == "length" and got["emitted"]["b"] == 1
    if reports_failures(vllm):
        # given up after load_retry_s and told to vLLM as the job's failure (it recomputes the
        # request: b ran with nothing loaded, and its later lookups skip the offloaded cache)
        # only once the daemon was back and said no copy of the session could land
        assert not got["settled_before_continue"], got["settled_s"]
        assert got["worker"]["load_failures"] == 1 and got["invalid_blocks"] == 0
        assert got["worker"]["load_fence_waits"] == 1
        assert (got["b_loaded"], got["worker"]["loads"]) == (0, 0), got["worker"]
    elif connector == "hicached":
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


LONG_HANG_S = 13.0
"""A hang past every deadline the spec has by default: ``load_retry_s`` (10 s), the daemon's
lease, ``rpc_timeout_s`` (5 s), ``down_after_s`` (10 s)."""


def test_a_13_s_hang_with_the_spec_s_defaults_never_leaves_wrong_kv(
        tmp_path: Path, daemon: DaemonProc, model: str) -> None:
    """As above on the newest vLLM, with the spec's default deadlines and the daemon stopped
    13 s between the hit and its load: the load is given up after ``load_retry_s``, told to
    vLLM only once the daemon is back (the fence), and the request is computed exact; the
    links come back by themselves and new requests hit again within two seconds."""
    got: dict[str, Any] = hang(tmp_path, daemon, model, NEWEST, "hicached", LONG_HANG_S,
                               defaults=True)
    assert got["first"] == CLEAN and got["c"] == CLEAN
    assert got["b"] == CLEAN, got["b"]
    assert got["finish"]["b"] == "length" and got["emitted"]["b"] == 1
    assert not got["settled_before_continue"], got["settled_s"]
    assert got["settled_s"] >= LONG_HANG_S - 1, got["settled_s"]  # held until the fence
    assert got["worker"]["load_failures"] == 1 and got["worker"]["load_fence_waits"] == 1
    assert got["b_loaded"] in (0, 8 * BS)
    after = got["after"]
    assert after["first_hit_s"] is not None and after["first_hit_s"] < 2.0, after
    assert "Traceback" not in got["stderr"]


@pytest.mark.parametrize("policy, sync_load", [("recompute", False), ("fail", False),
                                               ("recompute", True), ("fail", True)],
                         ids=["recompute-async", "fail-async", "recompute-sync", "fail-sync"])
def test_keys_gone_before_the_load_recompute_or_fail_that_request_only(
        daemon: DaemonProc, model: str, policy: str, sync_load: bool) -> None:
    got = run("keys_gone_before_load", model=model, target=daemon.target,
              connector="hicached", policy=policy, sync_load=sync_load)
    assert got["removed"] == [6] and not got["raised"]
    # told as the job's failure where vLLM takes it (an asynchronous load, 0.34), else as
    # the blocks not loaded (the connector's load-error path)
    told_by_blocks = sync_load or not reports_failures(NEWEST)
    assert got["worker"]["load_failures"] == 1
    assert got["invalid_blocks"] == (6 if told_by_blocks else 0)
    assert got["took_s"] < 3  # given up at once (KEY_NOT_FOUND), not after load_retry_s
    assert got["c"] == CLEAN and got["finish"]["c"] == "length"  # the rest: untouched
    if policy == "recompute":
        assert got["b"] == CLEAN and got["finish"]["b"] == "length"
        assert got["emitted"]["b"] == 1
    else:  # vLLM fails that request: no token of it reaches its client
        assert got["finish"]["b"] == "error" and got["emitted"].get("b", 0) == 0


@pytest.mark.parametrize("sync_load", [False, True], ids=["async", "sync"])
def test_keys_gone_before_the_load_under_vllms_own_connector(
        daemon: DaemonProc, model: str, sync_load: bool) -> None:
    """vLLM's own ``OffloadingConnector`` (its default policy: "fail"): vLLM 0.34 takes an
    asynchronous load's failure and fails that request only; a synchronous load's it cannot
    take (the request already ran on those blocks), so the engine's step raises rather than
    decode on them."""
    got = run("keys_gone_before_load", model=model, target=daemon.target, connector="plain",
              sync_load=sync_load)
    if sync_load or not reports_failures(NEWEST):
        assert got["raised"].startswith("hicache_vllm.worker.LoadFailed: "), got["raised"]
        assert "KEY_NOT_FOUND" in got["raised"]
        assert got["b"] is None and "b" not in got["finish"]  # it never completed
    else:
        assert not got["raised"] and got["worker"]["load_failures"] == 1
        assert got["finish"]["b"] == "error" and got["emitted"].get("b", 0) == 0
        assert got["c"] == CLEAN and got["finish"]["c"] == "length"  # the rest: untouched


def test_a_connector_reset_keeps_the_pages_other_engines_hit(daemon: DaemonProc,
                                                            model: str) -> None:
    first = run("store_only", model=model, target=daemon.target, blocks=4, seed=3)
    assert first["worker"]["store_pages"] == 4
    got = run("reset_keeps_shared_pages", model=model, target=daemon.target, blocks=4)
    assert got["held"] == 4 and got["manager"]["resets"] == 1
    assert got["manager"]["reset_holds_released"] == 4  # its own holds, let go
    assert got["loaded"] == 4 * BS and got["b"] == CLEAN  # its own pages: still there
    assert got["theirs_loaded"] == 4 * BS and got["theirs"] == CLEAN  # the other engine's
