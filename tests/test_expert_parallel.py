"""Expert parallelism exactly as NxD 2.29 (DESIGN 2.6): file names, where non-expert tensors live, expert flags,
ZeRO-1 and plain optimizers, both directions; 4 ranks as EP=2 x expert-DP=2 (DP=4)."""
from __future__ import annotations

import os

import pytest
import torch

import xser
from harness import run_ranks
from nxd_ckpt import layout
from tiny_models import TinyShard, all_files, assert_bit_equal, sync, to_cpu_state

HIDDEN = 8


# ---- a tiny MoE-like model: `up` is an expert weight (different per EP rank), the rest is shared -------------
def _expert_weight(ep: int) -> torch.Tensor:
    return torch.randn(HIDDEN, HIDDEN, generator=torch.Generator().manual_seed(77 + ep))


def _ep_model(ps, seed_offset=0):
    model = TinyShard(hidden=HIDDEN, seed_offset=seed_offset)
    with torch.no_grad():
        model.up.copy_(_expert_weight(ps.get_expert_model_parallel_rank() + seed_offset).to(model.up.device))
    model.up.expert_model_parallel = True
    return model


def _make_opt(ps, model, zero1):
    if not zero1:
        return torch.optim.Adam(model.parameters(), lr=0.01)
    from nxd_ckpt.testing import ZeroOneEPAdam

    return ZeroOneEPAdam(model.parameters(), lr=0.01,
                         dp_group=ps.get_data_parallel_host_group(), dp_rank=ps.get_data_parallel_rank(),
                         dp_size=ps.get_data_parallel_size(), edp_group=ps.get_expert_data_parallel_host_group(),
                         edp_rank=ps.get_expert_data_parallel_rank(), edp_size=ps.get_expert_data_parallel_size())


def _train(ps, model, opt, steps, start, zero1):
    """Deterministic steps: non-expert gradients averaged over DP, expert ones over expert-DP (as NxD)."""
    import torch.distributed as dist

    dev = model.up.device
    for s in range(start, start + steps):
        g = torch.Generator().manual_seed(50 + 10 * s + ps.get_data_parallel_rank())
        loss = model(torch.randn(4, HIDDEN, generator=g).to(dev)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        if not zero1:   # ZeroOneEPAdam reduces over its own groups
            for p in model.parameters():
                expert = getattr(p, "expert_model_parallel", False)
                group = ps.get_expert_data_parallel_host_group() if expert else ps.get_data_parallel_host_group()
                size = ps.get_expert_data_parallel_size() if expert else ps.get_data_parallel_size()
                grad = p.grad.detach().cpu()
                dist.all_reduce(grad, group=group)
                p.grad = (grad / size).to(dev)
        opt.step()
        sync()


def _opt_state(opt):
    return to_cpu_state(opt.state_dict())


def _ep_round_trip_rank(rank, world, root, zero1):
    import nxd_ckpt
    import parallel_state as ps
    from nxd_ckpt.storage import set_write_hook

    ps.initialize_model_parallel(expert_model_parallel_size=2)
    model = _ep_model(ps)
    opt = _make_opt(ps, model, zero1)
    _train(ps, model, opt, 2, 0, zero1)
    written = []
    set_write_hook(written.append)
    nxd_ckpt.save_checkpoint(root, "step_2", model=model, optimizer=opt, use_xser=True)
    set_write_hook(None)
    saved_model, saved_opt = to_cpu_state(model.state_dict()), _opt_state(opt)
    _train(ps, model, opt, 2, 2, zero1)   # the uninterrupted run
    final = (to_cpu_state(model.state_dict()), _opt_state(opt))

    fresh = _ep_model(ps, seed_offset=9)
    fresh_opt = _make_opt(ps, fresh, zero1)
    nxd_ckpt.load_checkpoint(root, model=fresh, optimizer=fresh_opt)
    assert_bit_equal(saved_model, to_cpu_state(fresh.state_dict()), "model")
    assert_bit_equal(saved_opt, _opt_state(fresh_opt), "optim")
    _train(ps, fresh, fresh_opt, 2, 2, zero1)   # resumed
    assert_bit_equal(final, (to_cpu_state(fresh.state_dict()), _opt_state(fresh_opt)), "resumed")
    return {"written": written, "dp": ps.get_data_parallel_rank(), "ep": ps.get_expert_model_parallel_rank()}


# ---- the files NxD writes for this state (DESIGN 2.6) ------------------------------------------------------
MODEL_TENSORS = 4            # up (expert), down, bias, steps_seen
PLAIN_OPTIM_TENSORS = 9      # step, exp_avg, exp_avg_sq of up (expert), down, bias
PLAIN_OPTIM_EXPERT = 3       # tids 0-2: up's state
ZERO1_TENSORS = 9            # base_state (3 x 3); NxD's EP ZeRO-1 state has no sharded_master_weights


def _shard_files(folder, name, tids):
    base = f"{folder}/{name}"
    return {base, base + ".info.pt"} | {f"{base}.tensors/tensor_{t}.pt" for t in tids}


def nxd_file_set(zero1: bool) -> set:
    files = {"checkpoint", "done"}
    for ep in range(2):
        name = layout.shard_filename(0, 0, 0, ep)
        files |= _shard_files("model", name, range(MODEL_TENSORS) if ep == 0 else [0])
        if not zero1:
            files |= _shard_files("optim", name, range(PLAIN_OPTIM_TENSORS if ep == 0 else PLAIN_OPTIM_EXPERT))
    if zero1:
        for dp in range(4):
            files |= _shard_files("optim", layout.shard_filename(dp, 0, 0), range(ZERO1_TENSORS))
    return files


@pytest.mark.parametrize("zero1", [True, False], ids=["zero1", "adam"])
def test_ep2_round_trip_and_resume_with_nxds_file_names(tmp_path, zero1):
    root = str(tmp_path / "ckpt")
    results = run_ranks(_ep_round_trip_rank, 4, root, zero1, timeout=300)
    tag = os.path.join(root, "step_2")
    assert all_files(tag) == nxd_file_set(zero1) | {"manifest.json"}
    payload = [w for r in results for w in r["written"] if "/model/" in w or "/optim/" in w]
    assert len(payload) == len(set(payload)), "a file was written by two ranks"
    for r in results:   # ZeRO-1 files are named by the full DP rank, the writer's own
        if zero1:
            assert any(f"/optim/dp_rank_{r['dp']:02d}_tp_rank_00_pp_rank_00.pt" in w for w in r["written"])
    model_info = [torch.load(os.path.join(tag, "model", layout.shard_filename(0, 0, 0, e) + ".info.pt"),
                             weights_only=True) for e in range(2)]
    refs = xser.load_refs(os.path.join(tag, "model", layout.shard_filename(0, 0, 0, 1)))
    assert refs["up"].tid == 0
    for info in model_info:
        assert [info[t]["expert_model_parallel"] for t in range(MODEL_TENSORS)] == [True, False, False, False]
    if not zero1:
        info = torch.load(os.path.join(tag, "optim", layout.shard_filename(0, 0, 0, 1) + ".info.pt"),
                          weights_only=True)
        assert [info[t]["expert_model_parallel"] for t in range(PLAIN_OPTIM_TENSORS)] == [True] * 3 + [False] * 6
    # the offline tools read it too
    from nxd_ckpt.inspect import describe
    from nxd_ckpt.verify import verify_tag

    assert verify_tag(tag).problems == []
    d = describe(tag, tensors=True)
    assert d["topology"]["ep"] == 2 and d["topology"]["dp"] == 4


# ---- NxD's own EP checkpoints, built by hand from its documented behaviour, load bit-exact -----------------
def _nxd_model(ep):
    g = torch.Generator().manual_seed(5)
    return {"up": _expert_weight(100 + ep), "down": torch.randn(HIDDEN, HIDDEN, generator=g),
            "bias": torch.randn(HIDDEN, generator=g), "steps_seen": torch.tensor(7)}


def _nxd_zero1(dp):
    g = torch.Generator().manual_seed(300 + dp)
    adam = lambda rows: {"step": torch.tensor(3.0), "exp_avg": torch.randn(rows, HIDDEN, generator=g),  # noqa: E731
                         "exp_avg_sq": torch.rand(rows, HIDDEN, generator=g)}
    group = {"lr": 0.01, "betas": (0.9, 0.999), "eps": 1e-8}
    return {"ep_param_id_offset": 1, "ep_param_group_offset": 1, "ep_base_state_offset": 2, "ep_shape_info_offset": 2,
            "param_groups": [dict(group, params=[0, 1]), dict(group, params=[0])], "state": {},
            "base_state": {0: adam(2), 1: {"step": torch.tensor(3.0), "exp_avg": torch.randn(2, generator=g),
                                           "exp_avg_sq": torch.rand(2, generator=g)}, 2: adam(4)},
            "shape_info": {0: torch.Size([HIDDEN, HIDDEN]), 1: torch.Size([HIDDEN]), 2: torch.Size([HIDDEN, HIDDEN])}}


def _nxd_adam(ep):
    g = torch.Generator().manual_seed(400)   # non-expert state: the same on every EP rank
    e = torch.Generator().manual_seed(500 + ep)
    moments = lambda shape, gen: {"step": torch.tensor(3.0), "exp_avg": torch.randn(*shape, generator=gen),  # noqa: E731
                                  "exp_avg_sq": torch.rand(*shape, generator=gen)}
    return {"state": {0: moments((HIDDEN, HIDDEN), e), 1: moments((HIDDEN, HIDDEN), g), 2: moments((HIDDEN,), g)},
            "param_groups": [{"lr": 0.01, "betas": (0.9, 0.999), "eps": 1e-8, "params": [0, 1, 2]}]}


def _write_nxd_shard(tagdir, rel, state, expert_tids, written_tids):
    """NxD's xser shard: ref pickle, .info.pt {tid: dtype, shape, expert_model_parallel}, tensor files."""
    ref, tensors = xser.to_refs(state)
    path = os.path.join(tagdir, rel)
    os.makedirs(path + ".tensors", exist_ok=True)
    for tid in written_tids:
        with open(os.path.join(path + ".tensors", f"tensor_{tid}.pt"), "wb") as f:
            xser.write_tensor(tensors[tid], f)
    info = {tid: {"dtype": t.dtype, "shape": t.shape, "expert_model_parallel": tid in expert_tids}
            for tid, t in enumerate(tensors)}
    torch.save(info, path + ".info.pt")
    with open(path, "wb") as f:
        xser.dump_refs(ref, f)


def build_nxd_ep_tag(tagdir: str, zero1: bool) -> None:
    """A tag as NxD 2.29 writes it at EP=2 x expert-DP=2 (4 ranks, TP=PP=1)."""
    for ep in range(2):
        name = layout.shard_filename(0, 0, 0, ep)
        # non-expert tensors only under ep_rank_00; every EP rank writes its own ref and info
        _write_nxd_shard(tagdir, f"model/{name}", _nxd_model(ep), {0}, range(MODEL_TENSORS) if ep == 0 else [0])
        if not zero1:
            _write_nxd_shard(tagdir, f"optim/{name}", _nxd_adam(ep), set(range(PLAIN_OPTIM_EXPERT)),
                             range(PLAIN_OPTIM_TENSORS) if ep == 0 else range(PLAIN_OPTIM_EXPERT))
    if zero1:   # one file per full DP rank, no ep field; NxD marks no ZeRO-1 tensor as expert
        for dp in range(4):
            _write_nxd_shard(tagdir, f"optim/{layout.shard_filename(dp, 0, 0)}", _nxd_zero1(dp), set(),
                             range(ZERO1_TENSORS))
    for marker in ("checkpoint", "done"):
        with open(os.path.join(tagdir, marker), "w") as f:
            f.write("1")


def _expected_nxd_state(ep, dp, zero1):
    model = dict(_nxd_model(0), up=_nxd_model(ep)["up"])
    if zero1:
        return model, _nxd_zero1(dp)
    optim = _nxd_adam(0)
    optim["state"][0] = _nxd_adam(ep)["state"][0]
    return model, optim


def _nxd_fixture_rank(rank, world, root):
    import nxd_ckpt
    import parallel_state as ps

    ps.initialize_model_parallel(expert_model_parallel_size=2)
    ep, dp = ps.get_expert_model_parallel_rank(), ps.get_data_parallel_rank()
    for tag, zero1 in (("nxd_zero1", True), ("nxd_adam", False)):
        model, optim = {}, {}
        nxd_ckpt.load_checkpoint(root, tag, model=model, optimizer=optim)
        want_model, want_optim = _expected_nxd_state(ep, dp, zero1)
        assert_bit_equal(want_model, model, f"{tag}/model")
        assert_bit_equal(want_optim, optim, f"{tag}/optim")
    return True


def test_nxds_ep_checkpoints_load_bit_exact(tmp_path):
    root = str(tmp_path / "ckpt")
    for tag, zero1 in (("nxd_zero1", True), ("nxd_adam", False)):
        build_nxd_ep_tag(os.path.join(root, tag), zero1)
        assert all_files(os.path.join(root, tag)) == nxd_file_set(zero1)
    assert run_ranks(_nxd_fixture_rank, 4, root, timeout=240) == [True] * 4


def test_verify_accepts_nxds_ep_checkpoint(tmp_path):
    from nxd_ckpt.verify import verify_tag

    tagdir = str(tmp_path / "nxd_zero1")
    build_nxd_ep_tag(tagdir, zero1=True)
    assert verify_tag(tagdir).problems == []
    os.remove(os.path.join(tagdir, "model", layout.shard_filename(0, 0, 0, 0) + ".tensors", "tensor_1.pt"))
    assert any("tensor_1.pt" in str(p) for p in verify_tag(tagdir).problems)   # a non-expert tensor ep 1 reads


# ---- convert-zero1 of an EP ZeRO-1 state: non-expert over DP, expert over expert-DP ------------------------
def _full_params():
    g = torch.Generator().manual_seed(11)
    return {"down": torch.randn(HIDDEN, HIDDEN, generator=g), "bias": torch.randn(HIDDEN - 1, generator=g),
            "up": {e: torch.randn(HIDDEN + 2, HIDDEN, generator=g) for e in range(2)}}   # 10 rows: padding at 4, 8


def _ep_zero1_shard(full, dp, dp_size, ep_size=2):
    """DP rank ``dp``'s NxD EP ZeRO-1 state: down and bias sharded over DP, up (expert) over expert-DP."""
    from nxd_ckpt.testing import shard_of

    ep, edp = dp % ep_size, dp // ep_size
    pieces = {0: shard_of(full["down"], dp, dp_size), 1: shard_of(full["bias"], dp, dp_size),
              2: shard_of(full["up"][ep], edp, dp_size // ep_size)}
    base = {i: {"step": torch.tensor(5.0), "exp_avg": p * 2, "exp_avg_sq": p * p} for i, p in pieces.items()}
    group = {"lr": 0.01, "betas": (0.9, 0.999), "eps": 1e-8}
    return {"ep_param_id_offset": 1, "ep_param_group_offset": 1, "ep_base_state_offset": 2, "ep_shape_info_offset": 2,
            "param_groups": [dict(group, params=[0, 1]), dict(group, params=[0])], "state": {}, "base_state": base,
            "shape_info": {0: full["down"].shape, 1: full["bias"].shape, 2: full["up"][0].shape}}


def _build_ep_zero1_tag(tagdir, dp_size, use_xser):
    """An EP=2 NxD tag with a ZeRO-1 optimizer over ``dp_size`` ranks in the new directory ``tagdir``."""
    for sub in ("model", "optim"):
        os.makedirs(os.path.join(tagdir, sub))
    full = _full_params()
    for ep in range(2):
        name = layout.shard_filename(0, 0, 0, ep)
        _write_nxd_shard(tagdir, f"model/{name}", _nxd_model(ep), {0}, range(MODEL_TENSORS) if ep == 0 else [0])
    for dp in range(dp_size):
        rel = f"optim/{layout.shard_filename(dp, 0, 0)}"
        if use_xser:
            _write_nxd_shard(tagdir, rel, _ep_zero1_shard(full, dp, dp_size), set(), range(ZERO1_TENSORS))
        else:
            torch.save(_ep_zero1_shard(full, dp, dp_size), os.path.join(tagdir, rel))
    for marker in ("checkpoint", "done"):
        with open(os.path.join(tagdir, marker), "w") as f:
            f.write("1")
    return full


@pytest.mark.parametrize("use_xser", [True, False], ids=["xser", "plain"])
@pytest.mark.parametrize("dp_out", [2, 8])
def test_convert_zero1_reshards_expert_parallel_state(tmp_path, use_xser, dp_out):
    from nxd_ckpt.zero1 import convert_zero1

    src = str(tmp_path / "in")
    full = _build_ep_zero1_tag(src, 4, use_xser)
    out = str(tmp_path / "out")
    convert_zero1(src, out, dp_size=dp_out)
    for dp in range(dp_out):
        path = os.path.join(out, "optim", layout.shard_filename(dp, 0, 0))
        got = xser.load(path) if use_xser else torch.load(path, weights_only=True)
        assert_bit_equal(_ep_zero1_shard(full, dp, dp_out), got, f"dp {dp}")
    assert not os.path.exists(os.path.join(out, "optim", layout.shard_filename(dp_out, 0, 0)))
    import json

    with open(os.path.join(out, "manifest.json")) as f:
        topo = json.load(f)["topology"]
    assert (topo["dp"], topo["ep"]) == (dp_out, 2)
    # model files (expert-parallel names, non-expert tensors under ep_rank_00) come along unchanged
    model = sorted(os.listdir(os.path.join(out, "model")))
    assert model == sorted(os.listdir(os.path.join(src, "model")))


def _converted_rank(rank, world, root):
    import nxd_ckpt
    import parallel_state as ps

    ps.initialize_model_parallel(expert_model_parallel_size=2)   # 2 ranks: DP=2, EP=2, expert-DP=1
    ep, dp = ps.get_expert_model_parallel_rank(), ps.get_data_parallel_rank()
    model, optim = {}, {}
    nxd_ckpt.load_checkpoint(root, "dp2", model=model, optimizer=optim)
    assert_bit_equal(dict(_nxd_model(0), up=_nxd_model(ep)["up"]), model, "model")
    assert_bit_equal(_ep_zero1_shard(_full_params(), dp, 2), optim, "optim")
    return ep, dp


def test_ep_zero1_converted_to_a_smaller_dp_loads(tmp_path):
    from nxd_ckpt.zero1 import convert_zero1

    src = str(tmp_path / "dp4")
    _build_ep_zero1_tag(src, 4, True)
    root = str(tmp_path / "ckpt")
    convert_zero1(src, os.path.join(root, "dp2"), dp_size=2)
    assert run_ranks(_converted_rank, 2, root, timeout=180) == [(0, 0), (1, 1)]


def test_convert_zero1_ep_refusals(tmp_path):
    from nxd_ckpt.errors import CheckpointArgumentError
    from nxd_ckpt.zero1 import Zero1FormatError, convert_zero1

    src = str(tmp_path / "in")
    _build_ep_zero1_tag(src, 4, True)
    out = str(tmp_path / "out")
    with pytest.raises(CheckpointArgumentError, match="new DP size 3 is not a multiple of EP=2"):
        convert_zero1(src, out, dp_size=3)
    with pytest.raises(Zero1FormatError, match="convert_to_full cannot hold EP=2"):
        convert_zero1(src, out, to_full=True)
    # an optim/ folder alone: NxD's EP keys, but no model/ names to give the EP size
    with pytest.raises(Zero1FormatError, match="EP size is unknown"):
        convert_zero1(os.path.join(src, "optim"), out, dp_size=2)
    assert not os.path.exists(out)


def test_topology_mismatch_names_the_full_dp_size():
    from nxd_ckpt.errors import TopologyMismatchError
    from nxd_ckpt.loader import check_topology
    from nxd_ckpt.world import World
    from parallel_state.topology import Topology

    saved = {"tp": 1, "pp": 1, "ep": 2, "dp": None, "zero1_shards": 4, "zero1": True}
    same = World(0, 4, 0, 4, Topology(4, ep=2), True)
    check_topology("t", saved, same, loading_optim=True)   # NxD's EP=2 x DP=4 ZeRO-1 fits DP=4 EP=2
    smaller = World(0, 2, 0, 2, Topology(2, ep=2), True)
    with pytest.raises(TopologyMismatchError) as info:
        check_topology("t", saved, smaller, loading_optim=True)
    msg = str(info.value)
    assert "saved at TP=1 PP=1 DP=4 EP=2 with ZeRO-1" in msg and "runs TP=1 PP=1 DP=2 EP=2 (DP differs)" in msg
    assert "--dp_size 2" in msg


# ---- EP together with CP (NxD allows it): model and plain optimizer as above; ZeRO-1 refused ------------------
def _ep_cp_rank(rank, world, root):
    import nxd_ckpt
    import parallel_state as ps

    ps.initialize_model_parallel(context_parallel_size=2, expert_model_parallel_size=2)   # DP=2, EDP=2
    ep, cp, dp = ps.get_expert_model_parallel_rank(), ps.get_context_parallel_rank(), ps.get_data_parallel_rank()
    model = _nxd_model(ep)
    model["up"].expert_model_parallel = True
    nxd_ckpt.save_checkpoint(root, "plain", model=model, optimizer=_nxd_adam(0), use_xser=True)
    got_model, got_optim = {}, {}
    nxd_ckpt.load_checkpoint(root, "plain", model=got_model, optimizer=got_optim)
    assert_bit_equal(_nxd_model(ep), got_model, "model")
    assert_bit_equal(_nxd_adam(0), got_optim, "optim")
    with pytest.raises(nxd_ckpt.CheckpointArgumentError, match="EP=2 with CP=2 .* named by the DP rank alone"):
        nxd_ckpt.save_checkpoint(root, "zero1", model=model, optimizer=_nxd_zero1(dp), zero1_optimizer=True)
    return ep, cp, dp


def test_expert_with_context_parallel_round_trip(tmp_path):
    root = str(tmp_path / "ckpt")
    coords = run_ranks(_ep_cp_rank, 4, root, timeout=240)
    assert coords == [(0, 0, 0), (1, 1, 0), (0, 0, 1), (1, 1, 1)]   # the expert view folds CP into EP here
    tag = os.path.join(root, "plain")
    files = all_files(tag) - {"manifest.json", "checkpoint", "done"}
    want = set()
    for ep in range(2):
        name = layout.shard_filename(0, 0, 0, ep)
        want |= _shard_files("model", name, range(MODEL_TENSORS) if ep == 0 else [0])
        want |= _shard_files("optim", name, range(PLAIN_OPTIM_TENSORS) if ep == 0 else [])
    assert files == want
    assert sorted(os.listdir(root)) == ["newest", "plain"]   # the refused save wrote nothing (no staging dir)
