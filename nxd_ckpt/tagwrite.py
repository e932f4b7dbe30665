"""Sink: a FullState written as a complete NxD tag at given TP / PP / DP (/ EP) sizes (`import`, `reshard`,
`from-dcp`). At EP > 1 (``reshard --ep``): NxD's expert-parallel names and layout (DESIGN 2.6), expert tensors
(``FullState.experts``) split along dim 0 into EP runs, a ZeRO-1 state as NxD's expert-parallel ZeRO-1.

The tag is in NxD's layout (DESIGN 2.1), xser format: ``model/dp_rank_00_tp_rank_TT_pp_rank_PP.pt`` per (tp, pp)
with ``.info.pt`` (partition attributes included) and one tensor file per tensor; the optimizer as torch-xla's
ZeRO-1 state (``base_state`` pieces over DP, ``shape_info``, ``sharded_master_weights``) in one file per
(dp, tp, pp), or a plain torch optimizer state (``state`` by parameter index) in one file per (tp, pp);
``scheduler.pt``, ``user_content.pt``; our manifest (every file's size and CRC32C) and ``done`` last. It is
written through the commit strategy of its storage (outdir.output_tag: built in ``<dst>.nxdtmp`` and renamed
into place on POSIX, `done` last on an object store), so a failed conversion leaves no complete-looking tag.

Streaming: each full tensor is loaded once, split into its TP shards (and ZeRO-1 pieces), each written to its
own tensor file at once; ref files, which hold no tensor data, are written at the end.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import torch

import xser

from . import layout
from . import manifest as manifest_mod
from .errors import CheckpointArgumentError
from .fullstate import ConversionError, FullState, ParamState
from .outdir import output_tag, progress_bar
from .partition import (EP_BASE_OFFSET_KEY, EP_GROUP_OFFSET_KEY, EP_OFFSET_KEY, EP_SHAPE_OFFSET_KEY, EXPERTS,
                        assign_stages, split_tp, tp_shard_shape, zero1_shard)
from .storage import FileRecord, Storage


@dataclass(frozen=True)
class TagSizes:
    tp: int = 1
    pp: int = 1
    dp: int = 1
    zero1: bool = False
    ep: int = 1

    def check(self) -> None:
        for flag, v in (("--tp", self.tp), ("--pp", self.pp), ("--dp", self.dp), ("--ep", self.ep)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise CheckpointArgumentError(f"{flag} must be a positive integer, got {v!r}")
        if self.dp % self.ep:
            raise CheckpointArgumentError(f"--ep {self.ep} does not divide --dp {self.dp}: expert parallelism splits "
                                          "the data-parallel ranks; pass a --dp that is a multiple of --ep")

    @property
    def ep_zero1(self) -> bool:
        """NxD's expert-parallel ZeRO-1 layout: files by full DP rank, experts' pieces over expert-DP."""
        return self.zero1 and self.ep > 1

    def ep_field(self, e: int) -> Optional[int]:
        return e if self.ep > 1 else None     # NxD's names carry an ep field only under expert parallelism

    def topology(self) -> dict:
        return {"world_size": self.tp * self.pp * self.dp, "tp": self.tp, "pp": self.pp, "dp": self.dp, "cp": 1,
                "ep": self.ep}


@dataclass
class TagResult:
    output: str
    tp: int
    pp: int
    dp: int
    zero1: bool
    tensors: int
    files: int
    bytes_written: int

    def to_json(self) -> dict:
        return dict(self.__dict__)


@dataclass
class _File:
    """One ref file being built: its ref data and what its tensor files are."""

    rel: str
    data: Any = None
    meta: Dict[int, dict] = field(default_factory=dict)
    next_tid: int = 0
    index: Dict[str, int] = field(default_factory=dict)     # optimizer files: parameter name -> index

    def ref(self, key: str, attrs: Optional[dict] = None) -> xser.TensorReference:
        tid = self.next_tid
        self.next_tid += 1
        self.meta[tid] = {"key": key, **(attrs or {})}
        return xser.TensorReference(tid)


class _Writer:
    def __init__(self, store: Storage, bar):
        self.store = store
        self.records: Dict[str, FileRecord] = {}
        self.tensors: Dict[str, Dict[str, dict]] = {}
        self.bar = bar

    def tensor(self, f: _File, ref, t: torch.Tensor, write: bool = True) -> None:
        """``write`` False: only the metadata (a non-expert tensor of an ``ep_rank`` > 0 file, whose data NxD keeps
        in ``ep_rank_00``'s folder: layout.tensor_home)."""
        if write:
            rel = layout.tensor_path(f.rel, ref.tid)
            self.records[rel] = self.store.write_file(rel, lambda fo: xser.write_tensor(t, fo), durable=False)
        f.meta[ref.tid].update(dtype=str(t.dtype).replace("torch.", ""), shape=list(t.shape))

    def small(self, rel: str, produce) -> None:
        self.records[rel] = self.store.write_file(rel, produce, durable=False)

    def ref_file(self, f: _File) -> None:
        info = {tid: manifest_mod.info_entry(m["dtype"], m["shape"], m) for tid, m in sorted(f.meta.items())}
        self.small(layout.info_path(f.rel), lambda fo: torch.save(info, fo))
        self.small(f.rel, lambda fo: xser.dump_refs(f.data, fo))
        self.tensors[f.rel] = {str(tid): m for tid, m in sorted(f.meta.items())}

    def progress(self, n: int) -> None:
        if self.bar is not None:
            self.bar.update(n)


def plan_check(state: FullState, sizes: TagSizes) -> Dict[str, int]:
    """Raise before anything is written when the state cannot be laid out at ``sizes``; the stage of each name."""
    sizes.check()
    for t in state.model:
        tp_shard_shape(t.shape, t.partition, sizes.tp, t.name)
        if sizes.ep > 1 and t.name in state.experts and (not t.shape or t.shape[0] % sizes.ep):
            raise ConversionError(f"{t.name} holds {t.shape[0] if t.shape else 0} experts along dim 0, which do not "
                                  f"split into --ep {sizes.ep} equal runs; choose an --ep that divides "
                                  f"{t.shape[0] if t.shape else 0} (or leave {t.name} out of the expert tensors)")
    if sizes.ep > 1 and not state.experts:
        raise ConversionError(f"--ep {sizes.ep}: the source records no expert tensors, so nothing would be split over "
                              "EP; name them with --expert GLOB (repeatable; tensors whose dim 0 holds the experts, "
                              "e.g. --expert '*.mlp.experts.*'; a tag saved at EP=1 marks none), or pass --ep 1")
    if sizes.zero1 and state.optim is None:
        raise ConversionError("--zero1 asks for a ZeRO-1 optimizer state but the source holds no optimizer state; "
                              "drop --zero1 (the tag then has the model only)")
    if state.optim is not None:
        names = set(state.names())
        extra = sorted(set(state.optim.params) - names)
        if extra:
            raise ConversionError(f"the optimizer holds state for {extra[:3]} (and {max(0, len(extra) - 3)} more), which "
                                  "the model does not have: the names do not match")
    return assign_stages(state.names(), sizes.pp)


def write_tag(state: FullState, dst: str, sizes: TagSizes, *, converted_from: dict,
              progress: Optional[bool] = None) -> TagResult:
    """Write ``state`` as the complete tag ``dst`` (a path or URL, checked with outdir.check_output by the
    caller). Single process; blocks until the tag is committed."""
    stages = plan_check(state, sizes)
    total = sum(t.nbytes for t in state.model)
    if state.optim is not None:
        total += sum(m.nbytes for ps in state.optim.params.values() for m in ps.moments.values())
    with progress_bar(total, "write tag", progress) as bar, output_tag(dst) as out:
        w = _Writer(out.storage, bar)
        w.small(layout.CHECKPOINT_MARKER, lambda f: f.write(b"1"))
        models, optims = _skeletons(state, sizes, stages)
        for t in state.model:
            _write_param(w, state, t, sizes, stages[t.name], models, optims)
        for f in list(models.values()) + list(optims.values()):
            w.ref_file(f)
        for name, obj in ((layout.SCHEDULER_FILE, state.scheduler), (layout.USER_CONTENT_FILE, state.user_content)):
            if obj is not None:
                w.small(name, lambda fo, obj=obj: torch.save(obj, fo))
        out.commit(_manifest(w, out.name, sizes, state, converted_from, list(optims.values())))
    return TagResult(dst, sizes.tp, sizes.pp, sizes.dp, sizes.zero1, len(state.model), len(w.records),
                     sum(r.size for r in w.records.values()))


def _skeletons(state: FullState, sizes: TagSizes, stages: Dict[str, int]):
    """The ref data of every model and optimizer file, with a TensorReference per tensor to write."""
    models: Dict[Tuple[int, int, int], _File] = {}     # (tp, pp, ep)
    optims: Dict[Tuple[int, int, int, int], _File] = {}   # (tp, pp, dp, ep)
    for p in range(sizes.pp):
        names = [t for t in state.model if stages[t.name] == p]
        for r in range(sizes.tp):
            for e in range(sizes.ep):
                f = _File(f"{layout.MODEL_DIR}/{layout.shard_filename(0, r, p, sizes.ep_field(e))}", {})
                for t in names:   # the same keys in the same order in every EP rank's file: the same tids
                    f.data[t.name] = f.ref(t.name, _attrs(state, t, sizes))
                models[(r, p, e)] = f
        if state.optim is None:
            continue
        order = _packing_order(state, [t.name for t in names if t.name in state.optim.params])
        for r in range(sizes.tp):
            for d in range(sizes.dp if sizes.zero1 else 1):
                for e in range(1 if sizes.zero1 else sizes.ep):   # ZeRO-1 files are named by the full DP rank
                    optims[(r, p, d, e)] = _optim_file(state, order, sizes, r, p, d, e)
    return models, optims


def _attrs(state: FullState, t, sizes: TagSizes) -> Optional[dict]:
    attrs = dict(t.partition.to_attrs()) if t.partition else {}
    if sizes.ep > 1 and t.name in state.experts:
        attrs["expert_model_parallel"] = True
    return attrs or None


def _packing_order(state: FullState, names: List[str]) -> List[str]:
    """Optimizer indices as torch and ZeRO-1 number them: group by group, each group's parameters in order
    (the model's order when there is one group); parameters in no group last."""
    mine = set(names)
    order = [n for _h, group in state.optim.groups for n in group if n in mine]
    seen = set(order)
    return order + [n for n in names if n not in seen]


def _groups(state: FullState, order: List[str]) -> List[dict]:
    index = {n: i for i, n in enumerate(order)}
    out = []
    for hyper, names in state.optim.groups:
        mine = [index[n] for n in names if n in index]
        if mine:
            out.append({**hyper, "params": mine})
    if not out:   # no group information: one group with every parameter
        out.append({"params": list(range(len(order)))})
    return out


def _optim_file(state: FullState, order: List[str], sizes: TagSizes, r: int, p: int, d: int, e: int = 0) -> _File:
    ep = None if sizes.zero1 else sizes.ep_field(e)      # ZeRO-1 files: named by the full DP rank (NxD)
    f = _File(f"{layout.OPTIM_DIR}/{layout.shard_filename(d, r, p, ep)}",
              index={n: i for i, n in enumerate(order)})
    params = state.optim.params
    by_name = {t.name: t for t in state.model}
    if sizes.ep_zero1:
        return _ep_zero1_file(f, state, order, sizes, by_name)
    if not sizes.zero1:
        expert = {n: _attrs(state, by_name[n], sizes) if n in state.experts else None for n in order}
        f.data = {"state": {i: _entry(f, params[n], f"state/{i}", expert[n]) for i, n in enumerate(order)},
                  "param_groups": _groups(state, order)}
        return f
    f.data = {"state": {}, "param_groups": _groups(state, order),
              "base_state": {i: _entry(f, params[n], f"base_state/{i}") for i, n in enumerate(order)},
              "shape_info": {i: torch.Size(tp_shard_shape(by_name[n].shape, by_name[n].partition, sizes.tp, n))
                             for i, n in enumerate(order)},
              "sharded_master_weights": {i: f.ref(f"sharded_master_weights/{i}") for i in range(len(order))}}
    return f


def _ep_zero1_file(f: _File, state: FullState, order: List[str], sizes: TagSizes, by_name) -> _File:
    """NxD's NeuronEPZero1Optimizer state: the non-expert parameters numbered first, the experts from
    ``ep_base_state_offset`` on (their param groups after ``ep_param_group_offset``, numbered from 0 again).
    NxD's own EP state has no master weights (its load re-shards them from the parameters); when the source has
    them (``carries_masters``) they are kept as ``sharded_master_weights`` by the same indices, cut like the
    moments: NxD's load ignores the extra key, load_checkpoint and the offline tools read it, so fp32 masters of a
    lower-precision model are not lost."""
    others = [n for n in order if n not in state.experts]
    experts = [n for n in order if n in state.experts]
    base = len(others) or 1          # NxD's offset: max index + 1, 1 for an empty dict
    f.index = {**{n: i for i, n in enumerate(others)}, **{n: base + i for i, n in enumerate(experts)}}
    params = state.optim.params

    def local_shape(n):
        shape = by_name[n].shape
        if n in state.experts:
            shape = tp_shard_shape(shape, EXPERTS, sizes.ep, n)
        return torch.Size(tp_shard_shape(shape, by_name[n].partition, sizes.tp, n))

    f.data = {EP_OFFSET_KEY: 1, EP_GROUP_OFFSET_KEY: len(_groups(state, others)) if others else 0,
              EP_BASE_OFFSET_KEY: base, EP_SHAPE_OFFSET_KEY: base, "state": {},
              "param_groups": (_groups(state, others) if others else []) + (_groups(state, experts) if experts else []),
              "base_state": {f.index[n]: _entry(f, params[n], f"base_state/{f.index[n]}") for n in order},
              "shape_info": {f.index[n]: local_shape(n) for n in order}}
    if carries_masters(state):
        f.data["sharded_master_weights"] = {f.index[n]: f.ref(f"sharded_master_weights/{f.index[n]}") for n in order}
    return f


def carries_masters(state: FullState) -> bool:
    """Whether an expert-parallel ZeRO-1 tag written from ``state`` keeps master weights: when the source has any
    (a plain ZeRO-1 tag always writes them, taking the model's values where the source has none)."""
    return state.optim is not None and any(ps.master is not None for ps in state.optim.params.values())


def _entry(f: _File, ps: ParamState, path: str, attrs: Optional[dict] = None) -> dict:
    """``attrs``: an expert parameter's (its state tensors are marked expert, kept in each EP rank's folder)."""
    mark = {"expert_model_parallel": True} if attrs and attrs.get("expert_model_parallel") else None
    out = {}
    if ps.step is not None:
        out["step"] = f.ref(f"{path}/step", mark) if isinstance(ps.step, torch.Tensor) else ps.step
    for k in ps.moments:
        out[k] = f.ref(f"{path}/{k}", mark)
    return out


def _write_param(w: _Writer, state: FullState, t, sizes: TagSizes, p: int, models, optims) -> None:
    """Load one full model tensor and its optimizer state; write every shard and piece of them."""
    full = t.checked()
    out = full.to(state.model_dtypes[t.name]) if t.name in state.model_dtypes else full
    expert = sizes.ep > 1 and t.name in state.experts
    for r in range(sizes.tp):
        for e in range(sizes.ep):
            f = models[(r, p, e)]
            w.tensor(f, f.data[t.name], _ep_tp_shard(out, t, sizes, r, e, expert), write=expert or e == 0)
    w.progress(t.nbytes)
    del out
    if state.optim is None or t.name not in state.optim.params:
        return
    ps = state.optim.params[t.name]
    i = optims[(0, p, 0, 0)].index[t.name]
    root = "base_state" if sizes.zero1 else "state"
    if sizes.zero1 and (not sizes.ep_zero1 or carries_masters(state)):
        master = ps.master.checked() if ps.master is not None else full
        _write_pieces(w, optims, p, sizes, master.float(), t, lambda f: f.data["sharded_master_weights"][i], state)
    del full
    for k, src in ps.moments.items():
        _write_pieces(w, optims, p, sizes, src.checked(), t, lambda f, k=k: f.data[root][i][k], state)
        w.progress(src.nbytes)
    if isinstance(ps.step, torch.Tensor):
        expert = sizes.ep > 1 and t.name in state.experts
        for (_r, fp, _d, e), f in optims.items():
            if fp == p:
                w.tensor(f, f.data[root][i]["step"], ps.step, write=expert or e == 0)


def _ep_tp_shard(full: torch.Tensor, t, sizes: TagSizes, r: int, e: int, expert: bool) -> torch.Tensor:
    """TP rank r's shard of EP rank e's part: an expert tensor's run of experts along dim 0 (partition.EXPERTS),
    then split over TP."""
    if expert:
        full = split_tp(full, EXPERTS, sizes.ep, e, t.name)
    return split_tp(full, t.partition, sizes.tp, r, t.name)


def _write_pieces(w: _Writer, optims, p: int, sizes: TagSizes, full: torch.Tensor, t, ref_of,
                  state: FullState) -> None:
    expert = sizes.ep > 1 and t.name in state.experts
    for r in range(sizes.tp):
        for e in range(sizes.ep):
            local = _ep_tp_shard(full, t, sizes, r, e, expert)
            if sizes.ep_zero1:
                _write_ep_zero1_pieces(w, optims, p, sizes, local, r, e, expert, ref_of)
                continue
            for d in range(sizes.dp if sizes.zero1 else 1):
                f = optims[(r, p, d, e)]
                piece = zero1_shard(local, d, sizes.dp) if sizes.zero1 else local
                w.tensor(f, ref_of(f), piece, write=expert or e == 0)


def _write_ep_zero1_pieces(w: _Writer, optims, p: int, sizes: TagSizes, local: torch.Tensor, r: int, e: int,
                           expert: bool, ref_of) -> None:
    """EP rank e's local tensor into the ZeRO-1 files: a non-expert one (e = 0) over DP; an expert one over its
    expert-DP group, DP rank d = x * EP + e holding piece x (NxD's row-major grid)."""
    if not expert:
        if e == 0:
            for d in range(sizes.dp):
                w.tensor(optims[(r, p, d, 0)], ref_of(optims[(r, p, d, 0)]), zero1_shard(local, d, sizes.dp))
        return
    edp = sizes.dp // sizes.ep
    for x in range(edp):
        f = optims[(r, p, x * sizes.ep + e, 0)]
        w.tensor(f, ref_of(f), zero1_shard(local, x, edp))


def _manifest(w: _Writer, tag: str, sizes: TagSizes, state: FullState, converted_from: dict,
              optims) -> manifest_mod.Manifest:
    from .zero1 import _rank_of

    topo = sizes.topology()
    files = {}
    for rel, rec in sorted(w.records.items()):
        files[rel] = {**rec.to_json(), "rank": _rank_of(rel, topo) if "/" in rel else 0}
    flags = {"zero1": sizes.zero1, "xser": True, "has_model": True, "has_optim": state.optim is not None}
    man = manifest_mod.build(tag, topo, flags, files, w.tensors)
    man.extra["converted_from"] = converted_from
    # the parameter name of each optimizer index, so that reading this tag back never has to infer it
    man.extra["optim_params"] = {f.rel: list(f.index) for f in optims}
    return man
