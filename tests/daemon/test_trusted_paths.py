"""The daemon's directories and files: what is accepted, tightened, or refused."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from hicached.core.trusted_paths import UntrustedPath, open_own, own_dir, socket_dir

root_only = pytest.mark.skipif(os.geteuid() != 0, reason="giving a file away needs root")


def test_a_missing_directory_is_created_private(tmp_path: Path) -> None:
    own_dir(str(tmp_path / "a" / "state"))
    assert (tmp_path / "a" / "state").stat().st_mode & 0o777 == 0o700
    own_dir(str(tmp_path / "grp"), group=True, gid=os.getgid())
    assert (tmp_path / "grp").stat().st_mode & 0o777 == 0o750


def test_an_own_directory_others_may_read_is_closed_to_them(tmp_path: Path) -> None:
    d = tmp_path / "state"
    d.mkdir(mode=0o755)
    d.chmod(0o755)
    own_dir(str(d))
    assert d.stat().st_mode & 0o777 == 0o700


@pytest.mark.parametrize("mode", [0o775, 0o757, 0o777, 0o1777])
def test_an_own_directory_others_may_write_is_refused(tmp_path: Path, mode: int) -> None:
    d = tmp_path / "state"
    d.mkdir()
    d.chmod(mode)
    with pytest.raises(UntrustedPath, match="others may"):
        own_dir(str(d))
    assert d.stat().st_mode & 0o7777 == mode  # left as it was


def test_a_symlink_is_not_a_directory(tmp_path: Path) -> None:
    (tmp_path / "real").mkdir(mode=0o700)
    (tmp_path / "link").symlink_to(tmp_path / "real")
    for check in (own_dir, socket_dir):
        with pytest.raises(UntrustedPath, match="symlink"):
            check(str(tmp_path / "link"))


@root_only
def test_another_users_directory_is_refused(tmp_path: Path) -> None:
    d = tmp_path / "theirs"
    d.mkdir(mode=0o700)
    os.chown(d, 65534, 65534)
    for check in (own_dir, socket_dir):
        with pytest.raises(UntrustedPath, match="owned by uid 65534"):
            check(str(d))


def test_a_shared_socket_directory_must_be_sticky_if_others_write(tmp_path: Path) -> None:
    d = tmp_path / "shared"
    d.mkdir()
    d.chmod(0o1777)
    socket_dir(str(d))  # as /tmp: others cannot move what is ours
    d.chmod(0o777)
    with pytest.raises(UntrustedPath, match="move the daemon's socket"):
        socket_dir(str(d))


@root_only
def test_files_are_opened_only_when_they_are_the_daemons_own(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_text("precious")
    (tmp_path / "lock").symlink_to(victim)
    with pytest.raises(UntrustedPath, match="symlink"):
        open_own(str(tmp_path / "lock"), os.O_RDWR | os.O_CREAT)
    assert victim.read_text() == "precious"
    theirs = tmp_path / "theirs"
    theirs.write_text("x")
    os.chown(theirs, 65534, 65534)
    with pytest.raises(UntrustedPath, match="owned by uid 65534"):
        open_own(str(theirs), os.O_RDONLY)
    loose = tmp_path / "loose"
    loose.write_text("x")
    loose.chmod(0o666)
    with pytest.raises(UntrustedPath, match="writable by others"):
        open_own(str(loose), os.O_RDONLY)
    os.close(open_own(str(tmp_path / "mine"), os.O_RDWR | os.O_CREAT | os.O_EXCL))
    assert (tmp_path / "mine").stat().st_mode & 0o777 == 0o600
