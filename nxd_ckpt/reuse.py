"""Retired checkpoints: the files of a tag retention removes, taken over by the next save instead of new files.

On a filesystem (``Storage.caps.reuse_files``) retention does not delete the files of a tag it removes: once the
tag's `done` and manifest are gone (``commit.delete_tag``, as for any deletion) the directory is moved into
``<checkpoint_dir>/.nxd_ckpt_reuse/``, replacing what an earlier retirement left there. Each rank's next save then
renames every file it writes out of there when the same path exists (a save of the same structure finds them
all) and overwrites it in place, cut to its new length. Creating a file, allocating its blocks and later freeing
them are most of the CPU of writing a small file on a local disk: on this project's VM (ext4) 0.75 ms of system
CPU per file created, against 0.1 ms to take one over (README "Levers measured").

What this costs: between saves the folder holds the retired tag's files (the disk holds ``num_kept_ckpts`` + 1
tags' worth until the next save takes them; during a save of the same file names the same peak as deleting, one
tag more for the first save after a change of layout). Deleting the folder is always safe. A file is never taken
over when it is a hard link (its bytes are also another name's) or not a regular file, and a tag that is or holds
a symlink is deleted, never kept. A reader that kept a retired tag's file open or mapped sees the next save's
bytes once it is overwritten, where a deleted file would have kept its old bytes: nxd-ckpt never retires a tag
this process is loading, and its loader checks every file's CRC32C. ``save_checkpoint(reuse_retired_files=False)``
deletes instead (and empties the folder).
"""
from __future__ import annotations

import logging
import os
from typing import Optional

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
    """Whether the tree ``name`` is, or holds, a symbolic link: a rename out of it through a linked folder would
    move (and the save overwrite) the files of whatever the link points at, another checkpoint's say. Such a tag is
    deleted, never kept (the delete removes the links, not what they point at). Cheap: the folder entries' types."""
    top = storage.local_path(name)
    if top is None or os.path.islink(top):
        return True
    for _dirpath, dirs, files in os.walk(top):
        if any(os.path.islink(os.path.join(_dirpath, d)) for d in dirs):
            return True
        if any(os.path.islink(os.path.join(_dirpath, f)) for f in files):
            return True
    return False


def empty(storage: Storage) -> None:
    """Delete whatever the reuse folder holds: files no later save took."""
    for old in storage.listdir(REUSE_DIR):
        storage.remove_tree(f"{REUSE_DIR}/{old}")


def source(storage: Storage) -> Optional[str]:
    """Every rank, before it writes a save's files: the retired tag whose files it may take over (``<reuse
    folder>/<name>``; ``Storage.write_file(reuse=...)`` with each file's path inside the tag), or None. One
    listing; a retirement running meanwhile on rank 0 only makes some files missing, which are then created."""
    if not storage.caps.reuse_files:
        return None
    names = storage.listdir(REUSE_DIR)
    return f"{REUSE_DIR}/{names[-1]}" if names else None
