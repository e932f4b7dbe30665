#!/usr/bin/env python3
"""Benchmark `nxd-ckpt to-dcp` against what the disk allows (issue 15).

1. Builds a TP=2 x DP=4 ZeRO-1 tag of about ``--size-gb`` (fp32 model, master weights and both Adam moments,
   Llama-like shapes with a large embedding) with nxd-ckpt's own tag writer.
2. Runs ``nxd-ckpt to-dcp`` in a subprocess ``--repeat`` times, measuring wall time and peak memory of the
   process (PSS samples and GNU time's maximum RSS; bench_tools.run_measured): medians of the times, the
   largest peak; the load average at the end is recorded (the machine may be shared).
3. Measures the disk: writing the DCP's byte count with fsync and reading the tag's byte count back cold.

Checks: time <= 1.5 x (read of the tag + write of the DCP at disk speed); peak RSS <= 2 x the largest tensor
+ 300 MB. Prints a table and writes JSON (``--out``).

    python scripts/bench_dcp.py --size-gb 2 --out bench_dcp.json
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import torch  # noqa: E402

from bench_tools import disk_baseline, run_measured  # noqa: E402
from nxd_ckpt.fullstate import FullState, OptimState, ParamState, TensorSource  # noqa: E402
from nxd_ckpt.partition import Partition  # noqa: E402
from nxd_ckpt.tagwrite import TagSizes, write_tag  # noqa: E402

MB = 1 << 20
HIDDEN = 2048


def llama_shapes(size_bytes: int):
    """(name, shape, partition) of a Llama-like model whose fp32 weights + master + 2 moments total about
    ``size_bytes``: an embedding and LM head of a quarter each, decoder layers for the rest."""
    n_total = size_bytes // 16
    vocab = n_total // 4 // HIDDEN
    out = [("model.embed_tokens.weight", (vocab, HIDDEN), Partition(0))]
    layer = [("input_layernorm.weight", (HIDDEN,), None), ("self_attn.q_proj.weight", (HIDDEN, HIDDEN), Partition(0)),
             ("self_attn.k_proj.weight", (HIDDEN, HIDDEN), Partition(0)),
             ("self_attn.v_proj.weight", (HIDDEN, HIDDEN), Partition(0)),
             ("self_attn.o_proj.weight", (HIDDEN, HIDDEN), Partition(1)),
             ("post_attention_layernorm.weight", (HIDDEN,), None),
             ("mlp.gate_proj.weight", (2 * HIDDEN, HIDDEN), Partition(0)),
             ("mlp.up_proj.weight", (2 * HIDDEN, HIDDEN), Partition(0)),
             ("mlp.down_proj.weight", (HIDDEN, 2 * HIDDEN), Partition(1))]
    per_layer = sum(math.prod(s) for _n, s, _p in layer)
    left = n_total - 2 * vocab * HIDDEN
    i = 0
    while left >= per_layer:
        out += [(f"model.layers.{i}.{n}", s, p) for n, s, p in layer]
        left -= per_layer
        i += 1
    out += [("model.norm.weight", (HIDDEN,), None), ("lm_head.weight", (vocab, HIDDEN), Partition(0))]
    return out


def synthetic_state(size_bytes: int) -> FullState:
    """A FullState whose tensors are generated when loaded (seeded per tensor)."""
    def src(name, shape, part, seed):
        def load():
            g = torch.Generator().manual_seed(seed)
            return torch.randn(shape, generator=g)
        return TensorSource(name, tuple(shape), torch.float32, part, load)

    model, params = [], {}
    for k, (name, shape, part) in enumerate(llama_shapes(size_bytes)):
        model.append(src(name, shape, part, 4 * k))
        params[name] = ParamState({"exp_avg": src(f"{name} exp_avg", shape, part, 4 * k + 1),
                                   "exp_avg_sq": src(f"{name} exp_avg_sq", shape, part, 4 * k + 2)},
                                  torch.tensor(100.0), src(name, shape, part, 4 * k + 3))
    hyper = {"lr": 1e-4, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
    return FullState(model, OptimState(params, [(hyper, list(params))]), {"last_epoch": 100}, {"step": 100})


def tree_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(r, f)) for r, _d, fs in os.walk(path) for f in fs)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-gb", type=float, default=2.0, help="state size: model + master + 2 moments (default 2)")
    ap.add_argument("--dir", help="work directory (default: a temporary directory, removed afterwards)")
    ap.add_argument("--out", default="bench_dcp.json", help="JSON result file")
    ap.add_argument("--repeat", type=int, default=1, help="to-dcp runs on the same tag: times are their medians, "
                                                          "memory their maximum (default 1)")
    args = ap.parse_args(argv)
    if args.repeat < 1:
        ap.error(f"--repeat {args.repeat}: pass 1 or more")
    work = args.dir or tempfile.mkdtemp(prefix="nxd_bench_dcp_")
    os.makedirs(work, exist_ok=True)
    env = dict(os.environ, PJRT_DEVICE=os.environ.get("PJRT_DEVICE", "CPU"))
    res = {"size_gb": args.size_gb}
    try:
        state = synthetic_state(int(args.size_gb * 1e9))
        res["tensors"] = len(state.model)
        res["largest_tensor_bytes"] = state.largest()
        t0 = time.perf_counter()
        src, dst = os.path.join(work, "tag"), os.path.join(work, "dcp")
        write_tag(state, src, TagSizes(2, 1, 4, True), converted_from={"path": "synthetic"}, progress=False)
        res["build_s"] = time.perf_counter() - t0
        res["tag_bytes"] = tree_bytes(src)
        shutil.rmtree(dst, ignore_errors=True)   # a previous run's output in --dir
        startup = run_measured([sys.executable, "-c", "import nxd_ckpt.cli, nxd_ckpt.convert, nxd_ckpt.dcpio, "
                                                      "torch.distributed.checkpoint"], env)
        res["python_startup_s"] = startup["wall_s"]
        res["baseline_rss"] = max(startup["peak_rss_sampled"], startup["maxrss_time"] or 0)
        runs = []
        for _ in range(args.repeat):
            shutil.rmtree(dst, ignore_errors=True)
            runs.append(run_measured([sys.executable, "-m", "nxd_ckpt.cli", "to-dcp", src, dst, "--json"], env))
        res["to_dcp_runs_s"] = [r["wall_s"] for r in runs]
        res["to_dcp_internal_runs_s"] = [json.loads(r["stdout"])["seconds"] for r in runs]
        res["to_dcp_s"] = statistics.median(res["to_dcp_runs_s"])
        res["to_dcp_internal_s"] = statistics.median(res["to_dcp_internal_runs_s"])
        res["peak_rss"] = max(max(r["peak_rss_sampled"], r["maxrss_time"] or 0) for r in runs)
        res["dcp_bytes"] = tree_bytes(dst)
        shutil.rmtree(dst, ignore_errors=True)
        res["load_average"] = os.getloadavg()
        probe = disk_baseline(work, max(res["tag_bytes"], res["dcp_bytes"]))
        n = max(res["tag_bytes"], res["dcp_bytes"])
        res["disk"] = probe
        res["disk_read_write_s"] = probe["read_s"] * res["tag_bytes"] / n + probe["write_s"] * res["dcp_bytes"] / n
        res["time_limit_s"] = 1.5 * res["disk_read_write_s"]
        res["rss_limit"] = 2 * res["largest_tensor_bytes"] + 300 * MB
        res["time_ok"] = res["to_dcp_s"] <= res["time_limit_s"]
        res["time_ok_excluding_startup"] = res["to_dcp_internal_s"] <= res["time_limit_s"]
        res["rss_ok"] = res["peak_rss"] <= res["rss_limit"]
        res["rss_over_baseline"] = res["peak_rss"] - res["baseline_rss"]
    finally:
        if not args.dir:
            shutil.rmtree(work, ignore_errors=True)

    def gb(x):
        return f"{x / 1e9:.2f} GB"

    rows = [("tag TP=2 x DP=4 ZeRO-1 (model, master, moments)", gb(res["tag_bytes"]), f"{res['tensors']} parameters"),
            ("DCP written (model, moments)", gb(res["dcp_bytes"]), f"largest tensor {gb(res['largest_tensor_bytes'])}"),
            ("disk write+fsync / cold read (GB/s)", f"{res['disk']['write_gbps']:.2f} / {res['disk']['read_gbps']:.2f}", ""),
            ("load average at the end (1/5/15 min)", " / ".join(f"{x:.1f}" for x in res["load_average"]),
             f"{args.repeat} to-dcp run(s): median times"),
            ("to-dcp wall time", f"{res['to_dcp_s']:.2f} s (conversion itself {res['to_dcp_internal_s']:.2f} s, "
                                 f"startup ~{res['python_startup_s']:.2f} s)",
             f"limit {res['time_limit_s']:.2f} s: {'OK' if res['time_ok'] else 'OVER'}"),
            ("to-dcp peak memory", f"{gb(res['peak_rss'])} ({gb(res['rss_over_baseline'])} above python+torch "
                                   f"{gb(res['baseline_rss'])})",
             f"limit {gb(res['rss_limit'])}: {'OK' if res['rss_ok'] else 'OVER'}")]
    w0, w1 = max(len(r[0]) for r in rows), max(len(r[1]) for r in rows)
    for a, b, c in rows:
        print(f"{a:<{w0}}  {b:<{w1}}  {c}")
    with open(args.out, "w") as f:
        json.dump(res, f, indent=2)
    print(f"wrote {args.out}")
    missed = [k for k in ("time_ok", "rss_ok") if not res[k]]
    if missed:
        print(f"targets missed: {', '.join(missed)}")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
