"""Load-time resharding: read a checkpoint saved at other TP / PP / (ZeRO-1) DP sizes into this job's layout.

Called by loader.read_tag on every rank when the saved sizes differ from the job's and the caller allowed it
(``load_checkpoint(..., reshard=True)``, the default). Each rank builds its own new shard of every tensor:

- model tensors: for each key of the caller's model (its local state dict: a pipeline stage's keys), the
  source stage that holds the key, and of that stage only the source TP shards whose rows overlap this rank's
  new rows, each copied into place and dropped before the next is read (partition.copy_tp_overlap);
- ZeRO-1 optimizer state (moments, master weights): per parameter, the source TP-local tensor is rebuilt from
  its DP pieces, its overlap copied into this rank's new TP-local tensor, which is then cut into this rank's
  new DP piece; ``step`` and other non-sharded entries are copied;
- a plain optimizer's per-parameter state follows its parameter (resharded like it when it has its shape);
- scheduler and user content are read as they are.

Which optimizer index is which parameter: the saved model shard's parameter keys in order (source) and the
caller's ``model.named_parameters()`` (target), which must be the optimizer's parameters in that order. The
partition of a tensor is the one recorded in the manifest or ``.info.pt``, else the caller's parameter's NxD
attributes (``tensor_model_parallel`` / ``partition_dim`` / ``partition_stride``).

Only files this rank needs are read (a ref pickle is small; tensor files are read one at a time), so peak host
memory is about this rank's new shard plus the source tensors of one parameter. Nothing is changed here: the
result has the shape of loader._read_parts' and is checked and applied by the caller.
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
from .partition import (Partition, PartitionError, copy_tp_overlap, make_piece, piece_rows, rows_tail,
                        tp_overlaps, zero1_shard, zero1_unshard)
from .reader import FileReader
from .world import World

log = logging.getLogger("nxd_ckpt")


@dataclass(frozen=True)
class Sizes:
    """The parallel sizes resharding works between (ZeRO-1 ``dp`` is the number of optimizer pieces)."""

    tp: int
    pp: int
    dp: Optional[int]

    def describe(self) -> str:
        return f"TP={self.tp} PP={self.pp} DP={self.dp if self.dp is not None else '?'}"


def needs_reshard(saved: dict, world: World, loading_optim: bool) -> bool:
    """True when the checkpoint's TP or PP size, or (loading a ZeRO-1 optimizer) its DP size, differ from the
    job's. EP must match (checked by loader.check_topology)."""
    topo = world.topology
    if saved.get("tp", 1) != topo.tp or saved.get("pp", 1) != topo.pp:
        return True
    return bool(loading_optim and saved.get("zero1") and saved.get("zero1_shards") not in (None, topo.dp))


def check_reshardable(tag: str, saved: dict, world: World, has_model: bool, loading_optim: bool) -> None:
    """Raise, before anything is read, when this load cannot be resharded."""
    topo = world.topology
    if saved.get("ep", 1) != 1 or topo.ep != 1 or topo.cp != 1:
        raise TopologyMismatchError(
            f"checkpoint {tag!r} (EP={saved.get('ep', 1)}) cannot be resharded into this job (EP={topo.ep}, "
            f"CP={topo.cp}): load-time resharding handles TP, PP and DP with EP=1 and CP=1; relaunch with the saved "
            "sizes")
    if loading_optim and saved.get("zero1_dcp"):
        tp, pp = saved.get("tp", 1), saved.get("pp", 1)
        raise TopologyMismatchError(
            f"checkpoint {tag!r} was saved with use_zero1_dcp at TP={tp} PP={pp} and this job runs at TP={topo.tp} "
            f"PP={topo.pp}: its optimizer (a torch.distributed.checkpoint) loads at any DP size but only at the "
            f"saved TP and PP sizes; relaunch at TP={tp} PP={pp}, or load with optimizer=None (model resharding "
            "still works)")
    if not has_model:
        raise TopologyMismatchError(
            f"checkpoint {tag!r} was saved at other parallel sizes; resharding needs the model (model=, an "
            "nn.Module or a dict of this rank's tensors) to know which keys this rank holds and how they are split")


# --- source files -----------------------------------------------------------------------------------
class SourceShard:
    """One saved shard file: its ref data (small for xser shards) and its tensors, loaded on demand."""

    def __init__(self, reader: FileReader, relpath: str, manifest: Optional[Manifest]):
        self.reader, self.relpath = reader, relpath
        self.ref = reader.load_pickle(relpath)
        meta = manifest.tensors.get(relpath) if manifest is not None else None
        # the same shape as an .info.pt entry
        self.meta: Dict[int, dict] = {int(t): m.to_json() for t, m in meta.items()} if meta else {}
        if not self.meta and reader.exists(layout.info_path(relpath)):
            self.meta = {int(t): dict(m) for t, m in reader.load_pickle(layout.info_path(relpath)).items()}

    def load(self, obj) -> torch.Tensor:
        if isinstance(obj, xser.TensorReference):
            return self.reader.load_tensor(layout.tensor_path(self.relpath, obj.tid))
        return obj

    def partition(self, obj) -> Optional[Partition]:
        if isinstance(obj, xser.TensorReference):
            return Partition.from_attrs(self.meta.get(obj.tid))
        return Partition.of_param(obj)

    def shape(self, obj) -> tuple:
        if isinstance(obj, xser.TensorReference):
            m = self.meta.get(obj.tid)
            if m is not None:
                return tuple(int(d) for d in m["shape"])
            return tuple(self.load(obj).shape)
        return tuple(obj.shape)


@dataclass
class Source:
    """The saved checkpoint, opened lazily: shard files by (folder, dp, tp, pp)."""

    reader: FileReader
    manifest: Optional[Manifest]
    sizes: Sizes
    workers: int = 1
    inflight_bytes: int = 1 << 30
    from_masters: bool = False     # model weights kept only as ZeRO-1 master weights (NxD's
                                   # avoid_saving_lower_precision_weights)
    _shards: Dict[tuple, SourceShard] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def shard(self, folder: str, dp: int, tp: int, pp: int) -> SourceShard:
        key = (folder, dp, tp, pp)
        with self._lock:    # reading threads share the (small) ref pickles; each is read once
            return self._open(key)

    def _open(self, key: tuple) -> SourceShard:
        folder, dp, tp, pp = key
        if key not in self._shards:
            rel = f"{folder}/{layout.shard_filename(dp, tp, pp)}"
            if not self.reader.exists(rel):
                raise StateMismatchError(f"checkpoint {self.reader.tag!r} has no {rel}; it is needed to reshard "
                                         f"from {self.sizes.describe()}")
            self._shards[key] = SourceShard(self.reader, rel, self.manifest)
        return self._shards[key]

    def model(self, tp: int, pp: int) -> SourceShard:
        return self.shard(layout.MODEL_DIR, 0, tp, pp)

    def zero1_local(self, p: int, r: int, path: tuple, key: str) -> torch.Tensor:
        """Saved TP rank r's (stage p) whole TP-local tensor at ``path`` of the ZeRO-1 state (e.g.
        ``("base_state", j, "exp_avg")``), joined from its DP pieces."""
        shards = [self.shard(layout.OPTIM_DIR, d, r, p) for d in range(self.sizes.dp)]
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
    c = world.topology.coords(world.rank)
    return Target(world.topology.tp, c.tp, world.topology.dp, c.dp, shapes, params,
                  {k: Partition.of_param(v) for k, v in named}, frozenset(k for ps in gathered for k in ps),
                  [id(v) for _, v in named])


# --- one tensor -------------------------------------------------------------------------------------
def _partition_of(key: str, recorded: Optional[Partition], target: Target) -> Optional[Partition]:
    return recorded if recorded is not None else target.partitions.get(key)


def reshard_tensor(key: str, src_shape: tuple, part: Optional[Partition], dst_shape: tuple, src_tp: int,
                   load: Callable[[int], torch.Tensor], target: Target) -> torch.Tensor:
    """This rank's new TP shard of ``key``, from the source TP shards ``load(r)`` that overlap it (each read,
    copied and dropped in turn). A tensor without a partition is replicated: read from source rank 0."""
    if part is None:
        if src_shape != dst_shape:
            raise _NoPartition(f"{key} (saved TP shard {src_shape}, this rank's {dst_shape})")
        return load(0)
    part = part.normalised(len(src_shape), key)
    length = src_shape[part.dim] * src_tp
    want = tuple(length // target.tp if i == part.dim else d for i, d in enumerate(src_shape))
    if length % (target.tp * part.stride) or want != dst_shape:
        raise StateMismatchError(
            f"{key}: the saved tensor ({length} rows along partition dim {part.dim}, stride {part.stride}) splits "
            f"into TP={target.tp} shards of {want}, but this rank's tensor is {dst_shape}; build the model with "
            "the saved sizes (hidden, heads, vocab) at the new TP degree")
    out: Optional[torch.Tensor] = None
    for r in range(src_tp):
        if not tp_overlaps(length, part, src_tp, r, target.tp, target.tp_rank):
            continue
        piece = load(r)
        if out is None:
            out = torch.empty(dst_shape, dtype=piece.dtype)
        copy_tp_overlap(out, piece, part, src_tp, r, target.tp, target.tp_rank)
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
        part = _partition_of(key, first.partition(obj), target)
        if src.from_masters and key in index:
            j = _recorded_index(first, obj, index[key][1])
            load = lambda r: src.zero1_local(p, r, ("sharded_master_weights", j), key)   # noqa: E731
        else:
            load = lambda r: src.model(r, p).load(src.model(r, p).ref[key])   # noqa: E731
        try:
            return reshard_tensor(key, first.shape(obj), part, target.shapes[key], src.sizes.tp, load, target)
        except _NoPartition as exc:
            unsplit.append(str(exc))
            return None

    keys = [k for k in target.shapes if k in stage_of]   # others: check_model reports missing keys (strict)
    jobs = [(2 * _nbytes(target.shapes[k]), lambda k=k: one(k, stage_of[k])) for k in keys]
    out = {k: v for k, v in zip(keys, _run_bounded(jobs, src.workers, src.inflight_bytes)) if v is not None}
    if unsplit:
        raise StateMismatchError(
            f"checkpoint {src.reader.tag!r} was saved at TP={src.sizes.tp} and records no partition dims for "
            f"{len(unsplit)} tensor(s) whose shape differs at TP={target.tp}, and the model's parameters do not "
            f"say how they are split either: {'; '.join(unsplit[:10])}. Set NxD's attributes on those parameters "
            "(tensor_model_parallel=True, partition_dim, partition_stride; NxD's parallel layers do), or load at "
            "the saved TP size")
    return out


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
    checked against the ZeRO-1 ``shape_info``."""
    out = {}
    for p in range(src.sizes.pp):
        first = src.model(0, p)
        keys = [k for k in first.ref if k in target.all_params]
        osd = src.shard(layout.OPTIM_DIR, 0, 0, p)
        sizes = [len(g["params"]) for g in osd.ref.get("param_groups", [])] or [len(keys)]
        count = len(osd.ref["shape_info"]) if zero1 else sum(sizes)
        recorded = ((src.manifest.extra if src.manifest is not None else {}).get("optim_params") or {}).get(osd.relpath)
        order = _first_fitting(param_orders(keys, sizes, count, recorded),
                               lambda i, k: not zero1 or tuple(osd.ref["shape_info"][i]) == first.shape(first.ref[k]))
        if order is None:
            raise StateMismatchError(
                f"{osd.relpath} holds the state of {count} parameters in param groups of sizes {sizes}, which matches "
                f"neither the {len(keys)} parameters of its model shard in order nor NxD's weight-decay grouping: the "
                "optimizer state cannot be mapped to parameters to reshard it; load the model alone (optimizer=None)")
        out.update((k, (p, j)) for j, k in enumerate(order))
    return out


def _first_fitting(candidates: List[List[str]], fits: Callable[[int, str], bool]) -> Optional[List[str]]:
    return next((c for c in candidates if all(fits(i, k) for i, k in enumerate(c))), None)


# --- optimizer ----------------------------------------------------------------------------------------
def read_optimizer(src: Source, target: Target, index: Dict[str, Tuple[int, int]], zero1: bool, optimizer) -> dict:
    order = _target_order(optimizer, target, zero1)
    missing = [k for k in order if k not in index]
    if missing:
        raise StateMismatchError(f"the checkpoint has no optimizer state for parameters {missing[:5]}: they are not "
                                 "in its model shards; load the optimizer of a checkpoint saved from this model")
    groups = _param_groups(src, optimizer)
    if zero1:
        return _read_zero1(src, target, index, groups, order)
    return _read_plain(src, target, index, groups, order)


def _target_order(optimizer, target: Target, zero1: bool) -> List[str]:
    """The model key of each of the new optimizer's indices: by identity of a torch optimizer's parameters; else
    the model's parameter order or NxD's weight-decay split, whichever fits its ZeRO-1 ``shape_info``."""
    if isinstance(optimizer, torch.optim.Optimizer):
        name_of = dict(zip(target.param_ids, target.params))
        ids = [id(q) for g in optimizer.param_groups for q in g["params"]]
        if not all(i in name_of for i in ids):
            raise StateMismatchError("the optimizer holds parameters that are not the model's; resharding maps "
                                     "optimizer state to the model's parameters: build it over model.parameters()")
        return [name_of[i] for i in ids]
    sd = optimizer if isinstance(optimizer, dict) else optimizer.state_dict()
    shapes = sd.get("shape_info") if zero1 and isinstance(sd, dict) else None
    sizes = [len(g["params"]) for g in sd.get("param_groups", [])] if isinstance(sd, dict) else []
    count = len(shapes) if shapes is not None else sum(sizes)
    if not sizes:
        return list(target.params)
    order = _first_fitting(param_orders(target.params, sizes, count),
                           lambda i, k: shapes is None or tuple(shapes[i]) == target.shapes[k])
    if order is None:
        raise StateMismatchError(
            f"the optimizer's {count} parameters (param groups of sizes {sizes}) are not the model's parameters in "
            "named_parameters() order nor in NxD's weight-decay grouping; resharding maps optimizer state to "
            "parameters by that order: build the optimizer over model.parameters()")
    return order


def _param_groups(src: Source, optimizer) -> List[dict]:
    """The optimizer's own param_groups (its ``params`` lists) with the saved hyperparameters."""
    saved = src.shard(layout.OPTIM_DIR, 0, 0, 0).ref.get("param_groups", [])
    mine = (optimizer.state_dict()["param_groups"] if hasattr(optimizer, "state_dict")
            else optimizer.get("param_groups", saved))
    if len(saved) != len(mine):
        raise StateMismatchError(f"the checkpoint's optimizer has {len(saved)} param groups, this optimizer "
                                 f"{len(mine)}; build it with the same groups")
    return [dict(s, params=list(m["params"])) for s, m in zip(saved, mine)]


def _read_zero1(src: Source, target: Target, index, groups, order: List[str]) -> dict:
    has_masters = "sharded_master_weights" in src.shard(layout.OPTIM_DIR, 0, 0, 0).ref
    jobs = [(4 * _nbytes(target.shapes[key]),
             lambda i=i, key=key: _zero1_param(src, target, index, i, key, has_masters)) for i, key in enumerate(order)]
    base, shapes, masters = {}, {}, {}
    for i, (entry, shape, master) in enumerate(_run_bounded(jobs, src.workers, src.inflight_bytes)):
        base[i], shapes[i] = entry, shape
        if has_masters:
            masters[i] = master
    out = {"state": {}, "param_groups": groups, "base_state": base, "shape_info": shapes}
    if has_masters:
        out["sharded_master_weights"] = masters
    return out


def _zero1_param(src: Source, target: Target, index, i: int, key: str, has_masters: bool):
    """(base_state entry, shape_info, master piece or None) of this rank's new ZeRO-1 piece of parameter i."""
    p, j = index[key]
    first = src.model(0, p)
    part = _partition_of(key, first.partition(first.ref[key]), target)
    dst_shape = target.shapes[key]
    info0 = tuple(src.shard(layout.OPTIM_DIR, 0, 0, p).ref["shape_info"][j])

    def piece(path):
        if src.sizes.tp == target.tp:   # only DP changes: read just the saved pieces holding this rank's rows
            return _repiece(src, p, target.tp_rank, path, key, target)
        full = reshard_tensor(key, info0, part, dst_shape, src.sizes.tp,
                              lambda r: src.zero1_local(p, r, path, key), target)
        return zero1_shard(full, target.dp_rank, target.dp)

    entry = {}
    for name, v in src.shard(layout.OPTIM_DIR, 0, 0, p).ref["base_state"][j].items():
        if name == "step" or not isinstance(v, (torch.Tensor, xser.TensorReference)):
            entry[name] = src.shard(layout.OPTIM_DIR, 0, 0, p).load(v) if name == "step" else v
        else:
            entry[name] = piece(("base_state", j, name))
    master = piece(("sharded_master_weights", j)) if has_masters else None
    return entry, torch.Size(dst_shape), master


def _repiece(src: Source, p: int, r: int, path: tuple, key: str, target: Target) -> torch.Tensor:
    """This rank's piece of the new DP size from the saved DP pieces of TP rank r that overlap its rows."""
    shards = [src.shard(layout.OPTIM_DIR, d, r, p) for d in range(src.sizes.dp)]
    rows, tail = rows_tail(shards[0].ref["shape_info"][path[1]])
    out = make_piece(target.dp_rank, lambda d: shards[d].load(_get(shards[d].ref, path)),
                     piece_rows(rows, src.sizes.dp), rows, tail, piece_rows(rows, target.dp),
                     lambda: shards[0].load(_get(shards[0].ref, path)).dtype)
    return out.clone() if out.dim() and out.untyped_storage().nbytes() > out.nbytes else out


def _get(obj, path):
    for k in path:
        obj = obj[k]
    return obj


def _read_plain(src: Source, target: Target, index, groups, order: List[str]) -> dict:
    state = {}
    for i, key in enumerate(order):
        p, j = index[key]
        saved = src.shard(layout.OPTIM_DIR, 0, 0, p).ref.get("state", {}).get(j)
        if saved is not None:       # else: no state yet for this parameter (never stepped)
            state[i] = {name: _plain_entry(src, target, key, p, j, name, v) for name, v in saved.items()}
    return {"state": state, "param_groups": groups}


def _plain_entry(src: Source, target: Target, key: str, p: int, j: int, name: str, v):
    """One entry of a plain optimizer's state of parameter ``key``: resharded like the parameter when it has the
    parameter's shape (moments), else copied (``step``)."""
    first, opt0 = src.model(0, p), src.shard(layout.OPTIM_DIR, 0, 0, p)
    src_shape = first.shape(first.ref[key])
    if not (isinstance(v, (torch.Tensor, xser.TensorReference)) and src_shape and opt0.shape(v) == src_shape):
        return opt0.load(v)
    part = _partition_of(key, first.partition(first.ref[key]), target)

    def load(r: int) -> torch.Tensor:
        shard = src.shard(layout.OPTIM_DIR, 0, r, p)
        return shard.load(shard.ref["state"][j][name])

    return reshard_tensor(key, src_shape, part, target.shapes[key], src.sizes.tp, load, target)


# --- entry point ------------------------------------------------------------------------------------
def saved_sizes(saved: dict) -> Sizes:
    return Sizes(int(saved.get("tp", 1)), int(saved.get("pp", 1)), saved.get("zero1_shards") or saved.get("dp"))


def read_resharded(reader: FileReader, manifest: Optional[Manifest], saved: dict, target: Target, *, want_model: bool,
                   optimizer=None, num_workers: int = 8, inflight_bytes: int = 1 << 30) -> dict:
    """This rank's model state dict ("model") and optimizer state ("optim", when ``optimizer`` is given) at the
    job's sizes, from a checkpoint saved at ``saved``'s sizes. No collectives (``target`` was gathered by the
    caller); raises StateMismatchError naming the keys that cannot be resharded. ``num_workers`` threads
    read and reshard tensors at once, holding at most ``inflight_bytes`` of them (beyond the new shard)."""
    src = Source(reader, manifest, saved_sizes(saved), max(1, num_workers), inflight_bytes,
                 bool(saved.get("from_masters")))
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
        log.info("nxd_ckpt: resharding %s -> TP=%d PP=%d DP=%d", saved_sizes(saved).describe(), topo.tp, topo.pp,
                 topo.dp)
