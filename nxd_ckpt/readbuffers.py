"""Host buffers that one load reads its large tensor files into with O_DIRECT, each reused for a later file once
its tensor is on its device.

Why reused buffers: a direct read skips the page cache (no pages to allocate, fill and map), but into fresh memory
it pays the first touch of every page instead, which costs more than the page cache saves (README "Load: the read
pipeline"). torch-xla's host-to-device transfer copies its source before it returns (``AtenSource``), so a buffer
is free again as soon as the batch holding its tensor has been moved: the load keeps about the files in flight plus
one batch, in huge pages, and touches each page once.
"""
from __future__ import annotations

import threading
from typing import List, Optional

from .storage.local import mapped_buffer

_HUGE_PAGE = 2 << 20
_BLOCK = 4096

#: The most bytes of buffers one load holds (in use and free): a file that would need more is read as before
#: (memory-mapped), not waited for, so the cap bounds the load's anonymous memory and never blocks it. About
#: 2 x ``num_workers`` files in flight plus one 64 MiB host-to-device batch fit at the benchmark's shapes (files
#: of 4-14 MB).
HOLD_BYTES = 512 << 20


def buffer_bytes(size: int) -> int:
    """Bytes of the buffer a file of ``size`` bytes is read into: one byte more (a longer file shows in the same
    read), in whole blocks for O_DIRECT, in whole huge pages so that every page of it is one."""
    return -(-(size + 1) // _HUGE_PAGE) * _HUGE_PAGE


def read_span(size: int) -> int:
    """Bytes of the direct read of a file of ``size`` bytes: one more, in whole blocks (O_DIRECT)."""
    return -(-(size + 1) // _BLOCK) * _BLOCK


class ReadBuffers:
    """The load's direct-read buffers, each aligned to a huge page (``mapped_buffer``). ``take`` hands out the
    smallest free one that fits (the load reads largest first, so later, smaller files reuse earlier buffers) or
    maps a new one within HOLD_BYTES; ``give_back`` returns one for reuse once nothing reads it again; ``close``
    forgets the free ones (a buffer is unmapped when the last view of it goes). Thread-safe: the readers take,
    the loading thread gives back."""

    def __init__(self, hold_bytes: Optional[int] = None):
        self.hold_bytes = HOLD_BYTES if hold_bytes is None else hold_bytes
        self.held = 0               # bytes of every buffer handed out or free
        self.reused = 0             # files read into a buffer that had held another (for tests and the bench)
        self._free: List[memoryview] = []
        self._lock = threading.Lock()
        self._closed = False

    def take(self, size: int) -> Optional[memoryview]:
        """A buffer of ``buffer_bytes(size)`` bytes or more, page-aligned; None when the cap would be passed.
        Raises OSError when the kernel refuses a new mapping."""
        need = buffer_bytes(size)
        with self._lock:
            fits = [b for b in self._free if len(b) >= need]
            if fits:
                best = min(fits, key=len)
                self._free.remove(best)
                self.reused += 1
                return best
            if self._closed or self.held + need > self.hold_bytes:
                return None
            self.held += need
        return mapped_buffer(need)[1]

    def give_back(self, buffer: memoryview) -> None:
        """``buffer`` (from ``take``) is free for another file: the caller reads none of its bytes again."""
        with self._lock:
            if self._closed:
                self.held -= len(buffer)
            else:
                self._free.append(buffer)

    def close(self) -> None:
        """The load is over: the free buffers are dropped (unmapped when no tensor views them), later ones too."""
        with self._lock:
            self._closed = True
            self.held -= sum(len(b) for b in self._free)
            self._free = []
