"""A small Adam whose state is sharded over data parallel ranks in torch-xla's ZeRO-1 format.

torch-xla's ZeroRedundancyOptimizer needs XLA collectives across processes, which PJRT CPU does not
provide; this one reduces gradients and gathers updated shards over a host gloo group instead, and its
``state_dict()`` has exactly the ZeRO-1 layout (DESIGN 2.4): ``base_state`` shards, ``shape_info``,
``sharded_master_weights``. Deterministic, so resumed runs can be compared bit for bit.
"""
from __future__ import annotations

from typing import List, Optional

import torch
import torch.distributed as dist

from ..partition import zero1_shard, zero1_unshard


def shard_of(full: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """Piece ``rank`` of ``full`` padded with zeros along dim 0 to a multiple of ``size``."""
    return zero1_shard(full, rank, size)


def unshard(shards: List[torch.Tensor], shape) -> torch.Tensor:
    """Inverse of shard_of: concatenate along dim 0, trim to ``shape[0]`` rows."""
    return zero1_unshard(shards, shape)


class ZeroOneAdam:
    """Adam with ZeRO-1 sharded state. ``params`` may live on an XLA device; state shards live there too."""

    def __init__(self, params, lr=1e-2, betas=(0.9, 0.999), eps=1e-8, dp_group=None,
                 dp_rank: int = 0, dp_size: int = 1, save_master_weights: bool = True):
        self.params: List[torch.nn.Parameter] = list(params)
        # As in torch optimizers, the live groups hold the parameters; state_dict() numbers them.
        self.param_groups = [{"lr": lr, "betas": betas, "eps": eps, "params": list(self.params)}]
        self.dp_group, self.dp_rank, self.dp_size = dp_group, dp_rank, dp_size
        self.save_master_weights = save_master_weights
        self.base_state = {}
        self.master = {}
        for i, p in enumerate(self.params):
            self.master[i] = shard_of(p.detach().cpu().float(), dp_rank, dp_size).to(p.device)
            self.base_state[i] = {"step": torch.tensor(0.0),
                                  "exp_avg": torch.zeros_like(self.master[i]),
                                  "exp_avg_sq": torch.zeros_like(self.master[i])}

    def zero_grad(self):
        for p in self.params:
            p.grad = None

    def _reduced_grad(self, p) -> torch.Tensor:
        g = p.grad.detach().cpu().float()
        if self.dp_group is not None and self.dp_size > 1:
            dist.all_reduce(g, group=self.dp_group)
            g = g / self.dp_size
        return g

    @torch.no_grad()
    def step(self):
        group = self.param_groups[0]
        lr, (b1, b2), eps = group["lr"], group["betas"], group["eps"]
        for i, p in enumerate(self.params):
            g = shard_of(self._reduced_grad(p), self.dp_rank, self.dp_size).to(p.device)
            st = self.base_state[i]
            st["step"] += 1
            t = float(st["step"])
            st["exp_avg"].mul_(b1).add_(g, alpha=1 - b1)
            st["exp_avg_sq"].mul_(b2).addcmul_(g, g, value=1 - b2)
            denom = (st["exp_avg_sq"] / (1 - b2 ** t)).sqrt().add_(eps)
            self.master[i].addcdiv_(st["exp_avg"], denom, value=-lr / (1 - b1 ** t))
            self._gather_into(i, p)

    def _gather_into(self, i: int, p) -> None:
        mine = self.master[i].detach().cpu()
        if self.dp_group is not None and self.dp_size > 1:
            parts = [torch.empty_like(mine) for _ in range(self.dp_size)]
            dist.all_gather(parts, mine, group=self.dp_group)
            # all_gather orders by position in the sorted group; shards go by DP rank, which NxD's trn2
            # layout counts by list position instead
            parts = [parts[i] for i in self._members_by_dp_rank()]
        else:
            parts = [mine]
        p.copy_(unshard(parts, p.shape).to(p.dtype).to(p.device))

    def _members_by_dp_rank(self) -> List[int]:
        if getattr(self, "_order", None) is None:
            ranks = [torch.zeros(1, dtype=torch.int64) for _ in range(self.dp_size)]
            dist.all_gather(ranks, torch.tensor([self.dp_rank]), group=self.dp_group)
            by_rank = {int(r.item()): i for i, r in enumerate(ranks)}
            self._order = [by_rank[d] for d in range(self.dp_size)]
        return self._order

    def state_dict(self) -> dict:
        sd = {
            "state": {},
            "param_groups": [dict(g, params=list(range(len(g["params"])))) for g in self.param_groups],
            "base_state": {i: dict(s) for i, s in self.base_state.items()},
            "shape_info": {i: p.shape for i, p in enumerate(self.params)},
        }
        if self.save_master_weights:
            sd["sharded_master_weights"] = dict(self.master)
        return sd

    @torch.no_grad()
    def load_state_dict(self, sd: dict) -> None:
        for g, saved in zip(self.param_groups, sd["param_groups"]):
            g.update({k: v for k, v in saved.items() if k != "params"})
        for i, p in enumerate(self.params):
            src = sd["base_state"][i]
            self.base_state[i] = {k: (v.to(p.device) if v.dim() else v.clone()) for k, v in src.items()}
            masters: Optional[dict] = sd.get("sharded_master_weights")
            if masters is not None:
                # As torch-xla's ZeroRedundancyOptimizer: the parameters become the gathered master weights.
                self.master[i] = masters[i].to(p.device)
                self._gather_into(i, p)
            else:  # re-shard from the (already loaded) parameters
                self.master[i] = shard_of(p.detach().cpu().float(), self.dp_rank, self.dp_size).to(p.device)


class ZeroOneEPAdam:
    """ZeRO-1 Adam for expert parallelism, in the state-dict format of NxD's ``NeuronEPZero1Optimizer``:
    non-expert parameters sharded over the data-parallel group, expert parameters (``expert_model_parallel``
    set) over the expert-data-parallel group; ``state_dict()`` concatenates the two states, the expert one
    after the ``ep_*_offset`` keys. Like NxD's, the combined state carries no ``sharded_master_weights``: loading
    re-shards the master weights from the (already loaded) parameters."""

    def __init__(self, params, lr=1e-2, *, dp_group, dp_rank: int, dp_size: int, edp_group, edp_rank: int,
                 edp_size: int):
        params = list(params)
        is_ep = [bool(getattr(p, "expert_model_parallel", False)) for p in params]
        self.non_ep = ZeroOneAdam([p for p, e in zip(params, is_ep) if not e], lr=lr, dp_group=dp_group,
                                  dp_rank=dp_rank, dp_size=dp_size, save_master_weights=False)
        self.ep = ZeroOneAdam([p for p, e in zip(params, is_ep) if e], lr=lr, dp_group=edp_group,
                              dp_rank=edp_rank, dp_size=edp_size, save_master_weights=False)

    def zero_grad(self):
        self.non_ep.zero_grad()
        self.ep.zero_grad()

    def step(self):
        self.non_ep.step()
        self.ep.step()

    @staticmethod
    def _offset(d: dict) -> int:
        return max(d) + 1 if d else 1    # as NxD computes it (1 for an empty dict)

    def state_dict(self) -> dict:
        a, b = self.non_ep.state_dict(), self.ep.state_dict()
        offsets = {"ep_param_id_offset": self._offset(a["state"]), "ep_param_group_offset": len(a["param_groups"]),
                   "ep_base_state_offset": self._offset(a["base_state"]),
                   "ep_shape_info_offset": self._offset(a["shape_info"])}
        sd = dict(offsets, param_groups=a["param_groups"] + b["param_groups"])
        for key, off in (("state", "ep_param_id_offset"), ("base_state", "ep_base_state_offset"),
                         ("shape_info", "ep_shape_info_offset")):
            sd[key] = {**a[key], **{offsets[off] + k: v for k, v in b[key].items()}}
        return sd

    def load_state_dict(self, sd: dict) -> None:
        groups = sd["ep_param_group_offset"]

        def split(key, off):
            src = sd[key]
            return ({k: v for k, v in src.items() if k < off}, {k - off: v for k, v in src.items() if k >= off})

        parts = {}
        for key, off in (("state", "ep_param_id_offset"), ("base_state", "ep_base_state_offset"),
                         ("shape_info", "ep_shape_info_offset")):
            parts[key] = split(key, sd[off])
        for i, opt in enumerate((self.non_ep, self.ep)):
            part = {k: v[i] for k, v in parts.items()}
            part["param_groups"] = sd["param_groups"][:groups] if i == 0 else sd["param_groups"][groups:]
            opt.load_state_dict(part)
