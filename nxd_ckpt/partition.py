"""Join and split primitives: tensor parallel (by partition dim and stride) and ZeRO-1 (DESIGN 2.4).

Pure tensor arithmetic, no I/O: every converter (export, import, reshard, to-dcp/from-dcp) and load-time
resharding go through these, so each layout fact lives here once.

- TP: a parameter with NxD's attributes ``tensor_model_parallel``, ``partition_dim`` d and
  ``partition_stride`` s is cut along d into ``tp * s`` equal blocks; TP rank r holds blocks
  ``r, tp + r, 2*tp + r, ...`` (s blocks, Megatron's strided split; s = 1 is a plain chunk).
- ZeRO-1: a (TP-local) tensor is flattened to rows along dim 0 (a 0-d tensor is one row), padded with zeros
  to a multiple of the group size G and cut into G pieces; DP rank d holds piece d.
- Expert parallel (NxD's ``ExpertFused*Linear``, ``checkpoint_converter.py``): an expert tensor (parameter attribute
  ``expert_model_parallel``) holds its EP rank's experts along dim 0, in contiguous equal runs: EP rank e holds
  experts ``[e * n, (e + 1) * n)``. NxD's ZeRO-1 optimizer for MoE keeps non-expert parameters first and the expert
  ones from ``ep_base_state_offset`` on (``EP_STATE_KEYS``), those sharded over expert-DP instead of DP.
- Pipeline stages: ``stage_of`` assigns a parameter to a stage from the layer number in its name.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from .errors import CheckpointError


class PartitionError(CheckpointError, ValueError):
    """A tensor cannot be joined or split as asked (sizes do not divide, shards disagree, ...)."""


@dataclass(frozen=True)
class Partition:
    """How a parameter is split over TP ranks (NxD's ``partition_dim`` / ``partition_stride``)."""

    dim: int
    stride: int = 1

    def to_attrs(self) -> dict:
        """NxD's parameter attributes, as our manifest and ``.info.pt`` record them."""
        return {"tensor_model_parallel": True, "partition_dim": self.dim, "partition_stride": self.stride}

    @classmethod
    def from_attrs(cls, meta: Optional[dict]) -> Optional["Partition"]:
        """The partition recorded in ``meta`` (manifest / ``.info.pt`` entry or attributes), or None."""
        if not meta or not meta.get("tensor_model_parallel"):
            return None
        return cls(int(meta.get("partition_dim", 0)), int(meta.get("partition_stride", 1)))

    @classmethod
    def of_param(cls, tensor) -> Optional["Partition"]:
        """The partition of a parameter carrying NxD's attributes, or None."""
        if not getattr(tensor, "tensor_model_parallel", False):
            return None
        return cls(int(getattr(tensor, "partition_dim", 0)), int(getattr(tensor, "partition_stride", 1)))

    def normalised(self, ndim: int, name: str = "tensor") -> "Partition":
        if not -ndim <= self.dim < max(ndim, 1):
            raise PartitionError(f"{name} has {ndim} dims; partition dim {self.dim} is out of range")
        if self.stride < 1:
            raise PartitionError(f"{name}: partition_stride {self.stride} must be >= 1")
        return Partition(self.dim % max(ndim, 1), self.stride)


# --- tensor parallel --------------------------------------------------------------------------------
def merge_tp(shards: Sequence[torch.Tensor], dim: int, stride: int = 1) -> torch.Tensor:
    """The full tensor from its TP shards (rank order). With ``stride`` s > 1 each shard holds s blocks along
    ``dim`` and the full tensor is block k of every rank, for k = 0..s-1 (Megatron's strided split)."""
    if len(shards) == 1:
        return shards[0]
    if stride == 1:
        return torch.cat(list(shards), dim=dim)
    per = shards[0].shape[dim]
    if per % stride:
        raise PartitionError(f"a shard has {per} rows along dim {dim}, not a multiple of partition_stride {stride}")
    blk = per // stride
    return torch.cat([s.narrow(dim, k * blk, blk) for k in range(stride) for s in shards], dim=dim)


def join_tp(shards: Sequence[torch.Tensor], part: Optional[Partition], name: str = "tensor") -> torch.Tensor:
    """The full tensor from its TP shards in rank order. ``part`` None: replicated, taken from rank 0."""
    if part is None or len(shards) == 1:
        return shards[0]
    part = part.normalised(shards[0].dim(), name)
    shapes = {tuple(s.shape) for s in shards}
    if len(shapes) > 1:
        raise PartitionError(f"{name}: TP shards have different shapes {sorted(shapes)}")
    if shards[0].shape[part.dim] % part.stride:
        raise PartitionError(f"{name}: a shard has {shards[0].shape[part.dim]} rows along dim {part.dim}, not a "
                             f"multiple of partition_stride {part.stride}")
    return merge_tp(shards, part.dim, part.stride)


def tp_shard_shape(shape: Sequence[int], part: Optional[Partition], tp: int, name: str = "tensor") -> tuple:
    """Shape of one TP shard of a full tensor of ``shape``; raises when the sizes do not divide."""
    shape = tuple(int(d) for d in shape)
    if part is None or tp == 1:
        return shape
    part = part.normalised(len(shape), name)
    n = shape[part.dim]
    if n % (tp * part.stride):
        raise PartitionError(
            f"{name} has {n} rows along its partition dim {part.dim}, which do not split into TP={tp} x "
            f"partition_stride {part.stride} equal blocks; choose a TP size that divides {n // part.stride or n}")
    return tuple(n // tp if i == part.dim else d for i, d in enumerate(shape))


def split_tp(full: torch.Tensor, part: Optional[Partition], tp: int, rank: int, name: str = "tensor") -> torch.Tensor:
    """TP rank ``rank``'s shard of ``full``: a view of it when the shard is one block (copy it before
    saving: torch.save writes a view's whole storage); replicated tensors as they are."""
    if part is None or tp == 1:
        return full
    tp_shard_shape(full.shape, part, tp, name)
    part = part.normalised(full.dim(), name)
    blk = full.shape[part.dim] // (tp * part.stride)
    blocks = [full.narrow(part.dim, (k * tp + rank) * blk, blk) for k in range(part.stride)]
    return blocks[0] if len(blocks) == 1 else torch.cat(blocks, dim=part.dim)


def tp_block_views(full: torch.Tensor, part: Optional[Partition], tp: int, rank: int,
                   name: str = "tensor") -> List[torch.Tensor]:
    """Views of ``full`` holding TP rank ``rank``'s shard, block by block (one view unless strided): write a
    shard into them to assemble the full tensor in place. A replicated tensor: rank 0 gets the whole
    tensor, the others nothing."""
    if part is None or tp == 1:
        return [full] if rank == 0 else []
    tp_shard_shape(full.shape, part, tp, name)
    part = part.normalised(full.dim(), name)
    blk = full.shape[part.dim] // (tp * part.stride)
    return [full.narrow(part.dim, (k * tp + rank) * blk, blk) for k in range(part.stride)]


def copy_into_blocks(shard: torch.Tensor, blocks: Sequence[torch.Tensor], part: Optional[Partition],
                     name: str = "tensor") -> None:
    """Copy one TP shard into the views ``tp_block_views`` gave (the inverse of ``split_tp``)."""
    if not blocks:
        return
    if len(blocks) == 1:
        if tuple(shard.shape) != tuple(blocks[0].shape):
            raise PartitionError(f"{name}: a TP shard is {tuple(shard.shape)}, expected {tuple(blocks[0].shape)}")
        blocks[0].copy_(shard)
        return
    dim = part.normalised(shard.dim(), name).dim
    per = blocks[0].shape[dim]
    if shard.shape[dim] != per * len(blocks):
        raise PartitionError(f"{name}: a TP shard has {shard.shape[dim]} rows along dim {dim}, expected "
                             f"{per * len(blocks)}")
    for k, b in enumerate(blocks):
        b.copy_(shard.narrow(dim, k * per, per))


def split_tp_all(full: torch.Tensor, part: Optional[Partition], tp: int, name: str = "tensor") -> List[torch.Tensor]:
    return [split_tp(full, part, tp, r, name) for r in range(tp)]


def tp_overlaps(length: int, part: Partition, src_tp: int, src_rank: int, dst_tp: int,
                dst_rank: int) -> List[Tuple[int, int, int]]:
    """Where TP rank ``src_rank`` of ``src_tp`` and rank ``dst_rank`` of ``dst_tp`` share rows of a tensor whose
    full length along ``part.dim`` is ``length``: (offset in the source shard, offset in the destination
    shard, rows) runs, one per stride block at most. Empty: the destination needs nothing from that source."""
    blocks = length // part.stride
    if length % part.stride or blocks % src_tp or blocks % dst_tp:
        raise PartitionError(f"{length} rows along dim {part.dim} do not split into partition_stride {part.stride} "
                             f"x TP={src_tp} (or TP={dst_tp}) equal blocks")
    bs, bd = blocks // src_tp, blocks // dst_tp
    out = []
    for k in range(part.stride):
        a0, b0 = k * blocks + src_rank * bs, k * blocks + dst_rank * bd
        lo, hi = max(a0, b0), min(a0 + bs, b0 + bd)
        if lo < hi:
            out.append((k * bs + lo - a0, k * bd + lo - b0, hi - lo))
    return out


def copy_tp_overlap(dst: torch.Tensor, src: torch.Tensor, part: Partition, src_tp: int, src_rank: int,
                    dst_tp: int, dst_rank: int) -> None:
    """Copy into ``dst`` (TP rank ``dst_rank`` of ``dst_tp``'s shard) the rows it shares with ``src`` (rank
    ``src_rank`` of ``src_tp``): resharding one source shard at a time, without the full tensor."""
    part = part.normalised(src.dim())
    length = src.shape[part.dim] * src_tp
    for so, do, n in tp_overlaps(length, part, src_tp, src_rank, dst_tp, dst_rank):
        dst.narrow(part.dim, do, n).copy_(src.narrow(part.dim, so, n))


# --- expert parallel ---------------------------------------------------------------------------------------
#: The dim of an expert tensor that holds its experts (split over EP in contiguous runs).
EXPERT_DIM = 0
EXPERTS = Partition(EXPERT_DIM)
#: Keys of NxD's expert-parallel ZeRO-1 state dict (NeuronEPZero1Optimizer): where the expert parameters start in
#: ``state``, ``param_groups``, ``base_state`` and ``shape_info``.
EP_OFFSET_KEY = "ep_param_id_offset"
EP_GROUP_OFFSET_KEY = "ep_param_group_offset"
EP_BASE_OFFSET_KEY = "ep_base_state_offset"
EP_SHAPE_OFFSET_KEY = "ep_shape_info_offset"
EP_STATE_KEYS = (EP_OFFSET_KEY, EP_GROUP_OFFSET_KEY, EP_BASE_OFFSET_KEY, EP_SHAPE_OFFSET_KEY)


# --- ZeRO-1 ---------------------------------------------------------------------------------------------
def rows_tail(shape: Sequence[int]) -> Tuple[int, tuple]:
    """(rows, trailing shape) of a tensor as ZeRO-1 sees it: rows along dim 0; a 0-d tensor is one row."""
    shape = tuple(int(d) for d in shape)
    return (shape[0], shape[1:]) if shape else (1, ())


def piece_rows(rows: int, group: int) -> int:
    """Rows of one ZeRO-1 piece of ``rows`` rows over ``group`` ranks (padding included)."""
    return math.ceil(rows / group) if rows else 0


def zero1_piece_shape(shape: Sequence[int], group: int) -> tuple:
    rows, tail = rows_tail(shape)
    return (piece_rows(rows, group), *tail)


def row_segments(shape: Sequence[int], part: Optional[Partition], tp: int, per: int,
                 name: str = "tensor") -> Optional[List[Tuple[int, int, int, int]]]:
    """The full tensor's bytes, in order, as (TP rank, piece, first row in the piece, rows) segments, where each
    TP rank's shard is stored as pieces of ``per`` rows (ZeRO-1 pieces; one piece of the whole shard without
    ZeRO-1): what a sink writes one after the other instead of joining the full tensor. None when that is not
    a sequence of whole-row runs reading each piece once: shards split along a dim other than 0 (their rows
    interleave), or a stride whose blocks cut a piece in two."""
    shape = tuple(int(d) for d in shape)
    rows, _tail = rows_tail(shape)
    if part is None or tp == 1:
        runs = [(0, 0, rows)]
    else:
        tp_shard_shape(shape, part, tp, name)
        part = part.normalised(len(shape), name)
        if part.dim != 0:
            return None
        blk = rows // (tp * part.stride)
        runs = [(r, k * blk, blk) for k in range(part.stride) for r in range(tp)]
    out: List[Tuple[int, int, int, int]] = []
    for r, row, n in runs:
        end = row + n
        while row < end:
            d, off = divmod(row, per)
            take = min(per - off, end - row)
            if out and (out[-1][0], out[-1][1]) == (r, d) and out[-1][2] + out[-1][3] == off:
                out[-1] = (r, d, out[-1][2], out[-1][3] + take)
            else:
                out.append((r, d, off, take))
            row += take
    pieces = [(r, d) for r, d, _o, _n in out]
    return out if len(set(pieces)) == len(pieces) else None


def zero1_shard(full: torch.Tensor, rank: int, group: int) -> torch.Tensor:
    """Piece ``rank`` of ``full`` padded with zeros along dim 0 to a multiple of ``group`` (a new tensor)."""
    rows, tail = rows_tail(full.shape)
    per = piece_rows(rows, group)
    src = full.reshape(rows, *tail)
    a, b = min(rank * per, rows), min((rank + 1) * per, rows)
    out = torch.zeros((per, *tail), dtype=full.dtype)
    out[:b - a].copy_(src[a:b])
    return out


def zero1_shard_all(full: torch.Tensor, group: int) -> List[torch.Tensor]:
    return [zero1_shard(full, r, group) for r in range(group)]


def zero1_unshard(pieces: Sequence[torch.Tensor], shape: Sequence[int], name: str = "tensor") -> torch.Tensor:
    """The (TP-local) tensor of ``shape`` from its ZeRO-1 pieces in DP rank order: concatenated, trimmed."""
    shape = tuple(int(d) for d in shape)
    want = zero1_piece_shape(shape, len(pieces))
    for d, p in enumerate(pieces):
        if tuple(p.shape) != want:
            raise PartitionError(f"{name}: ZeRO-1 piece {d} is {tuple(p.shape)}; a {shape} tensor over "
                                 f"{len(pieces)} DP ranks has pieces of {want}")
    rows = shape[0] if shape else 1
    full = pieces[0] if len(pieces) == 1 else torch.cat(list(pieces), dim=0)
    return full[:rows].reshape(shape)


def assemble_zero1(load: Callable[[int], torch.Tensor], group: int, shape: Sequence[int],
                   out: Optional[torch.Tensor] = None, name: str = "tensor") -> torch.Tensor:
    """The (TP-local) tensor of ``shape`` from its ZeRO-1 pieces ``load(d)``, d = 0..group-1, loaded one at a
    time and copied without their padding into ``out`` (a contiguous tensor of ``shape``; new when None)."""
    shape = tuple(int(d) for d in shape)
    rows, tail = rows_tail(shape)
    want = zero1_piece_shape(shape, group)
    per = want[0]
    flat = None
    for d in range(group):
        piece = load(d)
        if tuple(piece.shape) != want:
            raise PartitionError(f"{name}: ZeRO-1 piece {d} is {tuple(piece.shape)}; a {shape} tensor over {group} DP "
                                 f"ranks has pieces of {want}")
        if flat is None:
            out = torch.empty(shape, dtype=piece.dtype) if out is None else out
            flat = out.view(rows, *tail)
        a, b = min(d * per, rows), min((d + 1) * per, rows)
        flat[a:b].copy_(piece[:b - a])
        del piece
    return out


def make_piece(r: int, load: Callable[[int], torch.Tensor], per_in: int, rows: int, tail: tuple, per_out: int,
               dtype_of: Callable[[], torch.dtype],
               out_buffer: Optional[Callable[[], torch.Tensor]] = None) -> torch.Tensor:
    """Output piece ``r`` ((per_out, *tail) rows ``[r*per_out, (r+1)*per_out)`` of the padded parameter),
    assembled from the input pieces ``load(j)`` (each (per_in, *tail)) that overlap it. ``out_buffer()``
    gives a (per_out, *tail) tensor to assemble it in (else a new one); a piece that is exactly one input
    piece is returned as it is."""
    a, b = r * per_out, (r + 1) * per_out
    end = min(b, rows)
    parts = []
    pos = a
    while pos < end:
        j = pos // per_in
        off = pos - j * per_in
        take = min(per_in - off, end - pos)
        src = load(j)
        parts.append(src if (off == 0 and take == src.shape[0]) else src[off:off + take])
        pos += take
    pad = b - max(a, end)
    if len(parts) == 1 and not pad:
        return parts[0]
    if out_buffer is not None:
        out = out_buffer()
    else:
        out = torch.empty((per_out, *tail), dtype=parts[0].dtype if parts else dtype_of())
    row = 0
    for p in parts:
        out[row:row + p.shape[0]].copy_(p)
        row += p.shape[0]
    if pad:
        out[row:].zero_()
    return out


# --- pipeline stages ------------------------------------------------------------------------------------
_LAYER_RE = re.compile(r"(?:^|\.)(\d+)(?:\.|$)")


def layer_index(name: str) -> Optional[int]:
    """The layer number of a parameter name (the first all-digit component: ``layers.3.mlp`` -> 3)."""
    m = _LAYER_RE.search(name)
    return int(m.group(1)) if m else None


def assign_stages(names: Sequence[str], pp: int) -> Dict[str, int]:
    """Pipeline stage of each name (in model order) for ``pp`` stages, as NxD's pipeline splits a decoder:
    the layers in equal contiguous runs, what comes before the first layer (embeddings) on stage 0, what
    comes after the last (final norm, LM head) on the last stage."""
    if pp == 1:
        return {n: 0 for n in names}
    layers = sorted({i for i in map(layer_index, names) if i is not None})
    if not layers:
        raise PartitionError(f"no parameter name carries a layer number (e.g. 'layers.0.'), so the model cannot be "
                             f"split into PP={pp} stages; use --pp 1")
    nl = layers[-1] + 1
    if nl % pp:
        raise PartitionError(f"the model has {nl} layers, which do not split into PP={pp} equal stages; pass a "
                             f"--pp that divides {nl}")
    per = nl // pp
    out, seen_layer = {}, False
    for n in names:
        i = layer_index(n)
        if i is not None:
            seen_layer = True
            out[n] = i // per
        else:
            out[n] = pp - 1 if seen_layer else 0
    return out


__all__ = ["Partition", "PartitionError", "join_tp", "split_tp", "split_tp_all", "tp_shard_shape", "zero1_shard",
           "zero1_shard_all", "zero1_unshard", "zero1_piece_shape", "rows_tail", "piece_rows", "merge_tp",
           "layer_index", "tp_overlaps", "copy_tp_overlap", "assign_stages", "make_piece", "EXPERT_DIM", "EXPERTS",
           "EP_STATE_KEYS"]
