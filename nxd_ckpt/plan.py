"""Which tensors this rank writes, to which files. Pure: moves no bytes, talks to no one.

Every rank computes the same plan from the topology, so replicas of a DP-replicated shard agree on
who writes what without exchanging a message: the tensors of a shard are spread over its replicas
largest-first onto the least-loaded replica, and the first replica writes the ref and info files.
"""
from __future__ import annotations

import io
import threading
from dataclasses import dataclass, field
from typing import Any, Collection, Dict, List, Optional, Sequence

import torch

import xser

from parallel_state.topology import Topology

from . import layout
from .errors import CheckpointArgumentError


def assign_to_bins(sizes: Sequence[int], bins: int) -> List[List[int]]:
    """Indices of ``sizes`` split into ``bins`` lists with near-equal totals (largest first, to the
    least-loaded bin, lowest bin index on ties). Deterministic, so every replica computes the same split."""
    if bins < 1:
        raise ValueError("bins must be >= 1")
    if bins == 1:
        return [list(range(len(sizes)))]
    out: List[List[int]] = [[] for _ in range(bins)]
    load = [0] * bins
    order = sorted(range(len(sizes)), key=lambda i: (-sizes[i], i))
    for i in order:
        b = min(range(bins), key=lambda k: (load[k], k))
        out[b].append(i)
        load[b] += sizes[i]
    for b in out:
        b.sort()
    return out


def tensor_nbytes(t: torch.Tensor) -> int:
    return t.nbytes


def model_filename(topo: Topology, rank: int) -> str:
    c = topo.coords(rank)
    ep = topo.expert_coords(rank).ep if topo.ep > 1 else None
    return layout.shard_filename(0, c.tp, c.pp, ep)


def optim_filename(topo: Topology, rank: int, zero1: bool, legacy_ep: bool = False) -> str:
    """A ZeRO-1 shard is named by the full DP rank, with no ep field even under expert parallelism (NxD);
    a plain optimizer shard is named like the model's. ``legacy_ep``: the name nxd-ckpt gave a ZeRO-1 shard
    under EP before it took NxD's layout (``layout.legacy_ep_folders``; read, never written): by expert-DP
    and EP rank."""
    if not zero1:
        return model_filename(topo, rank)
    if legacy_ep and topo.ep > 1:
        e = topo.expert_coords(rank)
        return layout.shard_filename(e.edp, e.tp, e.pp, e.ep)
    if topo.ep > 1 and topo.cp > 1:
        raise CheckpointArgumentError(
            f"a ZeRO-1 optimizer at EP={topo.ep} with CP={topo.cp} cannot be checkpointed in NxD's layout: its files "
            "are named by the DP rank alone, but the CP ranks that share a DP rank hold different expert shards "
            "(NxD's expert view [PP, EDP, EP, TP] folds CP into EP and expert-DP, so those ranks have different "
            "EP or expert-DP ranks) and their files would overwrite each other. Use a plain (non-ZeRO-1) "
            "optimizer, or context_parallel_size=1 or expert_model_parallel_size=1")
    c = topo.coords(rank)
    return layout.shard_filename(c.dp, c.tp, c.pp)


def home_filename(name_of, home=layout.tensor_home):
    """``name_of`` mapped to the shard whose folder holds its non-expert tensors (``home``: layout.tensor_home,
    which sets the ep field to 0, or layout.own_home for the legacy EP layout)."""
    return lambda r: home(name_of(r), False)


def replica_groups(topo: Topology, name_of) -> Dict[str, List[int]]:
    """Map file name -> sorted global ranks that hold identical content for it (they share the name)."""
    groups: Dict[str, List[int]] = {}
    for r in range(topo.world_size):
        groups.setdefault(name_of(r), []).append(r)
    return groups


class RefPickle:
    """A shard's ref data and its pickle. Pickled when made, unless ``deferred``: the ref data is
    self-contained (``xser.TracedRefs.self_contained``: fresh containers of references and immutable values,
    which nothing the caller does can change), so the writer that first needs the bytes pickles it, off the
    caller's stall (5,000 tensors: 8-15 ms)."""

    def __init__(self, ref_data: Any, deferred: bool = False):
        self._data: Any = ref_data if deferred else None
        self._bytes: Optional[bytes] = None
        self._lock = threading.Lock()
        if not deferred:
            self._bytes = self._pickle(ref_data)

    @classmethod
    def of_bytes(cls, data: bytes) -> "RefPickle":
        made = cls(None, deferred=True)
        made._bytes = data
        return made

    @staticmethod
    def _pickle(ref_data: Any) -> bytes:
        buf = io.BytesIO()
        xser.dump_refs(ref_data, buf)
        return buf.getvalue()

    @property
    def pickled(self) -> bool:
        return self._bytes is not None

    def get(self) -> bytes:
        """The pickle's bytes (any thread; pickled once)."""
        with self._lock:
            if self._bytes is None:
                self._bytes = self._pickle(self._data)
            return self._bytes

    def data(self) -> Any:
        """The ref data: the self-contained copy itself, or else the call-time pickle read back."""
        if self._data is not None:
            return self._data
        return xser.load_refs(io.BytesIO(self.get()), trusted=True)    # trusted: pickled by this process


@dataclass
class ShardPlan:
    """One shard file (model/ or optim/) as seen from one rank."""

    folder: str                    # "model" or "optim"
    filename: str                  # dp_rank_.._tp_rank_.._pp_rank_...pt
    replicas: List[int]            # global ranks with identical content, sorted
    my_index: int                  # this rank's position in replicas
    refs: RefPickle                # the pickled ref data (made at call time, or its self-contained copy)
    tensors: List[torch.Tensor]    # by tid (device or host); only my_tids are staged
    my_tids: List[int]
    tensor_meta: Dict[int, dict] = field(default_factory=dict)
    xser: bool = True

    @property
    def relpath(self) -> str:
        return f"{self.folder}/{self.filename}"

    @property
    def writes_ref(self) -> bool:
        return self.my_index == 0


def plan_shard(folder: str, filename: str, replicas: List[int], rank: int, refs: RefPickle,
               tensors: List[torch.Tensor], tensor_meta: Dict[int, dict], xser: bool,
               skip: Collection[int] = ()) -> ShardPlan:
    """This rank's share of one shard: with xser its bin of tensor files; without, all or nothing. An
    expert-parallel shard other than ep_rank_00 writes only its expert tensors (layout.tensor_home); the
    ``skip`` tids are not written at all (their data is saved elsewhere: avoid_saving_lower_precision_weights)."""
    my_index = replicas.index(rank)
    if xser:
        here = {e: layout.tensor_home(filename, e) == filename for e in (False, True)}
        own = [t for t in range(len(tensors)) if t not in skip and here[layout.is_expert(tensor_meta.get(t))]]
        bins = assign_to_bins([tensor_nbytes(tensors[t]) for t in own], len(replicas))
        my_tids = sorted(own[i] for i in bins[my_index])
    else:
        my_tids = list(range(len(tensors))) if my_index == 0 else []
    return ShardPlan(folder, filename, replicas, my_index, refs, tensors, my_tids, tensor_meta, xser)


@dataclass
class DcpPart:
    """use_zero1_dcp=True: this rank's data file of the optimizer's torch.distributed.checkpoint."""

    relpath: str                 # optim/__{rank}_0.distcp
    items: list                  # zero1_dcp.Item, in file order

    def tensors(self) -> List[torch.Tensor]:
        return [it.tensor for it in self.items if it.tensor is not None]


@dataclass
class SavePlan:
    """Everything one rank writes for one checkpoint."""

    shards: List[ShardPlan]
    small_files: Dict[str, bytes]          # relpath -> bytes (scheduler.pt, user_content.pt), rank 0
    topology: Topology
    zero1: bool
    xser: bool
    has_model: bool
    has_optim: bool
    model_from_masters: bool = False     # avoid_saving_lower_precision_weights took effect
    dcp: Optional[DcpPart] = None        # use_zero1_dcp=True: the optimizer as a torch.distributed.checkpoint

    def staged_tensors(self) -> List[torch.Tensor]:
        """The tensors this rank must copy to host, in write order: the use_zero1_dcp file's, then each shard's."""
        out = self.dcp.tensors() if self.dcp is not None else []
        for s in self.shards:
            out.extend(s.tensors[i] for i in s.my_tids)
        return out


def partition_info(tensor: torch.Tensor) -> Optional[dict]:
    """NxD's tensor-parallel partition attributes of a parameter, or None when it has none."""
    if not getattr(tensor, "tensor_model_parallel", False):
        return None
    return {
        "tensor_model_parallel": True,
        "partition_dim": int(getattr(tensor, "partition_dim", 0)),
        "partition_stride": int(getattr(tensor, "partition_stride", 1)),
    }
