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


def retired(root: str) -> list:
    """What the reuse folder holds (nxd_ckpt.reuse: the tag retention retired last, for the next save to take
    its files over), checked: at most one tag, never one that looks complete."""
    from nxd_ckpt.layout import DONE_MARKER, MANIFEST_FILE, REUSE_DIR

    s = storage_of(root)
    held = s.listdir(REUSE_DIR)
    assert len(held) <= 1, f"the reuse folder holds more than one retired tag: {held}"
    for name in held:
        assert not s.exists(f"{REUSE_DIR}/{name}/{DONE_MARKER}"), name
        assert not s.exists(f"{REUSE_DIR}/{name}/{MANIFEST_FILE}"), name
    return held


def tags_on_disk(root: str) -> list:
    """``top_level`` without the reuse folder, whose content ``retired`` checks."""
    from nxd_ckpt.layout import REUSE_DIR

    names = top_level(root)
    if REUSE_DIR in names:
        names.remove(REUSE_DIR)
        retired(root)
    return names


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
