#!/usr/bin/env python
"""A tiny tensor-, pipeline- and data-parallel transformer language model that checkpoints with nxd-ckpt.

Run it under torchrun, one process per rank (CPU-XLA here, NeuronCores on Trn1):

    PJRT_DEVICE=CPU python -m torch.distributed.run --standalone --nproc-per-node 4 \
        scripts/train_demo.py --tp 2 --steps 40 --ckpt-every 10 --ckpt-dir /tmp/demo_ckpt --zero1

What it does, as an NxD training script would:
- a 2-layer Llama (RMSNorm, rotary embeddings, SwiGLU MLP, no biases) with transformers' parameter names,
  whose q/k/v, gate/up and LM head are Megatron column-parallel linears, o_proj / down_proj row-parallel and
  the token embedding vocabulary-parallel (as NxD's Llama example splits them),
  with NxD's partition attributes (``tensor_model_parallel``, ``partition_dim``, ``partition_stride``);
  ``nxd-ckpt export`` of its checkpoint loads with transformers' ``LlamaForCausalLM`` (``llama_config``);
- pipeline stages (``--pp``): the first stage holds the embeddings, the last the final norm and LM head, each a
  contiguous run of blocks; activations and their gradients travel between stages over gloo, one micro-batch
  per step; keys keep the full model's names;
- data parallelism over the DP group (gradients averaged), Adam or, with ``--zero1``, Adam whose state is
  sharded over DP in torch-xla's ZeRO-1 format; a warm-up + cosine LR schedule;
- a deterministic synthetic token stream; its position and the step go into ``user_content``;
- ``save_checkpoint(..., async_save=True)`` every ``--ckpt-every`` steps (and at the last step), and on
  start ``load_checkpoint`` of the newest complete checkpoint, so a restarted job resumes by itself.

Cross-rank communication (TP all-reduce, PP send/recv, DP gradient averaging) goes over gloo on host tensors, because
XLA collectives do not cross processes on the CPU PJRT device. On Trainium one would use the XLA
collectives of the same groups; the checkpointing calls do not change.

The training is deterministic: a run that is killed and resumed ends with the same bits as one that was
not. ``--crash-at-step N`` SIGKILLs every rank right after the async save of step N returned, while that
save is still being written (its writes are slowed by a write hook so it surely is in flight).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import signal
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # run from a checkout without installing
    sys.path.insert(0, ROOT)

# Neuron devices when the host has them (a Trn1/Inf2 instance), else the XLA CPU device; an explicit
# PJRT_DEVICE always wins.
os.environ.setdefault("PJRT_DEVICE", "NEURON" if os.path.exists("/dev/neuron0") else "CPU")
# Tiny model, few cores: let XLA:CPU compile fast rather than optimize hard (every run of the demo uses the
# same flags, so results stay comparable bit for bit). Irrelevant on Trainium, where neuronx-cc compiles.
FAST_CPU_COMPILE = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
if os.environ["PJRT_DEVICE"] == "CPU" and FAST_CPU_COMPILE not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {FAST_CPU_COMPILE}".strip()

import torch
import torch.distributed as dist
import torch.nn.functional as F


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--tp", type=int, default=2, help="tensor parallel size (DP = world size / (TP x PP))")
    p.add_argument("--pp", type=int, default=1, help="pipeline parallel size; must divide --layers")
    p.add_argument("--dp", type=int, default=None,
                   help="data parallel size; must equal world size / (TP x PP) (default: that value)")
    p.add_argument("--steps", type=int, default=30, help="train until this global step (counting resumed steps)")
    p.add_argument("--ckpt-every", type=int, default=5, help="save every K steps (and at the last step); 0: never")
    p.add_argument("--async", dest="async_save", action="store_true", default=True, help="async saves")
    p.add_argument("--no-async", dest="async_save", action="store_false", help="synchronous saves")
    p.add_argument("--num-kept", type=int, default=None, help="keep this many complete checkpoints (default all)")
    p.add_argument("--ckpt-dir", required=True, help="checkpoint directory (shared by every rank)")
    p.add_argument("--no-resume", action="store_true", help="start from scratch even if a checkpoint exists")
    p.add_argument("--out", default=None, help="JSON report (rank 0): losses, save stats, final checksum")
    p.add_argument("--crash-at-step", type=int, default=None,
                   help="SIGKILL every rank right after the async save of this step returned, while it is in flight")
    p.add_argument("--crash-write-delay", type=float, default=2.0,
                   help="seconds each file write of the crash step's save is held back (keeps it in flight)")
    p.add_argument("--dump-final", default=None, help="each rank writes its final model+optimizer state to FILE.rank<r>.pt")
    p.add_argument("--init-model", default=None, metavar="TAG_DIR",
                   help="start from the model weights of this tag (model only; e.g. `nxd-ckpt import` output)")
    p.add_argument("--dump-loaded", default=None,
                   help="right after resuming, each rank writes its loaded model+optimizer state to FILE.rank<r>.pt")
    p.add_argument("--dump-logits", default=None,
                   help="at the end, a forward pass over LOGITS_TOKENS; global rank of the last stage's first TP/DP "
                        "rank writes {'tokens', 'logits'} to FILE")
    p.add_argument("--zero1", action="store_true", help="ZeRO-1 (DP-sharded) Adam instead of replicated Adam")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--total-steps", type=int, default=None, help="length of the LR schedule (default: --steps)")
    p.add_argument("--global-batch", type=int, default=8, help="sequences per step over all DP ranks")
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--vocab", type=int, default=32)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=None, help="key/value heads (grouped-query attention; default --heads)")
    p.add_argument("--rms-eps", type=float, default=1e-5)
    p.add_argument("--rope-theta", type=float, default=10000.0)
    p.add_argument("--ffn", type=int, default=256)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--num-workers", type=int, default=4, help="checkpoint writer threads per rank")
    p.add_argument("--log-every", type=int, default=10, help="print the loss every N steps (rank 0)")
    return p.parse_args(argv)


# ---------------------------------------------------------------------------------------------------------
# Tensor parallel building blocks (Megatron's f / g operators over a host gloo TP group)
# ---------------------------------------------------------------------------------------------------------
class TP:
    group = None
    size = 1
    rank = 0


def _host_all_reduce(x: torch.Tensor) -> torch.Tensor:
    if TP.size == 1:
        return x
    h = x.detach().cpu()
    dist.all_reduce(h, group=TP.group)
    return h.to(x.device)


def _host_all_gather_last(x: torch.Tensor) -> torch.Tensor:
    if TP.size == 1:
        return x
    h = x.detach().cpu().contiguous()
    parts = [torch.empty_like(h) for _ in range(TP.size)]
    dist.all_gather(parts, h, group=TP.group)
    return torch.cat(parts, dim=-1).to(x.device)


class _CopyToTP(torch.autograd.Function):
    """Megatron's f: identity forward, all-reduce of the gradient backward (input of a column-parallel layer)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return _host_all_reduce(g)


class _ReduceFromTP(torch.autograd.Function):
    """Megatron's g: all-reduce forward, identity backward (output of a row-parallel layer)."""

    @staticmethod
    def forward(ctx, x):
        return _host_all_reduce(x)

    @staticmethod
    def backward(ctx, g):
        return g


class _GatherFromTP(torch.autograd.Function):
    """All-gather along the last dim forward; backward keeps this rank's slice (column-parallel gather_output)."""

    @staticmethod
    def forward(ctx, x):
        ctx.width = x.shape[-1]
        return _host_all_gather_last(x)

    @staticmethod
    def backward(ctx, g):
        return g[..., TP.rank * ctx.width:(TP.rank + 1) * ctx.width].contiguous()


def _param(full: torch.Tensor, device, partition_dim=None) -> torch.nn.Parameter:
    """This rank's slice of a full (CPU-initialized) tensor as a Parameter created on ``device``, with NxD's
    partition attributes. Attributes go on after the Parameter exists on the device: Module.to(xla) would
    replace the Parameter and drop them."""
    if partition_dim is not None and TP.size > 1:
        full = full.chunk(TP.size, dim=partition_dim)[TP.rank]
    p = torch.nn.Parameter(full.contiguous().to(device))
    if partition_dim is not None:
        p.tensor_model_parallel = True
        p.partition_dim = partition_dim
        p.partition_stride = 1
    return p


class ColumnParallelLinear(torch.nn.Module):
    """y = x W^T with W split along its output rows (partition_dim 0) over TP (Llama's linears have no bias)."""

    def __init__(self, in_f, out_f, gen, device, gather_output=False):
        super().__init__()
        assert out_f % TP.size == 0, f"{out_f} output features do not split over TP={TP.size}"
        self.weight = _param(torch.randn(out_f, in_f, generator=gen) * in_f ** -0.5, device, 0)
        self.gather_output = gather_output

    def forward(self, x):
        y = F.linear(_CopyToTP.apply(x), self.weight)
        return _GatherFromTP.apply(y) if self.gather_output else y


class RowParallelLinear(torch.nn.Module):
    """y = x W^T with W split along its input columns (partition_dim 1); partial sums all-reduced."""

    def __init__(self, in_f, out_f, gen, device):
        super().__init__()
        assert in_f % TP.size == 0, f"{in_f} input features do not split over TP={TP.size}"
        self.weight = _param(torch.randn(out_f, in_f, generator=gen) * in_f ** -0.5, device, 1)

    def forward(self, x):
        return _ReduceFromTP.apply(F.linear(x, self.weight))


class ParallelEmbedding(torch.nn.Module):
    """NxD's vocabulary-parallel embedding: each TP rank holds a contiguous slice of the rows (partition_dim 0),
    looks up the tokens in its range, and the partial results are summed over TP."""

    def __init__(self, vocab, hidden, gen, device):
        super().__init__()
        assert vocab % TP.size == 0, f"vocabulary {vocab} does not split over TP={TP.size}"
        self.weight = _param(torch.randn(vocab, hidden, generator=gen) * 0.02, device, 0)
        self.per = vocab // TP.size

    def forward(self, ids):
        if TP.size == 1:
            return F.embedding(ids, self.weight)
        local = ids - TP.rank * self.per
        inside = (local >= 0) & (local < self.per)
        out = F.embedding(torch.where(inside, local, torch.zeros_like(local)), self.weight)
        return _ReduceFromTP.apply(out * inside.unsqueeze(-1).to(out.dtype))


class RMSNorm(torch.nn.Module):
    """Llama's RMSNorm, computed as transformers' LlamaRMSNorm does (in float32, weight applied last)."""

    def __init__(self, n, eps, device):
        super().__init__()
        self.weight = _param(torch.ones(n), device)
        self.eps = eps

    def forward(self, x):
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def rope_tables(seq_len, head_dim, theta, device):
    """cos/sin of Llama's rotary embedding for positions 0..seq_len-1 ([seq_len, head_dim], halves repeated)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    freqs = torch.outer(torch.arange(seq_len).float(), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(device), emb.sin().to(device)


def _rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class LlamaAttention(torch.nn.Module):
    """Causal self-attention with rotary embeddings and grouped-query heads; q/k/v column-parallel (whole
    heads per TP rank), o_proj row-parallel."""

    def __init__(self, cfg, gen, device):
        super().__init__()
        h, heads, kv = cfg.hidden, cfg.heads, cfg.kv_heads or cfg.heads
        assert heads % TP.size == 0 and kv % TP.size == 0, f"{heads} heads / {kv} KV heads do not split over TP={TP.size}"
        assert heads % kv == 0, f"{heads} heads are not a multiple of {kv} KV heads"
        self.head_dim = h // heads
        self.local_heads, self.local_kv = heads // TP.size, kv // TP.size
        self.q_proj = ColumnParallelLinear(h, heads * self.head_dim, gen, device)
        self.k_proj = ColumnParallelLinear(h, kv * self.head_dim, gen, device)
        self.v_proj = ColumnParallelLinear(h, kv * self.head_dim, gen, device)
        self.o_proj = RowParallelLinear(heads * self.head_dim, h, gen, device)

    def forward(self, x, mask, cos, sin):
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.local_heads, self.head_dim).transpose(1, 2)   # [b, heads, t, d]
        k = self.k_proj(x).view(b, t, self.local_kv, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.local_kv, self.head_dim).transpose(1, 2)
        q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        rep = self.local_heads // self.local_kv
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        att = (q @ k.transpose(-1, -2)) * self.head_dim ** -0.5 + mask
        y = (att.softmax(-1) @ v).transpose(1, 2).reshape(b, t, self.local_heads * self.head_dim)
        return self.o_proj(y)


class LlamaMLP(torch.nn.Module):
    """down(silu(gate(x)) * up(x)): gate/up column-parallel, down row-parallel."""

    def __init__(self, cfg, gen, device):
        super().__init__()
        self.gate_proj = ColumnParallelLinear(cfg.hidden, cfg.ffn, gen, device)
        self.up_proj = ColumnParallelLinear(cfg.hidden, cfg.ffn, gen, device)
        self.down_proj = RowParallelLinear(cfg.ffn, cfg.hidden, gen, device)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(torch.nn.Module):
    """Llama's pre-norm decoder layer (the same parameter names as transformers' LlamaDecoderLayer)."""

    def __init__(self, cfg, gen, device):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden, cfg.rms_eps, device)
        self.self_attn = LlamaAttention(cfg, gen, device)
        self.post_attention_layernorm = RMSNorm(cfg.hidden, cfg.rms_eps, device)
        self.mlp = LlamaMLP(cfg, gen, device)

    def forward(self, x, mask, cos, sin):
        x = x + self.self_attn(self.input_layernorm(x), mask, cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class PP:
    """This rank's pipeline stage and its neighbours' global ranks (activations go over the host)."""
    rank = 0
    size = 1
    prev = None
    next = None


class LlamaBody(torch.nn.Module):
    """``model.*`` of transformers' LlamaForCausalLM: embeddings (first stage), this stage's layers, final norm
    (last stage)."""

    def __init__(self, cfg, gen, device, first, last, layer_ids):
        super().__init__()
        embed = ParallelEmbedding(cfg.vocab, cfg.hidden, gen, device)
        layers = [DecoderLayer(cfg, gen, device) for _ in range(cfg.layers)]   # every layer: same RNG draws at any PP
        norm = RMSNorm(cfg.hidden, cfg.rms_eps, device)
        if first:
            self.embed_tokens = embed
        self.layers = torch.nn.ModuleDict({str(i): layers[i] for i in layer_ids})
        if last:
            self.norm = norm


class TinyLM(torch.nn.Module):
    """A small Llama (RMSNorm, rotary embeddings, SwiGLU MLP, no biases) with transformers' parameter names
    (``model.embed_tokens.weight``, ``model.layers.<i>.self_attn.q_proj.weight``, ..., ``lm_head.weight``), so
    ``nxd-ckpt export`` output loads with ``LlamaForCausalLM.from_pretrained`` and a ``llama_config(args)``.
    At PP>1 this stage's part: the embeddings on the first stage, a contiguous run of layers on each, the
    final norm and LM head on the last; keys keep the full model's names, so stages merge back into one."""

    def __init__(self, cfg, device):
        super().__init__()
        gen = torch.Generator().manual_seed(cfg.seed)   # full weights from one seed: same model for any TP/PP
        per = cfg.layers // PP.size
        self.first, self.last = PP.rank == 0, PP.rank == PP.size - 1
        self.model = LlamaBody(cfg, gen, device, self.first, self.last, range(PP.rank * per, (PP.rank + 1) * per))
        lm_head = ColumnParallelLinear(cfg.hidden, cfg.vocab, gen, device, gather_output=True)
        if self.last:
            self.lm_head = lm_head
        t = cfg.seq_len
        cos, sin = rope_tables(t, cfg.hidden // cfg.heads, cfg.rope_theta, device)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.register_buffer("mask", torch.full((t, t), float("-inf")).triu(1).to(device), persistent=False)

    def forward(self, x):
        """First stage: token ids in; last stage: logits out; in between: activations."""
        t = x.shape[1]
        if self.first:
            x = self.model.embed_tokens(x)
        for layer in self.model.layers.values():
            x = layer(x, self.mask[:t, :t], self.rope_cos[:t], self.rope_sin[:t])
        return self.lm_head(self.model.norm(x)) if self.last else x


def llama_config(cfg) -> dict:
    """transformers' LlamaConfig (as a dict, for ``config.json``) of the model ``TinyLM(cfg)`` builds."""
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": cfg.vocab,
            "hidden_size": cfg.hidden, "intermediate_size": cfg.ffn, "num_hidden_layers": cfg.layers,
            "num_attention_heads": cfg.heads, "num_key_value_heads": cfg.kv_heads or cfg.heads,
            "head_dim": cfg.hidden // cfg.heads, "max_position_embeddings": cfg.seq_len, "rms_norm_eps": cfg.rms_eps,
            "rope_theta": cfg.rope_theta, "hidden_act": "silu", "attention_bias": False, "mlp_bias": False,
            "tie_word_embeddings": False, "torch_dtype": "float32"}


def pipeline_forward(model, tokens, hidden, device):
    """Forward only, through every stage; the logits on the last stage, else None."""
    with torch.no_grad():
        x = tokens
        if not model.first:
            x = torch.empty(tokens.shape[0], tokens.shape[1], hidden)
            dist.recv(x, src=PP.prev)
            x = x.to(device)
        out = model(x)
        if not model.last:
            dist.send(out.cpu().contiguous(), dst=PP.next)
            return None
        return out


def pipeline_step(model, tokens, targets, vocab, hidden, device):
    """Forward and backward of one batch through the pipeline (one micro-batch: no overlap between stages,
    which keeps it short and deterministic). Returns the loss on the last stage, else None."""
    if model.first:
        x_in = tokens
    else:
        h = torch.empty(tokens.shape[0], tokens.shape[1], hidden)
        dist.recv(h, src=PP.prev)
        x_in = h.to(device).requires_grad_(True)
    out = model(x_in)
    loss = None
    if model.last:
        loss = F.cross_entropy(out.reshape(-1, vocab), targets.reshape(-1))
        loss.backward()
    else:
        dist.send(out.detach().cpu().contiguous(), dst=PP.next)
        g = torch.empty(out.shape)
        dist.recv(g, src=PP.next)
        out.backward(g.to(device))
    if not model.first:
        dist.send(x_in.grad.detach().cpu().contiguous(), dst=PP.prev)
    return loss


# ---------------------------------------------------------------------------------------------------------
# Data, schedule, helpers
# ---------------------------------------------------------------------------------------------------------
class TokenStream:
    """A deterministic, endless stream of synthetic sequences; sample ``i`` depends only on (seed, i).
    Each sequence follows one of a few affine rules (next = a*prev + c mod V) with 10% noise, so the loss
    can fall well below log(V) once the model infers the rule from the context."""

    RULES = ((5, 3), (7, 11), (3, 1), (9, 5))

    def __init__(self, seed, vocab, seq_len):
        self.seed, self.vocab, self.len = seed, vocab, seq_len + 1

    def sample(self, i):
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + i)
        a, c = self.RULES[int(torch.randint(len(self.RULES), (1,), generator=g))]
        noise = torch.rand(self.len, generator=g) < 0.1
        rand = torch.randint(self.vocab, (self.len,), generator=g)
        out = [int(rand[0])]
        for j in range(1, self.len):
            out.append(int(rand[j]) if noise[j] else (a * out[-1] + c) % self.vocab)
        return torch.tensor(out, dtype=torch.long)

    def batch(self, pos, n):
        return torch.stack([self.sample(pos + k) for k in range(n)])


class WarmupCosine:
    """Linear warm-up then cosine decay to 10%; works with any optimizer that has ``param_groups``."""

    def __init__(self, optimizer, base_lr, warmup, total):
        self.optimizer, self.base_lr, self.warmup, self.total = optimizer, base_lr, warmup, max(total, 1)
        self.last_step = 0
        self._apply()

    def lr_at(self, s):
        if s < self.warmup:
            return self.base_lr * (s + 1) / self.warmup
        frac = min(1.0, (s - self.warmup) / max(1, self.total - self.warmup))
        return self.base_lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))

    def _apply(self):
        for g in self.optimizer.param_groups:
            g["lr"] = self.lr_at(self.last_step)

    def step(self):
        self.last_step += 1
        self._apply()

    def state_dict(self):
        return {"last_step": self.last_step, "base_lr": self.base_lr, "warmup": self.warmup, "total": self.total}

    def load_state_dict(self, sd):
        self.last_step, self.base_lr = int(sd["last_step"]), float(sd["base_lr"])
        self.warmup, self.total = int(sd["warmup"]), int(sd["total"])
        self._apply()


def cpu_state(obj):
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu().clone()
    if isinstance(obj, dict):
        return {k: cpu_state(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(cpu_state(v) for v in obj)
    return obj


def digest(obj, h=None):
    """sha256 over a nested state: keys, tensor dtypes/shapes/bytes, other values' repr."""
    h = h or hashlib.sha256()
    if isinstance(obj, torch.Tensor):
        t = obj.detach().cpu().contiguous()
        h.update(f"T{t.dtype}{tuple(t.shape)}".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    elif isinstance(obj, dict):
        for k in sorted(obj, key=str):
            h.update(f"K{k!r}".encode())
            digest(obj[k], h)
    elif isinstance(obj, (list, tuple)):
        h.update(f"L{len(obj)}".encode())
        for v in obj:
            digest(v, h)
    else:
        h.update(f"V{obj!r}".encode())
    return h


def write_json(path, data):
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1)
    os.replace(tmp, path)


def gather_save_stats(nxd_ckpt):
    """Per-save stats of every rank, merged per tag: max stall and commit time, summed bytes and files."""
    mine = nxd_ckpt.save_stats()
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    merged = {}
    for rank_stats in every:
        for s in rank_stats:
            m = merged.setdefault(s["tag"], {"tag": s["tag"], "stall_s": 0.0, "commit_s": 0.0, "bytes": 0,
                                             "files": 0, "ok": True, "ranks": 0})
            m["stall_s"] = max(m["stall_s"], float(s.get("stall_s", 0.0)))
            m["commit_s"] = max(m["commit_s"], float(s.get("commit_s", 0.0)))
            m["bytes"] += int(s.get("bytes", 0))
            m["files"] += int(s.get("files", 0))
            m["ok"] = m["ok"] and bool(s.get("ok", True))
            m["ranks"] += 1
    out = list(merged.values())
    for m in out:
        m["step"] = int(m["tag"].rsplit("_", 1)[-1]) if m["tag"].rsplit("_", 1)[-1].isdigit() else None
    return out


# ---------------------------------------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------------------------------------
def main(argv=None):
    args = parse_args(argv)
    if args.pp < 1 or args.layers % args.pp:
        sys.exit(f"train_demo.py: --pp {args.pp} must be >= 1 and divide --layers {args.layers}")
    torch.set_num_threads(1)
    if not dist.is_initialized():   # torchrun sets the env; a test harness may have initialized it already
        dist.init_process_group("gloo")
    import torch_xla

    import nxd_ckpt
    import parallel_state as ps
    from nxd_ckpt.testing import ZeroOneAdam

    wall0 = time.monotonic()
    rank, world = dist.get_rank(), dist.get_world_size()
    if world % (args.tp * args.pp):
        sys.exit(f"train_demo.py: --tp {args.tp} x --pp {args.pp} does not divide the world size {world}")
    if args.dp is not None and args.dp * args.tp * args.pp != world:
        sys.exit(f"train_demo.py: --dp {args.dp} x --tp {args.tp} x --pp {args.pp} must equal the world size {world}; "
                 f"use --dp {world // (args.tp * args.pp)} or launch {args.dp * args.tp * args.pp} ranks")
    ps.initialize_model_parallel(tensor_model_parallel_size=args.tp, pipeline_model_parallel_size=args.pp)
    TP.group, TP.size, TP.rank = (ps.get_tensor_model_parallel_group(), ps.get_tensor_model_parallel_size(),
                                  ps.get_tensor_model_parallel_rank())
    PP.rank, PP.size = ps.get_pipeline_model_parallel_rank(), ps.get_pipeline_model_parallel_size()
    stage_ranks = next(g for g in ps.get_pipeline_model_parallel_replica_groups() if rank in g)
    PP.prev = stage_ranks[PP.rank - 1] if PP.rank > 0 else None
    PP.next = stage_ranks[PP.rank + 1] if PP.rank < PP.size - 1 else None
    dp_rank, dp_size, dp_group = ps.get_data_parallel_rank(), ps.get_data_parallel_size(), ps.get_data_parallel_host_group()
    if args.global_batch % dp_size:
        sys.exit(f"train_demo.py: --global-batch {args.global_batch} does not split over DP={dp_size}")
    local_batch = args.global_batch // dp_size
    say = (lambda *a: print("[train_demo]", *a, flush=True)) if rank == 0 else (lambda *a: None)

    device = torch_xla.device()
    model = TinyLM(args, device)
    if args.init_model:   # weights only (e.g. an `nxd-ckpt import` of a Hugging Face model), resharded as needed
        tagdir = os.path.abspath(args.init_model)
        nxd_ckpt.load_checkpoint(os.path.dirname(tagdir), os.path.basename(tagdir), model=model)
        torch_xla.sync()
        say(f"model weights from {tagdir}")
    params = list(model.parameters())
    if args.zero1:
        opt = ZeroOneAdam(params, lr=args.lr, dp_group=dp_group, dp_rank=dp_rank, dp_size=dp_size)
    else:
        opt = torch.optim.Adam(params, lr=args.lr)
    sched = WarmupCosine(opt, args.lr, args.warmup, args.total_steps or args.steps)
    stream = TokenStream(args.seed, args.vocab, args.seq_len)
    torch_xla.sync()

    start_step, data_pos, resumed_from = 0, 0, None
    os.makedirs(args.ckpt_dir, exist_ok=True)
    if not args.no_resume and nxd_ckpt.has_checkpoint(args.ckpt_dir):
        resumed_from = nxd_ckpt.newest_checkpoint(args.ckpt_dir)
        t0 = time.monotonic()
        uc = nxd_ckpt.load_checkpoint(args.ckpt_dir, model=model, optimizer=opt, scheduler=sched)
        torch_xla.sync()   # materialize the loaded values: the next step's graph is then the same as in a fresh run
        if args.dump_loaded:
            torch.save({"model": cpu_state(model.state_dict()), "optim": cpu_state(opt.state_dict())},
                       f"{args.dump_loaded}.rank{rank}.pt")
        start_step, data_pos = int(uc["step"]), int(uc["data_pos"])
        resumed_from = uc.get("tag", resumed_from)
        say(f"resumed from {resumed_from} (step {start_step}, data position {data_pos}) in "
            f"{time.monotonic() - t0:.2f}s; TP={TP.size} PP={PP.size} DP={dp_size} (saved with DP={uc.get('dp_size')})")
    else:
        say(f"starting from scratch; TP={TP.size} PP={PP.size} DP={dp_size} world={world} zero1={args.zero1}")

    if args.crash_at_step is not None:
        from nxd_ckpt.commit import STAGING_SUFFIX
        from nxd_ckpt.storage import set_write_hook

        crash_tag = f"step_{args.crash_at_step}"

        def slow_writes(relpath):   # hold back every file of the crash step's save: it stays in flight
            if relpath.startswith((f"{crash_tag}{STAGING_SUFFIX}/", f"{crash_tag}/")):
                time.sleep(args.crash_write_delay)

        set_write_hook(slow_writes)

    report = {"config": {k: v for k, v in vars(args).items()}, "world_size": world, "tp": TP.size, "pp": PP.size, "dp": dp_size,
              "resumed_from": resumed_from, "start_step": start_step + 1, "losses": {}, "step_s": {},
              "saves": [], "save_steps": [], "crashed_at": None, "final_checksum": None}
    report["config"]["async_save"] = args.async_save

    def flush_report():
        if rank == 0 and args.out:
            write_json(args.out, report)

    for step in range(start_step + 1, args.steps + 1):
        t_step = time.monotonic()
        batch = stream.batch(data_pos + dp_rank * local_batch, local_batch)
        data_pos += args.global_batch
        tokens, targets = batch[:, :-1].to(device), batch[:, 1:].to(device)
        loss = pipeline_step(model, tokens, targets, args.vocab, args.hidden, device)
        torch_xla.sync()
        if not args.zero1 and dp_size > 1:   # DDP-style gradient averaging over the host DP group
            for p in params:
                g = p.grad.detach().cpu()
                dist.all_reduce(g, group=dp_group)
                p.grad = (g / dp_size).to(device)
        opt.step()
        sched.step()
        opt.zero_grad()
        torch_xla.sync()
        lval = loss.detach().cpu().reshape(1) if loss is not None else torch.zeros(1)
        if PP.size > 1:   # the last stage's loss, to every stage (rank 0 reports it)
            dist.all_reduce(lval, group=ps.get_pipeline_model_parallel_group())
        if dp_size > 1:
            dist.all_reduce(lval, group=dp_group)
            lval /= dp_size
        report["losses"][str(step)] = float(lval)
        report["step_s"][str(step)] = time.monotonic() - t_step
        if step % args.log_every == 0 or step == args.steps:
            say(f"step {step:4d}  loss {float(lval):.4f}  lr {sched.lr_at(sched.last_step - 1):.2e}")

        if args.ckpt_every and (step % args.ckpt_every == 0 or step == args.steps):
            tag = f"step_{step}"
            uc = {"step": step, "data_pos": data_pos, "tag": tag, "seed": args.seed, "dp_size": dp_size,
                  "tp_size": TP.size, "global_batch": args.global_batch}
            nxd_ckpt.save_checkpoint(args.ckpt_dir, tag, model=model, optimizer=opt, scheduler=sched,
                                     user_content=uc, num_workers=args.num_workers,
                                     num_kept_ckpts=args.num_kept, async_save=args.async_save,
                                     zero1_optimizer=args.zero1, use_xser=True)
            report["save_steps"].append(step)
            if step == args.crash_at_step:
                from nxd_ckpt.engine import get_engine

                in_flight = get_engine().in_flight_tags()
                report["saves"] = gather_save_stats(nxd_ckpt)   # also a barrier: every rank's save has started
                report["crashed_at"] = step
                report["crash_in_flight"] = tag in in_flight
                flush_report()
                say(f"step {step}: save {tag} returned and is in flight on rank 0: {tag in in_flight}; "
                    "SIGKILL on every rank now")
                os.kill(os.getpid(), signal.SIGKILL)
        flush_report()

    t_fin = time.monotonic()
    nxd_ckpt.finalize_checkpoint()
    report["finalize_s"] = time.monotonic() - t_fin
    report["saves"] = gather_save_stats(nxd_ckpt)
    final = {"model": cpu_state(model.state_dict()), "optim": cpu_state(opt.state_dict())}
    mine = digest(final).hexdigest()
    every = [None] * world
    dist.all_gather_object(every, mine)
    report["rank_checksums"] = every
    report["final_checksum"] = hashlib.sha256("".join(every).encode()).hexdigest()
    report["wall_s"] = time.monotonic() - wall0
    if args.dump_final:
        torch.save(final, f"{args.dump_final}.rank{rank}.pt")
    if args.dump_logits:
        tokens = TokenStream(args.seed + 1, args.vocab, args.seq_len).batch(0, 2)[:, :-1]
        logits = pipeline_forward(model, tokens.to(device), args.hidden, device)
        if logits is not None and TP.rank == 0 and dp_rank == 0:
            torch.save({"tokens": tokens, "logits": logits.detach().cpu()}, args.dump_logits)
    flush_report()
    say(f"done: steps {start_step + 1}..{args.steps}, final state sha256 {report['final_checksum'][:16]}, "
        f"{report['wall_s']:.1f}s")
    ps.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
