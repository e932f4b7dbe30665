"""One background thread that starts the writeback of written files and closes them, off their writer.

During an async save on a disk of this host every small tensor file has its writeback started as it is closed
(``local.OWN_WRITEBACK``): ``sync_file_range`` submits its pages, which is about a third of the small-file
thread's time per file. Handing the descriptor to this thread lets that thread go on to the next file while the
other core submits the last one: at 0.5 GB / 5,000 tensors the commit went from 0.58 to 0.48 s for the same CPU
(README "Levers measured", session 21).
"""
from __future__ import annotations

import collections
import os
import threading
from typing import Callable, Optional

#: Descriptors handed over and not yet closed, at most: a writer that gets this far ahead waits.
DEPTH = 256
#: How long ``hand`` and ``drain`` wait for the thread before they raise. Each file costs it tens of
#: microseconds; only a disk that takes no writes at all makes it wait.
WAIT_S = 600.0


class Closer:
    """``hand(fd)`` queues an open file: the thread calls ``start(fd)`` (a hint: its result and errors are
    ignored, as the writer's own call's were) and closes it. ``drain()`` waits until every file handed so far
    is closed and raises the first error a close met. The thread is started by the first ``hand`` and inherits
    that thread's priority (the save's writers run at niceness +19 under ``SCHED_IDLE``), and again in a
    forked child, which has no threads."""

    def __init__(self, start: Callable[[int], object], depth: int = DEPTH, wait_s: float = WAIT_S):
        self._start = start
        self._depth = depth
        self._wait_s = wait_s
        self._cond = threading.Condition()
        self._pending: collections.deque = collections.deque()
        self._error: Optional[OSError] = None
        self._pid = -1

    def hand(self, fd: int) -> None:
        """Queue ``fd``, whose ownership passes to the thread. Blocks while ``depth`` files wait; raises
        TimeoutError after ``wait_s`` of that, with ``fd`` still the caller's."""
        with self._cond:
            self._ensure_thread()
            if not self._cond.wait_for(lambda: len(self._pending) < self._depth, self._wait_s):
                raise TimeoutError(self._stuck("take another file"))
            self._pending.append(fd)
            self._cond.notify_all()

    def drain(self) -> None:
        """Wait until every file handed over so far is closed; raise the first close error since the last
        drain (once), or TimeoutError after ``wait_s``. Called before a batch's sync."""
        with self._cond:
            if self._pid == os.getpid() and not self._cond.wait_for(lambda: not self._pending, self._wait_s):
                raise TimeoutError(self._stuck("close the files handed to it"))
            error, self._error = self._error, None
        if error is not None:
            raise error

    def _ensure_thread(self) -> None:
        if self._pid != os.getpid():
            self._pending, self._error, self._pid = collections.deque(), None, os.getpid()
            threading.Thread(target=self._run, name="nxd_ckpt-closer", daemon=True).start()

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._pending)
                fd = self._pending[0]
            try:
                self._start(fd)
            except OSError:
                pass
            try:
                os.close(fd)
            except OSError as exc:
                self._keep(exc)
            with self._cond:
                self._pending.popleft()
                self._cond.notify_all()

    def _keep(self, exc: OSError) -> None:
        with self._cond:
            if self._error is None:
                self._error = exc

    def _stuck(self, what: str) -> str:
        return (f"nxd_ckpt: the thread that closes written files did not {what} within {self._wait_s:.0f} s "
                f"({len(self._pending)} waiting): the disk is not taking writes; check the device and its free "
                "space, then save again")
