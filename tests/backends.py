"""The two storage backends a save/load test runs against: POSIX with the rename commit, and the
shared-directory object store (``objdir://``: keys only, no rename; several processes see it) with the
marker commit. Import this module in a test module (and so in its rank processes) to enable ``objdir://``.

``ckpt_root`` (a fixture, parametrized over both) is the checkpoint directory or URL; the helpers below
look at what a save left through Storage, so one assertion holds for both."""
from __future__ import annotations

import os

import pytest

from nxd_ckpt.storage.testing import enable_test_schemes

enable_test_schemes()   # objdir:// in this process and in every rank process that imports this module

BACKENDS = ["posix", "objects"]


def root_for(backend: str, tmp_path) -> str:
    return str(tmp_path / "ckpt") if backend == "posix" else f"objdir://{tmp_path}/bucket//ckpt"


@pytest.fixture(params=BACKENDS)
def ckpt_root(request, tmp_path) -> str:
    return root_for(request.param, tmp_path)


def storage_of(root: str):
    from nxd_ckpt.storage import open_storage

    return open_storage(root)


def files_under(root: str) -> set:
    """Every file (key) under ``root``, relative to it (none when ``root`` does not exist yet)."""
    s = storage_of(root)
    return set(s.list("")) if s.isdir("") else set()


def exists(root: str, rel: str) -> bool:
    return storage_of(root).exists(rel)


def top_level(root: str) -> list:
    """The names directly under ``root`` (tags, `newest`, debris), sorted."""
    s = storage_of(root)
    return sorted(s.listdir("")) if s.isdir("") else []


def overwrite(root: str, rel: str, data: bytes) -> None:
    """Replace a file's bytes behind the storage's back, as a bad disk or a bucket edit would (no checksum
    is recorded anywhere)."""
    s = storage_of(root)
    path = s.local_path(rel)
    if path is None:
        path = s.bucket._path(s.key(rel))         # DirBucket: one file per key
    with open(path, "wb") as f:
        f.write(data)


def local_copy(root: str, prefix: str, dest) -> str:
    """The files under ``prefix`` read through Storage into the local folder ``dest`` (same relative paths),
    for readers that need a local path (``xser.load``); ``dest``/``prefix``."""
    s = storage_of(root)
    for rel in s.list(prefix):
        path = os.path.join(str(dest), rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(s.read(rel))
    return os.path.join(str(dest), prefix)


def remove(root: str, rel: str) -> None:
    storage_of(root).remove_file(rel)
