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


def keys_by_order(keys_shapes: Sequence[Tuple[str, tuple]], shape_info: Dict[int, tuple],
                  group_sizes: Optional[List[int]] = None) -> Optional[Dict[str, int]]:
    """model key -> ZeRO-1 index when exactly one of the orders an optimizer numbers the model's tensors in
    (``fullstate.param_orders``: one param group, or NxD's weight-decay split; both when ``group_sizes`` is
    None) agrees with ``shape_info`` tensor by tensor; None otherwise (the mapping would be a guess)."""
    from .fullstate import param_orders

    ids = sorted(shape_info)
    shapes = dict(keys_shapes)
    fits = []
    for order in param_orders([k for k, _ in keys_shapes], group_sizes, len(ids)):
        if order not in fits and all(tuple(shape_info[i]) == tuple(shapes[k]) for i, k in zip(ids, order)):
            fits.append(order)
    return {k: i for i, k in zip(ids, fits[0])} if len(fits) == 1 else None


def group_sizes(osd) -> Optional[List[int]]:
    """The parameter count of each param group of an optimizer state dict; None when it does not say."""
    groups = osd.get("param_groups") if isinstance(osd, dict) else None
    if not isinstance(groups, list) or not all(isinstance(g, dict) and "params" in g for g in groups):
        return None
    return [len(g["params"]) for g in groups]


def param_keys(model, optimizer, keys_shapes, shape_info,
               group_sizes: Optional[List[int]] = None) -> Optional[Dict[str, int]]:
    """model key -> ZeRO-1 index: by identity of the live objects, else by order; None when neither holds."""
    return keys_by_identity(model, optimizer) or keys_by_order(keys_shapes, shape_info, group_sizes)


def join_shards(parts: Sequence[torch.Tensor], shape) -> torch.Tensor:
    """The full tensor of ``shape`` from its ZeRO-1 shards in DP order (zero-padded along dim 0)."""
    shape = tuple(int(d) for d in shape)
    flat = torch.cat([p.reshape(p.shape[0] if p.dim() else 1, -1) for p in parts])
    rows = shape[0] if shape else 1
    return flat[:rows].reshape(shape).clone()
