#!/usr/bin/env python3
"""A/B of load_checkpoint's tensor reads, side by side in one process (alternating, medians), on bench.py's state
saved once with nxd_ckpt (xser), loaded into a dict of XLA tensors with the page cache of its files dropped
(``posix_fadvise(DONTNEED)`` on them only) before every load:

- ``mapped``: what load_checkpoint does (files of 1 MiB and more moved to the device read with O_DIRECT into reused
  buffers where the storage reads direct, other files of 1 MiB and more memory-mapped: ``FileReader.mapped``);
- ``buffered``: every file read into a fresh host buffer (``read_buffer``);
- ``torch_refs``: as ``mapped``, the ref pickles unpickled by torch's safe loader instead of the restricted C
  unpickler (``xser.pickling.load_plain_refs``, what load_checkpoint did before).
- ``no_frames``: as ``mapped``, every small tensor file's zip directory parsed (``xser.tensorfile``'s frames
  off, what load_checkpoint did before);
- ``eof_probe``: as ``mapped``, one more read per file that only confirms the end of the file (``Storage.read_into``
  without ``expect``, what load_checkpoint did before);
- ``old_read``: both of the above;
- ``one_thread``: as ``mapped``, torch's intra-op threads set to 1 for the whole load (``torch.set_num_threads``);
- ``omp_threads``: as ``mapped``, torch's intra-op threads left as they are during the read pipelines
  (``reader.PIPELINE_INTRAOP_THREADS = None``, what load_checkpoint did before);
- ``before_all``: ``old_read``, ``omp_threads``, ``no_groups`` and ``no_tail_flush`` together (this session's load
  levers off);
- ``group<KiB>`` (e.g. ``group4096``): as ``mapped``, small files in groups of that many KiB (``reader.GROUP_BYTES``);
- ``batch<KiB>`` (e.g. ``batch1``): as ``mapped``, host-to-device batches of that many KiB (``reader.PLACE_BATCH_BYTES``;
  ``batch1``: one transfer per tensor);
- ``workers<N>`` (e.g. ``workers2``): as ``mapped``, with ``num_workers=N`` instead of NxD's default 8;
- ``switch<us>`` (e.g. ``switch500``): as ``mapped``, the GIL's switch interval set to that many microseconds;
- ``no_groups``: as ``mapped``, one pool task per tensor file (``reader.GROUP_BYTES = 0``, what load_checkpoint
  did before);
- ``no_tail_flush``: as ``mapped``, the pipeline's last batch moved to the device after the last read
  (``reader.TAIL_FLUSH = False``, what load_checkpoint did before);
- ``no_prefetch``: as ``mapped``, groups of small files not prefetched as they are handed out
  (``reader.PREFETCH_GROUPS = False``, what load_checkpoint did before);
- ``no_direct_reads``: as ``mapped``, the large files moved to the device read through the page cache (memory-mapped)
  instead of with O_DIRECT into reused buffers (``storage.local.DIRECT_READS = False``, what load_checkpoint did
  before);
- ``written_buffered``: as ``mapped``, a second save of the same state written through the page cache
  (``storage.local.DIRECT_WRITES = False``): whether the files' layout on disk from ``O_DIRECT`` writes
  changes the load.

    python scripts/ab_load.py --size-gb 1 --tensors 300 --rounds 4 --dir /tmp/ab_load --out bench_out/ab_load.json
"""
from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import bench  # noqa: E402


def main() -> int:
    p = bench.ab_parser(__doc__, dir="/tmp/nxd_ckpt_ab_load", rounds=4)
    p.add_argument("--variants", default="mapped,buffered")
    args = p.parse_args()
    import torch

    import nxd_ckpt
    import nxd_ckpt.api as api
    from nxd_ckpt import reader
    from nxd_ckpt.storage import local
    import xser.api as xser_api
    from nxd_ckpt.storage import base as storage_base
    from xser import tensorfile

    variants = tuple(args.variants.split(","))
    dev = bench.device()
    model, optim, _ = bench.build_state(int(args.size_gb * 1e9), args.tensors, dev, args.state)
    bench.remove_tree(args.dir)
    nxd_ckpt.save_checkpoint(args.dir, "t", model=model, optimizer=optim, use_xser=True)
    if "written_buffered" in variants:
        local.DIRECT_WRITES = False
        nxd_ckpt.save_checkpoint(args.dir, "tb", model=model, optimizer=optim, use_xser=True, num_kept_ckpts=2)
        local.DIRECT_WRITES = True
    nxd_ckpt.release_host_buffers()
    nbytes = bench.nbytes({"model": model, "optimizer": optim} if optim is not None else model)
    cache = bench.Cache()
    cache.mode = "posix_fadvise_dontneed"        # this run's files only: the machine is shared
    mapped_default = api.copies_every_tensor
    plain_refs = xser_api.load_plain_refs
    intraop, group_bytes, tail_flush = reader.PIPELINE_INTRAOP_THREADS, reader.GROUP_BYTES, reader.TAIL_FLUSH
    prefetch, place_batch = reader.PREFETCH_GROUPS, reader.PLACE_BATCH_BYTES
    directory, read_into = tensorfile._directory, storage_base.Storage.read_into

    def probing_read_into(self, relpath, view, offset=0, on_range=None, expect=None):
        return read_into(self, relpath, view, offset, on_range)

    def one(variant: str, _round: int) -> dict:
        api.copies_every_tensor = mapped_default if variant != "buffered" else (lambda m, o: False)
        reader.PIPELINE_INTRAOP_THREADS = None if variant in ("omp_threads", "before_all") else intraop
        reader.GROUP_BYTES = 0 if variant in ("no_groups", "before_all") else group_bytes
        reader.TAIL_FLUSH = tail_flush and variant not in ("no_tail_flush", "before_all")
        reader.PREFETCH_GROUPS = prefetch and variant != "no_prefetch"
        local.DIRECT_READS = variant != "no_direct_reads"
        if variant.startswith("group"):
            reader.GROUP_BYTES = int(variant[len("group"):]) << 10
        reader.PLACE_BATCH_BYTES = int(variant[len("batch"):]) << 10 if variant.startswith("batch") else place_batch
        xser_api.load_plain_refs = plain_refs if variant != "torch_refs" else (lambda data: (False, None))
        tensorfile._directory = (lambda view: None) if variant in ("no_frames", "old_read", "before_all") else directory
        storage_base.Storage.read_into = probing_read_into if variant in ("eof_probe", "old_read", "before_all") else read_into
        target = {k: v for k, v in model.items()}
        opt = bench.replace_tensors(optim, iter(bench.tensors_of(optim))) if optim is not None else None
        bench.trim_heap()
        cache.drop(args.dir)
        faults = bench.minor_faults()
        threads = torch.get_num_threads()
        c0, t0 = bench.cpu_time(), time.perf_counter()
        if variant == "one_thread":
            torch.set_num_threads(1)
        switch = sys.getswitchinterval()
        if variant.startswith("switch"):       # e.g. switch500: the GIL's switch interval 500 us during the load
            sys.setswitchinterval(int(variant[len("switch"):]) * 1e-6)
        workers = int(variant[len("workers"):]) if variant.startswith("workers") else 8
        tag = "tb" if variant == "written_buffered" else "t"
        nxd_ckpt.load_checkpoint(args.dir, tag, model=target, optimizer=opt, num_workers=workers)
        bench.wait_device()
        torch.set_num_threads(threads)
        sys.setswitchinterval(switch)
        wall, cpu = time.perf_counter() - t0, bench.cpu_time() - c0
        faults = bench.minor_faults() - faults
        return {"load_s": wall, "load_cpu_s_per_gb": cpu / (nbytes / 1e9), "page_faults_mb": faults * 4096 / 2 ** 20}

    res, loads = bench.alternate(variants, one, args.rounds)
    api.copies_every_tensor = mapped_default
    xser_api.load_plain_refs = plain_refs
    tensorfile._directory, storage_base.Storage.read_into = directory, read_into
    reader.PIPELINE_INTRAOP_THREADS, reader.GROUP_BYTES, reader.TAIL_FLUSH = intraop, group_bytes, tail_flush
    reader.PREFETCH_GROUPS, reader.PLACE_BATCH_BYTES = prefetch, place_batch
    local.DIRECT_READS = True
    bench.remove_tree(args.dir)
    out = {"bytes": nbytes, "tensors": args.tensors, "state": args.state, "rounds": args.rounds, "load1": loads,
           "median": bench.medians(res), "runs": res}
    bench.print_json(out, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
