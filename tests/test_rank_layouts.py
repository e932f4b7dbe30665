"""NxD's node-aware rank layouts on 8 ranks: file names follow NxD's get_*_rank() answers, and a ZeRO-1 run
saves, loads and resumes bit for bit.

On two "nodes" of 4 (LOCAL_WORLD_SIZE=4) NxD's own triggers cannot show a permutation (TP=4 on Trn1 gives
L = LOCAL_WORLD_SIZE/TP = 1, the identity; Trn2's needs TP=32/64), so the layouts are chosen explicitly at TP=2,
where the same arithmetic does: ``trn1_tp4`` puts TP groups 2 apart inside each node, ``trn2`` pairs rows 0 and 3
of each node and counts DP ranks by list position. ``trn1_tp4`` at NxD's own TP=4 runs on one node of 8.
tests/test_topology.py checks both layouts at full size."""
from __future__ import annotations

import json
import os

import pytest
import torch

from harness import run_ranks
from tiny_models import TinyShard, all_files, assert_bit_equal, sync, to_cpu_state

# rank -> (tp, dp) as NxD 2.29 answers them
EXPECTED = {
    # TP groups [0, 2], [1, 3], [4, 6], [5, 7]; DP groups [0, 1, 4, 5], [2, 3, 6, 7]
    "trn1_tp4": {0: (0, 0), 1: (0, 1), 2: (1, 0), 3: (1, 1), 4: (0, 2), 5: (0, 3), 6: (1, 2), 7: (1, 3)},
    # TP groups [0, 3], [1, 2], [4, 7], [5, 6]; DP groups [0, 1, 4, 5], [3, 2, 7, 6] (list positions)
    "trn2": {0: (0, 0), 1: (0, 1), 2: (1, 1), 3: (1, 0), 4: (0, 2), 5: (0, 3), 6: (1, 3), 7: (1, 2)},
    # NxD's own trigger, TP=4, on one node of 8: TP groups [0, 2, 4, 6], [1, 3, 5, 7]; DP groups [0, 1], ...
    "trn1_tp4@tp4": {r: (r // 2, r % 2) for r in range(8)},
}
CASES = [("trn1_tp4", 2, 4), ("trn2", 2, 4), ("trn1_tp4@tp4", 4, 8)]   # (layout, TP, LOCAL_WORLD_SIZE)


def _train(model, opt, steps, start, dp_rank):
    dev = model.up.device
    for s in range(start, start + steps):
        g = torch.Generator().manual_seed(70 + 10 * s + dp_rank)
        loss = model(torch.randn(4, 8, generator=g).to(dev)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        sync()


def _layout_rank(rank, world, root, rank_layout, tp_size):
    import nxd_ckpt
    import parallel_state as ps
    from nxd_ckpt.storage import set_write_hook
    from nxd_ckpt.testing import ZeroOneAdam

    ps.initialize_model_parallel(tensor_model_parallel_size=tp_size, rank_layout=rank_layout)
    tp, dp = ps.get_tensor_model_parallel_rank(), ps.get_data_parallel_rank()

    def make(seed_offset=0):
        model = TinyShard(tp, 0, seed_offset=seed_offset)
        opt = ZeroOneAdam(model.parameters(), dp_group=ps.get_data_parallel_host_group(), dp_rank=dp,
                          dp_size=ps.get_data_parallel_size())
        return model, opt

    model, opt = make()
    _train(model, opt, 2, 0, dp)
    written = []
    set_write_hook(written.append)
    nxd_ckpt.save_checkpoint(root, "step_2", model=model, optimizer=opt, use_xser=True)
    set_write_hook(None)
    saved = (to_cpu_state(model.state_dict()), to_cpu_state(opt.state_dict()))
    _train(model, opt, 2, 2, dp)
    final = (to_cpu_state(model.state_dict()), to_cpu_state(opt.state_dict()))

    fresh, fresh_opt = make(seed_offset=9)
    nxd_ckpt.load_checkpoint(root, model=fresh, optimizer=fresh_opt)
    assert_bit_equal(saved, (to_cpu_state(fresh.state_dict()), to_cpu_state(fresh_opt.state_dict())), "loaded")
    _train(fresh, fresh_opt, 2, 2, dp)
    assert_bit_equal(final, (to_cpu_state(fresh.state_dict()), to_cpu_state(fresh_opt.state_dict())), "resumed")
    return {"tp": tp, "dp": dp, "written": written, "tp_group": ps.get_tensor_model_parallel_replica_groups()}


@pytest.mark.parametrize("case, tp, lws", CASES, ids=[c[0] for c in CASES])
def test_layout_on_nodes_round_trip_and_resume(tmp_path, case, tp, lws):
    rank_layout = case.split("@")[0]
    root = str(tmp_path / "ckpt")
    results = run_ranks(_layout_rank, 8, root, rank_layout, tp, env={"LOCAL_WORLD_SIZE": str(lws)}, timeout=400)
    assert {r: (out["tp"], out["dp"]) for r, out in enumerate(results)} == EXPECTED[case]
    # every TP group stays inside its node
    assert all(len({x // lws for x in g}) == 1 for g in results[0]["tp_group"])
    want = {"newest", "step_2/checkpoint", "step_2/done", "step_2/manifest.json"}
    for folder, dps, n in (("model", [0], 4), ("optim", range(8 // tp), 12)):
        for d in dps:
            for t in range(tp):
                base = f"step_2/{folder}/dp_rank_{d:02d}_tp_rank_{t:02d}_pp_rank_00.pt"
                want |= {base, base + ".info.pt"} | {f"{base}.tensors/tensor_{i}.pt" for i in range(n)}
    assert all_files(root) == want
    for r, out in enumerate(results):   # each ZeRO-1 shard written by the rank NxD gives that DP rank
        tp, dp = EXPECTED[case][r]
        mine = f"optim/dp_rank_{dp:02d}_tp_rank_{tp:02d}_pp_rank_00.pt"
        assert any(w.endswith(mine) for w in out["written"]), (r, mine)
        others = [w for w in out["written"] if "/optim/" in w and f"/{mine}" not in w]
        assert others == [], (r, others)
    with open(os.path.join(root, "step_2", "manifest.json")) as f:
        assert json.load(f)["topology"]["layout"] == rank_layout
