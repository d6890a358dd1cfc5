from __future__ import annotations

import subprocess
import sys

import pytest

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


def test_a_cuda_vmm_buffer_crosses_the_wire_field_by_field() -> None:
    from hicache.buffers import MAX_FDS, DeviceBufferSpec
    from hicache.codec import buffer_from_proto, buffer_to_proto
    from hicache.errors import SpecInvalid
    from hicache.specs import DType, Role

    b = DeviceBufferSpec(member="kv", role=Role.V, layer=3, shape=(64, 2, 8),
                         dtype=DType.BFLOAT16, strides=(), transport="cuda_vmm",
                         fd_indices=(2, 0, 1), chunk_bytes=(2 << 20, 4 << 20, 2 << 20),
                         device_uuid="GPU-abc", offset=12_288, nbytes=2048)
    msg = buffer_to_proto(b)
    assert msg.WhichOneof("handle") == "cuda_vmm"
    assert buffer_from_proto(pb.DeviceBuffer.FromString(msg.SerializeToString()), 0) == b
    uneven = pb.DeviceBuffer.FromString(msg.SerializeToString())
    uneven.cuda_vmm.chunk_bytes.append(2 << 20)
    many = pb.DeviceBuffer.FromString(msg.SerializeToString())
    many.cuda_vmm.fd_indices[:] = list(range(MAX_FDS + 1))
    many.cuda_vmm.chunk_bytes[:] = [2 << 20] * (MAX_FDS + 1)
    for bad in (uneven, many):  # a domain error naming the buffer, of bounded size
        with pytest.raises(SpecInvalid, match=r"buffers\[7\]") as info:
            buffer_from_proto(bad, 7)
        assert len(str(info.value)) < 300
