from __future__ import annotations

import subprocess
import sys

from hicache.v1 import hicache_pb2 as pb
from tests.daemon_proc import REPO


def test_committed_stubs_match_the_proto() -> None:
    out = subprocess.run([sys.executable, "scripts/gen_protos.py", "--check"], cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr


def test_contract_names() -> None:
    svc = pb.DESCRIPTOR.services_by_name["HostCache"]
    assert svc.full_name == "hicache.v1.HostCache"
    for method in ("GetInfo", "CreatePool", "GetPool", "ListPools", "DeletePool",
                   "OpenSession", "CloseSession", "Alloc", "Free", "Backup", "Load", "Drain"):
        assert method in svc.methods_by_name
    assert [v.name.rsplit("_", 1)[-1] for v in pb.PoolKind.DESCRIPTOR.values][1:] == [
        "MHA", "MLA", "INDEXER", "LOGICAL", "OPAQUE"]
    assert pb.POOL_KIND_DSA_INDEXER and pb.LAYOUT_PAGE_FIRST_DIRECT and pb.BUFFER_ROLE_INDEX
    assert pb.TransferRequest.DESCRIPTOR.fields_by_name["host_indices"].type == 12  # bytes
