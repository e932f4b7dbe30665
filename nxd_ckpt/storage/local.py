"""POSIX storage (local disk, FSx for Lustre, NFS): atomic files by temporary name + rename, durability by
fsync (batched and parallel for the files of a staging directory), directories fsynced."""
from __future__ import annotations

import ctypes
import errno
import functools
import mmap
import os
import shutil
import stat
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Iterable, Iterator, List, Optional, Sequence, Tuple

from ..layout import TMP_SUFFIX

from .base import READ_BLOCK, Capabilities, FileRecord, AlreadyExistsError, Sink, Stat, Storage
from .closer import Closer


def file_blocks(path: str) -> Iterator[memoryview]:
    """A local file's bytes in READ_BLOCK blocks, read through one open file into one reused buffer (each block
    valid until the next is asked for)."""
    with open(path, "rb", buffering=0) as f:
        buf = bytearray(min(READ_BLOCK, max(1, os.fstat(f.fileno()).st_size)))
        view = memoryview(buf)
        while True:
            n = f.readinto(buf)
            if not n:
                return
            yield view[:n]


_SYNC_THREADS = 8


_CREATE = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0)

#: A file of at least this many bytes written for a later batched sync (``durable=False``) has its writeback
#: started as it is closed (``sync_file_range`` WRITE on its descriptor), so that the disk works while the next
#: files are written instead of all of it in the final ``sync_files``. Smaller files are left to that sync (a
#: system call each would cost more than it overlaps), except on a disk of this host (``OWN_WRITEBACK``).
WRITEBACK_MIN_BYTES = 1 << 20
#: During an async save (``Storage.beside_training``) on a disk of this host (ext4, xfs, btrfs: ``_DIRECT_FS_TYPES``)
#: every file written for a later batched sync has its writeback started as it is closed, whatever its size: the
#: writeback's kernel work (block allocation, submitting the pages) is then done by the save's writer threads at
#: niceness +19 instead of by the kernel's flusher threads at niceness 0 beside the training. Measured at 0.5 GB /
#: 5,000 tensors: training time lost per save 0.14 against 0.23 s, the same host CPU, a longer commit, and that CPU
#: counted in the process's (README "Levers measured"). Not for a save the caller waits for, whose commit it
#: only lengthens. False: only files of WRITEBACK_MIN_BYTES or more (the A/B variant ``no_own_writeback`` of
#: scripts/ab_train.py).
OWN_WRITEBACK = True
#: Where the writeback is the save's own (``OWN_WRITEBACK``), a small file's ``sync_file_range`` and close run on
#: one background thread (``closer.Closer``) instead of on its writer, so that the small-file thread goes on to
#: the next file meanwhile. False: the writer does both (the A/B lever ``closer`` of scripts/ab_commit.py and the
#: variant ``no_closer`` of scripts/ab_train.py).
CLOSE_BEHIND = True

#: How long a failed save waits for ``CLOSER`` to close its files (``LocalStorage.abandon_batch``) before it
#: reports its own error anyway.
ABANDON_WAIT_S = 10.0

#: A buffered file created on ext4 with at least this many bytes gets its blocks reserved in one piece just
#: before its write (``_reserve``): ext4's delayed allocation otherwise reserves, maps and records every 4 KiB
#: block of the write one at a time, and allocates them again at writeback. Measured here (5,000 new files, each
#: written, its writeback started and closed, then one ``syncfs``; page cache dropped; 5 alternating rounds):
#: 100 KB files 61-78 against 52-59 us of process CPU a file and 72-84 against 58-66 us of the host's; 256 KiB
#: 73-79 against 60-62; 40 KB no difference; 4 KiB 3-4 us dearer (the extra system call); on a journaled ext4
#: (a loop device) at 100 KB 62-89 against 58-60 us. Files of ``DIRECT_MIN_BYTES`` or more are written directly
#: and reserved by ``RESERVE_BLOCKS``. 1 << 62: never (the A/B lever ``reservesmall`` of scripts/ab_commit.py).
RESERVE_BUFFERED_MIN_BYTES = 64 << 10

#: On a local filesystem the writer threads create their files one at a time (see ``LocalStorage._sink``);
#: False creates them concurrently (the A/B lever ``createlock`` of scripts/ab_commit.py).
SERIAL_CREATE = True


class _FileSink(Sink):
    _flags = _CREATE
    direct = False
    taken_size = -1         # the size of the file taken over in place (``reuse``), -1 for a file created
    writeback_min = 1 << 62     # files this large or larger start their writeback as they close (set by the storage)
    close_behind = False        # ... and are handed to ``CLOSER`` for it (set by the storage)
    reserve_min = 1 << 62       # files created this large or larger get their blocks reserved (set by the storage)

    def __init__(self, final: str, atomic: bool, exclusive: bool, create_lock: Optional[threading.Lock] = None,
                 reuse: bool = False):
        self._final = final
        self._path = f"{final}{TMP_SUFFIX}" if atomic else final
        self._atomic = atomic
        self._exclusive = exclusive
        if exclusive and os.path.exists(final):
            raise AlreadyExistsError(errno.EEXIST, "already exists", final)
        self._reuse = reuse and not atomic
        if self._reuse:
            # an open of an existing file is a lookup, no change to its folder: outside the creation lock
            fd, self.taken_size = _take_over(self._path, self._flags)
            if fd >= 0:
                self._fd = fd
                return
        if create_lock is None:
            self._fd = self._create()
        else:
            with create_lock:
                self._fd = self._create()

    def _create(self) -> int:
        try:
            return os.open(self._path, self._flags, 0o666)
        except FileNotFoundError:
            # The folder is created on the first miss only: thousands of tensor files share a few folders,
            # and a makedirs per file cost three system calls each.
            os.makedirs(os.path.dirname(self._final), exist_ok=True)
        except NotADirectoryError:
            if not self._reuse:
                raise
            _clear_folders(os.path.dirname(self._final))   # a retired tag's file where this save wants a folder
        return os.open(self._path, self._flags, 0o666)

    def write(self, view: memoryview) -> None:
        done, total = 0, len(view)
        while done < total:
            done += os.write(self._fd, view[done:])

    def write_parts(self, views: Sequence[memoryview]) -> None:
        if self.taken_size < 0:
            size = sum(len(view) for view in views)
            if size >= self.reserve_min:
                _reserve(self._fd, size)
        done = os.writev(self._fd, views)
        for view in views:          # what a short write left (a signal, a full disk's last bytes)
            if done >= len(view):
                done -= len(view)
                continue
            self.write(view[done:])
            done = 0

    def _close(self) -> None:
        fd, self._fd = self._fd, -1
        if fd >= 0:
            os.close(fd)

    def finish(self, record: FileRecord, durable: bool) -> None:
        try:
            if self.taken_size > record.size and not self.direct:
                os.ftruncate(self._fd, record.size)     # a longer file's tail (the direct sink cuts its own)
            if durable:
                os.fsync(self._fd)
            elif record.size >= self.writeback_min and not self.direct:
                self._start_writeback()
        finally:
            self._close()
        if self._atomic:
            if self._exclusive:
                try:
                    os.link(self._path, self._final)     # fails when another writer got there first
                except FileExistsError:
                    raise AlreadyExistsError(errno.EEXIST, "already exists", self._final) from None
                os.unlink(self._path)
            else:
                os.replace(self._path, self._final)

    def _start_writeback(self) -> None:
        if self.close_behind and not self._atomic:
            CLOSER.hand(self._fd)       # the descriptor is the closer's from here
            self._fd = -1
        else:
            _start_writeback_fd(self._fd)

    def abort(self) -> None:
        try:
            self._close()
        except OSError:
            pass
        try:
            os.unlink(self._path)
        except OSError:
            pass


#: Files of at least this many bytes (as the caller expects them: ``write_file``'s ``size_hint``) are written
#: with O_DIRECT where the filesystem takes it (``_DIRECT_FS_TYPES``): from an aligned bounce buffer straight to
#: the disk, past the page cache. The kernel's copy of each byte into the page cache, and the page cache's own
#: upkeep, cost 1.7-1.9 CPU-s/GB of this host's cores (20-30% of two cores during a save at 1 GB), against
#: 0.4-0.55 CPU-s/GB for the bounce copy and the direct write, which also finished sooner (README "Levers
#: measured"). Smaller files stay buffered: a direct write waits for the disk, and the one small-file thread
#: would wait once per file.
DIRECT_MIN_BYTES = 1 << 20
#: False: every file is written through the page cache (the A/B lever ``direct`` of scripts/ab_commit.py).
DIRECT_WRITES = True
#: False: every file is read through the page cache. True: a large tensor file that the load moves to an XLA device
#: is read with O_DIRECT into a buffer reused between files (``LocalStorage.reads_direct``, the load's
#: ``ReadBuffers``): no page-cache pages to allocate, fill and map, no fresh memory to fault and zero. Measured
#: here (8 threads, 100 files of 10 MB, page cache dropped): 0.15-0.24 against 0.45-0.64 CPU-s/GB for the mapped
#: read, and sooner (README "Load: the read pipeline").
DIRECT_READS = True
#: False: a direct file's blocks are allocated chunk by chunk as written, not reserved first (``_reserve``; the A/B
#: lever ``reserve`` of scripts/ab_commit.py).
RESERVE_BLOCKS = True
#: Bytes of one direct write, and of each bounce buffer (one per file being written directly).
DIRECT_CHUNK = 4 << 20
#: False: bounce buffers in small pages. True: each is aligned to a huge page and asks the kernel for
#: transparent huge pages (``madvise`` HUGEPAGE, honoured where THP is "madvise" or "always"): each 4 MiB write then
#: pins two 2 MiB pages and reaches the disk as one request, not 1,024 pages pinned one by one and the write split
#: into requests at the device's segment limit (254 here). Measured here: 8 threads writing 1 GB took 0.32-0.39 s
#: against 0.50-0.54 s, at 0.02-0.04 against 0.07-0.08 system CPU-s/GB; the training step slowdown during a 1 GB
#: save fell from 1.45x to 1.17x (README "Levers measured").
HUGE_BOUNCES = True
_HUGE_PAGE = 2 << 20
# O_DIRECT wants file offsets, lengths and memory aligned to the device's logical block: 4 KiB covers 512-byte
# and 4 KiB devices.
_DIRECT_ALIGN = 4096
_O_DIRECT = getattr(os, "O_DIRECT", 0)
# Memory at least this large is copied into the bounce buffer with the GIL released.
_COPY_NOGIL_BYTES = 64 << 10


class _Bounces:
    """Page-aligned anonymous buffers of DIRECT_CHUNK bytes, one per file being written directly, kept for the
    next file (as many as the writer threads that ever wrote at once). Each is (mapping, its view, its
    address). Thread-safe."""

    def __init__(self):
        self._free: List[Tuple[mmap.mmap, memoryview, int]] = []
        self._lock = threading.Lock()

    def take(self) -> Tuple[mmap.mmap, memoryview, int]:
        with self._lock:
            if self._free:
                return self._free.pop()
        return _new_bounce()

    def give_back(self, bounce: Tuple[mmap.mmap, memoryview, int]) -> None:
        with self._lock:
            self._free.append(bounce)

    def release(self) -> int:
        """Unmap the free buffers; the bytes released. A buffer of which a view is still alive (held by the
        traceback of a failed write) is unmapped when that view goes."""
        with self._lock:
            free, self._free = self._free, []
        for buf, view, _ in free:
            view.release()
            try:
                buf.close()
            except BufferError:
                pass
        return len(free) * DIRECT_CHUNK


BOUNCES = _Bounces()


def _new_bounce() -> Tuple[mmap.mmap, memoryview, int]:
    """A DIRECT_CHUNK buffer, aligned to a huge page and asking for transparent huge pages (HUGE_BOUNCES) where
    the kernel has them: (mapping, the buffer's view, its address). Without them it is still page-aligned."""
    return mapped_buffer(DIRECT_CHUNK, HUGE_BOUNCES)


def mapped_buffer(nbytes: int, huge: bool = True) -> Tuple[mmap.mmap, memoryview, int]:
    """``nbytes`` of memory in an anonymous mapping of their own, page-aligned, or aligned to 2 MiB and asking for
    transparent huge pages when ``huge`` and the kernel has them: (mapping, the bytes' view, their address). The
    view holds the mapping: unmapped when it goes. Bounce buffers, and the slabs of ``PlacedSlabs``."""
    spare = _HUGE_PAGE if huge and hasattr(mmap, "MADV_HUGEPAGE") else 0
    # Private: Python's anonymous mappings are shared by default, i.e. shmem, and shared with forked children.
    # The spare bytes are address space only: never touched, they take no memory.
    buf = mmap.mmap(-1, nbytes + spare, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    start = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    at = (-start) % _HUGE_PAGE if spare else 0
    if spare:
        try:
            buf.madvise(mmap.MADV_HUGEPAGE, at, nbytes)
        except OSError:     # a kernel built without transparent huge pages: small pages, same bytes
            pass
    whole = memoryview(buf)
    view = whole[at:at + nbytes]
    whole.release()         # the slice holds the mapping; releasing it alone lets the mapping close
    return buf, view, start + at


#: Bytes of each mapping that ``PlacedSlabs`` cuts snapshot buffers from (a larger buffer gets one of its own).
SLAB_BYTES = 64 << 20


class PlacedSlabs:
    """Buffers cut one after another from anonymous mappings in transparent huge pages (``mapped_buffer``), each
    buffer's first byte ``lead`` bytes (modulo 4 KiB) past a page boundary: the snapshot buffers that direct
    writes send to the disk from where they are (``staging.HostBufferPool``).

    Why slabs: a huge page backs only a whole, aligned 2 MiB of a mapping, so a buffer of 1-4 MiB mapped on its
    own is mostly small pages, which a direct write pins one by one (or, rounded up to whole huge pages, wastes a
    quarter to a half of its memory). Cut from a slab, every buffer is in huge pages and wastes under 4 KiB.
    A slab is unmapped once the last buffer cut from it is freed and it is no longer the one being cut (a new
    ``PlacedSlabs`` lets go of the current one); ``discard_pages`` gives one buffer's memory back while its
    neighbours live on. Not thread-safe: the caller serializes ``cut``."""

    def __init__(self, slab_bytes: int = SLAB_BYTES):
        self.slab_bytes = -(-slab_bytes // _HUGE_PAGE) * _HUGE_PAGE    # whole huge pages (``discard_pages``)
        self._view: Optional[memoryview] = None
        self._addr = 0          # address of the current slab's first byte
        self._used = 0          # bytes of it cut so far

    def cut(self, nbytes: int, lead: int) -> memoryview:
        """A writable view of ``nbytes`` whose first byte sits ``lead`` (mod 4 KiB) past a page boundary; it
        keeps its slab mapped. Raises OSError when the kernel refuses a new mapping (ENOMEM)."""
        skip = (lead - self._addr - self._used) % _DIRECT_ALIGN
        if self._view is None or self._used + skip + nbytes > len(self._view):
            size = max(self.slab_bytes, -(-(nbytes + _DIRECT_ALIGN) // _HUGE_PAGE) * _HUGE_PAGE)
            _, self._view, self._addr = mapped_buffer(size)
            self._used, skip = 0, lead % _DIRECT_ALIGN
        start = self._used + skip
        self._used = start + nbytes
        return self._view[start:start + nbytes]


_libc_madvise = None


def _madvise(start: int, length: int, advice: int) -> None:
    global _libc_madvise
    if _libc_madvise is None:
        _libc_madvise = ctypes.CDLL(None, use_errno=True).madvise
        _libc_madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    _libc_madvise(start, length, advice)     # refused (EINVAL: no such advice here): the pages stay, harmless


def discard_pages(address: int, nbytes: int) -> None:
    """Give the memory of a ``PlacedSlabs`` buffer that nobody reads again back to the OS: its whole pages are
    dropped (``MADV_DONTNEED``; a private anonymous page reads as zeros after), and the 2 MiB regions it touches
    stop asking for huge pages (``MADV_NOHUGEPAGE``), else the kernel's khugepaged, which rebuilds a huge page
    around any page still present (``max_ptes_none``), would fault the dropped pages back in next to a live
    neighbour. Only for slab buffers: those regions lie inside the buffer's slab. A no-op where there is none."""
    if not hasattr(mmap, "MADV_DONTNEED"):
        return
    start = -(-address // mmap.PAGESIZE) * mmap.PAGESIZE
    end = (address + nbytes) // mmap.PAGESIZE * mmap.PAGESIZE
    if end <= start:
        return
    if hasattr(mmap, "MADV_NOHUGEPAGE"):
        first = address // _HUGE_PAGE * _HUGE_PAGE
        _madvise(first, -(-(address + nbytes) // _HUGE_PAGE) * _HUGE_PAGE - first, mmap.MADV_NOHUGEPAGE)
    _madvise(start, end - start, mmap.MADV_DONTNEED)


class _DirectFileSink(_FileSink):
    """A file written with O_DIRECT: its bytes gathered into a bounce buffer and written to the disk a chunk at
    a time, the last chunk padded to the block size and the file then cut to its length. Durability is still
    the batch's sync (the file's size and extents are in the filesystem's journal until then). A filesystem
    that refuses O_DIRECT, at the open or at a write (EINVAL), gets the same bytes buffered."""

    _flags = _CREATE | _O_DIRECT

    def __init__(self, final: str, atomic: bool, exclusive: bool, create_lock: Optional[threading.Lock] = None,
                 size_hint: int = 0, reuse: bool = False):
        self.direct = True
        self._bounce = BOUNCES.take()   # first: a sink that failed to open has nothing else to give back
        self._fill = 0                  # bytes in the bounce buffer
        self._offset = 0                # file offset of the bounce buffer's first byte
        self._middle: Optional[memoryview] = None   # caller's bytes written between the bounce buffer's first
        self._split = 0                             # _split bytes and the rest (``_write_in_place``)
        try:
            super().__init__(final, atomic, exclusive, create_lock, reuse)
        except BaseException:
            self._give_back()
            raise
        # The file's blocks reserved in one piece: written a chunk at a time by several threads at once, each
        # chunk was otherwise allocated where the disk's free space was at that moment (13 MB files in 1 to
        # 4 extents instead of 1 to 2), and loads read them about 10% slower.
        if RESERVE_BLOCKS:
            _reserve(self._fd, size_hint + _DIRECT_ALIGN)

    def _create(self) -> int:
        try:
            return super()._create()
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
        self.direct = False
        self._flags = _CREATE
        return super()._create()

    def write_parts(self, views: Sequence[memoryview]) -> None:
        for view in views:
            if not (len(view) >= DIRECT_MIN_BYTES and self._write_in_place(view)):
                self.write(view)

    def _write_in_place(self, view: memoryview) -> bool:
        """Take ``view``'s block-aligned middle from where it is in memory, without the bounce buffer's copy: its
        head goes into the bounce buffer up to a block boundary of the file, the middle is held, and what follows
        (the rest of ``view``, the trailer) goes into the bounce buffer after the head, so that the next flush
        writes all three with one ``pwritev``. Possible when the bytes that fall on a block boundary of the file
        sit on one in memory (``PlacedSlabs`` places a snapshot's buffers so), once per file; False,
        nothing written, otherwise."""
        addr = _address(view)
        head = -(self._offset + self._fill) % _DIRECT_ALIGN
        if (not self.direct or self._middle is not None or addr is None or (addr + head) % _DIRECT_ALIGN
                or len(view) < head + _DIRECT_ALIGN):
            return False
        self.write(view[:head])     # the bounce buffer now ends on a block boundary of the file
        middle = (len(view) - head) // _DIRECT_ALIGN * _DIRECT_ALIGN
        self._split, self._middle = self._fill, view[head:head + middle]
        self.write(view[head + middle:])
        return True

    def write(self, view: memoryview) -> None:
        _, dst, addr = self._bounce
        pos, total = 0, len(view)
        while pos < total:
            n = min(DIRECT_CHUNK - self._fill, total - pos)
            _copy(dst, addr, self._fill, view[pos:pos + n])
            self._fill += n
            pos += n
            if self._fill == DIRECT_CHUNK:
                self._flush()

    def _flush(self) -> None:
        """Write the bounce buffer at its file offset (with the middle held by ``_write_in_place`` between its
        first ``_split`` bytes and the rest): directly, padded to the block size (cut at the end), or buffered
        once the filesystem has refused that."""
        view, middle = self._bounce[1], self._middle
        held = [view[:self._split], middle] if middle is not None else []
        rest = self._split if middle is not None else 0      # where the bounce bytes after the held ones start
        if self.direct:
            padded = -(-self._fill // _DIRECT_ALIGN) * _DIRECT_ALIGN
            try:
                _pwritev_all(self._fd, held + [view[rest:padded]], self._offset)
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                self.direct = False     # a device that wants another alignment: buffered from here on
                _set_direct(self._fd, False)
        if not self.direct:
            _pwritev_all(self._fd, held + [view[rest:self._fill]], self._offset)
        self._offset += self._fill + (len(middle) if middle is not None else 0)
        self._fill, self._split, self._middle = 0, 0, None

    def finish(self, record: FileRecord, durable: bool) -> None:
        if self._fill or self._middle is not None:
            self._flush()
        os.ftruncate(self._fd, self._offset)        # the last chunk's padding, and blocks reserved and not used
        self._give_back()
        super().finish(record, durable)

    def abort(self) -> None:
        self._give_back()
        super().abort()

    def _give_back(self) -> None:
        self._middle = None
        bounce, self._bounce = self._bounce, None
        if bounce is not None:
            BOUNCES.give_back(bounce)


def _open_folder(folder: str) -> int:
    """A descriptor on ``folder`` for ``syncfs`` (the batch's anchor, an early sync's own)."""
    return os.open(folder, os.O_RDONLY | os.O_DIRECTORY | getattr(os, "O_CLOEXEC", 0))


def _take_over(path: str, flags: int) -> Tuple[int, int]:
    """Open the file at ``path``, a retired checkpoint's that nobody needs any more, to be overwritten in place:
    (descriptor, its current size), or (-1, -1) when there is none or it must not be overwritten: not a regular file
    (never followed if a symlink; a FIFO is not waited on), or a hard link (its bytes are also another name's, an
    offline tool's link of a file it did not change, say). What is refused is removed, so that the caller creates
    the file in its place. The folders on the way are never links: ``reuse.retire`` keeps no tree that holds one."""
    try:
        # O_NONBLOCK: a FIFO left there would otherwise block the open forever (it then fails, ENXIO)
        fd = os.open(path, (flags & ~(os.O_CREAT | os.O_TRUNC)) | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        return -1, -1
    except OSError:
        # anything else (a symlink, a FIFO, a folder, O_DIRECT refused for what is there): removed, so that the
        # caller's creation, which follows links and waits on FIFOs, never meets it
        _discard(path)
        return -1, -1
    st = os.fstat(fd)
    if st.st_nlink == 1 and stat.S_ISREG(st.st_mode):
        return fd, st.st_size
    os.close(fd)
    _discard(path)
    return -1, -1


def _clear_folders(folder: str) -> None:
    """Make ``folder`` a folder where a retired tag left a file (or anything else) at it or at one of its parents:
    the deepest of them that exists is that file."""
    blocked = folder
    while blocked and not os.path.lexists(blocked):
        blocked = os.path.dirname(blocked)
    if blocked and (os.path.islink(blocked) or not os.path.isdir(blocked)):
        _discard(blocked)
    os.makedirs(folder, exist_ok=True)


def _discard(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    else:
        try:
            os.unlink(path)
        except OSError:
            pass


_FALLOC_FL_KEEP_SIZE = 1


def _reserve(fd: int, nbytes: int) -> None:
    """Allocate ``nbytes`` of the file's blocks now, its size unchanged (Linux ``fallocate`` KEEP_SIZE, which
    the filesystem does or refuses; never glibc's ``posix_fallocate``, which writes zeros where it is refused).
    A hint: refused, nothing happens. Blocks not written are freed by the file's final ``ftruncate``."""
    fn = _fallocate()
    if fn is not None:
        fn(fd, _FALLOC_FL_KEEP_SIZE, 0, nbytes)


@functools.lru_cache(maxsize=1)
def _fallocate():
    fn = getattr(_libc(), "fallocate", None) if _libc() is not None else None
    if fn is not None:
        fn.argtypes = (ctypes.c_int, ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong)
        fn.restype = ctypes.c_int
    return fn


def _set_direct(fd: int, on: bool) -> None:
    import fcntl

    flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    fcntl.fcntl(fd, fcntl.F_SETFL, (flags | _O_DIRECT) if on else (flags & ~_O_DIRECT))


def _pwritev_all(fd: int, views: List[memoryview], offset: int) -> None:
    """``views`` written one after the other at ``offset``, in one system call unless it writes short."""
    views = [v for v in views if len(v)]
    while views:
        done = os.pwritev(fd, views, offset)
        offset += done
        while views and done >= len(views[0]):
            done -= len(views[0])
            views.pop(0)
        if done:
            views[0] = views[0][done:]


def _address(view: memoryview) -> Optional[int]:
    """The address of ``view``'s first byte; None for a read-only view (ctypes takes only writable buffers)."""
    if view.readonly or not view.contiguous:
        return None
    return ctypes.addressof(ctypes.c_char.from_buffer(view))


def _copy(dst: memoryview, dst_addr: int, at: int, src: memoryview) -> None:
    """``src`` into ``dst`` at ``at``: a large writable source by ``memmove`` with the GIL released (the
    training thread runs meanwhile), the rest by a slice copy."""
    n = len(src)
    src_addr = _address(src) if n >= _COPY_NOGIL_BYTES else None
    if src_addr is not None:
        ctypes.memmove(dst_addr + at, src_addr, n)
    else:
        dst[at:at + n] = src


class LocalStorage(Storage):
    caps = Capabilities(rename=True, exchange=True, needs_sync=True, local=True, create_exclusive=True,
                        reuse_files=True)
    fix_hint = "the directory (free space, permissions)"

    def __init__(self, root: str):
        self.root = os.path.abspath(root)
        self._anchor = _SyncAnchor()
        self._create_lock = threading.Lock()

    def path(self, relpath: str) -> str:
        return os.path.join(self.root, relpath) if relpath else self.root

    local_path = path

    def small_files_one_writer(self) -> bool:
        """True on a local filesystem (ext4, xfs, btrfs, tmpfs: see the write pool's ``SMALL_WRITER``), told by
        the filesystem of the root or of its nearest existing parent; False on anything else (NFS, Lustre,
        FUSE, overlayfs, ZFS) and off Linux."""
        return self._filesystem in _LOCAL_FS_TYPES

    def prefetch(self, relpaths: Sequence[str]) -> None:
        """Start the kernel's readahead of each whole file (``_prefetch_file``) and return. Blocks the calling
        thread for each file's open (a lookup; on a cold cache the read of its inode) and for queuing its reads,
        never for the reads. Only on a disk of this host (``_PREFETCH_FS_TYPES``): on a network filesystem each
        open is a round trip to the server (not measured), and tmpfs has nothing to read."""
        if _FADVISE is None or self._filesystem not in _PREFETCH_FS_TYPES:
            return
        for relpath in relpaths:
            _prefetch_file(self.path(relpath))

    def writes_direct(self, size_hint: int) -> bool:
        """Whether a file of about ``size_hint`` bytes is written with O_DIRECT (``DIRECT_MIN_BYTES``): on
        ext4, xfs and btrfs (told as for ``small_files_one_writer``), not on tmpfs (no disk), nor on network
        filesystems (each direct write would wait for a round trip), nor off Linux."""
        return (DIRECT_WRITES and size_hint >= DIRECT_MIN_BYTES and _O_DIRECT != 0
                and self._filesystem in _DIRECT_FS_TYPES)

    def starts_writeback(self, size: int) -> bool:
        """Every file on a disk of this host during an async save (``OWN_WRITEBACK``); otherwise files of
        WRITEBACK_MIN_BYTES or more (a hint per small file was not measured on tmpfs, which has no disk, nor on
        network filesystems)."""
        return size >= self._writeback_min()

    def _writeback_min(self) -> int:
        own = OWN_WRITEBACK and self.beside_training and self._filesystem in _DIRECT_FS_TYPES
        return 0 if own else WRITEBACK_MIN_BYTES

    def reads_direct(self, size: int) -> bool:
        """Whether a file of ``size`` bytes is read with O_DIRECT (``read_direct``): at DIRECT_MIN_BYTES or more,
        on the filesystems that take direct writes (ext4, xfs, btrfs), off where DIRECT_READS is."""
        return (DIRECT_READS and size >= DIRECT_MIN_BYTES and _O_DIRECT != 0
                and self._filesystem in _DIRECT_FS_TYPES)

    def read_direct(self, relpath: str, view: memoryview) -> int:
        if len(view) % _DIRECT_ALIGN:
            raise ValueError(f"a direct read takes whole {_DIRECT_ALIGN}-byte blocks, got {len(view)} bytes")
        fd = os.open(self.path(relpath), os.O_RDONLY | _O_DIRECT | getattr(os, "O_CLOEXEC", 0))
        try:
            got = 0
            while got < len(view):
                n = os.preadv(fd, [view[got:]], got)
                got += max(n, 0)
                if n <= 0 or n % _DIRECT_ALIGN:     # a part block: the end of the file
                    break
            return got
        finally:
            os.close(fd)

    @functools.cached_property
    def _filesystem(self) -> Optional[int]:
        """statfs f_type of the root, or of its nearest existing parent (asked once)."""
        probe = self.root
        while not os.path.isdir(probe) and os.path.dirname(probe) != probe:
            probe = os.path.dirname(probe)
        return _filesystem_type(probe)

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

    def _sink(self, relpath: str, atomic: bool, exclusive: bool, size_hint: int = 0, reuse: bool = False) -> Sink:
        # On a local filesystem the writer threads create their files one at a time: concurrent creations
        # in one folder contend for its lock, and on a 2-core VM under load 8 threads took 2.3-2.7 s of
        # system CPU for 5,000 files created one at a time against 3.4-3.8 s concurrently, and finished in
        # 3.1-4.3 s instead of 7.5-14 s (the writes stay parallel). Network filesystems (a round trip per
        # creation) keep creating in parallel.
        lock = self._create_lock if self._anchor.local_fs and SERIAL_CREATE else None
        if size_hint and self.writes_direct(size_hint):
            sink: _FileSink = _DirectFileSink(self.path(relpath), atomic, exclusive, lock, size_hint, reuse)
        else:
            sink = _FileSink(self.path(relpath), atomic, exclusive, lock, reuse)
        sink.writeback_min = self._writeback_min()
        if self._filesystem in _RESERVE_FS_TYPES:
            sink.reserve_min = RESERVE_BUFFERED_MIN_BYTES
        sink.close_behind = CLOSE_BEHIND and sink.writeback_min == 0
        if not self._anchor.armed:
            self._anchor.arm(os.path.dirname(sink._path))
        return sink

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

    def blocks(self, relpath: str) -> Iterator[memoryview]:
        return file_blocks(self.path(relpath))

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
        """Make the files durable: one ``syncfs`` for those on the filesystem this storage has written to
        since the last call, when that filesystem is known to implement it (``_SyncAnchor``); else
        ``fdatasync`` of every file on parallel threads (the kernel has been writing the pages back since
        they were written, and one deep queue of syncs finishes sooner than one sync after each file). First
        waits until ``CLOSER`` has closed every file handed to it, and raises what a close met."""
        paths = [self.path(r) for r in relpaths]
        CLOSER.drain()
        anchor_dev, anchor_fd, early_error = self._anchor.take()
        try:
            if early_error is not None:
                raise early_error
            rest = paths
            if anchor_fd is not None and paths:
                dev_of = {d: os.stat(d).st_dev for d in {os.path.dirname(p) for p in paths}}
                rest = [p for p in paths if dev_of[os.path.dirname(p)] != anchor_dev]
                if len(rest) < len(paths):
                    _syncfs(anchor_fd)
            if not rest:
                return
            with ThreadPoolExecutor(max_workers=min(_SYNC_THREADS, len(rest)),
                                    thread_name_prefix="nxd_ckpt-sync") as pool:
                for _ in pool.map(_fdatasync, rest):
                    pass
        finally:
            if anchor_fd is not None:
                os.close(anchor_fd)

    def abandon_batch(self) -> None:
        """Close what ``CLOSER`` still holds (a partial group of up to 7 files would otherwise stay open, their
        space held, until the next save's sync) and the sync anchor's folder. Blocks until the closer is done,
        at most ``ABANDON_WAIT_S`` (a closer stuck on a failing disk closes them when it gets to them); what a
        close met is dropped with the batch."""
        try:
            CLOSER.drain(ABANDON_WAIT_S)
        except OSError:         # a close error or TimeoutError: the save's own error is the one reported
            pass
        _dev, fd, _error = self._anchor.take()
        if fd is not None:
            try:
                os.close(fd)
            except OSError:
                pass

    def start_sync(self) -> None:
        """One ``syncfs`` of the filesystem of the batch being written (``_SyncAnchor``), on a descriptor of its
        own: the anchor keeps its view of writeback errors for ``sync_files``, and an error this call gets is
        kept and raised by ``sync_files`` too (the kernel reports some errors to the first sync that asks).
        Nothing where the batch is not synced with ``syncfs`` or nothing was written yet."""
        folder = self._anchor.folder()
        if folder is None:
            return
        try:
            fd = _open_folder(folder)
        except OSError:
            return
        try:
            _syncfs(fd)
        except OSError as exc:
            self._anchor.keep_error(exc)
        finally:
            os.close(fd)

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


class _SyncAnchor:
    """A descriptor on the filesystem being written to, opened before the first byte of a batch of files,
    so that ``syncfs`` on it reports every writeback error of that filesystem since then (Linux >= 5.8
    reports them through the descriptor, also when another process has seen the error first).

    One ``syncfs`` instead of an ``fdatasync`` per file: for 5,000 files of 50 KB here, 0.16-0.18 s instead
    of 0.55-0.59 s, and no CPU in this process instead of 0.36 s. It is used only on the local filesystems
    whose ``syncfs`` waits for the data (ext4, xfs, btrfs, tmpfs); elsewhere (NFS, Lustre, FUSE) the
    files are synced one by one. It syncs the other dirty data of that filesystem too."""

    def __init__(self):
        self.armed = False
        self.local_fs = False       # ext4, xfs, btrfs or tmpfs, with a kernel and libc that have syncfs
        self._lock = threading.Lock()
        self._dev: Optional[int] = None
        self._fd: Optional[int] = None
        self._folder: Optional[str] = None
        self._error: Optional[OSError] = None     # what an early sync (start_sync) got, for sync_files

    def arm(self, folder: str) -> None:
        """Called with the folder of a file just created, before anything is written to it. Without an
        anchor (any failure here) the batch is synced file by file."""
        with self._lock:
            if self.armed:
                return
            try:
                self._open(folder)
            finally:
                # Published last: a writer that sees ``armed`` without the lock also sees ``local_fs``
                # (else, under load, writers created several files each without the creation lock).
                self.armed = True

    def _open(self, folder: str) -> None:
        try:
            fd = _open_folder(folder)
        except OSError:
            return
        self.local_fs = _syncfs_usable(fd)
        if self.local_fs:
            self._fd, self._dev, self._folder = fd, os.fstat(fd).st_dev, folder
        else:
            os.close(fd)

    def folder(self) -> Optional[str]:
        """The anchored folder of the batch being written; None when it is not synced with ``syncfs``."""
        with self._lock:
            return self._folder

    def keep_error(self, exc: OSError) -> None:
        with self._lock:
            if self._fd is not None and self._error is None:
                self._error = exc

    def take(self) -> Tuple[Optional[int], Optional[int], Optional[OSError]]:
        """(device, descriptor, an early sync's error) of the batch written since the last call; the caller
        closes the descriptor."""
        with self._lock:
            out = (self._dev, self._fd, self._error)
            self.armed, self._dev, self._fd, self._folder, self._error = False, None, None, None, None
            return out

    def __del__(self):
        # Writers that sync their files themselves (the offline tools) never take the anchor.
        if self._fd is not None:
            try:
                os.close(self._fd)
            except OSError:
                pass


#: statfs f_type of filesystems whose syncfs writes back and waits for every dirty page (and reports errors)
_SYNCFS_TYPES = {0xEF53: "ext4", 0x58465342: "xfs", 0x9123683E: "btrfs", 0x01021994: "tmpfs"}
#: statfs f_type of the filesystems on which creating a file costs this host's CPU, not a network round trip
#: (``LocalStorage.small_files_one_writer``); the same set today, kept apart because they are two facts
_LOCAL_FS_TYPES = dict(_SYNCFS_TYPES)
#: statfs f_type of the filesystems on a disk of this host that take O_DIRECT writes (``writes_direct``)
_DIRECT_FS_TYPES = {k: v for k, v in _SYNCFS_TYPES.items() if v != "tmpfs"}


#: statfs f_type of the filesystems whose buffered files are reserved before their write
#: (``RESERVE_BUFFERED_MIN_BYTES``): measured on ext4 only; XFS allocates whole extents at writeback already
_RESERVE_FS_TYPES = {0xEF53: "ext4"}

#: statfs f_type of the filesystems whose files ``LocalStorage.prefetch`` reads ahead: on a disk of this host
_PREFETCH_FS_TYPES = dict(_DIRECT_FS_TYPES)

_FADVISE = getattr(os, "posix_fadvise", None)       # not on macOS

#: One WILLNEED call reads ahead at most the device's readahead window or its largest request, whichever is
#: larger (Linux ``force_page_cache_ra``; 128 KiB by default): a file is asked for in pieces of this size.
_PREFETCH_PIECE = 128 << 10


def _prefetch_file(path: str) -> None:
    """``posix_fadvise(WILLNEED)`` over the whole of a regular file, in _PREFETCH_PIECE pieces; anything else
    (missing, a FIFO, a device, not readable) is left alone. O_NONBLOCK: opening a FIFO does not wait for a
    writer; O_NOCTTY: a terminal never becomes this process's."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | getattr(os, "O_CLOEXEC", 0))
    except (OSError, ValueError):
        return
    try:
        st = os.fstat(fd)
        if stat.S_ISREG(st.st_mode):
            for offset in range(0, st.st_size, _PREFETCH_PIECE):
                _FADVISE(fd, offset, _PREFETCH_PIECE, os.POSIX_FADV_WILLNEED)
    except OSError:
        pass
    finally:
        os.close(fd)


def _filesystem_type(target) -> Optional[int]:
    """statfs f_type of the filesystem holding ``target`` (an open descriptor or a path); None when unknown,
    and off Linux (struct statfs has another layout there: f_type is not its first field, and macOS's is
    2,168 bytes)."""
    libc = _libc()
    call = "fstatfs" if isinstance(target, int) else "statfs"
    if not sys.platform.startswith("linux") or libc is None or not hasattr(libc, call):
        return None
    buf = ctypes.create_string_buffer(256)        # Linux struct statfs (120 bytes); f_type is its first field, a long
    arg = target if isinstance(target, int) else os.fsencode(target)
    if getattr(libc, call)(arg, buf) != 0:
        return None
    return ctypes.c_long.from_buffer(buf).value


def _syncfs_usable(fd: int) -> bool:
    libc = _libc()
    if libc is None or not hasattr(libc, "syncfs") or _kernel() < (5, 8):
        return False
    return _filesystem_type(fd) in _SYNCFS_TYPES


def _syncfs(fd: int) -> None:
    if _libc().syncfs(fd) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"syncfs: {os.strerror(err)} (data written to this filesystem may not be durable)")


_SYNC_FILE_RANGE_WRITE = 2


def start_writeback(path: str) -> bool:
    """Ask the kernel to start writing ``path``'s dirty pages to disk now (``sync_file_range`` with
    SYNC_FILE_RANGE_WRITE: no waiting for the data, no durability); False where that is not available.
    A hint for a writer that makes its files durable together at the end (``sync_files``): the disk then
    works while the next files are produced, instead of all of it at the final sync (below the kernel's
    background threshold, 10% of RAM, nothing is written back before that). Errors surface at that sync."""
    if _sync_file_range() is None:
        return False
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return False
    try:
        return _start_writeback_fd(fd)
    finally:
        os.close(fd)


def _start_writeback_fd(fd: int) -> bool:
    """``start_writeback`` of an open file; False where unavailable or refused (a hint: errors surface at the
    file's sync)."""
    fn = _sync_file_range()
    return fn is not None and fn(fd, 0, 0, _SYNC_FILE_RANGE_WRITE) == 0


#: The thread that starts the writeback of the small files of an async save and closes them (``CLOSE_BEHIND``).
CLOSER = Closer(lambda fd: _start_writeback_fd(fd))


@functools.lru_cache(maxsize=1)
def _sync_file_range():
    libc = _libc()
    fn = getattr(libc, "sync_file_range", None) if libc is not None else None
    if fn is not None:
        fn.argtypes = (ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong, ctypes.c_uint)
        fn.restype = ctypes.c_int
    return fn


@functools.lru_cache(maxsize=1)
def _kernel() -> Tuple[int, int]:
    try:
        major, minor = os.uname().release.split(".")[:2]
        return int(major), int("".join(c for c in minor if c.isdigit()) or 0)
    except (AttributeError, ValueError):
        return (0, 0)


@functools.lru_cache(maxsize=1)
def _libc():
    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None


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
        fn = _libc().renameat2
    except AttributeError:   # not glibc >= 2.28 (or not Linux), or no libc
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn
