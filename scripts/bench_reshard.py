#!/usr/bin/env python3
"""Benchmark load-time resharding against a same-topology load of the same checkpoint.

A transformer-like model (per layer: qkv and up column-parallel, o and down row-parallel, a replicated norm; a
replicated embedding) is saved once at TP=2 on 2 ranks (``--format xser``: one file per tensor; ``plain``: one
``torch.save`` file per shard, NxD's default; with our manifest). Then, alternating, ``--repeat``
times each (page cache dropped before every load):

- ``same``: 2 ranks at TP=2 load it (no resharding);
- ``reshard``: 2 ranks at TP=1 x PP=2 load it: each rank joins both TP shards of its stage's tensors, so it
  reads as many bytes as a ``same`` rank does and only the resharding differs (of a plain shard it needs half:
  its stage's tensors, read by byte ranges, each zip record checked against the manifest's per-record CRC32C);
- ``reshard_streamed`` (``--format plain`` only): the same load of a copy of the tag (hard links) whose manifest
  lacks the per-record sums, as older releases wrote it: each shard file is first checked by one streaming pass.

Bytes read are each rank's ``rchar`` (/proc/self/io: every byte read()/pread() returned, page cache or not; a
memory-mapped same-topology plain load reads through the page cache and counts little).

Each rank loads into a dict of CPU tensors of its new shape (``load_checkpoint(model=dict)``), so the numbers
are the library's read + reshard + apply, not a device transfer. Reported per case: load time (slowest rank,
median over rounds) and each rank's RSS peak above its pre-load RSS, next to this rank's new shard bytes and the
largest source tensor it reads (the bound is their sum plus small buffers).

    python scripts/bench_reshard.py --hidden 1024 --layers 4 --repeat 3 --out bench_out/reshard.json
    python scripts/bench_reshard.py --hidden 1024 --layers 4 --repeat 3 --format plain
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time

SCRIPTS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(SCRIPTS)
for p in (ROOT, SCRIPTS):
    if p not in sys.path:
        sys.path.insert(0, p)

MB = 1 << 20


def model_spec(hidden: int, layers: int, vocab: int):
    """[(key, full shape, partition dim or None)] in model order."""
    h = hidden
    spec = [("embed.weight", (vocab, h), None)]
    for i in range(layers):
        p = f"layers.{i}."
        spec += [(p + "qkv.weight", (3 * h, h), 0), (p + "o.weight", (h, h), 1), (p + "up.weight", (4 * h, h), 0),
                 (p + "down.weight", (h, 4 * h), 1), (p + "norm.weight", (h,), None)]
    return spec


def _part(dim):
    from nxd_ckpt.partition import Partition

    return None if dim is None else Partition(dim)


def _tagged(t, dim):
    if dim is not None:
        t.tensor_model_parallel, t.partition_dim, t.partition_stride = True, dim, 1
    return t


# --- rank workers (under torchrun) ------------------------------------------------------------------------
def worker(args) -> None:
    import torch
    import torch.distributed as dist

    import nxd_ckpt
    import parallel_state as ps
    from bench import RssSampler, trim_heap
    from nxd_ckpt.partition import assign_stages, split_tp, tp_shard_shape

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    ps.initialize_model_parallel(tensor_model_parallel_size=args.tp, pipeline_model_parallel_size=args.pp)
    tp_rank, pp_rank = ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank()
    spec = model_spec(args.hidden, args.layers, args.vocab)
    stage = assign_stages([k for k, _, _ in spec], args.pp)
    if args.worker == "save":
        sd = {}
        for n, (key, shape, dim) in enumerate(spec):
            full = torch.randn(shape, generator=torch.Generator().manual_seed(n))
            sd[key] = _tagged(split_tp(full, _part(dim), args.tp, tp_rank).clone(), dim)
        nxd_ckpt.save_checkpoint(args.dir, "s", model=sd, use_xser=args.format == "xser")
        _shut_down(dist, ps)
        return
    sd = {key: _tagged(torch.zeros(tp_shard_shape(shape, _part(dim), args.tp)), dim)
          for key, shape, dim in spec if stage[key] == pp_rank}
    new_bytes = sum(t.numel() * 4 for t in sd.values())
    largest_src = max(math.prod(shape) * 4 // (1 if dim is None else args.src_tp)
                      for key, shape, dim in spec if key in sd)
    trim_heap()
    dist.barrier()
    sampler = RssSampler().start()
    base = sampler.peak
    rchar = _rchar()
    t0 = time.perf_counter()
    nxd_ckpt.load_checkpoint(args.dir, args.tag, model=sd)
    elapsed = time.perf_counter() - t0
    read_mb = (_rchar() - rchar) / MB
    peak = sampler.stop()
    rows = [None] * dist.get_world_size()
    dist.all_gather_object(rows, {"load_s": elapsed, "rss_peak_above_mb": (peak - base) / MB, "read_mb": read_mb,
                                  "new_shard_mb": new_bytes / MB, "largest_source_tensor_mb": largest_src / MB})
    if dist.get_rank() == 0:
        with open(args.result, "w") as f:
            json.dump(rows, f)
    _shut_down(dist, ps)


def _rchar() -> int:
    with open("/proc/self/io") as f:
        return next(int(ln.split()[1]) for ln in f if ln.startswith("rchar:"))


def _old_manifest_copy(root: str, tag: str, old: str) -> None:
    """``old``: ``tag`` with its files hard-linked and a manifest without per-record sums (sealed again)."""
    import shutil

    from nxd_ckpt import layout, manifest

    shutil.copytree(os.path.join(root, tag), os.path.join(root, old), copy_function=os.link)
    path = os.path.join(root, old, layout.MANIFEST_FILE)
    with open(path) as f:
        doc = json.load(f)
    doc["tag"] = old
    for e in doc["files"].values():
        e.pop("ranges", None)
    body = json.dumps(doc, indent=1).encode()
    for name, data in ((layout.MANIFEST_FILE, body), (layout.DONE_MARKER, manifest.seal(body))):
        os.unlink(os.path.join(root, old, name))      # hard links: replace, never write through
        with open(os.path.join(root, old, name), "wb") as f:
            f.write(data)


def _shut_down(dist, ps) -> None:
    # Every rank waits for the others before tearing down, and the host gloo groups go before the default
    # group: a rank that exits while a peer still holds a gloo connection to it aborts that peer (SIGABRT).
    dist.barrier()
    ps.destroy_model_parallel()
    dist.destroy_process_group()


# --- orchestrator ---------------------------------------------------------------------------------------------
def _torchrun(args, nproc: int, extra) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
           os.path.abspath(__file__), "--dir", args.dir, "--hidden", str(args.hidden), "--layers", str(args.layers),
           "--vocab", str(args.vocab), *extra]
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, env=env, timeout=1800, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if proc.returncode:
        tail = "\n".join(ln for ln in proc.stdout.splitlines() if not ln.startswith("[Gloo]"))[-4000:]
        raise SystemExit(f"bench_reshard.py: {' '.join(extra)} failed (exit {proc.returncode}):\n{tail}")


# (tp, pp, tag) of the loading job, 2 ranks each
CASES = {"same": ("2", "1", "s"), "reshard": ("1", "2", "s"), "reshard_streamed": ("1", "2", "s_old")}


def run(args) -> dict:
    import shutil

    from bench import Cache

    shutil.rmtree(args.dir, ignore_errors=True)
    _torchrun(args, 2, ["--worker", "save", "--tp", "2", "--format", args.format])
    cases = {c: v for c, v in CASES.items() if args.format == "plain" or c != "reshard_streamed"}
    if "reshard_streamed" in cases:
        _old_manifest_copy(args.dir, "s", "s_old")
    cache = Cache()
    rounds = {c: [] for c in cases}
    for _ in range(args.repeat):
        for case, (tp, pp, tag) in cases.items():
            cache.drop(args.dir)
            result = os.path.join(args.dir, f"result_{case}.json")
            _torchrun(args, 2, ["--worker", "load", "--tp", tp, "--pp", pp, "--src-tp", "2", "--result", result,
                                "--tag", tag])
            with open(result) as f:
                rounds[case].append(json.load(f))
    out = {"hidden": args.hidden, "layers": args.layers, "vocab": args.vocab, "format": args.format,
           "cache": cache.mode, "cases": {}}
    for case, rs in rounds.items():
        out["cases"][case] = {
            "tp_pp": CASES[case][:2],
            "read_mb_per_rank_max": max(r["read_mb"] for rows in rs for r in rows),
            "load_s_median": statistics.median(max(r["load_s"] for r in rows) for rows in rs),
            "load_s_rounds": [max(r["load_s"] for r in rows) for rows in rs],
            "rss_peak_above_mb_max": max(r["rss_peak_above_mb"] for rows in rs for r in rows),
            "new_shard_mb": rs[0][0]["new_shard_mb"], "largest_source_tensor_mb": rs[0][0]["largest_source_tensor_mb"],
        }
    c = out["cases"]
    out["reshard_over_same"] = c["reshard"]["load_s_median"] / c["same"]["load_s_median"]
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", default="/tmp/nxd_ckpt_bench_reshard")
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--format", choices=("xser", "plain"), default="xser",
                   help="how the checkpoint is saved: xser (use_xser=True) or plain torch.save shards")
    p.add_argument("--out", default=None)
    p.add_argument("--worker", choices=("save", "load"), default=None, help=argparse.SUPPRESS)
    p.add_argument("--tp", type=int, default=2, help=argparse.SUPPRESS)
    p.add_argument("--pp", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--src-tp", type=int, default=2, help=argparse.SUPPRESS)
    p.add_argument("--result", default=None, help=argparse.SUPPRESS)
    p.add_argument("--tag", default="s", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    out = run(args)
    for case, r in out["cases"].items():
        print(f"{case:8s} TP={r['tp_pp'][0]} PP={r['tp_pp'][1]}: load {r['load_s_median']:.3f}s "
              f"(rounds {', '.join(f'{x:.3f}' for x in r['load_s_rounds'])}); RSS peak above pre-load "
              f"{r['rss_peak_above_mb_max']:.0f} MB; read per rank {r['read_mb_per_rank_max']:.0f} MB; new shard {r['new_shard_mb']:.0f} MB, largest source tensor "
              f"{r['largest_source_tensor_mb']:.0f} MB")
    print(f"reshard / same-topology load time: {out['reshard_over_same']:.2f}x (target <= 1.3x)")
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
