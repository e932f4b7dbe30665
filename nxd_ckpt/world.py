"""Who this process is: global rank, world size, node-local rank and the model-parallel layout.

Reads torch.distributed and parallel_state (ours, or neuronx-distributed's when that is initialized).
Without torch.distributed, a single process is a world of one (handy for tools and benchmarks).
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch.distributed as dist

from parallel_state.topology import Topology


@dataclass(frozen=True)
class World:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    topology: Topology
    distributed: bool

    @property
    def is_root(self) -> bool:
        return self.rank == 0


def current_world() -> World:
    """The current process's place in the job. Called by every rank at save/load time; never blocks."""
    distributed = dist.is_available() and dist.is_initialized()
    rank = dist.get_rank() if distributed else 0
    world_size = dist.get_world_size() if distributed else 1
    local_rank = int(os.environ.get("LOCAL_RANK", rank if not distributed else rank % max(1, world_size)))
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    topology = _current_topology(world_size)
    return World(rank, world_size, local_rank, local_world_size, topology, distributed)


def _current_topology(world_size: int) -> Topology:
    import parallel_state

    if parallel_state.model_parallel_is_initialized():
        topo = parallel_state.get_topology()
        if topo.world_size != world_size:
            raise RuntimeError(
                f"parallel_state was initialized for {topo.world_size} ranks but torch.distributed has "
                f"{world_size}; call parallel_state.initialize_model_parallel again after re-initializing "
                "torch.distributed"
            )
        return topo
    return Topology(world_size)
