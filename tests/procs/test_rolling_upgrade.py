"""Workers upgraded before the daemon: this tree's client against a daemon of an earlier tree.

A node upgrades its inference servers and its daemon at different times, so a client must speak
to the daemon it finds. The earlier daemon here is e694450's (the last commit before Store
carried a deadline): its fast path took ``FLAG_DEADLINE`` for loads alone and refused a Store
frame with one (``INDICES_MALFORMED``: 8 bytes left over), which every Store of this client
sent until the daemon's ``GetInfo.fast_path_flags`` had to say ``STORE_DEADLINE`` first. Its
tree is checked out and built beside this one (``hicache_bench.compare.checkout``); skipped
where the clone lacks that commit.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from hicache.specs import DType, PoolKind
from hicache_bench.compare import Tree, checkout, remove
from hicache_client import HiCacheClient, ShmDeviceBuffers
from tests.daemon_proc import REPO, wait_serving
from tests.helpers import geometry_for, spec

EARLIER = "e694450"
SPEC = spec(geometry_for(PoolKind.MHA, DType.BFLOAT16), page_size=16, size_tokens=16 * 64,
            name="upgrade")


@pytest.fixture(scope="module")
def earlier_tree(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Tree]:
    have = subprocess.run(["git", "-C", str(REPO), "cat-file", "-e", f"{EARLIER}^{{commit}}"],
                          capture_output=True)
    if have.returncode != 0:
        pytest.skip(f"this clone has no {EARLIER}")
    where = tmp_path_factory.mktemp("earlier") / "tree"
    tree = checkout(REPO, EARLIER, where)
    yield tree
    remove(REPO, tree)


@pytest.fixture
def earlier_daemon(earlier_tree: Tree, tmp_path: Path) -> Iterator[str]:
    shm = Path(f"/dev/shm/hicache-upgrade-{os.getpid()}")
    shm.mkdir(exist_ok=True)
    sock = tmp_path / "d.sock"
    proc = subprocess.Popen(
        [sys.executable, "-m", "hicached", "serve", "--listen", f"unix:{sock}", "--shm-dir",
         str(shm), "--state-dir", str(shm / "state"), "--metrics-listen", "",
         "--memory-budget", "1GiB", "--reserve", "0"],
        env=earlier_tree.env(), cwd=earlier_tree.path, stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE)
    try:
        wait_serving(f"unix:{sock}")
        yield f"unix:{sock}"
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=30)
        subprocess.run(["rm", "-rf", str(shm)], check=False)
        assert b"Traceback" not in err, err.decode(errors="replace")[-2000:]


def test_this_client_stores_and_loads_through_an_earlier_daemons_fast_path(
        earlier_daemon: str) -> None:
    with HiCacheClient(earlier_daemon) as c, \
            ShmDeviceBuffers.create(SPEC, 4 * 16, sealed=True) as bufs:
        c.create_pool(SPEC)
        s = c.open_session(SPEC.name, "w", bufs.descriptors, fds=bufs.fds, heartbeat=False)
        gen = torch.Generator().manual_seed(7)
        for t in bufs.all_tensors():
            t.view(torch.uint8).copy_(torch.randint(0, 256, t.view(torch.uint8).shape,
                                                    dtype=torch.uint8, generator=gen))
        before = [t.view(torch.uint8).clone() for t in bufs.all_tensors()]
        keys = [b"upgrade-%d" % i for i in range(2)]
        assert s.store(keys, torch.arange(32)).status == bytes([1, 1])
        assert c.data_path == "fast"
        assert c.lookup(SPEC.name, keys).hit_prefix == 2
        for t in bufs.all_tensors():  # rows zeroed first: the load must bring the bytes
            t[32:64].zero_()
        s.load_keys(keys, torch.arange(32, 64))
        for t, b in zip(bufs.all_tensors(), before, strict=True):
            assert torch.equal(t.view(torch.uint8)[32:64], b[:32])
        s.close()


def test_what_an_earlier_daemon_does_not_say_it_reads_is_never_sent_it(
        earlier_daemon: str) -> None:
    """A daemon from before ``GetInfo.fast_path_flags`` reads only the flags the framing had
    then (layer events, holds, deadlines): a held Lookup (``FLAG_PROMISE`` would ask its reply
    for more than it sends), a Store with a namespace or lookahead tokens (their trailers
    would be bytes left over) reach it in frames it reads, or over gRPC, and succeed."""
    with HiCacheClient(earlier_daemon) as c, \
            ShmDeviceBuffers.create(SPEC, 4 * 16, sealed=True) as bufs:
        c.create_pool(SPEC)
        s = c.open_session(SPEC.name, "w", bufs.descriptors, fds=bufs.fds, heartbeat=False)
        keys = [b"unsaid-%d" % i for i in range(3)]
        assert s.store(keys[:1], torch.arange(16), lora_name="adapter").stored == 1
        assert s.store(keys[1:], torch.arange(32), token_ids=list(range(32)),
                       lookahead_token_ids=[[1], [2]]).stored == 2
        held = s.lookup(keys, hold_ms=5000)
        assert (held.hit_prefix, held.held) == (3, 3)
        assert c.data_path == "fast"
        s.close()

