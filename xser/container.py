"""``torch.save``'s file format without the zip container's CRC-32, and without touching torch's settings.

``torch.save`` spends almost all of its CPU time on the zip CRC-32 of the tensor bytes (0.090 s of 0.090 s
for a 268 MB tensor to a null sink on the development machine). Neither ``torch.load`` nor torch-xla's
loader checks it, and nxd-ckpt's own CRC32C covers every byte already. torch lets that be switched off only
process-wide (``torch.utils.serialization.config.save.compute_crc32``), which would change every other
``torch.save`` of the training process while a background save runs. Here a private
``torch._C.PyTorchFileWriter`` is opened with CRC off and fed by torch's own ``_save``: the bytes are
exactly what ``torch.save`` writes with that setting off (the CRC fields hold 0), so ``torch.load``
(``weights_only``, ``mmap``) and torch-xla's ``load`` read them. Python's ``zipfile`` refuses to extract
such records (it checks the CRC); nothing here reads tensor files with it.

When this torch lacks either private entry point, ``save`` falls back to ``torch.save`` (with CRC).

``write_tensor`` builds those same bytes directly for plain dense CPU tensors (see ``_Template``): torch's
writer issues about 40 small writes per file through Python file-object layers and pickles through
Python-level hooks, about 0.5 ms of CPU per tensor file, which dominates a save of thousands of small
tensors. Here the pickle is cached per dtype/shape/stride and the file goes out in one write (three for
tensors over 1 MiB). The layout is copied from a file torch's own writer produced in this process, and
checked byte for byte against torch's writer on a second tensor before first use; when they differ (another
torch version) every tensor goes through torch's writer.
"""
from __future__ import annotations

import collections
import ctypes
import io
import os
import pickle
import struct
import threading
import zipfile
from dataclasses import dataclass, field
from typing import Any, List, Optional, Tuple

import torch

_PROTOCOL = 2                    # torch.save's DEFAULT_PROTOCOL
_usable: Optional[bool] = None


def _private_writer_usable() -> bool:
    """True when this torch has the private writer (with its CRC switch) and ``_save``, checked once."""
    global _usable
    if _usable is None:
        ser = torch.serialization
        writer_cls = getattr(torch._C, "PyTorchFileWriter", None)
        _usable = bool(callable(getattr(ser, "_save", None)) and writer_cls is not None
                       and "compute_crc32" in (writer_cls.__init__.__doc__ or ""))
    return _usable


def _alignment() -> int:
    get = getattr(torch.serialization, "_get_storage_alignment", None)
    return int(get()) if callable(get) else 64


def save(obj: Any, dest) -> None:
    """``torch.save(obj, dest)`` with the zip CRC-32 fields left at 0 (see the module docstring).

    ``dest`` is a path or a file object with ``write`` (and ``flush``); ``obj`` must hold CPU tensors only
    (``_save`` would copy others to the host one by one).
    """
    if not _private_writer_usable():
        torch.save(obj, dest)
        return
    if isinstance(dest, (str, bytes, os.PathLike)):
        with open(dest, "wb") as f:
            _save_to(obj, f)
        return
    _save_to(obj, dest)


def _save_to(obj: Any, fileobj) -> None:
    writer = torch._C.PyTorchFileWriter(fileobj, False, _alignment())
    torch.serialization._save(obj, writer, pickle, _PROTOCOL, False)
    writer.write_end_of_file()
    flush = getattr(fileobj, "flush", None)
    if callable(flush):
        flush()


def tensor_parts(t: torch.Tensor) -> Optional[Tuple[bytes, memoryview, bytes]]:
    """The bytes of ``t``'s file as ``write_tensor`` writes them, in three pieces: (bytes before the data, the
    data itself without a copy (valid while ``t`` lives), bytes after); None when ``t`` is not a plain dense CPU
    tensor whose storage is exactly its bytes, or torch must write it (then call ``write_tensor``)."""
    template = _template()
    return template.parts(t) if template is not None else None


def write_tensor(t: torch.Tensor, fileobj) -> None:
    """Write ``t`` (a compact CPU tensor) into ``fileobj`` exactly as ``save`` would, in one to three writes."""
    parts = tensor_parts(t)
    if parts is None:
        save(t, fileobj)
        return
    head, data, tail = parts
    if len(data) <= _JOIN_MAX_BYTES:
        fileobj.write(b"".join((head, data, tail)))
    else:
        fileobj.write(head)
        fileobj.write(data)
        fileobj.write(tail)
    flush = getattr(fileobj, "flush", None)
    if callable(flush):
        flush()


def tensor_frame(shape, dtype: torch.dtype) -> Optional[Tuple[bytes, bytes]]:
    """(bytes before the data, bytes after it) of the file ``write_tensor`` writes for a contiguous tensor of
    ``shape`` and ``dtype``, for a caller that writes the data itself, piece by piece, in between. None when
    ``write_tensor`` would not write such a tensor in that form (empty, too large, a dtype torch pickles
    otherwise, no usable template): then build the tensor and call ``write_tensor``."""
    template = _template()
    meta = torch.empty(tuple(shape), dtype=dtype, device="meta")
    if template is None or not 0 < meta.numel() * meta.element_size() < FAST_MAX_BYTES:
        return None
    return template.frame(meta)


#: Tensors up to this size are joined with their header and trailer into one write.
_JOIN_MAX_BYTES = 1 << 20
#: Tensors this large or larger go through torch's writer (zip64 fields start at 4 GiB).
FAST_MAX_BYTES = 1 << 30
_ARCHIVE = "archive/"
_FRAME_CACHE = 4096
_PKL, _DATA = "data.pkl", "data/0"
_LOCAL = struct.Struct("<IHHHHHIIIHH")           # local file header; sizes follow in a data descriptor
_DESCRIPTOR = struct.Struct("<IIII")             # data descriptor: signature, CRC-32 (0), sizes
_CENTRAL = struct.Struct("<IHHHHHHIIIHHHHHII")   # central directory entry
_EOCD64 = struct.Struct("<IQHHIIQQQQ")
_LOCATOR64 = struct.Struct("<IIQI")
_EOCD = struct.Struct("<IHHHHIIH")
_FLAGS = 0x0808                                  # a data descriptor follows the data; names are UTF-8


class _StorageRef:
    """Stands for the tensor's storage in the pickle: pickled as torch's persistent storage tuple."""

    __slots__ = ("storage_type", "numel")

    def __init__(self, storage_type, numel: int):
        self.storage_type = storage_type
        self.numel = numel


class _TensorPickle:
    """Pickles as ``torch.Tensor.__reduce_ex__`` does for a plain dense tensor without Python state."""

    __slots__ = ("args",)

    def __init__(self, args):
        self.args = args

    def __reduce__(self):
        return torch._utils._rebuild_tensor_v2, self.args


class _Pickler(pickle.Pickler):
    def persistent_id(self, obj):
        if type(obj) is _StorageRef:
            return ("storage", obj.storage_type, "0", "cpu", obj.numel)
        return None


def _data_pkl(t: torch.Tensor) -> Optional[bytes]:
    """``data.pkl`` of ``torch.save(t)`` for a plain dense CPU tensor; None for dtypes torch pickles
    otherwise (the newer ones, through an untyped storage)."""
    storage = torch.storage
    name = storage._dtype_to_storage_type_map().get(t.dtype)
    if name is None or t.dtype in storage._new_dtypes():
        return None
    buf = io.BytesIO()
    args = (_StorageRef(getattr(torch, name), t.numel()), 0, tuple(t.shape), t.stride(), t.requires_grad,
            collections.OrderedDict())
    _Pickler(buf, protocol=_PROTOCOL).dump(_TensorPickle(args))
    return buf.getvalue()


def _eligible(t: torch.Tensor) -> bool:
    """A plain dense CPU tensor whose storage is exactly its bytes, without Python state or metadata."""
    nbytes = t.numel() * t.element_size()
    return (type(t) is torch.Tensor and t.device.type == "cpu" and t.layout == torch.strided
            and not t.is_quantized and 0 < nbytes < FAST_MAX_BYTES and t.storage_offset() == 0
            and t.untyped_storage().nbytes() == nbytes and not torch._utils.get_tensor_metadata(t)
            and not torch._utils._get_obj_state(t))


def _host_bytes(t: torch.Tensor) -> memoryview:
    """The bytes of ``t``'s storage, without a copy (valid while ``t`` lives)."""
    nbytes = t.untyped_storage().nbytes()
    return memoryview((ctypes.c_char * nbytes).from_address(t.untyped_storage().data_ptr())).cast("B")


class _Zip:
    """The records of one stored zip in torch's layout: 64-byte aligned data ("FB" padding extra field),
    data descriptors with CRC-32 0, a zip64 end record. Offsets stay below 4 GiB (``FAST_MAX_BYTES``)."""

    def __init__(self, alignment: int):
        self.alignment = alignment
        self.parts: List[Any] = []
        self.central: List[bytes] = []
        self.offset = 0

    def add(self, name: str, data: Optional[bytes], size: int = 0) -> None:
        """Append a record; ``data`` None stands for ``size`` bytes supplied later (a placeholder part)."""
        fname = (_ARCHIVE + name).encode()
        size = len(data) if data is not None else size
        pad = -(self.offset + _LOCAL.size + len(fname) + 4) % self.alignment
        header = (_LOCAL.pack(0x04034B50, 0, _FLAGS, 0, 0, 0, 0, 0, 0, len(fname), 4 + pad) + fname
                  + b"FB" + struct.pack("<H", pad) + b"Z" * pad)
        self.central.append(_CENTRAL.pack(0x02014B50, 0, 0, _FLAGS, 0, 0, 0, 0, size, size, len(fname),
                                          0, 0, 0, 0, 0, self.offset) + fname)
        self.parts += [header, data, _DESCRIPTOR.pack(0x08074B50, 0, size, size)]
        self.offset += len(header) + size + _DESCRIPTOR.size

    def finish(self) -> None:
        central = b"".join(self.central)
        n, cd_off, cd_size = len(self.central), self.offset, len(central)
        self.parts += [central, _EOCD64.pack(0x06064B50, 44, 0x031E, 0x002D, 0, 0, n, n, cd_size, cd_off),
                       _LOCATOR64.pack(0x07064B50, 0, cd_off + cd_size, 1),
                       _EOCD.pack(0x06054B50, 0, 0, n, n, cd_size, cd_off, 0)]


@dataclass(frozen=True)
class _Template:
    """The records torch's writer puts in a one-tensor file, in order; the pickle and the data are filled in
    per tensor, the others (format version, alignment, byte order, version, serialization id) are copied."""

    records: Tuple[Tuple[str, bytes], ...]
    alignment: int
    #: (dtype, shape, stride, requires_grad) -> (head, tail), or None for torch's writer: a model's tensors
    #: share a few dozen shapes, so most files cost a lookup
    frames: dict = field(default_factory=dict, compare=False, repr=False)

    def parts(self, t: torch.Tensor):
        """(bytes before the tensor data, the data, bytes after), or None when torch's writer must do it."""
        if not _eligible(t):
            return None
        frame = self.frame(t)
        if frame is None:
            return None
        return frame[0], _host_bytes(t), frame[1]

    def frame(self, t: torch.Tensor) -> Optional[Tuple[bytes, bytes]]:
        """(bytes before the data, bytes after) of ``t``'s file (``t`` may be a meta tensor), cached."""
        key = (t.dtype, tuple(t.shape), t.stride(), t.requires_grad)
        frame = self.frames.get(key, False)
        if frame is False:
            frame = self._frame(t)
            if len(self.frames) < _FRAME_CACHE:
                self.frames[key] = frame
        return frame

    def _frame(self, t: torch.Tensor) -> Optional[Tuple[bytes, bytes]]:
        pkl = _data_pkl(t)
        if pkl is None:
            return None
        nbytes = t.numel() * t.element_size()
        z = _Zip(self.alignment)
        split = 0
        for name, body in self.records:
            if name == _DATA:
                split = len(z.parts) + 1
                z.add(name, None, nbytes)
            else:
                z.add(name, pkl if name == _PKL else body)
        z.finish()
        return b"".join(z.parts[:split]), b"".join(z.parts[split + 1:])


_template_lock = threading.Lock()
_template_state: List[Optional[_Template]] = []


def _template() -> Optional[_Template]:
    """The template, learnt from torch's writer once per process; None when the direct writer must not be
    used (no private writer, or its bytes differ from torch's)."""
    if not _template_state:
        with _template_lock:
            if not _template_state:
                _template_state.append(_learn_template())
    return _template_state[0]


def _torch_bytes(t: torch.Tensor) -> bytes:
    buf = io.BytesIO()
    save(t, buf)
    return buf.getvalue()


def _learn_template() -> Optional[_Template]:
    if not _private_writer_usable():
        return None
    try:
        probe = _torch_bytes(torch.arange(3, dtype=torch.float32))
        with zipfile.ZipFile(io.BytesIO(probe)) as zf:
            infos = zf.infolist()
        records = []
        for info in infos:
            if not info.filename.startswith(_ARCHIVE) or info.compress_type != zipfile.ZIP_STORED:
                return None
            name_len, extra_len = struct.unpack_from("<HH", probe, info.header_offset + 26)
            start = info.header_offset + 30 + name_len + extra_len
            records.append((info.filename[len(_ARCHIVE):], probe[start:start + info.file_size]))
        template = _Template(tuple(records), _alignment())
        check = torch.arange(7 * 5, dtype=torch.bfloat16).reshape(7, 5).t()
        parts = template.parts(check)
        if parts is None or b"".join((parts[0], parts[1], parts[2])) != _torch_bytes(check):
            return None
        return template
    except (zipfile.BadZipFile, struct.error, ValueError, RuntimeError, AttributeError, KeyError):
        return None
