"""One background thread that starts the writeback of written files and closes them, off their writer.

During an async save on a disk of this host every small tensor file has its writeback started as it is closed
(``local.OWN_WRITEBACK``): ``sync_file_range`` submits its pages, which is about a third of the small-file
thread's time per file. Handing the descriptor to this thread lets that thread go on to the next file while the
other core submits the last one: at 0.5 GB / 5,000 tensors the commit went from 0.58 to 0.49 s for the same CPU
(README "Levers measured", session 21).
"""
from __future__ import annotations

import os
import queue
import threading
import time
from typing import Callable, Optional

#: Descriptors handed over and not yet taken by the thread, at most (counted in groups): a writer that gets this
#: far ahead waits.
DEPTH = 256
#: Descriptors go to the thread in groups of this many (the last group at ``drain``): one wake-up of the thread
#: per group instead of per file.
GROUP = 8
#: How long ``hand`` and ``drain`` wait for the thread before they raise. Each file costs it tens of
#: microseconds; only a disk that takes no writes at all makes it wait.
WAIT_S = 600.0


class Closer:
    """``hand(fd)`` queues an open file: the thread calls ``start(fd)`` (a hint: its result and errors are
    ignored, as the writer's own call's were) and closes it. ``drain()`` waits until every file handed so far
    is closed and raises the first error a close met. The thread is started by the first ``hand`` and inherits
    that thread's priority (the save's writers run at niceness +19 under ``SCHED_IDLE``), and again in a
    forked child, which has no threads. The hand-over is a list append, and one put on a C queue per group: a
    ``threading.Condition`` per file cost 0.12 CPU-s/GB more at 5,000 files, a queue put per file 0.075 (README
    "Levers measured")."""

    def __init__(self, start: Callable[[int], object], depth: int = DEPTH, wait_s: float = WAIT_S,
                 group: int = GROUP):
        self._start = start
        self._depth = max(1, depth // group)
        self._wait_s = wait_s
        self._group = group
        self._held: list = []
        self._queue: "queue.SimpleQueue" = queue.SimpleQueue()
        self._errors: list = []
        self._lock = threading.Lock()
        self._pid = -1

    def hand(self, fd: int) -> None:
        """Queue ``fd``, whose ownership passes to the thread. Blocks while ``depth`` files wait; raises
        TimeoutError after ``wait_s`` of that, with ``fd`` still the caller's."""
        if self._pid != os.getpid():
            self._start_thread()
        if self._queue.qsize() >= self._depth:
            deadline = time.monotonic() + self._wait_s
            while self._queue.qsize() >= self._depth:
                if time.monotonic() > deadline:
                    raise TimeoutError(self._stuck("take another file", self._wait_s))
                time.sleep(0.001)
        with self._lock:
            self._held.append(fd)
            if len(self._held) >= self._group:
                self._queue.put(self._held)
                self._held = []

    def drain(self, timeout_s: Optional[float] = None) -> None:
        """Wait until every file handed over so far is closed; raise the first close error since the last
        drain (once), or TimeoutError after ``timeout_s`` (default ``wait_s``). Called before a batch's sync,
        and when a failed save abandons its batch."""
        if self._pid != os.getpid():
            return                      # nothing handed in this process (a forked child's copy is its parent's)
        done = threading.Event()
        with self._lock:
            if self._held:
                self._queue.put(self._held)
                self._held = []
            self._queue.put(done)
        wait_s = self._wait_s if timeout_s is None else timeout_s
        if not done.wait(wait_s):
            raise TimeoutError(self._stuck("close the files handed to it", wait_s))
        if self._errors:
            error = self._errors[0]
            self._errors.clear()
            raise error

    def _start_thread(self) -> None:
        with self._lock:
            if self._pid != os.getpid():
                self._queue, self._errors, self._held = queue.SimpleQueue(), [], []
                threading.Thread(target=self._run, args=(self._queue,), name="nxd_ckpt-closer", daemon=True).start()
                self._pid = os.getpid()

    def _run(self, files: "queue.SimpleQueue") -> None:
        while True:
            item = files.get()
            if isinstance(item, threading.Event):
                item.set()
                continue
            for fd in item:
                try:
                    self._start(fd)
                except OSError:
                    pass
                try:
                    os.close(fd)
                except OSError as exc:
                    self._errors.append(exc)

    def _stuck(self, what: str, wait_s: float) -> str:
        return (f"nxd_ckpt: the thread that closes written files did not {what} within {wait_s:.0f} s "
                f"({self._queue.qsize()} waiting): the disk is not taking writes; check the device and its free "
                "space, then save again")
