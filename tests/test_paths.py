"""The socket directory must be private to the user."""

from __future__ import annotations

import os
import socket

import pytest

from completiond.serving import paths

pytestmark = pytest.mark.torch_free  # also run on the lowest supported Python, without torch (.ci/run)


def test_runtime_dir_prefers_xdg(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    assert paths.runtime_dir() == tmp_path / "completiond"
    monkeypatch.delenv("XDG_RUNTIME_DIR")
    assert paths.runtime_dir().name == f"completiond-{os.getuid()}"


def test_creates_0700(tmp_path):
    d = paths.ensure_private_dir(tmp_path / "rt")
    assert (os.stat(d).st_mode & 0o777) == 0o700


def test_tightens_readable_dir(tmp_path):
    d = tmp_path / "rt"
    d.mkdir(mode=0o755)
    os.chmod(d, 0o755)
    paths.ensure_private_dir(d)
    assert (os.stat(d).st_mode & 0o777) == 0o700


@pytest.mark.parametrize("mode", [0o770, 0o777, 0o702])
def test_refuses_group_or_world_writable(tmp_path, mode):
    d = tmp_path / "rt"
    d.mkdir()
    os.chmod(d, mode)
    with pytest.raises(paths.InsecureDirectoryError, match="writable by group or others"):
        paths.ensure_private_dir(d)


def test_refuses_symlink(tmp_path):
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    link = tmp_path / "rt"
    link.symlink_to(real)
    with pytest.raises(paths.InsecureDirectoryError, match="symlink"):
        paths.ensure_private_dir(link)


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to give a directory away")
def test_refuses_foreign_owner(tmp_path):
    d = tmp_path / "rt"
    d.mkdir(mode=0o700)
    os.chown(d, 12345, 12345)
    with pytest.raises(paths.InsecureDirectoryError, match="owned by uid 12345"):
        paths.ensure_private_dir(d)


def test_refuses_plain_file(tmp_path):
    f = tmp_path / "rt"
    f.write_text("x")
    with pytest.raises(paths.InsecureDirectoryError, match="not a directory"):
        paths.ensure_private_dir(f)


def test_peer_uid_is_ours():
    a, b = socket.socketpair(socket.AF_UNIX)
    with a, b:
        uid = paths.peer_uid(a)
        assert uid in (None, os.getuid())
