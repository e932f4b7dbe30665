"""Multi-rank save/load in NxD's layout on CPU-XLA: exact file sets, DP de-duplication, bit-exact reload."""
from __future__ import annotations

import os

import pytest
import torch

from backends import ckpt_root, files_under, local_copy, root_for  # noqa: F401 - ckpt_root: a fixture
from harness import run_ranks
from tiny_models import TinyShard, assert_bit_equal, to_cpu_state, train_steps, xla_device


def _setup(tp=1, pp=1, ep=1):
    import parallel_state as ps

    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                 expert_model_parallel_size=ep)
    return ps


def _count_writes():
    from nxd_ckpt.storage import set_write_hook

    written = []
    set_write_hook(written.append)
    return written


def _layout_rank(rank, world, root, tp, pp, use_xser, node_local=False):
    import nxd_ckpt

    ps = _setup(tp, pp)
    dev = xla_device()
    model = TinyShard(ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank()).to(dev)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    train_steps(model, opt, 2, seed=1, dp_rank=0, sched=sched)
    written = _count_writes()
    nxd_ckpt.save_checkpoint(root, "step_2", model=model, optimizer=opt, scheduler=sched,
                             user_content={"step": 2, "note": "hi"}, use_xser=use_xser)
    saved_model, saved_opt = to_cpu_state(model.state_dict()), to_cpu_state(opt.state_dict())

    fresh = TinyShard(ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank(), seed_offset=5).to(dev)
    fresh_opt = torch.optim.Adam(fresh.parameters(), lr=0.5)
    fresh_sched = torch.optim.lr_scheduler.StepLR(fresh_opt, step_size=1, gamma=0.5)
    from nxd_ckpt import reader

    reads = []
    original = reader.FileReader.read
    original_buffer = reader.FileReader.read_buffer             # tensor files read into a buffer
    original_direct = reader.FileReader._load_tensor_mapped   # tensor files read straight into tensors

    def direct(self, rel):
        tensor = original_direct(self, rel)
        if tensor is not None:
            reads.append(rel)
        return tensor

    reader.FileReader.read = lambda self, rel: (reads.append(rel), original(self, rel))[1]
    reader.FileReader.read_buffer = lambda self, rel: (reads.append(rel), original_buffer(self, rel))[1]
    reader.FileReader._load_tensor_mapped = direct
    uc = nxd_ckpt.load_checkpoint(root, model=fresh, optimizer=fresh_opt, scheduler=fresh_sched,
                                  node_local=node_local)
    reader.FileReader.read = original
    reader.FileReader.read_buffer = original_buffer
    reader.FileReader._load_tensor_mapped = original_direct
    assert uc == {"step": 2, "note": "hi"}
    assert all(p.device.type == "xla" for p in fresh.parameters())
    assert_bit_equal(saved_model, to_cpu_state(fresh.state_dict()), "model")
    assert_bit_equal(saved_opt, to_cpu_state(fresh_opt.state_dict()), "optim")
    assert fresh_sched.state_dict() == sched.state_dict()
    return {"writes": list(written), "reads": reads}


def _expected_files(tp, pp, ntensors_model, ntensors_optim, use_xser, optim_dp=(0,)):
    files = {"newest", "step_2/checkpoint", "step_2/done", "step_2/manifest.json",
             "step_2/scheduler.pt", "step_2/user_content.pt"}
    for t in range(tp):
        for p in range(pp):
            shards = [("model", 0, ntensors_model)] + [("optim", d, ntensors_optim) for d in optim_dp]
            for folder, d, n in shards:
                base = f"step_2/{folder}/dp_rank_{d:02d}_tp_rank_{t:02d}_pp_rank_{p:02d}.pt"
                files.add(base)
                if use_xser:
                    files.add(base + ".info.pt")
                    files.update(f"{base}.tensors/tensor_{i}.pt" for i in range(n))
    return files


# xser and plain shards on both backends (POSIX with the rename commit, the shared-directory object store
# with the marker commit: the same keys).
@pytest.mark.parametrize("backend,use_xser", [("posix", True), ("posix", False), ("objects", True),
                                              ("objects", False)],
                         ids=["xser", "plain", "xser-objects", "plain-objects"])
def test_tp2_pp2_dp2_layout_and_reload(tmp_path, backend, use_xser):
    root = root_for(backend, tmp_path)
    results = run_ranks(_layout_rank, 8, root, 2, 2, use_xser, timeout=240)
    per_rank = [r["writes"] for r in results]
    # model: up, down, bias, steps_seen; Adam: step, exp_avg, exp_avg_sq for 3 params
    assert files_under(root) == _expected_files(2, 2, 4, 9, use_xser)
    writes = [w for ws in per_rank for w in ws]
    payload = [w.split("/", 1)[1] for w in writes if "/model/" in w or "/optim/" in w]
    assert len(payload) == len(set(payload)), "a shard file was written by two ranks"
    if use_xser:
        # the 13 tensor files of each (tp, pp) shard are spread over both DP replicas
        for r in range(8):
            assert any(".tensors/" in w for w in per_rank[r]), f"rank {r} wrote no tensor file"
        # ... and on load each tensor file is read by exactly one replica of its DP group
        tensor_reads = [rel for r in results for rel in r["reads"] if ".tensors/" in rel]
        assert len(tensor_reads) == len(set(tensor_reads)) == 4 * 13
        assert all(any(".tensors/" in rel for rel in r["reads"]) for r in results)
    else:
        # a plain shard is one pickle: read by one replica of its DP group, received by the other
        shard_reads = [rel for r in results for rel in r["reads"] if rel.startswith(("model/", "optim/"))]
        assert sorted(shard_reads) == sorted({rel.split("/", 1)[1] for rel in _expected_files(2, 2, 4, 9, False)
                                              if "/model/" in rel or "/optim/" in rel})


@pytest.mark.parametrize("use_xser", [True, False], ids=["xser", "plain"])
def test_node_local_storage_every_rank_reads_its_own_files(tmp_path, use_xser):
    root = str(tmp_path / "ckpt")
    results = run_ranks(_layout_rank, 2, root, 1, 1, use_xser, node_local=True, timeout=120)   # DP=2
    for r in results:
        reads = [rel for rel in r["reads"] if rel.startswith(("model/", "optim/")) and not rel.endswith(".info.pt")]
        files = {rel.split("/", 1)[1] for rel in _expected_files(1, 1, 4, 9, use_xser)
                 if ("/model/" in rel or "/optim/" in rel) and not rel.endswith(".info.pt")}
        assert sorted(reads) == sorted(files)


def test_info_records_partition_attributes(tmp_path):
    root = str(tmp_path / "ckpt")
    run_ranks(_layout_rank, 2, root, 2, 1, True, timeout=120)
    import xser

    base = os.path.join(root, "step_2", "model", "dp_rank_00_tp_rank_01_pp_rank_00.pt")
    info = torch.load(base + ".info.pt", weights_only=True)
    refs = xser.load_refs(base)
    tid = {k: v.tid for k, v in refs.items()}
    assert info[tid["up"]]["partition_dim"] == 0 and info[tid["up"]]["tensor_model_parallel"] is True
    assert info[tid["down"]]["partition_dim"] == 1 and info[tid["down"]]["partition_stride"] == 1
    assert "partition_dim" not in info[tid["bias"]]
    assert info[tid["up"]]["shape"] == torch.Size([8, 8]) and info[tid["up"]]["dtype"] == torch.float32


def test_ref_files_load_with_torch_xla(tmp_path):
    root = str(tmp_path / "ckpt")
    run_ranks(_layout_rank, 2, root, 2, 1, True, timeout=120)
    import torch_xla.utils.serialization as txs

    import xser

    for folder in ("model", "optim"):
        for t in range(2):
            path = os.path.join(root, "step_2", folder, f"dp_rank_00_tp_rank_{t:02d}_pp_rank_00.pt")
            assert_bit_equal(xser.load(path), txs.load(path), path)


# ---- ZeRO-1 --------------------------------------------------------------------------------------
def _zero1_rank(rank, world, root):
    import nxd_ckpt
    from nxd_ckpt.testing import ZeroOneAdam

    ps = _setup()
    dev = xla_device()
    model = TinyShard(hidden=6).to(dev)   # 6 rows over DP=4: padded to 8, 2 rows per shard
    opt = ZeroOneAdam(model.parameters(), dp_group=ps.get_data_parallel_host_group(),
                      dp_rank=ps.get_data_parallel_rank(), dp_size=ps.get_data_parallel_size())
    train_steps(model, opt, 2, seed=3, dp_rank=ps.get_data_parallel_rank())
    sd = opt.state_dict()
    written = _count_writes()
    nxd_ckpt.save_checkpoint(root, "step_2", model=model, optimizer=sd, zero1_optimizer=True, use_xser=True)
    fresh_model = TinyShard(hidden=6, seed_offset=5).to(dev)
    nxd_ckpt.load_checkpoint(root, model=fresh_model)
    assert_bit_equal(to_cpu_state(model.state_dict()), to_cpu_state(fresh_model.state_dict()), "model")
    target = {}
    nxd_ckpt.load_checkpoint(root, optimizer=target)
    assert_bit_equal(to_cpu_state(sd), to_cpu_state(target), "zero1")
    assert target["base_state"][0]["exp_avg"].shape == (2, 6)
    fresh = ZeroOneAdam(model.parameters(), dp_group=ps.get_data_parallel_host_group(),
                        dp_rank=ps.get_data_parallel_rank(), dp_size=ps.get_data_parallel_size())
    nxd_ckpt.load_checkpoint(root, optimizer=fresh)
    assert_bit_equal(to_cpu_state(sd), to_cpu_state(fresh.state_dict()), "zero1-object")
    return list(written)


def _written_once(per_rank):
    payload = [w.split("/", 1)[1] for ws in per_rank for w in ws if "/model/" in w or "/optim/" in w]
    assert len(payload) == len(set(payload)), "a shard file was written by two ranks"


def test_zero1_dp4_layout_and_reload(tmp_path, ckpt_root):
    root = ckpt_root
    per_rank = run_ranks(_zero1_rank, 4, root, timeout=180)
    # model (up, down, bias, steps_seen) once for the 4 DP replicas; ZeRO-1 optimizer: one shard per DP
    # rank, each with step, exp_avg, exp_avg_sq and a master weight for 3 parameters
    shards = [("model", 0, 4)] + [("optim", d, 12) for d in range(4)]
    want = {"newest", "step_2/checkpoint", "step_2/done", "step_2/manifest.json"}
    for folder, d, n in shards:
        base = f"step_2/{folder}/dp_rank_{d:02d}_tp_rank_00_pp_rank_00.pt"
        want |= {base, base + ".info.pt"} | {f"{base}.tensors/tensor_{i}.pt" for i in range(n)}
    assert files_under(root) == want
    _written_once(per_rank)
    import xser

    optim = local_copy(root, "step_2/optim", tmp_path / "copy")
    shards = []
    for d in range(4):
        data = xser.load(os.path.join(optim, f"dp_rank_{d:02d}_tp_rank_00_pp_rank_00.pt"))
        assert data["shape_info"][0] == torch.Size([6, 6])
        shards.append(data["sharded_master_weights"][0])
    full_up = torch.cat(shards)
    assert full_up.shape == (8, 6) and torch.count_nonzero(full_up[6:]) == 0  # zero padding rows


