#!/usr/bin/env python
"""The demo's language model in native PyTorch (no XLA): resume an NxD run converted with `nxd-ckpt to-dcp`.

The model is train_demo.py's Llama as transformers' ``LlamaForCausalLM`` (the same parameter names:
model.embed_tokens.weight, model.layers.N.self_attn.q_proj.weight, ..., lm_head.weight), sharded with FSDP2
(``fully_shard``) over every rank, trained with ``torch.optim.AdamW``. It loads the DCP checkpoint the way any native job does:

    model_sd, optim_sd = get_state_dict(model, optim)
    dcp.load({"model": model_sd, "optim": optim_sd, "scheduler": ..., "user_content": ...}, checkpoint_id=DIR)
    set_state_dict(model, optim, model_state_dict=model_sd, optim_state_dict=optim_sd)

and continues with the same data stream and learning-rate schedule. Run it on CPU with gloo:

    nxd-ckpt to-dcp ckpts/step_10 dcp/step_10
    python -m torch.distributed.run --standalone --nproc-per-node 2 scripts/native_demo.py \
        --dcp dcp/step_10 --steps 12
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def build(args):
    """The demo's Llama as transformers' LlamaForCausalLM (the same parameter names as train_demo's TinyLM),
    sharded with FSDP2 over every rank; AdamW; the demo's LR schedule. ``args``: train_demo's model flags."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import LlamaConfig, LlamaForCausalLM

    from train_demo import WarmupCosine, llama_config

    model = LlamaForCausalLM(LlamaConfig(**llama_config(args), attn_implementation="eager"))
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
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
        logits = model(batch[:, :-1]).logits
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
    """--dcp DIR --steps N, plus train_demo.py's model and schedule flags (--hidden, --layers, --lr, ...)."""
    from train_demo import parse_args as demo_args

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dcp", required=True, help="the DCP checkpoint directory (nxd-ckpt to-dcp's output)")
    own, rest = p.parse_known_args(argv)
    args = demo_args(["--ckpt-dir", "-", *rest])
    args.dcp = own.dcp
    return args


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
