"""Source: the optimizer state of a tag saved with ``use_zero1_dcp=True`` (NxD's ZeRO-1 state as a DCP
checkpoint under ``optim/``; layout in zero1_dcp.py) as full tensors per parameter name, for the converters.

Each moment of parameter NAME is one DCP entry per TP rank, ``base_state.NAME.LEAF|tp-NNNN`` (``|pp-NNNN``
first when PP > 1), whose global size is the TP-local unpadded shape (its chunks are the DP ranks' rows):
read whole through dcp.load, then placed into the full tensor by the parameter's TP partition. ``step`` is
the 0-d ``base_state.NAME.step``; the param groups number parameters as the optimizer does (group by group),
mapped to names by the order of the ``base_state`` entries (the optimizer's index order), checked against
``shape_info`` (``fullstate.param_orders``).
"""
from __future__ import annotations

from typing import Dict, List, Tuple

from . import layout
from .fullstate import (ConversionError, OptimState, ParamState, TensorSource, local_shape, merge_groups,
                        new_full, param_orders, piece_stream)
from .partition import copy_into_blocks, tp_block_views


def read_optim(reader, model: Dict[str, TensorSource], stage_keys: Dict[int, List[str]]) -> OptimState:
    """The OptimState of the tag ``reader`` reads (its optim/ holds NxD's DCP layout). Every optim/ file is
    checked against the tag's manifest first."""
    from .dcpio import _DcpReader

    folder = reader.where(layout.OPTIM_DIR)
    if len(stage_keys) > 1:
        raise ConversionError(f"{folder} holds a use_zero1_dcp=True state of a PP={len(stage_keys)} tag, which the "
                              "converters do not read yet (only PP=1); pass --no-optimizer to convert the model only")
    if reader.manifest is not None:
        for rel in reader.manifest.files:
            if rel.startswith(layout.OPTIM_DIR + "/"):
                reader.check_file(rel)
    dcp = _DcpReader(reader.storage.child(layout.OPTIM_DIR), reader.trusted)
    leaves, steps, blobs = _entries(dcp)
    ntp = 1 + max((tp for by_tp in leaves.values() for tp in by_tp), default=0)
    params: Dict[str, ParamState] = {}
    for (name, leaf), by_tp in sorted(leaves.items()):
        if name not in model:
            raise ConversionError(f"{folder}: the optimizer state names parameter {name!r}, which the model does not "
                                  f"have (model keys: {sorted(model)[:4]}...): pass --no-optimizer")
        ps = params.setdefault(name, ParamState())
        ps.moments[leaf] = _joined(dcp, by_tp, model[name], ntp, f"{name} {leaf}")
    for name, key in steps.items():
        if name in params:
            params[name].step = dcp.tensor(key) if dcp.is_tensor(key) else dcp.value(key)
    return OptimState(params, _groups(dcp, blobs, list(stage_keys.values())[0], model, ntp, folder))


def _entries(dcp) -> Tuple[Dict[Tuple[str, str], Dict[int, str]], Dict[str, str], Dict[tuple, str]]:
    """({(name, leaf): {tp: key}} of the moments, {name: key} of the steps, {path: key} of the other entries)."""
    leaves: Dict[Tuple[str, str], Dict[int, str]] = {}
    steps: Dict[str, str] = {}
    blobs: Dict[tuple, str] = {}
    for key, path in dcp.paths.items():
        if len(path) == 3 and path[0] == "base_state":
            leaf, *marks = str(path[2]).split("|")
            tp = next((int(m[3:]) for m in marks if m.startswith("tp-")), 0)
            if not dcp.is_tensor(key):
                continue
            if len(dcp.entries[key].size) > 0:
                leaves.setdefault((str(path[1]), leaf), {})[tp] = key
            else:
                steps[str(path[1])] = key
        else:
            blobs[path] = key
    return leaves, steps, blobs


def _joined(dcp, by_tp: Dict[int, str], param: TensorSource, ntp: int, label: str) -> TensorSource:
    dtype = dcp.entries[by_tp[min(by_tp)]].properties.dtype

    def load():
        full = new_full(tuple(param.shape), dtype)
        for r in range(ntp):
            blocks = tp_block_views(full, param.partition, ntp, r, label)
            if not blocks:
                continue
            if r not in by_tp:
                raise ConversionError(f"{label}: the use_zero1_dcp state has no entry for TP rank {r}")
            copy_into_blocks(dcp.tensor(by_tp[r]), blocks, param.partition, label)
        return full

    def piece(r: int, _d: int):
        if r not in by_tp:
            raise ConversionError(f"{label}: the use_zero1_dcp state has no entry for TP rank {r}")
        return dcp.tensor(by_tp[r])

    pieces = piece_stream(param, ntp, local_shape(param, ntp), dtype, label, piece)
    return TensorSource(label, tuple(param.shape), dtype, param.partition, load, pieces)


def _groups(dcp, blobs: Dict[tuple, str], keys: List[str], model: Dict[str, TensorSource], ntp: int,
            folder: str) -> List[Tuple[dict, List[str]]]:
    """The param groups by parameter name: the optimizer's indices mapped as fullstate._param_names does."""
    by_index: Dict[int, dict] = {}
    for p, k in blobs.items():     # flattened as DCP flattens a list of dicts: ("param_groups", i, key)
        if p[0] == "param_groups" and len(p) == 3:
            by_index.setdefault(int(p[1]), {})[str(p[2])] = dcp.value(k)
    groups = [by_index[i] for i in sorted(by_index)]
    if not groups or any("params" not in g for g in groups):
        raise ConversionError(f"{folder} holds no param_groups entries with their params; pass --no-optimizer")
    shapes = {int(p[1]): tuple(int(d) for d in dcp.value(k)) for p, k in blobs.items()
              if p[0] == "shape_info" and len(p) == 2}
    sizes = [len(g["params"]) for g in groups]
    # base_state is keyed by name in the optimizer's index order (NxD's get_dcp_aux_infos), so the entries'
    # order is the recorded order
    named = list(dict.fromkeys(str(p[1]) for p in dcp.paths.values() if len(p) == 3 and p[0] == "base_state"))
    for order in param_orders(keys, sizes, len(shapes), named):
        if all(shapes.get(i) == local_shape(model[k], ntp) for i, k in enumerate(order)):
            out = [({k: v for k, v in g.items() if k != "params"}, [order[int(i)] for i in g["params"]])
                   for g in groups]
            return merge_groups(out)
    raise ConversionError(f"{folder}: the optimizer's {len(shapes)} parameters in groups of sizes {sizes} cannot be "
                          "mapped to the model's tensors in order; pass --no-optimizer to convert the model only")
