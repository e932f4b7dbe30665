"""One tensor at a time out of a ``torch.save`` file, by byte ranges, without reading the others.

A ``torch.save`` file is a zip holding its pickle (``<archive>/data.pkl``) and one uncompressed record per
storage (``<archive>/data/<key>``). ``open_lazy`` reads the zip's directory and the pickle through
``read(offset, length)`` and unpickles with every storage left unread: the tensors of ``LazyFile.data`` are on the
meta device (right dtype, shape and strides, no bytes). ``LazyFile.tensor(t)`` reads one such tensor's bytes (just
its span of the record when it is contiguous) into a new CPU tensor. The pickle is read as ``torch.load`` reads it:
``weights_only`` unless ``trusted``.

``check_crc32=True`` verifies each record read against the CRC-32 the zip records for it (``torch.save`` writes
one unless ``compute_crc32`` is off; a record whose CRC field is 0 is taken as having none): the pickle, and each
tensor's whole record (a tensor that is only part of its record then costs its whole record). For files without
any other checksum (neuronx-distributed's); the zip directory itself has no checksum.

Used where a process needs a few tensors of a large plain (non-xser) shard: its peak memory is the tensors it
reads, not the file.
"""
from __future__ import annotations

import io
import pickle
import struct
import warnings
import zipfile
import zlib
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
    _check_crc32: bool = False
    _record_ends: Dict[int, int] = field(default_factory=dict)   # header offset -> end of the record's data

    def tensor(self, t):
        """The CPU tensor that ``t`` (a tensor of ``data``) stands for, read from the file; anything else as it is.
        Reads the tensor's own span of its storage record when it is contiguous (and no CRC-32 is to be checked),
        else the whole record."""
        if not isinstance(t, torch.Tensor) or t.device.type != "meta":
            return t
        key, nbytes = self._storages[t.untyped_storage()._cdata]
        isz = t.element_size()
        start, length = t.storage_offset() * isz, t.numel() * isz
        if t.is_contiguous() and self._crc32(key) is None:
            out = torch.empty(t.shape, dtype=t.dtype)
            if length:
                _fill(out.reshape(-1).view(torch.uint8), self._span(key, start, length))
            return out
        storage = torch.empty(nbytes, dtype=torch.uint8)
        if nbytes:
            data = self._span(key, 0, nbytes)
            self._check(key, data)
            _fill(storage, data)
        view = torch.empty((0,), dtype=t.dtype).set_(storage.untyped_storage(), t.storage_offset(), t.shape,
                                                     t.stride())
        return view.clone() if t.is_contiguous() and length < nbytes else view

    def _crc32(self, key: str) -> Optional[int]:
        """The zip's CRC-32 of record ``key`` when it is to be checked, else None."""
        return _zip_crc(self._info(key)) if self._check_crc32 else None

    def _check(self, key: str, data) -> None:
        want = self._crc32(key)
        if want is not None and zlib.crc32(data) != want:
            raise CorruptFileError(f"{self.name}: storage record {key} fails the CRC-32 its zip directory records "
                                   f"(expected {want:08x}, found {zlib.crc32(data):08x}): the file is damaged; "
                                   "restore it from a complete copy", path=self.name)

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
        just the missing tail. Where the caller gave the record's end (``record_ends``: checksummed ranges whose
        reads verify whole records), the data offset is that end less the data's size, and no header is read."""
        info = self._info(key)
        end = self._record_ends.get(info.header_offset)
        if end is not None and key not in self._offsets:    # known from the caller's record map: no header read
            self._offsets[key] = end - info.file_size
        if key in self._offsets or start:
            return self._exact(self._data_offset(key) + start, length, key)
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


def _zip_crc(info: zipfile.ZipInfo) -> Optional[int]:
    """A record's CRC-32 as its zip directory records it; None when the writer recorded none (0 for bytes)."""
    return info.CRC if info.CRC or not info.file_size else None


def open_lazy(read: ReadRange, size: int, *, trusted: bool = False, name: str = "<file>",
              check_crc32: bool = False, record_ends: Optional[Dict[int, int]] = None) -> Optional[LazyFile]:
    """The file of ``size`` bytes behind ``read``, with its pickle unpickled and no tensor read; None when it is not
    a zip ``torch.save`` file whose records are stored uncompressed in little-endian byte order (a legacy file:
    read it whole). ``check_crc32``: verify every record read against the zip's own CRC-32 (module docstring).
    ``record_ends``: where each record (by its local header's offset) ends, when the caller knows (a reader whose
    every read pulls whole records then reads no header on its own). Raises xser's errors: CorruptFileError,
    UnsafeCheckpointError."""
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
    if f"{prefix}byteorder" in zf.namelist() and \
            _record(zf, f"{prefix}byteorder", read, check_crc32, name).strip() != b"little":
        return None
    data, storages = unpickle_meta(_record(zf, pkl[0], read, check_crc32, name), trusted=trusted, name=name)
    return LazyFile(data, name, read, zf, prefix, storages, _check_crc32=check_crc32,
                    _record_ends=dict(record_ends or {}))


def unpickle_meta(pkl, *, trusted: bool = False, name: str = "<file>") -> Tuple[Any, Dict[int, Tuple[str, int]]]:
    """A ``torch.save`` file's pickle (the bytes of its ``data.pkl`` record) unpickled with every storage left
    unread: its tensors are on the meta device. Also meta storage (``untyped_storage()._cdata``) -> (record key
    below ``data/``, bytes). Safely unless ``trusted``; raises xser's errors."""
    storages: Dict[int, Tuple[str, int]] = {}
    with _load_errors(name, trusted), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="TypedStorage is deprecated")   # the pickle names typed storages
        data = _unpickle(bytes(pkl), trusted, storages)
    return data, storages


def _record(zf: zipfile.ZipFile, record: str, read: ReadRange, check_crc32: bool, name: str) -> bytes:
    """A small record read whole; with ``check_crc32``, checked against the zip's CRC-32 when it has one."""
    info = zf.getinfo(record)
    head = read(info.header_offset, _LOCAL_HEADER.size)
    if len(head) != _LOCAL_HEADER.size or head[:4] != zipfile.stringFileHeader:
        raise CorruptFileError(f"{name}: the zip header of record {record} is damaged", path=name)
    fields = _LOCAL_HEADER.unpack(head)
    data = read(info.header_offset + _LOCAL_HEADER.size + fields[10] + fields[11], info.file_size)
    want = _zip_crc(info) if check_crc32 else None
    if len(data) != info.file_size or (want is not None and zlib.crc32(data) != want):
        raise CorruptFileError(f"{name}: record {record} is truncated or fails the CRC-32 its zip directory "
                               "records: the file is damaged; restore it from a complete copy", path=name)
    return data


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
