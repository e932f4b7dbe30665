"""Load-time resharding: read a checkpoint saved at other TP / PP / EP / (ZeRO-1) DP sizes into this job's layout.

Called by loader.read_tag on every rank when the saved sizes differ from the job's and the caller allowed it
(``load_checkpoint(..., reshard=True)``, the default). Each rank builds its own new shard of every tensor:

- model tensors: for each key of the caller's model (its local state dict: a pipeline stage's keys), the
  source stage that holds the key, and of that stage only the source TP shards whose rows overlap this rank's
  new rows, each copied into place and dropped before the next is read (partition.copy_tp_overlap); an expert
  tensor also only the source EP ranks whose experts (dim 0) overlap this rank's;
- ZeRO-1 optimizer state (moments, master weights): per parameter, the source TP-local (and, for an expert,
  EP-local) tensor is rebuilt from its DP (expert-DP) pieces, its overlap copied into this rank's new local
  tensor, which is then cut into this rank's new DP (expert-DP) piece; ``step`` and other non-sharded entries
  are copied;
- a plain optimizer's per-parameter state follows its parameter (resharded like it when it has its shape);
- scheduler and user content are read as they are.

Which optimizer index is which parameter: the saved model shard's parameter keys in order (source) and the
caller's ``model.named_parameters()`` (target), which must be the optimizer's parameters in that order (NxD's
expert-parallel ZeRO-1 numbers the non-expert parameters first, then the experts). The partition of a tensor is
the one recorded in the manifest or ``.info.pt``, else the caller's parameter's NxD attributes
(``tensor_model_parallel`` / ``partition_dim`` / ``partition_stride``); likewise whether it is an expert tensor
(``expert_model_parallel``; NxD marks none at EP=1, so there the caller's model decides).

Only what this rank needs is read: ref pickles (small), the tensor files of an xser shard one at a time, and of a
plain (non-xser) shard the zip records of the tensors it needs (xser.open_lazy through FileReader.plain_lazy,
each record checked by the manifest's per-record CRC32C, or the zip's CRC-32 in an NxD file). Peak host memory is this rank's new shard plus the source tensors in flight (bounded
by ``inflight_bytes``). Nothing is changed here: the result has the shape of loader._read_parts' and is checked and
applied by the caller.
"""
from __future__ import annotations

import logging
import math
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Tuple

import torch

import xser

from . import hostgroups, layout, masters
from .errors import StateMismatchError, TopologyMismatchError
from .fullstate import param_orders
from .manifest import Manifest
from .partition import (EP_BASE_OFFSET_KEY, EP_GROUP_OFFSET_KEY, EP_STATE_KEYS, EXPERT_DIM, EXPERTS, Partition,
                        PartitionError, copy_tp_overlap, make_piece, piece_rows, rows_tail, tp_overlaps, zero1_shard,
                        zero1_unshard)
from .reader import FileReader
from .world import World

log = logging.getLogger("nxd_ckpt")

#: a (source EP rank, source TP rank) -> that source shard's tensor
Load = Callable[[int, int], torch.Tensor]


@dataclass(frozen=True)
class Sizes:
    """The parallel sizes resharding works between (ZeRO-1 ``dp`` is the number of optimizer pieces)."""

    tp: int
    pp: int
    dp: Optional[int]
    ep: int = 1

    def describe(self, with_ep: bool = False) -> str:
        dp = self.dp if self.dp is not None else "?"
        return f"TP={self.tp} PP={self.pp} DP={dp}" + (f" EP={self.ep}" if with_ep else "")


def needs_reshard(saved: dict, world: World, loading_optim: bool) -> bool:
    """True when the checkpoint's TP, PP or EP size, or (loading a ZeRO-1 optimizer) its DP size, differ from
    the job's."""
    topo = world.topology
    if saved.get("tp", 1) != topo.tp or saved.get("pp", 1) != topo.pp or saved.get("ep", 1) != topo.ep:
        return True
    return bool(loading_optim and saved.get("zero1") and saved.get("zero1_shards") not in (None, topo.dp))


def check_reshardable(tag: str, saved: dict, world: World, has_model: bool, loading_optim: bool) -> None:
    """Raise, before anything is read, when this load cannot be resharded."""
    topo = world.topology
    if (saved.get("cp") or 1) != 1 or topo.cp != 1:
        raise TopologyMismatchError(
            f"checkpoint {tag!r} (CP={saved.get('cp') or 1}) cannot be resharded into this job (CP={topo.cp}): "
            "load-time resharding handles TP, PP, EP and DP without context parallelism; relaunch with the saved "
            "sizes")
    if loading_optim and saved.get("zero1_dcp"):
        tp, pp = saved.get("tp", 1), saved.get("pp", 1)
        raise TopologyMismatchError(
            f"checkpoint {tag!r} was saved with use_zero1_dcp at TP={tp} PP={pp} and this job runs at TP={topo.tp} "
            f"PP={topo.pp}: its optimizer (a torch.distributed.checkpoint) loads at any DP size but only at the "
            f"saved TP and PP sizes; relaunch at TP={tp} PP={pp}, or load with optimizer=None (model resharding "
            "still works)")
    if loading_optim and saved.get("zero1") and saved.get("ep", 1) > 1:
        _check_ep_zero1_source(tag, saved)
    if not has_model:
        raise TopologyMismatchError(
            f"checkpoint {tag!r} was saved at other parallel sizes; resharding needs the model (model=, an "
            "nn.Module or a dict of this rank's tensors) to know which keys this rank holds and how they are split")


def _check_ep_zero1_source(tag: str, saved: dict) -> None:
    """An expert-parallel ZeRO-1 state is resharded through NxD's row-major grid (DP rank d holds expert-DP piece
    d // EP of EP rank d % EP), in NxD's file names."""
    if layout.OPTIM_DIR in (saved.get("legacy_ep") or ()):
        raise TopologyMismatchError(
            f"checkpoint {tag!r} holds an expert-parallel ZeRO-1 optimizer in nxd-ckpt's older layout (files named "
            f"by expert-DP and EP rank); convert it to NxD's layout first (`nxd-ckpt convert-zero1 --input_dir "
            f"<dir>/{tag} --output_dir <dir>/<new_tag> --convert_to_sharded --dp_size {saved.get('zero1_shards')}`), "
            "then load that tag, or load with optimizer=None")
    if saved.get("layout") not in (None, "row_major"):
        raise TopologyMismatchError(
            f"checkpoint {tag!r} holds an expert-parallel ZeRO-1 optimizer saved in the {saved['layout']} rank "
            "layout, whose DP ranks do not map to (expert-DP, EP) ranks as the row-major grid's do; relaunch with "
            "the saved sizes, or load with optimizer=None")


# --- source files -----------------------------------------------------------------------------------
class SourceShard:
    """One saved shard file: its ref data (small for xser shards) and its tensors, loaded on demand.
    ``home_of`` (layout.tensor_home / own_home) tells which shard's folder holds a tensor file."""

    def __init__(self, reader: FileReader, relpath: str, home_of=layout.tensor_home,
                 plain: bool = False):
        self.reader, self.relpath, self.home_of = reader, relpath, home_of
        # A plain (non-xser) shard holds its tensors in the one file: opened lazily, each tensor read when needed.
        self.lazy = reader.plain_lazy(relpath) if plain else None
        self.ref = self.lazy.data if self.lazy is not None else reader.load_pickle(relpath)
        metas, _ = reader.tensor_metas(relpath)
        self.meta: Dict[int, dict] = {t: m.to_json() for t, m in metas.items()}

    def load(self, obj) -> torch.Tensor:
        if isinstance(obj, xser.TensorReference):
            home = self.home_of(self.relpath, layout.is_expert(self.meta.get(obj.tid)))
            return self.reader.load_tensor(layout.tensor_path(home, obj.tid))
        if self.lazy is not None:
            return self.reader.lazy_tensor(self.relpath, self.lazy, obj)
        return obj

    def _meta(self, obj, key: Optional[str]) -> Optional[dict]:
        """What the save recorded about ``obj`` (the entry at top-level ``key`` of a plain shard: found by key)."""
        if isinstance(obj, xser.TensorReference):
            return self.meta.get(obj.tid)
        if key is not None and self.meta:
            if not hasattr(self, "_by_key"):
                self._by_key = {m.get("key"): m for m in self.meta.values() if m.get("key")}
            return self._by_key.get(key)
        return None

    def partition(self, obj, key: Optional[str] = None) -> Optional[Partition]:
        m = self._meta(obj, key)
        return Partition.from_attrs(m) if m is not None else Partition.of_param(obj)

    def expert(self, obj, key: Optional[str] = None) -> Optional[bool]:
        """Whether the save marked ``obj`` an expert tensor; None when nothing was recorded for it."""
        m = self._meta(obj, key)
        if m is not None:
            return layout.is_expert(m)
        return True if getattr(obj, "expert_model_parallel", False) else None

    def shape(self, obj) -> tuple:
        if isinstance(obj, xser.TensorReference):
            m = self.meta.get(obj.tid)
            if m is not None:
                return tuple(int(d) for d in m["shape"])
            return tuple(self.load(obj).shape)
        return tuple(obj.shape)


@dataclass
class Source:
    """The saved checkpoint, opened lazily: shard files by (folder, dp, tp, pp, ep)."""

    reader: FileReader
    manifest: Optional[Manifest]
    sizes: Sizes
    workers: int = 1
    inflight_bytes: int = 1 << 30
    from_masters: bool = False     # model weights kept only as ZeRO-1 master weights (NxD's
                                   # avoid_saving_lower_precision_weights)
    legacy_ep: frozenset = frozenset()   # folders in nxd-ckpt's older EP layout (every tensor in its own folder)
    plain: bool = False                  # shards are plain torch.save files (not xser)
    _shards: Dict[tuple, SourceShard] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def shard(self, folder: str, dp: int, tp: int, pp: int, ep: Optional[int] = None) -> SourceShard:
        key = (folder, dp, tp, pp, ep)
        with self._lock:    # reading threads share the (small) ref pickles; each is read once
            return self._open(key)

    def _open(self, key: tuple) -> SourceShard:
        folder, dp, tp, pp, ep = key
        if key not in self._shards:
            rel = f"{folder}/{layout.shard_filename(dp, tp, pp, ep)}"
            if not self.reader.exists(rel):
                raise StateMismatchError(f"checkpoint {self.reader.tag!r} has no {rel}; it is needed to reshard "
                                         f"from {self.sizes.describe(self.sizes.ep > 1)}")
            home_of = layout.own_home if folder in self.legacy_ep else layout.tensor_home
            self._shards[key] = SourceShard(self.reader, rel, home_of, self.plain)
        return self._shards[key]

    def _ep(self, ep: int) -> Optional[int]:
        return ep if self.sizes.ep > 1 else None   # names carry an ep field only under expert parallelism

    def model(self, tp: int, pp: int, ep: int = 0) -> SourceShard:
        return self.shard(layout.MODEL_DIR, 0, tp, pp, self._ep(ep))

    def plain_optim(self, tp: int, pp: int, ep: int = 0) -> SourceShard:
        """A (non-ZeRO) optimizer shard: one per (EP,) TP and PP rank, like the model's."""
        return self.shard(layout.OPTIM_DIR, 0, tp, pp, self._ep(ep))

    def zero1(self, dp: int, tp: int, pp: int) -> SourceShard:
        """ZeRO-1 file of full DP rank ``dp`` (no ep field, as NxD names them)."""
        return self.shard(layout.OPTIM_DIR, dp, tp, pp)

    def zero1_pieces(self, p: int, j: int, e: int) -> List[int]:
        """The DP ranks whose ZeRO-1 files hold the pieces, in order, of parameter ``j`` (stage ``p``) of EP rank
        ``e``: every DP rank, or for an expert parameter of NxD's expert-parallel ZeRO-1 state the expert-DP
        group of EP rank ``e`` (DP rank ``x * EP + e`` holds its piece ``x``, NxD's row-major grid)."""
        ref = self.zero1(0, 0, p).ref
        if EP_BASE_OFFSET_KEY in ref and j >= int(ref[EP_BASE_OFFSET_KEY]) and self.sizes.ep > 1:
            return [x * self.sizes.ep + e for x in range(self.sizes.dp // self.sizes.ep)]
        return list(range(self.sizes.dp))

    def zero1_local(self, p: int, r: int, e: int, path: tuple, key: str) -> torch.Tensor:
        """Saved TP rank r's (EP rank e's, stage p) whole local tensor at ``path`` of the ZeRO-1 state (e.g.
        ``("base_state", j, "exp_avg")``), joined from its DP (expert-DP) pieces."""
        shards = [self.zero1(d, r, p) for d in self.zero1_pieces(p, path[1], e)]
        info = tuple(shards[0].ref["shape_info"][path[1]])
        parts = [sh.load(_get(sh.ref, path)) for sh in shards]
        return zero1_unshard(parts, info, f"{key} {'/'.join(map(str, path))}")

    def stage_of_keys(self) -> Dict[str, int]:
        """key -> the (first) source stage whose model shard holds it."""
        out: Dict[str, int] = {}
        for p in range(self.sizes.pp):
            for k in self.model(0, p).ref:
                out.setdefault(k, p)
        return out

    def is_expert(self, key: str, p: int, target: "Target") -> bool:
        """Whether ``key`` (of stage ``p``) is an expert tensor: as the save recorded it; NxD marks none at EP=1
        (and old files record nothing), so there the caller's parameter decides."""
        first = self.model(0, p)
        recorded = first.expert(first.ref[key], key)
        if recorded or (recorded is not None and self.sizes.ep > 1):
            return bool(recorded)
        return key in target.experts


# --- bounded parallel reads ---------------------------------------------------------------------------
class _Inflight:
    """Bounds the bytes the reading threads hold at once (a job larger than the bound runs alone)."""

    def __init__(self, limit: int):
        self.limit, self.used, self.cond = limit, 0, threading.Condition()

    def run(self, nbytes: int, fn):
        with self.cond:
            self.cond.wait_for(lambda: self.used == 0 or self.used + nbytes <= self.limit)
            self.used += nbytes
        try:
            return fn()
        finally:
            with self.cond:
                self.used -= nbytes
                self.cond.notify_all()


def _run_bounded(jobs: List[Tuple[int, Callable[[], object]]], workers: int, limit: int) -> list:
    """Results of ``fn()`` for each (bytes, fn), in order, run on ``workers`` threads holding at most ``limit``
    bytes of source tensors at once."""
    gate = _Inflight(limit)
    if workers <= 1 or len(jobs) <= 1:
        return [fn() for _, fn in jobs]
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="nxd-reshard") as pool:
        return list(pool.map(lambda job: gate.run(*job), jobs))


def _nbytes(shape, itemsize: int = 4) -> int:
    return math.prod(shape) * itemsize


def _job_bytes(target: "Target", key: str, copies: int) -> int:
    """What resharding ``key`` holds at most: ``copies`` tensors of its new shard's size, at least 4 bytes an
    element (optimizer state and master weights are float32 under a lower-precision model)."""
    return copies * _nbytes(target.shapes[key], max(4, target.itemsizes.get(key, 4)))


# --- targets ----------------------------------------------------------------------------------------
@dataclass
class Target:
    """What this rank's new shard looks like, from the caller's model: keys, shapes, partitions."""

    tp: int
    tp_rank: int
    dp: int
    dp_rank: int
    shapes: Dict[str, tuple]                       # every key of the local state dict
    params: List[str]                              # parameter keys, in optimizer index order
    partitions: Dict[str, Optional[Partition]]     # from the caller's parameters' NxD attributes
    all_params: frozenset                          # parameter keys of every stage (gathered)
    param_ids: List[int]                           # id() of each parameter, to match a torch optimizer's
    ep: int = 1
    ep_rank: int = 0
    edp: int = 1                                   # expert-DP size and rank (the group of an expert's ZeRO-1)
    edp_rank: int = 0
    experts: frozenset = frozenset()               # parameter keys marked expert_model_parallel
    itemsizes: Dict[str, int] = field(default_factory=dict)   # bytes per element of each local tensor


def target_of(model, world: World) -> Target:
    """Every rank (collective: one all-gather of parameter names over the host group)."""
    if isinstance(model, torch.nn.Module):
        sd = model.local_state_dict() if hasattr(model, "local_state_dict") else model.state_dict()
        named = list(model.named_parameters())
    else:
        sd = model
        named = [(k, v) for k, v in model.items() if isinstance(v, torch.Tensor)]
    shapes = {k: tuple(v.shape) for k, v in sd.items() if isinstance(v, torch.Tensor)}
    params = [k for k, _ in named]
    gathered = hostgroups.all_gather_objects(params) if world.distributed else [params]
    topo = world.topology
    c, x = topo.coords(world.rank), topo.expert_coords(world.rank)
    return Target(topo.tp, c.tp, topo.dp, c.dp, shapes, params,
                  {k: Partition.of_param(v) for k, v in named}, frozenset(k for ps in gathered for k in ps),
                  [id(v) for _, v in named], topo.ep, x.ep, topo.edp, x.edp,
                  frozenset(k for k, v in named if getattr(v, "expert_model_parallel", False)),
                  {k: v.element_size() for k, v in sd.items() if isinstance(v, torch.Tensor)})


# --- one tensor -------------------------------------------------------------------------------------
def _partition_of(key: str, recorded: Optional[Partition], target: Target) -> Optional[Partition]:
    return recorded if recorded is not None else target.partitions.get(key)


def _new_shape(key: str, src_shape: tuple, part: Optional[Partition], src: Sizes, target: Target,
               expert: bool) -> tuple:
    """The shape of this rank's new shard of a tensor whose saved shards are ``src_shape``."""
    shape = list(src_shape)
    if expert:
        if not shape:
            raise StateMismatchError(f"{key} is marked an expert tensor but is 0-d; expert tensors hold their "
                                     "experts along dim 0")
        experts = shape[EXPERT_DIM] * src.ep
        if experts % target.ep:
            raise StateMismatchError(f"{key}: its {experts} experts (dim {EXPERT_DIM}) do not split into EP="
                                     f"{target.ep} equal runs; choose an EP size that divides {experts}")
        shape[EXPERT_DIM] = experts // target.ep
    if part is not None:
        length = shape[part.dim] * src.tp
        if length % (target.tp * part.stride):
            return ()
        shape[part.dim] = length // target.tp
    return tuple(shape)


def reshard_tensor(key: str, src_shape: tuple, part: Optional[Partition], dst_shape: tuple, src: Sizes, load: Load,
                   target: Target, expert: bool = False) -> torch.Tensor:
    """This rank's new shard of ``key``, from the source shards ``load(e, r)`` (EP rank e, TP rank r) that overlap
    it, each read, copied and dropped in turn. A tensor without a partition is replicated over TP (read from TP
    rank 0); a non-expert one is the same on every EP rank (read from EP rank 0)."""
    if part is None and not expert:
        if src_shape != dst_shape:
            raise _NoPartition(f"{key} (saved TP shard {src_shape}, this rank's {dst_shape})")
        return load(0, 0)
    if part is not None:
        part = part.normalised(len(src_shape), key)
        if expert and part.dim == EXPERT_DIM:
            raise StateMismatchError(f"{key} is an expert tensor split over TP along dim {EXPERT_DIM}, which holds "
                                     "its experts; NxD's expert layers split TP along another dim")
    want = _new_shape(key, src_shape, part, src, target, expert)
    if want != dst_shape:
        if part is None:
            raise _NoPartition(f"{key} (saved shard {src_shape}, this rank's {dst_shape})")
        length = src_shape[part.dim] * src.tp
        raise StateMismatchError(
            f"{key}: the saved tensor ({length} rows along partition dim {part.dim}, stride {part.stride}"
            f"{f', {src.ep} EP ranks' if expert else ''}) splits into TP={target.tp}{f' x EP={target.ep}' if expert else ''} "
            f"shards of {want or 'unequal sizes'}, but this rank's tensor is {dst_shape}; build the model with the "
            "saved sizes (hidden, heads, vocab, experts) at the new TP/EP degrees")
    return _assemble(src_shape, part, dst_shape, src, load, target, expert)


def _assemble(src_shape: tuple, part: Optional[Partition], dst_shape: tuple, src: Sizes, load: Load,
              target: Target, expert: bool) -> torch.Tensor:
    """Copy the overlap of every source shard (e, r) with this rank's new shard into it."""
    if expert:
        experts = src_shape[EXPERT_DIM] * src.ep
        runs = {e: tp_overlaps(experts, EXPERTS, src.ep, e, target.ep, target.ep_rank) for e in range(src.ep)}
    else:
        runs = {0: [None]}
    if part is not None:
        length = src_shape[part.dim] * src.tp
        tps = [r for r in range(src.tp) if tp_overlaps(length, part, src.tp, r, target.tp, target.tp_rank)]
    else:
        tps = [0]
    sources = [(e, r) for e, rs in runs.items() if rs for r in tps]
    out: Optional[torch.Tensor] = None
    for e, r in sources:
        piece = load(e, r)
        if len(sources) == 1 and tuple(piece.shape) == tuple(dst_shape):
            return piece        # this rank's new shard is exactly one saved shard
        if out is None:
            out = torch.empty(dst_shape, dtype=piece.dtype)
        for run in runs[e]:
            dst = out if run is None else out.narrow(EXPERT_DIM, run[1], run[2])
            s = piece if run is None else piece.narrow(EXPERT_DIM, run[0], run[2])
            if part is None:
                dst.copy_(s)
            else:
                copy_tp_overlap(dst, s, part, src.tp, r, target.tp, target.tp_rank)
        del piece
    return out


class _NoPartition(StateMismatchError):
    """A tensor whose shape changes with TP has no partition attributes, recorded or on the parameter."""


# --- model ------------------------------------------------------------------------------------------
def read_model(src: Source, target: Target, index: Dict[str, Tuple[int, int]]) -> dict:
    """This rank's new model state dict (the caller's keys that the checkpoint has). Every key that lacks
    partition information is named in one error. When the saved model data lies in the ZeRO-1 master weights,
    parameters are resharded from those (``index``: key -> (stage, ZeRO-1 index))."""
    stage_of = src.stage_of_keys()
    unsplit: List[str] = []

    def one(key: str, p: int):
        first = src.model(0, p)
        obj = first.ref[key]
        part = _partition_of(key, first.partition(obj, key), target)
        expert = src.is_expert(key, p, target)
        if src.from_masters and key in index:
            j = _recorded_index(first, obj, index[key][1])
            load = lambda e, r: src.zero1_local(p, r, e, ("sharded_master_weights", j), key)   # noqa: E731
        else:
            load = lambda e, r: _model_tensor(src, key, p, e if expert else 0, r)   # noqa: E731
        try:
            return reshard_tensor(key, first.shape(obj), part, target.shapes[key], src.sizes, load, target, expert)
        except _NoPartition as exc:
            unsplit.append(str(exc))
            return None

    keys = [k for k in target.shapes if k in stage_of]   # others: check_model reports missing keys (strict)
    jobs = [(_job_bytes(target, k, 2), lambda k=k: one(k, stage_of[k])) for k in keys]
    out = {k: v for k, v in zip(keys, _run_bounded(jobs, src.workers, src.inflight_bytes)) if v is not None}
    if unsplit:
        raise StateMismatchError(
            f"checkpoint {src.reader.tag!r} was saved at TP={src.sizes.tp} and records no partition dims for "
            f"{len(unsplit)} tensor(s) whose shape differs at TP={target.tp}, and the model's parameters do not "
            f"say how they are split either: {'; '.join(unsplit[:10])}. Set NxD's attributes on those parameters "
            "(tensor_model_parallel=True, partition_dim, partition_stride; NxD's parallel layers do; "
            "expert_model_parallel=True on expert weights), or load at the saved TP size")
    return out


def _model_tensor(src: Source, key: str, p: int, e: int, r: int) -> torch.Tensor:
    shard = src.model(r, p, e)
    return shard.load(shard.ref[key])


def _recorded_index(shard: SourceShard, obj, default: int) -> int:
    """The ZeRO-1 index the save recorded for a model tensor whose data lies in the master weights."""
    if isinstance(obj, xser.TensorReference):
        m = shard.meta.get(obj.tid) or {}
        if masters.INDEX_META in m:
            return int(m[masters.INDEX_META])
    return default


def _param_index(src: Source, target: Target, zero1: bool) -> Dict[str, Tuple[int, int]]:
    """key -> (source stage, optimizer index in that stage). A stage's parameters are its model keys that are
    parameters (of any stage of the caller's model), numbered as the saved optimizer numbers them: the names a
    converter recorded, the model's order (one param group) or NxD's weight-decay split (fullstate.param_orders),
    checked against the ZeRO-1 ``shape_info``; in NxD's expert-parallel ZeRO-1 state the non-expert parameters
    so, then the experts from ``ep_base_state_offset`` on."""
    out = {}
    for p in range(src.sizes.pp):
        first = src.model(0, p)
        keys = [k for k in first.ref if k in target.all_params]
        osd = src.zero1(0, 0, p) if zero1 else src.plain_optim(0, 0, p)
        sizes = [len(g["params"]) for g in osd.ref.get("param_groups", [])] or [len(keys)]
        infos = osd.ref["shape_info"] if zero1 else None
        recorded = ((src.manifest.extra if src.manifest is not None else {}).get("optim_params") or {}).get(osd.relpath)
        if zero1 and EP_BASE_OFFSET_KEY in osd.ref:
            base, goff = int(osd.ref[EP_BASE_OFFSET_KEY]), int(osd.ref[EP_GROUP_OFFSET_KEY])
            experts = [k for k in keys if src.is_expert(k, p, target)]
            parts = [([k for k in keys if k not in experts], sizes[:goff], 0, base, None),
                     (experts, sizes[goff:], base, math.inf, None)]
        else:
            parts = [(keys, sizes, 0, math.inf, recorded)]
        for ks, szs, lo, hi, names in parts:
            idx = sorted(i for i in infos if lo <= i < hi) if zero1 else list(range(sum(szs)))
            out.update((k, (p, j)) for k, j in _number(osd, first, ks, szs, idx, names, zero1).items())
    return out


def _number(osd: SourceShard, first: SourceShard, keys: List[str], sizes: List[int], idx: List[int],
            recorded: Optional[List[str]], zero1: bool) -> Dict[str, int]:
    """key -> optimizer index ``idx[n]`` of the n-th parameter in the one candidate order that fits."""
    if not keys and not idx:
        return {}
    order = _first_fitting(param_orders(keys, sizes, len(idx), recorded),
                           lambda n, k: not zero1 or tuple(osd.ref["shape_info"][idx[n]]) == first.shape(first.ref[k]))
    if order is None:
        raise StateMismatchError(
            f"{osd.relpath} holds the state of {len(idx)} parameters in param groups of sizes {sizes}, which matches "
            f"neither the {len(keys)} parameters of its model shard in order nor NxD's weight-decay grouping: the "
            "optimizer state cannot be mapped to parameters to reshard it; load the model alone (optimizer=None)")
    return {k: idx[n] for n, k in enumerate(order)}


def _first_fitting(candidates: List[List[str]], fits: Callable[[int, str], bool]) -> Optional[List[str]]:
    return next((c for c in candidates if all(fits(i, k) for i, k in enumerate(c))), None)


# --- optimizer ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Slot:
    """One parameter of the new optimizer: its index (``state`` / ``base_state`` key), model key, and whether its
    ZeRO-1 pieces are cut over expert-DP (an expert of NxD's expert-parallel ZeRO-1 optimizer) rather than DP."""

    index: int
    key: str
    edp: bool = False


def read_optimizer(src: Source, target: Target, index: Dict[str, Tuple[int, int]], zero1: bool, optimizer) -> dict:
    slots, ep_keys = _target_slots(optimizer, target, zero1)
    missing = [s.key for s in slots if s.key not in index]
    if missing:
        raise StateMismatchError(f"the checkpoint has no optimizer state for parameters {missing[:5]}: they are not "
                                 "in its model shards; load the optimizer of a checkpoint saved from this model")
    groups = _param_groups(src.zero1(0, 0, 0) if zero1 else src.plain_optim(0, 0, 0), optimizer)
    if zero1:
        return _read_zero1(src, target, index, groups, slots, ep_keys)
    return _read_plain(src, target, index, groups, slots)


def _target_slots(optimizer, target: Target, zero1: bool) -> Tuple[List[Slot], dict]:
    """The new optimizer's parameters (by identity of a torch optimizer's; else the model's parameter order or
    NxD's weight-decay split, whichever fits its ZeRO-1 ``shape_info``; for NxD's expert-parallel ZeRO-1, the
    non-expert parameters so, then the experts from ``ep_base_state_offset`` on), and that optimizer's
    ``ep_*_offset`` entries (empty when it has none)."""
    if isinstance(optimizer, torch.optim.Optimizer):
        name_of = dict(zip(target.param_ids, target.params))
        ids = [id(q) for g in optimizer.param_groups for q in g["params"]]
        if not all(i in name_of for i in ids):
            raise StateMismatchError("the optimizer holds parameters that are not the model's; resharding maps "
                                     "optimizer state to the model's parameters: build it over model.parameters()")
        return [Slot(i, name_of[q]) for i, q in enumerate(ids)], {}
    sd = optimizer if isinstance(optimizer, dict) else optimizer.state_dict()
    sizes = [len(g["params"]) for g in sd.get("param_groups", [])] if isinstance(sd, dict) else []
    if not sizes:
        return [Slot(i, k) for i, k in enumerate(target.params)], {}
    shapes = sd.get("shape_info") if zero1 else None
    if shapes is not None and EP_BASE_OFFSET_KEY in sd:
        base, goff = int(sd[EP_BASE_OFFSET_KEY]), int(sd[EP_GROUP_OFFSET_KEY])
        others = [k for k in target.params if k not in target.experts]
        experts = [k for k in target.params if k in target.experts]
        slots = (_slots(others, sizes[:goff], sorted(i for i in shapes if i < base), shapes, target, False)
                 + _slots(experts, sizes[goff:], sorted(i for i in shapes if i >= base), shapes, target, True))
        return slots, {k: sd[k] for k in EP_STATE_KEYS if k in sd}
    idx = sorted(shapes) if shapes is not None else list(range(sum(sizes)))
    return _slots(target.params, sizes, idx, shapes, target, False), {}


def _slots(keys: List[str], sizes: List[int], idx: List[int], shapes, target: Target, edp: bool) -> List[Slot]:
    if not keys and not idx:
        return []
    order = _first_fitting(param_orders(keys, sizes, len(idx)),
                           lambda n, k: shapes is None or tuple(shapes[idx[n]]) == target.shapes[k])
    if order is None:
        raise StateMismatchError(
            f"the optimizer's {len(idx)} {'expert ' if edp else ''}parameters (param groups of sizes {sizes}) are not "
            f"the model's {'expert ' if edp else ''}parameters in named_parameters() order nor in NxD's weight-decay "
            "grouping; resharding maps optimizer state to parameters by that order: build the optimizer over "
            "model.parameters()")
    return [Slot(idx[n], k, edp) for n, k in enumerate(order)]


def _param_groups(first: SourceShard, optimizer) -> List[dict]:
    """The optimizer's own param_groups (its ``params`` lists) with the saved hyperparameters."""
    saved = first.ref.get("param_groups", [])
    sd = optimizer.state_dict() if hasattr(optimizer, "state_dict") else optimizer
    mine = sd.get("param_groups", saved)
    pick = _group_map(len(saved), first.ref.get(EP_GROUP_OFFSET_KEY), len(mine), sd.get(EP_GROUP_OFFSET_KEY))
    return [dict(saved[pick(t)], params=list(m["params"])) for t, m in enumerate(mine)]


def _group_map(n_saved: int, saved_off, n_mine: int, mine_off) -> Callable[[int], int]:
    """Which saved param group's hyperparameters each of this optimizer's groups takes: the one at its position;
    between NxD's expert-parallel ZeRO-1 (the non-expert groups, then the same groups for the experts) and an
    optimizer without experts, the non-expert group at that position."""
    if n_saved == n_mine and (saved_off is None) == (mine_off is None):
        return lambda t: t
    if saved_off is not None and mine_off is None and int(saved_off) == n_mine:
        return lambda t: t
    if mine_off is not None and saved_off is None and int(mine_off) == n_saved and n_mine == 2 * n_saved:
        return lambda t: t % n_saved
    raise StateMismatchError(f"the checkpoint's optimizer has {n_saved} param groups, this optimizer {n_mine}; "
                             "build it with the same groups")


def _read_zero1(src: Source, target: Target, index, groups, slots: List[Slot], ep_keys: dict) -> dict:
    has_masters = "sharded_master_weights" in src.zero1(0, 0, 0).ref
    jobs = [(_job_bytes(target, s.key, 4), lambda s=s: _zero1_param(src, target, index, s, has_masters))
            for s in slots]
    base, shapes, masters_ = {}, {}, {}
    for s, (entry, shape, master) in zip(slots, _run_bounded(jobs, src.workers, src.inflight_bytes)):
        base[s.index], shapes[s.index] = entry, shape
        if has_masters:
            masters_[s.index] = master
    out = dict(ep_keys, state={}, param_groups=groups, base_state=base, shape_info=shapes)
    if has_masters:
        out["sharded_master_weights"] = masters_
    return out


def _zero1_param(src: Source, target: Target, index, slot: Slot, has_masters: bool):
    """(base_state entry, shape_info, master piece or None) of this rank's new ZeRO-1 piece of one parameter."""
    key = slot.key
    p, j = index[key]
    first = src.model(0, p)
    part = _partition_of(key, first.partition(first.ref[key], key), target)
    expert = src.is_expert(key, p, target)
    dst_shape = target.shapes[key]
    opt0 = src.zero1(0, 0, p)
    info0 = tuple(opt0.ref["shape_info"][j])
    group, rank = (target.edp, target.edp_rank) if slot.edp else (target.dp, target.dp_rank)

    def piece(path):
        if src.sizes.tp == target.tp and (not expert or src.sizes.ep == target.ep):
            # only DP changes: read just the saved pieces holding this rank's rows
            return _repiece(src, p, target.tp_rank, target.ep_rank if expert else 0, path, group, rank)
        full = reshard_tensor(key, info0, part, dst_shape, src.sizes,
                              lambda e, r: src.zero1_local(p, r, e, path, key), target, expert)
        return zero1_shard(full, rank, group)

    entry = {}
    for name, v in opt0.ref["base_state"][j].items():
        if name == "step" or not isinstance(v, (torch.Tensor, xser.TensorReference)):
            entry[name] = opt0.load(v) if name == "step" else v
        else:
            entry[name] = piece(("base_state", j, name))
    master = piece(("sharded_master_weights", j)) if has_masters else None
    return entry, torch.Size(dst_shape), master


def _repiece(src: Source, p: int, r: int, e: int, path: tuple, group: int, rank: int) -> torch.Tensor:
    """Piece ``rank`` of ``group`` of TP rank r's (EP rank e's) local tensor, from the saved pieces that overlap
    its rows."""
    shards = [src.zero1(d, r, p) for d in src.zero1_pieces(p, path[1], e)]
    rows, tail = rows_tail(shards[0].ref["shape_info"][path[1]])
    out = make_piece(rank, lambda d: shards[d].load(_get(shards[d].ref, path)),
                     piece_rows(rows, len(shards)), rows, tail, piece_rows(rows, group),
                     lambda: shards[0].load(_get(shards[0].ref, path)).dtype)
    return out.clone() if out.dim() and out.untyped_storage().nbytes() > out.nbytes else out


def _get(obj, path):
    for k in path:
        obj = obj[k]
    return obj


def _read_plain(src: Source, target: Target, index, groups, slots: List[Slot]) -> dict:
    state = {}
    for s in slots:
        p, j = index[s.key]
        saved = src.plain_optim(0, 0, p).ref.get("state", {}).get(j)
        if saved is not None:       # else: no state yet for this parameter (never stepped)
            state[s.index] = {name: _plain_entry(src, target, s.key, p, j, name, v) for name, v in saved.items()}
    return {"state": state, "param_groups": groups}


def _plain_entry(src: Source, target: Target, key: str, p: int, j: int, name: str, v):
    """One entry of a plain optimizer's state of parameter ``key``: resharded like the parameter when it has the
    parameter's shape (moments), else copied (``step``)."""
    first, opt0 = src.model(0, p), src.plain_optim(0, 0, p)
    src_shape = first.shape(first.ref[key])
    if not (isinstance(v, (torch.Tensor, xser.TensorReference)) and src_shape and opt0.shape(v) == src_shape):
        return opt0.load(v)
    part = _partition_of(key, first.partition(first.ref[key], key), target)
    expert = src.is_expert(key, p, target)

    def load(e: int, r: int) -> torch.Tensor:
        shard = src.plain_optim(r, p, e if expert else 0)
        return shard.load(shard.ref["state"][j][name])

    return reshard_tensor(key, src_shape, part, target.shapes[key], src.sizes, load, target, expert)


# --- entry point ------------------------------------------------------------------------------------
def saved_sizes(saved: dict) -> Sizes:
    return Sizes(int(saved.get("tp", 1)), int(saved.get("pp", 1)), saved.get("zero1_shards") or saved.get("dp"),
                 int(saved.get("ep") or 1))


def read_resharded(reader: FileReader, manifest: Optional[Manifest], saved: dict, target: Target, *, want_model: bool,
                   optimizer=None, num_workers: int = 8, inflight_bytes: int = 1 << 30) -> dict:
    """This rank's model state dict ("model") and optimizer state ("optim", when ``optimizer`` is given) at the
    job's sizes, from a checkpoint saved at ``saved``'s sizes. No collectives (``target`` was gathered by the
    caller); raises StateMismatchError naming the keys that cannot be resharded. ``num_workers`` threads
    read and reshard tensors at once, holding at most ``inflight_bytes`` of them (beyond the new shard)."""
    src = Source(reader, manifest, saved_sizes(saved), max(1, num_workers), inflight_bytes,
                 bool(saved.get("from_masters")), frozenset(saved.get("legacy_ep") or ()), not saved.get("xser"))
    out: Dict[str, object] = {}
    zero1 = bool(saved.get("zero1")) and not saved.get("zero1_dcp")   # a DCP optimizer is refused up front
    if (zero1 or src.from_masters) and not src.sizes.dp:
        raise StateMismatchError(f"checkpoint {reader.tag!r}: the number of ZeRO-1 optimizer shards is unknown")
    try:
        index = _param_index(src, target, zero1) if optimizer is not None or src.from_masters else {}
        if want_model:
            out["model"] = read_model(src, target, index)
        if optimizer is not None:
            out["optim"] = read_optimizer(src, target, index, zero1, optimizer)
    except PartitionError as exc:
        raise StateMismatchError(f"checkpoint {reader.tag!r} cannot be resharded: {exc}") from None
    return out


def log_resharding(saved: dict, world: World) -> None:
    if world.is_root:
        topo = world.topology
        sizes = saved_sizes(saved)
        ep = sizes.ep > 1 or topo.ep > 1
        log.info("nxd_ckpt: resharding %s -> TP=%d PP=%d DP=%d%s", sizes.describe(ep), topo.tp, topo.pp, topo.dp,
                 f" EP={topo.ep}" if ep else "")
