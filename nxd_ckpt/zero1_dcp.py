"""NxD's ``use_zero1_dcp=True`` layout: a ZeRO-1 optimizer state as a ``torch.distributed.checkpoint`` in
``<tag>/optim/`` (neuronx-distributed's ``optimizer/zero_dcp_utils.py``), written and read without collectives.

What NxD writes (and so what this module writes), for a ZeRO-1 state dict with ``base_state``, ``shape_info``
and ``param_groups``:
- ``base_state`` is keyed by parameter *name* (the model's ``named_parameters()`` name of optimizer parameter
  ``pid``), and the state dict is flattened as torch.distributed.checkpoint flattens it (keys joined by ``.``).
- A tensor with dims is saved as a ZeRO-1 chunk of its parameter: global size = ``shape_info[pid]`` (unpadded),
  this DP rank's rows at offset ``per * dp_rank`` (``per = ceil(rows / DP)``), the padding rows dropped. Its key
  gets ``|pp-NNNN`` (PP > 1) and ``|tp-NNNN`` (TP > 1) appended, e.g.
  ``base_state.layers.0.weight.exp_avg|pp-0001|tp-0003``. 0-d tensors (``step``) keep the plain key.
- Everything else (``param_groups.*``, ``shape_info.*``) is a pickled bytes entry.
- Files: one ``__{rank}_0.distcp`` per rank and ``.metadata`` (a pickled ``Metadata``), as FileSystemWriter names
  them. Replicated entries (0-d tensors, bytes) are written once, by the DP=0, TP=0 rank of each PP stage.

Reading takes, for this rank's (pp, tp), the rows of its DP shard at the *current* DP size from whichever chunks
overlap them, so a checkpoint written at one DP size loads at another.
"""
from __future__ import annotations

import io
import math
import pickle
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import crc32c as _crc32c
import torch

from . import layout, masters
from .errors import CheckpointArgumentError, CorruptCheckpointError, StateMismatchError
from .storage.base import crc_hex

METADATA_FILE = layout.DCP_METADATA_FILE
FORMAT_FLAG = "zero1_dcp"      # manifest flag
RANGES_KEY = "zero1_dcp_entries"   # manifest field: every data file entry's byte range and CRC32C


def data_filename(rank: int) -> str:
    return f"__{rank}_0.distcp"


def param_names(model, optimizer) -> Dict[int, str]:
    """ZeRO-1 index -> parameter name (NxD's ``get_dcp_aux_infos``: the optimizer's parameters in group order,
    named by the model's ``named_parameters()``). CheckpointArgumentError when the objects cannot tell."""
    by_key = masters.keys_by_identity(model, optimizer)
    if not by_key:
        raise CheckpointArgumentError(
            "use_zero1_dcp=True names the optimizer state by parameter name: pass the nn.Module as model= and the "
            "ZeRO-1 optimizer object (whose param_groups hold the model's parameters) as optimizer=")
    return {i: k for k, i in by_key.items()}


def suffix(pp: int, tp: int, pp_size: int, tp_size: int) -> str:
    return (f"|pp-{pp:04d}" if pp_size > 1 else "") + (f"|tp-{tp:04d}" if tp_size > 1 else "")


def rows_of(rows: int, dp: int, dp_size: int) -> Tuple[int, int]:
    """[start, stop) of DP rank ``dp``'s ZeRO-1 rows of a parameter with ``rows`` rows (padding dropped)."""
    per = math.ceil(rows / dp_size)
    start = per * dp
    return start, max(start, min(rows, start + per))


@dataclass
class Item:
    """One entry of this rank's DCP data file."""

    fqn: str
    path: Tuple                      # the nested path (planner_data), str and int elements
    tensor: Optional[torch.Tensor]   # the chunk (or 0-d tensor); None for a bytes entry
    value: Optional[bytes] = None    # a bytes entry, already serialized
    offsets: Tuple[int, ...] = ()
    size: Tuple[int, ...] = ()       # the global size


@dataclass
class Coords:
    pp: int
    tp: int
    dp: int
    pp_size: int
    tp_size: int
    dp_size: int


def plan_items(osd: dict, names: Dict[int, str], c: Coords) -> List[Item]:
    """This rank's entries of NxD's DCP layout for ZeRO-1 state ``osd``."""
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    if masters.MASTERS in osd:
        raise CheckpointArgumentError(
            "use_zero1_dcp=True cannot save sharded_master_weights (neuronx-distributed's DCP layout has no place "
            "for them); build the ZeRO-1 optimizer without saving master weights, or pass use_zero1_dcp=False")
    missing = sorted(set(osd["base_state"]) - set(names))
    if missing:
        raise CheckpointArgumentError(f"use_zero1_dcp=True: ZeRO-1 parameters {missing[:5]} are not parameters of "
                                      "the model passed as model=; pass the model the optimizer was built over")
    wrapped = dict(osd, base_state={names[i]: v for i, v in osd["base_state"].items()})
    flat, mappings = flatten_state_dict(wrapped)
    pid_of = {v: k for k, v in names.items()}
    leader = c.dp == 0 and c.tp == 0
    items = []
    for key, value in flat.items():
        path = tuple(mappings[key])
        if not isinstance(value, torch.Tensor):
            if leader:   # pickled now: a later change by the training loop must not reach the file
                items.append(Item(key, path, None, _blob(value)))
            continue
        if value.dim() == 0:
            if leader:
                items.append(Item(key, path, value, size=()))
            continue
        shape = tuple(int(d) for d in osd["shape_info"][pid_of[path[1]]])
        start, stop = rows_of(shape[0], c.dp, c.dp_size)
        if stop <= start:
            continue   # this DP rank's rows are all padding
        path = (*path[:-1], f"{path[-1]}{suffix(c.pp, c.tp, c.pp_size, c.tp_size)}")
        items.append(Item(".".join(map(str, path)), path, value[: stop - start].contiguous(), None,
                          (start,) + (0,) * (len(shape) - 1), shape))
    return items


def write_data(f, items: Sequence[Item], tensors: Sequence[torch.Tensor], filename: str) -> List[dict]:
    """Write ``items`` (tensor data from ``tensors``, the host copies, in item order) as one DCP data file the
    way FileSystemWriter lays it out (each entry a torch.save blob); return each entry's record for rank 0."""
    host = iter(tensors)
    pos = 0
    out = []
    for it in items:
        data = next(host) if it.tensor is not None else None
        blob = _blob(data) if data is not None else it.value
        f.write(blob)
        rec = {"fqn": it.fqn, "path": list(it.path), "bytes": data is None, "offsets": list(it.offsets),
               "size": list(it.size), "file": filename, "offset": pos, "length": len(blob),
               "crc32c": crc_hex(_crc32c.crc32c(blob))}
        if data is not None:
            rec["chunk"] = list(data.shape)
            rec["dtype"] = str(data.dtype).replace("torch.", "")
        out.append(rec)
        pos += len(blob)
    return out


def _blob(obj) -> bytes:
    """One entry's bytes, as FileSystemWriter stores it: a torch.save of the tensor or object."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def metadata_bytes(records_by_rank: Sequence[Tuple[int, List[dict]]]) -> bytes:
    """Rank 0: the pickled ``Metadata`` of every rank's entries (an entry written by several ranks is taken from
    the lowest rank, as DCP's de-duplication does)."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata, Metadata,
                                                       MetadataIndex, TensorProperties, TensorStorageMetadata)
    from torch.distributed.checkpoint.storage import StorageMeta

    sd_meta: Dict[str, Any] = {}
    planner: Dict[str, tuple] = {}
    storage: Dict[Any, Any] = {}
    for _, recs in sorted(records_by_rank, key=lambda x: x[0]):
        for r in recs:
            offsets = torch.Size(r["offsets"]) if not r["bytes"] else None
            index = MetadataIndex(r["fqn"], offsets)
            if index in storage:
                continue
            storage[index] = _StorageInfo(r["file"], r["offset"], r["length"])
            planner.setdefault(r["fqn"], tuple(r["path"]))
            if r["bytes"]:
                sd_meta.setdefault(r["fqn"], BytesStorageMetadata())
                continue
            entry = sd_meta.setdefault(r["fqn"], TensorStorageMetadata(
                TensorProperties(dtype=getattr(torch, r["dtype"])), torch.Size(r["size"]), []))
            entry.chunks.append(ChunkStorageMetadata(torch.Size(r["offsets"]), torch.Size(r["chunk"])))
    meta = Metadata(sd_meta, planner_data=planner, storage_data=storage, storage_meta=StorageMeta(),
                    version=_dcp_version())
    return pickle.dumps(meta)


def entry_ranges(records_by_rank: Sequence[Tuple[int, List[dict]]]) -> Dict[str, List[list]]:
    """Rank 0: for our manifest (under RANGES_KEY), each data file's entries as ``[offset, length, crc32c]``,
    so a load reads and verifies just the entries it needs rather than whole files."""
    out: Dict[str, List[list]] = {}
    for _, recs in sorted(records_by_rank, key=lambda x: x[0]):
        for r in recs:
            out.setdefault(f"{layout.OPTIM_DIR}/{r['file']}", []).append([r["offset"], r["length"], r["crc32c"]])
    return out


def ranges_of(extra: dict) -> Dict[Tuple[str, int], Tuple[int, str]]:
    """(relpath, offset) -> (length, crc32c) from a manifest's extra fields ({} when it records none)."""
    recorded = extra.get(RANGES_KEY)
    if not isinstance(recorded, dict):
        return {}
    return {(rel, int(o)): (int(n), str(c)) for rel, entries in recorded.items() for o, n, c in entries}


def _dcp_version() -> Optional[str]:
    try:
        from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION
        return CURRENT_DCP_VERSION
    except ImportError:
        return None


# --- reading ---------------------------------------------------------------------------------------------------
def load_state(meta, read_blob, names: Dict[int, str], c: Coords, where: str) -> dict:
    """This rank's ZeRO-1 state dict (``base_state`` shards at the current DP size, ``shape_info``,
    ``param_groups``) from the DCP ``meta``; ``read_blob(file, offset, length)`` returns verified bytes."""
    from torch.distributed.checkpoint._traverse import set_element

    pid_of = {v: k for k, v in names.items()}
    tail = suffix(c.pp, c.tp, c.pp_size, c.tp_size)
    base: Dict[int, Dict[str, torch.Tensor]] = {}
    shape_info: Dict[int, torch.Size] = {}
    rest: Dict[str, Any] = {}
    for fqn, m in meta.state_dict_metadata.items():
        path = tuple(meta.planner_data.get(fqn, (fqn,))) if meta.planner_data else (fqn,)
        if path[0] == "base_state" and len(path) >= 3:
            origin = path[-1].split("|", 1)[0]
            pid = pid_of.get(path[1])
            if pid is None or ("|" in path[-1] and path[-1][len(origin):] != tail):
                continue        # another stage's or TP rank's entry, or a parameter this model does not have
            if hasattr(m, "chunks") and len(m.size) > 0:
                shape_info[pid] = torch.Size(m.size)
                base.setdefault(pid, {})[origin] = _my_rows(meta, fqn, m, c, read_blob)
            else:
                base.setdefault(pid, {})[origin] = _whole(meta, fqn, read_blob)
        elif hasattr(m, "chunks"):
            set_element(rest, path, _whole(meta, fqn, read_blob))
        else:
            set_element(rest, path, _load_blob(read_blob, meta.storage_data[_index(meta, fqn, None)]))
    unnamed = sorted(set(names) - set(base))
    if unnamed:
        raise StateMismatchError(
            f"{where} holds no optimizer state for parameter(s) {[names[i] for i in unnamed[:5]]} of this "
            f"rank (PP rank {c.pp}, TP rank {c.tp}); it was saved for another model or parallel layout")
    saved_shapes = {int(k): v for k, v in rest.get("shape_info", {}).items()} if isinstance(
        rest.get("shape_info"), dict) else {}
    for pid in base:
        shape_info.setdefault(pid, torch.Size(saved_shapes.get(pid, ())))
    groups = rest.get("param_groups") or []
    return {"state": rest.get("state", {}), "param_groups": groups,
            "base_state": dict(sorted(base.items())), "shape_info": dict(sorted(shape_info.items()))}


def fit_param_groups(saved: List[dict], live: Optional[List[dict]], pp_size: int, where: str) -> List[dict]:
    """The saved param groups with this rank's ``params`` lists. ``param_groups.*`` entries are stored once for
    every pipeline stage (their keys do not carry the stage, in NxD's layout either), so with PP > 1 a stage
    gets its own parameter numbering from the live optimizer, with the saved hyperparameters. StateMismatchError
    when the saved and live optimizers differ in group count or (PP = 1) in any group's parameter count."""
    if not live:
        return saved
    if len(saved) != len(live):
        raise StateMismatchError(
            f"{where} holds {len(saved)} optimizer param group(s) and this optimizer has {len(live)}; build the "
            "optimizer with the same param groups as the run that saved it")
    if pp_size == 1:
        for i, (s, g) in enumerate(zip(saved, live)):
            if len(s.get("params", ())) != len(g["params"]):
                raise StateMismatchError(
                    f"{where}: optimizer param group {i} holds {len(s.get('params', ()))} parameter(s) in the "
                    f"checkpoint and {len(g['params'])} in this optimizer; build the optimizer with the same "
                    "param groups as the run that saved it")
    return [dict(s, params=list(g["params"])) for s, g in zip(saved, live)]


def _index(meta, fqn: str, offsets):
    from torch.distributed.checkpoint.metadata import MetadataIndex

    return MetadataIndex(fqn, offsets)


def _load_blob(read_blob, info):
    return torch.load(io.BytesIO(read_blob(info.relative_path, info.offset, info.length)), weights_only=True)


def _whole(meta, fqn: str, read_blob) -> torch.Tensor:
    m = meta.state_dict_metadata[fqn]
    offsets = torch.Size([0] * len(m.size))
    return _load_blob(read_blob, meta.storage_data[_index(meta, fqn, offsets)])


def _my_rows(meta, fqn: str, m, c: Coords, read_blob) -> torch.Tensor:
    """This DP rank's ZeRO-1 shard (zero-padded to ``ceil(rows / DP)`` rows) from the chunks that overlap it."""
    rows = int(m.size[0])
    per = math.ceil(rows / c.dp_size)
    start = per * c.dp
    out = torch.zeros((per, *m.size[1:]), dtype=m.properties.dtype)
    for chunk in m.chunks:
        lo, hi = int(chunk.offsets[0]), int(chunk.offsets[0]) + int(chunk.sizes[0])
        a, b = max(lo, start), min(hi, start + per)
        if a >= b:
            continue
        part = _load_blob(read_blob, meta.storage_data[_index(meta, fqn, torch.Size(chunk.offsets))])
        out[a - start:b - start] = part[a - lo:b - lo]
    return out
