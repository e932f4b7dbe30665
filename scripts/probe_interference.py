#!/usr/bin/env python3
"""What slows bench.py's training loop (issue 13, ``train_step_slowdown``): the median step time of the same small
XLA loop while one kind of background work runs, over the median without, each kind in turn, ``--rounds`` times.
No checkpoint is written; each kind stands for one part of what a background save does:

- ``none``: nothing (the noise of the measure);
- ``py_thread``: a thread of this process at niceness +19 running pure Python (it holds the GIL whenever it runs);
- ``py_process``: the same loop in a process of its own at niceness +19 (no GIL shared);
- ``files``: a thread at +19 creating and writing 100 KB files (the small-file writer's system calls);
- ``files_py``: the same with 20 us of Python per file (about what nxd-ckpt's writer spends per small file);
- ``files_syncfs``: ``files`` with a ``syncfs`` every 640 files (64 MB), as the early sync does: the disk's
  writeback then runs beside the training;
- ``files_new``: ``files``, but every file a new one (``files`` overwrites the same 5,000 after its first pass, as
  a save never does: a save creates every file, and the kernel allocates an inode each time);
- ``files_new_py``: ``files_new`` with 20 us of Python per file (the small-file writer as it is);
- ``files_new_process``: ``files_new`` in a process of its own at niceness +19 (no GIL shared: what a writer
  process for the small files would leave to the training process);
- ``files_new_syncfs``: ``files_new`` with a ``syncfs`` every 640 files, as a save's small-file thread does;
- ``files_new_range``: ``files_new_syncfs`` with each file's writeback started by the writer itself
  (``sync_file_range(SYNC_FILE_RANGE_WRITE)`` before its close), at niceness +19, instead of by the kernel's flusher
  threads at niceness 0.

The writer threads count their files: besides the step ratio, each round prints the files written and the training
time lost per 1,000 files (median extra step time x steps), since a kind that writes fewer files in the same time
slows the loop less for that reason alone.

    python scripts/probe_interference.py --rounds 2 --dir /tmp/nxd_ckpt_probe
"""
from __future__ import annotations

import argparse
import ctypes
import math
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time

KINDS = ("none", "py_thread", "py_process", "files", "files_py", "files_syncfs", "files_new", "files_new_py",
         "files_new_process", "files_new_syncfs", "files_new_range")
_written = [0]      # files written by the writer thread of the current round


def _nice_this_thread() -> None:
    os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)


def _files(stop: threading.Event, folder: str, python_us: float, sync_every: int, new: bool = False,
           own_writeback: bool = False) -> None:
    _nice_this_thread()
    folder = os.path.join(folder, str(time.time_ns()))    # a new folder each time: new files are new
    os.makedirs(folder)
    data, i = b"x" * 100_000, 0
    if own_writeback:   # the library's own call, as a save makes it
        from nxd_ckpt.storage.local import _start_writeback_fd
    libc = ctypes.CDLL(None, use_errno=True)
    anchor = os.open(folder, os.O_RDONLY)
    try:
        while not stop.is_set():
            t = time.thread_time()
            while time.thread_time() - t < python_us * 1e-6:
                pass
            fd = os.open(f"{folder}/f{i if new else i % 5000}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.write(fd, data)
            if own_writeback:
                _start_writeback_fd(fd)
            os.close(fd)
            i += 1
            _written[0] += 1
            if sync_every and i % sync_every == 0:
                libc.syncfs(anchor)
    finally:
        os.close(anchor)


def _py(stop: threading.Event) -> None:
    _nice_this_thread()
    while not stop.is_set():
        sum(range(1000))


def _start(kind: str, stop: threading.Event, folder: str):
    """Start ``kind``'s background work; returns what ``_end`` stops."""
    if kind == "none":
        return None
    if kind == "py_process":
        return subprocess.Popen(["nice", "-n", "19", sys.executable, "-c", "while True: sum(range(1000))"])
    if kind == "files_new_process":
        return subprocess.Popen(["nice", "-n", "19", sys.executable, os.path.abspath(__file__), "--files-into", folder])
    target = {"py_thread": lambda: _py(stop),
              "files": lambda: _files(stop, folder, 0, 0),
              "files_py": lambda: _files(stop, folder, 20, 0),
              "files_syncfs": lambda: _files(stop, folder, 0, 640),
              "files_new": lambda: _files(stop, folder, 0, 0, new=True),
              "files_new_py": lambda: _files(stop, folder, 20, 0, new=True),
              "files_new_syncfs": lambda: _files(stop, folder, 0, 640, new=True),
              "files_new_range": lambda: _files(stop, folder, 0, 640, new=True, own_writeback=True)}[kind]
    th = threading.Thread(target=target, daemon=True)
    th.start()
    return th


def _end(work, stop: threading.Event) -> None:
    stop.set()
    if isinstance(work, subprocess.Popen):
        work.kill()
        work.wait(timeout=10)
    elif work is not None:
        work.join(timeout=30)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--steps", type=int, default=30, help="steps timed without, then with, the background work")
    p.add_argument("--train-dim", type=int, default=1024)
    p.add_argument("--dir", default="/tmp/nxd_ckpt_probe")
    p.add_argument("--kinds", default=",".join(KINDS))
    p.add_argument("--files-into", help=argparse.SUPPRESS)     # files_new_process's child: write until killed
    args = p.parse_args()
    if args.files_into:
        _files(threading.Event(), args.files_into, 0, 0, new=True)
        return 0
    os.environ.setdefault("PJRT_DEVICE", "CPU")
    import torch
    import torch_xla
    import torch_xla.core.xla_model as xm

    dev, n = torch_xla.device(), args.train_dim
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(n, n, generator=gen).to(dev)
    ws = [(torch.randn(n, n, generator=gen) / math.sqrt(n)).to(dev) for _ in range(3)]

    def step() -> float:     # the same loop as bench.py's train_step_slowdown
        t, y = time.perf_counter(), x
        for w in ws:
            y = torch.tanh(y @ w)
        s = y.sum()
        torch_xla.sync()
        xm.wait_device_ops()
        del s
        return time.perf_counter() - t

    for _ in range(5):
        step()
    ratios = {k: [] for k in args.kinds.split(",")}
    per_k = {k: [] for k in ratios}
    for r in range(args.rounds):
        for kind in ratios:
            base = [step() for _ in range(args.steps)]
            stop = threading.Event()
            _written[0] = 0
            work = _start(kind, stop, os.path.join(args.dir, kind))
            time.sleep(0.05)
            during = [step() for _ in range(args.steps)]
            _end(work, stop)
            ratios[kind].append(round(statistics.median(during) / statistics.median(base), 3))
            line = f"round {r} {kind}: {ratios[kind][-1]}x"
            if _written[0]:
                lost = (statistics.median(during) - statistics.median(base)) * len(during)
                per_k[kind].append(round(lost / _written[0] * 1000, 3))
                line += f", {_written[0]} files, training time lost per 1,000 files {per_k[kind][-1]} s"
            print(line, flush=True)
    shutil.rmtree(args.dir, ignore_errors=True)
    print({k: {"median": statistics.median(v), "rounds": v,
               **({"lost_s_per_1000_files": per_k[k]} if per_k[k] else {})} for k, v in ratios.items()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
