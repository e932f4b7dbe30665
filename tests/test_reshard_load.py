"""Load-time resharding: a run trained at TP=2 x DP=2 with ZeRO-1 (the demo's Llama) resumes at TP=4 x DP=1,
TP=1 x DP=4 and TP=2 x PP=2. Right after loading, every parameter, Adam moment and master weight of every
rank equals the saved full state split at the new sizes, bit for bit; the next steps' losses match the
uninterrupted run's within float tolerance."""
from __future__ import annotations

import json
import math
import os
import shutil

import pytest
import torch
from demo_runs import run_demo
from harness import run_ranks

import xser
from nxd_ckpt.partition import Partition, join_tp, split_tp, zero1_shard, zero1_unshard

MODEL = ["--zero1", "--layers", "2", "--hidden", "32", "--heads", "4", "--ffn", "64",
         "--seq-len", "8", "--vocab", "32", "--total-steps", "4", "--ckpt-every", "2", "--log-every", "1",
         "--no-async", "--num-workers", "2"]


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """4 steps at TP=2 x DP=2 (checkpoints step_2 and step_4): its losses of steps 3-4 are the reference."""
    d = tmp_path_factory.mktemp("reshard_src")
    return d, run_demo(MODEL + ["--tp", "2", "--steps", "4", "--ckpt-dir", str(d / "ckpt")], d / "ref.json")


def _full_state(tag_dir):
    """The saved state as full tensors: model key -> tensor, and key -> {moment/master name -> tensor}."""
    with open(os.path.join(tag_dir, "manifest.json")) as f:
        manifest = json.load(f)
    tp, dp = manifest["topology"]["tp"], manifest["topology"]["dp"]
    name = lambda d, t: f"dp_rank_{d:02d}_tp_rank_{t:02d}_pp_rank_00.pt"   # noqa: E731
    meta = manifest["tensors"][f"model/{name(0, 0)}"]
    parts = {m["key"]: Partition.from_attrs(m) for m in meta.values()}
    shards = [xser.load(os.path.join(tag_dir, "model", name(0, t))) for t in range(tp)]
    model = {k: join_tp([s[k] for s in shards], parts[k], k) for k in shards[0]}
    optims = [[xser.load(os.path.join(tag_dir, "optim", name(d, t))) for d in range(dp)] for t in range(tp)]
    optim = {}
    for i, key in enumerate(shards[0]):
        entry = {}
        for f in ("exp_avg", "exp_avg_sq", "master"):
            locals_ = []
            for t in range(tp):
                get = (lambda o: o["sharded_master_weights"][i]) if f == "master" else (lambda o: o["base_state"][i][f])
                locals_.append(zero1_unshard([get(o) for o in optims[t]], optims[t][0]["shape_info"][i], key))
            entry[f] = join_tp(locals_, parts[key], key)
        entry["step"] = optims[0][0]["base_state"][i]["step"]
        optim[key] = entry
    return model, optim, parts


def _assert_bits(a, b, what):
    assert a.dtype == b.dtype and a.shape == b.shape, f"{what}: {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}"
    assert torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)), f"{what} differs"


@pytest.mark.slow
@pytest.mark.parametrize("tp,pp", [(4, 1), (1, 1), (2, 2)], ids=["tp4_dp1", "tp1_dp4", "tp2_pp2"])
def test_zero1_run_resumes_resharded(source, tmp_path, tp, pp):
    src_dir, ref = source
    ckpt = tmp_path / "ckpt"
    shutil.copytree(src_dir / "ckpt" / "step_2", ckpt / "step_2")
    dump = tmp_path / "loaded"
    run = run_demo(MODEL + ["--tp", str(tp), "--pp", str(pp), "--steps", "4", "--ckpt-dir", str(ckpt),
                            "--dump-loaded", str(dump)], tmp_path / "run.json")
    assert run["resumed_from"] == "step_2" and (run["tp"], run["pp"], run["dp"]) == (tp, pp, 4 // (tp * pp))

    model, optim, parts = _full_state(str(src_dir / "ckpt" / "step_2"))
    dp = 4 // (tp * pp)
    seen = set()
    for rank in range(4):
        t, d = rank % tp, (rank // tp) % dp
        got = torch.load(f"{dump}.rank{rank}.pt", weights_only=True)
        for key, v in got["model"].items():
            _assert_bits(v, split_tp(model[key], parts[key], tp, t), f"rank {rank} {key}")
            seen.add(key)
        o = got["optim"]
        for i, key in enumerate(got["model"]):
            local = {f: split_tp(optim[key][f], parts[key], tp, t) for f in ("exp_avg", "exp_avg_sq", "master")}
            for f in ("exp_avg", "exp_avg_sq"):
                _assert_bits(o["base_state"][i][f], zero1_shard(local[f], d, dp), f"rank {rank} {key} {f}")
            _assert_bits(o["sharded_master_weights"][i], zero1_shard(local["master"], d, dp), f"rank {rank} {key} master")
            assert float(o["base_state"][i]["step"]) == float(optim[key]["step"]) == 2.0
            assert tuple(o["shape_info"][i]) == tuple(got["model"][key].shape)
    assert seen == set(model), "every saved key landed on some stage"
    for s in ("3", "4"):
        assert math.isclose(run["losses"][s], ref["losses"][s], rel_tol=1e-4), (s, run["losses"][s], ref["losses"][s])


# --- single process: an NxD checkpoint without our manifest, partitions from the caller's model ---------------
class _Full(torch.nn.Module):
    """The TP=1 form of two TP=2 shards: up split along dim 0, down along dim 1, bias replicated."""

    def __init__(self, attrs: bool):
        super().__init__()
        self.up = torch.nn.Parameter(torch.zeros(16, 8))
        self.down = torch.nn.Parameter(torch.zeros(8, 16))
        self.bias = torch.nn.Parameter(torch.zeros(8))
        if attrs:
            for p, dim in ((self.up, 0), (self.down, 1)):
                p.tensor_model_parallel, p.partition_dim, p.partition_stride = True, dim, 1


def _nxd_tp2_tag(root):
    """Two TP shards written as NxD does without xser (one torch.save per shard), no manifest, no .info.pt."""
    g = torch.Generator().manual_seed(7)
    shards = [{"up": torch.randn(8, 8, generator=g), "down": torch.randn(8, 8, generator=g)} for _ in range(2)]
    bias = torch.randn(8, generator=g)
    tag = os.path.join(root, "nxd")
    os.makedirs(os.path.join(tag, "model"))
    for t, s in enumerate(shards):
        torch.save(dict(s, bias=bias), os.path.join(tag, "model", f"dp_rank_00_tp_rank_{t:02d}_pp_rank_00.pt"))
    for marker in ("checkpoint", "done"):
        with open(os.path.join(tag, marker), "w") as f:
            f.write("1")
    return shards, bias


def test_nxd_checkpoint_reshards_with_the_models_partition_attributes(tmp_path, caplog):
    import logging

    import nxd_ckpt

    shards, bias = _nxd_tp2_tag(str(tmp_path))
    model = _Full(attrs=True)
    with caplog.at_level(logging.INFO, logger="nxd_ckpt"):
        nxd_ckpt.load_checkpoint(str(tmp_path), "nxd", model=model)
    # NxD's file names do not tell the DP size of a checkpoint without a ZeRO-1 optimizer
    assert "resharding TP=2 PP=1 DP=? -> TP=1 PP=1 DP=1" in caplog.text
    _assert_bits(model.up.data, torch.cat([s["up"] for s in shards], 0), "up")
    _assert_bits(model.down.data, torch.cat([s["down"] for s in shards], 1), "down")
    _assert_bits(model.bias.data, bias, "bias")


def test_nxd_checkpoint_without_partition_attributes_names_what_is_missing(tmp_path):
    import nxd_ckpt

    _nxd_tp2_tag(str(tmp_path))
    model = _Full(attrs=False)
    with pytest.raises(nxd_ckpt.StateMismatchError) as e:
        nxd_ckpt.load_checkpoint(str(tmp_path), "nxd", model=model)
    m = str(e.value)
    assert "down" in m and "tensor_model_parallel" in m and "partition_dim" in m and "(8, 8)" in m
    assert torch.count_nonzero(model.up.data) == 0, "nothing was applied"
    with pytest.raises(nxd_ckpt.TopologyMismatchError, match="TP=2 PP=1"):
        nxd_ckpt.load_checkpoint(str(tmp_path), "nxd", model=_Full(attrs=True), reshard=False)


@pytest.mark.parametrize("length,stride,src_tp,dst_tp", [(24, 1, 2, 4), (24, 2, 2, 3), (24, 3, 4, 1), (24, 1, 1, 4),
                                                         (24, 2, 6, 2), (12, 2, 3, 2)])
def test_copy_tp_overlap_rebuilds_every_new_shard(length, stride, src_tp, dst_tp):
    from nxd_ckpt.partition import copy_tp_overlap, split_tp_all

    full = torch.arange(length * 3, dtype=torch.float32).reshape(length, 3)
    part = Partition(0, stride)
    src = split_tp_all(full, part, src_tp)
    for t in range(dst_tp):
        want = split_tp(full, part, dst_tp, t)
        got = torch.full_like(want, -1.0)
        for r in range(src_tp):
            copy_tp_overlap(got, src[r], part, src_tp, r, dst_tp, t)
        _assert_bits(got, want, f"shard {t}")


# --- a plain (replicated) optimizer: its per-parameter state follows the parameter -------------------------
class _TPModel(torch.nn.Module):
    """TP rank ``tp_rank`` of ``tp``'s shard of one full model (seeded): col (16, 8) split along dim 0 with
    stride 2, row (8, 16) along dim 1, norm (8) replicated."""

    def __init__(self, tp_rank: int, tp: int, norm_first: bool = False):
        super().__init__()
        g = torch.Generator().manual_seed(11)
        full = {"col": torch.randn(16, 8, generator=g), "row": torch.randn(8, 16, generator=g), "norm": torch.randn(8, generator=g)}
        self.parts = {"col": Partition(0, 2), "row": Partition(1), "norm": None}
        for k in (["norm", "col", "row"] if norm_first else list(full)):   # parameter (and state dict) order
            v = full[k]
            p = torch.nn.Parameter(split_tp(v, self.parts[k], tp, tp_rank).clone())
            if self.parts[k] is not None:
                p.tensor_model_parallel, p.partition_dim, p.partition_stride = True, self.parts[k].dim, self.parts[k].stride
            setattr(self, k, p)

    def step(self, opt, tp_rank: int, tp: int) -> None:
        """One Adam step with gradients that are the TP split of one full (seeded) gradient."""
        g = torch.Generator().manual_seed(12)
        for k, p in sorted(self.named_parameters(), key=lambda kv: ["col", "row", "norm"].index(kv[0])):
            full = torch.randn(p.shape[0] * (tp if k == "col" else 1), p.shape[-1] * (tp if k == "row" else 1),
                               generator=g) if p.dim() == 2 else torch.randn(p.shape, generator=g)
            p.grad = split_tp(full, self.parts[k], tp, tp_rank).clone()
        opt.step()


def _weight_decay_groups(model):
    """NxD's Llama example grouping: parameters without 'bias'/'norm' in their names (decayed), then the rest."""
    named = list(model.named_parameters())
    return [{"params": [p for k, p in named if "norm" not in k], "weight_decay": 0.01},
            {"params": [p for k, p in named if "norm" in k], "weight_decay": 0.0}]


def _save_plain_tp2(rank, world, root, groups=False):
    import parallel_state as ps

    import nxd_ckpt

    ps.initialize_model_parallel(tensor_model_parallel_size=2)
    t = ps.get_tensor_model_parallel_rank()
    model = _TPModel(t, 2, norm_first=groups)
    opt = torch.optim.Adam(_weight_decay_groups(model) if groups else model.parameters(), lr=0.1)
    model.step(opt, t, 2)
    nxd_ckpt.save_checkpoint(root, "s", model=model, optimizer=opt)
    return True


@pytest.mark.parametrize("groups", [False, True], ids=["one_group", "nxd_weight_decay_groups"])
def test_plain_adam_state_follows_its_parameter_tp2_to_tp1(tmp_path, groups):
    """With NxD's weight-decay groups the optimizer numbers parameters group by group (col, row, then norm),
    unlike the model's order (norm, col, row): the state still lands on the right parameters."""
    import nxd_ckpt

    root = str(tmp_path / "ckpt")
    run_ranks(_save_plain_tp2, 2, root, groups, timeout=120)
    make = (lambda m: torch.optim.Adam(_weight_decay_groups(m) if groups else m.parameters(), lr=0.1))  # noqa: E731
    ref = _TPModel(0, 1, norm_first=groups)
    ref_opt = make(ref)
    ref.step(ref_opt, 0, 1)                     # the same step on the full model (Adam is elementwise)
    model = _TPModel(0, 1, norm_first=groups)
    opt = make(model)
    nxd_ckpt.load_checkpoint(root, "s", model=model, optimizer=opt)
    for (k, p), q in zip(model.named_parameters(), ref.parameters()):
        _assert_bits(p.data, q.data, k)
        for f in ("exp_avg", "exp_avg_sq"):
            _assert_bits(opt.state[p][f], ref_opt.state[q][f], f"{k} {f}")
        assert float(opt.state[p]["step"]) == 1.0
    assert opt.param_groups[0]["lr"] == 0.1


def _save_zero1_masters_only(rank, world, root):
    """TP=2 x DP=2, ZeRO-1 with master weights, saved with avoid_saving_lower_precision_weights=True: the model's
    data lies only in the optimizer's master weights."""
    import parallel_state as ps

    import nxd_ckpt
    from nxd_ckpt.testing import ZeroOneAdam

    ps.initialize_model_parallel(tensor_model_parallel_size=2)
    t = ps.get_tensor_model_parallel_rank()
    model = _TPModel(t, 2)
    opt = ZeroOneAdam(model.parameters(), lr=0.1, dp_group=ps.get_data_parallel_host_group(),
                      dp_rank=ps.get_data_parallel_rank(), dp_size=ps.get_data_parallel_size())
    model.step(opt, t, 2)
    nxd_ckpt.save_checkpoint(root, "s", model=model, optimizer=opt, zero1_optimizer=True, use_xser=True,
                             avoid_saving_lower_precision_weights=True)
    return True


def test_weights_kept_as_master_weights_reshard_from_the_optimizer(tmp_path):
    import nxd_ckpt
    from nxd_ckpt.testing import ZeroOneAdam

    root = str(tmp_path / "ckpt")
    run_ranks(_save_zero1_masters_only, 4, root, timeout=120)
    model_files = os.listdir(os.path.join(root, "s", "model"))
    assert not any(f.endswith(".tensors") and os.listdir(os.path.join(root, "s", "model", f)) for f in model_files)
    ref = _TPModel(0, 1)
    ref_opt = ZeroOneAdam(ref.parameters(), lr=0.1)
    ref.step(ref_opt, 0, 1)
    model = _TPModel(0, 1)
    opt = ZeroOneAdam(model.parameters(), lr=0.1)
    nxd_ckpt.load_checkpoint(root, "s", model=model, optimizer=opt)
    for i, ((k, p), q) in enumerate(zip(model.named_parameters(), ref.parameters())):
        _assert_bits(p.data, q.data, k)
        for f in ("exp_avg", "exp_avg_sq"):
            _assert_bits(opt.base_state[i][f], ref_opt.base_state[i][f], f"{k} {f}")
        _assert_bits(opt.master[i], ref_opt.master[i], f"{k} master")


# --- pipeline stages merged: PP=2 x TP=2 saved, loaded by one process (PP=1, TP=1) ---------------------------
class _Stages(torch.nn.Module):
    """Layers 0 and 1 of a two-layer model (full values seeded), each a column-parallel weight; ``stages`` says
    which layers this pipeline stage holds. Keys keep the full model's names (``layers.<i>.w``)."""

    def __init__(self, stages, tp_rank: int, tp: int):
        super().__init__()
        self.layers = torch.nn.ModuleDict()
        for i in (0, 1):
            full = torch.randn(8, 4, generator=torch.Generator().manual_seed(20 + i))
            m = torch.nn.Module()
            m.w = torch.nn.Parameter(split_tp(full, Partition(0), tp, tp_rank).clone())
            m.w.tensor_model_parallel, m.w.partition_dim, m.w.partition_stride = True, 0, 1
            if i in stages:
                self.layers[str(i)] = m

    def step(self, opt) -> None:
        for k, p in self.named_parameters():
            p.grad = torch.full_like(p, float(len(k)))
        opt.step()


def _save_pp2_tp2(rank, world, root):
    import parallel_state as ps

    import nxd_ckpt

    ps.initialize_model_parallel(tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
    pp, t = ps.get_pipeline_model_parallel_rank(), ps.get_tensor_model_parallel_rank()
    model = _Stages({pp}, t, 2)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    model.step(opt)
    nxd_ckpt.save_checkpoint(root, "s", model=model, optimizer=opt, use_xser=True)
    return True


def test_pipeline_stages_merge_on_load(tmp_path):
    import nxd_ckpt

    root = str(tmp_path / "ckpt")
    run_ranks(_save_pp2_tp2, 4, root, timeout=120)
    ref = _Stages({0, 1}, 0, 1)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=0.1)
    ref.step(ref_opt)
    model = _Stages({0, 1}, 0, 1)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    nxd_ckpt.load_checkpoint(root, "s", model=model, optimizer=opt)
    for (k, p), q in zip(model.named_parameters(), ref.parameters()):
        _assert_bits(p.data, q.data, k)
        _assert_bits(opt.state[p]["exp_avg"], ref_opt.state[q]["exp_avg"], f"{k} exp_avg")
        _assert_bits(opt.state[p]["exp_avg_sq"], ref_opt.state[q]["exp_avg_sq"], f"{k} exp_avg_sq")


def test_dcp_optimizer_at_another_tp_size_says_relaunch_or_load_the_model_only(tmp_path):
    """An NxD use_zero1_dcp tag saved at TP=2 loaded at TP=1: the optimizer cannot be resharded (a clear
    TopologyMismatchError before anything is read), the model still can."""
    import torch.distributed.checkpoint as dcp

    import nxd_ckpt
    from nxd_ckpt.testing import ZeroOneAdam

    shards, bias = _nxd_tp2_tag(str(tmp_path))
    state = {"base_state": {"bias": {"step": torch.tensor(1.0), "exp_avg": torch.zeros(8)}},
             "param_groups": [{"lr": 0.1, "params": [0, 1, 2]}]}
    dcp.save(state, checkpoint_id=str(tmp_path / "nxd" / "optim"), no_dist=True)
    model = _Full(attrs=True)
    opt = ZeroOneAdam(model.parameters(), save_master_weights=False)
    with pytest.raises(nxd_ckpt.TopologyMismatchError,
                       match=r"saved with use_zero1_dcp at TP=2 PP=1 .*relaunch at TP=2 PP=1, or load with "
                             r"optimizer=None \(model resharding still works\)"):
        nxd_ckpt.load_checkpoint(str(tmp_path), "nxd", model=model, optimizer=opt)
    with pytest.raises(nxd_ckpt.TopologyMismatchError, match="its use_zero1_dcp optimizer loads only at the saved"):
        nxd_ckpt.load_checkpoint(str(tmp_path), "nxd", model=model, optimizer=opt, reshard=False)
    nxd_ckpt.load_checkpoint(str(tmp_path), "nxd", model=model, optimizer=None)
    _assert_bits(model.up.data, torch.cat([s["up"] for s in shards], 0), "up")
    _assert_bits(model.bias.data, bias, "bias")
