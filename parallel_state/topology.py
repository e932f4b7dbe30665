"""Pure rank arithmetic for NxD's model-parallel grid (no torch, no process groups).

Global ranks fill an array of shape ``[PP, DP, CP, TP]`` in row-major order (TP fastest, PP slowest)::

    rank = ((pp * DP + dp) * CP + cp) * TP + tp

With expert parallelism the same ranks are also viewed as ``[PP, EDP, EP, TP]``::

    rank = ((pp * EDP + edp) * EP + ep) * TP + tp

so TP and PP coordinates agree in both views. ``EDP = DP // EP``; expert parallelism excludes context
parallelism, and with ``CP > 1`` (so ``EP = 1``) the expert view folds CP into EDP (``EDP = DP * CP``). Groups are slices of these arrays: TP ``[pp,dp,cp,:]``,
DP ``[pp,:,cp,tp]``, PP ``[:,dp,cp,tp]``, CP ``[pp,dp,:,tp]``, EP ``[pp,edp,:,tp]`` and expert-DP
``[pp,:,ep,tp]``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, NamedTuple

GROUP_KINDS = ("tp", "dp", "pp", "cp", "ep", "edp")


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


@dataclass(frozen=True)
class Topology:
    """The model-parallel layout of ``world_size`` ranks.

    ``tp``, ``pp``, ``cp`` and ``ep`` are the tensor-, pipeline-, context- and expert-parallel sizes; the
    data-parallel size ``dp`` is what is left, and ``edp = dp // ep`` is the expert-data-parallel size
    (``dp * cp`` when ``cp > 1``, which requires ``ep == 1``).
    """

    world_size: int
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1

    def __post_init__(self) -> None:
        for name in ("world_size", "tp", "pp", "cp", "ep"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        model = self.tp * self.pp * self.cp
        if self.world_size % model != 0:
            raise ValueError(
                f"tensor x pipeline x context parallel size (TP={self.tp} x PP={self.pp} x CP={self.cp} = {model}) "
                f"does not divide world size {self.world_size}; their product must be one of "
                f"{_divisors(self.world_size)}"
            )
        dp = self.world_size // model
        if self.ep > 1:
            if self.cp != 1:
                raise ValueError(
                    f"expert parallelism (EP={self.ep}) cannot be combined with context parallelism "
                    f"(CP={self.cp}); use context_parallel_size=1 or expert_model_parallel_size=1"
                )
            if dp % self.ep != 0:
                raise ValueError(
                    f"expert parallel size EP={self.ep} does not divide data parallel size DP={dp} "
                    f"(world {self.world_size} / (TP={self.tp} x PP={self.pp} x CP={self.cp})); "
                    f"valid EP sizes are {_divisors(dp)}"
                )

    # ----- sizes -----
    @property
    def dp(self) -> int:
        return self.world_size // (self.tp * self.pp * self.cp)

    @property
    def edp(self) -> int:
        # The expert view reshapes the same ranks, so EDP * EP = DP * CP. CP > 1 only occurs with EP = 1, where
        # the expert-DP group [pp, :, 0, tp] spans DP x CP (as in Megatron-core); otherwise EDP = DP // EP.
        return self.dp * self.cp // self.ep

    def as_dict(self) -> Dict[str, int]:
        return {"world_size": self.world_size, "tp": self.tp, "pp": self.pp, "cp": self.cp, "ep": self.ep,
                "dp": self.dp}

    # ----- coordinates -----
    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside the world of {self.world_size} ranks (0..{self.world_size - 1})")

    @staticmethod
    def _check_coord(name: str, value: int, size: int) -> None:
        if not 0 <= value < size:
            raise ValueError(f"{name} rank {value} is out of range for {name.upper()}={size} (0..{size - 1})")

    def coords(self, rank: int) -> Coords:
        self._check_rank(rank)
        rank, tp = divmod(rank, self.tp)
        rank, cp = divmod(rank, self.cp)
        pp, dp = divmod(rank, self.dp)
        return Coords(pp, dp, cp, tp)

    def expert_coords(self, rank: int) -> ExpertCoords:
        self._check_rank(rank)
        rank, tp = divmod(rank, self.tp)
        rank, ep = divmod(rank, self.ep)
        pp, edp = divmod(rank, self.edp)
        return ExpertCoords(pp, edp, ep, tp)

    def rank_of(self, pp: int, dp: int, cp: int = 0, tp: int = 0) -> int:
        self._check_coord("pp", pp, self.pp)
        self._check_coord("dp", dp, self.dp)
        self._check_coord("cp", cp, self.cp)
        self._check_coord("tp", tp, self.tp)
        return ((pp * self.dp + dp) * self.cp + cp) * self.tp + tp

    def expert_rank_of(self, pp: int, edp: int, ep: int, tp: int = 0) -> int:
        self._check_coord("pp", pp, self.pp)
        self._check_coord("edp", edp, self.edp)
        self._check_coord("ep", ep, self.ep)
        self._check_coord("tp", tp, self.tp)
        return ((pp * self.edp + edp) * self.ep + ep) * self.tp + tp

    # ----- groups -----
    def _groups(self, kind: str) -> List[List[int]]:
        # Group each rank by its coordinates with the group's own axis removed; the groups come out in the
        # order of their smallest rank, and each group's ranks are sorted.
        if kind not in GROUP_KINDS:
            raise ValueError(f"unknown group kind {kind!r}; expected one of {', '.join(GROUP_KINDS)}")
        keyed: Dict[tuple, List[int]] = {}
        for r in range(self.world_size):
            keyed.setdefault(self._group_key(kind, r), []).append(r)
        return list(keyed.values())

    def _group_key(self, kind: str, rank: int) -> tuple:
        if kind in ("ep", "edp"):
            c = self.expert_coords(rank)
            return (c.pp, c.ep, c.tp) if kind == "edp" else (c.pp, c.edp, c.tp)
        c = self.coords(rank)
        if kind == "tp":
            return (c.pp, c.dp, c.cp)
        if kind == "dp":
            return (c.pp, c.cp, c.tp)
        if kind == "pp":
            return (c.dp, c.cp, c.tp)
        return (c.pp, c.dp, c.tp)  # cp

    def tp_groups(self) -> List[List[int]]:
        return self._groups("tp")

    def dp_groups(self) -> List[List[int]]:
        return self._groups("dp")

    def pp_groups(self) -> List[List[int]]:
        return self._groups("pp")

    def cp_groups(self) -> List[List[int]]:
        return self._groups("cp")

    def ep_groups(self) -> List[List[int]]:
        return self._groups("ep")

    def edp_groups(self) -> List[List[int]]:
        return self._groups("edp")

    def groups(self, kind: str) -> List[List[int]]:
        """All groups of ``kind`` ("tp", "dp", "pp", "cp", "ep" or "edp")."""
        return self._groups(kind)

    def group_of(self, kind: str, rank: int) -> List[int]:
        """The sorted ranks of the ``kind`` group that contains ``rank``."""
        if kind not in GROUP_KINDS:
            raise ValueError(f"unknown group kind {kind!r}; expected one of {', '.join(GROUP_KINDS)}")
        if kind in ("ep", "edp"):
            e = self.expert_coords(rank)
            if kind == "ep":
                return [self.expert_rank_of(e.pp, e.edp, i, e.tp) for i in range(self.ep)]
            return [self.expert_rank_of(e.pp, i, e.ep, e.tp) for i in range(self.edp)]
        c = self.coords(rank)
        if kind == "tp":
            return [self.rank_of(c.pp, c.dp, c.cp, i) for i in range(self.tp)]
        if kind == "dp":
            return [self.rank_of(c.pp, i, c.cp, c.tp) for i in range(self.dp)]
        if kind == "pp":
            return [self.rank_of(i, c.dp, c.cp, c.tp) for i in range(self.pp)]
        return [self.rank_of(c.pp, c.dp, i, c.tp) for i in range(self.cp)]
