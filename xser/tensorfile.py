"""One-tensor files (``torch.save`` of one tensor, as xser writes them) read from a buffer at a fraction of
``torch.load``'s per-file cost, the tensor a view of the buffer (no copy).

``torch.load`` spends a few hundred microseconds per file on its zip reader and its (pure Python) safe
unpickler, which dominates loading checkpoints of many small tensors. Here the zip's central directory is
read directly, and ``data.pkl`` is unpickled by torch's safe loader only once per distinct pickle: the
pickles of tensors with the same dtype, shape, strides and storage size are byte for byte the same (the
bytes of the tensor are in another record), so what one safe load of those pickle bytes produced (dtype,
shape, strides, offset) is reused for every later file with identical pickle bytes. Anything else (a tensor
with attributes, ``requires_grad``, a subclass, zip64, compressed records, several storages) takes the
ordinary path, ``pickling.load_pickle_in_place``.

Files written without the zip CRC-32 (ours, ``container.py``) with the same dtype and shape are byte for byte
the same outside the tensor's bytes and the serialization id: their central directory and everything before
the tensor's bytes (local headers, ``data.pkl``, ``byteorder``) repeat. Such a file is recognised by those two
spans alone (``_frames``): no directory parse, no pickle lookup (about 40 us of Python per file otherwise).
"""
from __future__ import annotations

import struct
import threading
from dataclasses import dataclass
from typing import Dict, Optional, Tuple

import torch

from .pickling import load_pickle_in_place

_EOCD = struct.Struct("<IHHHHIIH")                  # end of central directory record
_CENTRAL = struct.Struct("<IHHHHHHIIIHHHHHII")      # central directory file header
_LOCAL = struct.Struct("<IHHHHHIIIHH")              # local file header
_EOCD_SIG, _CENTRAL_SIG, _LOCAL_SIG = 0x06054B50, 0x02014B50, 0x04034B50
_FULL32 = 0xFFFFFFFF


@dataclass(frozen=True)
class _Layout:
    """What a safe load of one pickle made of its (single) storage record."""

    record: str                  # the storage record's name below the archive folder, e.g. "data/0"
    dtype: torch.dtype
    size: Tuple[int, ...]
    stride: Tuple[int, ...]
    offset: int                  # in elements, within the storage record
    nbytes: int                  # bytes of the storage record the tensor needs


@dataclass(frozen=True)
class _Frame:
    """A file seen before, by its central directory: the bytes before its tensor data, and what they hold."""

    head: bytes                  # the file's bytes up to its data record's first byte
    layout: _Layout


_layouts: Dict[Tuple[bytes, bool], _Layout] = {}
_frames: Dict[Tuple[bytes, bool], _Frame] = {}     # (central directory + end record, trusted) -> frame
_lock = threading.Lock()
_MAX_LAYOUTS = 4096              # distinct (dtype, shape) pickles remembered; a real model has a few hundred


def records(view: memoryview) -> Optional[Dict[str, Tuple[int, int]]]:
    """name -> (offset of its data, size) of every record of a stored (uncompressed) zip in ``view``; None
    when the buffer is not such a zip (or needs zip64)."""
    n = len(view)
    tail = bytes(view[max(0, n - 4096):])
    at = tail.rfind(b"PK\x05\x06")
    if at < 0 or len(tail) - at < _EOCD.size:
        return None
    sig, _, _, _, count, cd_size, cd_off, _ = _EOCD.unpack_from(tail, at)
    if count == 0xFFFF or cd_off == _FULL32 or cd_off + cd_size > n:
        return None
    out, pos = {}, cd_off
    for _ in range(count):
        if pos + _CENTRAL.size > n:
            return None
        head = _CENTRAL.unpack_from(view, pos)
        if head[0] != _CENTRAL_SIG or head[4] != 0 or _FULL32 in (head[8], head[9], head[16]):
            return None
        nlen, xlen, clen, local = head[10], head[11], head[12], head[16]
        name = bytes(view[pos + _CENTRAL.size:pos + _CENTRAL.size + nlen]).decode("utf-8", "replace")
        if local + _LOCAL.size > n:
            return None
        lhead = _LOCAL.unpack_from(view, local)
        if lhead[0] != _LOCAL_SIG:
            return None
        start = local + _LOCAL.size + lhead[9] + lhead[10]
        if start + head[8] > n:
            return None
        out[name] = (start, head[8])
        pos += _CENTRAL.size + nlen + xlen + clen
    return out


def _directory(view: memoryview) -> Optional[bytes]:
    """The bytes from the central directory to the end of a zip without a comment (the directory, torch's zip64
    end records, the end record), None otherwise."""
    n = len(view)
    if n < _EOCD.size:
        return None
    sig, _, _, _, _, cd_size, cd_off, comment = _EOCD.unpack_from(view, n - _EOCD.size)
    if sig != _EOCD_SIG or comment or cd_off + cd_size + _EOCD.size > n:
        return None
    return bytes(view[cd_off:])


def _crc_free(directory: bytes) -> bool:
    """Whether every record of the directory has no CRC-32 (ours): files with a CRC-32 (torch's writer,
    neuronx-distributed) each have a directory of their own, so remembering their frames would never pay."""
    pos = 0
    while pos + _CENTRAL.size <= len(directory):
        head = _CENTRAL.unpack_from(directory, pos)
        if head[0] != _CENTRAL_SIG:
            break
        if head[7]:
            return False
        pos += _CENTRAL.size + head[10] + head[11] + head[12]
    return True


def load_tensor_in_place(buffer: torch.Tensor, *, trusted: bool = False, name: Optional[str] = None):
    """The object of the ``torch.save`` file held in ``buffer`` (a contiguous uint8 CPU tensor that owns its
    storage), a tensor being a view of the buffer; safely unless ``trusted`` (``load_pickle_in_place``'s
    contract, faster for plain tensors whose pickle was seen before, fastest for a file whose frame was)."""
    view = memoryview(buffer.numpy())
    directory = _directory(view)
    frame = _frames.get((directory, trusted)) if directory is not None else None
    # Same directory (record names, sizes, places) and the same bytes up to the data: same pickle, same layout.
    if frame is not None and view[:len(frame.head)] == frame.head:
        return _view(buffer, len(frame.head), frame.layout)
    recs = records(view)
    pkl = _find(recs, "data.pkl") if recs is not None else None
    if pkl is None:
        return load_pickle_in_place(buffer, trusted=trusted, name=name)
    prefix = pkl[0][: -len("data.pkl")]
    start, size = pkl[1]
    key = (bytes(view[start:start + size]) + _record_bytes(view, recs, prefix + "byteorder"), trusted)
    layout = _layouts.get(key)
    if layout is not None:
        rec = recs.get(prefix + layout.record)
        if rec is not None and rec[1] >= layout.nbytes and rec[0] % layout.dtype.itemsize == 0:
            _remember_frame(view, directory, trusted, recs, prefix, layout)
            return _view(buffer, rec[0], layout)
    obj = load_pickle_in_place(buffer, trusted=trusted, name=name)
    learned = _learn(obj, buffer, recs, prefix)
    if learned is not None and len(_layouts) < _MAX_LAYOUTS:
        with _lock:
            _layouts[key] = learned
        _remember_frame(view, directory, trusted, recs, prefix, learned)
    return obj


def _view(buffer: torch.Tensor, start: int, layout: _Layout) -> torch.Tensor:
    """The tensor ``layout`` describes, over ``buffer``'s storage, its record's data at byte ``start``."""
    return torch.empty(0, dtype=layout.dtype).set_(
        buffer.untyped_storage(), start // layout.dtype.itemsize + layout.offset, layout.size, layout.stride)


def _remember_frame(view: memoryview, directory: Optional[bytes], trusted: bool, recs: Dict[str, Tuple[int, int]],
                    prefix: str, layout: _Layout) -> None:
    """Remember the file's frame when its pickle and byte order lie before its data record (so the head the
    next file must repeat covers them): then a file with the same directory and head has this layout."""
    start = recs[prefix + layout.record][0]
    ends = [s + n for k, (s, n) in recs.items() if k in (prefix + "data.pkl", prefix + "byteorder")]
    if directory is None or max(ends) > start or len(_frames) >= _MAX_LAYOUTS or not _crc_free(directory):
        return
    with _lock:
        _frames[(directory, trusted)] = _Frame(bytes(view[:start]), layout)


def _find(recs: Dict[str, Tuple[int, int]], suffix: str):
    hits = [(k, v) for k, v in recs.items() if k.endswith("/" + suffix)]
    return hits[0] if len(hits) == 1 else None


def _record_bytes(view: memoryview, recs: Dict[str, Tuple[int, int]], name: str) -> bytes:
    start, size = recs.get(name, (0, 0))
    return bytes(view[start:start + size])


def _learn(obj, buffer: torch.Tensor, recs: Dict[str, Tuple[int, int]], prefix: str) -> Optional[_Layout]:
    """The layout to remember from a safely loaded file: only a plain tensor (no subclass, attributes or
    autograd state) that is a view of exactly one storage record of the buffer."""
    if type(obj) is not torch.Tensor or obj.requires_grad or obj.__dict__ or obj.is_quantized:
        return None
    data = [(k, v) for k, v in recs.items() if k.startswith(prefix + "data/")]
    if len(data) != 1:
        return None
    name, (start, size) = data[0]
    storage = obj.untyped_storage()
    item = obj.element_size()
    if storage.data_ptr() != buffer.data_ptr() + start or start % item:
        return None
    return _Layout(name[len(prefix):], obj.dtype, tuple(obj.shape), tuple(obj.stride()), obj.storage_offset(),
                   storage.nbytes())
