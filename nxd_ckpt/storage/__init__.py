"""Storage backends behind one byte-level interface (``base.Storage``): POSIX filesystems (local, FSx for
Lustre, NFS) and object stores (an in-memory one and a shared-directory one for tests)."""
from .base import AlreadyExistsError, Capabilities, FileRecord, Stat, Storage, set_write_hook
from .local import LocalStorage
from .objects import ObjectStorage

OBJECT_SCHEMES = ("mem", "objdir")


def open_storage(root: str) -> Storage:
    """The Storage for a checkpoint directory path or URL: ``mem://bucket/prefix`` and
    ``objdir:///dir`` are object stores (tests); any other ``scheme://`` is refused with a clear
    error; everything else is a POSIX path."""
    text = str(root)
    scheme = text.split("://", 1)[0] if "://" in text else ""
    if scheme in OBJECT_SCHEMES:
        from .objects import open_object_url

        return open_object_url(text)
    if scheme:
        from ..errors import CheckpointArgumentError

        raise CheckpointArgumentError(
            f"checkpoint_dir {root!r} is a {scheme}:// URL, which nxd-ckpt does not support; pass a POSIX path "
            "(local disk, FSx for Lustre, NFS)."
        )
    return LocalStorage(text)


__all__ = ["AlreadyExistsError", "Capabilities", "FileRecord", "Stat", "Storage", "LocalStorage", "ObjectStorage",
           "open_storage", "set_write_hook"]
