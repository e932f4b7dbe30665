"""The small byte-level interface every storage backend implements.

A backend provides a handful of verbs on keys (paths relative to its root, '/'-separated): write a file
from a producer, read it whole or a byte range, list the keys under a prefix (the backend paginates),
stat, delete many, and the optional capabilities it declares (atomic rename/exchange of a directory,
durability that needs an explicit sync, local paths for memory mapping). Everything a checkpoint needs
beyond that (directory views, trees, CRC32C and sizes of what is written) is derived here, once, so a
backend never re-implements it.
"""
from __future__ import annotations

import contextlib
import io
import os
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Callable, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

import crc32c as _crc32c

#: block size of streaming checksum reads
READ_BLOCK = 8 << 20

def crc_hex(crc: int) -> str:
    """A CRC32C as manifests and records write it: 8 lower-case hex digits."""
    return f"{crc:08x}"


def crc32c_of_blocks(blocks: Iterable[memoryview]) -> Tuple[int, int]:
    """(bytes, CRC32C) of a stream of blocks (``Storage.blocks``)."""
    size = crc = 0
    for block in blocks:
        crc = _crc32c.crc32c(block, crc)
        size += len(block)
    return size, crc


# A test hook: called with (relpath) before every file write; it may block or raise (fault injection).
_write_hook: Optional[Callable[[str], None]] = None


def set_write_hook(hook: Optional[Callable[[str], None]]) -> None:
    """Install (or clear with None) a process-wide callable run before each file write. For tests."""
    global _write_hook
    _write_hook = hook


@dataclass(frozen=True)
class FileRecord:
    """What was written: path relative to the tag directory, byte count and CRC32C of those bytes; ``ranges``:
    (offset, length, CRC32C) of byte ranges checksummed on their own (a plain shard's zip records), or None."""

    relpath: str
    size: int
    crc32c: int
    ranges: Optional[Tuple[Tuple[int, int, int], ...]] = None

    def to_json(self) -> dict:
        out: dict = {"size": self.size, "crc32c": crc_hex(self.crc32c)}
        if self.ranges is not None:
            out["ranges"] = [[o, n, crc_hex(c)] for o, n, c in self.ranges]
        return out


@dataclass(frozen=True)
class Stat:
    size: int
    mtime: float


@dataclass(frozen=True)
class LocalFile:
    """A local file held open (``Storage.open_local``). ``path`` names the opened file itself
    (``/proc/self/fd/N`` where there is one), so a reader that takes a path, such as torch's memory-mapped
    loader, reads these bytes even if the name is replaced meanwhile; ``size`` is the opened file's size."""

    path: str
    size: int
    fd: int

    def pread(self, length: int, offset: int) -> bytes:
        """``length`` bytes from ``offset`` of the opened file (fewer only at its end)."""
        return os.pread(self.fd, length, offset)


@dataclass(frozen=True)
class Capabilities:
    """What a backend can do beyond the common verbs.

    ``rename``: a directory (prefix) can be renamed atomically, so a tag can be staged under another name
    and published in one step (the rename commit). ``exchange``: two directories can be swapped
    atomically (renameat2). ``needs_sync``: written bytes are durable only after ``sync_files`` /
    ``sync_dirs`` (POSIX page cache); object stores are durable once a write is acknowledged.
    ``local``: ``local_path`` gives a filesystem path (memory-mapped reads). ``create_exclusive``:
    ``write_file(..., exclusive=True)`` fails when the key exists (S3 ``If-None-Match: *``). ``reuse_files``:
    ``write_file(..., reuse=True)`` may overwrite a retired checkpoint's file at its key in place instead of
    creating a new one (reuse.py)."""

    rename: bool
    exchange: bool = False
    needs_sync: bool = False
    local: bool = False
    create_exclusive: bool = False
    reuse_files: bool = False


class AlreadyExistsError(FileExistsError):
    """An exclusive write found the key already there (another job committed it)."""


class Sink(ABC):
    """Where a backend puts the bytes of one file while it is written."""

    @abstractmethod
    def write(self, view: memoryview) -> None: ...

    def write_parts(self, views: Sequence[memoryview]) -> None:
        """Write ``views`` one after the other (a backend may do it in one call)."""
        for view in views:
            self.write(view)

    @abstractmethod
    def finish(self, record: FileRecord, durable: bool) -> None:
        """Make the file visible under its key (and durable when asked); ``record`` carries the size and
        CRC32C of every byte written, for backends that send or store the checksum."""

    @abstractmethod
    def abort(self) -> None:
        """Drop whatever was written; never raises."""


class _CountingWriter(io.RawIOBase):
    """A write-only file object that CRC32C-checksums and counts bytes on their way to a Sink; ``name`` is the
    key written (for a producer's messages)."""

    def __init__(self, sink: Sink, name: str = ""):
        super().__init__()
        self._sink = sink
        self.name = name
        self.crc = 0
        self.size = 0

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        self.crc = _crc32c.crc32c(view, self.crc)
        self._sink.write(view)
        self.size += len(view)
        return len(view)

    def flush(self) -> None:
        pass


class Storage(ABC):
    """Bytes in and out under a root. Keys are relative to the root and use '/' separators; a
    "directory" is the set of keys under ``<name>/``."""

    caps: Capabilities
    root: str   # what messages show: a path or URL
    #: what to check when a write fails, for error messages ("Fix <fix_hint> and save again")
    fix_hint = "the storage"

    # --- the verbs a backend implements ---------------------------------------------------------------
    @abstractmethod
    def _sink(self, relpath: str, atomic: bool, exclusive: bool, size_hint: int = 0) -> Sink:
        """Open the destination of one file. ``atomic``: readers never see a partial file under the key
        (POSIX: temporary name + rename; objects are atomic anyway). ``size_hint``: about how many bytes the
        file will have (0: unknown), for a backend that writes large files another way."""

    @abstractmethod
    def read(self, relpath: str, offset: int = 0, length: Optional[int] = None) -> bytes:
        """The file's bytes (``length`` bytes from ``offset``; all when None). FileNotFoundError."""

    @abstractmethod
    def list(self, prefix: str = "") -> List[str]:
        """Every file key under ``prefix`` (a directory name, '' for all), recursively, sorted."""

    @abstractmethod
    def stat(self, relpath: str) -> Stat:
        """Size and modification time of a file. FileNotFoundError."""

    @abstractmethod
    def delete_many(self, relpaths: Iterable[str]) -> None:
        """Remove these files; missing ones are ignored."""

    @abstractmethod
    def isdir(self, relpath: str) -> bool: ...

    @abstractmethod
    def listdir(self, relpath: str) -> List[str]:
        """Names of the files and directories directly under ``relpath``, sorted ([] when none)."""

    # --- derived, one place for all backends ------------------------------------------------------------
    def write_file(self, relpath: str, produce: Callable, *, durable: bool = True, atomic: bool = True,
                   exclusive: bool = False, size_hint: int = 0, reuse: bool = False) -> FileRecord:
        """Call ``produce(fileobj)`` to write ``relpath``; the bytes are CRC32C-checksummed and counted as
        they pass. ``durable=False``: the caller makes the file durable later with ``sync_files``.
        ``atomic=False``: a crash may leave a partial file under its key (only for files inside an
        uncommitted staging directory). ``size_hint``: the bytes ``produce`` is expected to write, when known
        (a local disk writes large files past the page cache). ``reuse`` (with ``atomic=False``): the file at
        ``relpath`` may be a retired checkpoint's that nobody needs any more (reuse.py), which a backend with
        ``caps.reuse_files`` overwrites in place, cut to its new length, instead of creating a new file. Blocks
        until the backend acknowledged the write."""
        sink = self._open_sink(relpath, atomic, exclusive, size_hint, reuse)
        try:
            writer = _CountingWriter(sink, relpath)
            produce(writer)
            record = FileRecord(relpath, writer.size, writer.crc)
            sink.finish(record, durable)
        except BaseException:
            sink.abort()
            raise
        return record

    def write_parts(self, relpath: str, parts: Sequence, *, durable: bool = True, atomic: bool = True,
                    exclusive: bool = False, reuse: bool = False) -> FileRecord:
        """``write_file`` of bytes already in memory: ``parts`` (bytes-like objects) written one after the other,
        with no file object between (a local file gets them in one system call). Blocks as ``write_file``."""
        views = [memoryview(p).cast("B") for p in parts]
        crc = 0
        for view in views:
            crc = _crc32c.crc32c(view, crc)
        record = FileRecord(relpath, sum(len(v) for v in views), crc)
        sink = self._open_sink(relpath, atomic, exclusive, record.size, reuse)
        try:
            sink.write_parts(views)
            sink.finish(record, durable)
        except BaseException:
            sink.abort()
            raise
        return record

    def _open_sink(self, relpath: str, atomic: bool, exclusive: bool, size_hint: int, reuse: bool) -> Sink:
        if _write_hook is not None:
            _write_hook(relpath)
        if reuse and self.caps.reuse_files:
            return self._sink(relpath, atomic, exclusive, size_hint, reuse=True)
        return self._sink(relpath, atomic, exclusive, size_hint)

    def write_bytes(self, relpath: str, data: bytes, **kw) -> FileRecord:
        return self.write_parts(relpath, (data,), **kw)

    def read_bytes(self, relpath: str) -> bytes:
        return self.read(relpath)

    def read_into(self, relpath: str, view: memoryview, offset: int = 0,
                  on_range: Optional[Callable[[int, int], None]] = None, expect: Optional[int] = None) -> int:
        """Fill ``view`` with the file's bytes from ``offset`` (fewer only at the end of the file); how many were
        read. Where the backend has local files they go straight into ``view``, with no bytes object between.
        ``on_range(start, end)``: told of each filled span of ``view`` as it is complete (an object store's
        ranged GETs, from their threads; here once, at the end), so a reader can use it while the rest arrives.
        ``expect``: how many bytes the caller expects (the manifest's size): once that many are in, no further
        read only to confirm the end of the file (a ``view`` one byte longer still shows a longer file, in the
        same read). FileNotFoundError."""
        local = self.local_path(relpath)
        if local is None:
            data = self.read(relpath, offset, len(view))
            view[:len(data)] = data
            if on_range is not None:
                on_range(0, len(data))
            return len(data)
        fd = os.open(local, os.O_RDONLY)
        try:
            got = 0
            stop = len(view) if expect is None else min(len(view), expect)
            while got < stop:
                n = os.preadv(fd, [view[got:]], offset + got)
                if n <= 0:
                    break
                got += n
            if on_range is not None:
                on_range(0, got)
            return got
        finally:
            os.close(fd)

    def prefetch(self, relpaths: Sequence[str]) -> None:
        """Ask for these files' bytes ahead of reading them, not waiting for the reads. A no-op here (an object
        store's reads are ranged GETs in parallel already); ``LocalStorage`` starts the kernel's readahead. Never
        raises: a file that cannot be prefetched is left to its read, which names the problem."""

    def blocks(self, relpath: str) -> Iterator[memoryview]:
        """One file's bytes in order, READ_BLOCK at a time, for a streaming pass (checksums): ranged reads here;
        LocalStorage reads through one open file into one reused buffer, so a block is valid only until the
        next is asked for. Raises FileNotFoundError for a missing file when the first block is asked for."""
        total = self.size(relpath)
        for off in range(0, total, READ_BLOCK):
            data = self.read(relpath, off, min(READ_BLOCK, total - off))
            if not data:
                return
            yield memoryview(data).cast("B")

    def crc32c(self, relpath: str) -> tuple:
        """(size, CRC32C) of one file without holding it in memory (``blocks``)."""
        return crc32c_of_blocks(self.blocks(relpath))

    def exists(self, relpath: str) -> bool:
        """A file or a non-empty directory (like os.path.exists)."""
        return self.isfile(relpath) or self.isdir(relpath)

    def isfile(self, relpath: str) -> bool:
        try:
            self.stat(relpath)
            return True
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
            return False

    def size(self, relpath: str) -> int:
        return self.stat(relpath).size

    def mtime(self, relpath: str) -> float:
        return self.stat(relpath).mtime

    def remove_file(self, relpath: str) -> None:
        self.delete_many([relpath])

    def remove_tree(self, relpath: str) -> None:
        self.delete_many(self.list(relpath))

    def makedirs(self, relpath: str) -> None:
        """Directories exist implicitly in a key space; POSIX overrides."""

    def rename(self, src: str, dst: str) -> None:
        raise NotImplementedError(f"{type(self).__name__} cannot rename ({self.root}): use the marker commit")

    def exchange(self, a: str, b: str) -> bool:
        """Atomically swap two existing directories; False when this storage cannot (nothing changed)."""
        return False

    def sync_files(self, relpaths: Iterable[str]) -> None:
        """Make files written with ``durable=False`` durable (no-op where acknowledged writes are)."""

    def sync_dirs(self, relpaths: Iterable[str]) -> None:
        """Make directory entries (new files, renames) durable (no-op without directories)."""

    def abandon_batch(self) -> None:
        """The files written with ``durable=False`` since the last ``sync_files`` will not be synced (their save
        failed): let go of what the backend still holds for them. Never raises; the save's own error is what
        counts. Called by the write pool on the runner thread."""

    def start_sync(self) -> None:
        """Have what was written so far reach the disk ahead of ``sync_files``, which then has less left to wait
        for. A hint: nothing is durable because of it, and errors surface at ``sync_files``. Blocks until done
        (the write pool runs it on a thread of its own); no-op where ``sync_files`` has nothing to gain."""

    def local_path(self, relpath: str) -> Optional[str]:
        """A filesystem path for the key when the backend is local (for memory-mapped reads), else None."""
        return None

    def small_files_one_writer(self) -> bool:
        """True when small files are written here fastest by one thread: creating one costs this host's CPU,
        not a round trip (a local filesystem). False (object stores, network filesystems): every creation
        waits on the network, so small files are written by all the writer threads at once."""
        return False

    #: Set by an async save on the storage it writes through: its files are written beside the training, where the
    #: kernel's work for them is best done by the save's own threads at their low priority
    #: (``LocalStorage.starts_writeback``). A save the caller waits for, and the offline tools, leave it False.
    beside_training = False

    def starts_writeback(self, size: int) -> bool:
        """Whether a file of ``size`` bytes written for a later batched sync (``durable=False``) has its writeback
        to the disk started by the writer as it closes it (``sync_file_range``), so a caller need not hint it
        again. False here (object stores: nothing to write back)."""
        return False

    def reads_direct(self, size: int) -> bool:
        """Whether a file of ``size`` bytes is read here fastest past the page cache (``read_direct``): on a disk
        of this host, for a large file whose bytes go into memory that is reused (the load's ``ReadBuffers``).
        False here (object stores)."""
        return False

    def read_direct(self, relpath: str, view: memoryview) -> int:
        """Fill ``view`` (page-aligned, its length a multiple of 4 KiB) with the file's bytes from its start, past
        the page cache (O_DIRECT); how many were read (fewer only at the end of the file). Only where
        ``reads_direct`` said yes. FileNotFoundError."""
        raise NotImplementedError(f"{type(self).__name__} has no direct reads (reads_direct is False)")

    @contextlib.contextmanager
    def open_local(self, relpath: str) -> Iterator[Optional[LocalFile]]:
        """The key's local file held open for the ``with`` block (memory-mapped reads), or None when the
        backend has no local files (object stores). FileNotFoundError when a local key is missing."""
        local = self.local_path(relpath)
        if local is None:
            yield None
            return
        with open(local, "rb", buffering=0) as f:
            fd = f.fileno()
            src = f"/proc/self/fd/{fd}"
            yield LocalFile(src if os.path.exists(src) else local, os.fstat(fd).st_size, fd)

    @abstractmethod
    def child(self, relpath: str) -> "Storage":
        """The same backend rooted at ``relpath`` under this root."""

    @abstractmethod
    def parent(self) -> Tuple["Storage", str]:
        """(the same backend rooted at the directory holding this root, this root's name in it).
        ValueError when the root has no parent here (a bucket's top: a tool needs a prefix to write)."""

    def list_stats(self, prefix: str = "") -> Dict[str, Stat]:
        """{key: Stat} of every file under ``prefix``, like ``list``. Object stores answer from the listing
        itself (one LIST request per 1,000 keys, no request per key)."""
        return {rel: self.stat(rel) for rel in self.list(prefix)}

    def canonical_root(self) -> str:
        """The root as one spelling per location (symlinks resolved on POSIX), to tell whether two
        Storages overlap."""
        return self.root.rstrip("/")

    def link_from(self, src: "Storage", src_rel: str, relpath: str) -> bool:
        """Make ``relpath`` the same file as ``src``'s ``src_rel`` without copying bytes (a hard link on one
        POSIX filesystem); False when this backend cannot (the caller copies)."""
        return False

    def copy_from(self, src: "Storage", src_rel: str, relpath: str, *, durable: bool = True) -> FileRecord:
        """Copy ``src``'s file ``src_rel`` to ``relpath`` in blocks (never whole in memory); the record has the
        CRC32C of the bytes written."""
        total = src.size(src_rel)
        block = max(READ_BLOCK, 32 << 20) if not src.caps.local else READ_BLOCK

        def produce(f):
            for off in range(0, total, block):
                f.write(src.read(src_rel, off, min(block, total - off)))

        return self.write_file(relpath, produce, durable=durable)

    def check_writable(self, what: str = "directory") -> None:
        """Raise CheckpointArgumentError (naming the root as ``what``) when a save here is bound to fail for a reason known up front (a
        POSIX path that is a file, or a directory this process may not write). Object stores learn about
        access only from the first request."""
