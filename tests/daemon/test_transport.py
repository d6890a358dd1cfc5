from __future__ import annotations

import ctypes
import os
from pathlib import Path

import pytest

from hicache.buffers import DeviceBufferSpec
from hicache.errors import GeometryMismatch, ShmPathRejected
from hicache.specs import DType, Role
from hicached.transport.shm import ShmTransport


def buf(path: str, nbytes: int = 4096, offset: int = 0, layer: int = 0,
        shape: tuple[int, ...] = (16, 2, 64)) -> DeviceBufferSpec:
    return DeviceBufferSpec(member="kv", role=Role.K, layer=layer, shape=shape,
                            dtype=DType.BFLOAT16, strides=(), transport="shm", path=path,
                            offset=offset, nbytes=nbytes)


@pytest.fixture
def shm(tmp_path: Path) -> Path:
    d = tmp_path / "shm"
    d.mkdir()
    return d


def make(path: Path, size: int = 8192, mode: int = 0o600) -> str:
    path.write_bytes(b"\x01" * size)
    os.chmod(path, mode)
    return str(path)


def test_good_file_is_mapped_and_shared(shm: Path) -> None:
    p = make(shm / "w")
    att = ShmTransport(str(shm)).attach([buf(p), buf(p, offset=4096, layer=1)])
    assert att.buffers is not None and att.nbytes == 8192
    k = att.buffers.buffers["kv"][Role.K]  # raw memory of the mapping: no torch
    assert len(k) == 2 and tuple(k[0].shape) == (16, 2, 64)
    assert k[1].data_ptr() == k[0].data_ptr() + 4096
    ctypes.memmove(k[1].data_ptr(), b"\x07\x09", 2)
    with open(p, "rb") as f:
        f.seek(4096)
        assert f.read(2) == b"\x07\x09"  # the same bytes, not a copy
    att.release()
    att.release()


@pytest.mark.parametrize("case", ["outside", "symlink", "directory", "world_writable",
                                  "too_small", "relative", "missing", "proc", "dotdot",
                                  "fifo", "shape_bigger_than_nbytes"])
def test_hostile_paths_are_rejected(shm: Path, tmp_path: Path, case: str) -> None:
    t = ShmTransport(str(shm))
    b = None
    if case == "outside":
        b = buf(make(tmp_path / "elsewhere"))
    elif case == "symlink":
        os.symlink(make(tmp_path / "target"), shm / "link")
        b = buf(str(shm / "link"))
    elif case == "directory":
        (shm / "dir").mkdir()
        b = buf(str(shm / "dir"))
    elif case == "world_writable":
        b = buf(make(shm / "ww", mode=0o666))
    elif case == "too_small":
        b = buf(make(shm / "small", size=100))
    elif case == "relative":
        b = buf("shm/w")
    elif case == "missing":
        b = buf(str(shm / "missing"))
    elif case == "proc":
        b = buf("/proc/self/mem")
    elif case == "dotdot":
        make(tmp_path / "up")
        b = buf(str(shm / ".." / "up"))
    elif case == "fifo":
        os.mkfifo(shm / "fifo", 0o600)
        b = buf(str(shm / "fifo"))
    elif case == "shape_bigger_than_nbytes":
        b = buf(make(shm / "w"), nbytes=100)
    assert b is not None
    with pytest.raises(ShmPathRejected) as exc:
        t.attach([b])
    assert exc.value.metadata["path"] == b.path and exc.value.metadata["why"]


def test_duplicate_or_missing_layers_are_geometry_errors(shm: Path) -> None:
    p = make(shm / "w")
    t = ShmTransport(str(shm))
    with pytest.raises(GeometryMismatch):
        t.attach([buf(p), buf(p, offset=4096)])
    with pytest.raises(GeometryMismatch):
        t.attach([buf(p, layer=1)])
