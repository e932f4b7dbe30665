"""Pure rank arithmetic for NxD's model-parallel layouts (no torch, no process groups).

A :class:`Topology` is the set of group lists NxD 2.29's ``parallel_state`` builds (tensor-, data-, pipeline-,
context-, expert- and expert-data-parallel), and every rank's coordinates in them. A rank's coordinate of a
kind is its position in its group, counted as NxD's ``get_*_rank()`` counts it: the position in the sorted
group (``torch.distributed.get_rank(group)``; torch sorts a group's ranks), except the data- and
pipeline-parallel ranks of the ``trn2`` layout, which NxD reads off the unsorted list.

Layouts (NxD's ``initialize_model_parallel`` picks one; ``layout=`` names it here):

``row_major`` (NxD's "logic 1", the default everywhere)
    Ranks fill ``[PP, DP, CP, TP]`` row-major (TP fastest): ``rank = ((pp*DP + dp)*CP + cp)*TP + tp``.
    The expert view of the same ranks is ``[PP, EDP, EP, TP]``: ``rank = ((pp*EDP + edp)*EP + ep)*TP + tp``,
    so TP and PP agree in both views, and ``EDP = DP * CP // EP`` (NxD's rule): the expert view folds CP
    into EDP and EP, so with ``CP > 1`` and ``EP > 1`` the ranks of a CP group belong to different EP (or
    expert-DP) ranks.
``trn1_tp4`` (NxD on Trn1 with TP=4)
    With ``L = local_world_size // TP``, ranks fill ``[PP, DP//L, CP, TP, L]``, the last two axes are
    swapped and the result is viewed as ``[PP, DP, CP, TP]``: a TP group holds node-local ranks ``L`` apart
    (2 nodes of 32, TP=4: TP groups [0, 8, 16, 24], [1, 9, 17, 25], ...; DP groups [0..7, 32..39], ...).
    NxD refuses it with expert or context parallelism (so do we). Given explicitly, any TP that divides
    ``local_world_size`` works (NxD uses it at TP=4 only).
``trn2`` (NxD's "logic 2": Trn2 with TP=64 and LNC=1, or TP=32 and LNC=2, on 64 or more ranks)
    Each node's ranks form 4 rows of ``local_world_size // 4``; a TP group is rows 0 and 3 (ascending), the
    other rows 1 and 2; with ``TP == local_world_size`` one group holds rows 0, 3, 1, 2 in that order. TP
    groups are listed node by node, and CP, DP and PP groups are built from that list as NxD builds them
    (consecutive TP groups, zipped position by position). Expert groups stay on the row-major grid, as in
    NxD (whose logic 2 does not support EP yet). NxD answers CP ranks from the sorted CP group, so with
    ``CP > 1`` CP ranks do not line up with the TP groups here; file names carry no CP rank. Given explicitly,
    any ``TP`` equal to ``local_world_size`` or half of it works.
``custom``
    Group lists taken as given (an initialized neuronx-distributed whose lists match no layout above).
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Callable, Dict, FrozenSet, List, NamedTuple, Optional, Sequence, Tuple

GROUP_KINDS = ("tp", "dp", "pp", "cp", "ep", "edp")

ROW_MAJOR = "row_major"
TRN1_TP4 = "trn1_tp4"
TRN2 = "trn2"
CUSTOM = "custom"
LAYOUTS = (ROW_MAJOR, TRN1_TP4, TRN2)

Groups = Tuple[Tuple[int, ...], ...]


class Coords(NamedTuple):
    pp: int
    dp: int
    cp: int
    tp: int


class ExpertCoords(NamedTuple):
    pp: int
    edp: int
    ep: int
    tp: int


def _divisors(n: int) -> List[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


# NxD's `hardware` enum: the platform targets it treats as Trn1 and as Trn2.
_HARDWARE = {"trn1": "trn1", "trn1n": "trn1", "inf2": "trn1", "trn2": "trn2"}


def nxd_layout_choice(platform: Optional[str], tp: int, lnc_size: int, world_size: int) -> str:
    """The layout NxD 2.29's ``initialize_model_parallel`` uses: ``platform`` is torch-neuronx's platform
    target ("trn1", "trn1n", "inf2", "trn2", ...; None off Neuron hardware), ``lnc_size`` NxD's ``lnc_size``
    argument."""
    platform = _HARDWARE.get(platform)
    if platform == "trn1" and tp == 4:
        return TRN1_TP4
    if platform == "trn2" and (lnc_size, tp) in ((1, 64), (2, 32)) and not (lnc_size == 2 and world_size < 64):
        return TRN2
    return ROW_MAJOR


# ----------------------------------------------------------------------------------------------------------
# group lists of each layout, in NxD's order
# ----------------------------------------------------------------------------------------------------------
def _grid_groups(pp: int, dp: int, cp: int, tp: int, ep: int, edp: int,
                 nonexp: Callable[[int, int, int, int], int],
                 exp: Callable[[int, int, int, int], int]) -> Dict[str, List[List[int]]]:
    """Slices of the ``[PP, DP, CP, TP]`` grid ``nonexp`` and the ``[PP, EDP, EP, TP]`` grid ``exp``, listed
    in the order of NxD's ``itertools.product`` over the other axes."""
    prod = itertools.product
    return {
        "tp": [[nonexp(p, d, c, t) for t in range(tp)] for p, d, c in prod(range(pp), range(dp), range(cp))],
        "dp": [[nonexp(p, d, c, t) for d in range(dp)] for p, c, t in prod(range(pp), range(cp), range(tp))],
        "pp": [[nonexp(p, d, c, t) for p in range(pp)] for d, c, t in prod(range(dp), range(cp), range(tp))],
        "cp": [[nonexp(p, d, c, t) for c in range(cp)] for p, d, t in prod(range(pp), range(dp), range(tp))],
        "ep": [[exp(p, x, e, t) for e in range(ep)] for p, x, t in prod(range(pp), range(edp), range(tp))],
        "edp": [[exp(p, x, e, t) for x in range(edp)] for p, e, t in prod(range(pp), range(ep), range(tp))],
    }


def _row_major_groups(world: int, tp: int, pp: int, cp: int, ep: int, lws: int) -> Dict[str, List[List[int]]]:
    dp = world // (tp * pp * cp)
    edp = world // (tp * pp * ep)
    return _grid_groups(pp, dp, cp, tp, ep, edp,
                        lambda p, d, c, t: ((p * dp + d) * cp + c) * tp + t,
                        lambda p, x, e, t: ((p * edp + x) * ep + e) * tp + t)


def _trn1_tp4_groups(world: int, tp: int, pp: int, cp: int, ep: int, lws: int) -> Dict[str, List[List[int]]]:
    if ep != 1 or cp != 1:
        raise ValueError(f"the trn1_tp4 layout supports neither expert nor context parallelism (EP={ep}, CP={cp}), "
                         "as in neuronx-distributed; use rank_layout='row_major'")
    if lws % tp != 0 or world % lws != 0:
        raise ValueError(f"the trn1_tp4 layout needs TP={tp} to divide LOCAL_WORLD_SIZE={lws} and LOCAL_WORLD_SIZE "
                         f"to divide the world size {world}; check LOCAL_WORLD_SIZE or use rank_layout='row_major'")
    dp = world // (tp * pp)
    per = lws // tp                       # NxD's num_local_ranks: the swapped axis
    if dp % per != 0:
        raise ValueError(f"the trn1_tp4 layout needs DP={dp} to be a multiple of LOCAL_WORLD_SIZE/TP={per} "
                         f"(NxD reshapes the ranks to [PP, DP/{per}, CP, TP, {per}]); use rank_layout='row_major'")
    outer = dp // per

    def nonexp(p, d, c, t):
        # [PP, DP, CP, TP] index -> the same flat position in [PP, DP/L, CP, L, TP] -> the value held there
        # before the last two axes were swapped, i.e. its flat index in [PP, DP/L, CP, TP, L].
        j = ((p * dp + d) * cp + c) * tp + t
        j, t2 = divmod(j, tp)
        j, l2 = divmod(j, per)
        j, c2 = divmod(j, cp)
        p2, a2 = divmod(j, outer)
        return (((p2 * outer + a2) * cp + c2) * tp + t2) * per + l2

    return _grid_groups(pp, dp, cp, tp, 1, dp, nonexp, lambda p, x, e, t: nonexp(p, x, 0, t))


def _zip_tp_groups(tp_groups: List[List[int]], parallel: int, merge: Optional[int]) -> List[List[int]]:
    """NxD's create_parallel_groups_from_tp_groups: chunks of ``parallel`` consecutive TP groups, each
    chunk's groups concatenated ``merge`` at a time, then zipped position by position."""
    out = []
    for i in range(0, len(tp_groups), parallel):
        chunk = tp_groups[i:i + parallel]
        if merge is not None:
            chunk = [[r for g in chunk[k:k + merge] for r in g] for k in range(0, len(chunk), merge)]
        out.extend(list(z) for z in zip(*chunk))
    return out


def _trn2_groups(world: int, tp: int, pp: int, cp: int, ep: int, lws: int) -> Dict[str, List[List[int]]]:
    if lws % 4 != 0 or world % lws != 0 or tp not in (lws, lws // 2):
        raise ValueError(
            f"the trn2 layout splits each node's LOCAL_WORLD_SIZE={lws} ranks into 4 rows and needs TP equal to "
            f"LOCAL_WORLD_SIZE or half of it (got TP={tp}, world {world}); NxD uses it for TP=64 with LNC=1 and "
            "TP=32 with LNC=2. Use rank_layout='row_major' otherwise")
    dp = world // (tp * pp * cp)
    row = lws // 4
    tp_groups: List[List[int]] = []
    for base in range(0, world, lws):
        rows = [list(range(base + k * row, base + (k + 1) * row)) for k in range(4)]
        if tp == lws:
            tp_groups.append(rows[0] + rows[3] + rows[1] + rows[2])
        else:
            tp_groups.extend([rows[0] + rows[3], rows[1] + rows[2]])
    singletons = [[r] for r in range(world)]
    grid = _row_major_groups(world, tp, pp, cp, ep, lws)
    return {
        "tp": tp_groups,
        "cp": _zip_tp_groups(tp_groups, cp, None),
        "dp": _zip_tp_groups(tp_groups, dp * cp, cp) if dp > 1 else singletons,
        "pp": _zip_tp_groups(tp_groups, pp * dp * cp, dp * cp) if pp > 1 else singletons,
        "ep": grid["ep"] if ep > 1 else singletons,
        "edp": grid["edp"] if world // (tp * pp * ep) > 1 else singletons,
    }


_BUILDERS = {ROW_MAJOR: _row_major_groups, TRN1_TP4: _trn1_tp4_groups, TRN2: _trn2_groups}
# Kinds whose rank NxD reads off the group's list position rather than the sorted group (its LOGIC2).
_POSITION_RANKED = {ROW_MAJOR: frozenset(), TRN1_TP4: frozenset(), TRN2: frozenset({"dp", "pp"})}


def _freeze(groups: Dict[str, Sequence[Sequence[int]]]) -> Tuple[Tuple[str, Groups], ...]:
    return tuple((k, tuple(tuple(int(r) for r in g) for g in groups[k])) for k in GROUP_KINDS)


def _canonical(groups: Dict[str, Groups], ranked: FrozenSet[str]):
    """What decides every rank's coordinates: each kind's set of groups, ordered within a group only where
    the rank is the list position."""
    return {k: sorted(tuple(g) if k in ranked else tuple(sorted(g)) for g in groups[k]) for k in GROUP_KINDS}


# ----------------------------------------------------------------------------------------------------------
# the topology
# ----------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Topology:
    """The model-parallel layout of ``world_size`` ranks.

    ``tp``, ``pp``, ``cp`` and ``ep`` are the tensor-, pipeline-, context- and expert-parallel sizes; the
    data-parallel size ``dp`` is what is left, and ``edp = dp * cp // ep`` is the expert-data-parallel size
    (as in NxD, where EP must divide ``dp * cp``). ``layout`` names how ranks are placed (module
    docstring); ``local_world_size`` (ranks per node, default ``world_size``) matters to ``trn1_tp4`` and
    ``trn2`` only. ``custom_groups`` and ``position_ranked`` describe a ``custom`` layout (use
    :meth:`from_groups`).
    """

    world_size: int
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    layout: str = ROW_MAJOR
    local_world_size: Optional[int] = None
    custom_groups: Optional[Tuple[Tuple[str, Groups], ...]] = field(default=None, repr=False)
    position_ranked: FrozenSet[str] = frozenset()

    def __post_init__(self) -> None:
        self._check_sizes()
        if self.layout == CUSTOM:
            if self.custom_groups is None:
                raise ValueError("a custom layout needs its group lists: use Topology.from_groups(...)")
            groups = dict(self.custom_groups)
            ranked = frozenset(self.position_ranked)
        else:
            if self.layout not in _BUILDERS:
                raise ValueError(f"unknown rank layout {self.layout!r}; expected one of {', '.join(LAYOUTS)}")
            if self.custom_groups is not None:
                raise ValueError(f"custom_groups is only for layout={CUSTOM!r}, not {self.layout!r}")
            if self.layout == ROW_MAJOR:   # ranks per node do not matter to it: keep equal topologies equal
                object.__setattr__(self, "local_world_size", None)
            lws = self.local_world_size or self.world_size
            groups = dict(_freeze(_BUILDERS[self.layout](self.world_size, self.tp, self.pp, self.cp, self.ep, lws)))
            ranked = _POSITION_RANKED[self.layout]
        object.__setattr__(self, "_lists", groups)
        object.__setattr__(self, "_coord", self._coordinates(groups, ranked))
        object.__setattr__(self, "_member", {k: {r: i for i, g in enumerate(groups[k]) for r in g} for k in GROUP_KINDS})

    def _check_sizes(self) -> None:
        for name in ("world_size", "tp", "pp", "cp", "ep"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if self.local_world_size is not None and (not isinstance(self.local_world_size, int)
                                                  or self.local_world_size < 1):
            raise ValueError(f"local_world_size must be a positive int or None, got {self.local_world_size!r}")
        model = self.tp * self.pp * self.cp
        if self.world_size % model != 0:
            raise ValueError(
                f"tensor x pipeline x context parallel size (TP={self.tp} x PP={self.pp} x CP={self.cp} = {model}) "
                f"does not divide world size {self.world_size}; their product must be one of "
                f"{_divisors(self.world_size)}"
            )
        dp = self.world_size // model
        if self.ep > 1 and (dp * self.cp) % self.ep != 0:
            # NxD's check: EP must divide world / (TP x PP), i.e. DP x CP (the expert view folds CP into EDP)
            what = f"data parallel size DP={dp}" if self.cp == 1 else \
                f"data x context parallel size DP x CP = {dp} x {self.cp} = {dp * self.cp}"
            raise ValueError(
                f"expert parallel size EP={self.ep} does not divide {what} (world {self.world_size} / (TP={self.tp} x "
                f"PP={self.pp})); valid EP sizes are {_divisors(dp * self.cp)}"
            )

    def _coordinates(self, groups: Dict[str, Groups], ranked: FrozenSet[str]) -> Dict[str, List[int]]:
        sizes = self._sizes()
        out: Dict[str, List[int]] = {}
        for kind in GROUP_KINDS:
            coord = [-1] * self.world_size
            for g in groups[kind]:
                if len(g) != sizes[kind]:
                    raise ValueError(f"{kind} group {list(g)} has {len(g)} ranks, expected {sizes[kind]}")
                order = g if kind in ranked else sorted(g)
                for i, r in enumerate(order):
                    if not 0 <= r < self.world_size or coord[r] != -1:
                        raise ValueError(f"{kind} groups are not a partition of ranks 0..{self.world_size - 1} "
                                         f"(rank {r} is out of range or in two groups)")
                    coord[r] = i
            if -1 in coord:
                raise ValueError(f"{kind} groups leave rank {coord.index(-1)} out")
            out[kind] = coord
        return out

    @classmethod
    def from_groups(cls, groups: Dict[str, Sequence[Sequence[int]]], *, position_ranked=frozenset(),
                    local_world_size: Optional[int] = None) -> "Topology":
        """The topology whose group lists are ``groups`` (kind -> lists, e.g. NxD's replica groups). It is
        given the name of a known layout when that layout builds exactly these lists, else ``custom``.
        ``position_ranked``: kinds whose rank is the list position (not the sorted position)."""
        missing = [k for k in GROUP_KINDS if k not in groups]
        if missing:
            raise ValueError(f"group lists missing for {missing}")
        world = sum(len(g) for g in groups["tp"])
        size = {k: len(groups[k][0]) for k in ("tp", "pp", "cp", "ep")}
        frozen = _freeze(groups)
        ranked = frozenset(position_ranked)
        for layout in LAYOUTS:
            try:
                named = cls(world, **size, layout=layout, local_world_size=local_world_size)
            except ValueError:
                continue
            if _POSITION_RANKED[layout] == ranked and _canonical(named._lists, ranked) == _canonical(dict(frozen), ranked):
                return named
        return cls(world, **size, layout=CUSTOM, local_world_size=local_world_size, custom_groups=frozen,
                   position_ranked=ranked)

    # ----- sizes -----
    @property
    def dp(self) -> int:
        return self.world_size // (self.tp * self.pp * self.cp)

    @property
    def edp(self) -> int:
        # The expert view reshapes the same ranks ([PP, EDP, EP, TP] over [PP, DP, CP, TP]), so EDP * EP = DP * CP.
        return self.dp * self.cp // self.ep

    def _sizes(self) -> Dict[str, int]:
        return {"tp": self.tp, "pp": self.pp, "dp": self.dp, "cp": self.cp, "ep": self.ep, "edp": self.edp}

    def as_dict(self) -> Dict[str, object]:
        out: Dict[str, object] = {"world_size": self.world_size, "tp": self.tp, "pp": self.pp, "cp": self.cp,
                                  "ep": self.ep, "dp": self.dp}
        if self.layout != ROW_MAJOR:
            out["layout"] = self.layout
        return out

    # ----- coordinates -----
    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside the world of {self.world_size} ranks (0..{self.world_size - 1})")

    @staticmethod
    def _check_coord(name: str, value: int, size: int) -> None:
        if not 0 <= value < size:
            raise ValueError(f"{name} rank {value} is out of range for {name.upper()}={size} (0..{size - 1})")

    def rank_in(self, kind: str, rank: int) -> int:
        """``rank``'s coordinate of ``kind``: what NxD's ``get_<kind>_rank()`` answers on that rank."""
        self._check_kind(kind)
        self._check_rank(rank)
        return self._coord[kind][rank]

    def coords(self, rank: int) -> Coords:
        self._check_rank(rank)
        c = self._coord
        return Coords(c["pp"][rank], c["dp"][rank], c["cp"][rank], c["tp"][rank])

    def expert_coords(self, rank: int) -> ExpertCoords:
        self._check_rank(rank)
        c = self._coord
        return ExpertCoords(c["pp"][rank], c["edp"][rank], c["ep"][rank], c["tp"][rank])

    def _find(self, kinds: Tuple[str, ...], values: Tuple[int, ...]) -> int:
        found = [r for r in range(self.world_size) if all(self._coord[k][r] == v for k, v in zip(kinds, values))]
        if len(found) != 1:
            raise ValueError(f"{len(found)} ranks have ({', '.join(f'{k}={v}' for k, v in zip(kinds, values))}) "
                             f"in the {self.layout} layout")
        return found[0]

    def rank_of(self, pp: int, dp: int, cp: int = 0, tp: int = 0) -> int:
        self._check_coord("pp", pp, self.pp)
        self._check_coord("dp", dp, self.dp)
        self._check_coord("cp", cp, self.cp)
        self._check_coord("tp", tp, self.tp)
        if self.layout == ROW_MAJOR:
            return ((pp * self.dp + dp) * self.cp + cp) * self.tp + tp
        return self._find(("pp", "dp", "cp", "tp"), (pp, dp, cp, tp))

    def expert_rank_of(self, pp: int, edp: int, ep: int, tp: int = 0) -> int:
        self._check_coord("pp", pp, self.pp)
        self._check_coord("edp", edp, self.edp)
        self._check_coord("ep", ep, self.ep)
        self._check_coord("tp", tp, self.tp)
        if self.layout == ROW_MAJOR:
            return ((pp * self.edp + edp) * self.ep + ep) * self.tp + tp
        return self._find(("pp", "edp", "ep", "tp"), (pp, edp, ep, tp))

    # ----- groups -----
    @staticmethod
    def _check_kind(kind: str) -> None:
        if kind not in GROUP_KINDS:
            raise ValueError(f"unknown group kind {kind!r}; expected one of {', '.join(GROUP_KINDS)}")

    def groups(self, kind: str) -> List[List[int]]:
        """All groups of ``kind`` ("tp", "dp", "pp", "cp", "ep" or "edp"), as NxD lists them."""
        self._check_kind(kind)
        return [list(g) for g in self._lists[kind]]

    def tp_groups(self) -> List[List[int]]:
        return self.groups("tp")

    def dp_groups(self) -> List[List[int]]:
        return self.groups("dp")

    def pp_groups(self) -> List[List[int]]:
        return self.groups("pp")

    def cp_groups(self) -> List[List[int]]:
        return self.groups("cp")

    def ep_groups(self) -> List[List[int]]:
        return self.groups("ep")

    def edp_groups(self) -> List[List[int]]:
        return self.groups("edp")

    def group_of(self, kind: str, rank: int) -> List[int]:
        """The ``kind`` group that contains ``rank``, as NxD lists it."""
        self._check_kind(kind)
        self._check_rank(rank)
        return list(self._lists[kind][self._member[kind][rank]])
