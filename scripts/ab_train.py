#!/usr/bin/env python3
"""A/B of bench.py's ``train_step_slowdown`` by what ran just before it, side by side in one process
(alternating, medians), on bench.py's state:

- ``kept``: nothing in between (nxd_ckpt keeps its snapshot buffers from the previous save);
- ``released``: ``nxd_ckpt.release_host_buffers()`` + malloc_trim first (what bench.py's per-method RSS peak
  step leaves behind), so the measured save allocates and faults fresh host buffers;
- ``after_peers``: one save of each peer (torch_xla_xser, torch_save, dcp_async) and their rmtree first,
  nxd_ckpt's buffers kept;
- ``after_dcp``: one dcp_async save of a host copy and its rmtree first;
- ``nice<N>`` (e.g. ``nice19``): the save's background threads (runner, writers) at niceness +N
  (``writepool.BACKGROUND_NICE``; the threads that already exist are reniced too);
- ``no_small_writer``: small files on a local filesystem written by the ``num_workers`` threads like the others
  (``writepool.SMALL_WRITER = False``);
- ``no_direct``: every file written through the page cache (``storage.local.DIRECT_WRITES = False``);
- ``no_huge``: the direct writes' bounce buffers in small pages (``storage.local.HUGE_BOUNCES = False``);
- ``no_early_sync``: no ``syncfs`` started while small files are written (``writepool.EARLY_SYNC_BYTES``), only the
  durability batch's;
- ``no_own_writeback``: only files of 1 MiB or more start their writeback as their writer closes them
  (``storage.local.OWN_WRITEBACK = False``, what nxd_ckpt did before session 19); the smaller ones are written back
  by the kernel's flusher threads at niceness 0 instead of by the save's threads at +19. (Session 19 measured it
  as ``kept`` against ``writeback_all``, every file's writeback started by its writer, which is now the default:
  ``bench_out/ab_train_writeback_all_5000.json``.)
- ``no_sched_idle``: the save's background threads (runner, writers, the small-file thread) at niceness +19 only,
  not under ``SCHED_IDLE`` (``writepool.BACKGROUND_SCHED_IDLE = False``, what nxd_ckpt did before session 20;
  session 20 measured the change as ``kept``, then without it, against a variant ``sched_idle``:
  ``bench_out/ab_train_sched_idle_5000.json``);
- ``no_closer``: each small file's writeback started, and the file closed, by its writer rather than by the
  closer thread (``storage.local.CLOSE_BEHIND = False``, what nxd_ckpt did before session 21);
- ``flushers_nice19``: ``no_own_writeback`` on a host whose kernel flusher threads run at niceness 19 (the
  ``writeback`` workqueue's ``nice`` in sysfs, a host setting; root only, put back after the run): whether a tuned
  host gets the step time of the save's own writeback without moving the kernel's work into the process.

Every result is printed in run order too, so a lasting effect (one variant changing every later round) shows.

    python scripts/ab_train.py --size-gb 1 --tensors 300 --rounds 3 --out bench_out/ab_train_1gb.json
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import bench  # noqa: E402


def main() -> int:
    p = bench.ab_parser(__doc__, dir="/tmp/nxd_ckpt_ab_train", rounds=3, state=False)
    p.add_argument("--variants", default="kept,released,after_peers")
    p.add_argument("--train-steps", type=int, default=20)
    p.add_argument("--train-dim", type=int, default=1024)
    p.add_argument("--num-workers", type=int, default=8)
    args = p.parse_args()
    import nxd_ckpt

    args.state, args.repeat, args.rss_saves = "fp32", 1, 0
    b = bench.Bench(args)
    order = []

    from nxd_ckpt import writepool
    from nxd_ckpt.storage import local

    default_nice = writepool.BACKGROUND_NICE
    default_early_sync = writepool.EARLY_SYNC_BYTES
    default_own_writeback = local.OWN_WRITEBACK
    default_sched_idle = writepool.BACKGROUND_SCHED_IDLE
    default_close_behind = local.CLOSE_BEHIND

    flusher_nice = _FlusherNice()

    def prep(variant: str) -> None:
        flusher_nice.set(19 if variant == "flushers_nice19" else None)
        bench.renice_background(int(variant[len("nice"):]) if variant.startswith("nice") else default_nice)
        bench.sched_background(default_sched_idle and variant != "no_sched_idle")
        writepool.SMALL_WRITER = variant != "no_small_writer"
        local.DIRECT_WRITES = variant != "no_direct"
        writepool.EARLY_SYNC_BYTES = 1 << 62 if variant == "no_early_sync" else default_early_sync
        local.OWN_WRITEBACK = default_own_writeback and variant not in ("no_own_writeback", "flushers_nice19")
        local.CLOSE_BEHIND = default_close_behind and variant != "no_closer"
        if local.HUGE_BOUNCES != (variant != "no_huge"):
            local.BOUNCES.release()     # the next bounce buffers are made the other way
        local.HUGE_BOUNCES = variant != "no_huge"
        if variant == "released":
            nxd_ckpt.release_host_buffers()
            bench.trim_heap()
        elif variant == "after_peers":
            for m in ("torch_xla_xser", "torch_save", "dcp_async"):
                getattr(b, "m_" + m)(check=False)
        elif variant == "after_dcp":
            b.m_dcp_async(check=False)
        if not args.keep_tags:
            b.cleanup()

    def one(variant: str, rnd: int) -> dict:
        prep(variant)
        out = b.train_step_slowdown()
        out["load1"] = os.getloadavg()[0]
        order.append((rnd, variant, round(out["ratio"], 3), round(out["load1"], 2)))
        print(f"  round {rnd} {variant}: {out}", flush=True)
        return out

    try:
        res, loads = bench.alternate(tuple(args.variants.split(",")), one, args.rounds)
    finally:
        flusher_nice.set(None)
    b.cleanup()
    out = {"bytes": b.bytes, "tensors": args.tensors, "rounds": args.rounds, "settle_removals": b.settled,
           "load1": loads, "order": order,
           "median": bench.medians(res), "runs": res}
    bench.print_json(out, args.out)
    return 0


class _FlusherNice:
    """The niceness of the kernel's writeback workqueue (its flusher threads), set for a variant and put back."""

    PATH = "/sys/devices/virtual/workqueue/writeback/nice"

    def __init__(self):
        self._original = None

    def set(self, nice) -> None:
        """``nice``: the value for the next round; None puts back the value found first (if one was changed)."""
        if nice is None and self._original is None:
            return
        if self._original is None:
            with open(self.PATH) as f:
                self._original = int(f.read())
        with open(self.PATH, "w") as f:      # root only: PermissionError tells the caller to use another variant
            f.write(f"{self._original if nice is None else nice}\n")
        if nice is None:
            self._original = None


if __name__ == "__main__":
    sys.exit(main())
