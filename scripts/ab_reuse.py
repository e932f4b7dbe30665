#!/usr/bin/env python3
"""A/B of "reuse the retired tag's files" (nxd_ckpt.reuse) in a training job's steady state: consecutive async
saves of bench.py's state with ``num_kept_ckpts=2`` into two folders of one process, interleaved (reuse, delete,
delete, reuse, ...), so both see the same filesystem at the same time. Prints one JSON line per variant: medians
over the saves from the fourth on (the first whose retention had retired a tag before it), process CPU per GB,
time from the call until finalize_checkpoint returned (retention included), commit.

    python scripts/ab_reuse.py --size-gb 0.5 --tensors 5000 --saves 8 --dir /tmp/ab_reuse

``--drop-cache`` drops both folders' pages before each save (bench.py's Cache), as if the retired files had left
the page cache since their save; by default they stay, as on a host whose memory holds them between saves.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import uuid

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench  # noqa: E402

STEADY_FROM = 3     # saves 0-2 have no retired tag to take over (num_kept_ckpts=2)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size-gb", type=float, default=0.5)
    p.add_argument("--tensors", type=int, default=5000)
    p.add_argument("--state", choices=("fp32", "bf16-adam"), default="fp32")
    p.add_argument("--saves", type=int, default=8, help=f"saves per variant; medians from save {STEADY_FROM} on")
    p.add_argument("--drop-cache", action="store_true")
    p.add_argument("--dir", default="/tmp/nxd_ckpt_ab_reuse")
    args = p.parse_args(argv)
    if args.saves <= STEADY_FROM:
        p.error(f"--saves must be more than {STEADY_FROM}")
    import nxd_ckpt

    model, optim, _ = bench.build_state(int(args.size_gb * 1e9), args.tensors, bench.device(), args.state)
    kw = {"model": model, **({"optimizer": optim} if optim is not None else {})}
    gb = bench.nbytes({"model": model, "optimizer": optim} if optim is not None else model) / 1e9
    base = os.path.join(args.dir, uuid.uuid4().hex)
    cache, runs = bench.Cache(), {True: [], False: []}
    for i in range(args.saves):
        for reuse in (True, False) if i % 2 == 0 else (False, True):
            root = os.path.join(base, "reuse" if reuse else "delete")
            if args.drop_cache:
                cache.drop(root)
            c, t = bench.cpu_time(), time.perf_counter()
            nxd_ckpt.save_checkpoint(root, f"t{i}", async_save=True, use_xser=True, num_kept_ckpts=2,
                                     reuse_retired_files=reuse, **kw)
            nxd_ckpt.finalize_checkpoint()
            st = nxd_ckpt.save_stats()[-1]
            runs[reuse].append({"cpu_s_per_gb": (bench.cpu_time() - c) / gb, "finalized_s": time.perf_counter() - t,
                                "commit_s": st["commit_s"]})
    for reuse in (True, False):
        steady = runs[reuse][STEADY_FROM:]
        print(json.dumps({"reuse_retired_files": reuse, "size_gb": args.size_gb, "tensors": args.tensors,
                          "state": args.state, "drop_cache": args.drop_cache, "saves": len(steady),
                          **{k: round(statistics.median(r[k] for r in steady), 3)
                             for k in ("cpu_s_per_gb", "finalized_s", "commit_s")},
                          "cpu_s_per_gb_each": [round(r["cpu_s_per_gb"], 2) for r in runs[reuse]]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
