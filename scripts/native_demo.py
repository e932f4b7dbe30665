#!/usr/bin/env python
"""The demo's language model in native PyTorch (no XLA): resume an NxD run converted with `nxd-ckpt to-dcp`.

The model is train_demo.py's TinyLM as one full module with the same parameter names (embed, pos,
blocks.N.{ln1,qkv,proj,ln2,up,down}, ln_f, lm_head), sharded with FSDP2 (``fully_shard``) over every rank,
trained with ``torch.optim.AdamW``. It loads the DCP checkpoint the way any native job does:

    model_sd, optim_sd = get_state_dict(model, optim)
    dcp.load({"model": model_sd, "optim": optim_sd, "scheduler": ..., "user_content": ...}, checkpoint_id=DIR)
    set_state_dict(model, optim, model_state_dict=model_sd, optim_state_dict=optim_sd)

and continues with the same data stream and learning-rate schedule. Run it on CPU with gloo:

    nxd-ckpt to-dcp ckpts/step_10 dcp/step_10
    python -m torch.distributed.run --standalone --nproc-per-node 2 scripts/native_demo.py \
        --dcp dcp/step_10 --steps 12 --hidden 64 --ffn 256 --layers 2
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


class Block(torch.nn.Module):
    def __init__(self, h: int, heads: int, ffn: int):
        super().__init__()
        self.heads, self.head_dim = heads, h // heads
        self.ln1 = torch.nn.LayerNorm(h)
        self.qkv = torch.nn.Linear(h, 3 * h)
        self.proj = torch.nn.Linear(h, h)
        self.ln2 = torch.nn.LayerNorm(h)
        self.up = torch.nn.Linear(h, ffn)
        self.down = torch.nn.Linear(ffn, h)

    def forward(self, x, mask):
        b, t, _ = x.shape
        # QKV rows laid out [head, (q|k|v), head_dim], as in train_demo (whole heads per TP slice)
        qkv = self.qkv(self.ln1(x)).view(b, t, self.heads, 3, self.head_dim)
        q, k, v = (qkv[:, :, :, i].transpose(1, 2) for i in range(3))
        att = (q @ k.transpose(-1, -2)) * self.head_dim ** -0.5 + mask
        y = (att.softmax(-1) @ v).transpose(1, 2).reshape(b, t, self.heads * self.head_dim)
        x = x + self.proj(y)
        return x + self.down(F.gelu(self.up(self.ln2(x))))


class NativeLM(torch.nn.Module):
    """train_demo.TinyLM, unsharded, with the same parameter names."""

    def __init__(self, vocab: int, hidden: int, heads: int, ffn: int, layers: int, seq_len: int):
        super().__init__()
        self.embed = torch.nn.Parameter(torch.zeros(vocab, hidden))
        self.pos = torch.nn.Parameter(torch.zeros(seq_len, hidden))
        self.blocks = torch.nn.ModuleDict({str(i): Block(hidden, heads, ffn) for i in range(layers)})
        self.ln_f = torch.nn.LayerNorm(hidden)
        self.lm_head = torch.nn.Linear(hidden, vocab, bias=False)
        self.register_buffer("mask", torch.full((seq_len, seq_len), float("-inf")).triu(1), persistent=False)

    def forward(self, tokens):
        t = tokens.shape[1]
        x = F.embedding(tokens, self.embed) + self.pos[:t]
        for blk in self.blocks.values():
            x = blk(x, self.mask[:t, :t])
        return self.lm_head(self.ln_f(x))


def build(args):
    """NativeLM sharded with FSDP2 over every rank, AdamW, the demo's LR schedule."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from train_demo import WarmupCosine

    model = NativeLM(args.vocab, args.hidden, args.heads, args.ffn, args.layers, args.seq_len)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for blk in model.blocks.values():
        fully_shard(blk, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=args.lr)
    sched = WarmupCosine(optim, args.lr, args.warmup, args.total_steps or args.steps)
    return model, optim, sched


def load_dcp(path, model, optim, sched) -> dict:
    """Every rank: load the DCP checkpoint into the sharded model, AdamW and the schedule; return user content."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_sd, optim_sd = get_state_dict(model, optim)
    state = {"model": model_sd, "optim": optim_sd, "scheduler": sched.state_dict(),
             "user_content": {"step": 0, "data_pos": 0}}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, optim, model_state_dict=model_sd, optim_state_dict=optim_sd)
    sched.load_state_dict(state["scheduler"])
    return state["user_content"]


def train(model, optim, sched, args, start_step: int, data_pos: int) -> dict:
    """Steps start_step+1 .. args.steps with the demo's data: each rank a slice of the global batch, the
    loss averaged over ranks. Returns {step: loss}."""
    from train_demo import TokenStream

    rank, world = dist.get_rank(), dist.get_world_size()
    local = args.global_batch // world
    stream = TokenStream(args.seed, args.vocab, args.seq_len)
    losses = {}
    for step in range(start_step + 1, args.steps + 1):
        batch = stream.batch(data_pos + rank * local, local)
        data_pos += args.global_batch
        logits = model(batch[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, args.vocab), batch[:, 1:].reshape(-1))
        loss.backward()
        optim.step()
        sched.step()
        optim.zero_grad()
        lval = loss.detach().reshape(1).clone()
        dist.all_reduce(lval)
        losses[step] = float(lval) / world
    return losses


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dcp", required=True, help="the DCP checkpoint directory (nxd-ckpt to-dcp's output)")
    p.add_argument("--steps", type=int, required=True, help="train until this global step")
    for name, default in (("seed", 1234), ("warmup", 3), ("global-batch", 8), ("seq-len", 32), ("vocab", 32),
                          ("hidden", 64), ("heads", 4), ("ffn", 256), ("layers", 2)):
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--total-steps", type=int, default=None)
    p.add_argument("--lr", type=float, default=1e-2)
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    torch.set_num_threads(1)
    model, optim, sched = build(args)
    uc = load_dcp(args.dcp, model, optim, sched)
    losses = train(model, optim, sched, args, int(uc["step"]), int(uc["data_pos"]))
    if dist.get_rank() == 0:
        for s, v in losses.items():
            print(f"[native_demo] step {s:4d}  loss {v:.4f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
