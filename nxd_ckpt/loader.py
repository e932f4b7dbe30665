"""load_checkpoint's work: pick the tag, check it fits this job, read (reader.py), check, apply.

Every rank calls load_checkpoint. The read phase ends with an agreement over the host gloo group, so a
damaged file seen by one rank makes every rank skip that tag (tag=None) or raise (explicit tag)
together, before any state has changed. The model is applied before the optimizer.
"""
from __future__ import annotations

import fnmatch
import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Union

import torch

import xser

from . import commit, errors, hostgroups, layout, masters, reshard_load
from . import manifest as manifest_mod
from .errors import (CheckpointNotFoundError, CorruptCheckpointError, IncompleteCheckpointError,
                     StateMismatchError, TopologyMismatchError)
from .plan import home_filename, model_filename, optim_filename, replica_groups
from .reader import ALL, LOAD_HINT, FileReader, pipeline_threads, read_shard, resolve, share_shard
from .storage import Storage
from .storage.s3 import S3Error
from .world import World

log = logging.getLogger("nxd_ckpt")

IgnoreKeys = Union[None, str, Sequence[str], Callable[[dict], Optional[dict]]]


# --- which tag -------------------------------------------------------------------------------------
def candidate_tags(storage: Storage, tag) -> List[str]:
    """The directories to try, in order: the explicit tag's, or every complete tag's newest first (a tag
    that a crash during publish left under a suffixed name is read there). Rank 0 alone calls it."""
    if tag is not None:
        tag = layout.validate_tag(tag)
        # The common case first: a tag with `done` exists (as does the directory holding it), so nothing
        # else needs asking. On an object store that is one HEAD instead of 2 LISTs and 2 HEADs.
        if storage.isfile(f"{tag}/{layout.DONE_MARKER}"):
            return [tag]
    if not storage.isdir(""):
        raise CheckpointNotFoundError(f"checkpoint directory {storage.root!r} does not exist")
    if tag is not None:
        recoverable = {} if storage.exists(tag) else commit.recoverable_tags(storage)
        if tag in recoverable:
            return [recoverable[tag]]
        if not storage.exists(f"{tag}/{layout.DONE_MARKER}"):
            _check_unmarked(storage, tag)
        return [tag]
    tags = [name for _, name in commit.loadable(storage)]
    if not tags:
        raise CheckpointNotFoundError(
            f"no complete checkpoint in {storage.root} (no tag directory with a 'done' marker); "
            "check the path, or start training from scratch when has_checkpoint() is False")
    return tags


def _check_unmarked(storage: Storage, tag: str) -> None:
    """An explicit tag without `done`: loadable when it has no markers at all (NxD's converter output,
    weights converted from Hugging Face by NxD's checkpoint converter), as NxD loads it; refused when it
    has the `checkpoint` marker (a save that began and never finished) or holds no checkpoint."""
    available = commit.complete_tags(storage)
    if storage.exists(f"{tag}/{layout.CHECKPOINT_MARKER}"):
        raise IncompleteCheckpointError(
            f"checkpoint {tag!r} in {storage.root} has a 'checkpoint' marker but no 'done' marker: its save began "
            f"and never finished (interrupted), so its files may be partial. Complete checkpoints: "
            f"{available or 'none'}; pass one of them or tag=None for the newest")
    if storage.isdir(tag) and layout.holds_checkpoint_data(storage.child(tag)):
        log.info("nxd_ckpt: checkpoint %s in %s has no 'done' marker and no 'checkpoint' marker (written by a "
                 "converter, not by a save); loading it as given", tag, storage.root)
        return
    if storage.isdir(tag):
        raise CheckpointNotFoundError(
            f"{storage.root}/{tag} holds no checkpoint (no model/ or optim/ shard, no scheduler.pt or "
            f"user_content.pt). Complete checkpoints, newest first: {available or 'none'}")
    raise CheckpointNotFoundError(
        f"no checkpoint {tag!r} in {storage.root}. Complete checkpoints, newest first: {available or 'none'}")


# --- topology ------------------------------------------------------------------------------------
def saved_topology(storage: Storage, tag: str, manifest: Optional[manifest_mod.Manifest]) -> dict:
    """tp/pp/ep/dp/zero1/zero1_shards/xser/from_masters of a saved checkpoint: from the manifest when there is
    one (no request: on an object store ``describe_tag`` would HEAD `done` and LIST `model/` and `optim/` on
    every rank), else from the file names (``manifest_mod.describe_tag``)."""
    if manifest is not None:
        d = manifest_mod.saved_layout(manifest)
    else:
        d = manifest_mod.describe_tag(storage, tag, manifest_mod.NO_MANIFEST)
    t = dict(vars(d.topology), zero1=d.zero1, zero1_shards=d.zero1_shards, xser=d.xser)
    if d.zero1_dcp:
        t["zero1_dcp"] = True
    if manifest is not None:
        t["from_masters"] = bool(manifest.extra.get(masters.FLAG, False))
        t["legacy_ep"] = manifest_mod.legacy_ep_folders(manifest)
    else:
        t["from_masters"] = layout.model_data_absent(storage.child(tag))
    return t


def check_topology(tag: str, saved: dict, world: World, loading_optim: bool) -> None:
    topo = world.topology
    problems = []
    for k in ("tp", "pp", "ep"):
        if saved.get(k, 1) != getattr(topo, k):
            problems.append(k)
    dp_now = topo.dp   # ZeRO-1 files are named by the full DP rank, expert parallel or not (NxD)
    if loading_optim and saved.get("zero1") and saved.get("zero1_shards") not in (None, dp_now):
        problems.append("dp")
    if not problems:
        return
    s_dp = saved.get("dp") or saved.get("zero1_shards") or "?"
    was = f"TP={saved.get('tp')} PP={saved.get('pp')} DP={s_dp}" + (f" EP={saved['ep']}" if saved.get("ep", 1) > 1 else "")
    now = f"TP={topo.tp} PP={topo.pp} DP={topo.dp}" + (f" EP={topo.ep}" if topo.ep > 1 else "")
    hint = ("TP, PP and EP must match to load; " if set(problems) - {"dp"} else "")
    if "dp" in problems:
        hint += ("a ZeRO-1 optimizer state is sharded over DP: reshard it with `nxd-ckpt convert-zero1 "
                 f"--input_dir <dir>/{tag} --output_dir <dir>/<new_tag> --convert_to_sharded --dp_size {dp_now}` "
                 "(or load the model only)")
    else:
        hint += ("relaunch with the saved sizes, or merge the TP/PP shards into one full model with `nxd-ckpt "
                 f"export <dir>/{tag} --output <hf_dir>` and load that into the new layout")
    if loading_optim and saved.get("zero1_dcp"):
        hint += ("; its use_zero1_dcp optimizer loads only at the saved TP and PP sizes (with optimizer=None and "
                 "reshard=True the model alone is resharded)")
    elif (saved.get("cp") or 1) == topo.cp == 1:
        hint += "; or let load_checkpoint reshard it at load time (reshard=True, the default)"
    raise TopologyMismatchError(
        f"checkpoint {tag!r} was saved at {was}{' with ZeRO-1' if saved.get('zero1') else ''} and this job runs "
        f"{now} ({', '.join(p.upper() for p in problems)} differ{'s' if len(problems) == 1 else ''}). {hint}.")


# --- read ----------------------------------------------------------------------------------------
def agree(error: Optional[BaseException]) -> None:
    """Every rank: exchange this rank's error (or None) over the host group; if any rank failed, raise
    on every rank -- this rank's own error, or the first failing rank's, re-created with its class."""
    statuses = hostgroups.all_gather_objects(_status(error))
    bad = [(r, s) for r, s in enumerate(statuses) if s is not None]
    if not bad:
        return
    if error is not None:
        raise error
    raise _recreate(*bad[0])


def _status(error: Optional[BaseException]):
    """What travels between ranks of an error (None: no error)."""
    if error is None:
        return None
    return (type(error).__name__, str(error), getattr(error, "path", None), getattr(error, "expected", None),
            getattr(error, "found", None))


def _recreate(rank: int, status) -> errors.CheckpointError:
    """Another rank's error, re-created here with its class (CheckpointError when it is not one of ours)."""
    cls_name, msg, path, expected, found = status
    if cls_name == S3Error.__name__:
        # That rank's requests to the object store failed for good (its own load raises RankFailureError for
        # it in api.py): the same class here, so every rank raises a rank failure, not a bare CheckpointError.
        return errors.RankFailureError(f"rank {rank} could not read the checkpoint: {msg}. Nothing was changed on "
                                       "this rank", {rank: msg})
    cls = getattr(errors, cls_name, None)
    if not (isinstance(cls, type) and issubclass(cls, errors.CheckpointError)):
        cls = errors.CheckpointError
    if cls is CorruptCheckpointError:
        return CorruptCheckpointError(f"rank {rank}: {msg}", path=path, expected=expected, found=found)
    return cls(f"rank {rank}: {msg}")


def agreed_candidates(storage: Storage, tag, node_local: bool = False) -> List[str]:
    """Every rank: the directories to try, as rank 0 sees them (a save committing meanwhile must not make
    ranks pick different tags), or rank 0's error raised on every rank. ``node_local`` must be the same on
    every rank (it decides who reads what). Only rank 0 lists the directory (one listing per load, not one
    per rank: on an object store each is a series of paginated LIST requests)."""
    import torch.distributed as dist

    root = not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0
    try:
        mine, error = (candidate_tags(storage, tag) if root else _checked_tag(tag)), None
    except ValueError as exc:   # a bad tag
        mine, error = None, exc if isinstance(exc, errors.CheckpointError) else errors.CheckpointArgumentError(str(exc))
    except (errors.CheckpointError, S3Error) as exc:   # shared, so every rank raises rank 0's cause
        mine, error = None, exc
    gathered = hostgroups.all_gather_objects((mine, _status(error), bool(node_local)))
    if len({g[2] for g in gathered}) > 1:
        raise errors.CheckpointArgumentError(
            f"node_local differs between ranks ({[g[2] for g in gathered]} by rank); pass the same value on every rank")
    first_tags, first_status, _ = gathered[0]
    if first_status is None:
        return first_tags
    if error is not None and type(error).__name__ == first_status[0]:
        raise error
    raise _recreate(0, first_status)


def _checked_tag(tag) -> None:
    if tag is not None:
        layout.validate_tag(tag)
    return None


def agreed_manifest(storage: Storage, tag: str) -> Optional[manifest_mod.Manifest]:
    """Every rank: the tag's manifest as rank 0 read it (None for a tag without one that may lack it), or rank
    0's error raised on every rank. Only rank 0 reads `manifest.json` and `done` (on an object store 2 GETs
    per load, not 2 per rank) and broadcasts the result; a tag without a manifest is checked there too."""
    import torch.distributed as dist

    root = not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0
    manifest, error = None, None
    if root:
        try:
            manifest = _read_manifest(storage, tag)
        except Exception as exc:  # noqa: BLE001 - shared, so no rank waits for a manifest that never comes
            error = exc
    shared, status = hostgroups.broadcast_object((manifest, _status(error)))
    if status is None:
        return shared
    if error is not None:
        raise error
    raise _recreate(0, status)


def _read_manifest(storage: Storage, tag: str) -> Optional[manifest_mod.Manifest]:
    manifest = manifest_mod.read(storage, tag)
    if manifest is None and commit.expects_manifest(storage, tag):
        rel = f"{tag}/{layout.MANIFEST_FILE}"
        raise CorruptCheckpointError(
            f"checkpoint {tag!r} in {storage.root} is marked complete but {rel} is missing, although nxd-ckpt "
            "wrote this tag (`newest` names it, or it is newer than a tag here that has a manifest), so its "
            "files cannot be verified. Load another tag (tag=None picks the newest intact one); if the tag "
            "was copied in from neuronx-distributed, move it to a directory of its own to load it without "
            "checksums", path=rel)
    return manifest


def read_tag(storage: Storage, tag: str, world: World, *, want_model: bool, want_optim: bool,
             want_scheduler: bool, num_workers: int, trusted: bool, mapped: bool = False,
             node_local: bool = False, model=None, optimizer=None, reshard: bool = False) -> dict:
    """Every rank: read this rank's state of ``tag`` into host memory, verified. If any rank fails
    (damage, missing shard, topology), every rank raises, after agreeing; nothing has been changed.
    ``mapped``: large tensor files may be returned memory-mapped (see ``copies_every_tensor``).
    ``node_local``: every rank reads all of its own files (no sharing between DP replicas).
    ``reshard``: a checkpoint saved at other TP/PP/DP sizes is resharded into this job's (reshard_load.py,
    which needs ``model`` and, for the optimizer, ``optimizer``); else such a checkpoint is refused."""
    state: Dict[str, object] = {}
    error: Optional[BaseException] = None
    resharding = False
    try:
        manifest = agreed_manifest(storage, tag)
        saved = saved_topology(storage, tag, manifest)
        resharding = reshard and reshard_load.needs_reshard(saved, world, want_optim)
        if resharding:
            reshard_load.check_reshardable(tag, saved, world, model is not None, want_optim)
        else:
            check_topology(tag, saved, world, want_optim)
            reader = FileReader(storage, tag, manifest, trusted, mapped=mapped, hint=LOAD_HINT)
            state = _read_parts(reader, saved, world, want_model, want_optim, want_scheduler, num_workers, node_local,
                                (model, optimizer))
        state["manifest"], state["saved"], state["targets"] = manifest, saved, (model, optimizer)
    except Exception as exc:  # noqa: BLE001 - every failure must be agreed on before anyone raises
        error = exc
    agree(error)
    if resharding:
        return _read_resharded(storage, tag, state, world, model, optimizer, want_model, want_scheduler, trusted,
                               num_workers)
    _share(state, world)
    agree(state.pop("share_error", None))
    return state


def _read_resharded(storage: Storage, tag: str, state: dict, world: World, model, optimizer, want_model: bool,
                    want_scheduler: bool, trusted: bool, num_workers: int) -> dict:
    """Every rank (one all-gather, then reads agreed on): this rank's state resharded to the job's sizes."""
    saved = state["saved"]
    reshard_load.log_resharding(saved, world)
    target = reshard_load.target_of(model, world)
    error: Optional[BaseException] = None
    try:
        reader = FileReader(storage, tag, state["manifest"], trusted, hint=LOAD_HINT)
        state.update(reshard_load.read_resharded(reader, state["manifest"], saved, target, want_model=want_model,
                                                 optimizer=optimizer, num_workers=num_workers))
        state.update(_read_parts(reader, saved, world, False, False, want_scheduler, 1, True))
    except Exception as exc:  # noqa: BLE001 - agreed on before anyone raises
        error = exc
    agree(error)
    return state


def copies_every_tensor(model, optimizer) -> bool:
    """True when applying a checkpoint to these targets copies every loaded tensor of a size worth
    mapping into a tensor of the target (a module's parameters and buffers; device tensors of a dict
    model; a torch optimizer whose parameters are all XLA tensors: load_state_dict moves its state
    to the parameters' device, except ``step``, which is small), so the loaded host tensors may be
    memory-mapped files: none of them outlives the load. False when unsure."""
    if isinstance(model, dict):
        if not all(v.device.type == "xla" for v in model.values() if isinstance(v, torch.Tensor)):
            return False
    elif model is not None and not isinstance(model, torch.nn.Module):
        return False
    if optimizer is not None:
        groups = None if isinstance(optimizer, dict) else getattr(optimizer, "param_groups", None)
        if not groups or not all(isinstance(p, torch.Tensor) and p.device.type == "xla"
                                 for g in groups for p in g.get("params", [])):
            return False
    return True


def _read_parts(reader: FileReader, saved: dict, world: World, want_model: bool, want_optim: bool,
                want_scheduler: bool, num_workers: int, node_local: bool, targets: tuple = (None, None)) -> dict:
    topo = world.topology
    out: Dict[str, object] = {}
    cooperative = world.distributed and world.world_size > 1 and not node_local
    xser_shard = bool(saved.get("xser", True))
    with pipeline_threads(), ThreadPoolExecutor(max_workers=max(1, num_workers)) as pool:
        zero1, legacy = bool(saved.get("zero1")), saved.get("legacy_ep") or frozenset()
        old_names = layout.OPTIM_DIR in legacy
        parts = (("model", layout.MODEL_DIR, want_model, lambda r: model_filename(topo, r)),
                 ("optim", layout.OPTIM_DIR, want_optim, lambda r: optim_filename(topo, r, zero1, old_names)))
        for part, folder, wanted, name_of in parts:
            if not wanted:
                continue
            if part == "optim" and saved.get("zero1_dcp"):
                out["optim"] = _read_dcp(reader, world, *targets)
                continue
            home = layout.own_home if folder in legacy else layout.tensor_home
            name = name_of(world.rank)
            rel = f"{folder}/{name}"
            _require(reader, rel, "model" if part == "model" else "optimizer")
            groups = replica_groups(topo, name_of)
            homes = replica_groups(topo, home_filename(name_of, home))   # who shares the non-expert tensors
            from_masters = part == "model" and saved.get("from_masters")
            out[part] = read_shard(reader, rel, groups[name], world.rank, pool, cooperative, xser_shard,
                                   home_replicas=homes[home(name, False)], home_of=home,
                                   skip=_master_tids(reader, rel) if from_masters else (),
                                   live=_live_state(targets[part == "optim"]), workers=max(1, num_workers))
            out[f"{part}_groups"] = list(groups.values()) + list(homes.values())
            if from_masters:
                out["masters"] = _read_masters(reader, saved, world, groups[name] if cooperative else [world.rank])
    if want_scheduler:
        if not reader.exists(layout.SCHEDULER_FILE):
            raise StateMismatchError(f"checkpoint {reader.tag!r} has no {layout.SCHEDULER_FILE}; "
                                     "call load_checkpoint without scheduler=")
        out["scheduler"] = reader.load_pickle(layout.SCHEDULER_FILE)
    if reader.exists(layout.USER_CONTENT_FILE):
        out["user_content"] = reader.load_pickle(layout.USER_CONTENT_FILE)
    return out


def _live_state(target):
    """The state a loaded shard will replace (a dict target as it is, a module's or a torch optimizer's
    state_dict), for the read pipeline to move tensors to their devices as they are read; None for other
    targets (their own load_state_dict places them)."""
    if isinstance(target, dict):
        return target
    if isinstance(target, (torch.nn.Module, torch.optim.Optimizer)):
        return target.state_dict()
    return None


def _read_dcp(reader: FileReader, world: World, model, optimizer) -> dict:
    """This rank's ZeRO-1 state from NxD's use_zero1_dcp optimizer (optim/.metadata + .distcp files), at this
    job's DP size. Every file read is verified against the manifest when there is one."""
    from . import dcpmeta, zero1_dcp

    where = f"{reader.tag}/{layout.OPTIM_DIR}/{zero1_dcp.METADATA_FILE}"
    meta = dcpmeta.read_metadata(reader.read(f"{layout.OPTIM_DIR}/{zero1_dcp.METADATA_FILE}"), where,
                                 reader.trusted)
    try:
        names = zero1_dcp.param_names(model, optimizer)
    except errors.CheckpointArgumentError as exc:
        raise StateMismatchError(f"checkpoint {reader.tag!r} holds its optimizer as NxD's use_zero1_dcp "
                                 f"torch.distributed.checkpoint: {exc}") from None
    files: Dict[str, bytes] = {}
    ranges = zero1_dcp.ranges_of(reader.manifest.extra) if reader.manifest is not None else {}

    def read_blob(name: str, offset: int, length: int) -> bytes:
        rel = f"{layout.OPTIM_DIR}/{name}"
        recorded = ranges.get((rel, offset))
        if recorded is not None and recorded[0] == length:    # just this entry, verified by its own CRC32C
            return reader.read_range(rel, offset, length, recorded[1])
        if name not in files:   # no ranges recorded (NxD's or an older tag): the whole file, verified
            files[name] = reader.read(f"{layout.OPTIM_DIR}/{name}")
        data = files[name]
        if offset + length > len(data):
            raise CorruptCheckpointError(f"{reader.tag}/{layout.OPTIM_DIR}/{name} is shorter than its .metadata "
                                         f"says ({len(data)} < {offset + length} bytes)", path=name)
        return data[offset:offset + length]

    topo = world.topology
    c = topo.coords(world.rank)
    coords = zero1_dcp.Coords(c.pp, c.tp, c.dp, topo.pp, topo.tp, topo.dp)
    state = zero1_dcp.load_state(meta, read_blob, names, coords, where)
    live = optimizer.state_dict().get("param_groups") if hasattr(optimizer, "state_dict") else None
    state["param_groups"] = zero1_dcp.fit_param_groups(state["param_groups"], live, topo.pp, where)
    return state


def _master_tids(reader: FileReader, rel: str):
    """The model tids whose data lies in the ZeRO-1 master weights: as recorded in our manifest, or every one
    (neuronx-distributed writes none of the model's tensor files in this mode)."""
    meta = reader.manifest.tensors.get(rel, {}) if reader.manifest is not None else {}
    recorded = {int(tid) for tid, m in meta.items() if masters.INDEX_META in m.attrs}
    return recorded or ALL     # none recorded: written by NxD (perhaps converted since), no tensor file at all


@dataclass
class MasterRead:
    """This rank's share of the ZeRO-1 master weights of its (tp, pp) model shard."""

    zero1_shards: int
    parts: Dict[int, Dict[int, torch.Tensor]]     # saved DP rank -> ZeRO-1 index -> shard
    shape_info: Optional[dict]
    replicas: List[int]                           # who shares the reading (and receives it all)


def _read_masters(reader: FileReader, saved: dict, world: World, replicas: List[int]) -> MasterRead:
    """Read the master weights of the saved ZeRO-1 files of this rank's (tp, pp): file d is read by replica
    ``d % len(replicas)`` (any DP size now), the others receive it in ``_share``."""
    c = world.topology.coords(world.rank)
    # ZeRO-1 at DP=1 has the name of a plain optimizer shard: one file
    first = f"{layout.OPTIM_DIR}/{layout.shard_filename(0, c.tp, c.pp)}"
    shards = saved.get("zero1_shards") or int(reader.exists(first))
    if not shards:
        raise CorruptCheckpointError(
            f"checkpoint {reader.tag!r} keeps its model weights as ZeRO-1 master weights "
            "(avoid_saving_lower_precision_weights) but holds no ZeRO-1 optimizer shards to take them from")
    mine = replicas.index(world.rank)
    parts, shape_info = {}, None
    for d in range(mine, shards, len(replicas)):
        rel = f"{layout.OPTIM_DIR}/{layout.shard_filename(d, c.tp, c.pp)}"
        data = reader.load_pickle(rel)
        if not isinstance(data, dict) or masters.MASTERS not in data or "shape_info" not in data:
            raise CorruptCheckpointError(
                f"checkpoint {reader.tag!r} keeps its model weights as ZeRO-1 master weights but {rel} has no "
                f"{masters.MASTERS!r} (or no 'shape_info'); the model cannot be restored from it", path=rel)
        shape_info = data["shape_info"]
        parts[d] = {int(i): (reader.load_tensor(layout.tensor_path(rel, t.tid)) if xser.is_ref(t) else t)
                    for i, t in data[masters.MASTERS].items()}
    return MasterRead(shards, parts, shape_info, list(replicas))


def _require(reader: FileReader, rel: str, what: str) -> None:
    if not reader.exists(rel):
        folder = f"{reader.tag}/{rel.rsplit('/', 1)[0]}"
        names = reader.storage.listdir(folder) if reader.storage.isdir(folder) else []
        if what == "optimizer" and any(layout.parse_full_filename(n) is not None for n in names):
            raise StateMismatchError(
                f"checkpoint {reader.tag!r} holds a merged (full) ZeRO-1 optimizer state, as `nxd-ckpt convert-zero1 "
                "--convert_to_full` writes it; shard it for this job first: `nxd-ckpt convert-zero1 --input_dir "
                f"<dir>/{reader.tag} --output_dir <dir>/<new_tag> --convert_to_sharded --dp_size <DP>`")
        # Without a manifest, damage shows as a hole: sibling shards (whose names also fixed the topology
        # just checked), this shard's own tensor files, or a folder NxD created and left empty.
        siblings = any(layout.parse_shard_filename(n) is not None for n in names)
        own_files = reader.exists(layout.info_path(rel)) or reader.storage.isdir(
            f"{reader.tag}/{layout.tensors_dir(rel)}")
        if reader.manifest is None and (siblings or own_files or (reader.storage.isdir(folder) and not names)):
            full = f"{reader.tag}/{rel}"
            raise CorruptCheckpointError(
                f"checkpoint {reader.tag!r} is marked complete but {full} is missing (its folder is there); "
                "load another tag (tag=None picks the newest intact one), or restore the file", path=full)
        raise StateMismatchError(
            f"checkpoint {reader.tag!r} has no {what} shard {rel} for this rank; it was saved without a {what} "
            f"or at another parallel layout; call load_checkpoint without {'model' if what == 'model' else 'optimizer'}=")


def _share(state: dict, world: World) -> None:
    for part in ("model", "optim"):
        if part not in state:
            continue
        shard = state[part]
        if f"{part}_groups" not in state:
            continue      # read whole by this rank (use_zero1_dcp)
        groups = hostgroups.replica_host_groups(state[f"{part}_groups"]) if world.distributed else {}
        share_shard(shard, groups)
        if part == "model" and "masters" in state:
            mr = state["masters"]
            group = groups.get(tuple(sorted(mr.replicas))) if len(mr.replicas) > 1 else None
            parts, notes = hostgroups.share_tensor_dicts(mr.parts, mr.shape_info, mr.replicas, group)
            try:   # an error here is agreed on after every rank finished its exchanges (read_tag)
                _fill_from_masters(state, shard, parts, next(n for n in notes if n is not None), world)
            except Exception as exc:  # noqa: BLE001
                state["share_error"] = exc
        state[part] = resolve(shard)


def _fill_from_masters(state: dict, shard, parts: Dict[int, Dict[int, torch.Tensor]], shape_info: dict,
                       world: World) -> None:
    """Put the full master weight of each absent model tensor into ``shard`` (cast to the model's saved dtype).
    An absent tensor without a master weight (a buffer in a neuronx-distributed checkpoint, which saves none of
    the model's tensors in this mode) stays absent: the target keeps its value, as with neuronx-distributed."""

    mr: MasterRead = state["masters"]
    paths = xser.key_paths(shard.ref_data)
    index = _master_index(state, shard, paths, shape_info)
    for tid in shard.absent:
        i = index.get(tid)
        if i is None:
            state.setdefault("model_unsaved", []).append(paths.get(tid, str(tid)))
            continue
        want = shard.info[tid] if shard.info and tid in shard.info else None
        full = masters.join_shards([parts[d][i] for d in range(mr.zero1_shards)], shape_info[i])
        if want is not None:
            full = full.to(want["dtype"])
        shard.tensors[tid] = full
    if state.get("model_unsaved") and world.is_root:
        log.info("nxd_ckpt: %d model tensor(s) of this checkpoint have no saved data and no master weight (e.g. "
                 "buffers); they keep their current values: %s", len(state["model_unsaved"]),
                 ", ".join(state["model_unsaved"][:10]))


def _master_index(state: dict, shard, paths: Dict[int, str], shape_info) -> Dict[int, int]:
    """tid -> ZeRO-1 index of the absent model tensors: from our manifest, else matched on the live model and
    optimizer (or by order and shape)."""
    manifest = state.get("manifest")
    meta = manifest.tensors.get(shard.relpath, {}) if manifest is not None else {}
    recorded = {int(t): int(m.attrs[masters.INDEX_META]) for t, m in meta.items() if masters.INDEX_META in m.attrs}
    if recorded:
        return recorded
    model, optimizer = state.get("targets", (None, None))
    keys_shapes = [(paths.get(t, ""), tuple(shard.info[t]["shape"])) for t in sorted(shard.absent)
                   if shard.info and t in shard.info]
    by_key = masters.param_keys(model, optimizer, keys_shapes, shape_info or {})
    if by_key is None:
        raise StateMismatchError(
            "this neuronx-distributed checkpoint keeps the model's weights only as ZeRO-1 master weights "
            "(avoid_saving_lower_precision_weights), and which model key each belongs to cannot be told from the "
            "files: pass the nn.Module as model= and the ZeRO-1 optimizer object as optimizer=")
    return {t: by_key[k] for t, k in paths.items() if k in by_key and t in shard.absent}


# --- check and apply -------------------------------------------------------------------------------
def _matches(key: str, patterns: Sequence[str]) -> bool:
    return any(fnmatch.fnmatchcase(key, p) for p in patterns)


def apply_ignore_keys(state: dict, ignore_keys: IgnoreKeys) -> List[str]:
    """Drop ignored entries in place; return the patterns (for strict checks). A callable edits the
    state dict {'model':..., 'optim':...} and may return a replacement."""
    if ignore_keys is None:
        return []
    if callable(ignore_keys):
        view = {k: state[k] for k in ("model", "optim") if k in state}
        new = ignore_keys(view)
        if new is not None:
            view = new
        for k in ("model", "optim"):
            if k in view:
                state[k] = view[k]
        return []
    patterns = [ignore_keys] if isinstance(ignore_keys, str) else list(ignore_keys)
    if "model" in state and isinstance(state["model"], dict):
        state["model"] = {k: v for k, v in state["model"].items() if not _matches(f"model/{k}", patterns)}
    if "optim" in state and isinstance(state["optim"], dict):
        state["optim"] = _drop_optim_paths(state["optim"], patterns)
    return patterns


def _drop_optim_paths(osd: dict, patterns) -> dict:
    """Ignored top-level sections (e.g. ``optim/state``) become empty, so the optimizer keeps its shape;
    ignored nested entries (e.g. ``optim/state/3``) are removed."""
    out = type(osd)()
    for k, v in osd.items():
        if _matches(f"optim/{k}", patterns):
            if isinstance(v, dict):
                out[k] = type(v)()
            continue
        out[k] = _drop_paths(v, f"optim/{k}", patterns)
    return out


def _drop_paths(obj, prefix: str, patterns):
    if isinstance(obj, dict):
        return type(obj)((k, _drop_paths(v, f"{prefix}/{k}", patterns)) for k, v in obj.items()
                         if not _matches(f"{prefix}/{k}", patterns))
    return obj


def check_model(model, sd: dict, strict: bool, patterns: List[str]) -> None:
    """Raise StateMismatchError, before anything is applied, when ``sd`` cannot load into ``model``: keys
    (strict; a dict target is checked only when it is non-empty: an empty dict receives the whole state)
    or tensor shapes (always for an nn.Module, whose load_state_dict would otherwise copy part of the
    state and then fail; under strict for a dict)."""
    if isinstance(model, torch.nn.Module):
        targets = model.state_dict()
        shapes = _shapes_load_state_dict_enforces(model)
    elif isinstance(model, dict) and model:
        targets = model
        shapes = {k: tuple(v.shape) for k, v in model.items() if isinstance(v, torch.Tensor)}
    else:
        return
    if strict:
        want = {k for k in targets if not _matches(f"model/{k}", patterns)}
        have = set(sd.keys())
        missing, unexpected = sorted(want - have), sorted(have - want)
        if missing or unexpected:
            raise StateMismatchError(
                "the checkpoint's model keys do not match the model (strict=True): "
                f"missing from checkpoint: {missing or 'none'}; unexpected in checkpoint: {unexpected or 'none'}. "
                "Pass strict=False to load the overlap, or ignore_keys=['model/<pattern>'] to skip keys.")
    if isinstance(model, dict) and not strict:
        return
    wrong = [f"{k}: checkpoint {tuple(v.shape)}, model {shapes[k]}" for k, v in sorted(sd.items())
             if isinstance(v, torch.Tensor) and k in shapes and tuple(v.shape) != shapes[k]
             and not (shapes[k] == () and tuple(v.shape) == (1,))]   # torch loads (1,) into 0-d
    if wrong:
        shown = "; ".join(wrong[:10]) + (f"; and {len(wrong) - 10} more" if len(wrong) > 10 else "")
        raise StateMismatchError(
            f"the checkpoint's tensor shapes do not match the model for {len(wrong)} key(s): {shown}. Build the "
            "model with the sizes (and TP degree) it was saved with, or pass ignore_keys=['model/<key>'] to skip "
            "those keys.")


def _shapes_load_state_dict_enforces(model: torch.nn.Module) -> Dict[str, tuple]:
    """key -> shape of every parameter and persistent buffer whose size nn.Module's own loading insists
    on: not lazy (uninitialized), and owned by a module that does not override _load_from_state_dict
    (observers and fake-quantizers resize theirs on load; batch norm's override keeps the checks)."""
    from torch.nn.parameter import is_lazy

    out: Dict[str, tuple] = {}
    for prefix, module in model.named_modules():
        if (type(module)._load_from_state_dict is not torch.nn.Module._load_from_state_dict
                and not isinstance(module, torch.nn.modules.batchnorm._NormBase)):   # BN only adds the 0-d rule
            continue
        tensors = list(module.named_parameters(recurse=False)) + [
            (n, b) for n, b in module.named_buffers(recurse=False)
            if n not in module._non_persistent_buffers_set]
        for name, t in tensors:
            if t is not None and not is_lazy(t):
                out[f"{prefix}.{name}" if prefix else name] = tuple(t.shape)
    return out


def is_zero1_target(optimizer) -> bool:
    if isinstance(optimizer, dict):
        return "base_state" in optimizer and "shape_info" in optimizer
    if type(optimizer).__name__ in ("ZeroRedundancyOptimizer", "NeuronZero1Optimizer"):
        return True
    try:
        sd = optimizer.state_dict()
    except Exception:  # noqa: BLE001 - an optimizer that cannot produce a state dict is not ZeRO-1
        return False
    return isinstance(sd, dict) and "base_state" in sd and "shape_info" in sd


def check_optimizer(optimizer, osd, saved_zero1: bool, tag: str) -> None:
    if optimizer is None:
        return
    target_zero1 = is_zero1_target(optimizer)
    if isinstance(optimizer, dict) and not optimizer:
        target_zero1 = saved_zero1   # an empty dict accepts either
    if saved_zero1 and not target_zero1:
        raise StateMismatchError(
            f"checkpoint {tag!r} holds ZeRO-1 (DP-sharded) optimizer state but the optimizer is a plain "
            f"{type(optimizer).__name__}: load it into a ZeRO-1 optimizer, or call load_checkpoint without "
            "optimizer= (the model alone loads into any optimizer set-up)")
    if target_zero1 and not saved_zero1:
        raise StateMismatchError(
            f"checkpoint {tag!r} holds a plain (replicated) optimizer state but the optimizer is ZeRO-1 "
            f"({type(optimizer).__name__}); load it into a plain optimizer or call load_checkpoint without optimizer=")
    if isinstance(optimizer, torch.optim.Optimizer):
        missing = [k for k in ("state", "param_groups") if k not in osd]
        if missing:
            raise StateMismatchError(
                f"checkpoint {tag!r} optimizer state has no {missing} (removed by ignore_keys?); a torch optimizer "
                "needs both; ignore 'optim/state/*' entries instead of whole sections")
    if not isinstance(optimizer, dict) and hasattr(optimizer, "param_groups") and "param_groups" in osd:
        have = [len(g["params"]) for g in osd["param_groups"]]
        want = [len(g["params"]) for g in optimizer.param_groups]
        if have != want:
            raise StateMismatchError(
                f"checkpoint {tag!r} optimizer has param groups of sizes {have}, the optimizer has {want}; "
                "build the optimizer over the same parameters as when saving")


def apply_model(model, sd: dict, strict: bool) -> None:
    if isinstance(model, dict):
        # Tensors bound for XLA tensors move in one batched transfer per device (as for a Module below).
        on_xla = {k: model[k] for k, v in sd.items() if isinstance(v, torch.Tensor)
                  and isinstance(model.get(k), torch.Tensor) and model[k].device.type == "xla"}
        placed = _to_devices({k: sd[k] for k in on_xla}, on_xla)
        for k, v in sd.items():
            if k in placed:
                model[k] = placed[k]
            elif k not in model and isinstance(v, torch.Tensor):
                model[k] = v.clone()      # a key new to the dict keeps a tensor of its own (never a file map)
            else:
                model[k] = _place_like(v, model.get(k))
        return
    targets = model.state_dict()
    placed = _to_devices({k: v for k, v in sd.items() if k in targets}, targets)
    sd = dict(sd, **placed)
    model.load_state_dict(sd, strict=False)


def apply_optimizer(optimizer, osd) -> None:
    if isinstance(optimizer, dict):
        for k, v in osd.items():
            optimizer[k] = _place_like(v, optimizer.get(k))
        return
    optimizer.load_state_dict(osd)


def _place_like(loaded, existing):
    """Move loaded tensors onto the device (and dtype) of the tensor they replace, recursively."""
    if isinstance(loaded, torch.Tensor) and isinstance(existing, torch.Tensor):
        if existing.device != loaded.device or existing.dtype != loaded.dtype:
            return loaded.to(device=existing.device, dtype=existing.dtype)
        return loaded
    if isinstance(loaded, dict) and isinstance(existing, dict):
        return type(loaded)((k, _place_like(v, existing.get(k))) for k, v in loaded.items())
    if isinstance(loaded, (list, tuple)) and isinstance(existing, (list, tuple)) and len(loaded) == len(existing):
        return type(loaded)(_place_like(a, b) for a, b in zip(loaded, existing)) if not hasattr(loaded, "_fields") \
            else type(loaded)(*(_place_like(a, b) for a, b in zip(loaded, existing)))
    return loaded


def _to_devices(sd: Dict[str, torch.Tensor], targets: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """Host tensors moved to their targets' devices and dtypes; XLA transfers batched per device."""
    by_device: Dict[torch.device, List[str]] = {}
    out = {}
    for k, v in sd.items():
        t = targets[k]
        if not isinstance(v, torch.Tensor):
            continue
        v = v.to(dtype=t.dtype) if v.dtype != t.dtype else v
        if t.device.type == "xla" and v.device.type == "cpu":
            by_device.setdefault(t.device, []).append(k)
            out[k] = v
        elif t.device.type == "xla" and v.device != t.device:
            out[k] = v.to(t.device)
        else:
            # already on its device: send_cpu_data_to_device would copy.copy it through the host
            out[k] = v
    for dev, keys in by_device.items():
        import torch_xla.core.xla_model as xm

        moved = xm.send_cpu_data_to_device([out[k] for k in keys], dev)
        out.update(zip(keys, moved))
    return out
