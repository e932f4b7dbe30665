"""Planning: the size-balanced split of a DP-replicated shard's tensors over its replicas (save and load use
it), and when a shard's ref data is pickled."""
from __future__ import annotations

import copy
import io

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nxd_ckpt.plan import assign_to_bins


def test_largest_first_to_the_least_loaded():
    # round-robin would give loads 6 and 4; largest-first gives 5 and 5
    assert assign_to_bins([1, 1, 1, 1, 4, 2], 2) == [[2, 4], [0, 1, 3, 5]]
    assert assign_to_bins([5, 5, 5], 3) == [[0], [1], [2]]            # ties: lowest index, lowest bin
    assert assign_to_bins([], 3) == [[], [], []]
    assert assign_to_bins([7, 3], 4) == [[0], [1], [], []]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=10 ** 9), max_size=60), st.integers(min_value=1, max_value=9))
def test_every_tensor_once_and_loads_within_one_tensor(sizes, bins):
    split = assign_to_bins(sizes, bins)
    assert len(split) == bins
    assert sorted(i for b in split for i in b) == list(range(len(sizes)))
    assert all(b == sorted(b) for b in split)
    loads = [sum(sizes[i] for i in b) for b in split]
    assert max(loads) - min(loads) <= max(sizes, default=0)
    assert assign_to_bins(sizes, bins) == split                       # every replica computes the same


def test_bins_must_be_positive():
    import pytest

    with pytest.raises(ValueError, match="bins must be >= 1"):
        assign_to_bins([1], 0)


def test_expert_parallel_shards_write_what_nxd_puts_in_their_folders():
    """ep_rank_00's replicas write every tensor of their file; other EP ranks only their expert tensors (the
    non-expert ones live under ep_rank_00, layout.tensor_home); ZeRO-1 names carry the full DP rank, no ep."""
    import torch

    from nxd_ckpt import layout
    from nxd_ckpt.plan import RefPickle, home_filename, optim_filename, plan_shard, replica_groups
    from parallel_state.topology import Topology

    tensors = [torch.zeros(4), torch.zeros(8), torch.zeros(2), torch.zeros(6)]
    meta = {0: {"expert_model_parallel": True}, 1: {}, 2: {"expert_model_parallel": True}, 3: {}}
    mine = {}
    for ep, replicas in ((0, [0, 2]), (1, [1, 3])):
        name = layout.shard_filename(0, 0, 0, ep)
        for r in replicas:
            mine[r] = plan_shard("model", name, replicas, r, RefPickle.of_bytes(b""), tensors, meta, xser=True).my_tids
    assert sorted(mine[0] + mine[2]) == [0, 1, 2, 3] and not set(mine[0]) & set(mine[2])
    assert sorted(mine[1] + mine[3]) == [0, 2]
    assert layout.tensor_home("model/" + layout.shard_filename(0, 1, 0, 3), expert=False) == \
        "model/" + layout.shard_filename(0, 1, 0, 0)
    assert layout.tensor_home("optim/" + layout.shard_filename(3, 0, 0), expert=False) == \
        "optim/" + layout.shard_filename(3, 0, 0)

    topo = Topology(8, tp=2, ep=2)   # DP=4, EP=2, expert-DP=2
    names = {r: optim_filename(topo, r, zero1=True) for r in range(8)}
    assert names[7] == layout.shard_filename(3, 1, 0) and len(set(names.values())) == 8
    plain = replica_groups(topo, lambda r: optim_filename(topo, r, zero1=False))
    assert plain[layout.shard_filename(0, 1, 0, 1)] == [3, 7]
    homes = replica_groups(topo, home_filename(lambda r: optim_filename(topo, r, zero1=False)))
    assert homes[layout.shard_filename(0, 1, 0, 0)] == [1, 3, 5, 7]   # the DP group shares non-expert reads


def test_zero1_names_under_expert_and_context_parallelism_are_refused():
    """NxD names a ZeRO-1 file by the DP rank alone; with EP and CP > 1 the CP ranks of one DP rank hold different
    expert shards, so the names would collide: refused with the reason. Plain optimizers are named per EP rank."""
    import pytest

    from nxd_ckpt.errors import CheckpointArgumentError
    from nxd_ckpt.plan import model_filename, optim_filename
    from parallel_state.topology import Topology

    t = Topology(8, tp=2, cp=2, ep=2)
    assert optim_filename(t, 2, zero1=False) == model_filename(t, 2) == "dp_rank_00_ep_rank_01_tp_rank_00_pp_rank_00.pt"
    with pytest.raises(CheckpointArgumentError, match="EP=2 with CP=2 .* named by the DP rank alone"):
        optim_filename(t, 0, zero1=True)
    assert optim_filename(Topology(8, tp=2, cp=2), 2, zero1=True) == "dp_rank_00_tp_rank_00_pp_rank_00.pt"


def _optimizer_state(extra):
    return {"state": {0: {"exp_avg": torch.ones(2), "step": torch.tensor(3.0)}},
            "param_groups": [{"lr": 0.1, "betas": [0.9, 0.99], "params": [0], "extra": extra}]}


@pytest.mark.parametrize("extra,deferred", [(["a", 1], True), (np.array([1, 2]), False)], ids=["plain", "array"])
def test_a_mutation_after_planning_never_reaches_the_ref_pickle(extra, deferred):
    """Self-contained ref data is pickled by the writer, later; anything else at call time. Either way the
    bytes are those of the call."""
    import xser
    from nxd_ckpt.capture import build_plan
    from nxd_ckpt.world import current_world

    osd = _optimizer_state(extra)
    want = io.BytesIO()
    xser.dump_refs(xser.to_refs(_optimizer_state(copy.deepcopy(extra)))[0], want)
    plan = build_plan(current_world(), None, osd, None, None, True, False)
    refs = plan.shards[0].refs
    assert refs.pickled is not deferred
    group = osd["param_groups"][0]
    group["lr"] = 5.0
    group["betas"].append(1.0)
    group["extra"][0] = 7
    assert refs.get() == want.getvalue()
