"""Load-time resharding over expert parallelism: a tiny MoE layer trained one step at EP=2 x DP=4 (4 ranks, NxD's
expert-parallel ZeRO-1, and a plain Adam) loads at EP=1, EP=4 and TP=2 x EP=2. Right after loading, every
parameter, Adam moment and master weight of every rank equals the full state (the same step taken on the whole
model in one process) split at the new sizes, bit for bit (and at EP=2 x PP=2, where only DP and expert-DP change): experts over EP along dim 0 and over TP along their
partition dim, ZeRO-1 pieces over DP (non-expert parameters) or expert-DP (experts)."""
from __future__ import annotations

import logging
import os

import pytest
import torch
from harness import run_ranks

from nxd_ckpt.partition import Partition, split_tp, zero1_shard

E, H, F = 4, 8, 8                       # experts, hidden, expert FFN
SHAPES = {"w": (E, H, F), "v": (E, F, H), "router": (E, H), "dense": (H, H)}
PARTS = {"w": Partition(2), "v": Partition(1), "router": None, "dense": Partition(0)}
EXPERTS = ("w", "v")
LR = 0.1


def _full(seed: int):
    """Whole-model tensors; multiples of 1/16 so that gradient averages over DP replicas are exact."""
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randint(-8, 8, s, generator=g).float() / 16 for k, s in SHAPES.items()}


def _local(full: torch.Tensor, key: str, ep: int, e: int, tp: int, t: int) -> torch.Tensor:
    """EP rank e's (TP rank t's) shard: experts split along dim 0 over EP, then by the partition over TP."""
    if key in EXPERTS:
        n = full.shape[0] // ep
        full = full.narrow(0, e * n, n)
    return split_tp(full, PARTS[key], tp, t).clone()


class _MoE(torch.nn.Module):
    def __init__(self, ep: int, e: int, tp: int, t: int, seed: int = 1):
        super().__init__()
        full = _full(seed)
        for k in SHAPES:
            p = torch.nn.Parameter(_local(full[k], k, ep, e, tp, t))
            if PARTS[k] is not None:
                p.tensor_model_parallel, p.partition_dim, p.partition_stride = True, PARTS[k].dim, 1
            if k in EXPERTS and ep > 1:      # NxD marks expert weights only at EP > 1
                p.expert_model_parallel = True
            setattr(self, k, p)

    def step(self, opt, ep: int, e: int, tp: int, t: int) -> None:
        grads = _full(2)
        for k, p in self.named_parameters():
            p.grad = _local(grads[k], k, ep, e, tp, t)
        opt.step()


def _reference():
    """The same step on the whole model in one process: (params, {key: (exp_avg, exp_avg_sq)}) for ZeRO-1
    Adam and for torch's Adam, and (key "next") the parameters after a second step of each."""
    from nxd_ckpt.testing import ZeroOneAdam

    out = {}
    for kind in ("zero1", "adam"):
        m = _MoE(1, 0, 1, 0)
        opt = ZeroOneAdam(m.parameters(), lr=LR) if kind == "zero1" else torch.optim.Adam(m.parameters(), lr=LR)
        m.step(opt, 1, 0, 1, 0)
        params = {k: p.detach().clone() for k, p in m.named_parameters()}
        if kind == "zero1":
            moments = {k: (opt.base_state[i]["exp_avg"].clone(), opt.base_state[i]["exp_avg_sq"].clone())
                       for i, k in enumerate(params)}
        else:
            moments = {k: (opt.state[p]["exp_avg"].clone(), opt.state[p]["exp_avg_sq"].clone())
                       for k, p in m.named_parameters()}
        out[kind] = (params, moments)
        m.step(opt, 1, 0, 1, 0)
        out[f"{kind} next"] = {k: p.detach().clone() for k, p in m.named_parameters()}
    return out


def _check_next_step(coords, model, opt, want, where):
    """One more step after the load lands where the whole model's second step does (Adam is elementwise and the
    gradient averages over replicas are exact), bit for bit."""
    model.step(opt, *coords)
    ep, e, tp, t = coords
    for k, p in model.named_parameters():
        _bits(p.data, _local(want[k], k, ep, e, tp, t), f"{where} {k} after the next step")


def _zero1_opt(ps, model):
    from nxd_ckpt.testing import ZeroOneAdam, ZeroOneEPAdam

    dp = dict(dp_group=ps.get_data_parallel_host_group(), dp_rank=ps.get_data_parallel_rank(),
              dp_size=ps.get_data_parallel_size())
    if ps.get_expert_model_parallel_size() == 1:
        return ZeroOneAdam(model.parameters(), lr=LR, **dp)
    return ZeroOneEPAdam(model.parameters(), lr=LR, edp_group=ps.get_expert_data_parallel_host_group(),
                         edp_rank=ps.get_expert_data_parallel_rank(),
                         edp_size=ps.get_expert_data_parallel_size(), **dp)


def _coords(ps):
    return (ps.get_expert_model_parallel_size(), ps.get_expert_model_parallel_rank(),
            ps.get_tensor_model_parallel_size(), ps.get_tensor_model_parallel_rank())


def _bits(a, b, what):
    a, b = a.detach().cpu(), b.detach().cpu()
    assert a.dtype == b.dtype and a.shape == b.shape, f"{what}: {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}"
    assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), f"{what} differs"


def _check_zero1(ps, model, opt, ref, where):
    """Every parameter, moment and master piece of this rank equals the reference split at this rank's sizes."""
    params, moments = ref
    ep, e, tp, t = _coords(ps)
    for k, p in model.named_parameters():
        _bits(p.data, _local(params[k], k, ep, e, tp, t), f"{where} {k}")
    subs = [(opt, ps.get_data_parallel_size(), ps.get_data_parallel_rank())] if ep == 1 else [
        (opt.non_ep, ps.get_data_parallel_size(), ps.get_data_parallel_rank()),
        (opt.ep, ps.get_expert_data_parallel_size(), ps.get_expert_data_parallel_rank())]
    name_of = {id(p): k for k, p in model.named_parameters()}
    for sub, group, rank in subs:
        for i, p in enumerate(sub.params):
            k = name_of[id(p)]
            for f, full in zip(("exp_avg", "exp_avg_sq"), moments[k]):
                want = zero1_shard(_local(full, k, ep, e, tp, t), rank, group)
                _bits(sub.base_state[i][f], want, f"{where} {k} {f}")
            _bits(sub.master[i], zero1_shard(_local(params[k], k, ep, e, tp, t), rank, group), f"{where} {k} master")
            assert float(sub.base_state[i]["step"]) == 1.0


def _check_adam(coords, model, opt, ref, where):
    params, moments = ref
    ep, e, tp, t = coords
    for k, p in model.named_parameters():
        _bits(p.data, _local(params[k], k, ep, e, tp, t), f"{where} {k}")
        for f, full in zip(("exp_avg", "exp_avg_sq"), moments[k]):
            _bits(opt.state[p][f], _local(full, k, ep, e, tp, t), f"{where} {k} {f}")
        assert float(opt.state[p]["step"]) == 1.0


# (TP, EP, PP) of the loading job, 4 ranks each. At PP=2 every stage holds the whole (one-layer) model: TP and EP
# stay, DP and expert-DP halve, so only the saved ZeRO-1 pieces holding this rank's rows are read.
TARGETS = [(1, 1, 1), (1, 4, 1), (2, 2, 1), (1, 2, 2)]


def save_ep2_tags(root: str) -> None:
    """This rank's part of two tags of the MoE after one step at EP=2 x DP=4 (4 ranks): "zero1" (NxD's EP ZeRO-1
    optimizer, xser) and "adam" (a plain Adam, not xser)."""
    import nxd_ckpt
    import parallel_state as ps

    ps.initialize_model_parallel(expert_model_parallel_size=2)          # TP=1, DP=4, EDP=2
    coords = _coords(ps)
    model = _MoE(*coords)
    opt = _zero1_opt(ps, model)
    model.step(opt, *coords)
    nxd_ckpt.save_checkpoint(root, "zero1", model=model, optimizer=opt, zero1_optimizer=True, use_xser=True)
    model = _MoE(*coords)
    adam = torch.optim.Adam(model.parameters(), lr=LR)
    model.step(adam, *coords)
    nxd_ckpt.save_checkpoint(root, "adam", model=model, optimizer=adam, use_xser=False)
    nxd_ckpt.finalize_checkpoint()


def _ep_reshard_rank(rank, world, root):
    import nxd_ckpt
    import parallel_state as ps

    save_ep2_tags(root)

    ref = _reference()
    for tp, ep, pp in TARGETS:
        ps.destroy_model_parallel()
        ps.initialize_model_parallel(tensor_model_parallel_size=tp, expert_model_parallel_size=ep,
                                     pipeline_model_parallel_size=pp)
        coords = _coords(ps)
        model = _MoE(*coords, seed=5)
        opt = _zero1_opt(ps, model)
        nxd_ckpt.load_checkpoint(root, "zero1", model=model, optimizer=opt)
        _check_zero1(ps, model, opt, ref["zero1"], f"zero1 TP={tp} EP={ep} rank {rank}")
        _check_next_step(coords, model, opt, ref["zero1 next"], f"zero1 TP={tp} EP={ep} rank {rank}")
        model = _MoE(*coords, seed=5)
        adam = torch.optim.Adam(model.parameters(), lr=LR)
        nxd_ckpt.load_checkpoint(root, "adam", model=model, optimizer=adam)
        _check_adam(coords, model, adam, ref["adam"], f"adam TP={tp} EP={ep} rank {rank}")
        _check_next_step(coords, model, adam, ref["adam next"], f"adam TP={tp} EP={ep} rank {rank}")
    return True


def test_expert_parallel_checkpoint_reshards_to_other_ep_and_tp_sizes(tmp_path):
    root = str(tmp_path / "ckpt")
    assert run_ranks(_ep_reshard_rank, 4, root, timeout=300) == [True] * 4
    zero1 = sorted(os.listdir(os.path.join(root, "zero1", "optim")))
    assert [n for n in zero1 if n.endswith("_00.pt")] == [f"dp_rank_{d:02d}_tp_rank_00_pp_rank_00.pt" for d in range(4)]
    adam = sorted(n for n in os.listdir(os.path.join(root, "adam", "optim")))
    assert adam == [f"dp_rank_00_ep_rank_{e:02d}_tp_rank_00_pp_rank_00.pt" for e in range(2)]


# --- single process: EP=2 -> EP=1 from files, and the errors ------------------------------------------------
def _save_ep2_adam(rank, world, root, xser_):
    import nxd_ckpt
    import parallel_state as ps

    ps.initialize_model_parallel(expert_model_parallel_size=2)
    coords = _coords(ps)
    model = _MoE(*coords)
    adam = torch.optim.Adam(model.parameters(), lr=LR)
    model.step(adam, *coords)
    nxd_ckpt.save_checkpoint(root, "adam", model=model, optimizer=adam, use_xser=xser_)
    return True


@pytest.fixture(scope="module")
def ep2_adam(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("ep2") / "ckpt")
    run_ranks(_save_ep2_adam, 2, root, True, timeout=120)
    return root


def test_ep2_checkpoint_joins_its_experts_in_one_process(ep2_adam, caplog):
    import nxd_ckpt
    import parallel_state as ps

    model = _MoE(1, 0, 1, 0, seed=5)
    adam = torch.optim.Adam(model.parameters(), lr=LR)
    with caplog.at_level(logging.INFO, logger="nxd_ckpt"):
        nxd_ckpt.load_checkpoint(ep2_adam, "adam", model=model, optimizer=adam)
    assert "resharding TP=1 PP=1 DP=2 EP=2 -> TP=1 PP=1 DP=1 EP=1" in caplog.text
    assert not ps.model_parallel_is_initialized()
    _check_adam((1, 0, 1, 0), model, adam, _reference()["adam"], "EP=2 -> 1")


def test_experts_that_do_not_split_and_reshard_false_are_refused(ep2_adam):
    import nxd_ckpt

    with pytest.raises(nxd_ckpt.TopologyMismatchError, match="EP=2"):
        nxd_ckpt.load_checkpoint(ep2_adam, "adam", model=_MoE(1, 0, 1, 0), reshard=False)

    class Odd(_MoE):   # the caller's model holds 3 experts: 4 saved ones do not make that shard
        def __init__(self):
            super().__init__(1, 0, 1, 0)
            self.w = torch.nn.Parameter(torch.zeros(3, H, F))

    model = Odd()
    with pytest.raises(nxd_ckpt.StateMismatchError, match=r"w: the saved tensor .* 2 EP ranks.* this rank's tensor is "
                                                         r"\(3, 8, 8\)"):
        nxd_ckpt.load_checkpoint(ep2_adam, "adam", model=model)
    assert torch.count_nonzero(model.w.data) == 0, "nothing was applied"


@pytest.mark.parametrize("saved,match", [
    ({"tp": 1, "pp": 1, "ep": 2, "cp": 2}, r"\(CP=2\) cannot be resharded .* without context parallelism"),
    ({"tp": 1, "pp": 1, "ep": 2, "zero1": True, "zero1_shards": 4, "legacy_ep": ["optim"]},
     r"older layout .*nxd-ckpt convert-zero1 .*--dp_size 4"),
    ({"tp": 1, "pp": 1, "ep": 2, "zero1": True, "zero1_shards": 4, "layout": "trn2"},
     r"saved in the trn2 rank layout"),
])
def test_ep_reshard_refusals_say_why(saved, match):
    from nxd_ckpt.errors import TopologyMismatchError
    from nxd_ckpt.reshard_load import check_reshardable
    from nxd_ckpt.world import World
    from parallel_state.topology import Topology

    world = World(0, 4, 0, 4, Topology(4), True)
    with pytest.raises(TopologyMismatchError, match=match):
        check_reshardable("t", saved, world, has_model=True, loading_optim=True)
    if "cp" not in saved:     # the model alone reshards
        check_reshardable("t", saved, world, has_model=True, loading_optim=False)

