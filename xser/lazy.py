"""One tensor at a time out of a ``torch.save`` file, by byte ranges, without reading the others.

A ``torch.save`` file is a zip holding its pickle (``<archive>/data.pkl``) and one uncompressed record per
storage (``<archive>/data/<key>``). ``open_lazy`` reads the zip's directory and the pickle through
``read(offset, length)`` and unpickles with every storage left unread: the tensors of ``LazyFile.data`` are on the
meta device (right dtype, shape and strides, no bytes). ``LazyFile.tensor(t)`` reads one such tensor's bytes (just
its span of the record when it is contiguous) into a new CPU tensor. The pickle is read as ``torch.load`` reads it:
``weights_only`` unless ``trusted``.

Used where a process needs a few tensors of a large plain (non-xser) shard: its peak memory is the tensors it
reads, not the file.
"""
from __future__ import annotations

import io
import pickle
import struct
import warnings
import zipfile
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Optional, Tuple

import torch

from .errors import CorruptFileError
from .pickling import _SAFE_ENTRIES, REF_PICKLE, RangeFile, _load_errors

#: ``read(offset, length) -> bytes`` of the file
ReadRange = Callable[[int, int], bytes]

_LOCAL_HEADER = struct.Struct("<4s2B4HL2L2H")    # a zip local file header (zipfile.structFileHeader)
_ALIGN = 64      # torch.save starts each storage record's data at a multiple of this (its default alignment)


@dataclass
class LazyFile:
    """A ``torch.save`` file whose tensors are read one at a time (see the module docstring)."""

    data: Any
    name: str
    _read: ReadRange
    _zip: zipfile.ZipFile
    _prefix: str
    _storages: Dict[int, Tuple[str, int]]          # meta storage -> (record key, bytes)
    _offsets: Dict[str, int] = field(default_factory=dict)

    def tensor(self, t):
        """The CPU tensor that ``t`` (a tensor of ``data``) stands for, read from the file; anything else as it is.
        Reads the tensor's own span of its storage record when it is contiguous, else the whole record."""
        if not isinstance(t, torch.Tensor) or t.device.type != "meta":
            return t
        key, nbytes = self._storages[t.untyped_storage()._cdata]
        isz = t.element_size()
        if t.is_contiguous():
            start, length = t.storage_offset() * isz, t.numel() * isz
            out = torch.empty(t.shape, dtype=t.dtype)
            if length:
                _fill(out.reshape(-1).view(torch.uint8), self._span(key, start, length))
            return out
        storage = torch.empty(nbytes, dtype=torch.uint8)
        if nbytes:
            _fill(storage, self._span(key, 0, nbytes))
        return torch.empty((0,), dtype=t.dtype).set_(storage.untyped_storage(), t.storage_offset(), t.shape,
                                                     t.stride())

    def _exact(self, offset: int, length: int, key: str) -> bytes:
        data = self._read(offset, length)
        if len(data) != length:
            raise CorruptFileError(f"{self.name} is truncated: storage record {key} ends early (wanted {length} bytes "
                                   f"at {offset}, got {len(data)}); restore it from a complete copy", path=self.name)
        return data

    def _span(self, key: str, start: int, length: int) -> bytes:
        """``length`` bytes at ``start`` of record ``key``'s data. Where the data starts is in the record's local
        header; a record read from its start for the first time comes with its header in one request (the data
        offset predicted from torch's 64-byte alignment and checked against the header), so a tensor costs one
        read (one ranged GET on an object store); when the data starts later than predicted, a second read fetches
        just the missing tail."""
        if key in self._offsets or start:
            return self._exact(self._data_offset(key) + start, length, key)
        info = self._info(key)
        head = info.header_offset
        natural = head + _LOCAL_HEADER.size + len(info.orig_filename.encode())
        guess = -(-(natural + 4) // _ALIGN) * _ALIGN
        blob = self._read(head, guess - head + length)
        lo = self._header_end(key, info, blob[:_LOCAL_HEADER.size]) - head
        if lo + length > len(blob) >= guess - head + length:     # the data starts later than predicted: the tail
            blob += self._exact(head + len(blob), lo + length - len(blob), key)
        data = blob[lo:lo + length]
        if len(data) != length:
            raise CorruptFileError(f"{self.name} is truncated: storage record {key} ends early (wanted {length} bytes "
                                   f"at {head + lo}, got {len(data)}); restore it from a complete copy", path=self.name)
        return data

    def _info(self, key: str) -> zipfile.ZipInfo:
        try:
            return self._zip.getinfo(f"{self._prefix}data/{key}")
        except KeyError:
            raise CorruptFileError(f"{self.name} has no storage record {key} although its pickle uses it; "
                                   "restore it from a complete copy", path=self.name) from None

    def _header_end(self, key: str, info: zipfile.ZipInfo, head: bytes) -> int:
        """Record ``key``'s data offset, from its local header ``head`` (remembered)."""
        if len(head) != _LOCAL_HEADER.size or head[:4] != zipfile.stringFileHeader:
            raise CorruptFileError(f"{self.name}: the zip header of storage record {key} is damaged", path=self.name)
        fields = _LOCAL_HEADER.unpack(head)
        self._offsets[key] = info.header_offset + _LOCAL_HEADER.size + fields[10] + fields[11]
        return self._offsets[key]

    def _data_offset(self, key: str) -> int:
        """Where record ``key``'s bytes start: after its local header, whose extra field torch pads (alignment)."""
        if key not in self._offsets:
            info = self._info(key)
            self._header_end(key, info, self._read(info.header_offset, _LOCAL_HEADER.size))
        return self._offsets[key]


def _fill(dst: torch.Tensor, data: bytes) -> None:
    with warnings.catch_warnings():   # the bytes are only copied from
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        dst.copy_(torch.frombuffer(data, dtype=torch.uint8))


def open_lazy(read: ReadRange, size: int, *, trusted: bool = False, name: str = "<file>") -> Optional[LazyFile]:
    """The file of ``size`` bytes behind ``read``, with its pickle unpickled and no tensor read; None when it is not
    a zip ``torch.save`` file whose records are stored uncompressed in little-endian byte order (a legacy file:
    read it whole). Raises xser's errors: CorruptFileError, UnsafeCheckpointError."""
    try:
        zf = zipfile.ZipFile(RangeFile(read, size))
    except zipfile.BadZipFile:
        return None
    pkl = [n for n in zf.namelist() if n.endswith("data.pkl") and n.count("/") == 1]
    if len(pkl) != 1:
        return None
    prefix = pkl[0][:-len("data.pkl")]
    if any(i.compress_type != zipfile.ZIP_STORED for i in zf.infolist()):
        return None
    if f"{prefix}byteorder" in zf.namelist() and _record(zf, f"{prefix}byteorder", read).strip() != b"little":
        return None
    storages: Dict[int, Tuple[str, int]] = {}
    with _load_errors(name, trusted), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="TypedStorage is deprecated")   # the pickle names typed storages
        data = _unpickle(_record(zf, pkl[0], read), trusted, storages)
    return LazyFile(data, name, read, zf, prefix, storages)


def _record(zf: zipfile.ZipFile, record: str, read: ReadRange) -> bytes:
    """A small record read whole (zipfile checks its CRC-32 unless torch wrote none)."""
    info = zf.getinfo(record)
    head = read(info.header_offset, _LOCAL_HEADER.size)
    fields = _LOCAL_HEADER.unpack(head)
    return read(info.header_offset + _LOCAL_HEADER.size + fields[10] + fields[11], info.file_size)


def _unpickle(pkl: bytes, trusted: bool, storages: Dict[int, Tuple[str, int]]):
    """The pickle's object with every storage a meta storage of the right size (``storages`` records which)."""
    made: Dict[str, torch.storage.TypedStorage] = {}

    def persistent_load(saved_id):
        typename, storage_type, key, _location, numel = saved_id
        if torch.serialization._maybe_decode_ascii(typename) != "storage":
            raise pickle.UnpicklingError(f"unknown persistent id {typename!r}")
        key = torch.serialization._maybe_decode_ascii(key)
        if key not in made:
            dtype = torch.uint8 if storage_type is torch.UntypedStorage else storage_type.dtype
            nbytes = numel * torch._utils._element_size(dtype)
            us = torch.UntypedStorage(nbytes, device="meta")
            storages[us._cdata] = (key, nbytes)
            made[key] = torch.storage.TypedStorage(wrap_storage=us, dtype=dtype, _internal=True)
        return made[key]

    if trusted:
        unpickler = REF_PICKLE.Unpickler(io.BytesIO(pkl), encoding="utf-8")
    else:
        torch.serialization.add_safe_globals(_SAFE_ENTRIES)
        unpickler = torch._weights_only_unpickler.Unpickler(io.BytesIO(pkl), encoding="utf-8")
    unpickler.persistent_load = persistent_load
    return unpickler.load()
