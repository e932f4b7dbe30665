#!/usr/bin/env python3
"""A/B of one commit-path lever of the async save (issue 13), side by side in one process (alternating, medians),
on bench.py's state: ``before`` against ``after``, everything else as nxd_ckpt does it. Before every save the
page cache is written back and dropped (bench.Cache), so each starts from a clean disk.

Levers: ``writeback`` (no early writeback against ``sync_file_range`` WRITE as each file of
``storage.local.WRITEBACK_MIN_BYTES`` or more is closed, ``storage.local.OWN_WRITEBACK`` off so that the threshold
decides on every filesystem: ``--after 0`` is every file, the default on a local disk since session 19); ``createlock`` (local files created one at a time,
``storage.local.SERIAL_CREATE``: 1 against 0, concurrent creation); ``workers`` (``num_workers``, the writer threads:
``--before`` against ``--after``); ``nice`` (the background threads' niceness, ``writepool.BACKGROUND_NICE``: 10
against 19); ``smallwriter`` (small files on a local filesystem written by one thread of their own,
``writepool.SMALL_WRITER``: 0, by the ``num_workers`` threads, against 1); ``gcpause`` (the garbage collector held
while the caller is blocked in the snapshot, ``api.HOLD_GC_IN_STALL``: 0 against 1); ``direct`` (large files
written with O_DIRECT past the page cache, ``storage.local.DIRECT_WRITES``: 0 against 1); ``reserve`` (a direct file's
blocks reserved in one piece before its first write, ``storage.local.RESERVE_BLOCKS``: 0 against 1); ``huge`` (the
direct writes' bounce buffers in transparent huge pages, ``storage.local.HUGE_BOUNCES``: 0 against 1); ``directmin``
(the smallest file written with O_DIRECT, ``storage.local.DIRECT_MIN_BYTES``: ``--before`` against ``--after`` bytes,
by default 1 MiB against 4 KiB, i.e. a save's small tensor files written past the page cache too); ``handout``
(the bytes the snapshot copies before handing their files to the writers, ``engine.HANDOUT_BYTES``: ``--before``
against ``--after``, by default one hand-out per budget chunk against 128 MiB); ``earlysync`` (a ``syncfs`` started
each time the small-file thread has written ``writepool.EARLY_SYNC_BYTES`` more: ``--before`` against ``--after``,
by default never against 64 MiB); ``smallwriters`` (threads of the small-file writer, ``writepool.SMALL_WRITERS``:
``--before`` against ``--after``, by default 1 against 2); ``schedidle`` (the save's background threads under ``SCHED_IDLE``,
``writepool.BACKGROUND_SCHED_IDLE``: 0, niceness +19 only, against 1); ``closer`` (a small file's writeback start and
close on the closer thread, ``storage.local.CLOSE_BEHIND``: 0, on its writer, against 1); ``reservesmall`` (a new
buffered file's blocks reserved before its write on ext4, ``storage.local.RESERVE_BUFFERED_MIN_BYTES``: never
against the module's 64 KiB; with ``direct`` off, large buffered files are reserved too since session 22).

Besides the process's CPU (``cpu_s_per_gb``) each round records the whole host's (``host_cpu_s_per_gb``, from
``/proc/stat``): the kernel's writeback threads write the page cache's dirty pages on the process's behalf.

    python scripts/ab_commit.py --lever writeback --size-gb 1 --tensors 300 --rounds 4 --out bench_out/ab_writeback_1gb.json

``--before N`` / ``--after N`` set the two variants' value of the lever's knob (writeback: ``WRITEBACK_MIN_BYTES``,
e.g. the default 1 MiB against 64 KiB for many small files; workers: ``num_workers``).
"""
from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import bench  # noqa: E402

LEVERS = ("writeback", "workers", "createlock", "nice", "smallwriter", "gcpause", "direct", "reserve", "huge",
          "directmin", "handout", "earlysync", "smallwriters", "schedidle", "closer", "reservesmall")
_NEVER = 1 << 62


def _set_lever(lever: str, after: bool, values: dict, kw: dict) -> None:
    from nxd_ckpt.storage import local

    value = values["after" if after else "before"]
    if lever == "writeback":
        local.OWN_WRITEBACK = False
        local.WRITEBACK_MIN_BYTES = value
    elif lever == "workers":
        kw["num_workers"] = value
    elif lever == "createlock":
        local.SERIAL_CREATE = bool(value)
    elif lever == "nice":
        bench.renice_background(value)
    elif lever == "smallwriter":
        from nxd_ckpt import writepool

        writepool.SMALL_WRITER = bool(value)
    elif lever == "gcpause":
        from nxd_ckpt import api

        api.HOLD_GC_IN_STALL = bool(value)
    elif lever == "direct":
        local.DIRECT_WRITES = bool(value)
    elif lever == "reserve":
        local.RESERVE_BLOCKS = bool(value)
    elif lever == "huge":
        if local.HUGE_BOUNCES != bool(value):
            local.BOUNCES.release()     # the next buffers are made the other way
        local.HUGE_BOUNCES = bool(value)
    elif lever == "directmin":
        local.DIRECT_MIN_BYTES = value
    elif lever == "handout":
        from nxd_ckpt import engine

        engine.HANDOUT_BYTES = value
    elif lever == "smallwriters":
        from nxd_ckpt import writepool

        writepool.SMALL_WRITERS = value
    elif lever == "schedidle":
        bench.sched_background(bool(value))
    elif lever == "closer":
        local.CLOSE_BEHIND = bool(value)
    elif lever == "reservesmall":
        local.RESERVE_BUFFERED_MIN_BYTES = value
    elif lever == "earlysync":
        from nxd_ckpt import writepool

        writepool.EARLY_SYNC_BYTES = value


def main() -> int:
    p = bench.ab_parser(__doc__, dir="/tmp/nxd_ckpt_ab_commit", rounds=4)
    p.add_argument("--lever", choices=LEVERS, required=True)
    p.add_argument("--num-workers", type=int, default=8)
    p.add_argument("--device-snapshot", action="store_true", help="save with device_snapshot=True")
    p.add_argument("--before", type=int, help="the knob's value in 'before' (writeback: never started)")
    p.add_argument("--after", type=int, help="the knob's value in 'after' (writeback: the module's default)")
    args = p.parse_args()
    import nxd_ckpt
    from nxd_ckpt.storage import local

    defaults = {"writeback": (_NEVER, local.WRITEBACK_MIN_BYTES), "workers": (args.num_workers, args.num_workers),
                "createlock": (1, 0), "nice": (10, 19), "smallwriter": (0, 1), "gcpause": (0, 1),
                "direct": (0, 1), "reserve": (0, 1), "huge": (0, 1),
                "directmin": (local.DIRECT_MIN_BYTES, 4096), "handout": (_NEVER, 128 << 20),
                "earlysync": (_NEVER, 64 << 20), "smallwriters": (1, 2), "schedidle": (0, 1), "closer": (0, 1),
                "reservesmall": (_NEVER, local.RESERVE_BUFFERED_MIN_BYTES)}
    values = {"before": defaults[args.lever][0] if args.before is None else args.before,
              "after": defaults[args.lever][1] if args.after is None else args.after}
    model, optim, _ = bench.build_state(int(args.size_gb * 1e9), args.tensors, bench.device(), args.state)
    kw = {"model": model, "use_xser": True, "num_workers": args.num_workers, "device_snapshot": args.device_snapshot,
          **({"optimizer": optim} if optim is not None else {})}
    nbytes = bench.nbytes({"model": model, "optimizer": optim} if optim is not None else model)
    cache = bench.Cache()

    def one(variant: str, i: int) -> dict:
        _set_lever(args.lever, variant == "after", values, kw)
        root = bench.ab_save_dir(args, variant, i)
        bench.trim_heap()
        cache.drop(root)
        g0 = bench.full_collections()
        c0, h0, t0 = bench.cpu_time(), bench.host_cpu_time(), time.perf_counter()
        nxd_ckpt.save_checkpoint(root, f"t{i}", async_save=True, **kw)
        stall = time.perf_counter() - t0
        nxd_ckpt.finalize_checkpoint()
        st = nxd_ckpt.save_stats()[-1]
        gb = nbytes / 1e9
        return {"stall_s": stall, "write_done_s": st["write_done_s"], "commit_s": st["commit_s"],
                "commit_gbps": gb / st["commit_s"], "cpu_s_per_gb": (bench.cpu_time() - c0) / gb,
                "host_cpu_s_per_gb": (bench.host_cpu_time() - h0) / gb,
                "full_collections": bench.full_collections() - g0}

    bench.remove_tree(args.dir)
    settled = bench.settle_removals(args.dir, args.settle_timeout)
    res, loads = bench.alternate(("before", "after"), one, args.rounds)
    bench.remove_tree(args.dir)
    out = {"lever": args.lever, "values": values, "bytes": nbytes, "tensors": args.tensors, "state": args.state,
           "rounds": args.rounds, "settle_removals": settled,
           "filesystem": _fs_type(args.dir), "load1": loads, "median": bench.medians(res),
           "device_snapshot": args.device_snapshot,
           "stall_s_rounds": {v: [round(x["stall_s"], 3) for x in res[v]] for v in res},
           "commit_s_rounds": {v: [round(x["commit_s"], 3) for x in res[v]] for v in res},
           "cpu_s_per_gb_rounds": {v: [round(x["cpu_s_per_gb"], 3) for x in res[v]] for v in res},
           "host_cpu_s_per_gb_rounds": {v: [round(x["host_cpu_s_per_gb"], 3) for x in res[v]] for v in res}}
    bench.print_json(out, args.out)
    return 0


def _fs_type(path: str) -> str:
    """The filesystem type of ``path`` from /proc/mounts (longest mount point that contains it)."""
    path = os.path.realpath(os.path.dirname(path.rstrip("/")) or "/")
    best, kind = "", "unknown"
    try:
        with open("/proc/mounts") as f:
            for line in f:
                parts = line.split()
                mnt = parts[1]
                if (path == mnt or path.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best):
                    best, kind = mnt, parts[2]
    except OSError:
        pass
    return kind


if __name__ == "__main__":
    sys.exit(main())
