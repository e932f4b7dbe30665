"""Byte ranges of one file, each verified against the CRC32C the manifest records for it (``FileEntry.ranges``:
a plain shard's zip records), so a reader that needs a few tensors of a large file reads and checks just those.

``CheckedRanges.read(offset, length)`` reads every recorded range the request touches, whole, checks each, and
returns the requested bytes; the most recently read ranges, up to 16 MiB in all, are kept once checked, since the
zip reader asks for the central directory and the pickle's record in several small pieces (a tensor's record is
asked for once; the bound keeps a file of many small tensors from piling up). A request that touches bytes no range covers (a zip
data descriptor, which no reader here uses) falls back to one streaming check of the whole file, once.
``stream_mismatch`` is the whole-file check that also checks every range, in one pass over ``Storage.blocks``
(``verify``).
"""
from __future__ import annotations

import bisect
import collections
import threading
from typing import Callable, Iterable, List, Optional

import crc32c as _crc32c

from .errors import CorruptCheckpointError
from .manifest import FileEntry, RangeSum

_KEEP = 16 << 20         # bytes of checked ranges kept for repeated small reads (directory, pickle)


def covering(ranges, start: int, end: int, offsets: Optional[List[int]] = None) -> Optional[List[RangeSum]]:
    """The ranges that together cover ``[start, end)`` (sorted, disjoint ``ranges``; ``offsets`` their offsets,
    when the caller keeps them), or None when a byte of it lies in no range."""
    i = bisect.bisect_right(offsets if offsets is not None else [r.offset for r in ranges], start) - 1
    out, at = [], start
    while at < end:
        if i < 0 or i >= len(ranges) or not ranges[i].offset <= at < ranges[i].end:
            return None
        out.append(ranges[i])
        at, i = ranges[i].end, i + 1
    return out


class CheckedRanges:
    """``read`` of one file (``raw(offset, length) -> bytes``) whose bytes are checked against ``entry.ranges``;
    ``whole_check()`` checks the whole file (used once if a request falls outside the ranges). ``where`` and
    ``hint`` word the CorruptCheckpointError. Thread-safe."""

    def __init__(self, raw: Callable[[int, int], bytes], entry: FileEntry, where: str, hint: str,
                 whole_check: Callable[[], None]):
        self._raw, self._entry, self._where, self._hint = raw, entry, where, hint
        self._whole_check = whole_check
        self._offsets = [r.offset for r in entry.ranges]
        self._kept: "collections.OrderedDict[int, bytes]" = collections.OrderedDict()    # offset -> bytes, LRU
        self._kept_bytes = 0
        self._whole_done = False
        self._lock = threading.Lock()

    def read(self, offset: int, length: int) -> bytes:
        length = max(0, min(length, self._entry.size - offset))
        if length == 0:
            return b""
        ranges = covering(self._entry.ranges, offset, offset + length, self._offsets)
        if ranges is None:
            with self._lock:
                if not self._whole_done:
                    self._whole_check()
                    self._whole_done = True
            return self._raw(offset, length)
        parts = [self._checked(r) for r in ranges]
        blob = parts[0] if len(parts) == 1 else b"".join(parts)
        lo = offset - ranges[0].offset
        return blob if lo == 0 and length == len(blob) else bytes(memoryview(blob)[lo:lo + length])

    def _checked(self, r: RangeSum) -> bytes:
        with self._lock:
            kept = self._kept.get(r.offset)
            if kept is not None:
                self._kept.move_to_end(r.offset)
                return kept
        data = self._raw(r.offset, r.length)
        check_range(self._entry, r, data, self._where, self._hint)
        self._keep(r.offset, data)
        return data

    def _keep(self, offset: int, data: bytes) -> None:
        if len(data) > _KEEP:
            return
        with self._lock:
            if offset not in self._kept:
                self._kept[offset] = data
                self._kept_bytes += len(data)
            while self._kept_bytes > _KEEP:
                self._kept_bytes -= len(self._kept.popitem(last=False)[1])


def check_range(entry: FileEntry, r: RangeSum, data, where: str, hint: str = "") -> None:
    """CorruptCheckpointError naming ``where`` unless ``data`` (the bytes read for ``r``) are ``r``'s length and
    CRC32C."""
    if len(data) != r.length:
        raise CorruptCheckpointError(f"{where} is truncated: bytes {r.offset}..{r.end} end after {len(data)} "
                                     f"bytes{'; ' + hint if hint else ''}", path=where)
    crc = _crc32c.crc32c(data)
    problem = entry.range_mismatch(r, crc)
    if problem is not None:
        raise CorruptCheckpointError(f"{where} {problem}{'; ' + hint if hint else ''}", path=where,
                                     expected=r.crc32c, found=f"{crc:08x}")


def stream_mismatch(blocks: Iterable[memoryview], entry: FileEntry) -> Optional[str]:
    """What is wrong with the file against ``entry``: its size, its whole CRC32C, then each of its ranges' (first
    failing one), all in one streaming pass over its ``blocks`` (``Storage.blocks``); None when all match."""
    ranges = entry.ranges or ()
    crc = rcrc = pos = ri = 0
    problem = None
    for block in blocks:
        mv = memoryview(block).cast("B")
        crc = _crc32c.crc32c(mv, crc)
        end = pos + len(mv)
        while ri < len(ranges) and ranges[ri].offset < end:
            r = ranges[ri]
            lo, hi = max(r.offset, pos), min(r.end, end)
            if hi > lo:
                rcrc = _crc32c.crc32c(mv[lo - pos:hi - pos], rcrc)
            if r.end > end:
                break
            problem = problem or entry.range_mismatch(r, rcrc)
            rcrc, ri = 0, ri + 1
        pos = end
    return entry.mismatch(pos, crc) or problem
