"""A plain (non-xser) shard used while it downloads: its zip records checked and its tensors built as the
byte ranges of an object store's parallel GETs land in the host buffer, not after the last one.

A ``torch.save`` file is a zip whose first record is the pickle (``<archive>/data.pkl``), then one record per
storage (``<archive>/data/<key>``), then the central directory. The manifest holds the CRC32C of each record
(local header + data) and of the tail (``FileEntry.ranges``), so each record can be checked on its own as soon as
its bytes are in, and its local header says its name and where its data starts: no central directory needed.
``RecordPipe.landed(start, end)`` is told of each filled span; it checks every record that span completes,
unpickles the pickle when it is in (every tensor on the meta device, ``xser.unpickle_meta``), and returns the
tensors whose storage records are now checked, as views of the buffer. Nothing is applied anywhere here: the
caller keeps what it gets until ``finish()`` has seen every record checked.
"""
from __future__ import annotations

import bisect
import struct
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

import xser

from . import rangecheck
from .errors import CorruptCheckpointError
from .manifest import FileEntry, RangeSum

_LOCAL = struct.Struct("<4s2B4HL2L2H")      # a zip local file header (zipfile.structFileHeader)
_LOCAL_SIG = b"PK\x03\x04"


class RecordPipe:
    """Follows the download of one plain shard into ``buf`` (a uint8 host tensor of at least ``entry.size``
    bytes). ``unpickle(pkl_bytes) -> (data, storages)`` is ``xser.unpickle_meta`` with the caller's trust and
    error wording. Single thread (the caller's); errors are CorruptCheckpointError naming ``where``."""

    def __init__(self, buf: torch.Tensor, entry: FileEntry, where: str, hint: str,
                 unpickle: Callable[[bytes], Tuple[Any, Dict[int, Tuple[str, int]]]]):
        self._buf, self._entry, self._where, self._hint = buf, entry, where, hint
        self._view = memoryview(buf.numpy())
        self._unpickle = unpickle
        self._waiting: List[RangeSum] = list(entry.ranges)     # records not yet complete, in file order
        self._spans: List[Tuple[int, int]] = []                # landed [start, end), merged, sorted
        self._records: Dict[str, Tuple[int, int]] = {}         # storage key -> (data offset, data end)
        self._prefix: Optional[str] = None                     # the archive folder, from the pickle's name
        self.ref_data: Any = None                              # the pickle, tensors as TensorReferences
        self._metas: List[torch.Tensor] = []                   # tid -> meta tensor
        self._storages: Dict[int, Tuple[str, int]] = {}
        self._by_key: Dict[str, List[int]] = {}                # storage key -> tids
        self._pending: Dict[str, Tuple[int, int]] = {}         # storage records checked before the pickle
        self.usual = True                                      # False: a layout this does not read (byte order)

    @property
    def tids(self) -> List[int]:
        return list(range(len(self._metas)))

    def landed(self, start: int, end: int) -> List[Tuple[int, torch.Tensor]]:
        """``buf[start:end]`` is filled: check the records now complete; (tid, host tensor) of the tensors ready."""
        self._add_span(start, end)
        out: List[Tuple[int, torch.Tensor]] = []
        still = []
        for r in self._waiting:
            if self._covered(r.offset, r.end):
                out += self._record(r)
            else:
                still.append(r)
        self._waiting = still
        return out

    def finish(self) -> None:
        """Every record checked and every storage the pickle uses found; CorruptCheckpointError otherwise."""
        if self._waiting:
            r = self._waiting[0]
            raise self._corrupt(f"bytes {r.offset}..{r.end} never arrived")
        if self._prefix is None:
            raise self._corrupt("has no data.pkl record (not a torch.save zip file)")
        missing = sorted(set(self._by_key) - set(self._records))
        if missing:
            raise self._corrupt(f"has no storage record {missing[0]} although its pickle uses it")

    # --- internals ----------------------------------------------------------------------------------
    def _corrupt(self, what: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(f"{self._where} {what}{'; ' + self._hint if self._hint else ''}",
                                      path=self._where)

    def _add_span(self, start: int, end: int) -> None:
        spans = self._spans + [(start, end)]
        spans.sort()
        merged = [spans[0]]
        for a, b in spans[1:]:
            if a <= merged[-1][1]:
                merged[-1] = (merged[-1][0], max(merged[-1][1], b))
            else:
                merged.append((a, b))
        self._spans = merged

    def _covered(self, start: int, end: int) -> bool:
        i = bisect.bisect_right(self._spans, (start, float("inf"))) - 1
        return i >= 0 and self._spans[i][0] <= start and end <= self._spans[i][1]

    def _record(self, r: RangeSum) -> List[Tuple[int, torch.Tensor]]:
        rangecheck.check_range(self._entry, r, self._view[r.offset:r.end], self._where, self._hint)
        if bytes(self._view[r.offset:r.offset + 4]) != _LOCAL_SIG:
            return []                                   # the tail: central directory and end records
        if r.length < _LOCAL.size:
            raise self._corrupt(f"has a zip record at {r.offset} shorter than its header")
        fields = _LOCAL.unpack_from(self._view, r.offset)
        name_at = r.offset + _LOCAL.size
        data_at = name_at + fields[10] + fields[11]
        if data_at > r.end:
            raise self._corrupt(f"has a zip record at {r.offset} whose header runs past it")
        name = bytes(self._view[name_at:name_at + fields[10]]).decode("utf-8", "replace")
        folder, _, rest = name.partition("/")
        if rest == "data.pkl" and self._prefix is None:
            self._prefix = folder + "/"
            return self._parse(self._view[data_at:r.end])
        if rest == "byteorder":
            self.usual = self.usual and bytes(self._view[data_at:r.end]).strip() == b"little"
        elif rest.startswith("data/"):
            key = rest[len("data/"):]
            self._records[key] = (data_at, r.end)
            if self.ref_data is None:
                return []                               # built once the pickle is in
            return self._tensors(key)
        return []

    def _parse(self, pkl) -> List[Tuple[int, torch.Tensor]]:
        data, self._storages = self._unpickle(pkl)
        self.ref_data, self._metas = xser.to_refs(data)
        for tid, t in enumerate(self._metas):
            if t.device.type != "meta":
                self.usual = False                      # a tensor not backed by a storage record
                continue
            self._by_key.setdefault(self._storages[t.untyped_storage()._cdata][0], []).append(tid)
        out: List[Tuple[int, torch.Tensor]] = []
        for key in list(self._records):
            out += self._tensors(key)
        return out

    def _tensors(self, key: str) -> List[Tuple[int, torch.Tensor]]:
        """The tensors of storage record ``key``: views of the buffer (a copy where the data is not aligned)."""
        data_at, data_end = self._records[key]
        out = []
        for tid in self._by_key.get(key, ()):
            meta = self._metas[tid]
            nbytes = self._storages[meta.untyped_storage()._cdata][1]
            if data_at + nbytes > data_end:
                raise self._corrupt(f"storage record {key} holds {data_end - data_at} bytes; its pickle needs {nbytes}")
            reach = _extent(meta)
            if reach > nbytes:      # torch.load's set_ refuses it too; a view here would read the next record
                raise self._corrupt(f"has tensor {tid} reaching byte {reach} of its storage record {key}, "
                                    f"which holds {nbytes} bytes")
            isz = meta.element_size()
            storage = self._buf.untyped_storage()
            base = data_at
            if data_at % isz:                           # torch.save aligns records to 64 bytes; another writer may not
                storage = self._buf[data_at:data_at + nbytes].clone().untyped_storage()
                base = 0
            t = torch.empty(0, dtype=meta.dtype).set_(storage, base // isz + meta.storage_offset(), meta.shape,
                                                      meta.stride())
            out.append((tid, t))
        return out


def _extent(meta: torch.Tensor) -> int:
    """Bytes of its storage a tensor spans, from the storage's start (its offset, shape and strides)."""
    if meta.numel() == 0:
        return 0
    last = meta.storage_offset() + sum((n - 1) * st for n, st in zip(meta.shape, meta.stride()))
    return (last + 1) * meta.element_size()
