"""Random and adversarial requests through the real gRPC API. Every one gets a structured error
(or is a harmless valid read), the daemon stays up, and the pool's bytes do not change."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch
from google.rpc import error_details_pb2
from grpc_status import rpc_status
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hicache.codec import buffer_to_proto
from hicache.indices import indices_to_bytes
from hicache.specs import DType, KVGeometry, Layout, PoolKind, PoolSpec
from hicache.v1 import hicache_pb2 as pb
from hicache.v1 import hicache_pb2_grpc as pb_grpc
from hicache_client import HiCacheClient, ShmDeviceBuffers
from tests.daemon_proc import DaemonProc, start_daemon
from tests.reliability.figures import record

PS = 4
PAGES = 32
SPEC = PoolSpec("fuzz", KVGeometry(PoolKind.MHA, DType.BFLOAT16, 2, 2, 32), PS,
                Layout.PAGE_FIRST, size_tokens=PAGES * PS)
COUNT = {"requests": 0, "structured_errors": 0, "valid_reads": 0}


class World:
    def __init__(self, d: DaemonProc, tmp: Path) -> None:
        self.daemon = d
        self.client = HiCacheClient(d.target, reconnect_seconds=1)
        self.client.create_pool(SPEC)
        self.host = self.client.alloc(SPEC.name, PAGES * PS)
        self.bufs = ShmDeviceBuffers.create(SPEC, PAGES * PS, d.shm_dir, prefix="fuzz")
        for t in self.bufs.all_tensors():
            raw = t.view(torch.uint8)
            raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8))
        self.session = self.client.open_session(SPEC.name, "fuzz", self.bufs.descriptors,
                                                lease_ms=600_000)
        self.session.backup(self.host, torch.arange(PAGES * PS))
        self.scratch = ShmDeviceBuffers.create(SPEC, PAGES * PS, d.shm_dir, prefix="scratch")
        self.check = self.client.open_session(SPEC.name, "check", self.scratch.descriptors,
                                              lease_ms=600_000)
        self.channel = grpc.insecure_channel(d.target)
        self.stub = pb_grpc.HostCacheStub(self.channel)
        self.tmp = tmp

    def fingerprint(self) -> str:
        self.check.load(self.host, torch.arange(PAGES * PS))
        h = hashlib.sha256()
        for t in self.scratch.all_tensors():
            h.update(t.view(torch.uint8)[: PAGES * PS].numpy().tobytes())
        return h.hexdigest()


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    tmp = tmp_path_factory.mktemp("fuzz")
    d = start_daemon(tmp, "--lease-seconds", "600", "--memory-budget", "64MiB")
    w = World(d, tmp)
    before = w.fingerprint()
    yield w
    assert w.client.get_info().serving, "the daemon went down"
    assert w.fingerprint() == before, "pool bytes changed under fuzzing"
    record("fuzz_grpc", **COUNT)
    w.session.close()
    w.check.close()
    w.bufs.close()
    w.scratch.close()
    w.channel.close()
    w.client.close()
    assert d.stop() == 0, d.log()


def call(fn: object, request: object, allow_ok: bool) -> None:
    COUNT["requests"] += 1
    try:
        fn(request, timeout=10)  # type: ignore[operator]
    except grpc.RpcError as err:
        status = rpc_status.from_call(err)
        assert status is not None, f"unstructured error {err.code()}: {err.details()}"
        infos = []
        for d in status.details:
            info = error_details_pb2.ErrorInfo()
            if d.Unpack(info):
                infos.append(info)
        assert infos and infos[0].domain == "hicache.v1" and infos[0].reason, status
        assert err.code() != grpc.StatusCode.INTERNAL, err.details()
        COUNT["structured_errors"] += 1
        return
    assert allow_ok, "an invalid request was accepted"
    COUNT["valid_reads"] += 1


FUZZ = settings(max_examples=150, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.function_scoped_fixture,
                                       HealthCheck.too_slow])
INDEX = st.one_of(st.integers(-(2**63), 2**63 - 1), st.integers(-8, PAGES * PS + 8))


@FUZZ
@given(host=st.binary(max_size=256), dev=st.binary(max_size=256),
       begin=st.integers(-3, 5), end=st.integers(-3, 5))
def test_load_with_random_bytes(world: World, host: bytes, dev: bytes, begin: int,
                                end: int) -> None:
    call(world.stub.Load, pb.TransferRequest(session_id=world.session.session_id,
                                             host_indices=host, device_indices=dev,
                                             layer_begin=begin, layer_end=end), allow_ok=True)


@FUZZ
@given(host=st.lists(INDEX, max_size=24), dev=st.lists(INDEX, max_size=24))
def test_load_with_adversarial_indices(world: World, host: list[int], dev: list[int]) -> None:
    call(world.stub.Load, pb.TransferRequest(
        session_id=world.session.session_id, host_indices=indices_to_bytes(np.array(host)),
        device_indices=indices_to_bytes(np.array(dev))), allow_ok=True)


@st.composite
def invalid_backup(draw: st.DrawFn) -> tuple[np.ndarray, np.ndarray]:
    n = draw(st.integers(1, 8))
    hp = np.array(draw(st.lists(st.integers(0, PAGES - 1), min_size=n, max_size=n,
                                unique=True)))
    dp = np.array(draw(st.lists(st.integers(0, PAGES - 1), min_size=n, max_size=n,
                                unique=True)))
    h = (hp[:, None] * PS + np.arange(PS)).reshape(-1)
    d = (dp[:, None] * PS + np.arange(PS)).reshape(-1)
    how = draw(st.sampled_from(["negative", "huge", "truncate", "mismatch", "dup", "shift",
                                "device_huge"]))
    i = draw(st.integers(0, h.size - 1))
    if how == "negative":
        h[i] = -draw(st.integers(1, 2**62))
    elif how == "huge":
        h[i] = PAGES * PS + draw(st.integers(0, 2**62))
    elif how == "truncate":
        h, d = h[:-1], d[:-1]
    elif how == "mismatch":
        d = d[:-PS] if d.size > PS else np.concatenate([d, d + PAGES * PS])
    elif how == "dup":
        h, d = np.concatenate([h, h[:PS]]), np.concatenate([d, d[:PS] + 1000 * PS])
    elif how == "shift":
        h[i] += draw(st.sampled_from([1, -1, PS + 1])) if i % PS else 1
    else:
        d[i] = 10**12
    return h, d


@FUZZ
@given(batch=invalid_backup())
def test_invalid_backups_change_nothing(world: World,
                                        batch: tuple[np.ndarray, np.ndarray]) -> None:
    h, d = batch
    call(world.stub.Backup, pb.TransferRequest(
        session_id=world.session.session_id, host_indices=indices_to_bytes(h),
        device_indices=indices_to_bytes(d)), allow_ok=False)


@FUZZ
@given(sid=st.text(max_size=40), pool=st.text(max_size=40).map(lambda s: "nx-" + s),
       n=st.integers(-(2**63), 2**63 - 1))
def test_unknown_ids(world: World, sid: str, pool: str, n: int) -> None:
    req = pb.TransferRequest(session_id=sid, host_indices=b"", device_indices=b"")
    call(world.stub.Backup, req, allow_ok=False)
    call(world.stub.Heartbeat, pb.HeartbeatRequest(session_id=sid), allow_ok=False)
    call(world.stub.CloseSession, pb.CloseSessionRequest(session_id=sid), allow_ok=False)
    call(world.stub.Alloc, pb.AllocRequest(pool=pool, num_tokens=n), allow_ok=False)
    call(world.stub.Free, pb.FreeRequest(pool=pool, host_indices=b"\x00" * 8), allow_ok=False)
    call(world.stub.GetPool, pb.GetPoolRequest(name=pool), allow_ok=False)
    call(world.stub.DeletePool, pb.DeletePoolRequest(name=pool), allow_ok=False)


DIM = st.one_of(st.integers(-5, 5), st.integers(2**20, 2**62), st.just(0))


@FUZZ
@given(kind=st.integers(0, 6), dtype=st.integers(0, 8), layout=st.integers(0, 5),
       page=st.integers(-4, 2**40), dims=st.lists(DIM, min_size=8, max_size=8),
       size=st.one_of(st.integers(-(2**63), 2**63 - 1), st.integers(1, 2**40)))
def test_absurd_geometries(world: World, kind: int, dtype: int, layout: int, page: int,
                           dims: list[int], size: int) -> None:
    spec = pb.PoolSpec(name="nx-absurd", page_size=page, size_tokens=size)
    spec.kind, spec.dtype, spec.layout = kind, dtype, layout  # type: ignore[assignment]
    for field, v in zip(("layer_num", "head_num", "head_dim", "v_head_dim", "kv_lora_rank",
                         "qk_rope_head_dim", "index_head_dim", "quant_block_size"), dims,
                        strict=True):
        setattr(spec, field, v)
    try:
        call(world.stub.CreatePool, pb.CreatePoolRequest(spec=spec), allow_ok=True)
    finally:
        try:  # a small valid one may be created: it is another pool, remove it
            world.stub.DeletePool(pb.DeletePoolRequest(name="nx-absurd"), timeout=10)
        except grpc.RpcError:
            pass


@pytest.mark.parametrize("case", ["proc_mem", "etc_passwd", "symlink_out", "dir_itself",
                                  "dotdot", "world_writable", "fifo", "too_small"])
def test_hostile_shm_paths(world: World, case: str) -> None:
    shm = Path(world.daemon.shm_dir)
    target = world.tmp / "outside"
    target.write_bytes(b"\x00" * (1 << 20))
    path = {"proc_mem": "/proc/self/mem", "etc_passwd": "/etc/passwd",
            "dir_itself": str(shm), "dotdot": str(shm / ".." / "outside")}.get(case, "")
    if case == "symlink_out":
        path = str(shm / f"link-{os.getpid()}")
        if not os.path.lexists(path):
            os.symlink(target, path)
    elif case == "world_writable":
        path = str(shm / "ww")
        Path(path).write_bytes(b"\x00" * (1 << 20))
        os.chmod(path, 0o666)
    elif case == "fifo":
        path = str(shm / "fifo")
        if not os.path.exists(path):
            os.mkfifo(path, 0o600)
    elif case == "too_small":
        path = str(shm / "small")
        Path(path).write_bytes(b"\x00" * 16)
    bufs = [buffer_to_proto(b) for b in world.bufs.descriptors]
    bufs[0].shm.path = path
    call(world.stub.OpenSession, pb.OpenSessionRequest(pool=SPEC.name, worker_id="evil",
                                                       buffers=bufs), allow_ok=False)


def test_oversized_message_is_refused_and_the_daemon_stays_up(world: World) -> None:
    big = b"\x00" * (65 << 20)
    COUNT["requests"] += 1
    with pytest.raises(grpc.RpcError) as exc:
        world.stub.Load(pb.TransferRequest(session_id=world.session.session_id,
                                           host_indices=big, device_indices=b""), timeout=60)
    assert exc.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert world.client.get_info().serving


KEY = st.one_of(st.binary(max_size=70), st.binary(min_size=1, max_size=64))


@FUZZ
@given(keys=st.lists(KEY, max_size=6), dev=st.one_of(st.binary(max_size=96),
                                                      st.lists(INDEX, max_size=24)),
       begin=st.integers(-3, 5), end=st.integers(-3, 5))
def test_keyed_requests_with_random_keys_and_indices(world: World, keys: list[bytes],
                                                     dev: bytes | list[int], begin: int,
                                                     end: int) -> None:
    """The pool is full of raw pages (never evicted): a valid Store finds no space, so every
    keyed request leaves the pool's bytes as they were."""
    d = dev if isinstance(dev, bytes) else indices_to_bytes(np.array(dev))
    sid = world.session.session_id
    call(world.stub.Store, pb.StoreRequest(session_id=sid, keys=keys, device_indices=d,
                                           layer_begin=begin, layer_end=end), allow_ok=True)
    call(world.stub.LoadKeys, pb.LoadKeysRequest(session_id=sid, keys=keys, device_indices=d,
                                                 layer_begin=begin, layer_end=end),
         allow_ok=not keys)  # nothing is ever stored here: KEY_NOT_FOUND at best
    call(world.stub.Lookup, pb.LookupRequest(pool=SPEC.name, keys=keys), allow_ok=True)
    call(world.stub.RemoveKeys, pb.RemoveKeysRequest(pool=SPEC.name, keys=keys), allow_ok=True)


@FUZZ
@given(pool=st.text(max_size=40).map(lambda s: "nx-" + s), seq=st.integers(-(2**63), 2**63 - 1))
def test_watch_of_an_unknown_pool_is_a_structured_error(world: World, pool: str,
                                                        seq: int) -> None:
    stream = world.stub.WatchEvents(pb.WatchEventsRequest(pool=pool, after_seq=seq), timeout=10)
    call(lambda request, timeout: next(iter(stream)), None, allow_ok=False)
    call(world.stub.ClearPool, pb.ClearPoolRequest(pool=pool), allow_ok=False)
