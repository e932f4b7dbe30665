"""``save`` and ``load`` with torch-xla's semantics: a ref file plus one file per tensor."""
from __future__ import annotations

import io
import os
import shutil
import tempfile
from typing import Any, Optional

import torch

from .errors import CorruptFileError, MissingFileError, XserError
from .files import read_tensor, tensor_file, tensors_dir, write_tensor
from .host import batches, is_master, to_cpu
from .pickling import check_file, describe, dump_refs, load_pickle, load_plain_refs
from .refs import from_refs, to_refs

#: Host memory used by one batch of device -> host copies in ``save``.
SAVE_BATCH_BYTES = 1 << 30


def save(data: Any, path, master_only: bool = True, global_master: bool = False) -> None:
    """Save ``data`` as ``path`` (ref file) + ``<path>.tensors/tensor_<tid>.pt``, like torch-xla's ``save``.

    Every tensor (XLA or CPU) is written to its own file; with ``master_only`` only the (local, or with
    ``global_master`` the global) master process writes. An existing tensors folder is replaced. Tensor
    files are written first and the ref file last (atomically), so a ref file implies its tensors.
    """
    path = os.fspath(path)
    if master_only and not is_master(global_master):
        return
    if os.path.isdir(path):
        raise XserError(f"{path} is a directory; pass the path of the ref file to write", path=path)
    ref_data, tensors = to_refs(data)
    _write_tensors(path, tensors)
    _write_atomic(path, lambda f: dump_refs(ref_data, f))


def _write_tensors(path: str, tensors) -> None:
    """(Re)create ``<path>.tensors`` and write the tensors, copying XLA tensors to host in batches."""
    folder = tensors_dir(path)
    if os.path.isdir(folder):
        shutil.rmtree(folder)
    os.makedirs(folder)
    for idx in batches(tensors, SAVE_BATCH_BYTES):
        for tid, cpu in zip(idx, to_cpu([tensors[i] for i in idx])):
            with open(tensor_file(path, tid), "wb") as f:
                write_tensor(cpu, f)


def _write_atomic(path: str, write) -> None:
    """Write ``path`` through a temporary file in the same folder and rename it into place."""
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=os.path.basename(path) + ".", suffix=".tmp", dir=folder)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def load_refs(src, *, trusted: bool = False, name: Optional[str] = None) -> Any:
    """The ref data of a ref file (path or file object): TensorReferences in place of externalised tensors.
    A ref file in memory (BytesIO) holding only plain ref data is unpickled by the C unpickler restricted to
    TensorReference (``load_plain_refs``), else by torch's safe loader (``trusted``: the full unpickler)."""
    if not trusted and isinstance(src, io.BytesIO) and src.tell() == 0:
        plain, refs = load_plain_refs(src.getvalue())
        if plain:
            return refs
    return load_pickle(src, trusted=trusted, name=name or describe(src))


def load(path, *, trusted: bool = False) -> Any:
    """Load what ``save`` (ours, torch-xla's or NxD's) wrote at ``path``; tensors come back on CPU.

    ``.info.pt`` is not needed; tensors inlined in the ref file pass through. Unless ``trusted``, every
    pickle is read with ``weights_only=True``.
    """
    path = os.fspath(path)
    check_file(path, "ref file")
    ref_data = load_refs(path, trusted=trusted)
    return from_refs(ref_data, lambda tid: _load_tensor(path, tid, trusted))


def _load_tensor(path: str, tid, trusted: bool) -> torch.Tensor:
    """Tensor ``tid`` of ref file ``path``, with errors that name the tensor file and the tid."""
    if type(tid) is not int or tid < 0:
        raise CorruptFileError(f"{path} holds a TensorReference with invalid tid {tid!r} (must be an int >= 0); "
                               f"restore the ref file from a complete copy", path=path)
    file = tensor_file(path, tid)
    if not os.path.isfile(file):
        raise MissingFileError(
            f"tensor file {file} (tid {tid}) referenced by {path} is missing; the checkpoint is incomplete or "
            f"its {os.path.basename(tensors_dir(path))} folder was not copied along: copy the whole folder or "
            f"re-save", path=file)
    return read_tensor(file, trusted=trusted, name=f"{file} (tid {tid})")
