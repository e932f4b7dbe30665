"""Model-parallel process groups with neuronx-distributed's names.

``initialize_model_parallel`` creates a torch.distributed group for every tensor-, data-, pipeline-, context-,
expert- and expert-data-parallel group (every rank calls ``new_group`` for every group, in the same order),
plus gloo groups over the world, each DP and each expert-DP group, for host-side collectives that must never be
XLA ones (the CPU ZeRO-1 optimizers of the tests and demo use them; nxd_ckpt itself coordinates through the
c10d store and its own replica groups, not these).

When ``neuronx_distributed.parallel_layers.parallel_state`` has been imported and initialized, the query
functions answer with its values instead of ours, so code written against this module works unchanged in
an NxD training script.
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Dict, List, Optional

import torch.distributed as dist

from .topology import Topology, nxd_layout_choice

NXD_MODULE = "neuronx_distributed.parallel_layers.parallel_state"

_NOT_INITIALIZED = "model parallel is not initialized: call parallel_state.initialize_model_parallel(...) first"

# Our name for each kind of group -> the Topology's name for it.
_KINDS = {
    "tensor_model": "tp",
    "pipeline_model": "pp",
    "data": "dp",
    "context": "cp",
    "expert_model": "ep",
    "expert_data": "edp",
}
# Creation order of the device groups (identical on every rank).
_CREATION_ORDER = ("dp", "edp", "tp", "ep", "pp", "cp")


@dataclass
class _State:
    topology: Topology
    rank: int
    world_pg: Any  # the default group these groups were created under
    groups: Dict[str, Any]  # kind -> this rank's device-backend group
    replica_groups: Dict[str, List[List[int]]]
    host_group: Any
    dp_host_group: Any
    edp_host_group: Any
    created: List[Any] = field(default_factory=list)  # groups we created and this rank belongs to


_STATE: Optional[_State] = None
# Host (gloo) groups made lazily when neuronx-distributed owns the device groups, keyed by the default group.
_DELEGATE_HOST: Dict[str, Any] = {}


# ----------------------------------------------------------------------------------------------------------
# delegation to neuronx-distributed
# ----------------------------------------------------------------------------------------------------------
def _delegate():
    """NxD's parallel_state module when it is imported and initialized, else None.

    Only ``sys.modules`` is consulted: if NxD's parallel_state has not been imported it cannot have been
    initialized, and importing neuronx-distributed just to find that out would be slow.
    """
    mod = sys.modules.get(NXD_MODULE)
    if mod is None:
        return None
    try:
        return mod if mod.model_parallel_is_initialized() else None
    except Exception:  # a broken or half-imported NxD is treated as absent
        return None


def _delegate_call(mod, name: str, *args, **kwargs):
    fn = getattr(mod, name, None)
    if fn is None:
        raise AttributeError(name)
    return fn(*args, **kwargs)


def _delegate_world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _delegate_query(mod, kind: str, what: str):
    """Answer get_<kind>_parallel_<what>() from NxD, filling in what older NxD versions lack."""
    name = f"get_{kind}_parallel_{what}"
    if hasattr(mod, name):
        return _delegate_call(mod, name)
    if kind == "context" and hasattr(mod, f"get_context_model_parallel_{what}"):   # NxD's spelling
        return _delegate_call(mod, f"get_context_model_parallel_{what}")
    if what == "replica_groups" and hasattr(mod, f"get_{kind}_parallel_group"):
        try:
            return _delegate_call(mod, f"get_{kind}_parallel_group", as_list=True)
        except TypeError:  # an NxD whose group getters take no as_list
            pass
    if kind == "expert_data" and what in ("size", "rank") and hasattr(mod, "get_expert_data_parallel_group"):
        # older NxD: expert-data-parallel size/rank are read off the group
        group = _delegate_call(mod, "get_expert_data_parallel_group")
        return dist.get_world_size(group) if what == "size" else dist.get_rank(group)
    if kind in ("context", "expert_model", "expert_data"):
        # an NxD without this kind of parallelism: it is 1 (expert-DP then equals DP)
        if kind == "expert_data":
            return _delegate_query(mod, "data", what)
        world = _delegate_world_size()
        if what == "size":
            return 1
        if what == "rank":
            return 0
        if what == "replica_groups":
            return [[r] for r in range(world)]
    if what == "replica_groups":
        # an NxD that does not list its groups: they are the row-major grid's
        return _grid_topology(mod).groups(_KINDS[kind])
    raise RuntimeError(
        f"the initialized neuronx-distributed parallel_state has no {name}(); "
        "upgrade neuronx-distributed or initialize parallel_state from nxd-ckpt instead"
    )


# ----------------------------------------------------------------------------------------------------------
# initialize / destroy
# ----------------------------------------------------------------------------------------------------------
def _current_state() -> Optional[_State]:
    """Our state, or None when it is missing or stale (torch.distributed destroyed or re-initialized)."""
    state = _STATE
    if state is None:
        return None
    if not (dist.is_available() and dist.is_initialized()) or dist.group.WORLD is not state.world_pg:
        return None
    return state


def _require_state() -> _State:
    state = _current_state()
    if state is None:
        raise RuntimeError(_NOT_INITIALIZED)
    return state


def _platform_target() -> Optional[str]:
    """torch-neuronx's platform target ("trn1", "trn2", ...), or None off Neuron hardware."""
    try:
        from torch_neuronx.utils import get_platform_target
    except Exception:  # torch-neuronx is optional: not installed means not on Neuron hardware
        return None
    try:
        return str(get_platform_target())
    except Exception:  # no Neuron device visible
        return None


def _local_world_size(world_size: int) -> int:
    """Ranks per node, as NxD reads it (LOCAL_WORLD_SIZE, set by torchrun; the world when unset)."""
    try:
        return int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    except ValueError:
        raise ValueError(f"LOCAL_WORLD_SIZE={os.environ['LOCAL_WORLD_SIZE']!r} is not an integer") from None


def initialize_model_parallel(
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    context_parallel_size: int = 1,
    expert_model_parallel_size: int = 1,
    *,
    lnc_size: int = 1,
    rank_layout: Optional[str] = None,
    host_timeout_s: float = 600,
) -> None:
    """Create the model-parallel groups. Every rank must call this, with the same arguments.

    ``rank_layout`` places the ranks: "row_major" (``[PP, DP, CP, TP]``, TP fastest), "trn1_tp4" or "trn2"
    (NxD's node-aware layouts; see :mod:`parallel_state.topology`, which reads ``LOCAL_WORLD_SIZE``).
    ``None`` chooses as neuronx-distributed does: on Neuron hardware (torch-neuronx importable) "trn1_tp4"
    for TP=4 on Trn1 and "trn2" for TP=64 with ``lnc_size=1`` or TP=32 with ``lnc_size=2`` on Trn2, else
    "row_major". Besides one device-backend group per TP/DP/PP/CP/EP/expert-DP group, it makes gloo groups
    (timeout ``host_timeout_s``) over the world, each DP group and each expert-DP group, for host-side
    collectives (the CPU ZeRO-1 optimizers use them).
    """
    global _STATE
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "torch.distributed is not initialized: call torch.distributed.init_process_group first, e.g. under "
            "torchrun with backend 'gloo' on CPU or 'xla' on Trainium, then initialize_model_parallel(...)"
        )
    if _current_state() is not None:
        raise RuntimeError(
            "model parallel is already initialized: call parallel_state.destroy_model_parallel() before "
            "initializing it again"
        )
    world_size = dist.get_world_size()
    rank = dist.get_rank()
    if rank_layout is None:
        rank_layout = nxd_layout_choice(_platform_target(), tensor_model_parallel_size, lnc_size, world_size)
    topo = Topology(
        world_size,
        tp=tensor_model_parallel_size,
        pp=pipeline_model_parallel_size,
        cp=context_parallel_size,
        ep=expert_model_parallel_size,
        layout=rank_layout,
        local_world_size=_local_world_size(world_size),
    )
    timeout = timedelta(seconds=host_timeout_s)
    default_is_gloo = dist.get_backend() == "gloo"
    created: List[Any] = []

    def make(ranks: List[int], **kw):
        group = dist.new_group(ranks=ranks, **kw)
        if rank in ranks:
            created.append(group)
        return group

    replica_groups = {kind: topo.groups(kind) for kind in _CREATION_ORDER}
    groups: Dict[str, Any] = {}
    for kind in _CREATION_ORDER:
        for ranks in replica_groups[kind]:
            group = make(ranks)
            if rank in ranks:
                groups[kind] = group

    if default_is_gloo:
        host_group = dist.group.WORLD
        dp_host_group = groups["dp"]
        edp_host_group = groups["edp"]
    else:
        host_group = make(list(range(world_size)), backend="gloo", timeout=timeout)
        dp_host_group = edp_host_group = None
        for ranks in replica_groups["dp"]:
            group = make(ranks, backend="gloo", timeout=timeout)
            if rank in ranks:
                dp_host_group = group
        for ranks in replica_groups["edp"]:
            group = make(ranks, backend="gloo", timeout=timeout)
            if rank in ranks:
                edp_host_group = group

    _STATE = _State(
        topology=topo,
        rank=rank,
        world_pg=dist.group.WORLD,
        groups=groups,
        replica_groups=replica_groups,
        host_group=host_group,
        dp_host_group=dp_host_group,
        edp_host_group=edp_host_group,
        created=created,
    )


def destroy_model_parallel() -> None:
    """Forget (and, while torch.distributed is still up, destroy) the groups made by initialize_model_parallel."""
    global _STATE
    state, _STATE = _STATE, None
    _DELEGATE_HOST.clear()
    if state is None:
        return
    if dist.is_available() and dist.is_initialized() and dist.group.WORLD is state.world_pg:
        for group in state.created:
            try:
                dist.destroy_process_group(group)
            except Exception:  # already gone: nothing left to release
                pass


def model_parallel_is_initialized() -> bool:
    """True when our groups, or neuronx-distributed's, are initialized."""
    return _delegate() is not None or _current_state() is not None


def get_topology() -> Topology:
    """The current layout, from our state or from neuronx-distributed's when that is initialized."""
    mod = _delegate()
    if mod is not None:
        return _delegate_topology(mod)
    return _require_state().topology


def _grid_topology(mod) -> Topology:
    """The Topology with NxD's sizes (not checked against how NxD actually laid out its groups)."""
    return Topology(
        _delegate_world_size(),
        tp=_delegate_query(mod, "tensor_model", "size"),
        pp=_delegate_query(mod, "pipeline_model", "size"),
        cp=_delegate_query(mod, "context", "size"),
        ep=_delegate_query(mod, "expert_model", "size"),
    )


def _delegate_topology(mod) -> Topology:
    """NxD's layout, from its own group lists (whatever permutation they are), checked against this rank's
    own ``get_*_rank()`` answers so that file names always agree with NxD's."""
    grid = _grid_topology(mod)
    lists = {}
    for kind, short in _KINDS.items():
        try:
            lists[short] = _delegate_query(mod, kind, "replica_groups")
        except Exception:  # an NxD that cannot list its groups: the row-major grid is all we know
            return grid
    if any(len(lists[k]) * len(lists[k][0]) != grid.world_size for k in lists if lists[k]):
        return grid   # compressed replica groups (NEURON_EXPERIMENTAL_COMPRESS_RG lists only the first)
    logic = getattr(getattr(mod, "_REPLICA_LOGIC", None), "name", "")
    # NxD's "logic 2" (trn2) answers DP and PP ranks with list positions, every other rank through torch
    # (the position in the sorted group).
    ranked = {"dp", "pp"} if logic == "LOGIC2" else set()
    topo = Topology.from_groups(lists, position_ranked=ranked, local_world_size=_local_world_size(grid.world_size))
    if dist.is_available() and dist.is_initialized():
        rank = dist.get_rank()
        for kind, short in _KINDS.items():
            theirs = _delegate_query(mod, kind, "rank")
            if theirs != topo.rank_in(short, rank):
                raise RuntimeError(
                    f"neuronx-distributed says this rank ({rank}) has {kind} parallel rank {theirs}, but its "
                    f"{kind} group list {topo.group_of(short, rank)} puts it at {topo.rank_in(short, rank)}; "
                    "nxd-ckpt names files by NxD's ranks and cannot tell how this NxD counts them. Please report "
                    "this with your NxD version and parallel sizes")
    return topo


# ----------------------------------------------------------------------------------------------------------
# queries
# ----------------------------------------------------------------------------------------------------------
def _query(kind: str, what: str):
    mod = _delegate()
    if mod is not None:
        return _delegate_query(mod, kind, what)
    state = _require_state()
    short = _KINDS[kind]
    topo = state.topology
    if what == "size":
        return {"tp": topo.tp, "pp": topo.pp, "dp": topo.dp, "cp": topo.cp, "ep": topo.ep, "edp": topo.edp}[short]
    if what == "rank":
        return topo.rank_in(short, state.rank)
    if what == "group":
        return state.groups[short]
    if what == "replica_groups":
        return [list(g) for g in state.replica_groups[short]]
    raise AssertionError(what)


def _group(kind: str, as_list: bool):
    if as_list:
        return _query(kind, "replica_groups")
    mod = _delegate()
    if mod is not None:
        name = f"get_{kind}_parallel_group"
        if kind == "context" and not hasattr(mod, name) and hasattr(mod, "get_context_model_parallel_group"):
            name = "get_context_model_parallel_group"   # NxD's spelling
        if not hasattr(mod, name):
            raise RuntimeError(
                f"the initialized neuronx-distributed parallel_state has no {name}(); it does not support "
                f"{kind.replace('_', ' ')} parallelism"
            )
        return _delegate_call(mod, name)
    return _query(kind, "group")


def get_tensor_model_parallel_rank() -> int:
    return _query("tensor_model", "rank")


def get_tensor_model_parallel_size() -> int:
    return _query("tensor_model", "size")


def get_tensor_model_parallel_group(as_list: bool = False):
    return _group("tensor_model", as_list)


def get_tensor_model_parallel_replica_groups() -> List[List[int]]:
    return _query("tensor_model", "replica_groups")


def get_pipeline_model_parallel_rank() -> int:
    return _query("pipeline_model", "rank")


def get_pipeline_model_parallel_size() -> int:
    return _query("pipeline_model", "size")


def get_pipeline_model_parallel_group(as_list: bool = False):
    return _group("pipeline_model", as_list)


def get_pipeline_model_parallel_replica_groups() -> List[List[int]]:
    return _query("pipeline_model", "replica_groups")


def get_data_parallel_rank() -> int:
    return _query("data", "rank")


def get_data_parallel_size() -> int:
    return _query("data", "size")


def get_data_parallel_group(as_list: bool = False):
    return _group("data", as_list)


def get_data_parallel_replica_groups() -> List[List[int]]:
    return _query("data", "replica_groups")


def get_context_parallel_rank() -> int:
    return _query("context", "rank")


def get_context_parallel_size() -> int:
    return _query("context", "size")


def get_context_parallel_group(as_list: bool = False):
    return _group("context", as_list)


def get_context_parallel_replica_groups() -> List[List[int]]:
    return _query("context", "replica_groups")


def get_expert_model_parallel_rank() -> int:
    return _query("expert_model", "rank")


def get_expert_model_parallel_size() -> int:
    return _query("expert_model", "size")


def get_expert_model_parallel_group(as_list: bool = False):
    return _group("expert_model", as_list)


def get_expert_model_parallel_replica_groups() -> List[List[int]]:
    return _query("expert_model", "replica_groups")


def get_expert_data_parallel_rank() -> int:
    return _query("expert_data", "rank")


def get_expert_data_parallel_size() -> int:
    return _query("expert_data", "size")


def get_expert_data_parallel_group(as_list: bool = False):
    return _group("expert_data", as_list)


def get_expert_data_parallel_replica_groups() -> List[List[int]]:
    return _query("expert_data", "replica_groups")


# ----------------------------------------------------------------------------------------------------------
# host-side coordination
# ----------------------------------------------------------------------------------------------------------
def _delegate_host_groups(mod) -> Dict[str, Any]:
    """Gloo groups beside neuronx-distributed's device groups, made on first use.

    Collective: the first call must happen on every rank at the same point (as a checkpoint save does).
    """
    world_pg = dist.group.WORLD
    if _DELEGATE_HOST.get("world_pg") is not world_pg:
        _DELEGATE_HOST.clear()
        rank = dist.get_rank()
        out: Dict[str, Any] = {"world_pg": world_pg}
        if dist.get_backend() == "gloo":
            out["host"] = world_pg
            out["dp"] = _delegate_call(mod, "get_data_parallel_group")
            edp = getattr(mod, "get_expert_data_parallel_group", None)
            out["edp"] = edp() if edp is not None else out["dp"]
        else:
            timeout = timedelta(seconds=600)
            out["host"] = dist.new_group(ranks=list(range(dist.get_world_size())), backend="gloo", timeout=timeout)
            for kind, short in (("data", "dp"), ("expert_data", "edp")):
                for ranks in _delegate_query(mod, kind, "replica_groups"):
                    group = dist.new_group(ranks=sorted(ranks), backend="gloo", timeout=timeout)
                    if rank in ranks:
                        out[short] = group
        _DELEGATE_HOST.update(out)
    return _DELEGATE_HOST


def get_host_group():
    """A gloo group over all ranks for host-side coordination (never an XLA collective)."""
    mod = _delegate()
    if mod is not None:
        return _delegate_host_groups(mod)["host"]
    return _require_state().host_group


def get_data_parallel_host_group():
    """A gloo group over this rank's data-parallel group."""
    mod = _delegate()
    if mod is not None:
        return _delegate_host_groups(mod)["dp"]
    return _require_state().dp_host_group


def get_expert_data_parallel_host_group():
    """A gloo group over this rank's expert-data-parallel group."""
    mod = _delegate()
    if mod is not None:
        return _delegate_host_groups(mod)["edp"]
    return _require_state().edp_host_group


def get_store():
    """The default process group's c10d store (a TCPStore under torchrun)."""
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "torch.distributed is not initialized: call torch.distributed.init_process_group first"
        )
    from torch.distributed.distributed_c10d import _get_default_store

    return _get_default_store()
