"""Writing and safely reading the pickles of an xser checkpoint (ref, tensor and info files).

Writing: ``TensorReference`` is pickled under torch-xla's name so torch-xla's ``load`` reads our files, even
when torch-xla is not installed (a pure-Python pickler writes the GLOBAL opcode itself).

Reading: ``torch.load(weights_only=True)`` with torch-xla's class name allowlisted and mapped to ours. A pickle
that would import or call anything else raises ``UnsafeCheckpointError`` before anything runs.
``trusted=True`` switches to a full unpickler, which still maps torch-xla's class name to ours.
"""
from __future__ import annotations

import collections
import contextlib
import io
import os
import pickle
import re
import types
import zipfile
from typing import Any, Callable, Optional, Tuple

import torch

from .errors import CorruptFileError, MissingFileError, UnsafeCheckpointError, XserError
from .refs import TORCH_XLA_MODULE, TORCH_XLA_NAME, TensorReference

_GLOBAL_OPCODE = pickle.GLOBAL + f"{TORCH_XLA_MODULE}\n{TORCH_XLA_NAME}\n".encode("ascii")
_SAFE_ENTRIES = [(TensorReference, f"{TORCH_XLA_MODULE}.{TORCH_XLA_NAME}"), TensorReference]
_TRUST_HINT = "pass trusted=True only if the file comes from a trusted source"


class _RefPickler(pickle._Pickler):
    """Pure-Python pickler that writes our TensorReference class as torch-xla's global."""

    def save_global(self, obj, name=None):
        if obj is TensorReference:
            self.write(_GLOBAL_OPCODE)
            self.memoize(obj)
            return
        super().save_global(obj, name)


class _RefUnpickler(pickle.Unpickler):
    """Full (trusted) unpickler that resolves torch-xla's TensorReference to ours."""

    def find_class(self, module, name):
        if (module, name) == (TORCH_XLA_MODULE, TORCH_XLA_NAME):
            return TensorReference
        return super().find_class(module, name)


_OWN_GLOBAL = pickle.GLOBAL + f"{TensorReference.__module__}\n{TensorReference.__qualname__}\n".encode("ascii")


class _FastRefPickler(pickle.Pickler):
    """The C pickler, then our class's GLOBAL opcode replaced by torch-xla's (the C pickler cannot write a
    global that does not import); the same bytes as ``_RefPickler`` at a tenth of its CPU for large state
    dicts. Only into a BytesIO (torch.save's pickle buffer): anything else goes to ``_RefPickler``."""

    def __init__(self, file, protocol=None, **kw):
        super().__init__(file, protocol, **kw)
        self._out, self._protocol, self._kw = file, protocol, kw
        self._refs = 0

    def reducer_override(self, obj):
        if type(obj) is TensorReference:
            self._refs += 1
        return NotImplemented

    def dump(self, obj):
        if not isinstance(self._out, io.BytesIO) or self._out.tell() != 0:
            return self._slow(obj)
        try:
            # torch.save's subclass calls its persistent_id (a Python function) for every object pickled; it
            # only names storages, so where there are none the pickle is the same without it, at a third of
            # the CPU (5,000 tensors: 0.07 of 0.10 s in the ref and info pickles of a save's stall).
            self._refs = _NoStoragePickler(self._out, self._protocol, **self._kw).dump_counting(obj)
        except _HasStorage:
            self._out.seek(0)
            self._out.truncate()
            self._refs = 0
            super().dump(obj)
        if not self._refs:
            return None
        data = self._out.getvalue()
        # With a TensorReference pickled, its GLOBAL is there once (memoized); another occurrence could only be
        # inside a string: then the slow pickler, which writes the opcode itself.
        if data.count(_OWN_GLOBAL) != 1:
            self._out.seek(0)
            self._out.truncate()
            return self._slow(obj)
        self._out.seek(0)
        self._out.truncate()
        self._out.write(data.replace(_OWN_GLOBAL, _GLOBAL_OPCODE))
        return None

    def _slow(self, obj):
        slow = _RefPickler(self._out, self._protocol, **self._kw)
        slow.persistent_id = self.persistent_id        # torch.save's subclass names tensor storages here
        return slow.dump(obj)


class _HasStorage(Exception):
    """A tensor or storage met while pickling without torch.save's persistent_id."""


class _NoStoragePickler(pickle.Pickler):
    """The C pickler with no persistent_id: raises _HasStorage at the first tensor or storage (whose pickle
    needs torch.save's persistent_id), and counts TensorReferences. Only objects of non-builtin types reach
    ``reducer_override``, and every tensor or storage is one."""

    def reducer_override(self, obj):
        if type(obj) is TensorReference:
            self.refs += 1
        elif isinstance(obj, (torch.Tensor, torch.storage.TypedStorage)) or torch.is_storage(obj):
            raise _HasStorage
        return NotImplemented

    def dump_counting(self, obj) -> int:
        self.refs = 0
        self.dump(obj)
        return self.refs


def _make_pickle_module() -> types.ModuleType:
    """A module object for torch.save/torch.load's ``pickle_module`` argument."""
    mod = types.ModuleType("xser._ref_pickle")
    mod.Pickler = _FastRefPickler
    mod.Unpickler = _RefUnpickler
    mod.dump = lambda obj, f, protocol=None, **kw: _RefPickler(f, protocol, **kw).dump(obj)
    mod.load = lambda f, **kw: _RefUnpickler(f, **kw).load()
    mod.UnpicklingError = pickle.UnpicklingError
    mod.__version__ = "1"
    return mod


REF_PICKLE = _make_pickle_module()


class _Flushable:
    """Adds the no-op ``flush`` torch.save needs to a file object that only has ``write``."""

    def __init__(self, raw):
        self.write = raw.write

    def flush(self) -> None:
        pass


def writable(dest):
    """``dest`` as torch.save accepts it: a path, or a file object with ``write`` and ``flush``."""
    if isinstance(dest, (str, bytes, os.PathLike)) or hasattr(dest, "flush"):
        return dest
    return _Flushable(dest)


def dump_refs(ref_data: Any, fileobj) -> None:
    """``torch.save`` of ref data (a path or a writable file object), TensorReference named as torch-xla's."""
    torch.save(ref_data, writable(fileobj), pickle_module=REF_PICKLE)


def describe(src) -> str:
    """A name for a path or file object, for error messages."""
    if isinstance(src, (str, bytes, os.PathLike)):
        return os.fsdecode(src)
    return str(getattr(src, "name", None) or f"<{type(src).__name__}>")


def check_file(path: str, what: str = "file") -> None:
    """Raise MissingFileError if ``path`` is missing or is a directory."""
    if os.path.isdir(path):
        raise MissingFileError(
            f"{path} is a directory; pass the ref file (e.g. .../dp_rank_00_tp_rank_00_pp_rank_00.pt), "
            f"not a folder", path=path)
    if not os.path.exists(path):
        raise MissingFileError(f"{what} {path} does not exist; check the path (the checkpoint may be "
                               f"incomplete or not copied entirely)", path=path)


def load_pickle(src, *, trusted: bool = False, name: Optional[str] = None, map_location="cpu",
                mmap: bool = False) -> Any:
    """``torch.load`` of a path or file object, safely unless ``trusted``; errors become XserErrors.
    ``mmap=True`` (a path only) maps the file instead of reading tensor data into memory."""
    label = name or describe(src)
    if isinstance(src, (str, bytes, os.PathLike)):
        check_file(os.fsdecode(src))
    with _load_errors(label, trusted):
        if trusted:
            return torch.load(src, map_location=map_location, weights_only=False, pickle_module=REF_PICKLE,
                              mmap=mmap)
        # add_safe_globals, not the safe_globals context manager: its exit would race with loads on
        # other threads. Allowlisting this plain data class for the whole process is harmless.
        torch.serialization.add_safe_globals(_SAFE_ENTRIES)
        return torch.load(src, map_location=map_location, weights_only=True, mmap=mmap)


class _NotPlainRefs(Exception):
    """The pickle holds more than plain ref data: torch's safe loader decides (and explains)."""


class _PlainRefUnpickler(pickle.Unpickler):
    """The C unpickler allowed to import only TensorReference (under torch-xla's name or ours) and OrderedDict,
    both allowlisted by torch's safe loader too, and with no persistent_load (a tensor storage raises). Every
    other global raises before anything is imported or called: the allowlist pattern of the ``pickle`` docs
    ("Restricting Globals"), a strict subset of what ``torch.load(weights_only=True)`` accepts."""

    _ALLOWED = {(TORCH_XLA_MODULE, TORCH_XLA_NAME): TensorReference,
                (TensorReference.__module__, TensorReference.__qualname__): TensorReference,
                ("collections", "OrderedDict"): collections.OrderedDict}

    def find_class(self, module, name):
        cls = self._ALLOWED.get((module, name))
        if cls is None:
            raise _NotPlainRefs(f"{module}.{name}")
        return cls


def load_plain_refs(data) -> Tuple[bool, Any]:
    """(True, ref data) of a torch.save zip in ``data`` (bytes) holding only plain ref data (containers,
    numbers, strings, TensorReferences; no tensor, no other class), else (False, None): the caller then uses
    ``load_pickle``, whose result is the same where both apply. torch's safe loader spends about 25 us of
    Python per TensorReference (it rebuilds its allowlist twice per object): 0.12 CPU-s before the first
    tensor read of a 5,000-tensor shard; the C unpickler takes a few ms."""
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as zf:
            names = zf.namelist()
            pkl = [n for n in names if n.endswith("/data.pkl") or n == "data.pkl"]
            order = [n for n in names if n.endswith("/byteorder") or n == "byteorder"]
            if len(pkl) != 1 or len(order) > 1 or (order and zf.read(order[0]) != b"little"):
                return False, None
            return True, _PlainRefUnpickler(io.BytesIO(zf.read(pkl[0])), encoding="ASCII").load()
    except Exception:  # noqa: BLE001 - not plain ref data (or damaged): torch's loader decides and explains
        return False, None


@contextlib.contextmanager
def _load_errors(label: str, trusted: bool):
    """Turn what torch.load (or its zip loader) raises for the file ``label`` into the matching XserError."""
    try:
        yield
    except XserError:
        raise
    except IsADirectoryError as exc:
        raise MissingFileError(f"{label} is a directory; pass the ref file, not a folder", path=label) from exc
    except FileNotFoundError as exc:
        raise MissingFileError(f"{label} does not exist; check the path", path=label) from exc
    except pickle.UnpicklingError as exc:
        raise _classify(str(exc), label, trusted) from exc
    except ImportError as exc:
        raise XserError(f"{label} needs module {exc.name!r} to be unpickled; install it, or load the file "
                        f"where it is installed", path=label) from exc
    except (RuntimeError, EOFError, ValueError, TypeError, KeyError, IndexError, AttributeError,
            zipfile.BadZipFile, pickle.PickleError) as exc:
        raise _corrupt(label, _short(exc)) from exc


_GLOBAL_RE = re.compile(r"GLOBAL ([\w.]+)")
_REFUSED_RE = re.compile(r"(Trying to call reduce for unrecognized function[^\n]*|Can only (?:create new object|"
                         r"build)[^\n]*|Unsupported operand[^\n]*|WeightsUnpickler error:[^\n]*\w[^\n]*)")


def _classify(message: str, label: str, trusted: bool) -> XserError:
    """UnsafeCheckpointError when torch refused a global or a call, else CorruptFileError."""
    if not trusted:
        m = _GLOBAL_RE.search(message)
        if m:
            glob = m.group(1)
            return UnsafeCheckpointError(
                f"{label}: refusing to load: the pickle imports `{glob}`, which is not tensor data and could "
                f"run arbitrary code (nothing was executed); {_TRUST_HINT}", path=label, global_name=glob)
        m = _REFUSED_RE.search(message)
        detail = m.group(1).strip() if m else _short(message)
        if "reduce for" in detail or "Can only" in detail:
            return UnsafeCheckpointError(
                f"{label}: refusing to load: {detail} (nothing was executed); {_TRUST_HINT}", path=label)
        return _corrupt(label, detail, hint=f"if it is a valid pickle that the safe loader refuses, {_TRUST_HINT}")
    return _corrupt(label, _short(message))


def _corrupt(label: str, detail: str, hint: str = "") -> CorruptFileError:
    msg = (f"{label} is truncated or corrupt ({detail}); restore it from a complete copy of the checkpoint or "
           f"re-save it")
    return CorruptFileError(msg + (f"; {hint}" if hint else ""), path=label)


def _short(exc) -> str:
    text = str(exc).strip()
    if isinstance(exc, BaseException):
        text = f"{type(exc).__name__}: {text}" if text else f"{type(exc).__name__}: file ends early"
    lines = text.splitlines() or ["(no message)"]
    return lines[0][:300]


def load_pickle_in_place(buffer: torch.Tensor, *, trusted: bool = False, name: Optional[str] = None) -> Any:
    """``load_pickle`` of a torch.save file held in ``buffer`` (a contiguous uint8 CPU tensor that owns its
    storage), whose tensors come back as views of ``buffer``'s storage instead of copies: the file costs
    its own size in memory, not twice that. The tensors keep the whole buffer alive and write through to it.

    Uses torch's loader the way ``torch.load(mmap=True)`` does, with the buffer in place of the mapped
    file. A legacy (non-zip) file, or a torch without that entry point, is read the ordinary way."""
    label = name or "<buffer>"
    src = ViewReader(buffer.numpy())
    ser = torch.serialization
    usable = callable(getattr(ser, "_load", None)) and callable(getattr(ser, "_open_zipfile_reader", None))
    if (not usable or buffer.dtype != torch.uint8 or buffer.device.type != "cpu" or not buffer.is_contiguous()
            or buffer.storage_offset() != 0 or not ser._is_zipfile(src)):
        src.seek(0)
        return load_pickle(src, trusted=trusted, name=label)
    src.seek(0)
    with _load_errors(label, trusted), ser._open_zipfile_reader(src) as zf:
        whole = buffer.untyped_storage()
        if trusted:
            return ser._load(zf, "cpu", REF_PICKLE, overall_storage=whole)
        torch.serialization.add_safe_globals(_SAFE_ENTRIES)
        return ser._load(zf, "cpu", torch._weights_only_unpickler, overall_storage=whole)


class RangeFile(io.RawIOBase):
    """A read-only, seekable file over ``read(offset, length) -> bytes-like`` and a size: what zipfile and
    torch.load need from a file, for a buffer in memory, a byte range of a local file or an object."""

    def __init__(self, read: Callable[[int, int], Any], size: int):
        super().__init__()
        self._read, self._size, self._pos = read, size, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._size}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def readinto(self, out) -> int:
        n = max(0, min(len(out), self._size - self._pos))
        data = self._read(self._pos, n) if n else b""
        memoryview(out).cast("B")[:len(data)] = data
        self._pos += len(data)
        return len(data)


def ViewReader(buffer) -> RangeFile:  # noqa: N802 - reads like the class it used to be
    """A RangeFile over a buffer, without copying it (io.BytesIO would)."""
    view = memoryview(buffer).cast("B")
    return RangeFile(lambda offset, n: view[offset:offset + n], len(view))
