"""The offline tools on expert-parallel tags: the tiny MoE of test_reshard_ep.py saved once at EP=2 x DP=4 (4 ranks;
NxD's EP ZeRO-1 optimizer in xser, and a plain Adam without xser). to-dcp gives the full model state (the same step
taken on the whole model in one process) bit for bit, parameters and both Adam moments; from-dcp and
`reshard --ep 1` give back tags holding those tensors, which load at EP=1 bit-exact; `reshard --ep 2` writes NxD's
EP layout, which loads at EP=2 bit-exact; export joins the experts."""
from __future__ import annotations

import itertools
import os

import pytest
import torch
from harness import run_ranks
from test_reshard_ep import (EXPERTS, LR, SHAPES, _bits, _check_adam, _check_zero1, _coords, _local, _MoE, _reference,
                             _zero1_opt, save_ep2_tags)

from nxd_ckpt.cli import main


def _save_both(rank, world, root):
    save_ep2_tags(root)
    return True


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("ep2") / "ckpt")
    assert run_ranks(_save_both, 4, root, timeout=300) == [True] * 4
    return root, _reference()


def _check_full_state(state, ref, where):
    """A FullState's parameters and Adam moments equal the whole-model reference bit for bit."""
    params, moments = ref
    assert state.names() == list(params), where
    for t in state.model:
        _bits(t.checked(), params[t.name], f"{where} {t.name}")
    assert set(state.optim.params) == set(params)
    for k, (avg, sq) in moments.items():
        ps = state.optim.params[k]
        _bits(ps.moments["exp_avg"].checked(), avg, f"{where} {k} exp_avg")
        _bits(ps.moments["exp_avg_sq"].checked(), sq, f"{where} {k} exp_avg_sq")
        assert float(ps.step) == 1.0
    assert [names for _, names in state.optim.groups] == [list(params)]


@pytest.mark.parametrize("kind", ["zero1", "adam"])
def test_read_tag_of_an_ep_tag_is_the_full_state(saved, kind):
    from nxd_ckpt.fullstate import read_tag

    root, ref = saved
    _check_full_state(read_tag(os.path.join(root, kind)), ref[kind], f"read_tag {kind}")


@pytest.mark.parametrize("kind", ["zero1", "adam"])
def test_to_dcp_of_an_ep_tag_then_from_dcp_gives_the_full_state(saved, kind, tmp_path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    from nxd_ckpt.fullstate import read_tag

    root, ref = saved
    out = tmp_path / "dcp"
    assert main(["to-dcp", os.path.join(root, kind), str(out)]) == 0
    got = _load_state_dict_from_keys(storage_reader=dcp.FileSystemReader(str(out)))
    params, moments = ref[kind]
    for k, v in params.items():
        _bits(got["model"][k], v, f"dcp model {k}")
        _bits(got["optim"]["state"][k]["exp_avg"], moments[k][0], f"dcp {k} exp_avg")
        _bits(got["optim"]["state"][k]["exp_avg_sq"], moments[k][1], f"dcp {k} exp_avg_sq")
    back = tmp_path / "back"
    assert main(["from-dcp", str(out), str(back), "--tp", "1", "--dp", "2", "--zero1"]) == 0
    _check_full_state(read_tag(str(back)), ref[kind], f"from-dcp {kind}")


def test_reshard_to_ep1_loads_at_ep1_bit_exact(saved, tmp_path):
    import nxd_ckpt

    root, ref = saved
    dst = tmp_path / "ckpt" / "adam_ep1"
    assert main(["reshard", os.path.join(root, "adam"), str(dst), "--ep", "1", "--dp", "1"]) == 0
    assert sorted(os.listdir(dst / "optim")) == ["dp_rank_00_tp_rank_00_pp_rank_00.pt",
                                                 "dp_rank_00_tp_rank_00_pp_rank_00.pt.info.pt",
                                                 "dp_rank_00_tp_rank_00_pp_rank_00.pt.tensors"]
    model = _MoE(1, 0, 1, 0, seed=5)
    adam = torch.optim.Adam(model.parameters(), lr=LR)
    nxd_ckpt.load_checkpoint(str(tmp_path / "ckpt"), "adam_ep1", model=model, optimizer=adam, reshard=False)
    _check_adam((1, 0, 1, 0), model, adam, ref["adam"], "reshard --ep 1")


def test_reshard_of_the_ep_zero1_tag_to_ep1(saved, tmp_path):
    from nxd_ckpt.fullstate import read_tag

    root, ref = saved
    dst = tmp_path / "zero1_ep1"
    assert main(["reshard", os.path.join(root, "zero1"), str(dst), "--ep", "1", "--dp", "2"]) == 0
    names = sorted(n for n in os.listdir(dst / "optim") if n.endswith(".pt") and not n.endswith(".info.pt"))
    assert names == [f"dp_rank_{d:02d}_tp_rank_00_pp_rank_00.pt" for d in range(2)]
    _check_full_state(read_tag(str(dst)), ref["zero1"], "reshard zero1 --ep 1")


def test_export_joins_the_experts(saved, tmp_path):
    from safetensors.torch import load_file

    root, ref = saved
    out = tmp_path / "hf"
    assert main(["export", os.path.join(root, "zero1"), "--output", str(out)]) == 0
    got = load_file(str(out / "model.safetensors"))
    assert set(got) == set(ref["zero1"][0])
    for k, v in ref["zero1"][0].items():
        _bits(got[k], v, f"export {k}")


def _load_ep2(rank, world, root, adam_tag="adam_ep2", zero1_tag="zero1_ep2", model_tag=None):
    """Load each tag at EP=2 x DP=2 with reshard=False (this rank reads the files its own ranks name) and check it
    against the whole-model reference split at those sizes: a plain Adam, a ZeRO-1 state, a model alone."""
    import nxd_ckpt
    import parallel_state as ps

    ps.initialize_model_parallel(expert_model_parallel_size=2)          # TP=1, DP=2, EDP=1
    coords = _coords(ps)
    ref = _reference()
    if adam_tag:
        model = _MoE(*coords, seed=5)
        adam = torch.optim.Adam(model.parameters(), lr=LR)
        nxd_ckpt.load_checkpoint(root, adam_tag, model=model, optimizer=adam, reshard=False)
        _check_adam(coords, model, adam, ref["adam"], f"{adam_tag} rank {rank}")
    if zero1_tag:
        model = _MoE(*coords, seed=5)
        opt = _zero1_opt(ps, model)
        nxd_ckpt.load_checkpoint(root, zero1_tag, model=model, optimizer=opt, reshard=False)
        _check_zero1(ps, model, opt, ref["zero1"], f"{zero1_tag} rank {rank}")
    if model_tag:
        model = _MoE(*coords, seed=5)
        nxd_ckpt.load_checkpoint(root, model_tag, model=model, reshard=False)
        ep, e, tp, t = coords
        for k, p in model.named_parameters():
            _bits(p.data, _local(ref["zero1"][0][k], k, ep, e, tp, t), f"{model_tag} rank {rank} {k}")
    return True


def test_reshard_to_ep2_writes_nxd_ep_layout_that_loads_at_ep2(saved, tmp_path):
    """A plain Adam tag and an EP ZeRO-1 tag (EP=2 x DP=4) resharded to EP=2 x DP=2 in NxD's EP layout load there
    with reshard=False (each rank reads the files its own ranks name), bit for bit."""
    root, _ = saved
    out = tmp_path / "ckpt"
    for kind in ("adam", "zero1"):
        assert main(["reshard", os.path.join(root, kind), str(out / f"{kind}_ep2"), "--ep", "2", "--dp", "2"]) == 0
        assert main(["verify", str(out / f"{kind}_ep2")]) == 0
    model = out / "adam_ep2" / "model"
    names = sorted(n for n in os.listdir(model) if n.endswith(".pt") and not n.endswith(".info.pt"))
    assert names == [f"dp_rank_00_ep_rank_{e:02d}_tp_rank_00_pp_rank_00.pt" for e in range(2)]
    # NxD's rule: only ep_rank_00 holds the non-expert tensors (router, dense); each EP rank its experts (w, v)
    assert len(os.listdir(model / f"{names[0]}.tensors")) == 4
    assert len(os.listdir(model / f"{names[1]}.tensors")) == 2
    optim = sorted(n for n in os.listdir(out / "zero1_ep2" / "optim") if n.endswith(".pt") and ".info" not in n)
    assert optim == [f"dp_rank_{d:02d}_tp_rank_00_pp_rank_00.pt" for d in range(2)]
    # the manifest names the rank that owns each file at EP=2 x DP=2: EP rank e of expert-DP rank 0 is rank e
    from nxd_ckpt import manifest
    files = manifest.read(str(out / "adam_ep2")).files
    assert [files[f"{d}/dp_rank_00_ep_rank_{e:02d}_tp_rank_00_pp_rank_00.pt"].rank
            for d in ("model", "optim") for e in range(2)] == [0, 1, 0, 1]
    assert run_ranks(_load_ep2, 2, str(out), timeout=180) == [True, True]


def test_an_ep_tag_that_marks_no_expert_is_refused(saved, tmp_path, monkeypatch, capsys):
    from nxd_ckpt.reshard_load import SourceShard

    root, _ = saved
    monkeypatch.setattr(SourceShard, "expert", lambda self, obj, key=None: False)   # as NxD's .info.pt records it
    out = tmp_path / "dcp"
    assert main(["to-dcp", os.path.join(root, "adam"), str(out)]) == 1
    err = capsys.readouterr().err
    assert "2 expert-parallel shards but marks no tensor expert_model_parallel" in err
    assert not out.exists()


@pytest.mark.parametrize("kind", ["zero1", "adam"])
def test_reshard_to_tp2_ep2_and_read_back(saved, kind, tmp_path):
    """Experts split over TP (dims 2 and 1) and EP at once: written by reshard --tp 2 --ep 2, joined back by read_tag."""
    from nxd_ckpt.fullstate import read_tag

    root, ref = saved
    dst = tmp_path / "tp2ep2"
    assert main(["reshard", os.path.join(root, kind), str(dst), "--tp", "2", "--ep", "2", "--dp", "2"]) == 0
    names = sorted(n for n in os.listdir(dst / "model") if n.endswith(".pt") and ".info" not in n)
    assert names == [f"dp_rank_00_ep_rank_{e:02d}_tp_rank_{t:02d}_pp_rank_00.pt" for e in range(2) for t in range(2)]
    _check_full_state(read_tag(str(dst)), ref[kind], f"reshard {kind} --tp 2 --ep 2")


def _ep2_files(tag):
    """The model and optimizer ref files of a tag written in NxD's EP=2 x DP=2 layout (ZeRO-1 files by DP rank)."""
    names = lambda d: sorted(n for n in os.listdir(tag / d) if n.endswith(".pt") and ".info" not in n)  # noqa: E731
    assert names("model") == [f"dp_rank_00_ep_rank_{e:02d}_tp_rank_00_pp_rank_00.pt" for e in range(2)]
    # only ep_rank_00 holds the non-expert tensors (router, dense); each EP rank its experts (w, v)
    assert len(os.listdir(tag / "model" / f"{names('model')[1]}.tensors")) == 2
    return names("optim") if (tag / "optim").exists() else []


def test_from_dcp_with_ep_writes_nxd_ep_layout_that_loads_at_ep2(saved, tmp_path):
    """to-dcp of both EP tags, then from-dcp --ep 2 (the expert tensors as to-dcp recorded them): the same layout
    as reshard --ep 2, loaded at EP=2 x DP=2 with reshard=False, bit for bit (ZeRO-1 and plain Adam)."""
    root, _ = saved
    out = tmp_path / "ckpt"
    for kind, z in (("adam", "--no-zero1"), ("zero1", "--zero1")):
        assert main(["to-dcp", os.path.join(root, kind), str(tmp_path / f"dcp_{kind}")]) == 0
        assert main(["from-dcp", str(tmp_path / f"dcp_{kind}"), str(out / f"{kind}_dcp_ep2"), "--ep", "2",
                     "--dp", "2", z]) == 0
        assert main(["verify", str(out / f"{kind}_dcp_ep2")]) == 0
    assert _ep2_files(out / "zero1_dcp_ep2") == [f"dp_rank_{d:02d}_tp_rank_00_pp_rank_00.pt" for d in range(2)]
    assert _ep2_files(out / "adam_dcp_ep2") == [f"dp_rank_00_ep_rank_{e:02d}_tp_rank_00_pp_rank_00.pt"
                                                for e in range(2)]
    assert run_ranks(_load_ep2, 2, str(out), "adam_dcp_ep2", "zero1_dcp_ep2", timeout=180) == [True, True]


def test_import_with_ep_writes_nxd_ep_layout_that_loads_at_ep2(saved, tmp_path):
    """export joins the experts into Hugging Face safetensors; import --ep 2 --expert splits them again in NxD's
    EP layout, which loads at EP=2 x DP=2 with reshard=False, bit for bit."""
    root, _ = saved
    hf, out = tmp_path / "hf", tmp_path / "ckpt"
    assert main(["export", os.path.join(root, "zero1"), "--output", str(hf)]) == 0
    argv = ["import", str(hf), str(out / "imported_ep2"), "--ep", "2", "--dp", "2"]
    assert main(argv + [a for k in EXPERTS for a in ("--expert", k)]) == 0
    assert _ep2_files(out / "imported_ep2") == []
    assert run_ranks(_load_ep2, 2, str(out), None, None, "imported_ep2", timeout=180) == [True, True]


@pytest.mark.parametrize("extra, message", [
    (["--ep", "2", "--dp", "2"], "records no expert tensors, so nothing would be split over EP; name them with --expert"),
    (["--expert", "w"], "--expert marks tensors to split over expert-parallel ranks; it needs --ep E"),
    (["--ep", "2", "--dp", "2", "--expert", "experts.*"], "--expert 'experts.*' matches no tensor of HF_DIR"),
    (["--ep", "2", "--expert", "w"], "--ep 2 does not divide --dp 1"),
    (["--ep", "3", "--dp", "3", "--expert", "w"], "w holds 4 experts along dim 0, which do not split into --ep 3"),
])
def test_import_ep_refusals(saved, tmp_path, capsys, extra, message):
    root, _ = saved
    hf = tmp_path / "hf"
    assert main(["export", os.path.join(root, "zero1"), "--output", str(hf)]) == 0
    capsys.readouterr()
    assert main(["import", str(hf), str(tmp_path / "out")] + extra) == 1
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def _bf16_source_with_masters():
    """A whole-model ZeRO-1 FullState of the MoE in bfloat16 whose fp32 master weights hold bits the bf16 model
    does not (what a bf16 run's ZeRO-1 state looks like), with moments."""
    from nxd_ckpt.fullstate import FullState, OptimState, ParamState, TensorSource

    g = torch.Generator().manual_seed(7)
    masters = {k: torch.randn(s, generator=g) for k, s in SHAPES.items()}
    moments = {k: (torch.randn(s, generator=g), torch.rand(s, generator=g)) for k, s in SHAPES.items()}
    src = lambda name, t: TensorSource(name, tuple(t.shape), t.dtype, None, lambda: t)  # noqa: E731
    model = [src(k, m) for k, m in masters.items()]       # master weights stand in for the model (as read_tag does)
    params = {k: ParamState({"exp_avg": src(k, a), "exp_avg_sq": src(k, b)}, torch.tensor(3.0), model[i])
              for i, (k, (a, b)) in enumerate(moments.items())}
    state = FullState(model, OptimState(params, [({"lr": LR}, list(SHAPES))]),
                      model_dtypes={k: torch.bfloat16 for k in SHAPES}, experts=frozenset(EXPERTS))
    return state, masters, moments


def test_reshard_ep_zero1_carries_fp32_master_weights(tmp_path, capsys):
    """reshard --ep 2 --zero1 of a ZeRO-1 tag whose fp32 master weights differ from its bf16 model keeps them as
    sharded_master_weights (cut like the moments: experts over expert-DP, the rest over DP), so that reading the
    new tag back, or resharding it to --ep 1, gives the fp32 masters bit for bit (it used to drop them)."""
    import xser
    from nxd_ckpt.fullstate import read_tag
    from nxd_ckpt.partition import zero1_shard
    from nxd_ckpt.tagwrite import TagSizes, write_tag

    state, masters, moments = _bf16_source_with_masters()
    write_tag(state, str(tmp_path / "src"), TagSizes(dp=2, zero1=True), converted_from={})
    experts = [a for k in EXPERTS for a in ("--expert", k)]    # a tag saved at EP=1 marks no expert tensor
    assert main(["reshard", str(tmp_path / "src"), str(tmp_path / "ep2"), "--ep", "2", "--dp", "4"]) == 1
    assert "--ep 2: the source records no expert tensors, so nothing would be split over EP" in capsys.readouterr().err
    assert not (tmp_path / "ep2").exists()
    assert main(["reshard", str(tmp_path / "src"), str(tmp_path / "ep2"), "--ep", "2", "--dp", "4"] + experts) == 0
    assert main(["reshard", str(tmp_path / "ep2"), str(tmp_path / "ep1"), "--ep", "1", "--dp", "1"]) == 0
    index = [k for k in SHAPES if k not in EXPERTS] + list(EXPERTS)   # non-experts first, then the experts
    for d in range(4):     # DP file d = x * EP + e holds expert-DP piece x of EP rank e (NxD's row-major grid)
        sd = xser.load(str(tmp_path / "ep2" / "optim" / f"dp_rank_{d:02d}_tp_rank_00_pp_rank_00.pt"))
        assert set(sd["sharded_master_weights"]) == set(sd["base_state"]) == set(range(4))
        for i, k in enumerate(index):
            local = _local(masters[k], k, 2, d % 2, 1, 0) if k in EXPERTS else masters[k]
            group, rank = (2, d // 2) if k in EXPERTS else (4, d)
            _bits(sd["sharded_master_weights"][i], zero1_shard(local, rank, group), f"dp {d} {k} master")
    for tag in ("ep2", "ep1"):
        got = read_tag(str(tmp_path / tag))
        for k in SHAPES:
            ps = got.optim.params[k]
            _bits(ps.master.checked(), masters[k], f"{tag} {k} master")
            _bits(ps.moments["exp_avg"].checked(), moments[k][0], f"{tag} {k} exp_avg")
            assert got.model_dtypes[k] == torch.bfloat16


def _load_masters_at_ep1(rank, world, root):
    """load_checkpoint of the EP=2 tag that carries master weights, resharded to one process (EP=1, a plain ZeRO-1
    optimizer): the optimizer's masters are the fp32 originals and the parameters their bf16 casts, bit for bit."""
    import nxd_ckpt
    import parallel_state as ps
    from nxd_ckpt.testing import ZeroOneAdam

    ps.initialize_model_parallel()
    _, masters, moments = _bf16_source_with_masters()
    model = _MoE(1, 0, 1, 0).to(torch.bfloat16)
    opt = ZeroOneAdam(model.parameters(), lr=LR)
    nxd_ckpt.load_checkpoint(root, "ep2", model=model, optimizer=opt)
    for i, (k, p) in enumerate(model.named_parameters()):
        _bits(opt.master[i], masters[k], f"load {k} master")
        _bits(p.data, masters[k].bfloat16(), f"load {k}")
        _bits(opt.base_state[i]["exp_avg"], moments[k][0], f"load {k} exp_avg")
    return True


def test_load_checkpoint_reads_the_masters_reshard_ep_carried(tmp_path):
    from nxd_ckpt.tagwrite import TagSizes, write_tag

    state, _, _ = _bf16_source_with_masters()
    write_tag(state, str(tmp_path / "src"), TagSizes(dp=2, zero1=True), converted_from={})
    assert main(["reshard", str(tmp_path / "src"), str(tmp_path / "ep2"), "--ep", "2", "--dp", "4", "--expert", "w",
                 "--expert", "v"]) == 0
    assert run_ranks(_load_masters_at_ep1, 1, str(tmp_path), timeout=120) == [True]


def test_rank_of_names_the_owner_on_the_expert_grid_at_ep2_dp4():
    """EP=2 x DP=4 (expert-DP 2), TP=2: an EP file (dp field 00, as NxD names them) belongs to expert-DP rank 0 of
    its EP rank, a ZeRO-1 file to its DP rank; both agree with parallel_state's rank grid."""
    from parallel_state.topology import Topology

    from nxd_ckpt.zero1 import _rank_of

    topo, grid = {"tp": 2, "dp": 4, "ep": 2, "pp": 1}, Topology(8, tp=2, pp=1, cp=1, ep=2)
    for e, t in itertools.product(range(2), range(2)):
        rel = f"model/dp_rank_00_ep_rank_{e:02d}_tp_rank_{t:02d}_pp_rank_00.pt"
        assert _rank_of(rel, topo) == grid.expert_rank_of(0, 0, e, t) == e * 2 + t, rel
    # a dp field of 1 (not NxD's naming, read as the expert-DP rank): expert-DP rank 1 of EP rank e
    assert _rank_of("model/dp_rank_01_ep_rank_01_tp_rank_01_pp_rank_00.pt", topo) == grid.expert_rank_of(0, 1, 1, 1) == 7
    assert [_rank_of(f"optim/dp_rank_{d:02d}_tp_rank_01_pp_rank_00.pt", topo) for d in range(4)] == [1, 3, 5, 7]
