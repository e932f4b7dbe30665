"""POSIX storage (local disk, FSx for Lustre, NFS): temp file + fsync + rename, directories fsynced."""
from __future__ import annotations

import ctypes
import errno
import functools
import io
import os
import shutil
from typing import Callable, Iterable, List, Optional

import crc32c as _crc32c

from ..layout import TMP_SUFFIX
from .base import FileRecord, Storage

# A test hook: called with (relpath) before every file write; it may block or raise (fault injection).
_write_hook: Optional[Callable[[str], None]] = None


def set_write_hook(hook: Optional[Callable[[str], None]]) -> None:
    """Install (or clear with None) a process-wide callable run before each file write. For tests."""
    global _write_hook
    _write_hook = hook


class ChecksumWriter(io.RawIOBase):
    """A write-only file object that CRC32C-checksums and counts bytes on their way to the file."""

    def __init__(self, raw: io.FileIO):
        super().__init__()
        self._raw = raw
        self.crc = 0
        self.size = 0

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        self.crc = _crc32c.crc32c(view, self.crc)
        total = len(view)
        done = 0
        while done < total:
            done += self._raw.write(view[done:])
        self.size += total
        return total

    def flush(self) -> None:
        pass


class LocalStorage(Storage):
    def __init__(self, root: str):
        self.root = os.path.abspath(root)

    def path(self, relpath: str) -> str:
        return os.path.join(self.root, relpath) if relpath else self.root

    def write_file(self, relpath: str, produce: Callable, *, durable: bool = True) -> FileRecord:
        if _write_hook is not None:
            _write_hook(relpath)
        final = self.path(relpath)
        tmp = f"{final}{TMP_SUFFIX}"
        os.makedirs(os.path.dirname(final), exist_ok=True)
        try:
            with open(tmp, "wb", buffering=0) as raw:
                writer = ChecksumWriter(raw)
                produce(writer)
                if durable:
                    os.fsync(raw.fileno())
            os.replace(tmp, final)
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise
        return FileRecord(relpath, writer.size, writer.crc)

    def read_bytes(self, relpath: str) -> bytes:
        with open(self.path(relpath), "rb") as f:
            return f.read()

    def exists(self, relpath: str) -> bool:
        return os.path.exists(self.path(relpath))

    def isdir(self, relpath: str) -> bool:
        return os.path.isdir(self.path(relpath))

    def listdir(self, relpath: str) -> List[str]:
        try:
            return sorted(os.listdir(self.path(relpath)))
        except FileNotFoundError:
            return []

    def makedirs(self, relpath: str) -> None:
        os.makedirs(self.path(relpath), exist_ok=True)

    def remove_file(self, relpath: str) -> None:
        try:
            os.unlink(self.path(relpath))
        except FileNotFoundError:
            pass

    def remove_tree(self, relpath: str) -> None:
        shutil.rmtree(self.path(relpath), ignore_errors=True)

    def rename(self, src: str, dst: str) -> None:
        os.replace(self.path(src), self.path(dst))

    def exchange(self, a: str, b: str) -> bool:
        return rename_exchange(self.path(a), self.path(b))

    def sync_dirs(self, relpaths: Iterable[str]) -> None:
        for rel in sorted(set(relpaths)):
            try:
                fd = os.open(self.path(rel), os.O_RDONLY | os.O_DIRECTORY)
            except FileNotFoundError:
                continue
            try:
                os.fsync(fd)
            except OSError:
                pass  # some network filesystems refuse fsync on directories; rename is still atomic there
            finally:
                os.close(fd)

    def size(self, relpath: str) -> int:
        return os.path.getsize(self.path(relpath))

    def mtime(self, relpath: str) -> float:
        return os.path.getmtime(self.path(relpath))


_RENAME_EXCHANGE = 2       # linux/fs.h
_AT_FDCWD = -100
# EPERM: some FUSE filesystems answer it for unknown rename flags; a real permission problem then shows
# in the plain rename that follows.
_UNSUPPORTED = {errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EXDEV, errno.EPERM}


def rename_exchange(a: str, b: str) -> bool:
    """Swap paths ``a`` and ``b`` in one atomic step (Linux renameat2 RENAME_EXCHANGE: ext4, xfs, btrfs,
    tmpfs). False when the kernel, libc or filesystem (e.g. some network filesystems) does not offer it."""
    renameat2 = _libc_renameat2()
    if renameat2 is None:
        return False
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in _UNSUPPORTED:
        return False
    raise OSError(err, f"renameat2(RENAME_EXCHANGE) of {a} and {b}: {os.strerror(err)}")


@functools.lru_cache(maxsize=1)
def _libc_renameat2():
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):   # not glibc >= 2.28 (or not Linux)
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn
