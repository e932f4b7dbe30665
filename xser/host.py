"""Device -> host copies and the "who writes" rule. torch-xla is imported only when an XLA tensor is present."""
from __future__ import annotations

import os
from typing import Iterator, List, Sequence

import torch

from .files import compact_cpu


def is_xla(t: torch.Tensor) -> bool:
    """True for a tensor on an XLA device (checked without importing torch-xla)."""
    return t.device.type == "xla"


def to_cpu(tensors: Sequence[torch.Tensor]) -> List[torch.Tensor]:
    """Compact CPU copies of ``tensors`` (same order); all XLA tensors are fetched in one batched call."""
    out: List[torch.Tensor] = list(tensors)
    xla_idx = [i for i, t in enumerate(out) if is_xla(t)]
    if xla_idx:
        for i, cpu in zip(xla_idx, _fetch_xla([out[i] for i in xla_idx])):
            out[i] = cpu
    return [compact_cpu(t) for t in out]


def _fetch_xla(tensors: List[torch.Tensor]) -> List[torch.Tensor]:
    """One ``_xla_get_cpu_tensors`` call for many XLA tensors; falls back to ``.cpu()`` one by one."""
    detached = [t.detach() for t in tensors]
    try:
        import torch_xla

        return list(torch_xla._XLAC._xla_get_cpu_tensors(detached))
    except (ImportError, AttributeError, RuntimeError, TypeError):
        return [t.cpu() for t in detached]


def batches(tensors: Sequence[torch.Tensor], max_bytes: int) -> Iterator[List[int]]:
    """Index lists of consecutive tensors whose total size stays under ``max_bytes`` (at least one each)."""
    batch: List[int] = []
    size = 0
    for i, t in enumerate(tensors):
        nbytes = t.numel() * t.element_size()
        if batch and size + nbytes > max_bytes:
            yield batch
            batch, size = [], 0
        batch.append(i)
        size += nbytes
    if batch:
        yield batch


def is_master(global_master: bool = False) -> bool:
    """torch-xla's master rule: the local master (LOCAL_RANK 0), or with ``global_master`` global rank 0.

    The global rank is torch.distributed's when it is initialized, else the ``RANK`` environment variable
    (0 when unset).
    """
    if not global_master:
        return int(os.environ.get("LOCAL_RANK", "0") or 0) == 0
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank() == 0
    return int(os.environ.get("RANK", "0") or 0) == 0
