"""Gloo process groups for host-side exchange during load (never the training group, never XLA).

Groups are created collectively (every rank calls new_group for every group, in the same order), once
per default process group and timeout, and cached. ``timeout(seconds)`` sets how long an exchange waits
for a peer (load_checkpoint's ``timeout_s``, the same on every rank).
"""
from __future__ import annotations

import contextlib
from datetime import timedelta
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

_CACHE: Dict[Tuple, object] = {}
_CACHE_OWNER: List[object] = [None]
TIMEOUT = timedelta(seconds=1800)
_timeout: List[timedelta] = [TIMEOUT]


@contextlib.contextmanager
def timeout(seconds: float):
    """Exchanges inside the block wait at most ``seconds`` for a peer (then gloo raises on this rank)."""
    previous = _timeout[0]
    _timeout[0] = timedelta(seconds=float(seconds))
    try:
        yield
    finally:
        _timeout[0] = previous


def _check_owner() -> None:
    pg = dist.group.WORLD
    if _CACHE_OWNER[0] is not pg:
        _CACHE.clear()
        _CACHE_OWNER[0] = pg


def world_group():
    """A gloo group over all ranks, with the current timeout."""
    _check_owner()
    key = ("world", _timeout[0])
    if key not in _CACHE:
        _CACHE[key] = dist.new_group(backend="gloo", timeout=_timeout[0])
    return _CACHE[key]


def replica_host_groups(groups: Sequence[Sequence[int]]) -> Dict[Tuple[int, ...], object]:
    """Gloo groups for each rank list of ``groups`` (all ranks must call this with the same lists)."""
    _check_owner()
    out = {}
    for g in sorted(tuple(sorted(x)) for x in groups):
        key = ("replicas", g, _timeout[0])
        if key not in _CACHE:
            _CACHE[key] = dist.new_group(ranks=list(g), backend="gloo", timeout=_timeout[0])
        out[g] = _CACHE[key]
    return out


def all_gather_objects(obj) -> list:
    """Every rank's ``obj`` (picklable, small), in rank order, over the host gloo group."""
    if not (dist.is_available() and dist.is_initialized()):
        return [obj]
    out: List[Optional[object]] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj, group=world_group())
    return out


def broadcast_object(obj, src: int = 0):
    """Global rank ``src``'s ``obj`` (picklable) on every rank, over the host gloo group; every rank calls it
    (the others pass anything, e.g. None). Unlike ``all_gather_objects`` only ``src``'s object travels."""
    if not (dist.is_available() and dist.is_initialized()):
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src, group=world_group())
    return box[0]


def broadcast_tensor(t: torch.Tensor, src: int, group) -> torch.Tensor:
    """Broadcast a contiguous CPU tensor's bytes from global rank ``src`` (any dtype, 0-d included)."""
    flat = t.reshape(-1)
    if flat.numel() == 0:
        return t
    dist.broadcast(flat.view(torch.uint8), src=src, group=group)
    return t


def share_tensor_dicts(mine: Dict[int, Dict[int, torch.Tensor]], note, replicas: Sequence[int], group):
    """Every replica's ``{a: {b: CPU tensor}}`` merged into one, plus every replica's small picklable ``note``
    (in replica order), over the gloo ``group`` of ``replicas``. Every replica calls it; ``group`` None: alone."""
    if group is None:
        return mine, [note]
    ranks = sorted(replicas)
    meta = {a: {b: (tuple(t.shape), t.dtype) for b, t in d.items()} for a, d in mine.items()}
    gathered: List[Optional[object]] = [None] * len(ranks)
    dist.all_gather_object(gathered, (meta, note), group=group)
    me = dist.get_rank()
    out: Dict[int, Dict[int, torch.Tensor]] = {}
    for src, (theirs, _) in zip(ranks, gathered):
        for a in sorted(theirs):
            for b in sorted(theirs[a]):
                shape, dtype = theirs[a][b]
                t = mine[a][b].contiguous() if src == me else torch.empty(shape, dtype=dtype)
                out.setdefault(a, {})[b] = broadcast_tensor(t, src, group)
    return out, [g[1] for g in gathered]
