"""Small models and helpers shared by the multi-rank tests (importable by rank processes)."""
from __future__ import annotations

import os

import torch


def xla_device():
    import torch_xla

    return torch_xla.device()


def sync():
    import torch_xla

    torch_xla.sync()


class TinyShard(torch.nn.Module):
    """A TP shard of a two-layer MLP: a column-parallel and a row-parallel linear, with NxD's
    partition attributes. Its values depend on (tp, pp) so shards differ per rank and agree over DP."""

    def __init__(self, tp_rank: int = 0, pp_rank: int = 0, hidden: int = 8, seed_offset: int = 0, device=None):
        super().__init__()
        # Built directly on the device: Module.to(xla) replaces Parameters and drops their attributes.
        device = device if device is not None else xla_device()
        g = torch.Generator().manual_seed(1000 + 17 * tp_rank + 101 * pp_rank + seed_offset)
        self.up = torch.nn.Parameter(torch.randn(hidden, hidden, generator=g).to(device))
        self.down = torch.nn.Parameter(torch.randn(hidden, hidden, generator=g).to(device))
        self.bias = torch.nn.Parameter(torch.randn(hidden, generator=g).to(device))
        self.register_buffer("steps_seen", torch.zeros((), dtype=torch.int64).to(device))
        for p, dim in ((self.up, 0), (self.down, 1)):
            p.tensor_model_parallel = True
            p.partition_dim = dim
            p.partition_stride = 1

    def forward(self, x):
        return torch.tanh(x @ self.up.t()) @ self.down.t() + self.bias


def reduce_grads(model, group, size):
    """Average gradients over a host (gloo) data-parallel group, as DDP would."""
    import torch.distributed as dist

    for p in model.parameters():
        g = p.grad.detach().cpu()
        dist.all_reduce(g, group=group)
        p.grad = (g / size).to(p.device)


def train_steps(model, opt, steps: int, seed: int, dp_rank: int = 0, sched=None, dp_group=None, dp_size=1,
                start: int = 0):
    """Deterministic steps on the model's device; the batch depends on the step and DP rank. With
    ``dp_group`` gradients are averaged over it (plain replicated optimizers)."""
    dev = next(model.parameters()).device
    for s in range(start, start + steps):
        g = torch.Generator().manual_seed(seed * 1000 + s * 10 + dp_rank)
        x = torch.randn(4, model.up.shape[1], generator=g).to(dev)
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        if dp_group is not None and dp_size > 1:
            reduce_grads(model, dp_group, dp_size)
        opt.step()
        if sched is not None:
            sched.step()
        sync()


def to_cpu_state(obj):
    """A CPU copy of a nested state (for bit-exact comparison)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu().clone()
    if isinstance(obj, dict):
        return {k: to_cpu_state(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_cpu_state(v) for v in obj)
    return obj


def assert_bit_equal(a, b, path="state"):
    """Structures equal; tensors equal bit for bit (same dtype, shape and bytes)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), f"{path}: tensor vs {type(b).__name__}"
        a, b = a.detach().cpu(), b.detach().cpu()
        assert a.dtype == b.dtype and a.shape == b.shape, f"{path}: {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}"
        assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)), f"{path}: bytes differ"
        return
    if isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), f"{path}: keys {sorted(map(str, a))} vs {sorted(map(str, b))}"
        for k in a:
            assert_bit_equal(a[k], b[k], f"{path}/{k}")
        return
    if isinstance(a, (list, tuple)):
        assert len(a) == len(b), f"{path}: length {len(a)} vs {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_bit_equal(x, y, f"{path}/{i}")
        return
    assert a == b, f"{path}: {a!r} vs {b!r}"


def all_files(root: str) -> set:
    out = set()
    for d, _, files in os.walk(root):
        for f in files:
            out.add(os.path.relpath(os.path.join(d, f), root))
    return out


class Note:
    """A user class: not on torch's weights_only allowlist, so loading it needs trusted=True."""

    def __init__(self, text: str):
        self.text = text

    def __eq__(self, other):
        return isinstance(other, Note) and other.text == self.text
