#!/usr/bin/env python3
"""A/B of the async save's snapshot, side by side in one process (alternating, medians), on bench.py's state:

- ``old``: the batched ``_xla_get_cpu_tensors`` transfer into fresh memory (the snapshot before the pool);
- ``pool_copy_``: the pool's kept buffers, filled by DLPack + torch's ``copy_``;
- ``new``: the pool's kept buffers, filled by DLPack + one ``memmove`` per tensor (what nxd_ckpt does).

The pool persists across the variants (``old`` never touches it), so ``pool_*`` measure the steady state of a
training run's repeated saves.

    python scripts/ab_snapshot.py --size-gb 1 --tensors 300 --rounds 4 --dir /tmp/ab --out bench_out/ab.json

``--lever`` A/Bs one save-path lever instead (``before`` against ``after``, the snapshot as nxd_ckpt does it):
``write_batch`` (one writer-pool task per file against batches of small files), ``manifest_json`` (the
manifest indented against compact), ``ref_pickle`` (the ref file by the pure-Python pickler against the C
pickler) or ``smallfiles_all`` (the three together).
"""
from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import bench  # noqa: E402
import torch  # noqa: E402

VARIANTS = ("old", "pool_copy_", "new")
LEVERS = ("write_batch", "manifest_json", "ref_pickle", "smallfiles_all")


def _set_lever(lever: str, variant: str) -> None:
    import json as _json

    from nxd_ckpt import manifest, writepool

    import xser.pickling as pickling

    after = variant == "after"
    if lever in ("write_batch", "smallfiles_all"):
        writepool.BATCH_FILES = 32 if after else 1
    if lever in ("manifest_json", "smallfiles_all"):
        manifest.Manifest.body = (_BODY if after else
                                  (lambda self: _json.dumps(self.to_json(), indent=1).encode()))
    if lever in ("ref_pickle", "smallfiles_all"):
        pickling.REF_PICKLE.Pickler = pickling._FastRefPickler if after else pickling._RefPickler


_BODY = None


def _old_copy(tensors, pool=None):
    from nxd_ckpt import staging

    out = [None] * len(tensors)
    xla = [i for i, t in enumerate(tensors) if t.device.type == "xla"]
    for i, host in zip(xla, staging._xla_to_cpu([tensors[i] for i in xla])):
        out[i] = host
    return [h if h is not None else t.detach().clone() for h, t in zip(out, tensors)]


def _torch_copy_into(src, pool):
    dst = pool.empty_like(src) if pool is not None else torch.empty(src.shape, dtype=src.dtype)
    dst.copy_(src)
    return dst


def main() -> int:
    p = bench.ab_parser(__doc__, dir="/tmp/nxd_ckpt_ab", rounds=4)
    p.add_argument("--lever", choices=LEVERS)
    args = p.parse_args()
    global _BODY
    from nxd_ckpt import manifest
    _BODY = manifest.Manifest.body
    variants = ("before", "after") if args.lever else VARIANTS
    import nxd_ckpt
    import nxd_ckpt.engine as engine
    import nxd_ckpt.staging as staging

    model, optim, _ = bench.build_state(int(args.size_gb * 1e9), args.tensors, bench.device(), args.state)
    kw = {"model": model, "use_xser": True, **({"optimizer": optim} if optim is not None else {})}
    nbytes = bench.nbytes({"model": model, "optimizer": optim} if optim is not None else model)
    new_copy, memmove_into = staging.copy_to_host, staging._copy_into

    def one(variant: str, i: int) -> dict:
        root = bench.ab_save_dir(args, variant, i)
        if args.lever:
            _set_lever(args.lever, variant)
            variant = "new"
        engine.copy_to_host = _old_copy if variant == "old" else new_copy
        staging._copy_into = _torch_copy_into if variant == "pool_copy_" else memmove_into
        bench.trim_heap()
        faults = bench.minor_faults()
        c0, t0 = bench.cpu_time(), time.perf_counter()
        nxd_ckpt.save_checkpoint(root, f"t{i}", async_save=True, **kw)
        stall, c_stall = time.perf_counter() - t0, bench.cpu_time() - c0
        faults = bench.minor_faults() - faults
        nxd_ckpt.finalize_checkpoint()
        gb = nbytes / 1e9
        return {"stall_s": stall, "commit_s": nxd_ckpt.save_stats()[-1]["commit_s"], "cpu_s_per_gb": (bench.cpu_time() - c0) / gb,
                "stall_cpu_s_per_gb": c_stall / gb, "stall_faults_mb": faults * 4096 / 2 ** 20}

    bench.remove_tree(args.dir)
    res, loads = bench.alternate(variants, one, args.rounds)
    bench.remove_tree(args.dir)
    out = {"lever": args.lever, "bytes": nbytes, "tensors": args.tensors, "state": args.state, "rounds": args.rounds, "load1": loads,
           "median": bench.medians(res),
           "cpu_s_per_gb_rounds": {v: [round(x["cpu_s_per_gb"], 3) for x in res[v]] for v in res},
           "pool_held_mb": engine.get_engine().buffers.held_bytes / 2 ** 20}
    bench.print_json(out, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
