"""File naming of an xser checkpoint and the I/O of one tensor file."""
from __future__ import annotations

import io
import os
from typing import Optional

import torch

from . import container
from .errors import CorruptFileError
from .pickling import describe, load_pickle, writable


def tensors_dir(path) -> str:
    """The folder holding the tensor files of ref file ``path``: ``<path>.tensors``."""
    return os.fspath(path) + ".tensors"


def tensor_file(path, tid: int) -> str:
    """The file of tensor ``tid`` of ref file ``path``: ``<path>.tensors/tensor_<tid>.pt``."""
    return os.path.join(tensors_dir(path), f"tensor_{tid}.pt")


def info_file(path) -> str:
    """NxD's per-shard metadata file: ``<path>.info.pt``."""
    return os.fspath(path) + ".info.pt"


def _is_dense_permutation(t: torch.Tensor) -> bool:
    """True if ``t``'s elements tile its memory exactly (contiguous up to a permutation of dims)."""
    expected = 1
    for stride, size in sorted((st, sz) for st, sz in zip(t.stride(), t.shape) if sz != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def is_compact(t: torch.Tensor) -> bool:
    """True if saving ``t`` as is would write only its own bytes (no slack from a larger storage)."""
    if t.layout != torch.strided:
        return True
    nbytes = t.numel() * t.element_size()
    return (t.storage_offset() == 0 and t.untyped_storage().nbytes() == nbytes
            and (t.is_contiguous() or _is_dense_permutation(t)))


def compact_cpu(t: torch.Tensor) -> torch.Tensor:
    """A plain CPU tensor holding ``t``'s values whose storage is exactly its bytes.

    Detaches (a Parameter becomes a Tensor), copies non-CPU tensors to the host, resolves lazy conj/neg
    bits and clones views of larger storages.
    """
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    if not is_compact(t):
        t = t.clone(memory_format=torch.contiguous_format)
    return t


def write_tensor(t: torch.Tensor, fileobj) -> None:
    """``torch.save``'s format of ``t`` compacted to CPU, into a path or any writable file object; the zip
    CRC-32 fields are left at 0 (nobody checks them and they cost most of the CPU), and plain tensors are
    written in one piece (``container.write_tensor``)."""
    dest = writable(fileobj)
    if isinstance(dest, (str, bytes, os.PathLike)):
        with open(dest, "wb") as f:
            container.write_tensor(compact_cpu(t), f)
        return
    container.write_tensor(compact_cpu(t), dest)


def tensor_to_bytes(t: torch.Tensor) -> bytes:
    """The bytes ``write_tensor`` would write."""
    buf = io.BytesIO()
    write_tensor(t, buf)
    return buf.getvalue()


def read_tensor(src, *, trusted: bool = False, map_location="cpu", name: Optional[str] = None,
                mmap: bool = False) -> torch.Tensor:
    """Load one tensor file (path or file object), safely unless ``trusted``; ``mmap=True`` (a path only)
    returns a tensor backed by a private mapping of the file."""
    label = name or describe(src)
    obj = load_pickle(src, trusted=trusted, name=label, map_location=map_location, mmap=mmap)
    if not isinstance(obj, torch.Tensor):
        raise CorruptFileError(f"{label} holds a {type(obj).__name__}, not a tensor; a tensor file must hold "
                               f"one torch.save'd tensor: restore it from a complete copy", path=label)
    return obj


def read_info(path, *, trusted: bool = False) -> Optional[dict]:
    """NxD's ``<path>.info.pt`` ({tid: {"dtype", "shape", ...}}), or None when there is none (older NxD)."""
    info = info_file(path)
    if not os.path.isfile(info):
        return None
    return load_pickle(info, trusted=trusted)
