"""Storage backends. Only POSIX filesystems (local, FSx for Lustre, NFS) are implemented."""
from .base import FileRecord, Storage
from .local import ChecksumWriter, LocalStorage, set_write_hook


def open_storage(root: str) -> Storage:
    """Storage for a checkpoint directory. ``s3://`` URLs are refused with a pointer to mounting them."""
    if "://" in str(root):
        from ..errors import CheckpointArgumentError

        raise CheckpointArgumentError(
            f"checkpoint_dir {root!r} is a URL; nxd-ckpt writes to POSIX paths only. Mount the bucket "
            "(e.g. Mountpoint for Amazon S3 or FSx for Lustre linked to S3) and pass the mount path."
        )
    return LocalStorage(root)


__all__ = ["FileRecord", "Storage", "LocalStorage", "ChecksumWriter", "open_storage", "set_write_hook"]
