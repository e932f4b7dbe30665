#!/usr/bin/env python3
"""Benchmark the offline tools against what the hardware allows.

1. Builds a ZeRO-1 optimizer state at DP=8 of ``--size-gb`` (xser, with manifest) on disk.
2. Runs ``nxd-ckpt convert-zero1`` to DP=2 in a subprocess, measuring wall time and peak RSS (psutil samples of
   the whole process tree, and getrusage(RUSAGE_CHILDREN).ru_maxrss).
3. Measures the disk: writing the same number of bytes in large blocks with fsync, and reading them back.
4. Exports a TP=4 checkpoint (column/row-parallel, strided and replicated tensors) and checks the safetensors
   bit-exact against the unsharded state.

Checks: peak RSS <= 2 x the largest parameter's full optimizer state + 300 MB; convert time <= 1.5 x
(read + write of the same bytes at disk speed). Prints a table and writes JSON (``--out``).

    python scripts/bench_tools.py --size-gb 2 --out bench_tools.json
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import psutil  # noqa: E402
import torch  # noqa: E402

import xser  # noqa: E402
from bench import Cache, limit_disk  # noqa: E402  (scripts/ is on sys.path when run as a script)
from nxd_ckpt import layout  # noqa: E402
from nxd_ckpt import manifest as manifest_mod  # noqa: E402
from nxd_ckpt.storage import LocalStorage  # noqa: E402

MB = 1 << 20
HIDDEN = 2048


def shard_of(full: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    rows = full.shape[0] if full.dim() else 1
    flat = full.reshape(rows, *full.shape[1:])
    per = math.ceil(rows / size)
    piece = flat[rank * per:(rank + 1) * per]
    if piece.shape[0] < per:
        piece = torch.cat([piece, piece.new_zeros((per - piece.shape[0], *flat.shape[1:]))])
    return piece.clone()


def param_shapes(size_bytes: int):
    """Parameter shapes whose Adam state (exp_avg, exp_avg_sq, fp32 master) totals about ``size_bytes``: one
    embedding of a quarter of it (rows not divisible by 8) and transformer-like layers for the rest."""
    n_total = size_bytes // 12
    shapes = [(n_total // 4 // HIDDEN + 3, HIDDEN)]
    left = n_total - shapes[0][0] * HIDDEN
    layer = [(3 * HIDDEN, HIDDEN), (3 * HIDDEN,), (HIDDEN, HIDDEN), (HIDDEN,), (HIDDEN,), (HIDDEN,)]
    per_layer = sum(math.prod(s) for s in layer)
    while left >= per_layer:
        shapes += layer
        left -= per_layer
    if left > HIDDEN:
        shapes.append((left // HIDDEN, HIDDEN))
    shapes.append(())
    return shapes


def build_zero1(root: str, tag: str, dp: int, shapes) -> dict:
    """Write a complete xser tag with a ZeRO-1 optimizer state at ``dp``; one parameter in memory at a time."""
    store = LocalStorage(root)
    store.makedirs(tag)
    store.write_file(f"{tag}/{layout.CHECKPOINT_MARKER}", lambda f: f.write(b"1"))
    holders = {}

    def h(key):
        return holders.setdefault(key, torch.zeros(1))

    n = len(shapes)
    template = {
        "state": {},
        "param_groups": [{"lr": 1e-4, "betas": (0.9, 0.999), "eps": 1e-8, "params": list(range(n))}],
        "base_state": {i: {"step": h((i, "step")), "exp_avg": h((i, "exp_avg")), "exp_avg_sq": h((i, "exp_avg_sq"))}
                       for i in range(n)},
        "shape_info": {i: torch.Size(s) for i, s in enumerate(shapes)},
        "sharded_master_weights": {i: h((i, "master")) for i in range(n)},
    }
    ref, ordered = xser.to_refs(template)
    key_of = {id(t): k for k, t in holders.items()}
    tid_of = {key_of[id(t)]: tid for tid, t in enumerate(ordered)}
    files, tensors, infos = {}, {}, {r: {} for r in range(dp)}
    rels = [f"optim/{layout.shard_filename(r, 0, 0)}" for r in range(dp)]
    g = torch.Generator().manual_seed(0)
    for i, shape in enumerate(shapes):
        for k in ("exp_avg", "exp_avg_sq", "master", "step"):
            full = torch.tensor(11.0) if k == "step" else torch.randn(shape, generator=g)
            for r in range(dp):
                t = full if k == "step" else shard_of(full, r, dp)
                tid = tid_of[(i, k)]
                rel = layout.tensor_path(rels[r], tid)
                files[rel] = store.write_file(f"{tag}/{rel}", lambda f, t=t: xser.write_tensor(t, f)).to_json()
                infos[r][tid] = {"dtype": t.dtype, "shape": t.shape, "expert_model_parallel": False}
                tensors.setdefault(rels[r], {})[str(tid)] = {"dtype": "float32", "shape": list(t.shape), "key": ""}
            del full
    for r, rel in enumerate(rels):
        files[layout.info_path(rel)] = store.write_file(f"{tag}/{layout.info_path(rel)}",
                                                        lambda f, r=r: torch.save(infos[r], f)).to_json()
        files[rel] = store.write_file(f"{tag}/{rel}", lambda f: xser.dump_refs(ref, f)).to_json()
    model_rel = f"model/{layout.shard_filename(0, 0, 0)}"
    mref, mts = xser.to_refs({"w": torch.randn(HIDDEN, 8, generator=g)})
    for tid, t in enumerate(mts):
        rel = layout.tensor_path(model_rel, tid)
        files[rel] = store.write_file(f"{tag}/{rel}", lambda f, t=t: xser.write_tensor(t, f)).to_json()
    files[model_rel] = store.write_file(f"{tag}/{model_rel}", lambda f: xser.dump_refs(mref, f)).to_json()
    for e in files.values():
        e["rank"] = 0
    topo = {"world_size": dp, "tp": 1, "pp": 1, "dp": dp, "cp": 1, "ep": 1}
    man = manifest_mod.build(tag, topo, {"zero1": True, "xser": True, "has_model": True, "has_optim": True},
                                files, tensors)
    body = man.body()
    store.write_file(f"{tag}/{layout.MANIFEST_FILE}", lambda f: f.write(body))
    store.write_file(f"{tag}/{layout.DONE_MARKER}", lambda f: f.write(b"1"))
    optim_bytes = sum(e["size"] for rel, e in files.items() if rel.startswith("optim/"))
    return {"optim_bytes": optim_bytes, "files": len(files)}


def _pss(proc) -> int:
    """Proportional set size (shared library pages split between the processes that map them), else RSS.
    Summing RSS over a worker pool would count torch's shared libraries once per worker."""
    try:
        return proc.memory_full_info().pss
    except (psutil.Error, AttributeError):
        return proc.memory_info().rss


def run_measured(cmd, env=None) -> dict:
    """Run ``cmd``; return wall time, peak memory of its process tree (psutil samples of the summed PSS, counted
    only once the child has exec'd so the forked copy of this process is not measured) and GNU time's maximum
    RSS (of the largest single process) when available."""
    timefile = tempfile.NamedTemporaryFile(prefix="nxd_bench_time_", delete=False)
    timefile.close()
    gnu_time = shutil.which("time") or ("/usr/bin/time" if os.path.exists("/usr/bin/time") else None)
    full_cmd = [gnu_time, "-f", "%M", "-o", timefile.name, *cmd] if gnu_time else list(cmd)
    t0 = time.perf_counter()
    proc = subprocess.Popen(full_cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    peak = [0]
    stop = threading.Event()

    def sample():
        try:
            p = psutil.Process(proc.pid)
        except psutil.NoSuchProcess:
            return
        while not stop.is_set():
            try:
                if p.cmdline()[-len(cmd):] != list(cmd):
                    time.sleep(0.002)  # not exec'd yet: this is a forked copy of the benchmark itself
                    continue
                total = sum(_pss(q) for q in [p] + p.children(recursive=True))
                peak[0] = max(peak[0], total)
            except psutil.Error:
                pass
            time.sleep(0.01)

    th = threading.Thread(target=sample, daemon=True)
    th.start()
    out, err = proc.communicate()
    wall = time.perf_counter() - t0
    stop.set()
    th.join()
    maxrss = None
    if gnu_time:
        try:
            maxrss = int(open(timefile.name).read().split()[-1]) * 1024
        except (OSError, ValueError, IndexError):
            maxrss = None
    os.unlink(timefile.name)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{err.decode()}")
    return {"wall_s": wall, "peak_rss_sampled": peak[0], "maxrss_time": maxrss, "stdout": out.decode()}


def disk_baseline(folder: str, nbytes: int) -> dict:
    """Seconds to write ``nbytes`` in large blocks with fsync, and to read them back cold (bench.py's probe)."""
    write_s, read_s = limit_disk(os.path.join(folder, "disk_probe.bin"), nbytes, Cache())
    return {"write_s": write_s, "read_s": read_s, "write_gbps": nbytes / write_s / 1e9, "read_gbps": nbytes / read_s / 1e9}


def build_tp4_model(root: str, tag: str, mb: int, tp: int = 4) -> dict:
    """A TP=4 model checkpoint whose full model is about ``mb`` MB; returns the full (unsharded) state."""
    g = torch.Generator().manual_seed(1)
    h = 1024
    per_layer = (3 * h * h + h * h + 8 * h * h) * 4  # qkv, o, gate_up (stride 2) fp32
    layers = max(1, mb * MB // per_layer)
    full, attrs = {}, {}
    for li in range(layers):
        p = f"layers.{li}."
        full[p + "qkv.weight"] = torch.randn(3 * h, h, generator=g)
        attrs[p + "qkv.weight"] = (0, 1)
        full[p + "o.weight"] = torch.randn(h, h, generator=g)
        attrs[p + "o.weight"] = (1, 1)
        full[p + "gate_up.weight"] = torch.randn(8 * h, h, generator=g).to(torch.bfloat16)
        attrs[p + "gate_up.weight"] = (0, 2)
        full[p + "norm.weight"] = torch.randn(h, generator=g)
    full["embed.weight"] = torch.randn(4000, h, generator=g)
    store = LocalStorage(root)
    store.makedirs(tag)
    store.write_file(f"{tag}/{layout.CHECKPOINT_MARKER}", lambda f: f.write(b"1"))
    files, tensors = {}, {}
    for r in range(tp):
        sd = {}
        for k, v in full.items():
            if k in attrs:
                dim, stride = attrs[k]
                blocks = torch.chunk(v, tp * stride, dim=dim)
                sd[k] = torch.cat([blocks[r + s * tp] for s in range(stride)], dim=dim).clone()
            else:
                sd[k] = v
        rel = f"model/{layout.shard_filename(0, r, 0)}"
        ref, ts = xser.to_refs(sd)
        keys = list(sd)
        info, meta = {}, {}
        for tid, t in enumerate(ts):
            trel = layout.tensor_path(rel, tid)
            files[trel] = store.write_file(f"{tag}/{trel}", lambda f, t=t: xser.write_tensor(t, f)).to_json()
            m = {"dtype": str(t.dtype).replace("torch.", ""), "shape": list(t.shape), "key": keys[tid]}
            info[tid] = {"dtype": t.dtype, "shape": t.shape, "expert_model_parallel": False}
            if keys[tid] in attrs:
                part = {"tensor_model_parallel": True, "partition_dim": attrs[keys[tid]][0],
                        "partition_stride": attrs[keys[tid]][1]}
                m.update(part)
                info[tid].update(part)
            meta[str(tid)] = m
        files[layout.info_path(rel)] = store.write_file(f"{tag}/{layout.info_path(rel)}",
                                                        lambda f, info=info: torch.save(info, f)).to_json()
        files[rel] = store.write_file(f"{tag}/{rel}", lambda f, ref=ref: xser.dump_refs(ref, f)).to_json()
        tensors[rel] = meta
    for e in files.values():
        e["rank"] = 0
    topo = {"world_size": tp, "tp": tp, "pp": 1, "dp": 1, "cp": 1, "ep": 1}
    man = manifest_mod.build(tag, topo, {"zero1": False, "xser": True, "has_model": True, "has_optim": False},
                                files, tensors)
    body = man.body()
    store.write_file(f"{tag}/{layout.MANIFEST_FILE}", lambda f: f.write(body))
    store.write_file(f"{tag}/{layout.DONE_MARKER}", lambda f: f.write(b"1"))
    return full


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-gb", type=float, default=2.0, help="optimizer state size (default 2)")
    ap.add_argument("--num-workers", default="1,2",
                    help="convert-zero1 --num_workers values to run, comma-separated; the first is checked against "
                         "the limits (default 1,2)")
    ap.add_argument("--export-mb", type=int, default=256, help="full model size of the export check (default 256)")
    ap.add_argument("--dir", help="work directory (default: a temporary directory, removed afterwards)")
    ap.add_argument("--out", default="bench_tools.json", help="JSON result file")
    ap.add_argument("--keep", action="store_true", help="keep the work directory")
    args = ap.parse_args(argv)
    work = args.dir or tempfile.mkdtemp(prefix="nxd_bench_tools_")
    os.makedirs(work, exist_ok=True)
    env = dict(os.environ, PJRT_DEVICE=os.environ.get("PJRT_DEVICE", "CPU"))
    workers = [int(w) for w in str(args.num_workers).split(",") if w.strip()]
    res = {"size_gb": args.size_gb, "num_workers": workers[0]}
    try:
        shapes = param_shapes(int(args.size_gb * 1e9))
        largest = max(math.prod(s) for s in shapes)
        t0 = time.perf_counter()
        built = build_zero1(work, "src", 8, shapes)
        res["build_s"] = time.perf_counter() - t0
        res["params"] = len(shapes)
        res["optim_bytes"] = built["optim_bytes"]
        res["largest_param_numel"] = largest
        res["largest_param_full_state_bytes"] = largest * 4 * 3
        # The disk is measured just before and just after the conversion (shared machines drift); the mean
        # is the reference.
        disk_before = disk_baseline(work, built["optim_bytes"])
        startup = run_measured([sys.executable, "-c", "import nxd_ckpt.cli, nxd_ckpt.zero1"], env)
        res["python_startup_s"] = startup["wall_s"]
        res["baseline_rss"] = max(startup["peak_rss_sampled"], startup["maxrss_time"] or 0)
        runs = []
        for w in workers:
            shutil.rmtree(os.path.join(work, "dp2"), ignore_errors=True)
            run = run_measured([sys.executable, "-m", "nxd_ckpt.cli", "convert-zero1", "--input_dir",
                                os.path.join(work, "src"), "--output_dir", os.path.join(work, "dp2"),
                                "--convert_to_sharded", "--dp_size", "2", "--num_workers", str(w), "--json"], env)
            run["num_workers"] = w
            run["internal_s"] = json.loads(run.pop("stdout"))["seconds"]
            runs.append(run)
        conv = runs[0]
        conv["stdout"] = json.dumps({"seconds": conv["internal_s"]})
        res["convert_runs"] = runs
        res["convert_s"] = conv["wall_s"]
        res["convert_internal_s"] = json.loads(conv["stdout"])["seconds"]
        res["convert_peak_rss_sampled"] = conv["peak_rss_sampled"]
        res["convert_maxrss_time"] = conv["maxrss_time"]
        out_bytes = sum(os.path.getsize(os.path.join(r, f)) for r, _d, fs in os.walk(os.path.join(work, "dp2", "optim"))
                        for f in fs)
        res["output_optim_bytes"] = out_bytes
        verify = run_measured([sys.executable, "-m", "nxd_ckpt.cli", "verify", os.path.join(work, "dp2")], env)
        res["verify_output_s"] = verify["wall_s"]
        disk_after = disk_baseline(work, built["optim_bytes"])
        disk = {k: (disk_before[k] + disk_after[k]) / 2 for k in disk_before}
        disk["before"], disk["after"] = disk_before, disk_after
        res["disk"] = disk
        res["disk_read_write_s"] = disk["read_s"] + disk["write_s"]
        res["rss_limit"] = 2 * res["largest_param_full_state_bytes"] + 300 * MB
        res["time_limit_s"] = 1.5 * res["disk_read_write_s"]
        peak = max(res["convert_peak_rss_sampled"], res["convert_maxrss_time"] or 0)
        res["rss_ok"] = peak <= res["rss_limit"]
        res["rss_over_baseline"] = peak - res["baseline_rss"]
        res["rss_over_baseline_ok"] = res["rss_over_baseline"] <= 2 * res["largest_param_full_state_bytes"]
        res["time_ok"] = res["convert_s"] <= res["time_limit_s"]
        res["time_ok_excluding_startup"] = res["convert_internal_s"] <= res["time_limit_s"]
        shutil.rmtree(os.path.join(work, "dp2"), ignore_errors=True)
        shutil.rmtree(os.path.join(work, "src"), ignore_errors=True)

        full = build_tp4_model(work, "tp4", args.export_mb)
        exp = run_measured([sys.executable, "-m", "nxd_ckpt.cli", "export", os.path.join(work, "tp4"), "--output",
                            os.path.join(work, "hf"), "--max-shard-size", "100MB"], env)
        from safetensors.torch import load_file

        index_path = os.path.join(work, "hf", "model.safetensors.index.json")
        if os.path.isfile(index_path):
            index = json.load(open(index_path))
        else:
            index = {"weight_map": {k: "model.safetensors" for k in load_file(os.path.join(work, "hf",
                                                                                          "model.safetensors"))}}
        exact = set(index["weight_map"]) == set(full)
        for name in sorted(set(index["weight_map"].values())):
            part = load_file(os.path.join(work, "hf", name))
            for k, v in part.items():
                w = full[k]
                exact = exact and v.dtype == w.dtype and v.shape == w.shape and torch.equal(
                    v.reshape(-1).view(torch.uint8), w.reshape(-1).view(torch.uint8))
        model_bytes = sum(v.numel() * v.element_size() for v in full.values())
        res["export"] = {"model_bytes": model_bytes, "tensors": len(full), "files": len(set(index["weight_map"].values())),
                         "wall_s": exp["wall_s"], "peak_rss_sampled": exp["peak_rss_sampled"],
                         "largest_tensor_bytes": max(v.numel() * v.element_size() for v in full.values()),
                         "bit_exact": bool(exact)}
    finally:
        if not args.keep and not args.dir:
            shutil.rmtree(work, ignore_errors=True)

    def gb(n):
        return f"{n / 1e9:.2f} GB"

    rows = [
        ("optimizer state (DP=8 -> DP=2)", gb(res["optim_bytes"]), ""),
        ("parameters / largest full state", f"{res['params']} / {gb(res['largest_param_full_state_bytes'])}", ""),
        ("disk write+fsync / read (GB/s)", f"{disk['write_gbps']:.2f} / {disk['read_gbps']:.2f}", ""),
        ("convert-zero1 wall time", f"{res['convert_s']:.2f} s (conversion itself {res['convert_internal_s']:.2f} s, "
                                    f"python+torch startup ~{res['python_startup_s']:.2f} s)",
         f"limit {res['time_limit_s']:.2f} s: {'OK' if res['time_ok'] else 'OVER'}"
         + ("" if res["time_ok"] else f" (conversion itself: {'OK' if res['time_ok_excluding_startup'] else 'OVER'})")),
        *[(f"  with --num_workers {r['num_workers']}", f"{r['wall_s']:.2f} s (conversion itself {r['internal_s']:.2f} s)",
           f"peak memory {gb(max(r['peak_rss_sampled'], r['maxrss_time'] or 0))}") for r in res["convert_runs"][1:]],
        ("convert-zero1 peak memory (tree PSS / max RSS)",
         f"{gb(res['convert_peak_rss_sampled'])} / {gb(res['convert_maxrss_time'] or 0)}",
         f"limit {gb(res['rss_limit'])}: {'OK' if res['rss_ok'] else 'OVER'}"),
        ("  baseline (python + torch import) / above it",
         f"{gb(res['baseline_rss'])} / {gb(res['rss_over_baseline'])}",
         f"2 x largest state {gb(2 * res['largest_param_full_state_bytes'])}: "
         f"{'OK' if res['rss_over_baseline_ok'] else 'OVER'}"),
        ("verify of the output", f"{res['verify_output_s']:.2f} s", ""),
        ("export TP=4 -> safetensors", f"{gb(res['export']['model_bytes'])} in {res['export']['wall_s']:.2f} s, "
                                       f"peak RSS {gb(res['export']['peak_rss_sampled'])}",
         "bit-exact" if res["export"]["bit_exact"] else "MISMATCH"),
    ]
    w0 = max(len(r[0]) for r in rows)
    w1 = max(len(r[1]) for r in rows)
    for a, b, c in rows:
        print(f"{a:<{w0}}  {b:<{w1}}  {c}")
    with open(args.out, "w") as f:
        json.dump(res, f, indent=2)
    print(f"wrote {args.out}")
    missed = [name for name, ok in (("convert time", res["time_ok"]), ("convert peak memory", res["rss_ok"]),
                                    ("export bit-exact", res["export"]["bit_exact"])) if not ok]
    if missed:
        print(f"targets missed: {', '.join(missed)}")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
