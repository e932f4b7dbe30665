"""The model's weights kept only as ZeRO-1 master weights (NxD's ``avoid_saving_lower_precision_weights``).

Which model key each ZeRO-1 parameter index belongs to, and a full tensor joined from its DP shards. Pure:
no files, no process groups. The save records the index of each such model tensor in the manifest
(``zero1_index`` in the tensor's metadata); loading and the offline tools read it back.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import torch

MASTERS = "sharded_master_weights"
INDEX_META = "zero1_index"         # manifest tensor metadata: the ZeRO-1 index of a model tensor
FLAG = "model_from_master_weights"  # manifest flag: the model's parameter data lies in the optimizer


def has_master_weights(osd) -> bool:
    """True for a ZeRO-1 state dict that holds master weights (NxD's test, also for a list of states)."""
    if isinstance(osd, list) and osd:
        osd = osd[0]
    return isinstance(osd, dict) and MASTERS in osd


def _flat_params(optimizer) -> Optional[List[torch.Tensor]]:
    groups = getattr(optimizer, "param_groups", None) if not isinstance(optimizer, dict) else None
    params = [p for g in (groups or []) for p in g.get("params", [])]
    if not params or not all(isinstance(p, torch.Tensor) for p in params):
        return None
    return params


def keys_by_identity(model, optimizer) -> Optional[Dict[str, int]]:
    """model key -> ZeRO-1 index, matching the optimizer's parameters (in group order, as ZeRO-1 numbers
    them) to the model's named parameters by identity; None when the objects cannot tell."""
    if not isinstance(model, torch.nn.Module):
        return None
    params = _flat_params(optimizer)
    if params is None:
        return None
    name_of = {id(p): n for n, p in model.named_parameters()}
    if not all(id(p) in name_of for p in params):
        return None
    return {name_of[id(p)]: i for i, p in enumerate(params)}


def keys_by_order(keys_shapes: Sequence[Tuple[str, tuple]], shape_info: Dict[int, tuple]) -> Optional[Dict[str, int]]:
    """model key -> ZeRO-1 index when the model's tensors are the optimizer's parameters in order (same count,
    same shapes); None otherwise (the mapping would be a guess)."""
    order = sorted(shape_info)
    if len(order) != len(keys_shapes):
        return None
    if any(tuple(shape_info[i]) != tuple(s) for i, (_, s) in zip(order, keys_shapes)):
        return None
    return {k: i for i, (k, _) in zip(order, keys_shapes)}


def param_keys(model, optimizer, keys_shapes, shape_info) -> Optional[Dict[str, int]]:
    """model key -> ZeRO-1 index: by identity of the live objects, else by order; None when neither holds."""
    return keys_by_identity(model, optimizer) or keys_by_order(keys_shapes, shape_info)


def join_shards(parts: Sequence[torch.Tensor], shape) -> torch.Tensor:
    """The full tensor of ``shape`` from its ZeRO-1 shards in DP order (zero-padded along dim 0)."""
    shape = tuple(int(d) for d in shape)
    flat = torch.cat([p.reshape(p.shape[0] if p.dim() else 1, -1) for p in parts])
    rows = shape[0] if shape else 1
    return flat[:rows].reshape(shape).clone()
