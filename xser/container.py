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
"""
from __future__ import annotations

import os
import pickle
from typing import Any, Optional

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
