"""The one reader of torch.distributed.checkpoint ``.metadata`` files (a pickled ``Metadata``).

torch's own ``FileSystemReader.read_metadata`` is a plain ``pickle.load``: a crafted ``.metadata`` runs any code.
This reader resolves only the exact (module, name) globals torch 2.9's FileSystemWriter pickles (checked against
real ``dcp.save`` output, model and optimizer state) unless the caller passes ``trusted=True``.
"""
from __future__ import annotations

import io
import pickle

import torch

from .errors import CorruptCheckpointError, UnsafeCheckpointError

_DCP_META = "torch.distributed.checkpoint.metadata"
_ALLOWED = frozenset({
    (_DCP_META, "Metadata"), (_DCP_META, "TensorStorageMetadata"), (_DCP_META, "BytesStorageMetadata"),
    (_DCP_META, "ChunkStorageMetadata"), (_DCP_META, "TensorProperties"), (_DCP_META, "MetadataIndex"),
    (_DCP_META, "StorageMeta"), (_DCP_META, "_MEM_FORMAT_ENCODING"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),     # TensorProperties.layout: looks a torch.layout up by name
    ("collections", "OrderedDict"),
    ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"),   # StorageMeta.checkpoint_id
})
_DTYPES = frozenset(name for name in dir(torch) if isinstance(getattr(torch, name, None), torch.dtype))


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module, name):
        if (module, name) in _ALLOWED or (module == "torch" and name in _DTYPES):
            return super().find_class(module, name)
        raise UnsafeCheckpointError(f"global {module}.{name} is not one a torch.distributed.checkpoint .metadata "
                                    "file holds")


def read_metadata(data: bytes, where: str, trusted: bool = False):
    """The ``Metadata`` pickled in ``data`` (the bytes of the file ``where``, named in errors). Without
    ``trusted`` only DCP's metadata classes, torch.Size, dtypes and paths are resolved: UnsafeCheckpointError
    naming the global otherwise. CorruptCheckpointError when the bytes do not unpickle to a ``Metadata``."""
    from torch.distributed.checkpoint.metadata import Metadata

    try:
        meta = pickle.loads(data) if trusted else _MetadataUnpickler(io.BytesIO(data)).load()
    except UnsafeCheckpointError as exc:
        raise UnsafeCheckpointError(f"{where}: {exc}; load it only if you trust its origin (trusted=True, or "
                                    "--trusted on the command line)") from None
    except Exception as exc:  # noqa: BLE001 - any unpickling failure means a damaged file
        raise CorruptCheckpointError(f"{where} is not a readable torch.distributed.checkpoint metadata file: {exc}",
                                     path=where) from exc
    if not isinstance(meta, Metadata):
        raise CorruptCheckpointError(f"{where} holds a {type(meta).__name__}, not a torch.distributed.checkpoint "
                                     "Metadata", path=where)
    return meta
