"""use_zero1_dcp=True: the ZeRO-1 optimizer state as NxD's torch.distributed.checkpoint under optim/, saved on
several ranks and loaded at the same and at other DP sizes; NxD-written DCP optimizers load."""
from __future__ import annotations

import os

import pytest
import torch

import nxd_ckpt
from harness import run_ranks
from nxd_ckpt.testing.zero1_adam import shard_of, unshard
from tiny_models import TinyShard, all_files, assert_bit_equal, to_cpu_state, train_steps


def _build(ps, tp_rank, offset):
    from nxd_ckpt.testing import ZeroOneAdam

    model = TinyShard(tp_rank=tp_rank, hidden=6, seed_offset=offset)   # 6 rows: DP=4 pads to 8
    opt = ZeroOneAdam(model.parameters(), dp_group=ps.get_data_parallel_host_group(),
                      dp_rank=ps.get_data_parallel_rank(), dp_size=ps.get_data_parallel_size(),
                      save_master_weights=False)
    return model, opt


def _save_rank(rank, world, root, tp):
    import parallel_state as ps

    ps.initialize_model_parallel(tensor_model_parallel_size=tp)
    tp_rank = ps.get_tensor_model_parallel_rank()
    model, opt = _build(ps, tp_rank, 0)
    train_steps(model, opt, 2, seed=4, dp_rank=ps.get_data_parallel_rank())
    nxd_ckpt.save_checkpoint(root, "s", model=model, optimizer=opt, async_save=True, use_zero1_dcp=True)
    nxd_ckpt.finalize_checkpoint()
    want = to_cpu_state(opt.state_dict())
    fresh, fresh_opt = _build(ps, tp_rank, 3)
    nxd_ckpt.load_checkpoint(root, "s", fresh, fresh_opt, None, 8, True, True)   # NxD's positional call
    assert_bit_equal(to_cpu_state(model.state_dict()), to_cpu_state(fresh.state_dict()), "model")
    assert_bit_equal(want, to_cpu_state(fresh_opt.state_dict()), "optimizer")
    return want


def _load_rank(rank, world, root):
    """The loaded optimizer state, and every (file, offset, length) read from the DCP data files."""
    import parallel_state as ps

    from nxd_ckpt.storage.local import LocalStorage

    ps.initialize_model_parallel(tensor_model_parallel_size=1)
    model, opt = _build(ps, 0, 3)
    reads, real = [], LocalStorage.read

    def read(self, relpath, offset=0, length=None):
        if relpath.endswith(".distcp"):
            reads.append((os.path.basename(relpath), offset, length))
        return real(self, relpath, offset, length)

    LocalStorage.read = read
    try:
        nxd_ckpt.load_checkpoint(root, "s", model=model, optimizer=opt)
    finally:
        LocalStorage.read = real
    return to_cpu_state(opt.state_dict()), reads


def _full(states, key, i):
    return unshard([s["base_state"][i][key] for s in states], states[0]["shape_info"][i])


def test_tp2_dp2_names_files_and_torch_dcp_reads_it(tmp_path):
    root = str(tmp_path / "ck")
    states = run_ranks(_save_rank, 4, root, 2, timeout=240)
    want = {"newest", "s/checkpoint", "s/done", "s/manifest.json", "s/optim/.metadata"}
    want |= {f"s/optim/__{r}_0.distcp" for r in range(4)}
    want |= {f"s/model/dp_rank_00_tp_rank_{t:02d}_pp_rank_00.pt" for t in range(2)}
    assert all_files(root) == want
    from torch.distributed.checkpoint import FileSystemReader
    import torch.distributed.checkpoint as dcp

    meta = FileSystemReader(os.path.join(root, "s", "optim")).read_metadata()
    keys = set(meta.state_dict_metadata)
    for name in ("up", "down", "bias"):
        assert f"base_state.{name}.step" in keys
        for k in ("exp_avg", "exp_avg_sq"):
            assert {f"base_state.{name}.{k}|tp-0000", f"base_state.{name}.{k}|tp-0001"} <= keys
    assert "param_groups.0.lr" in keys and "shape_info.0" in keys
    from nxd_ckpt.cli import main as cli_main

    assert cli_main(["verify", root]) == 0
    # torch's own reader assembles the DP chunks: rank r is tp r % 2, dp r // 2
    target = {"base_state.up.exp_avg|tp-0001": torch.empty(6, 6)}
    dcp.load(target, checkpoint_id=os.path.join(root, "s", "optim"), no_dist=True)
    assert_bit_equal(_full([states[1], states[3]], "exp_avg", 0), target["base_state.up.exp_avg|tp-0001"])


def test_saved_at_dp2_loads_at_dp1_and_dp4(tmp_path):
    root = str(tmp_path / "ck")
    states = run_ranks(_save_rank, 2, root, 1, timeout=240)
    from torch.distributed.checkpoint import FileSystemReader

    meta = FileSystemReader(os.path.join(root, "s", "optim")).read_metadata()
    entries = {(i.relative_path, i.offset, i.length): k for k, i in meta.storage_data.items()}
    small = {e for e, k in entries.items() if not k.offset}    # 0-d tensors and bytes (param_groups, shape_info)
    for dp in (1, 4):
        results = run_ranks(_load_rank, dp, root, timeout=240)
        loaded = [state for state, _ in results]
        for r, (_, reads) in enumerate(results):
            # entry by entry, never whole files: at DP=4 rank 3's rows are all padding, rank 0's all in file 0
            assert set(reads) <= set(entries) and len(reads) == len(set(reads)), reads
            if dp == 4 and r == 3:
                assert set(reads) == small
            if dp == 4 and r == 0:
                assert all(f == "__0_0.distcp" for f, _, _ in reads)
        for r in range(dp):
            for i in range(3):
                for key in ("exp_avg", "exp_avg_sq"):
                    assert_bit_equal(shard_of(_full(states, key, i), r, dp), loaded[r]["base_state"][i][key],
                                     f"dp{dp} rank {r} param {i} {key}")
                assert_bit_equal(states[0]["base_state"][i]["step"], loaded[r]["base_state"][i]["step"])
            assert loaded[r]["param_groups"] == states[0]["param_groups"]


@pytest.mark.parametrize("flatten", ["torch>=2.4", "torch<=2.3"])
def test_nxd_written_dcp_optimizer_loads(tmp_path, flatten):
    """What NxD's zero_dcp_utils writes at DP=1, TP=1 (keys by parameter name, flattened as DCP flattens: one
    entry per leaf since torch 2.4, whole non-tensor containers such as param_groups before), written here by
    torch's own DCP writer."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import _version

    from nxd_ckpt.testing import ZeroOneAdam

    model = TinyShard(hidden=4, device="cpu")
    g = torch.Generator().manual_seed(1)
    names = ["up", "down", "bias"]
    flat = {}
    for n, p in zip(names, model.parameters()):
        flat[f"base_state.{n}.step"] = torch.tensor(5.0)
        flat[f"base_state.{n}.exp_avg"] = torch.randn(p.shape, generator=g)
        flat[f"base_state.{n}.exp_avg_sq"] = torch.randn(p.shape, generator=g).abs()
    state = {"param_groups": [{"lr": 0.5, "betas": (0.9, 0.999), "eps": 1e-8, "params": [0, 1, 2]}],
             "base_state": {n: {k.rsplit(".", 1)[1]: v for k, v in flat.items() if k.startswith(f"base_state.{n}.")}
                            for n in names},
             "shape_info": {i: p.shape for i, p in enumerate(model.parameters())}}
    tag = tmp_path / "nxd"
    _version._derived_version = "2_3" if flatten == "torch<=2.3" else None
    try:
        dcp.save(state, checkpoint_id=str(tag / "optim"), no_dist=True)
    finally:
        _version._derived_version = None
    keys = set(dcp.FileSystemReader(str(tag / "optim")).read_metadata().state_dict_metadata)
    assert ("param_groups" in keys) == (flatten == "torch<=2.3")
    (tag / "model").mkdir()
    torch.save(model.state_dict(), tag / "model" / "dp_rank_00_tp_rank_00_pp_rank_00.pt")
    (tag / "checkpoint").write_text("1")
    (tag / "done").write_text("1")
    opt = ZeroOneAdam(model.parameters(), save_master_weights=False)
    nxd_ckpt.load_checkpoint(str(tmp_path), "nxd", model=model, optimizer=opt, use_zero1_dcp=True)
    with pytest.raises(nxd_ckpt.StateMismatchError, match="use_zero1_dcp"):
        nxd_ckpt.load_checkpoint(str(tmp_path), "nxd", optimizer=opt)   # no model: parameter names unknown
    sd = opt.state_dict()
    for i, n in enumerate(names):
        for k in ("step", "exp_avg", "exp_avg_sq"):
            assert_bit_equal(flat[f"base_state.{n}.{k}"], sd["base_state"][i][k], f"{n}.{k}")
    assert sd["param_groups"][0]["lr"] == 0.5
    from nxd_ckpt.cli import main as cli_main

    assert cli_main(["verify", str(tag)]) == 0
    data = tag / "optim" / "__0_0.distcp"
    data.write_bytes(data.read_bytes()[:-10])
    assert cli_main(["verify", str(tag)]) == 1


def test_dcp_refuses_master_weights(tmp_path):
    from nxd_ckpt.testing import ZeroOneAdam

    model = TinyShard(device="cpu")
    opt = ZeroOneAdam(model.parameters())
    with pytest.raises(nxd_ckpt.CheckpointArgumentError, match="cannot save sharded_master_weights"):
        nxd_ckpt.save_checkpoint(str(tmp_path), "s", model=model, optimizer=opt, async_save=True,
                                 use_zero1_dcp=True)
    assert os.listdir(tmp_path) == []


class _Head(torch.nn.Module):
    """A second pipeline stage whose parameter names differ from the first's."""

    def __init__(self, offset):
        super().__init__()
        g = torch.Generator().manual_seed(50 + offset)
        self.head = torch.nn.Parameter(torch.randn(5, 6, generator=g))
        self.norm = torch.nn.Parameter(torch.randn(6, generator=g))


def _pp_rank(rank, world, root, save):
    import parallel_state as ps

    from nxd_ckpt.testing import ZeroOneAdam

    ps.initialize_model_parallel(pipeline_model_parallel_size=2)
    pp = ps.get_pipeline_model_parallel_rank()

    def build(offset):
        model = TinyShard(hidden=6, seed_offset=offset, device="cpu") if pp == 0 else _Head(offset)
        return model, ZeroOneAdam(model.parameters(), dp_group=ps.get_data_parallel_host_group(),
                                  dp_rank=ps.get_data_parallel_rank(), dp_size=ps.get_data_parallel_size(),
                                  save_master_weights=False)

    if save:
        model, opt = build(0)
        for p in model.parameters():
            p.grad = torch.full_like(p, 0.1 * (ps.get_data_parallel_rank() + 1))
        opt.step()
        nxd_ckpt.save_checkpoint(root, "s", model=model, optimizer=opt, async_save=True, use_zero1_dcp=True)
        nxd_ckpt.finalize_checkpoint()
    model, opt = build(3)
    nxd_ckpt.load_checkpoint(root, "s", model=model, optimizer=opt)
    return pp, to_cpu_state(opt.state_dict())


def test_pp2_stages_with_different_names_saved_at_dp2_load_at_dp1(tmp_path):
    root = str(tmp_path / "ck")
    saved = run_ranks(_pp_rank, 4, root, True, timeout=240)    # ranks: pp = rank // 2, dp = rank % 2
    from torch.distributed.checkpoint import FileSystemReader

    keys = set(FileSystemReader(os.path.join(root, "s", "optim")).read_metadata().state_dict_metadata)
    assert {"base_state.up.exp_avg|pp-0000", "base_state.head.exp_avg|pp-0001", "base_state.norm.step"} <= keys
    loaded = run_ranks(_pp_rank, 2, root, False, timeout=240)   # PP=2, DP=1
    for pp, state in loaded:
        stage = [s for p, s in saved if p == pp]
        for i in state["base_state"]:
            for key in ("exp_avg", "exp_avg_sq"):
                assert_bit_equal(_full(stage, key, i), state["base_state"][i][key], f"pp {pp} param {i} {key}")
        assert state["shape_info"] == stage[0]["shape_info"]


def test_convert_zero1_says_a_dcp_optimizer_needs_no_conversion(tmp_path, capsys):
    from nxd_ckpt.cli import main as cli_main
    from nxd_ckpt.testing import ZeroOneAdam

    model = TinyShard(device="cpu")
    opt = ZeroOneAdam(model.parameters(), save_master_weights=False)
    nxd_ckpt.save_checkpoint(str(tmp_path), "d", model=model, optimizer=opt, async_save=True, use_zero1_dcp=True)
    nxd_ckpt.finalize_checkpoint()
    assert cli_main(["convert-zero1", "--input_dir", str(tmp_path / "d"), "--output_dir", str(tmp_path / "d2"),
                     "--convert_to_sharded", "--dp_size", "2"]) == 1
    assert "load_checkpoint reads it at any DP size directly" in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "d2")


def _grouped(model, sizes):
    """A ZeRO-1 Adam whose param groups hold ``sizes`` parameters each, in order."""
    from nxd_ckpt.testing import ZeroOneAdam

    opt = ZeroOneAdam(model.parameters(), save_master_weights=False)
    params, g0, out = list(model.parameters()), opt.param_groups[0], []
    for n in sizes:
        out.append(dict(g0, params=params[:n]))
        params = params[n:]
    opt.param_groups = out
    return opt


@pytest.mark.parametrize("saved,live,what", [
    ([3], [2, 1], "holds 1 optimizer param group\\(s\\) and this optimizer has 2"),
    ([2, 1], [1, 2], "param group 0 holds 2 parameter\\(s\\) in the checkpoint and 1 in this optimizer")])
def test_param_groups_that_differ_are_refused(tmp_path, saved, live, what):
    model = TinyShard(device="cpu")
    nxd_ckpt.save_checkpoint(str(tmp_path), "g", model=model, optimizer=_grouped(model, saved), async_save=True,
                             use_zero1_dcp=True)
    nxd_ckpt.finalize_checkpoint()
    opt = _grouped(model, live)
    before = [dict(g) for g in opt.param_groups]
    with pytest.raises(nxd_ckpt.StateMismatchError, match=what):
        nxd_ckpt.load_checkpoint(str(tmp_path), "g", model=model, optimizer=opt)
    assert opt.param_groups == before
    nxd_ckpt.load_checkpoint(str(tmp_path), "g", model=model, optimizer=_grouped(model, saved))


def test_a_damaged_entry_is_named_by_its_byte_range(tmp_path):
    from torch.distributed.checkpoint.metadata import MetadataIndex

    from nxd_ckpt.dcpmeta import read_metadata

    model = TinyShard(device="cpu")
    nxd_ckpt.save_checkpoint(str(tmp_path), "r", model=model, optimizer=_grouped(model, [3]), async_save=True,
                             use_zero1_dcp=True)
    nxd_ckpt.finalize_checkpoint()
    meta_path = tmp_path / "r" / "optim" / ".metadata"
    meta = read_metadata(meta_path.read_bytes(), str(meta_path))
    info = meta.storage_data[MetadataIndex("base_state.up.exp_avg", torch.Size([0, 0]))]
    data = bytearray((tmp_path / "r" / "optim" / info.relative_path).read_bytes())
    data[info.offset + info.length - 5] ^= 0xFF
    (tmp_path / "r" / "optim" / info.relative_path).write_bytes(bytes(data))
    with pytest.raises(nxd_ckpt.CorruptCheckpointError,
                       match=f"bytes {info.offset}-{info.offset + info.length} are damaged"):
        nxd_ckpt.load_checkpoint(str(tmp_path), "r", model=model, optimizer=_grouped(model, [3]))


def test_info_lists_a_dcp_optimizer(tmp_path, capsys):
    from nxd_ckpt.cli import main as cli_main

    model = TinyShard(device="cpu")
    nxd_ckpt.save_checkpoint(str(tmp_path), "i", model=model, optimizer=_grouped(model, [3]), async_save=True,
                             use_zero1_dcp=True)
    nxd_ckpt.finalize_checkpoint()
    size = os.path.getsize(tmp_path / "i" / "optim" / "__0_0.distcp")
    assert cli_main(["info", str(tmp_path / "i"), "--json"]) == 0
    import json

    d = json.loads(capsys.readouterr().out)
    # 3 parameters x (step, exp_avg, exp_avg_sq) tensors; param_groups.0.{lr, betas, eps, params}, shape_info.0-2
    assert d["dcp_optimizer"] == {"file": "optim/.metadata", "entries": 16, "tensor_entries": 9, "data_files": 1,
                                  "bytes": size}
    assert cli_main(["info", str(tmp_path / "i")]) == 0
    assert ("optimizer:  use_zero1_dcp (a torch.distributed.checkpoint in optim/; loads at any DP size): 16 "
            "entries (9 tensors) in 1 data files") in capsys.readouterr().out


def _save_dcp_rank(rank, world, root, tp):
    """A trained state saved with NxD's DCP optimizer layout; this rank's (tp, dp, optimizer state)."""
    import parallel_state as ps

    ps.initialize_model_parallel(tensor_model_parallel_size=tp)
    model, opt = _build(ps, ps.get_tensor_model_parallel_rank(), 0)
    train_steps(model, opt, 2, seed=4, dp_rank=ps.get_data_parallel_rank())
    nxd_ckpt.save_checkpoint(root, "d", model=model, optimizer=opt, async_save=True, use_zero1_dcp=True)
    nxd_ckpt.finalize_checkpoint()
    return ps.get_tensor_model_parallel_rank(), ps.get_data_parallel_rank(), to_cpu_state(opt.state_dict())


def test_to_dcp_of_a_use_zero1_dcp_tag(tmp_path):
    """to-dcp reads a use_zero1_dcp=True optimizer (TP=2 x DP=2): every Adam moment in the DCP checkpoint is
    the ranks' ZeRO-1 pieces joined over DP, then over TP by the parameter's partition, bit for bit; steps and
    the param group carry over by parameter name."""
    from nxd_ckpt.cli import main
    from nxd_ckpt.dcpio import read_dcp

    root = str(tmp_path / "ckpt")
    ranks = run_ranks(_save_dcp_rank, 4, root, 2, timeout=240)
    by = {(t, d): st for t, d, st in ranks}
    # TinyShard's bias differs per TP rank and records no partition: say how it is split
    assert main(["to-dcp", os.path.join(root, "d"), str(tmp_path / "dcp"), "--partition", "bias=0"]) == 0
    got = read_dcp(str(tmp_path / "dcp"))
    parts = {"up": 0, "down": 1, "bias": 0}       # TinyShard: column-parallel up, row-parallel down
    assert sorted(got.optim.params) == sorted(parts)
    for i, name in enumerate(["up", "down", "bias"]):
        ps = got.optim.params[name]
        for k in ("exp_avg", "exp_avg_sq"):
            local = [unshard([by[(t, d)]["base_state"][i][k] for d in range(2)], by[(t, 0)]["shape_info"][i])
                     for t in range(2)]
            assert_bit_equal(ps.moments[k].checked(), torch.cat(local, dim=parts[name]), f"{name} {k}")
        assert_bit_equal(ps.step, by[(0, 0)]["base_state"][i]["step"], f"{name} step")
    assert got.optim.groups == [({"lr": 0.01, "betas": (0.9, 0.999), "eps": 1e-08}, ["up", "down", "bias"])]
