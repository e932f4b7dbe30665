"""An expert-parallel (EP > 1) tag as a FullState, for the offline tools (export, reshard, to-dcp).

Load-time resharding already knows how to read an EP tag (reshard_load: NxD's file names, non-expert tensors from
``ep_rank_00``, experts joined over EP along dim 0 and over TP by their partition, the EP ZeRO-1 optimizer's
non-expert pieces over DP and expert pieces over expert-DP). The full state is that resharding with a one-rank
target (TP = EP = DP = 1), tensor by tensor: each ``TensorSource.load()`` calls ``reshard_load.reshard_tensor`` for
one tensor, so a conversion holds about one full tensor and its pieces at a time, as for other tags.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch

import xser

from . import layout
from . import manifest as manifest_mod
from .export import _dtype
from .fullstate import (ConversionError, FullState, OptimState, ParamState, TensorSource, merge_groups,
                        rule_partition)
from .partition import EP_BASE_OFFSET_KEY, EP_GROUP_OFFSET_KEY, PartitionError
from .reader import FileReader
from .reshard_load import (Sizes, Source, SourceShard, Target, _check_ep_zero1_source, _model_tensor, _new_shape,
                           _param_index, _plain_entry, reshard_tensor)


def is_ep_tag(st) -> bool:
    """Whether the tag's model shards carry an ``ep_rank`` field (NxD's names under expert parallelism)."""
    return any(s.ep is not None for s in layout.list_shard_files(st, layout.MODEL_DIR))


def read_ep_tag(st, manifest, reader: FileReader, rules, optimizer: bool) -> FullState:
    """The full state of the EP tag ``st`` (nothing but ref pickles read yet). Single process."""
    src = _source(st, manifest, reader, optimizer)
    full = _full_target()
    keys, skipped = _model_keys(src)
    state = FullState([], skipped=skipped,
                      topology=dict(vars(manifest.topology)) if manifest is not None else {})
    info: Dict[str, tuple] = {}
    for key, p in keys:
        first = src.model(0, p)
        obj = first.ref[key]
        expert = _expert(src, first, key, obj)
        part = rule_partition(key, rules) or first.partition(obj, key)
        src_shape = first.shape(obj)
        shape = _full_shape(key, src_shape, part, src.sizes, full, expert)
        full.shapes[key] = shape
        info[key] = (p, src_shape, part, expert)
        state.model.append(TensorSource(key, shape, _dtype_of(first, obj), part, _loader(
            key, src_shape, part, shape, src, full, expert,
            lambda e, r, key=key, p=p, expert=expert: _model_tensor(src, key, p, e if expert else 0, r))))
    state.experts = frozenset(k for k, (_, _, _, expert) in info.items() if expert)
    if not state.experts:
        raise ConversionError(
            f"{reader.where(layout.MODEL_DIR)} holds {src.sizes.ep} expert-parallel shards but marks no tensor "
            "expert_model_parallel (neuronx-distributed's own .info.pt files mark none), so the offline tools cannot "
            "tell which tensors hold experts to join; load it with load_checkpoint in a job of the new sizes, whose "
            "model marks its expert weights")
    if optimizer and st.isdir(layout.OPTIM_DIR):
        state.optim = _read_optim(src, full, info)
        for i, t in enumerate(state.model):    # master weights stand in for the model tensors (as fullstate does)
            ps = state.optim.params.get(t.name)
            if ps is not None and ps.master is not None:
                state.model_dtypes[t.name] = t.dtype
                state.model[i] = ps.master
    return state


def _source(st, manifest, reader: FileReader, optimizer: bool) -> Source:
    names = layout.list_shard_files(st, layout.MODEL_DIR)
    tp = max(s.tp for s in names) + 1
    pp = max(s.pp for s in names) + 1
    ep = max(s.ep or 0 for s in names) + 1
    for t in range(tp):
        for p in range(pp):
            for e in range(ep):
                if layout.ShardName(0, t, p, e) not in names:
                    raise ConversionError(f"{reader.where(layout.MODEL_DIR)} lacks "
                                          f"{layout.shard_filename(0, t, p, e)}: the checkpoint is incomplete")
    if layout.model_data_absent(st):
        raise ConversionError(f"{st.root} keeps its model weights only as ZeRO-1 master weights "
                              "(avoid_saving_lower_precision_weights), which the offline tools do not read at EP > 1; "
                              "load it with load_checkpoint in a job of the new sizes instead")
    zero1 = optimizer and layout.folder_is_zero1(st, layout.OPTIM_DIR)
    dp = None
    if zero1:
        dp = max(s.dp for s in layout.list_shard_files(st, layout.OPTIM_DIR)) + 1
        legacy = manifest_mod.legacy_ep_folders(manifest)
        saved = {"legacy_ep": legacy, "zero1_shards": dp,
                 "layout": manifest.topology.layout if manifest is not None else None}
        try:
            _check_ep_zero1_source(reader.tag or st.root, saved)
        except Exception as exc:  # noqa: BLE001 - the same refusal, worded for the offline tools
            raise ConversionError(f"{exc}; or pass --no-optimizer to convert the model only") from None
    return Source(reader, manifest, Sizes(tp, pp, dp, ep), legacy_ep=manifest_mod.legacy_ep_folders(manifest),
                  plain=not layout.folder_is_xser(st, layout.MODEL_DIR))


def _full_target() -> Target:
    """One rank holding everything: TP = EP = DP = 1 (``shapes`` filled in as the keys are read)."""
    return Target(tp=1, tp_rank=0, dp=1, dp_rank=0, shapes={}, params=[], partitions={}, all_params=frozenset(),
                  param_ids=[])


def _model_keys(src: Source) -> Tuple[List[Tuple[str, int]], List[str]]:
    """(key, first stage holding it) in model order, and the non-tensor entries left out."""
    out, seen, skipped = [], set(), []
    for p in range(src.sizes.pp):
        for k, v in src.model(0, p).ref.items():
            if not isinstance(v, (torch.Tensor, xser.TensorReference)):
                skipped.append(str(k))
            elif k not in seen:
                seen.add(k)
                out.append((k, p))
    return out, skipped


def _expert(src: Source, first: SourceShard, key: str, obj) -> bool:
    recorded = first.expert(obj, key)
    if recorded is None:
        raise ConversionError(f"{first.relpath} records nothing about whether {key!r} is an expert tensor (no .info.pt "
                              "or manifest entry), so its EP shards cannot be joined offline; load it with "
                              "load_checkpoint in a job of the new sizes, whose model marks its expert weights")
    return recorded


def _full_shape(key, src_shape, part, sizes: Sizes, full: Target, expert: bool) -> tuple:
    try:
        return _new_shape(key, src_shape, part.normalised(len(src_shape), key) if part else None, sizes, full, expert)
    except PartitionError as exc:
        raise ConversionError(str(exc)) from None


def _dtype_of(shard: SourceShard, obj) -> torch.dtype:
    if isinstance(obj, xser.TensorReference):
        m = shard.meta.get(obj.tid)
        return _dtype(m["dtype"]) if m is not None and "dtype" in m else shard.load(obj).dtype
    return obj.dtype


def _loader(key, src_shape, part, shape, src: Source, full: Target, expert: bool, load):
    def run() -> torch.Tensor:
        t = reshard_tensor(key, src_shape, part, shape, src.sizes, load, full, expert)
        return t.contiguous()
    return run


# --- optimizer -------------------------------------------------------------------------------------
def _read_optim(src: Source, full: Target, info: Dict[str, tuple]) -> OptimState:
    zero1 = src.sizes.dp is not None
    full.params = [k for k in info]
    full.all_params = frozenset(info)
    try:
        index = _param_index(src, full, zero1)
    except Exception as exc:  # noqa: BLE001 - StateMismatchError from load-time resharding, for the offline tools
        raise ConversionError(f"{exc}; or pass --no-optimizer to convert the model only") from None
    params = {k: (_zero1_state if zero1 else _plain_state)(src, full, info[k], k, j) for k, (p, j) in index.items()}
    groups = []
    for p in range(src.sizes.pp):
        osd = src.zero1(0, 0, p) if zero1 else src.plain_optim(0, 0, p)
        goff = osd.ref.get(EP_GROUP_OFFSET_KEY)
        base = int(osd.ref.get(EP_BASE_OFFSET_KEY, 0)) if zero1 else 0
        for g, group in enumerate(osd.ref.get("param_groups", [])):
            # NxD's EP ZeRO-1 numbers an expert group's params from 0; their state sits from the base offset on
            shift = base if goff is not None and g >= int(goff) else 0
            ids = {int(i) + shift for i in group["params"]}
            names = [k for k, (pk, j) in index.items() if pk == p and j in ids]
            groups.append(({k: v for k, v in group.items() if k != "params"}, names))
    order = {k: n for n, k in enumerate(info)}   # a merged group (non-expert + expert) lists names in model order
    return OptimState(params, [(h, sorted(ns, key=order.__getitem__)) for h, ns in merge_groups(groups)])


def _zero1_state(src: Source, full: Target, info: tuple, key: str, j: int) -> ParamState:
    p, src_shape, part, expert = info
    opt0 = src.zero1(0, 0, p)
    local = tuple(int(d) for d in opt0.ref["shape_info"][j])
    ps = ParamState()

    def source(path: tuple, label: str) -> TensorSource:
        obj = opt0.ref
        for k in path:
            obj = obj[k]
        return TensorSource(label, full.shapes[key], _dtype_of(opt0, obj), part, _loader(
            key, local, part, full.shapes[key], src, full, expert,
            lambda e, r: src.zero1_local(p, r, e, path, key)))

    for name, v in opt0.ref["base_state"][j].items():
        if name == "step":
            step = opt0.load(v)
            ps.step = step.clone() if isinstance(step, torch.Tensor) else step
        elif isinstance(v, (torch.Tensor, xser.TensorReference)):
            ps.moments[name] = source(("base_state", j, name), f"{key} {name}")
    masters = opt0.ref.get("sharded_master_weights")
    if isinstance(masters, dict) and j in masters:
        ps.master = source(("sharded_master_weights", j), key)
    return ps


def _plain_state(src: Source, full: Target, info: tuple, key: str, j: int) -> ParamState:
    p, src_shape, part, expert = info
    opt0 = src.plain_optim(0, 0, p)
    ps = ParamState()
    for name, v in (opt0.ref.get("state", {}).get(j) or {}).items():
        tensor = isinstance(v, (torch.Tensor, xser.TensorReference))
        if tensor and src_shape and opt0.shape(v) == src_shape:   # a moment: resharded like its parameter
            ps.moments[name] = TensorSource(f"{key} {name}", full.shapes[key], _dtype_of(opt0, v), part,
                                            lambda name=name, v=v: _plain_entry(src, full, key, p, j, name, v)
                                            .contiguous())
        elif name == "step":
            step = opt0.load(v)
            ps.step = step.clone() if isinstance(step, torch.Tensor) else step
    return ps


__all__ = ["is_ep_tag", "read_ep_tag"]
