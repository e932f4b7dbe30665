"""parallel_state: process groups on real multi-process gloo worlds, errors, and delegation to NxD."""
from __future__ import annotations

import sys
import types

import pytest

import parallel_state as ps
from harness import run_ranks
from parallel_state.topology import Topology

KINDS = {  # our API's name -> the Topology's group kind
    "tensor_model": "tp",
    "pipeline_model": "pp",
    "data": "dp",
    "context": "cp",
    "expert_model": "ep",
    "expert_data": "edp",
}
QUERIES = [f"get_{k}_parallel_{w}" for k in KINDS for w in ("rank", "size", "group", "replica_groups")]


# ----------------------------------------------------------------------------------------------------------
# multi-process: every rank's view against the topology module
# ----------------------------------------------------------------------------------------------------------
def _describe_rank(rank, world, tp, pp, cp, ep, pretend_backend=None):
    import torch
    import torch.distributed as dist

    if pretend_backend is not None:
        # exercise the path where the default backend is not gloo (xla on Trainium): separate gloo host groups
        real_get_backend = dist.get_backend
        dist.get_backend = lambda group=None: pretend_backend if group is None else real_get_backend(group)
    assert not ps.model_parallel_is_initialized()
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                 context_parallel_size=cp, expert_model_parallel_size=ep)
    assert ps.model_parallel_is_initialized()
    out = {"topology": ps.get_topology()}
    for name in KINDS:
        group = getattr(ps, f"get_{name}_parallel_group")()
        out[name] = {
            "rank": getattr(ps, f"get_{name}_parallel_rank")(),
            "size": getattr(ps, f"get_{name}_parallel_size")(),
            "replica_groups": getattr(ps, f"get_{name}_parallel_replica_groups")(),
            "as_list": getattr(ps, f"get_{name}_parallel_group")(as_list=True),
            "group_ranks": dist.get_process_group_ranks(group),
            "rank_in_group": dist.get_rank(group),
        }
    # host groups: gloo, and collectives over them work
    host = {}
    for label, group in (("world", ps.get_host_group()), ("dp", ps.get_data_parallel_host_group()),
                         ("edp", ps.get_expert_data_parallel_host_group())):
        t = torch.tensor([rank], dtype=torch.int64)
        dist.all_reduce(t, group=group)
        host[label] = {"ranks": dist.get_process_group_ranks(group), "sum": int(t.item()),
                       "backend": dist.get_backend(group)}
    out["host"] = host
    out["host_is_device_group"] = ps.get_data_parallel_host_group() is ps.get_data_parallel_group()
    store = ps.get_store()
    store.set(f"k{rank}", str(rank * 10))
    out["store_peer"] = store.get(f"k{(rank + 1) % world}").decode()
    # destroy, then queries fail; initializing again works
    ps.destroy_model_parallel()
    assert not ps.model_parallel_is_initialized()
    try:
        ps.get_data_parallel_rank()
        out["after_destroy"] = "no error"
    except RuntimeError as exc:
        out["after_destroy"] = str(exc)
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                 context_parallel_size=cp, expert_model_parallel_size=ep)
    t = torch.tensor([1])
    dist.all_reduce(t, group=ps.get_tensor_model_parallel_group())
    out["tp_sum_after_reinit"] = int(t.item())
    ps.destroy_model_parallel()
    return out


def _check_against_topology(results, topo: Topology):
    for rank, out in enumerate(results):
        assert out["topology"] == topo
        c, e = topo.coords(rank), topo.expert_coords(rank)
        coords = {"tp": c.tp, "pp": c.pp, "dp": c.dp, "cp": c.cp, "ep": e.ep, "edp": e.edp}
        sizes = {"tp": topo.tp, "pp": topo.pp, "dp": topo.dp, "cp": topo.cp, "ep": topo.ep, "edp": topo.edp}
        for name, kind in KINDS.items():
            got = out[name]
            where = f"rank {rank} {name}"
            assert got["rank"] == coords[kind], where
            assert got["size"] == sizes[kind], where
            assert got["replica_groups"] == topo.groups(kind), where
            assert got["as_list"] == topo.groups(kind), where
            assert got["group_ranks"] == topo.group_of(kind, rank), where
            assert got["rank_in_group"] == coords[kind], where
        host = out["host"]
        assert host["world"]["ranks"] == list(range(topo.world_size))
        assert host["world"]["sum"] == sum(range(topo.world_size))
        assert host["dp"]["ranks"] == topo.group_of("dp", rank)
        assert host["dp"]["sum"] == sum(topo.group_of("dp", rank))
        assert host["edp"]["ranks"] == topo.group_of("edp", rank)
        assert host["edp"]["sum"] == sum(topo.group_of("edp", rank))
        assert all(h["backend"] == "gloo" for h in host.values())
        assert out["store_peer"] == str(((rank + 1) % topo.world_size) * 10)
        assert out["after_destroy"].startswith("model parallel is not initialized")
        assert out["tp_sum_after_reinit"] == topo.tp


@pytest.mark.parametrize(
    "tp, pp, cp, ep",
    [
        (2, 2, 1, 1),  # TP=2 PP=2 DP=2
        (2, 1, 1, 2),  # TP=2 DP=4 viewed as EDP=2 x EP=2
        (2, 1, 2, 1),  # TP=2 CP=2 DP=2
    ],
    ids=["tp2-pp2-dp2", "tp2-ep2-dp4", "tp2-cp2-dp2"],
)
def test_eight_ranks(tp, pp, cp, ep):
    results = run_ranks(_describe_rank, 8, tp, pp, cp, ep, timeout=120)
    _check_against_topology(results, Topology(8, tp=tp, pp=pp, cp=cp, ep=ep))
    assert all(r["host_is_device_group"] for r in results)  # gloo default: the same groups serve the host


def test_separate_gloo_host_groups_when_the_default_backend_is_not_gloo():
    results = run_ranks(_describe_rank, 4, 1, 1, 1, 2, "xla", timeout=120)
    _check_against_topology(results, Topology(4, ep=2))
    assert not any(r["host_is_device_group"] for r in results)


def _bad_sizes(rank, world):
    errors = {}
    for kwargs in (dict(tensor_model_parallel_size=3), dict(pipeline_model_parallel_size=4, tensor_model_parallel_size=2),
                   dict(expert_model_parallel_size=3)):
        try:
            ps.initialize_model_parallel(**kwargs)
            errors[str(kwargs)] = None
        except ValueError as exc:
            errors[str(kwargs)] = str(exc)
    errors["initialized"] = ps.model_parallel_is_initialized()
    ps.initialize_model_parallel(tensor_model_parallel_size=2)
    try:
        ps.initialize_model_parallel(tensor_model_parallel_size=2)
        errors["twice"] = None
    except RuntimeError as exc:
        errors["twice"] = str(exc)
    return errors


def test_sizes_that_do_not_divide_the_world():
    for errors in run_ranks(_bad_sizes, 4, timeout=60):
        assert "does not divide world size 4" in errors["{'tensor_model_parallel_size': 3}"]
        assert "TP=2 x PP=4" in errors["{'pipeline_model_parallel_size': 4, 'tensor_model_parallel_size': 2}"]
        assert "EP=3 does not divide data parallel size DP=4" in errors["{'expert_model_parallel_size': 3}"]
        assert errors["initialized"] is False
        assert "already initialized" in errors["twice"]


# ----------------------------------------------------------------------------------------------------------
# in-process: errors before initialization
# ----------------------------------------------------------------------------------------------------------
@pytest.fixture
def no_nxd(monkeypatch):
    for name in list(sys.modules):
        if name.startswith("neuronx_distributed"):
            monkeypatch.delitem(sys.modules, name)
    ps.destroy_model_parallel()
    yield
    ps.destroy_model_parallel()


@pytest.fixture
def single_rank_world(tmp_path):
    import torch.distributed as dist

    assert not dist.is_initialized(), "another test left torch.distributed initialized in the pytest process"
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    yield dist
    ps.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def test_initialize_before_torch_distributed(no_nxd):
    import torch.distributed as dist

    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="torch.distributed.init_process_group first") as info:
        ps.initialize_model_parallel(tensor_model_parallel_size=1)
    assert "torchrun" in str(info.value) and "gloo" in str(info.value) and "xla" in str(info.value)
    with pytest.raises(RuntimeError, match="init_process_group"):
        ps.get_store()


@pytest.mark.parametrize("with_dist", [False, True], ids=["no-dist", "dist"])
def test_queries_before_initialize(no_nxd, request, with_dist):
    if with_dist:
        request.getfixturevalue("single_rank_world")
    assert not ps.model_parallel_is_initialized()
    names = QUERIES + ["get_topology", "get_host_group", "get_data_parallel_host_group",
                       "get_expert_data_parallel_host_group"]
    for name in names:
        with pytest.raises(RuntimeError) as info:
            getattr(ps, name)()
        assert str(info.value) == (
            "model parallel is not initialized: call parallel_state.initialize_model_parallel(...) first"), name


def test_single_rank_world_and_stale_state(no_nxd, single_rank_world):
    dist = single_rank_world
    ps.initialize_model_parallel()
    assert ps.get_topology() == Topology(1)
    assert ps.get_data_parallel_size() == 1 and ps.get_tensor_model_parallel_rank() == 0
    assert ps.get_host_group() is dist.group.WORLD
    # torch.distributed torn down underneath us: the state is stale, not silently reused
    dist.destroy_process_group()
    assert not ps.model_parallel_is_initialized()
    with pytest.raises(RuntimeError, match="not initialized"):
        ps.get_tensor_model_parallel_size()
    ps.destroy_model_parallel()  # harmless on stale state


# ----------------------------------------------------------------------------------------------------------
# delegation to neuronx-distributed (a fake package)
# ----------------------------------------------------------------------------------------------------------
class FakeGroup:
    def __init__(self, name):
        self.name = name


def _fake_nxd(monkeypatch, *, initialized=True, sizes=None, ranks=None, topo=None, old=False, world=8, logic=None):
    """neuronx_distributed.parallel_layers.parallel_state as a fake package in sys.modules. Groups are those
    of ``topo`` (default: the row-major grid of ``sizes``)."""
    sizes = sizes or {"tensor_model": 2, "pipeline_model": 2, "data": 2, "expert_model": 2, "expert_data": 1}
    ranks = ranks or {"tensor_model": 1, "pipeline_model": 1, "data": 1, "expert_model": 1, "expert_data": 0}
    pkg = types.ModuleType("neuronx_distributed")
    pkg.__path__ = []
    layers = types.ModuleType("neuronx_distributed.parallel_layers")
    layers.__path__ = []
    mod = types.ModuleType("neuronx_distributed.parallel_layers.parallel_state")
    mod.calls = []
    mod.model_parallel_is_initialized = lambda: initialized
    kinds = ["tensor_model", "pipeline_model", "data"] + ([] if old else ["expert_model", "expert_data"])
    topo = topo or Topology(world, tp=sizes["tensor_model"], pp=sizes["pipeline_model"],
                            ep=sizes.get("expert_model", 1))
    if logic is not None:
        mod._REPLICA_LOGIC = types.SimpleNamespace(name=logic)
    groups = {"tensor_model": topo.tp_groups(), "pipeline_model": topo.pp_groups(),
              "data": topo.dp_groups(), "expert_model": topo.ep_groups(), "expert_data": topo.edp_groups()}
    for kind in kinds:
        def make(kind=kind):
            def size():
                mod.calls.append(f"{kind}_size")
                return sizes[kind]

            def rank():
                mod.calls.append(f"{kind}_rank")
                return ranks[kind]

            def group(as_list=False):
                mod.calls.append(f"{kind}_group")
                return groups[kind] if as_list else FakeGroup(kind)

            def replica_groups():
                return groups[kind]

            return size, rank, group, replica_groups

        size, rank, group, replica_groups = make()
        setattr(mod, f"get_{kind}_parallel_size", size)
        setattr(mod, f"get_{kind}_parallel_rank", rank)
        setattr(mod, f"get_{kind}_parallel_group", group)
        if not old:
            setattr(mod, f"get_{kind}_parallel_replica_groups", replica_groups)
    pkg.parallel_layers = layers
    layers.parallel_state = mod
    for name, m in (("neuronx_distributed", pkg), ("neuronx_distributed.parallel_layers", layers),
                    ("neuronx_distributed.parallel_layers.parallel_state", mod)):
        if monkeypatch is None:  # inside a rank process, which is thrown away afterwards
            sys.modules[name] = m
        else:
            monkeypatch.setitem(sys.modules, name, m)
    return mod


def test_delegation(no_nxd, single_rank_world, monkeypatch):
    dist = single_rank_world
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 8)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 7)   # tp 1, pp 1, dp 1; ep 1, edp 0
    fake = _fake_nxd(monkeypatch)
    assert ps.model_parallel_is_initialized()
    assert ps.get_tensor_model_parallel_rank() == 1 and ps.get_tensor_model_parallel_size() == 2
    assert ps.get_pipeline_model_parallel_rank() == 1 and ps.get_pipeline_model_parallel_size() == 2
    assert ps.get_data_parallel_rank() == 1 and ps.get_data_parallel_size() == 2
    assert ps.get_expert_model_parallel_rank() == 1 and ps.get_expert_model_parallel_size() == 2
    assert ps.get_expert_data_parallel_size() == 1
    assert ps.get_data_parallel_group().name == "data"
    assert ps.get_expert_data_parallel_group().name == "expert_data"
    assert ps.get_pipeline_model_parallel_replica_groups() == Topology(8, tp=2, pp=2).pp_groups()
    assert ps.get_tensor_model_parallel_group(as_list=True) == Topology(8, tp=2, pp=2).tp_groups()
    # NxD has no context parallelism: size 1, rank 0, singleton groups
    assert ps.get_context_parallel_size() == 1 and ps.get_context_parallel_rank() == 0
    assert ps.get_context_parallel_replica_groups() == [[r] for r in range(8)]
    with pytest.raises(RuntimeError, match="no get_context_parallel_group"):
        ps.get_context_parallel_group()
    assert ps.get_topology() == Topology(8, tp=2, pp=2, ep=2)
    # host side: the default group is gloo, so NxD's own groups serve
    assert ps.get_host_group() is dist.group.WORLD
    assert ps.get_data_parallel_host_group().name == "data"
    assert ps.get_expert_data_parallel_host_group().name == "expert_data"
    assert "tensor_model_rank" in fake.calls


def test_delegate_wins_over_our_own_state(no_nxd, single_rank_world, monkeypatch):
    ps.initialize_model_parallel()  # ours: a world of one
    assert ps.get_tensor_model_parallel_size() == 1
    monkeypatch.setattr(single_rank_world, "get_world_size", lambda group=None: 8)
    monkeypatch.setattr(single_rank_world, "get_rank", lambda group=None: 7)
    _fake_nxd(monkeypatch)
    assert ps.get_tensor_model_parallel_size() == 2
    assert ps.get_topology() == Topology(8, tp=2, pp=2, ep=2)


def test_uninitialized_delegate_is_ignored(no_nxd, single_rank_world, monkeypatch):
    fake = _fake_nxd(monkeypatch, initialized=False)
    assert not ps.model_parallel_is_initialized()
    with pytest.raises(RuntimeError, match="model parallel is not initialized"):
        ps.get_tensor_model_parallel_rank()
    ps.initialize_model_parallel()
    assert ps.get_tensor_model_parallel_size() == 1 and ps.get_topology() == Topology(1)
    assert fake.calls == []


def test_old_nxd_without_expert_parallelism(no_nxd, single_rank_world, monkeypatch):
    monkeypatch.setattr(single_rank_world, "get_world_size", lambda group=None: 8)
    monkeypatch.setattr(single_rank_world, "get_rank", lambda group=None: 6)   # tp 0, pp 1, dp 1
    _fake_nxd(monkeypatch, old=True, sizes={"tensor_model": 2, "pipeline_model": 2, "data": 2},
              ranks={"tensor_model": 0, "pipeline_model": 1, "data": 1})
    assert ps.get_expert_model_parallel_size() == 1 and ps.get_expert_model_parallel_rank() == 0
    assert ps.get_expert_data_parallel_size() == 2 and ps.get_expert_data_parallel_rank() == 1
    assert ps.get_data_parallel_replica_groups() == Topology(8, tp=2, pp=2).dp_groups()  # via group(as_list=True)
    assert ps.get_topology() == Topology(8, tp=2, pp=2)
    assert ps.get_expert_data_parallel_host_group().name == "data"


@pytest.mark.parametrize("layout, logic", [("trn1_tp4", "LOGIC1"), ("trn2", "LOGIC2")])
def test_nxd_layouts_outside_the_row_major_grid_are_adopted(no_nxd, single_rank_world, monkeypatch, layout, logic):
    # NxD on trn1 with TP=4 groups ranks 8 apart ([0, 8, 16, 24], ...); trn2's logic 2 pairs rows 0 and 3
    world, tp = (64, 4) if layout == "trn1_tp4" else (128, 32)
    theirs = Topology(world, tp=tp, layout=layout, local_world_size=world // 2)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(world // 2))
    monkeypatch.setattr(single_rank_world, "get_world_size", lambda group=None: world)
    rank = 33 if layout == "trn1_tp4" else 112
    monkeypatch.setattr(single_rank_world, "get_rank", lambda group=None: rank)
    c = theirs.coords(rank)
    ranks = {"tensor_model": c.tp, "pipeline_model": c.pp, "data": c.dp, "expert_model": 0,
             "expert_data": theirs.rank_in("edp", rank)}
    sizes = {"tensor_model": tp, "pipeline_model": 1, "data": theirs.dp, "expert_model": 1, "expert_data": theirs.edp}
    _fake_nxd(monkeypatch, sizes=sizes, ranks=ranks, topo=theirs, world=world, logic=logic)
    got = ps.get_topology()
    assert got == theirs and got.layout == layout
    assert got.coords(rank) == c
    if layout == "trn2":
        assert c.dp == 2 and got.group_of("dp", rank) == [48, 32, 112, 96]
    # an NxD whose answer disagrees with its own lists is not guessed at
    _fake_nxd(monkeypatch, sizes=sizes, ranks=dict(ranks, data=c.dp + 1), topo=theirs, world=world, logic=logic)
    with pytest.raises(RuntimeError, match="data parallel rank"):
        ps.get_topology()


def _delegate_host_rank(rank, world):
    import torch
    import torch.distributed as dist

    topo = Topology(world, tp=2, ep=2)
    c, e = topo.coords(rank), topo.expert_coords(rank)
    _fake_nxd(None, world=world, sizes={"tensor_model": 2, "pipeline_model": 1, "data": topo.dp, "expert_model": 2,
                                       "expert_data": topo.edp},
              ranks={"tensor_model": c.tp, "pipeline_model": 0, "data": c.dp, "expert_model": e.ep,
                     "expert_data": e.edp})
    real_get_backend = dist.get_backend
    dist.get_backend = lambda group=None: "xla" if group is None else real_get_backend(group)  # as on Trainium
    assert ps.get_topology() == topo
    out = {}
    for label, get in (("world", ps.get_host_group), ("dp", ps.get_data_parallel_host_group),
                       ("edp", ps.get_expert_data_parallel_host_group)):
        group = get()
        assert get() is group  # made once
        t = torch.tensor([rank])
        dist.all_reduce(t, group=group)
        out[label] = (dist.get_backend(group), dist.get_process_group_ranks(group), int(t.item()))
    return out


def test_host_groups_beside_an_initialized_nxd_on_a_non_gloo_backend():
    topo = Topology(8, tp=2, ep=2)
    for rank, out in enumerate(run_ranks(_delegate_host_rank, 8, timeout=120)):
        assert out["world"] == ("gloo", list(range(8)), 28)
        dp, edp = topo.group_of("dp", rank), topo.group_of("edp", rank)
        assert out["dp"] == ("gloo", dp, sum(dp))
        assert out["edp"] == ("gloo", edp, sum(edp))


def test_layout_is_chosen_as_nxd_chooses_it(no_nxd, single_rank_world, monkeypatch):
    from parallel_state import state

    seen = []

    def choice(platform, tp, lnc_size, world_size):
        seen.append((platform, tp, lnc_size, world_size))
        return "row_major"

    monkeypatch.setattr(state, "_platform_target", lambda: "trn2")
    monkeypatch.setattr(state, "nxd_layout_choice", choice)
    ps.initialize_model_parallel(lnc_size=2)
    assert seen == [("trn2", 1, 2, 1)] and ps.get_topology().layout == "row_major"
    ps.destroy_model_parallel()
    with pytest.raises(ValueError, match="unknown rank layout 'zigzag'"):
        ps.initialize_model_parallel(rank_layout="zigzag")
    assert not ps.model_parallel_is_initialized()   # refused before any group was made
