#!/usr/bin/env python3
"""A/B of the S3 load of one plain (non-xser) shard, side by side in one process (alternating, medians), on
bench.py's state saved once with nxd_ckpt (use_xser=False), loaded into a dict of XLA tensors:

- ``pipelined``: records checked and tensors sent to the device as the ranged GETs land (``read_plain_pipelined``);
- ``whole``: the whole file downloaded into one buffer, checked, unpickled in place, then sent (what it was);
- ``pipelined-late`` (``--variants``): records checked and tensors built as the ranges land, all sent after the
  download (the pipeline's own cost, without the overlap of the transfer).

Each round also times one host-to-device transfer of the state's host copy (``h2d_s``), for the saving per GB
of host-to-device work. The endpoint and credentials come from the AWS environment (``AWS_ENDPOINT_URL``).

    python scripts/ab_s3load.py --dir s3://bench/ab --size-gb 0.25 --tensors 100 --rounds 6 --out bench_out/x.json
"""
from __future__ import annotations

import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import bench  # noqa: E402


def main() -> int:
    p = bench.ab_parser(__doc__, dir=None, rounds=6, size_gb=0.25, tensors=100, state=False)
    p.add_argument("--variants", default="pipelined,whole")
    args = p.parse_args()
    import torch_xla.core.xla_model as xm

    import nxd_ckpt
    from nxd_ckpt import reader

    dev = bench.device()
    model, _, _ = bench.build_state(int(args.size_gb * 1e9), args.tensors, dev, "fp32")
    nxd_ckpt.save_checkpoint(args.dir, "t", model=model, use_xser=False)
    nxd_ckpt.release_host_buffers()
    nbytes = bench.nbytes(model)
    host = {k: v.cpu() for k, v in model.items()}
    default, batch = reader.PIPELINE_PLAIN_SHARDS, reader.PLACE_BATCH_BYTES

    def one(variant: str, _round: int) -> dict:
        reader.PIPELINE_PLAIN_SHARDS = variant.startswith("pipelined")
        reader.PLACE_BATCH_BYTES = 1 << 62 if variant == "pipelined-late" else batch
        t0 = time.perf_counter()
        xm.send_cpu_data_to_device(list(host.values()), dev)
        bench.wait_device()
        h2d = time.perf_counter() - t0
        target = dict(model)
        bench.trim_heap()
        c0, t0 = bench.cpu_time(), time.perf_counter()
        nxd_ckpt.load_checkpoint(args.dir, "t", model=target)
        bench.wait_device()
        wall, cpu = time.perf_counter() - t0, bench.cpu_time() - c0
        return {"load_s": wall, "load_cpu_s": cpu, "h2d_s": h2d}

    res, loads = bench.alternate(tuple(args.variants.split(",")), one, args.rounds)
    reader.PIPELINE_PLAIN_SHARDS, reader.PLACE_BATCH_BYTES = default, batch
    med = bench.medians(res)
    saved = med["whole"]["load_s"] - med["pipelined"]["load_s"] if {"whole", "pipelined"} <= set(med) else None
    out = {"bytes": nbytes, "tensors": args.tensors, "rounds": args.rounds, "load1": loads, "median": med,
           "runs": res, "saved_s": saved, "saved_s_per_gb": None if saved is None else saved / (nbytes / 1e9),
           "h2d_s_per_gb": statistics.median([r["h2d_s"] for v in res.values() for r in v]) / (nbytes / 1e9)}
    bench.print_json(out, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
