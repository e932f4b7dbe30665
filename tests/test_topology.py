"""Pure rank arithmetic of parallel_state.topology, checked exhaustively and against NxD's documented examples."""
from __future__ import annotations

import itertools

import pytest

from parallel_state.topology import Coords, ExpertCoords, Topology

KINDS = ("tp", "dp", "pp", "cp", "ep", "edp")


def all_topologies(max_world=16):
    """Every valid (world, tp, pp, cp, ep) with world <= max_world."""
    for world in range(1, max_world + 1):
        divs = [d for d in range(1, world + 1) if world % d == 0]
        for tp, pp, cp in itertools.product(divs, repeat=3):
            if world % (tp * pp * cp):
                continue
            dp = world // (tp * pp * cp)
            for ep in [d for d in range(1, dp * cp + 1) if dp * cp % d == 0]:   # NxD: EP divides DP x CP
                yield Topology(world, tp=tp, pp=pp, cp=cp, ep=ep)


TOPOLOGIES = list(all_topologies())


def _differing(kind, topo, a, b):
    """Names of the coordinates of ranks a and b that differ, in the view the group kind belongs to."""
    if kind in ("ep", "edp"):
        ca, cb = topo.expert_coords(a), topo.expert_coords(b)
    else:
        ca, cb = topo.coords(a), topo.coords(b)
    return {name for name in ca._fields if getattr(ca, name) != getattr(cb, name)}


def test_enumeration_is_big_enough():
    assert len(TOPOLOGIES) > 200
    assert any(t.ep > 1 and t.pp > 1 and t.tp > 1 for t in TOPOLOGIES)
    assert any(t.cp > 1 and t.dp > 1 and t.pp > 1 for t in TOPOLOGIES)
    assert any(t.cp > 1 and t.ep > 1 and t.dp * t.cp > t.ep for t in TOPOLOGIES)
    assert any(t.cp > 1 and t.ep > t.dp for t in TOPOLOGIES)   # EP larger than DP: it spans CP ranks


def test_coords_and_rank_of_are_inverse_bijections():
    for topo in TOPOLOGIES:
        seen = set()
        for r in range(topo.world_size):
            c = topo.coords(r)
            assert topo.rank_of(*c) == r
            assert topo.rank_of(c.pp, c.dp, cp=c.cp, tp=c.tp) == r
            assert c == ((r // (topo.tp * topo.cp * topo.dp)), (r // (topo.tp * topo.cp)) % topo.dp,
                         (r // topo.tp) % topo.cp, r % topo.tp)
            seen.add(c)
            e = topo.expert_coords(r)
            assert topo.expert_rank_of(*e) == r
            # TP and PP agree in both views
            assert (e.pp, e.tp) == (c.pp, c.tp)
        assert len(seen) == topo.world_size
        # every coordinate tuple in range maps to a distinct rank in range
        ranks = {topo.rank_of(pp, dp, cp, tp) for pp, dp, cp, tp in itertools.product(
            range(topo.pp), range(topo.dp), range(topo.cp), range(topo.tp))}
        assert ranks == set(range(topo.world_size))
        eranks = {topo.expert_rank_of(pp, edp, ep, tp) for pp, edp, ep, tp in itertools.product(
            range(topo.pp), range(topo.edp), range(topo.ep), range(topo.tp))}
        assert eranks == set(range(topo.world_size))


def test_groups_partition_the_world_with_one_varying_coordinate():
    for topo in TOPOLOGIES:
        sizes = {"tp": topo.tp, "dp": topo.dp, "pp": topo.pp, "cp": topo.cp, "ep": topo.ep, "edp": topo.edp}
        for kind in KINDS:
            groups = getattr(topo, f"{kind}_groups")()
            assert groups == topo.groups(kind)
            flat = [r for g in groups for r in g]
            assert sorted(flat) == list(range(topo.world_size)), (topo, kind)
            assert len(groups) == topo.world_size // sizes[kind]
            for g in groups:
                assert g == sorted(g) and len(g) == sizes[kind]
                for a, b in zip(g, g[1:]):
                    assert _differing(kind, topo, a, b) == {kind}, (topo, kind, a, b)
            for r in range(topo.world_size):
                g = topo.group_of(kind, r)
                assert g in groups and r in g
                # the position of a rank inside its group is its own coordinate
                coord = (getattr(topo.expert_coords(r), kind) if kind in ("ep", "edp")
                         else getattr(topo.coords(r), kind))
                assert g.index(r) == coord


def test_sizes_and_dict():
    t = Topology(48, tp=2, pp=3, cp=2)
    assert (t.dp, t.edp) == (4, 8)  # CP folds into expert-DP
    assert t.as_dict() == {"world_size": 48, "tp": 2, "pp": 3, "cp": 2, "ep": 1, "dp": 4}
    t = Topology(16, tp=2, ep=4)
    assert (t.dp, t.edp, t.ep) == (8, 2, 4)
    assert Topology(1).as_dict() == {"world_size": 1, "tp": 1, "pp": 1, "cp": 1, "ep": 1, "dp": 1}


def test_nxd_example_32_ranks_tp8_pp4():
    t = Topology(32, tp=8, pp=4)
    assert t.dp == 1
    assert t.tp_groups() == [list(range(0, 8)), list(range(8, 16)), list(range(16, 24)), list(range(24, 32))]
    assert t.pp_groups() == [[i, i + 8, i + 16, i + 24] for i in range(8)]
    assert t.pp_groups()[0] == [0, 8, 16, 24] and t.pp_groups()[7] == [7, 15, 23, 31]
    assert t.dp_groups() == [[r] for r in range(32)]
    assert t.coords(13) == Coords(pp=1, dp=0, cp=0, tp=5)
    assert t.rank_of(3, 0, 0, 7) == 31


def test_nxd_example_128_ranks_tp8_pp4_ep2():
    t = Topology(128, tp=8, pp=4, ep=2)
    assert (t.dp, t.edp) == (4, 2)
    pp = t.pp_groups()
    assert len(pp) == 32 and all(len(g) == 4 for g in pp)
    assert pp[0] == [0, 32, 64, 96] and pp[1] == [1, 33, 65, 97]
    assert pp[30] == [30, 62, 94, 126] and pp[31] == [31, 63, 95, 127]
    dp = t.dp_groups()
    assert len(dp) == 32
    assert dp[0] == [0, 8, 16, 24] and dp[1] == [1, 9, 17, 25]
    assert dp[30] == [102, 110, 118, 126] and dp[31] == [103, 111, 119, 127]
    edp = t.edp_groups()
    assert len(edp) == 64 and all(len(g) == 2 for g in edp)
    assert edp[:3] == [[0, 16], [1, 17], [2, 18]] and edp[8] == [8, 24] and edp[16] == [32, 48]
    assert [0, 16] in edp and [1, 17] in edp and [110, 126] in edp and [111, 127] in edp
    assert t.group_of("edp", 0) == [0, 16] and t.group_of("edp", 126) == [110, 126]
    ep = t.ep_groups()
    assert len(ep) == 64
    assert [0, 8] in ep and [1, 9] in ep and [118, 126] in ep and [119, 127] in ep
    assert t.group_of("ep", 127) == [119, 127]
    tp = t.tp_groups()
    assert len(tp) == 16 and tp[0] == list(range(8)) and tp[1] == list(range(8, 16))
    assert tp[14] == list(range(112, 120)) and tp[15] == list(range(120, 128))
    # rank 126: (PP=3, DP=3, TP=6) or (PP=3, DP_EXP=1, EP=1, TP=6)
    assert t.coords(126) == Coords(3, 3, 0, 6)
    assert t.expert_coords(126) == ExpertCoords(3, 1, 1, 6)
    assert t.expert_rank_of(3, 1, 1, 6) == 126
    # NxD's own construction of each list (itertools.product over the other axes of the reshaped rank grid)
    grid = [[[[((p * 2 + e) * 2 + x) * 8 + q for q in range(8)] for x in range(2)] for e in range(2)] for p in range(4)]
    nxd_edp = [[grid[p][e][x][q] for e in range(2)] for p in range(4) for x in range(2) for q in range(8)]
    nxd_ep = [[grid[p][e][x][q] for x in range(2)] for p in range(4) for e in range(2) for q in range(8)]
    nxd_dp = [[grid[p][e][x][q] for e in range(2) for x in range(2)] for p in range(4) for q in range(8)]
    nxd_pp = [[grid[p][e][x][q] for p in range(4)] for e in range(2) for x in range(2) for q in range(8)]
    nxd_tp = [grid[p][e][x] for p in range(4) for e in range(2) for x in range(2)]
    # same groups, listed in the same order as NxD's replica groups
    assert (nxd_edp, nxd_ep, nxd_dp, nxd_pp, nxd_tp) == (edp, ep, dp, pp, tp)


def test_example_128_ranks_pp2_dp2_cp4_tp8():
    t = Topology(128, tp=8, pp=2, cp=4)
    assert t.dp == 2
    # rank = ((pp*2 + dp)*4 + cp)*8 + tp
    assert t.rank_of(1, 1, 3, 7) == 127
    assert t.rank_of(0, 1, 0, 0) == 32
    assert t.rank_of(1, 0, 2, 5) == 64 + 16 + 5
    assert t.coords(85) == Coords(pp=1, dp=0, cp=2, tp=5)
    assert t.tp_groups()[:3] == [list(range(0, 8)), list(range(8, 16)), list(range(16, 24))]
    assert len(t.tp_groups()) == 16
    assert t.cp_groups()[0] == [0, 8, 16, 24]
    assert t.group_of("cp", 45) == [37, 45, 53, 61]  # pp0 dp1 tp5: 32+5 + 8*cp
    assert len(t.cp_groups()) == 32
    assert t.dp_groups()[0] == [0, 32] and t.group_of("dp", 85) == [85, 117]
    assert len(t.dp_groups()) == 64
    assert t.pp_groups()[0] == [0, 64] and t.group_of("pp", 63) == [63, 127]
    assert len(t.pp_groups()) == 64
    # no expert parallelism: EP groups are singletons; the expert view [PP, EDP, EP=1, TP] folds CP into EDP
    assert t.edp == 8
    assert t.ep_groups() == [[r] for r in range(128)]
    assert t.edp_groups()[0] == list(range(0, 64, 8)) and len(t.edp_groups()) == 16
    assert t.expert_coords(85) == ExpertCoords(pp=1, edp=2, ep=0, tp=5)


@pytest.mark.parametrize(
    "kwargs, words",
    [
        (dict(world_size=8, tp=3), ["TP=3", "does not divide world size 8", "[1, 2, 4, 8]"]),
        (dict(world_size=12, tp=2, pp=4), ["TP=2 x PP=4", "= 8", "does not divide world size 12"]),
        (dict(world_size=16, tp=2, cp=3), ["CP=3", "does not divide world size 16"]),
        (dict(world_size=16, tp=2, ep=3), ["EP=3 does not divide data parallel size DP=8", "[1, 2, 4, 8]"]),
        (dict(world_size=16, tp=8, ep=4), ["EP=4", "DP=2", "[1, 2]"]),
        (dict(world_size=16, tp=2, cp=2, ep=3), ["EP=3 does not divide data x context parallel size DP x CP = 4 x 2 = 8",
                                                  "[1, 2, 4, 8]"]),
        (dict(world_size=0), [">= 1"]),
        (dict(world_size=8, tp=0), ["tp must be >= 1"]),
        (dict(world_size=8, ep=-1), ["ep must be >= 1"]),
    ],
)
def test_invalid_sizes(kwargs, words):
    with pytest.raises(ValueError) as info:
        Topology(**kwargs)
    for w in words:
        assert w in str(info.value), (w, str(info.value))


def test_out_of_range_ranks_and_coords():
    t = Topology(8, tp=2, pp=2)
    with pytest.raises(ValueError, match="outside the world of 8"):
        t.coords(8)
    with pytest.raises(ValueError, match="outside"):
        t.expert_coords(-1)
    with pytest.raises(ValueError, match="tp rank 2 is out of range for TP=2"):
        t.rank_of(0, 0, 0, 2)
    with pytest.raises(ValueError, match="dp rank 5"):
        t.rank_of(0, 5)
    with pytest.raises(ValueError, match="unknown group kind"):
        t.group_of("zz", 0)
    with pytest.raises(TypeError):
        Topology(8.0)


def test_frozen_and_hashable():
    t = Topology(8, tp=2)
    with pytest.raises(Exception):
        t.tp = 4
    assert t == Topology(8, tp=2) and hash(t) == hash(Topology(8, tp=2, pp=1))


# ---- NxD's other layouts (DESIGN 2.7) ---------------------------------------------------------------
from parallel_state.topology import nxd_layout_choice  # noqa: E402


def test_trn1_tp4_design_example_two_nodes_of_32():
    t = Topology(64, tp=4, layout="trn1_tp4", local_world_size=32)
    assert t.dp == 16
    tp = t.tp_groups()
    assert len(tp) == 16
    assert tp[:3] == [[0, 8, 16, 24], [1, 9, 17, 25], [2, 10, 18, 26]] and tp[7] == [7, 15, 23, 31]
    assert tp[8] == [32, 40, 48, 56] and tp[15] == [39, 47, 55, 63]
    dp = t.dp_groups()
    assert dp == [list(range(0, 8)) + list(range(32, 40)), list(range(8, 16)) + list(range(40, 48)),
                  list(range(16, 24)) + list(range(48, 56)), list(range(24, 32)) + list(range(56, 64))]
    assert sorted(t.pp_groups()) == [[r] for r in range(64)]
    # NxD's get_*_rank(): positions in the (sorted) groups
    assert t.coords(8) == Coords(pp=0, dp=0, cp=0, tp=1)
    assert t.coords(33) == Coords(pp=0, dp=9, cp=0, tp=0)
    assert t.rank_of(0, 9, 0, 3) == 57
    assert Topology.from_groups({k: t.groups(k) for k in KINDS}, local_world_size=32) == t


@pytest.mark.parametrize("world, tp, pp, lws", [(64, 4, 1, 32), (64, 4, 2, 32), (128, 4, 2, 32), (8, 2, 1, 4),
                                               (16, 2, 2, 8), (8, 4, 1, 8)])
def test_trn1_tp4_matches_nxds_tensor_arithmetic(world, tp, pp, lws):
    import torch

    t = Topology(world, tp=tp, pp=pp, layout="trn1_tp4", local_world_size=lws)
    dp, per = t.dp, lws // tp
    grid = torch.arange(world).reshape(pp, dp // per, 1, tp, per).transpose(-1, -2).reshape(pp, dp, 1, tp)
    assert t.tp_groups() == [grid[p, d, 0, :].tolist() for p in range(pp) for d in range(dp)]
    assert t.dp_groups() == [grid[p, :, 0, q].tolist() for p in range(pp) for q in range(tp)]
    assert t.pp_groups() == [grid[:, d, 0, q].tolist() for d in range(dp) for q in range(tp)]
    assert t.edp_groups() == t.dp_groups() and sorted(t.ep_groups()) == [[r] for r in range(world)]
    for r in range(world):
        c = t.coords(r)
        assert grid[c.pp, c.dp, 0, c.tp].item() == r
        # TP groups stay inside a node
        assert len({x // lws for x in t.group_of("tp", r)}) == 1


def test_trn2_tp32_lnc2_64_and_128_ranks():
    t = Topology(64, tp=32, layout="trn2", local_world_size=64)
    a, b = list(range(0, 16)) + list(range(48, 64)), list(range(16, 48))
    assert t.tp_groups() == [a, b]
    assert t.dp_groups() == [[x, y] for x, y in zip(a, b)]
    assert t.dp_groups()[16] == [48, 32]
    # DP (and PP) ranks are list positions in NxD's logic 2; TP ranks positions in the sorted group
    assert t.coords(48) == Coords(pp=0, dp=0, cp=0, tp=16) and t.coords(32) == Coords(pp=0, dp=1, cp=0, tp=16)
    assert t.coords(47) == Coords(pp=0, dp=1, cp=0, tp=31) and t.coords(15) == Coords(pp=0, dp=0, cp=0, tp=15)

    t = Topology(128, tp=32, pp=2, layout="trn2", local_world_size=64)
    tp = t.tp_groups()
    assert tp == [a, b, [r + 64 for r in a], [r + 64 for r in b]]
    assert t.dp_groups()[:2] == [[0, 16], [1, 17]] and t.dp_groups()[16] == [48, 32]
    assert t.dp_groups()[32] == [64, 80] and len(t.dp_groups()) == 64
    merged0, merged1 = a + b, [r + 64 for r in a + b]
    assert t.pp_groups() == [[x, y] for x, y in zip(merged0, merged1)]
    assert t.group_of("pp", 112) == [48, 112] and t.coords(112) == Coords(pp=1, dp=0, cp=0, tp=16)
    assert t.coords(96) == Coords(pp=1, dp=1, cp=0, tp=16)


def test_trn2_tp64_lnc1_128_ranks_and_one_group_per_node():
    t = Topology(128, tp=64, layout="trn2", local_world_size=128)
    a = list(range(0, 32)) + list(range(96, 128))
    assert t.tp_groups() == [a, list(range(32, 96))]
    assert t.group_of("dp", 100) == [100, 68] and t.coords(100).dp == 0 and t.coords(68).dp == 1
    # TP equal to the node: rows 0, 3, 1, 2 in one group (every rank of the node)
    t = Topology(128, tp=64, layout="trn2", local_world_size=64)
    assert t.tp_groups()[0] == list(range(0, 16)) + list(range(48, 64)) + list(range(16, 48))
    assert t.tp_groups()[1] == [r + 64 for r in t.tp_groups()[0]]


def test_trn2_small_two_nodes_of_four():
    t = Topology(8, tp=2, layout="trn2", local_world_size=4)
    assert t.tp_groups() == [[0, 3], [1, 2], [4, 7], [5, 6]]
    assert t.dp_groups() == [[0, 1, 4, 5], [3, 2, 7, 6]]
    assert [t.coords(r) for r in (3, 2)] == [Coords(0, 0, 0, 1), Coords(0, 1, 0, 1)]
    assert Topology.from_groups({k: t.groups(k) for k in KINDS}, position_ranked={"dp", "pp"},
                                local_world_size=4) == t
    # the same lists read as sorted groups are a different (custom) layout
    other = Topology.from_groups({k: t.groups(k) for k in KINDS}, local_world_size=4)
    assert other.layout == "custom" and other.coords(3).dp == 1


def test_custom_groups_and_bad_groups():
    tp = [[0, 5], [1, 4], [2, 7], [3, 6]]
    groups = {"tp": tp, "dp": [[0, 1, 2, 3], [4, 5, 6, 7]], "pp": [[r] for r in range(8)],
              "cp": [[r] for r in range(8)], "ep": [[r] for r in range(8)], "edp": [[0, 1, 2, 3], [4, 5, 6, 7]]}
    t = Topology.from_groups(groups)
    assert t.layout == "custom" and (t.tp, t.dp) == (2, 4)
    assert t.coords(5) == Coords(0, 1, 0, 1) and t.rank_of(0, 1, 0, 1) == 5
    with pytest.raises(ValueError, match="two groups"):
        Topology.from_groups(dict(groups, tp=[[0, 5], [1, 5], [2, 7], [3, 6]]))
    with pytest.raises(ValueError, match="unknown rank layout"):
        Topology(8, layout="zigzag")


@pytest.mark.parametrize("kwargs, words", [
    (dict(world_size=8, tp=4, layout="trn1_tp4", local_world_size=4, ep=2), ["expert"]),
    (dict(world_size=8, tp=2, layout="trn1_tp4", local_world_size=3), ["LOCAL_WORLD_SIZE=3"]),
    (dict(world_size=32, tp=4, pp=2, layout="trn1_tp4", local_world_size=32), ["DP=4", "LOCAL_WORLD_SIZE/TP=8"]),
    (dict(world_size=8, tp=1, layout="trn2", local_world_size=4), ["TP=1", "LOCAL_WORLD_SIZE=4"]),
])
def test_layout_preconditions(kwargs, words):
    with pytest.raises(ValueError) as info:
        Topology(**kwargs)
    for w in words:
        assert w in str(info.value)


def test_nxd_layout_choice():
    assert nxd_layout_choice("trn1", 4, 1, 64) == "trn1_tp4"
    assert nxd_layout_choice("trn1", 8, 1, 64) == "row_major"
    assert nxd_layout_choice("trn2", 64, 1, 128) == "trn2"
    assert nxd_layout_choice("trn2", 32, 2, 64) == "trn2"
    assert nxd_layout_choice("trn2", 32, 2, 32) == "row_major"   # NxD falls back below 64 ranks with LNC=2
    assert nxd_layout_choice("trn2", 32, 1, 128) == "row_major"
    assert nxd_layout_choice("trn2", 4, 2, 64) == "row_major"
    assert nxd_layout_choice(None, 4, 1, 64) == "row_major"
    assert nxd_layout_choice("trn1n", 4, 1, 64) == nxd_layout_choice("inf2", 4, 1, 32) == "trn1_tp4"
    assert nxd_layout_choice("trn3", 4, 1, 64) == "row_major"


@pytest.mark.parametrize("layout, lws", [("trn1_tp4", 8), ("trn1_tp4", 16), ("trn2", 4), ("trn2", 8), ("trn2", 16)])
def test_named_layouts_are_consistent_grids(layout, lws):
    """Every valid size of a layout up to 64 ranks: each group's members differ in that group's coordinate only,
    and (pp, dp, cp, tp) names each rank once, so file names never collide."""
    checked = 0
    for world in range(lws, 65, lws):
        for tp, pp, cp, ep in itertools.product((1, 2, 4, 8, 16), (1, 2, 4), (1, 2), (1, 2)):
            try:
                t = Topology(world, tp=tp, pp=pp, cp=cp, ep=ep, layout=layout, local_world_size=lws)
            except ValueError:
                continue
            if layout == "trn2" and cp > 1:
                # NxD builds trn2's CP groups by list position but answers CP ranks from the sorted group, so CP
                # coordinates do not line up with TP groups there; file names carry no CP rank.
                assert sorted(t.rank_in("cp", r) for r in t.groups("cp")[0]) == list(range(cp))
                continue
            checked += 1
            assert len({t.coords(r) for r in range(world)}) == world
            for kind in ("tp", "dp", "pp", "cp"):
                for g in t.groups(kind):
                    assert sorted(t.rank_in(kind, r) for r in g) == list(range(len(g)))
                    for a, b in zip(g, g[1:]):
                        assert _differing(kind, t, a, b) <= {kind}, (t, kind, a, b)
            for r in range(world):
                c = t.coords(r)
                assert t.rank_of(*c) == r
    assert checked >= 3


# ---- expert parallelism together with context parallelism, as NxD 2.29 builds it ---------------------------
def _nxd_grid_groups(world, tp, pp, cp, ep):
    """NxD's row-major reshapes, written out independently: non-expert [PP, DP, CP, TP], expert [PP, EDP, EP, TP]."""
    dp, edp = world // (tp * pp * cp), world // (tp * pp * ep)
    nonexp = lambda p, d, c, t: ((p * dp + d) * cp + c) * tp + t  # noqa: E731
    exp = lambda p, x, e, t: ((p * edp + x) * ep + e) * tp + t  # noqa: E731
    prod = itertools.product
    return {"cp": [[nonexp(p, d, c, t) for c in range(cp)] for p, d, t in prod(range(pp), range(dp), range(tp))],
            "ep": [[exp(p, x, e, t) for e in range(ep)] for p, x, t in prod(range(pp), range(edp), range(tp))],
            "edp": [[exp(p, x, e, t) for x in range(edp)] for p, e, t in prod(range(pp), range(ep), range(tp))]}


def test_expert_and_context_parallel_groups_as_nxd():
    """EP with CP > 1 (NxD allows it when EP divides DP x CP): the expert view folds CP into EP and expert-DP."""
    t = Topology(8, tp=2, cp=2, ep=2)                       # DP=2, EDP = 8 / (2 x 2) = 2
    assert (t.dp, t.edp) == (2, 2)
    assert t.cp_groups() == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert t.ep_groups() == [[0, 2], [1, 3], [4, 6], [5, 7]]   # here the EP groups are the CP groups
    assert t.edp_groups() == [[0, 4], [1, 5], [2, 6], [3, 7]]  # and expert-DP is DP
    t = Topology(8, cp=4, ep=4)                              # EP larger than DP=2: EP spans CP ranks
    assert (t.dp, t.edp) == (2, 2)
    assert t.ep_groups() == [[0, 1, 2, 3], [4, 5, 6, 7]] == t.cp_groups()
    assert t.edp_groups() == [[0, 4], [1, 5], [2, 6], [3, 7]] == t.dp_groups()
    t = Topology(16, pp=2, cp=2, ep=4)                       # DP=4, EDP=2: EP spans two DP ranks' CP ranks
    assert t.ep_groups()[:2] == [[0, 1, 2, 3], [4, 5, 6, 7]] and t.cp_groups()[:2] == [[0, 1], [2, 3]]
    assert t.expert_coords(6) == ExpertCoords(pp=0, edp=1, ep=2, tp=0) and t.coords(6) == Coords(pp=0, dp=3, cp=0, tp=0)
    checked = 0
    for t in TOPOLOGIES:
        if t.cp > 1 and t.ep > 1:
            want = _nxd_grid_groups(t.world_size, t.tp, t.pp, t.cp, t.ep)
            assert {k: t.groups(k) for k in want} == want, t
            checked += 1
    assert checked > 20
