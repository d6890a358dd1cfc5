from __future__ import annotations

import os

import pytest

from hicache.errors import HostMemoryInsufficient, PinFailed
from hicached.core.memory import Backing, HostMemory
from hicached.core.system import available_bytes, check_budget
from hicached.cuda.pinner import default_pinner


class FakePinner:
    def __init__(self, fail_at: int | None = None) -> None:
        self.fail_at = fail_at
        self.registered: list[tuple[int, int]] = []
        self.unregistered: list[int] = []

    def register(self, address: int, nbytes: int) -> None:
        if self.fail_at is not None and len(self.registered) == self.fail_at:
            raise RuntimeError("cudaHostRegister failed")
        self.registered.append((address, nbytes))

    def unregister(self, address: int) -> None:
        self.unregistered.append(address)


@pytest.mark.parametrize("backing", [Backing.ANONYMOUS, Backing.MEMFD])
def test_region_is_zeroed_writable_and_closes(backing: Backing) -> None:
    m = HostMemory(3 << 20, backing=backing, prefault_threads=2)
    arr = m.array()
    assert arr.size == 3 << 20 and not arr.any()
    arr[::4096] = 7
    assert m.prefault_seconds > 0
    if backing is Backing.MEMFD:
        assert m.fd >= 0
        assert os.fstat(m.fd).st_size == 3 << 20
    del arr
    m.close()
    assert m.closed and m.fd == -1
    with pytest.raises(RuntimeError):
        m.array()


def test_file_backing_is_shareable_and_removed_on_close(tmp_path: object) -> None:
    path = os.path.join(str(tmp_path), "pool")
    m = HostMemory(1 << 20, backing=Backing.FILE, path=path)
    m.array()[:4] = [1, 2, 3, 4]
    with open(path, "rb") as f:
        assert f.read(4) == bytes([1, 2, 3, 4])
    assert oct(os.stat(path).st_mode & 0o777) == "0o600"
    m.close()
    assert not os.path.exists(path)


def test_pinning_is_chunked_and_undone_on_close(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("hicached.core.memory.PIN_CHUNK", 1 << 20)
    p = FakePinner()
    m = HostMemory(3 << 20, pinner=p)
    assert [n for _, n in p.registered] == [1 << 20] * 3
    assert m.pinned_bytes == 3 << 20
    m.close()
    assert sorted(p.unregistered) == sorted(a for a, _ in p.registered)


def test_failed_pinning_rolls_back_and_frees(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("hicached.core.memory.PIN_CHUNK", 1 << 20)
    p = FakePinner(fail_at=2)
    with pytest.raises(PinFailed, match="cudaHostRegister failed") as info:
        HostMemory(3 << 20, pinner=p)
    assert info.value.reason == "PIN_FAILED" and "LimitMEMLOCK" in info.value.message
    assert info.value.metadata["pinned_before_failure"] == str(2 << 20)
    assert sorted(p.unregistered) == sorted(a for a, _ in p.registered)
    assert len(p.registered) == 2


def test_cpu_only_torch_never_pins() -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this host has CUDA")
    assert default_pinner() is None


def test_budget_refusal_gives_both_numbers() -> None:
    with pytest.raises(HostMemoryInsufficient) as exc:
        check_budget(available_bytes() * 2, reserve_bytes=1 << 30)
    md = exc.value.metadata
    assert int(md["requested_bytes"]) > int(md["available_bytes"])
    assert md["reserve_bytes"] == str(1 << 30)
    check_budget(1 << 20, reserve_bytes=0)
