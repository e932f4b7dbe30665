"""Retired checkpoints: the files of a tag retention removes, taken over by the next save instead of new files.

On a filesystem (``Storage.caps.reuse_files``) retention does not delete the files of a tag it removes: once the
tag's `done` and manifest are gone (``commit.delete_tag``, as for any deletion) the directory is moved into
``<checkpoint_dir>/.nxd_ckpt_reuse/``, replacing what an earlier retirement left there. Rank 0's next save renames
that directory to be its staging directory (``take``: one rename for the whole tag), every rank overwrites in
place each file it writes that is already there (a save of the same structure finds them all), cut to its new
length, and rank 0 removes the files no rank wrote (``sweep``) before the manifest and `done`. Creating a file,
allocating its blocks and later freeing them are most of the CPU of writing a small file on a local disk: on this
project's VM (ext4) 0.25-1.1 ms of system CPU per file created, against 0.03 ms to open one in place (README
"Levers measured").

What this costs: between saves the folder holds the retired tag's files (the disk holds ``num_kept_ckpts`` + 1
tags' worth until the next save takes them; during a save the same peak as deleting, since what the save does not
overwrite goes before its commit). Deleting the folder is always safe. A file is never
overwritten when it is a hard link (its bytes are also another name's) or not a regular file (it is removed and a
new file created), and a tag that is or holds a symlink is deleted, never kept. A reader that kept a retired
tag's file open or mapped sees the next save's bytes once it is overwritten, where a deleted file would have kept
its old bytes: nxd-ckpt never retires a tag this process is loading, and its loader checks every file's CRC32C.
``save_checkpoint(reuse_retired_files=False)`` deletes instead (and empties the folder).
"""
from __future__ import annotations

import logging
import os
from typing import Set

from . import layout
from .storage import Storage

log = logging.getLogger("nxd_ckpt")

REUSE_DIR = layout.REUSE_DIR


def retire(storage: Storage, name: str) -> bool:
    """Rank 0 (retention): move the tag directory ``name`` (already not a complete tag) into the reuse folder in
    place of what was there. False when it was not moved (the storage cannot reuse files, or the rename failed):
    the caller deletes it."""
    if not storage.caps.reuse_files or _has_links(storage, name):
        return False
    empty(storage)
    try:
        storage.makedirs(REUSE_DIR)
        storage.rename(name, f"{REUSE_DIR}/{name.rsplit('/', 1)[-1]}")
    except OSError as exc:
        log.info("nxd_ckpt: could not keep the files of %s for reuse (%s); deleting them", name, exc)
        return False
    return True


def _has_links(storage: Storage, name: str) -> bool:
    """Whether the tree ``name`` is, or holds, a symbolic link: the save that takes it over would write through a
    linked folder into whatever the link points at, another checkpoint's files say. Such a tag is deleted, never
    kept (the delete removes the links, not what they point at). Cheap: the folder entries' types as listed, no
    system call per file."""
    top = storage.local_path(name)
    try:
        return top is None or os.path.islink(top) or _holds_link(top)
    except OSError:     # a folder it cannot list (permissions, removed meanwhile): not kept, deleted as usual
        return True


def _holds_link(folder: str) -> bool:
    with os.scandir(folder) as entries:
        for entry in entries:
            if entry.is_symlink() or (entry.is_dir(follow_symlinks=False) and _holds_link(entry.path)):
                return True
    return False


def empty(storage: Storage) -> None:
    """Delete whatever the reuse folder holds: files no later save took."""
    for old in storage.listdir(REUSE_DIR):
        storage.remove_tree(f"{REUSE_DIR}/{old}")


def take(storage: Storage, workdir: str) -> bool:
    """Rank 0, preparing a save (``commit.RenameCommit.begin``): rename the retired tag, if there is one, to the
    save's working directory ``workdir`` (which does not exist). True when it did: the ranks then write with
    ``reuse=True`` (``Storage.write_parts``/``write_file``) and rank 0 calls ``sweep`` before it publishes."""
    if not storage.caps.reuse_files:
        return False
    for name in reversed(storage.listdir(REUSE_DIR)):
        try:
            storage.rename(f"{REUSE_DIR}/{name}", workdir)
        except OSError as exc:
            log.info("nxd_ckpt: could not take over the retired files of %s (%s); creating new ones", name, exc)
            return False
        return True
    return False


def sweep(storage: Storage, workdir: str, written: Set[str]) -> int:
    """Rank 0, once every rank has written its files into a working directory ``take`` filled: remove every file
    (and folder left empty) that is not in ``written`` (paths inside ``workdir``), i.e. what the retired tag held
    and this save did not write, so the tag holds exactly its own files. Returns how many files went; their
    folders are synced when any did."""
    top = storage.local_path(workdir)
    removed, touched = 0, set()
    for dirpath, dirs, files in os.walk(top, topdown=False):
        rel = os.path.relpath(dirpath, top)
        for name in files:
            if (name if rel == "." else f"{rel}/{name}") not in written:
                os.unlink(os.path.join(dirpath, name))
                touched.add(dirpath)
                removed += 1
        for name in dirs:
            path = os.path.join(dirpath, name)
            if os.path.islink(path) or not os.listdir(path):
                _unlink_or_rmdir(path)
                touched.add(dirpath)
    if touched:
        storage.sync_dirs(os.path.relpath(d, storage.local_path("")) for d in touched)
    return removed


def _unlink_or_rmdir(path: str) -> None:
    if os.path.islink(path):
        os.unlink(path)
    else:
        os.rmdir(path)
