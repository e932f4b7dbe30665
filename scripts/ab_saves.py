#!/usr/bin/env python3
"""Back-to-back async saves of bench.py's state, as a training job makes them: no heap trim or forced garbage
collection between saves (bench.py and ab_commit.py trim before each, which resets the collector's count and hides
the full collections a save sets off). Prints one JSON line: medians over the saves after the first, and the full
garbage collections during them.

To compare two versions of the library, run it alternately from two checkouts (``--code``), e.g.

    for i in 1 2 3; do for c in /tmp/before /work/main; do python scripts/ab_saves.py --code $c; done; done

which is how README "Levers measured" measured "fewer GC-tracked objects per save"
(bench_out/ab_gc_pressure_*.json). Every save goes into a folder of its own under ``--dir``; nothing is removed
(a mass deletion right before a save slows file creation on this VM's ext4: README "Levers measured").
``--num-kept N`` saves into one folder with ``num_kept_ckpts=N`` instead, as a training job does (retention
after every save: "reuse the retired tag's files"); ``--no-reuse`` passes ``reuse_retired_files=False`` (the same
checkout, both ways); ``--device-snapshot`` saves with ``device_snapshot=True``.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
import uuid


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--code", default=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                   help="the checkout whose nxd_ckpt and scripts/bench.py to use (default: this one)")
    p.add_argument("--size-gb", type=float, default=0.5)
    p.add_argument("--tensors", type=int, default=5000)
    p.add_argument("--state", choices=("fp32", "bf16-adam"), default="fp32")
    p.add_argument("--saves", type=int, default=6, help="saves in a row (the first --skip not counted)")
    p.add_argument("--dir", default="/tmp/nxd_ckpt_ab_saves")
    p.add_argument("--num-kept", type=int, default=None,
                   help="save into one folder with this num_kept_ckpts (default: a folder per save, no retention)")
    p.add_argument("--no-reuse", action="store_true", help="reuse_retired_files=False")
    p.add_argument("--device-snapshot", action="store_true", help="device_snapshot=True")
    p.add_argument("--keep-cache", action="store_true",
                   help="leave the folder's pages in the page cache between saves (default: dropped before each)")
    p.add_argument("--skip", type=int, default=1, help="saves not counted at the start (with --num-kept 2: 3, the "
                   "first whose retention had retired a tag before it)")
    args = p.parse_args(argv)
    if args.saves <= args.skip:
        p.error("--saves must be more than --skip (the saves not counted)")
    code = os.path.abspath(args.code)
    sys.path[:0] = [os.path.join(code, "scripts"), code]
    import bench
    import nxd_ckpt

    if not os.path.abspath(nxd_ckpt.__file__).startswith(code + os.sep):
        p.error(f"nxd_ckpt was imported from {nxd_ckpt.__file__}, not from --code {code}")
    model, optim, _ = bench.build_state(int(args.size_gb * 1e9), args.tensors, bench.device(), args.state)
    kw = {"model": model, **({"optimizer": optim} if optim is not None else {})}
    if args.no_reuse:
        kw["reuse_retired_files"] = False
    if args.device_snapshot:
        kw["device_snapshot"] = True
    gb = bench.nbytes({"model": model, "optimizer": optim} if optim is not None else model) / 1e9
    full = [0]          # counted here, not by bench.py's counter: an older checkout's bench.py has none

    def count(phase: str, info: dict) -> None:
        full[0] += phase == "start" and info["generation"] == 2

    gc.callbacks.append(count)
    cache, root, runs = bench.Cache(), os.path.join(args.dir, uuid.uuid4().hex), []
    for i in range(args.saves):
        if not args.keep_cache:
            cache.drop(root)
        g, c, t = full[0], bench.cpu_time(), time.perf_counter()
        if args.num_kept is None:
            nxd_ckpt.save_checkpoint(f"{root}/{i}", f"t{i}", async_save=True, use_xser=True, **kw)
        else:
            nxd_ckpt.save_checkpoint(root, f"t{i}", async_save=True, use_xser=True, num_kept_ckpts=args.num_kept, **kw)
        nxd_ckpt.finalize_checkpoint()
        st = nxd_ckpt.save_stats()[-1]
        runs.append({"cpu_s_per_gb": (bench.cpu_time() - c) / gb, "full_collections": full[0] - g,
                     "finalized_s": time.perf_counter() - t,
                     "commit_s": st["commit_s"], "stall_s": st["stall_s"]})
    counted = runs[args.skip:]
    print(json.dumps({"code": code, "saves": len(counted), "num_kept": args.num_kept, "reuse": not args.no_reuse,
                      "tensors": args.tensors, "state": args.state, "cache": "kept" if args.keep_cache else "dropped",
                      "device_snapshot": args.device_snapshot,
                      "cpu": round(statistics.median(r["cpu_s_per_gb"] for r in counted), 3),
                      "full_gcs": sum(r["full_collections"] for r in counted),
                      "commit": round(statistics.median(r["commit_s"] for r in counted), 3),
                      "stall": round(statistics.median(r["stall_s"] for r in counted), 3),
                      "finalized": round(statistics.median(r["finalized_s"] for r in counted), 3),
                      "cpus": [round(r["cpu_s_per_gb"], 2) for r in counted]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
