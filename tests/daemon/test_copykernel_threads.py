"""The native copy kernel's worker pool under concurrency: many callers, mixed thread counts.

One caller at a time dispatches to the persistent workers (others copy on their own thread);
consecutive dispatches ask for different numbers of helpers, and a helper that is slow to wake
must neither run a later dispatch's job twice nor miss it. Every copy is checked against
zeroed destinations, and the calls run from several Python threads at once (the kernel
releases the GIL), so a job that ran twice, early or on a dead caller's plan shows as wrong
bytes or a crash.
"""

from __future__ import annotations

import random
import threading

import numpy as np
import pytest

from hicached.copy import native
from tests.copy_jobs import LAYERS, PAGE_BYTES, PAGES, one_copy

pytestmark = pytest.mark.skipif(native.KERNEL is None, reason="native kernel not built")

def test_many_callers_with_mixed_thread_counts_copy_exactly() -> None:
    callers, rounds = 6, 200
    bad: list[str] = []

    def caller(seed: int) -> None:
        rng = random.Random(seed)
        src = np.frombuffer(rng.randbytes(LAYERS * PAGES * PAGE_BYTES), dtype=np.uint8
                            ).reshape(LAYERS, PAGES, PAGE_BYTES).copy()
        dst = np.empty_like(src)
        for r in range(rounds):
            if not one_copy(rng, src, dst):
                bad.append(f"caller {seed} round {r}")
                return

    threads = [threading.Thread(target=caller, args=(s,)) for s in range(callers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not bad, bad[:5]


def test_one_caller_alternating_thread_counts() -> None:
    rng = random.Random(7)
    src = np.frombuffer(rng.randbytes(LAYERS * PAGES * PAGE_BYTES), dtype=np.uint8
                        ).reshape(LAYERS, PAGES, PAGE_BYTES).copy()
    dst = np.empty_like(src)
    for _ in range(2500):
        assert one_copy(rng, src, dst)


SPIN_PROBE = """
import random, resource, sys, time
import numpy as np
from tests.copy_jobs import LAYERS, PAGES, PAGE_BYTES, one_copy
from hicached.copy import native

def cpu():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime

def copies(n):
    rng = random.Random(1)
    src = np.frombuffer(rng.randbytes(LAYERS * PAGES * PAGE_BYTES), dtype=np.uint8
                        ).reshape(LAYERS, PAGES, PAGE_BYTES).copy()
    dst = np.zeros_like(src)
    t0 = cpu()
    for _ in range(n):
        assert one_copy(rng, src, dst)
        time.sleep(0.003)  # the next request comes 3 ms later
    time.sleep(0.2)
    return cpu() - t0

copies(5)  # first-time costs out of the measure: the helpers' start, fresh buffer pages
default = copies(60)  # as the daemon starts: set_copy_spin never called
native.KERNEL.set_copy_spin(int(sys.argv[1]))
spun = copies(60)
native.KERNEL.set_copy_spin(0)
print(default, spun, copies(60))
"""


def test_copy_threads_do_not_spin_after_each_job_by_default() -> None:
    """60 small parallel copies 3 ms apart, in a fresh process: by default the helpers sleep
    after each job; told to spin 2 ms (copy_spin_us = 2000), they burn that after every one."""
    import subprocess
    import sys

    from tests.daemon_proc import REPO

    out = subprocess.run([sys.executable, "-c", SPIN_PROBE, "2000000"], cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    default, spun, zero = map(float, out.stdout.split())
    assert default - zero < 0.03, (default, zero)  # a 1 ms spin per job would add >= 0.06
    assert spun - zero > 0.06, (spun, zero)  # >= 60 x 2 ms on at least one helper


def _cpu_seconds_while_idle(spin_ns: int) -> float:
    """Process CPU time over 0.4 s of idleness right after a parallel copy."""
    import resource
    import time

    kernel = native.KERNEL
    assert kernel is not None
    old = kernel.set_copy_spin(spin_ns)
    try:
        rng = random.Random(1)
        src = np.frombuffer(rng.randbytes(LAYERS * PAGES * PAGE_BYTES), dtype=np.uint8
                            ).reshape(LAYERS, PAGES, PAGE_BYTES).copy()
        assert one_copy(rng, src, np.zeros_like(src))
        t0 = resource.getrusage(resource.RUSAGE_SELF)
        time.sleep(0.4)
        t1 = resource.getrusage(resource.RUSAGE_SELF)
        return (t1.ru_utime + t1.ru_stime) - (t0.ru_utime + t0.ru_stime)
    finally:
        kernel.set_copy_spin(old)


# the spin is measured as the CPU its threads get in 0.4 s of wall-clock time: beside other
# test processes on two cores they get a part of it (0.034 s once, against the 0.06 s bound)
@pytest.mark.alone
def test_copy_threads_sleep_after_a_job_unless_told_to_spin() -> None:
    """By default a worker sleeps as soon as its job is done: an idle daemon burns no CPU
    after a copy. A spin set with set_copy_spin (copy_spin_us) is spent, and only then."""
    assert native.KERNEL is not None
    with pytest.raises(ValueError):
        native.KERNEL.set_copy_spin(-1)
    with pytest.raises(ValueError):
        native.KERNEL.set_copy_spin(200_000_000)  # over 100 ms
    assert _cpu_seconds_while_idle(0) < 0.03
    # every helper of the copy spins 100 ms: at least one CPU busy for most of it
    assert _cpu_seconds_while_idle(100_000_000) > 0.06
