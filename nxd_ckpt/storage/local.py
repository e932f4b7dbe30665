"""POSIX storage (local disk, FSx for Lustre, NFS): atomic files by temporary name + rename, durability by
fsync (batched and parallel for the files of a staging directory), directories fsynced."""
from __future__ import annotations

import ctypes
import errno
import functools
import os
import shutil
from concurrent.futures import ThreadPoolExecutor
from typing import Iterable, List, Optional, Tuple

from ..layout import TMP_SUFFIX
import crc32c as _crc32c

from .base import READ_BLOCK, Capabilities, FileRecord, AlreadyExistsError, Sink, Stat, Storage


def file_crc32c(path: str) -> Tuple[int, int]:
    """(size, CRC32C) of a local file, read in large blocks into one reused buffer."""
    crc, size = 0, 0
    buf = bytearray(min(READ_BLOCK, max(1, os.path.getsize(path))))
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while True:
            n = f.readinto(buf)
            if not n:
                break
            crc = _crc32c.crc32c(view[:n], crc)
            size += n
    return size, crc

_SYNC_THREADS = 8


class _FileSink(Sink):
    def __init__(self, final: str, atomic: bool, exclusive: bool):
        self._final = final
        self._path = f"{final}{TMP_SUFFIX}" if atomic else final
        self._atomic = atomic
        self._exclusive = exclusive
        os.makedirs(os.path.dirname(final), exist_ok=True)
        if exclusive and os.path.exists(final):
            raise AlreadyExistsError(errno.EEXIST, "already exists", final)
        self._raw = open(self._path, "wb", buffering=0)

    def write(self, view: memoryview) -> None:
        done, total = 0, len(view)
        while done < total:
            done += self._raw.write(view[done:])

    def finish(self, record: FileRecord, durable: bool) -> None:
        if durable:
            os.fsync(self._raw.fileno())
        self._raw.close()
        if self._atomic:
            if self._exclusive:
                try:
                    os.link(self._path, self._final)     # fails when another writer got there first
                except FileExistsError:
                    raise AlreadyExistsError(errno.EEXIST, "already exists", self._final) from None
                os.unlink(self._path)
            else:
                os.replace(self._path, self._final)

    def abort(self) -> None:
        try:
            self._raw.close()
            os.unlink(self._path)
        except OSError:
            pass


class LocalStorage(Storage):
    caps = Capabilities(rename=True, exchange=True, needs_sync=True, local=True, create_exclusive=True)
    fix_hint = "the directory (free space, permissions)"

    def __init__(self, root: str):
        self.root = os.path.abspath(root)

    def path(self, relpath: str) -> str:
        return os.path.join(self.root, relpath) if relpath else self.root

    local_path = path

    def child(self, relpath: str) -> "LocalStorage":
        return LocalStorage(self.path(relpath))

    def parent(self) -> Tuple["LocalStorage", str]:
        up, name = os.path.split(self.root)
        if not name:
            raise ValueError(f"{self.root} is the filesystem root, which has no parent: pass a directory below it")
        return LocalStorage(up), name

    def canonical_root(self) -> str:
        return os.path.realpath(self.root)

    def link_from(self, src: Storage, src_rel: str, relpath: str) -> bool:
        local = src.local_path(src_rel)
        if local is None:
            return False
        dst = self.path(relpath)
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        try:
            os.link(local, dst)
        except OSError:   # another filesystem, or one without hard links: the caller copies
            return False
        return True

    def check_writable(self, what: str = "directory") -> None:
        from ..errors import CheckpointArgumentError

        if os.path.exists(self.root):
            if not os.path.isdir(self.root):
                raise CheckpointArgumentError(f"{what} {self.root!r} exists and is not a directory; pass a directory")
            probe = self.root
        else:
            probe = os.path.dirname(self.root)
            while probe and not os.path.exists(probe):
                probe = os.path.dirname(probe)
        if not os.access(probe, os.W_OK | os.X_OK):
            raise CheckpointArgumentError(
                f"{what} {self.root!r} is not writable by this process ({probe!r} denies write); fix its permissions or "
                "choose another directory")

    def _sink(self, relpath: str, atomic: bool, exclusive: bool) -> Sink:
        return _FileSink(self.path(relpath), atomic, exclusive)

    def read(self, relpath: str, offset: int = 0, length: Optional[int] = None) -> bytes:
        with open(self.path(relpath), "rb", buffering=0) as f:
            if length is None:
                f.seek(offset)
                return f.read()
            return os.pread(f.fileno(), length, offset)

    def list(self, prefix: str = "") -> List[str]:
        top = self.path(prefix)
        out = []
        for dirpath, _dirs, files in os.walk(top):
            rel = os.path.relpath(dirpath, self.root)
            out += [name if rel == "." else f"{rel}/{name}" for name in files]
        return sorted(out)

    def crc32c(self, relpath: str) -> Tuple[int, int]:
        return file_crc32c(self.path(relpath))

    def stat(self, relpath: str) -> Stat:
        st = os.stat(self.path(relpath))
        return Stat(st.st_size, st.st_mtime)

    def isfile(self, relpath: str) -> bool:
        return os.path.isfile(self.path(relpath))

    def exists(self, relpath: str) -> bool:
        return os.path.exists(self.path(relpath))

    def delete_many(self, relpaths: Iterable[str]) -> None:
        for rel in relpaths:
            try:
                os.unlink(self.path(rel))
            except FileNotFoundError:
                pass

    def isdir(self, relpath: str) -> bool:
        return os.path.isdir(self.path(relpath))

    def listdir(self, relpath: str) -> List[str]:
        try:
            return sorted(os.listdir(self.path(relpath)))
        except (FileNotFoundError, NotADirectoryError):
            return []

    def makedirs(self, relpath: str) -> None:
        os.makedirs(self.path(relpath), exist_ok=True)

    def remove_tree(self, relpath: str) -> None:
        shutil.rmtree(self.path(relpath), ignore_errors=True)

    def rename(self, src: str, dst: str) -> None:
        os.replace(self.path(src), self.path(dst))

    def exchange(self, a: str, b: str) -> bool:
        return rename_exchange(self.path(a), self.path(b))

    def sync_files(self, relpaths: Iterable[str]) -> None:
        """fdatasync every file, on parallel threads: the kernel has been writing the pages back since
        they were written, and one deep queue of syncs finishes sooner than one sync after each file."""
        paths = [self.path(r) for r in relpaths]
        if not paths:
            return
        with ThreadPoolExecutor(max_workers=min(_SYNC_THREADS, len(paths)),
                                thread_name_prefix="nxd_ckpt-sync") as pool:
            for _ in pool.map(_fdatasync, paths):
                pass

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


def _fdatasync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fdatasync(fd)
    finally:
        os.close(fd)


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
