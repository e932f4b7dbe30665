"""Turn what the caller passed (model, optimizer, scheduler, user content) into a SavePlan, at call time.

Everything that is not a tensor is pickled here, during the call, so a later mutation by the training
loop can never reach the files; tensors are captured by the snapshot that follows.
"""
from __future__ import annotations

import io
from typing import Dict, List, Tuple

import torch

import xser

from . import layout
from .errors import CheckpointArgumentError
from .plan import SavePlan, model_filename, optim_filename, partition_info, plan_shard, replica_groups
from .world import World


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


def ref_paths(ref_data) -> Dict[int, str]:
    """tid -> '/'-joined key path of each TensorReference in ``ref_data`` (first occurrence)."""
    out: Dict[int, str] = {}

    def walk(obj, path):
        if isinstance(obj, xser.TensorReference):
            out.setdefault(obj.tid, "/".join(path))
        elif isinstance(obj, dict):
            for k, v in obj.items():
                walk(v, path + [str(k)])
        elif isinstance(obj, (list, tuple)):
            for i, v in enumerate(obj):
                walk(v, path + [str(i)])

    walk(ref_data, [])
    return out


def tensor_meta(tensors: List[torch.Tensor], paths: Dict[int, str], attrs: Dict[str, dict]) -> Dict[int, dict]:
    meta = {}
    for tid, t in enumerate(tensors):
        key = paths.get(tid, "")
        m = {"dtype": str(t.dtype).replace("torch.", ""), "shape": list(t.shape), "key": key}
        if getattr(t, "expert_model_parallel", False):   # marked on the tensor itself, as NxD reads it
            m["expert_model_parallel"] = True
        m.update(attrs.get(key, {}))
        meta[tid] = m
    return meta


def info_bytes(tensors: List[torch.Tensor], meta: Dict[int, dict]) -> bytes:
    """NxD's ``.info.pt``: {tid: {dtype, shape, expert_model_parallel}} plus the partition attributes."""
    info = {}
    for tid, t in enumerate(tensors):
        m = meta[tid]
        entry = {"dtype": t.dtype, "shape": t.shape,
                 "expert_model_parallel": bool(m.get("expert_model_parallel", False))}
        for k in ("tensor_model_parallel", "partition_dim", "partition_stride"):
            if k in m:
                entry[k] = m[k]
        info[tid] = entry
    return pickle_bytes(info)


def build_plan(world: World, model, optimizer, scheduler, user_content, use_xser: bool,
               zero1_optimizer: bool) -> SavePlan:
    """This rank's SavePlan. Every rank calls it with its own state; no communication."""
    topo = world.topology
    shards = []
    zero1 = False
    if model is not None:
        sd, attrs = model_state(model)
        shards.append(_shard(world, layout.MODEL_DIR, sd, attrs, lambda r: model_filename(topo, r), use_xser))
    if optimizer is not None:
        osd, zero1, expert = optimizer_state(optimizer, zero1_optimizer)
        shards.append(_shard(world, layout.OPTIM_DIR, osd, expert,
                             lambda r: optim_filename(topo, r, zero1), use_xser))
    small: Dict[str, bytes] = {}
    if world.is_root:
        if scheduler is not None:
            small[layout.SCHEDULER_FILE] = pickle_bytes(scheduler.state_dict())
        if user_content is not None:
            small[layout.USER_CONTENT_FILE] = pickle_bytes(user_content)
    return SavePlan(shards, small, topo, zero1, use_xser, model is not None, optimizer is not None)


def _shard(world: World, folder: str, state, attrs: Dict[str, dict], name_of, use_xser: bool):
    groups = replica_groups(world.topology, name_of)
    name = name_of(world.rank)
    ref_data, tensors = xser.to_refs(state)
    buf = io.BytesIO()
    xser.dump_refs(ref_data, buf)
    meta = tensor_meta(tensors, ref_paths(ref_data), attrs)
    return plan_shard(folder, name, groups[name], world.rank, buf.getvalue(), tensors, meta, use_xser)


def validate_save_args(checkpoint_dir_str, tag, model, optimizer, scheduler, num_workers, use_xser,
                       num_kept_ckpts, async_save, zero1_optimizer) -> str:
    """Raise CheckpointArgumentError for anything that cannot work; return the tag as a string."""
    if not isinstance(checkpoint_dir_str, (str, bytes)) and not hasattr(checkpoint_dir_str, "__fspath__"):
        raise CheckpointArgumentError(
            f"checkpoint_dir_str must be a path, got {type(checkpoint_dir_str).__name__}")
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
    for name, val in (("use_xser", use_xser), ("async_save", async_save), ("zero1_optimizer", zero1_optimizer)):
        if not isinstance(val, bool):
            raise CheckpointArgumentError(f"{name} must be True or False, got {val!r}")
    if zero1_optimizer and optimizer is None:
        raise CheckpointArgumentError("zero1_optimizer=True needs an optimizer (state dict) to save")
    return tag
