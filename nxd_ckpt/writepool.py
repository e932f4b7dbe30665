"""The write pool: a save's files, produced from host memory, written through Storage by ``num_workers``
threads (and, on a local filesystem, the small ones by one thread of their own), then made durable in one batch.

Knows nothing about ranks or commits (that is ``saveprotocol.py``). Each WriteTask holds the host staging
memory of its bytes as a HostLease; the pool gives it back in :func:`_settle`, the one place a task ends,
whether it was written, failed or dropped.
"""
from __future__ import annotations

import functools
import io
import os
import queue
import threading
import traceback
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Optional

import torch

import xser

from .staging import HostLease, no_lease
from .storage import FileRecord, Storage

_END = object()
# A batch of small files is one pool task: per-file futures, locks and callbacks cost more than writing a
# 100 KB file from memory. Files above SMALL_BYTES are never batched (batching 3 MB files cost CPU and
# commit time in an A/B at 1 GB / 300).
BATCH_FILES = 128
BATCH_BYTES = 16 << 20
SMALL_BYTES = 1 << 20
#: On a local filesystem (``Storage.small_files_one_writer``) the batches of small files (leases of SMALL_BYTES or
#: less, and the unleased pickles) go to one writer thread of their own, and only larger files to the
#: ``num_workers`` threads: such a file is a memory copy and a creation under the folder's lock, and eight threads
#: passing the GIL and that lock between them on every system call spent 2 to 3.4 times the CPU of one thread and
#: took longer (5,000 files of 100 KB on tmpfs: 225-300 against 88-111 us of CPU per file; A/B in README "Levers
#: measured"). False: every file goes to the ``num_workers`` threads.
SMALL_WRITER = True
#: Threads of that small-file writer (the A/B lever ``smallwriters`` of scripts/ab_commit.py).
SMALL_WRITERS = 1
#: On a local filesystem the small files' bytes stay in the page cache until the durability batch's ``syncfs``,
#: which then waits for all of them (0.5-0.6 s of a 1.8 s commit at 0.5 GB in 5,000 files): the kernel starts
#: writing back only at 10% of RAM. Each time the small-file thread has written this many more bytes, one
#: ``Storage.start_sync`` runs on a thread of its own (never two at once), so the disk writes while the rest is
#: produced. One sync per 0.15 s instead cost more CPU than it saved (A/B in README "Levers measured").
EARLY_SYNC_BYTES = 64 << 20


@dataclass
class WriteTask:
    """One file to write, relative to the tag's working directory. ``produce(fileobj)`` writes its bytes;
    ``lease`` is the host staging memory they occupy until the file is written (or dropped)."""

    relpath: str
    produce: Callable
    lease: HostLease = field(default_factory=no_lease)

    def parts(self) -> Optional[tuple]:
        """The file's bytes when they are already in memory (``Storage.write_parts``); None: call ``produce``."""
        return None


def bytes_task(relpath: str, data: bytes) -> WriteTask:
    return WriteTask(relpath, lambda f: f.write(data))


class TensorTask(WriteTask):
    """An xser tensor file: a WriteTask that writes its own tensor. One object per file where a task, a producer
    (and before that a closure: a function, its cell and their tuple) were several: a save makes one per tensor
    file, they live until the file is written, and each GC-tracked object that outlives a young collection
    brings the next full collection of the training process's heap closer (0.2-0.3 s here). Not a dataclass of
    its own: ``dataclasses.replace``/``fields`` of one see WriteTask's fields, not its tensor (nothing uses them)."""

    def __init__(self, relpath: str, tensor: torch.Tensor, lease: HostLease):
        # Not the dataclass's __init__: ``produce`` is this class's method, not a field value.
        self.relpath = relpath
        self.tensor = tensor
        self.lease = lease

    def produce(self, f) -> None:
        xser.write_tensor(self.tensor, f)

    def parts(self) -> Optional[tuple]:
        return xser.tensor_parts(self.tensor)


def tensor_file_lead(t: torch.Tensor) -> Optional[int]:
    """How many bytes precede the data of ``t``'s tensor file (``staging.HostBufferPool``'s ``lead_of``: its
    buffers are placed for the direct writes of these files); None when the file is not written in that form."""
    frame = xser.tensor_frame(t.shape, t.dtype)
    return None if frame is None else len(frame[0])


def tensor_task(relpath: str, tensor: torch.Tensor, lease: Optional[HostLease] = None) -> TensorTask:
    return TensorTask(relpath, tensor, lease if lease is not None else no_lease())


@dataclass
class PlainShardProducer:
    """A non-xser shard: the ref data with its tensors put back, written as one torch.save file. The CRC32C of
    each of its zip records is taken as it is written (``ranges`` after the call, None when the layout was not
    the expected one), so that a resharding reader can check just the records it reads."""

    refs: Any                      # plan.RefPickle: its ``data()``
    host: Dict[int, torch.Tensor]
    ranges: Optional[tuple] = None

    def __call__(self, f) -> None:
        sums = xser.RecordSums(f)
        torch.save(xser.from_refs(self.refs.data(), self.host.__getitem__), sums)
        self.ranges = sums.ranges()


def plain_shard_producer(refs, host: Dict[int, torch.Tensor]) -> PlainShardProducer:
    return PlainShardProducer(refs, host)


def failing_task(exc: BaseException) -> WriteTask:
    """A task that fails with ``exc``: how the snapshot reports its own failure to the writers."""

    def produce(f):
        raise exc

    return WriteTask("<snapshot>", produce)


class TaskQueue:
    """The tasks of one save, from the snapshot (producer) to the pool (consumer), ended by :meth:`close`."""

    def __init__(self):
        self._q: "queue.Queue" = queue.Queue()

    def add(self, task: WriteTask) -> None:
        self._q.put(task)

    def add_many(self, tasks: List[WriteTask]) -> None:
        """Queue ``tasks`` at once: one lock and one wake-up per writer, not one per task (the snapshot
        queues thousands of small files from the training thread)."""
        if not tasks:
            return
        q = self._q
        with q.mutex:       # queue.Queue's own lock and condition (unbounded queue: never full)
            q.queue.extend(tasks)
            q.unfinished_tasks += len(tasks)
            q.not_empty.notify(len(tasks))

    def close(self) -> None:
        self._q.put(_END)

    def __iter__(self) -> Iterator[WriteTask]:
        while True:
            task = self._q.get()
            if task is _END:
                return
            yield task

    def batches(self, max_files: int, max_bytes: int) -> Iterator[List[WriteTask]]:
        """The tasks in batches: each waits for one task, then takes what is already queued (a batch never
        waits for more work), up to ``max_files`` tasks or ``max_bytes`` of leases. A file above
        ``SMALL_BYTES`` is a batch of its own (large files spread over every writer thread)."""
        while True:
            task = self._q.get()
            if task is _END:
                return
            batch, size = [task], task.lease.nbytes
            while size <= SMALL_BYTES and len(batch) < max_files and size < max_bytes:
                try:
                    task = self._q.get_nowait()
                except queue.Empty:
                    break
                if task is _END:
                    yield batch
                    return
                if task.lease.nbytes > SMALL_BYTES:
                    yield batch
                    batch, size = [task], task.lease.nbytes
                    break
                batch.append(task)
                size += task.lease.nbytes
            yield batch

    def drain(self) -> None:
        """Drop every task until the producer closes the queue (so it never waits on a dead consumer)."""
        for task in self:
            _settle(task, None)


@dataclass
class WriteResult:
    records: List[FileRecord]
    error: Optional[str]          # the first failure, described; None when every file is durable
    nbytes: int


#: Niceness of the save's background threads (writers, runner) above the process's: the training loop's threads
#: stay at their own priority and win the cores whenever both want them; the save takes what is left. Niceness
#: weighs each thread apart: 8 writers at +10 (weight 110 each) would take about 30% of cores two training
#: threads want, at +19 (weight 15) about 5% (A/B in README "Levers measured": 1.67x against 1.25x at 1 GB).
BACKGROUND_NICE = 19
#: On Linux those threads also run under ``SCHED_IDLE``: a training thread that wakes up (after its device work,
#: after a GIL hand-off) always takes the core from them at once, where a +19 thread may first finish its slice.
#: At 5,000 tensors a +19 save mostly yielded, but in one to three saves of five ran as fast as alone while the
#: training steps took 1.7-1.9x as long; under SCHED_IDLE none did (A/B in README "Levers measured": step ratio
#: 1.33x against 1.13x, at most 1.81x against 1.22x). False: niceness only.
BACKGROUND_SCHED_IDLE = True


def lower_thread_priority() -> None:
    """Give the calling thread ``BACKGROUND_NICE`` more niceness than the process (Linux: niceness is per
    thread, and a new thread inherits its creator's, so this is counted from the process's main thread, not
    from the calling thread) and, with ``BACKGROUND_SCHED_IDLE``, the ``SCHED_IDLE`` policy (inherited by the
    threads it starts). Elsewhere, or when refused, the thread keeps its priority."""
    try:
        tid = threading.get_native_id()
        base = os.getpriority(os.PRIO_PROCESS, os.getpid())
        os.setpriority(os.PRIO_PROCESS, tid, min(19, base + BACKGROUND_NICE))
        if BACKGROUND_SCHED_IDLE and hasattr(os, "SCHED_IDLE"):
            os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError):
        pass


class _SizedExecutor:
    """A thread pool kept between saves and made anew, after its threads finish, when a save wants another size."""

    def __init__(self, prefix: str):
        self._prefix = prefix
        self._pool: Optional[ThreadPoolExecutor] = None
        self._size = 0

    def sized(self, workers: int) -> ThreadPoolExecutor:
        if self._pool is None or self._size != workers:
            if self._pool is not None:
                self._pool.shutdown(wait=True)
            self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix=self._prefix,
                                            initializer=lower_thread_priority)
            self._size = workers
        return self._pool


class WritePool:
    """The writer threads of one process: ``num_workers`` of them (resized to each save's), plus one for the
    small files on a local filesystem (``SMALL_WRITER``)."""

    def __init__(self):
        self._pool = _SizedExecutor("nxd_ckpt-write")
        self._small = _SizedExecutor("nxd_ckpt-small")

    def _executor(self, workers: int) -> ThreadPoolExecutor:
        return self._pool.sized(workers)

    def _small_writer(self) -> ThreadPoolExecutor:
        return self._small.sized(SMALL_WRITERS)

    def write_all(self, tasks: TaskQueue, storage: Storage, workdir: str, workers: int,
                  overwrite: bool = False) -> WriteResult:
        """Write every task of ``tasks`` under ``workdir`` until the queue is closed, then make the files
        durable in one batch. Blocks the calling thread (the runner) until then; never raises: the first
        failure is described in the result, and the tasks after it are dropped (their memory released).
        Small files go to one thread of their own where ``storage`` says so (``SMALL_WRITER``).
        ``overwrite``: ``workdir`` holds a retired tag's files (reuse.take), each overwritten in place where a
        task writes one of them (``Storage.write_file(reuse=True)``)."""
        pool = self._executor(max(1, workers))
        small = self._small_writer() if SMALL_WRITER and storage.small_files_one_writer() else pool
        early = _EarlySync(storage) if small is not pool else None
        write = functools.partial(_write_one, storage, workdir, overwrite)
        futures: List[Future] = []
        failed: List[Future] = []      # appended by done-callbacks: no rescan of every future per task (O(n^2))
        error: Optional[str] = None
        for batch in tasks.batches(BATCH_FILES, BATCH_BYTES):
            if error is None and failed:
                error = describe(failed[0].exception())
            if error is not None:
                _drop(batch)
                continue
            to_small = batch[0].lease.nbytes <= SMALL_BYTES
            fut = (small if to_small else pool).submit(_write_batch, batch, write)
            fut.add_done_callback(lambda f: f.exception() is not None and failed.append(f))
            if to_small and early is not None:
                fut.add_done_callback(early.wrote)
            futures.append(fut)
        wait(futures)
        if early is not None:
            early.close()
        records: List[FileRecord] = []
        for f in futures:
            if f.exception() is not None:
                error = error or describe(f.exception())
            else:
                records.extend(f.result())
        if error is None:
            error = _make_durable(storage, workdir, records)
        if error is not None:       # a failed write or sync: what the storage still holds of the batch goes
            storage.abandon_batch()
        return WriteResult(records, error, sum(r.size for r in records))


class _EarlySync:
    """``Storage.start_sync`` on a thread of its own each time ``EARLY_SYNC_BYTES`` more bytes of small files were
    written in one save (``wrote``: a done-callback of a small-file batch), never two at once, none after
    :meth:`close`. Nothing waits for it (the durability batch syncs everything anyway), and its thread is a
    daemon: a ``syncfs`` stuck on a failing disk never holds up the process's exit."""

    def __init__(self, storage: Storage):
        self._storage = storage
        self._lock = threading.Lock()
        self._unsynced = 0
        self._closed = False
        self._running: Optional[threading.Thread] = None

    def wrote(self, batch: Future) -> None:
        if batch.exception() is not None:
            return
        with self._lock:
            self._unsynced += sum(r.size for r in batch.result())
            if (self._closed or self._unsynced < EARLY_SYNC_BYTES
                    or (self._running is not None and self._running.is_alive())):
                return
            self._unsynced = 0
            self._running = threading.Thread(target=self._sync, name="nxd_ckpt-early-sync", daemon=True)
            self._running.start()

    def _sync(self) -> None:
        lower_thread_priority()
        self._storage.start_sync()

    def close(self) -> None:
        """No sync starts after this (a batch's callback may run after ``wait`` returned for it)."""
        with self._lock:
            self._closed = True


def _write_batch(batch: List[WriteTask], write: Callable[[WriteTask], FileRecord]) -> List[FileRecord]:
    """Write the files of ``batch`` in order (one pool task for many small files: no future per file);
    on the first failure the rest are dropped and the failure raised."""
    records: List[FileRecord] = []
    for i, task in enumerate(batch):
        try:
            records.append(_settle(task, write))
        except BaseException:
            _drop(batch[i + 1:])
            raise
    return records


def _drop(batch: List[WriteTask]) -> None:
    for task in batch:
        _settle(task, None)


def _settle(task: WriteTask, write: Optional[Callable[[WriteTask], FileRecord]]):
    """End ``task``: write it (``write`` None: drop it). Its host memory is given back here, and only here."""
    with task.lease:
        return write(task) if write is not None else None


def _make_durable(storage: Storage, workdir: str, records: List[FileRecord]) -> Optional[str]:
    """Durability for the whole batch at once, before the rank reports its files: they were written without a
    temporary name (the working directory's rename, or `done`, is the atomic step) and without a sync each."""
    try:
        storage.sync_files(f"{workdir}/{r.relpath}" for r in records)
        storage.sync_dirs({workdir + "/" + r.relpath.rsplit("/", 1)[0] if "/" in r.relpath else workdir
                           for r in records})
    except Exception as exc:  # noqa: BLE001 - reported to rank 0 like a failed write
        return describe(exc)
    return None


def _write_one(storage: Storage, workdir: str, overwrite: bool, task: WriteTask) -> FileRecord:
    parts = task.parts()
    if parts is not None:
        rec = storage.write_parts(f"{workdir}/{task.relpath}", parts, durable=False, atomic=False, reuse=overwrite)
        return FileRecord(task.relpath, rec.size, rec.crc32c)
    seen: List[OSError] = []

    def produce(f):
        try:
            task.produce(_OSErrorKeeper(f, seen))
        except Exception as exc:
            # torch.save's zip writer swallows the OSError of a failed write (a full disk, a quota) and
            # fails later with "unexpected pos ..."; report the real cause.
            if seen and exc is not seen[0]:
                raise seen[0] from exc
            raise

    rec = storage.write_file(f"{workdir}/{task.relpath}", produce, durable=False, atomic=False,
                             size_hint=task.lease.nbytes, reuse=overwrite)
    ranges = task.produce.ranges if isinstance(task.produce, PlainShardProducer) else None
    return FileRecord(task.relpath, rec.size, rec.crc32c, ranges)


class _OSErrorKeeper(io.RawIOBase):
    """A pass-through writable file object that remembers the first OSError a write raised."""

    def __init__(self, f, seen: List[OSError]):
        super().__init__()
        self._f = f
        self._seen = seen

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        try:
            return self._f.write(data)
        except OSError as exc:
            if not self._seen:
                self._seen.append(exc)
            raise

    def flush(self) -> None:
        pass


def describe(exc: BaseException) -> str:
    """An exception as the one line that travels to rank 0 and into RankFailureError's causes."""
    return "".join(traceback.format_exception_only(type(exc), exc)).strip()
