"""Storage backends behind one byte-level interface (``base.Storage``): POSIX filesystems (local, FSx for
Lustre, NFS) and object stores (an in-memory one and a shared-directory one for tests)."""
from __future__ import annotations

import os

from .base import AlreadyExistsError, Capabilities, FileRecord, Stat, Storage, set_write_hook
from .local import LocalStorage
from .objects import ObjectStorage

OBJECT_SCHEMES = ("mem", "objdir")


def check_location(path) -> str:
    """``path`` as a string, or CheckpointArgumentError when it is a URL whose scheme no backend here serves
    (``s3://...``). Every entry point and tool calls this first: the one place where S3 support plugs in."""
    text = os.fspath(path) if not isinstance(path, str) and hasattr(path, "__fspath__") else path
    if isinstance(text, bytes):
        text = os.fsdecode(text)
    if isinstance(text, str) and "://" in text:
        scheme = text.split("://", 1)[0]
        if scheme not in OBJECT_SCHEMES:
            from ..errors import CheckpointArgumentError

            raise CheckpointArgumentError(
                f"{text!r} is a {scheme}:// URL; this version of nxd-ckpt reads and writes POSIX paths only "
                "(S3 support is not built yet). Mount the bucket (Mountpoint for Amazon S3, or FSx for Lustre "
                "linked to S3) and pass the mount path.")
    return text


def open_storage(root: str) -> Storage:
    """The Storage for a checkpoint directory path or URL: ``mem://bucket/prefix`` and
    ``objdir:///dir`` are object stores (tests); any other ``scheme://`` is refused by ``check_location``;
    everything else is a POSIX path."""
    text = check_location(root)
    scheme = text.split("://", 1)[0] if "://" in text else ""
    if scheme in OBJECT_SCHEMES:
        from .objects import open_object_url

        return open_object_url(text)
    return LocalStorage(text)


__all__ = ["AlreadyExistsError", "Capabilities", "FileRecord", "Stat", "Storage", "LocalStorage", "ObjectStorage",
           "check_location", "open_storage", "set_write_hook"]
