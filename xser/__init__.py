"""xser: torch-xla's serialized-tensor checkpoint format (a ref file plus one file per tensor).

Compatible both ways with ``torch_xla.utils.serialization`` and usable without torch-xla installed.
Every pickle is read with ``weights_only=True`` unless the caller passes ``trusted=True``.
"""
from .api import load, load_refs, save
from .container import tensor_frame, tensor_parts
from .errors import CorruptFileError, MissingFileError, UnsafeCheckpointError, XserError
from .files import (compact_cpu, info_file, is_compact, read_info, read_tensor, tensor_file, tensor_to_bytes,
                    tensors_dir, write_tensor)
from .host import is_master, to_cpu
from .lazy import LazyFile, open_lazy, unpickle_meta
from .pickling import REF_PICKLE, RangeFile, ViewReader, dump_refs, load_pickle, load_pickle_in_place
from .tensorfile import load_tensor_in_place
from .zipranges import RecordSums
from .refs import (TORCH_XLA_MODULE, TORCH_XLA_NAME, TensorReference, TracedRefs, collect_tids, from_refs, is_ref,
                   key_paths, to_refs, traced_refs)

__all__ = [
    "TensorReference", "to_refs", "traced_refs", "TracedRefs", "key_paths", "from_refs", "collect_tids", "is_ref",
    "tensors_dir", "tensor_file", "info_file",
    "write_tensor", "tensor_frame", "tensor_parts", "tensor_to_bytes", "read_tensor", "read_info", "compact_cpu", "is_compact", "to_cpu",
    "dump_refs", "load_refs", "load_pickle", "load_pickle_in_place", "load_tensor_in_place", "ViewReader", "RangeFile", "save", "load", "is_master",
    "LazyFile", "open_lazy", "unpickle_meta", "RecordSums",
    "XserError", "MissingFileError", "CorruptFileError", "UnsafeCheckpointError",
    "REF_PICKLE", "TORCH_XLA_MODULE", "TORCH_XLA_NAME",
]
