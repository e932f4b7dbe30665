"""The neuronx-distributed compatible entry points. Validates arguments; the work lives elsewhere."""
from __future__ import annotations

import contextlib
import gc
import glob
import logging
import time
from typing import List, Optional

from . import commit, hostgroups
from .capture import build_plan, validate_save_args
from .coord import peer_grace
from .engine import get_engine
from .errors import CheckpointArgumentError, CorruptCheckpointError, RankFailureError
from .loader import (agree, agreed_candidates, apply_ignore_keys, apply_model, apply_optimizer, check_model,
                     check_optimizer, copies_every_tensor, read_tag)
from .storage import check_location, open_storage
from .storage.listed import listed
from .storage.s3 import S3Error
from .world import current_world

log = logging.getLogger("nxd_ckpt")

DEFAULT_TIMEOUT_S = 1800.0

#: No garbage collection while the caller is blocked in the snapshot (``_collections_held``); False: the
#: collector runs whenever allocations trigger it (the A/B lever ``gcpause`` of scripts/ab_commit.py).
HOLD_GC_IN_STALL = True


@contextlib.contextmanager
def _collections_held():
    """Hold the garbage collector while the caller is blocked planning and copying to host. A save of many
    tensors allocates tens of thousands of objects there: dozens of young collections and, every few saves, a
    full one of the whole training process's heap (0.2-0.3 s for this benchmark's 450,000 objects), which then
    lands in the stall. Held, the stall's objects are examined by one young collection at the next allocation
    after it, and a full collection, when due, runs outside the stall. The caller's own setting is restored
    (a loop that manages collections itself keeps doing so)."""
    held = HOLD_GC_IN_STALL and gc.isenabled()
    if held:
        gc.disable()
    try:
        yield
    finally:
        if held:
            gc.enable()


def save_checkpoint(checkpoint_dir_str, tag, model=None, optimizer=None, scheduler=None, user_content=None,
                    num_workers=8, use_xser=False, num_kept_ckpts=None, async_save=False, zero1_optimizer=False,
                    use_zero1_dcp=False, avoid_saving_lower_precision_weights=False,
                    *, host_memory_budget: Optional[int] = None, device_snapshot: bool = False,
                    keep_host_buffers: bool = True, reuse_retired_files: bool = True,
                    timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
    """Save a checkpoint under ``checkpoint_dir_str/tag`` in NxD's layout. Every rank calls it.

    Blocks for: argument checks, pickling small state, and the device-to-host snapshot of this rank's
    share of the tensors (with ``device_snapshot=True`` only for an on-device clone); Python's garbage collector
    is held while it plans and copies to host, then left as the caller had it. With
    ``async_save=False`` it then blocks until the checkpoint is committed (``done`` written) and raises
    any rank's failure; with ``async_save=True`` it returns, and a failure is raised on every rank by the
    next save_checkpoint or finalize_checkpoint. Ranks coordinate through the c10d store, never with a
    collective on the training group.

    ``keep_host_buffers=True`` keeps the host buffers of the snapshot after the save (at most
    ``host_memory_budget`` bytes) so the next save of the same shapes reuses them instead of faulting in
    fresh memory; ``False`` frees them when this save's files are written (and drops those kept so far).
    :func:`release_host_buffers` frees them at any time.

    ``reuse_retired_files=True`` (a filesystem checkpoint_dir): the tag ``num_kept_ckpts`` retention removes is
    kept in ``checkpoint_dir/.nxd_ckpt_reuse/`` until the next save, which renames it to its staging directory and
    overwrites its files in place instead of creating new files (``nxd_ckpt.reuse``: file creation is most of the
    CPU of writing small files); ``False`` deletes it, and empties that folder.
    """
    called_at = time.monotonic()
    tag = validate_save_args(checkpoint_dir_str, tag, model, optimizer, scheduler, num_workers, use_xser,
                             num_kept_ckpts, async_save, zero1_optimizer, use_zero1_dcp,
                             avoid_saving_lower_precision_weights)
    root = check_location(checkpoint_dir_str)
    storage = open_storage(root, timeout_s=timeout_s, workers=num_workers)
    storage.check_writable("checkpoint_dir")
    storage.beside_training = async_save
    if host_memory_budget is not None and (not isinstance(host_memory_budget, int) or host_memory_budget <= 0):
        raise CheckpointArgumentError(f"host_memory_budget must be a positive number of bytes, got {host_memory_budget!r}")
    if not isinstance(keep_host_buffers, bool):
        raise CheckpointArgumentError(f"keep_host_buffers must be True or False, got {keep_host_buffers!r}")
    if not isinstance(reuse_retired_files, bool):
        raise CheckpointArgumentError(f"reuse_retired_files must be True or False, got {reuse_retired_files!r}")
    engine = get_engine()
    engine.raise_pending()
    world = current_world()
    with _collections_held():
        plan = build_plan(world, model, optimizer, scheduler, user_content, use_xser, zero1_optimizer,
                          avoid_saving_lower_precision_weights, use_zero1_dcp)
        job = engine.start_job(world, storage, tag, plan, num_kept_ckpts, num_workers, timeout_s,
                               host_memory_budget, called_at, keep_host_buffers, reuse_retired_files)
        if not device_snapshot:
            engine.snapshot(job, plan, on_device=False, timeout_s=timeout_s)
    if device_snapshot:
        # Outside the hold: the clones start the background copy, whose allocations would pile up uncollected
        # until the hold ended and then be collected at once at the end of the stall.
        engine.snapshot(job, plan, on_device=True, timeout_s=timeout_s)
    job.stats.stall_s = time.monotonic() - called_at
    job.stats.ordering_wait_s = engine.last_ordering_wait_s
    engine.last_ordering_wait_s = 0.0
    if not async_save:
        engine.wait(job, timeout_s + 60)


def finalize_checkpoint(*, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
    """Block until every save in flight on this rank is committed or failed; raise a failure once.
    Every rank calls it (e.g. at the end of training). No collectives."""
    get_engine().finalize(timeout_s)


def release_host_buffers() -> int:
    """Free the snapshot buffers this process keeps between saves (``keep_host_buffers=True``) and the direct
    writes' bounce buffers not in use; buffers of saves still in flight are freed when their files are written.
    Returns the bytes freed now. Any thread,
    any time; no communication. The next save allocates (and keeps) its buffers again."""
    return get_engine().release_buffers()


def load_checkpoint(path, tag=None, model=None, optimizer=None, scheduler=None, num_workers=8, strict=True,
                    use_zero1_dcp=False, *, ignore_keys=None, trusted: bool = False, node_local: bool = False,
                    reshard: bool = True, timeout_s: float = DEFAULT_TIMEOUT_S):
    """Load ``path/tag`` (newest complete when ``tag`` is None) into the given objects; return the saved
    user_content or None. Every rank calls it; ranks exchange shares over a host gloo group.

    Everything is read and verified first; nothing is changed unless every rank read its part intact.
    With ``tag=None`` a damaged checkpoint is skipped with a warning and the next newest one is used.
    Pickles are loaded with ``weights_only=True`` unless ``trusted=True``. Each file of a DP-replicated
    shard is read by one replica and broadcast to the others, unless ``node_local=True`` (every node holds
    its own copy of the checkpoint on local disk: each rank reads its own files). A checkpoint saved at
    other TP / PP / ZeRO-1 DP sizes is resharded into this job's sizes (needs ``model``); ``reshard=False``
    refuses it with TopologyMismatchError instead.
    ``timeout_s``: the deadline of this rank's storage requests on S3 (past it the load raises
    RankFailureError, and the other ranks raise the same cause); an exchange waits for another rank
    ``timeout_s`` plus a grace of min(timeout_s, 60 s) (the same value on every rank), then every waiting
    rank raises RankFailureError. Only rank 0 lists the checkpoint directory.
    """
    root = check_location(path)
    if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 1:
        raise CheckpointArgumentError(f"num_workers must be a positive int, got {num_workers!r}")
    if not isinstance(use_zero1_dcp, bool):
        raise CheckpointArgumentError(f"use_zero1_dcp must be True or False, got {use_zero1_dcp!r}")
    if not isinstance(reshard, bool):
        raise CheckpointArgumentError(f"reshard must be True or False, got {reshard!r}")
    storage = open_storage(root, timeout_s=timeout_s, workers=num_workers)
    try:
        # A peer's exchange waits past this rank's storage deadline (timeout_s), so that it receives this
        # rank's storage failure rather than timing out at the same moment.
        with hostgroups.timeout(timeout_s + peer_grace(timeout_s)):
            return _load_newest(storage, tag, model, optimizer, scheduler, num_workers, strict, ignore_keys,
                                trusted, node_local, reshard)
    except S3Error as exc:
        raise RankFailureError(f"load_checkpoint from {root}: {exc}. Nothing was changed on this rank") from exc
    except RuntimeError as exc:
        if "timed out" not in str(exc).lower() and "timeout" not in str(exc).lower():
            raise
        raise RankFailureError(
            f"load_checkpoint from {root}: another rank did not answer within {timeout_s + peer_grace(timeout_s):.0f}s (hung or "
            f"dead): {str(exc).splitlines()[0]}. Nothing was changed on this rank; check the other ranks' logs") from exc


def _load_newest(storage, tag, model, optimizer, scheduler, num_workers, strict, ignore_keys, trusted,
                 node_local, reshard):
    tags = agreed_candidates(storage, tag, node_local)
    world = current_world()
    engine = get_engine()
    last_error = None
    for candidate in tags:
        engine.loading.add(candidate)
        try:
            return _load_one(storage, candidate, world, model, optimizer, scheduler, num_workers, strict,
                             ignore_keys, trusted, node_local, reshard)
        except CorruptCheckpointError as exc:
            if tag is not None:
                raise
            last_error = exc
            log.warning("nxd_ckpt: skipping damaged checkpoint %s: %s", candidate, exc)
        finally:
            engine.loading.discard(candidate)
    raise CorruptCheckpointError(
        f"every complete checkpoint in {storage.root} is damaged; the last error: {last_error}. "
        "Run `nxd-ckpt verify` on the directory for details")


def _load_one(storage, tag, world, model, optimizer, scheduler, num_workers, strict, ignore_keys, trusted,
              node_local, reshard):
    state = read_tag(storage, tag, world, want_model=model is not None, want_optim=optimizer is not None,
                     want_scheduler=scheduler is not None, num_workers=num_workers, trusted=trusted,
                     mapped=copies_every_tensor(model, optimizer), node_local=node_local, model=model,
                     optimizer=optimizer, reshard=reshard)
    error = None
    try:
        patterns = apply_ignore_keys(state, ignore_keys)
        # model tensors with neither data nor a master weight keep the target's value (as NxD)
        patterns += [f"model/{glob.escape(k)}" for k in state.get("model_unsaved", [])]
        if model is not None:
            check_model(model, state["model"], strict, patterns)
        if optimizer is not None:
            check_optimizer(optimizer, state["optim"], bool(state["saved"].get("zero1")), tag)
    except Exception as exc:  # noqa: BLE001 - agreed on by every rank before anything changes
        error = exc
    agree(error)
    # Model before optimizer: a ZeRO-1 optimizer without saved master weights re-shards from the params.
    if model is not None:
        apply_model(model, state["model"], strict)
    if optimizer is not None:
        apply_optimizer(optimizer, state["optim"])
    if scheduler is not None:
        scheduler.load_state_dict(state["scheduler"])
    if world.is_root:
        log.info("nxd_ckpt: loaded checkpoint %s from %s", tag, storage.root)
    return state.get("user_content")


def has_checkpoint(checkpoint_dir_str) -> bool:
    """True when the directory holds at least one complete checkpoint."""
    return bool(list_checkpoints(checkpoint_dir_str))


def list_checkpoints(checkpoint_dir_str) -> List[str]:
    """Complete tags, newest first (by commit time); each loads with ``load_checkpoint(dir, tag)``. On an
    object store the directory is listed once (``storage.listed``: on S3 one LIST per 1,000 keys and no
    request per tag); a POSIX directory is asked tag by tag (no walk of every tensor file)."""
    storage = open_storage(check_location(checkpoint_dir_str))
    if not storage.caps.local:
        storage = listed(storage)
    if not storage.isdir(""):
        return []
    return [tag for tag, _ in commit.loadable(storage)]


def newest_checkpoint(checkpoint_dir_str) -> Optional[str]:
    """The newest complete tag, or None."""
    tags = list_checkpoints(checkpoint_dir_str)
    return tags[0] if tags else None


def save_stats() -> List[dict]:
    """Per-save statistics of this process (stall_s, commit_s, bytes, files, ...), oldest first."""
    return [s.as_dict() for s in get_engine().history]
