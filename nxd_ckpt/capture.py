"""Turn what the caller passed (model, optimizer, scheduler, user content) into a SavePlan, at call time.

Everything that is not a tensor is pickled here, during the call, so a later mutation by the training
loop can never reach the files; tensors are captured by the snapshot that follows.
"""
from __future__ import annotations

import io
import logging
from typing import Dict, List, Optional, Tuple

import torch

import xser

from . import layout, masters, zero1_dcp
from .errors import CheckpointArgumentError
from .manifest import info_entry
from .storage import check_location
from .plan import DcpPart, RefPickle, SavePlan, model_filename, optim_filename, partition_info, plan_shard, replica_groups
from .world import World

log = logging.getLogger("nxd_ckpt")


def model_state(model) -> Tuple[dict, Dict[str, dict]]:
    """(state dict, NxD partition attributes by key) of an nn.Module, an NxD pipeline model or a dict."""
    if isinstance(model, dict):
        sd = model
        attrs = {k: partition_info(v) for k, v in sd.items() if isinstance(v, torch.Tensor)}
    else:
        sd = model.local_state_dict() if hasattr(model, "local_state_dict") else model.state_dict()
        attrs = {name: partition_info(p) for name, p in model.named_parameters()}
    extra = {}
    for k, v in (attrs.items()):
        if v is not None:
            extra[k] = v
    expert = {}
    params = dict(model.named_parameters()) if isinstance(model, torch.nn.Module) else sd
    for k, v in params.items():
        if isinstance(v, torch.Tensor) and getattr(v, "expert_model_parallel", False):
            expert[k] = True
    for k in expert:
        extra.setdefault(k, {})["expert_model_parallel"] = True
    return sd, extra


def optimizer_state(optimizer, zero1_flag: bool) -> Tuple[dict, bool, Dict[str, dict]]:
    """(state dict, is ZeRO-1, expert flags by key path). A ZeRO-1 state dict carries ``base_state`` and
    ``shape_info``."""
    sd = optimizer if isinstance(optimizer, dict) else optimizer.state_dict()
    looks_zero1 = isinstance(sd, dict) and "base_state" in sd and "shape_info" in sd
    return sd, bool(zero1_flag or looks_zero1), optimizer_expert_paths(optimizer, sd)


def optimizer_expert_paths(optimizer, sd) -> Dict[str, dict]:
    """``state/<i>/<key>`` of every state tensor of an expert-parallel parameter of a torch optimizer, as
    NxD's optimizer wrapper marks them (so an EP rank's expert state is written into its own folder)."""
    groups = getattr(optimizer, "param_groups", None)
    state = sd.get("state") if isinstance(sd, dict) else None
    if isinstance(optimizer, dict) or not groups or not isinstance(state, dict):
        return {}
    out: Dict[str, dict] = {}
    params = [p for g in groups for p in g.get("params", [])]
    for idx, p in enumerate(params):
        entry = state.get(idx)
        if getattr(p, "expert_model_parallel", False) and isinstance(entry, dict):
            for k, v in entry.items():
                if isinstance(v, torch.Tensor):
                    out[f"state/{idx}/{k}"] = {"expert_model_parallel": True}
    return out


def pickle_bytes(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


_DTYPE_NAMES: Dict[torch.dtype, str] = {}
_SHAPES: Dict[tuple, tuple] = {}
_SHAPES_MAX = 65536


def _shape_tuple(size: torch.Size) -> tuple:
    """``size`` as a plain tuple, the same object for the same shape from one save to the next. A tuple of ints
    is untracked by the collector's first pass over it, and a dict built from untracked values is never tracked:
    so from the second save of the same shapes on, the meta dicts (one per tensor) stay out of the collector's
    lists altogether."""
    shape = _SHAPES.get(size)        # a torch.Size finds its plain tuple: same hash, equal
    if shape is None:
        if len(_SHAPES) >= _SHAPES_MAX:
            _SHAPES.clear()
        shape = tuple(size)
        _SHAPES[shape] = shape          # keyed by the tuple too: a torch.Size key would stay tracked for good
    return shape


def tensor_meta(tensors: List[torch.Tensor], paths: Dict[int, str], attrs: Dict[str, dict]) -> Dict[int, dict]:
    """tid -> {dtype name, shape, state-dict key, attributes}: what the manifest and ``.info.pt`` record of each
    tensor. The shape is a plain tuple of ints (JSON writes it as a list): the collector untracks such a tuple
    at its first pass, where a list stays tracked for as long as the save runs, and every tracked object that
    outlives a young collection brings the next full collection of the training process's heap closer."""
    meta = {}
    names = _DTYPE_NAMES
    for tid, t in enumerate(tensors):
        key = paths.get(tid, "")
        dtype = t.dtype
        name = names.get(dtype)
        if name is None:
            name = names[dtype] = str(dtype).replace("torch.", "")
        m = {"dtype": name, "shape": _shape_tuple(t.shape), "key": key}
        if getattr(t, "expert_model_parallel", False):   # marked on the tensor itself, as NxD reads it
            m["expert_model_parallel"] = True
        extra = attrs.get(key)
        if extra:
            m.update(extra)
        meta[tid] = m
    return meta


def info_bytes(meta: Dict[int, dict]) -> bytes:
    """NxD's ``.info.pt``: {tid: {dtype, shape, expert_model_parallel}} plus the partition attributes, from
    the tensor_meta captured at call time (so it can be built by a writer thread, off the caller's stall)."""
    info = {tid: info_entry(m["dtype"], m["shape"], m) for tid, m in meta.items()}
    buf = io.BytesIO()
    torch.save(info, buf, pickle_module=xser.REF_PICKLE)     # its fast path: no persistent_id per object
    return buf.getvalue()


def build_plan(world: World, model, optimizer, scheduler, user_content, use_xser: bool,
               zero1_optimizer: bool, avoid_saving_lower_precision_weights: bool = False,
               use_zero1_dcp: bool = False) -> SavePlan:
    """This rank's SavePlan. Every rank calls it with its own state; no communication."""
    topo = world.topology
    shards = []
    osd, zero1, expert = optimizer_state(optimizer, zero1_optimizer) if optimizer is not None else (None, False, {})
    from_masters: Dict[str, int] = {}
    if model is not None:
        sd, attrs = model_state(model)
        if avoid_saving_lower_precision_weights:
            from_masters = _master_keys(model, optimizer, sd, osd, zero1, use_xser, topo.ep)
        shards.append(_shard(world, layout.MODEL_DIR, sd, attrs, lambda r: model_filename(topo, r), use_xser,
                             from_masters))
    dcp = None
    if optimizer is not None and use_zero1_dcp and zero1:
        dcp = _dcp_part(world, model, optimizer, osd)
    elif optimizer is not None:
        shards.append(_shard(world, layout.OPTIM_DIR, osd, expert,
                             lambda r: optim_filename(topo, r, zero1), use_xser))
    small: Dict[str, bytes] = {}
    if world.is_root:
        if scheduler is not None:
            small[layout.SCHEDULER_FILE] = pickle_bytes(scheduler.state_dict())
        if user_content is not None:
            small[layout.USER_CONTENT_FILE] = pickle_bytes(user_content)
    return SavePlan(shards, small, topo, zero1, use_xser, model is not None, optimizer is not None,
                    bool(from_masters), dcp)


def _dcp_part(world: World, model, optimizer, osd: dict) -> DcpPart:
    """use_zero1_dcp=True: this rank's entries of NxD's DCP optimizer layout (zero1_dcp.py)."""
    topo = world.topology
    if topo.ep > 1:
        raise CheckpointArgumentError("use_zero1_dcp=True with expert parallelism (EP > 1) is not supported; "
                                      "pass use_zero1_dcp=False")
    c = topo.coords(world.rank)
    coords = zero1_dcp.Coords(c.pp, c.tp, c.dp, topo.pp, topo.tp, topo.dp)
    items = zero1_dcp.plan_items(osd, zero1_dcp.param_names(model, optimizer), coords)
    return DcpPart(f"{layout.OPTIM_DIR}/{zero1_dcp.data_filename(world.rank)}", items)


def _master_keys(model, optimizer, sd: dict, osd, zero1: bool, use_xser: bool, ep: int) -> Dict[str, int]:
    """avoid_saving_lower_precision_weights: model key -> ZeRO-1 index of each model tensor whose data the
    optimizer's master weights hold (those tensor files are not written). Empty, as in NxD, when there is
    nothing to take the weights from (no ZeRO-1 master weights) or the shard is one torch.save file
    (use_xser=False); empty with a warning when the keys cannot be matched to the optimizer's parameters."""
    if not (zero1 and masters.has_master_weights(osd)):
        log.info("nxd_ckpt: avoid_saving_lower_precision_weights: the optimizer state holds no ZeRO-1 master "
                 "weights, so the model is saved in full (as neuronx-distributed does)")
        return {}
    if not use_xser:
        log.info("nxd_ckpt: avoid_saving_lower_precision_weights: with use_xser=False the model is one torch.save "
                 "file and is saved in full (as neuronx-distributed does)")
        return {}
    if ep > 1:
        raise CheckpointArgumentError(
            "avoid_saving_lower_precision_weights=True with expert parallelism (EP > 1) is not supported by "
            "nxd-ckpt yet; pass avoid_saving_lower_precision_weights=False")
    shape_info = osd.get("shape_info", {})
    keys_shapes = [(k, tuple(v.shape)) for k, v in sd.items() if isinstance(v, torch.Tensor)]
    found = masters.param_keys(model, optimizer, keys_shapes, shape_info, masters.group_sizes(osd)) or {}
    found = {k: i for k, i in found.items() if i in osd[masters.MASTERS] and k in sd}
    if not found:
        log.warning("nxd_ckpt: avoid_saving_lower_precision_weights: cannot tell which model key each ZeRO-1 "
                    "master weight belongs to (pass the nn.Module and the optimizer object), so the model is "
                    "saved in full")
    return found


def _shard(world: World, folder: str, state, attrs: Dict[str, dict], name_of, use_xser: bool,
           from_masters: Optional[Dict[str, int]] = None):
    """``from_masters``: model key -> ZeRO-1 index of the tensors whose files are not written."""
    groups = replica_groups(world.topology, name_of)
    name = name_of(world.rank)
    traced = xser.traced_refs(state)
    tensors = traced.tensors
    meta = tensor_meta(tensors, traced.paths, attrs)
    skip = set()
    for tid, m in meta.items():
        if m["key"] in (from_masters or {}):
            m[masters.INDEX_META] = from_masters[m["key"]]
            skip.add(tid)
    refs = RefPickle(traced.ref_data, deferred=traced.self_contained)
    return plan_shard(folder, name, groups[name], world.rank, refs, tensors, meta, use_xser, skip)


def validate_save_args(checkpoint_dir_str, tag, model, optimizer, scheduler, num_workers, use_xser,
                       num_kept_ckpts, async_save, zero1_optimizer, use_zero1_dcp=False,
                       avoid_saving_lower_precision_weights=False) -> str:
    """Raise CheckpointArgumentError for anything that cannot work; return the tag as a string."""
    if not isinstance(checkpoint_dir_str, (str, bytes)) and not hasattr(checkpoint_dir_str, "__fspath__"):
        raise CheckpointArgumentError(
            f"checkpoint_dir_str must be a path, got {type(checkpoint_dir_str).__name__}")
    check_location(checkpoint_dir_str)
    try:
        tag = layout.validate_tag(tag)
    except ValueError as exc:
        raise CheckpointArgumentError(str(exc)) from None
    if model is not None and not isinstance(model, (torch.nn.Module, dict)):
        raise CheckpointArgumentError(
            f"model must be a torch.nn.Module or a state dict, got {type(model).__name__}")
    if optimizer is not None and not (isinstance(optimizer, dict) or hasattr(optimizer, "state_dict")):
        raise CheckpointArgumentError(
            f"optimizer must be a torch optimizer, a ZeRO-1 optimizer or a state dict, got {type(optimizer).__name__}")
    if scheduler is not None and not hasattr(scheduler, "state_dict"):
        raise CheckpointArgumentError(
            f"scheduler must have state_dict() (e.g. torch.optim.lr_scheduler.LambdaLR), got {type(scheduler).__name__}")
    if isinstance(num_workers, bool) or not isinstance(num_workers, int) or not 1 <= num_workers <= 64:
        raise CheckpointArgumentError(f"num_workers must be an int from 1 to 64, got {num_workers!r}")
    if num_kept_ckpts is not None and (isinstance(num_kept_ckpts, bool) or not isinstance(num_kept_ckpts, int)
                                       or not (num_kept_ckpts == -1 or num_kept_ckpts >= 1)):
        raise CheckpointArgumentError(
            f"num_kept_ckpts must be None or -1 (keep all) or a positive int, got {num_kept_ckpts!r}")
    for name, val in (("use_xser", use_xser), ("async_save", async_save), ("zero1_optimizer", zero1_optimizer),
                      ("use_zero1_dcp", use_zero1_dcp),
                      ("avoid_saving_lower_precision_weights", avoid_saving_lower_precision_weights)):
        if not isinstance(val, bool):
            raise CheckpointArgumentError(f"{name} must be True or False, got {val!r}")
    if zero1_optimizer and optimizer is None:
        raise CheckpointArgumentError("zero1_optimizer=True needs an optimizer (state dict) to save")
    if use_zero1_dcp and avoid_saving_lower_precision_weights:
        raise CheckpointArgumentError(
            "use_zero1_dcp=True and avoid_saving_lower_precision_weights=True cannot be combined (as in "
            "neuronx-distributed): the model weights are restored from master weights, which the DCP optimizer "
            "layout does not hold; pass one of them")
    if use_zero1_dcp and optimizer is not None and optimizer_state(optimizer, zero1_optimizer)[1]:
        if not async_save:
            raise CheckpointArgumentError(
                "use_zero1_dcp=True with a ZeRO-1 optimizer needs async_save=True (as in neuronx-distributed)")
    return tag
