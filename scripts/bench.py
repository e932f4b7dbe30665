#!/usr/bin/env python3
"""Benchmark nxd_ckpt's save and load against what the machine allows and against peer checkpointers.

One process, XLA device (``PJRT_DEVICE=CPU`` here; the code is device-agnostic). The state (``--state``):
``fp32``, a transformer-like model state dict of ``--size-gb`` GB in ``--tensors`` float32 tensors (embedding,
LM head and four matrices per layer hold the bytes; biases and norms are many small vectors); or ``bf16-adam``,
bf16 parameters plus an Adam-like fp32 optimizer state (exp_avg, exp_avg_sq, a CPU ``step``) of ``--size-gb`` GB.

Measured (medians over ``--repeat`` rounds, after one warm-up round that is not counted; every method saves
the same tensors; before every save and every load the page cache is written back and dropped the same way):

- limits: one batched device-to-host copy of all tensors (``torch_xla._XLAC._xla_get_cpu_tensors``, with its
  CPU time per GB), one batched host-to-device copy (``xm.send_cpu_data_to_device``), write+fsync and read of
  the same bytes as 64 files by ``--num-workers`` threads, and as one file in 64 MiB blocks, in ``--dir``; and
  the per-file floor of nxd_ckpt's own file set (``limit_files``: as many files of the same sizes, written by
  ``--num-workers`` threads with os.open/os.write/os.close + one syncfs, read back with os.open/os.readv/os.close;
  wall and CPU), against which the (extra) targets put nxd_ckpt's save CPU, commit and load;
- nxd_ckpt async (host snapshot), async with ``device_snapshot=True``, and sync: stall (call to return), commit
  (call to ``done`` being durable, from ``nxd_ckpt.save_stats()``) and load (``load_checkpoint`` into XLA
  tensors, until the device holds them); host RSS peak above the pre-save RSS;
- torch_xla_xser: ``torch_xla.utils.serialization.save`` + fsync of its files; load + batched host-to-device;
- torch_save: host copy + ``torch.save`` + fsync; ``torch.load`` + batched host-to-device;
- dcp_async: host copy + ``torch.distributed.checkpoint.async_save`` (no_dist); commit when its future is done.
  DCP's default stager cannot copy XLA storages, so the host copy is made by the caller and counted in the stall.
  The peers' host copies use the same routine as nxd_ckpt (``nxd_ckpt.staging.copy_to_host``);
- cpu_s_per_gb, for every method: process CPU time (all threads, user + system) from the call to commit, per GB;
- train_step_slowdown: median step time of a small XLA training loop (matmuls, each step synced) while an async
  save runs in the background, over the median step time without (after the rounds, before the RSS peaks,
  which release nxd_ckpt's kept host buffers); each run also reports the save's own CPU and page faults;
- RSS after each of ``--rss-saves`` consecutive async saves (first vs last).

Writes JSON (``--out``) and prints a table and a verdict per target (issue 13's targets; the 1-minute load
average is sampled every 15 s, since the machine may be shared).

    python scripts/bench.py --size-gb 1 --tensors 300 --dir /tmp/nxd_ckpt_bench --repeat 3 --out bench_out/bench_1gb.json
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time

os.environ.setdefault("PJRT_DEVICE", "CPU")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import psutil  # noqa: E402
import torch  # noqa: E402

MB = 1 << 20
GB = 1e9            # throughputs are in GB/s = 1e9 bytes/s
BLOCK = 64 * MB
METHODS = ("nxd_ckpt_async", "nxd_ckpt_async_device_snapshot", "nxd_ckpt_sync", "torch_xla_xser", "torch_save",
           "dcp_async")


# --- environment ---------------------------------------------------------------------------------------
def xla():
    import torch_xla
    import torch_xla.core.xla_model as xm

    return torch_xla, xm


def device():
    torch_xla, _ = xla()
    return torch_xla.device()


def wait_device():
    torch_xla, xm = xla()
    xm.wait_device_ops()


class Cache:
    """Writes back and evicts the page cache: drop_caches when allowed (root), else fadvise(DONTNEED)."""

    def __init__(self):
        self.mode = "posix_fadvise_dontneed"
        try:
            os.sync()
            with open("/proc/sys/vm/drop_caches", "w") as f:
                f.write("3\n")
            self.mode = "drop_caches"
        except OSError:
            pass

    def drop(self, *paths):
        os.sync()
        if self.mode == "drop_caches":
            try:
                with open("/proc/sys/vm/drop_caches", "w") as f:
                    f.write("3\n")
                return
            except OSError:
                self.mode = "posix_fadvise_dontneed"
        for p in paths:
            for f in _files(p):
                try:
                    fd = os.open(f, os.O_RDONLY)
                except OSError:
                    continue
                try:
                    os.fdatasync(fd)
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                finally:
                    os.close(fd)


def _files(path):
    if os.path.isfile(path):
        yield path
    elif os.path.isdir(path):
        for d, _, names in os.walk(path):
            for n in names:
                yield os.path.join(d, n)


def fsync_tree(path):
    """fsync every file under ``path`` (or the file itself) and every directory, parent included."""
    dirs = {os.path.dirname(os.path.abspath(path))}
    for f in _files(path):
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        dirs.add(os.path.dirname(f))
    if os.path.isdir(path):
        for d, subs, _ in os.walk(path):
            dirs.add(d)
    for d in dirs:
        fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


#: Why --keep-tags exists (bench.py and the A/B scripts).
KEEP_TAGS_WHY = ("on ext4 without a journal, as on this VM, creating files right after removing thousands costs "
                 "0.2-0.7 ms of kernel CPU each")
#: Time to create one empty file under which a folder's filesystem counts as settled (about 15 us here).
SETTLED_CREATE_US = 40.0
#: Seconds after a removal until ext4 without a journal allocates its inode again: 60 s, 360 s while the inode's
#: table block is unwritten (fs/ext4/ialloc.c ``recently_deleted``), which a save's creations in the same block
#: make it again; plus 20 s of margin.
REMOVAL_WINDOW_S = 380.0


#: Where the benchmark scripts note when they last removed files, per filesystem (``remove_tree``).
REMOVALS_FILE = os.path.join(tempfile.gettempdir(), "nxd_ckpt_bench_removals.json")


def _device_of(path: str) -> str:
    path = os.path.abspath(path)
    while not os.path.exists(path):
        path = os.path.dirname(path)
    return str(os.stat(path).st_dev)


def _noted_removals() -> dict:
    try:
        with open(REMOVALS_FILE) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def remove_tree(path: str) -> None:
    """``shutil.rmtree`` (errors ignored), noting the time on ``path``'s filesystem so that the next run's
    ``settle_removals`` waits out the window of these removals, which its probes may miss."""
    if not os.path.lexists(path):
        return
    dev = _device_of(path)
    shutil.rmtree(path, ignore_errors=True)
    noted = _noted_removals()
    noted[dev] = time.time()
    try:        # a note, best effort: a unique temporary name, so that two scripts at once never mix their bytes
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(REMOVALS_FILE), prefix=".nxd_ckpt_bench_removals")
        with os.fdopen(fd, "w") as f:
            json.dump(noted, f)
        os.replace(tmp, REMOVALS_FILE)
    except OSError:
        pass


def _wait_out_noted_removal(folder: str) -> float:
    """Sleep until REMOVAL_WINDOW_S after the last removal ``remove_tree`` noted on ``folder``'s filesystem;
    returns the seconds slept."""
    last = _noted_removals().get(_device_of(folder))
    left = 0.0 if last is None else min(REMOVAL_WINDOW_S, last + REMOVAL_WINDOW_S - time.time())
    if left > 0:
        time.sleep(left)
    return max(0.0, left)


def settle_removals(folder: str, timeout_s: float = 420.0, probe_files: int = 64, probe_folders: int = 16) -> dict:
    """Wait until files removed before this run no longer slow the creation of new ones; returns what was seen.

    ext4 without a journal (this VM's disk) does not reuse an inode removed less than 60 s ago, or 360 s while
    its inode-table block is unwritten (which the creation of its neighbours makes it again): allocating one
    scans past every such inode in the block group. Found with ``perf`` (``recently_deleted`` under
    ``__ext4_new_inode``): after a test run or an earlier run's cleanup, creating a file cost 80-500 us of kernel
    CPU instead of about 15 us, for every method measured, and most at 5,000 files. Syncs, then creates
    ``probe_files`` empty files in each of ``probe_folders`` new folders (ext4 spreads folders over groups) under
    ``folder``/_create_probes (``path`` in the result; kept, since removing them would restart the wait, until
    the caller's cleanup) every 10 s until the dearest folder's creations take under SETTLED_CREATE_US each, or
    ``timeout_s`` passes. A probe only meets the removed inodes that come first in its group, and saves right
    after a cheap probe still paid, so once a dear probe turns cheap the wait goes on until REMOVAL_WINDOW_S
    after the start (session 22: saves that began 340-350 s after a removal, 300 s after the probe turned cheap,
    still spent 20% of the small-file thread's samples in ``recently_deleted``).
    The probes of 16 folders still miss removals in other groups (a run started 4 minutes after the last one's
    cleanup probed cheap at once and paid), so first the window of the last removal the benchmark scripts
    noted (``remove_tree``) is waited out (``noted_removal_wait_s``).
    Journaled filesystems (ext4's default, XFS, FSx for Lustre) pass at once."""
    noted_wait = _wait_out_noted_removal(folder) if timeout_s > 0 else 0.0
    start, seen, root = time.perf_counter(), [], os.path.join(folder, "_create_probes")
    while True:
        os.sync()
        seen.append(max(_create_cost_us(os.path.join(root, f"{len(seen)}_{k}_{os.getpid()}"), probe_files)
                        for k in range(probe_folders)))
        if seen[-1] < SETTLED_CREATE_US or time.perf_counter() - start > timeout_s:
            break
        time.sleep(10)
    settled = seen[-1] < SETTLED_CREATE_US
    if settled and len(seen) > 1:
        time.sleep(max(0.0, REMOVAL_WINDOW_S - (time.perf_counter() - start)))
    return {"create_us": seen, "waited_s": round(time.perf_counter() - start, 1), "settled": settled,
            "path": root, "noted_removal_wait_s": round(noted_wait, 1)}


def _create_cost_us(probe: str, files: int) -> float:
    """Microseconds to create one empty file, averaged over ``files`` new ones in the new folder ``probe``. Wall
    time: creation is the kernel's CPU on this thread, and the thread's own CPU time counts in scheduler ticks
    (4 ms here, 125 us a file over 32 files)."""
    os.makedirs(probe)
    t = time.perf_counter()
    for i in range(files):
        os.close(os.open(os.path.join(probe, str(i)), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
    return round((time.perf_counter() - t) / files * 1e6, 1)


def ab_parser(doc: str, *, dir: str | None, rounds: int, size_gb: float = 1.0, tensors: int = 300,
              state: bool = True) -> "argparse.ArgumentParser":
    """The arguments every A/B script takes (state shape, rounds, folder, JSON out); ``dir=None``: required."""
    import argparse

    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size-gb", type=float, default=size_gb)
    p.add_argument("--tensors", type=int, default=tensors)
    if state:
        p.add_argument("--state", choices=("fp32", "bf16-adam"), default="fp32")
    p.add_argument("--rounds", type=int, default=rounds)
    p.add_argument("--dir", default=dir, required=dir is None)
    p.add_argument("--out")
    p.add_argument("--settle-timeout", type=float, default=420.0,
                   help="seconds to probe at the start until earlier file removals stop slowing file creation "
                        "(settle_removals; before probing, until 380 s after the last removal the scripts noted; once a "
                        "dear probe turns cheap, until 380 s after the start; 0: probe once and go on)")
    p.add_argument("--keep-tags", action="store_true",
                   help="save each round into a folder of its own under --dir, all removed only at the end (the "
                        f"default empties --dir before each save; {KEEP_TAGS_WHY})")
    return p


def renice_background(n: int) -> None:
    """nxd_ckpt's background threads at niceness +``n``: those started from now on (``writepool.BACKGROUND_NICE``)
    and those that already exist (the runner and writer threads are kept between saves)."""
    import threading

    from nxd_ckpt import writepool

    writepool.BACKGROUND_NICE = n
    base = os.getpriority(os.PRIO_PROCESS, os.getpid())
    for t in threading.enumerate():
        if t.name.startswith("nxd_ckpt-") and t.native_id is not None:
            os.setpriority(os.PRIO_PROCESS, t.native_id, min(19, base + n))


def sched_background(idle: bool) -> None:
    """nxd_ckpt's background threads under SCHED_IDLE (``idle``) or SCHED_OTHER at their niceness: those started
    from now on (``writepool.BACKGROUND_SCHED_IDLE``) and those that already exist."""
    import threading

    from nxd_ckpt import writepool

    writepool.BACKGROUND_SCHED_IDLE = idle
    policy = os.SCHED_IDLE if idle else os.SCHED_OTHER
    for t in threading.enumerate():
        if t.name.startswith("nxd_ckpt-") and t.native_id is not None:
            nice = os.getpriority(os.PRIO_PROCESS, t.native_id)
            os.sched_setscheduler(t.native_id, policy, os.sched_param(0))
            os.setpriority(os.PRIO_PROCESS, t.native_id, nice)


def ab_save_dir(args, variant: str, i: int) -> str:
    """The empty folder an A/B script saves round ``i`` of ``variant`` into (``--keep-tags``: a new one each
    time, the earlier ones kept; else ``--dir`` itself, emptied)."""
    if args.keep_tags:
        path = os.path.join(args.dir, f"{variant}_{i}")
        os.makedirs(path)
        return path
    remove_tree(args.dir)
    os.makedirs(args.dir)
    return args.dir


def alternate(variants, one, rounds: int):
    """A/B runs of ``one(variant, round)``: a warm-up of each (round 0), then ``rounds`` rounds alternating the
    order; returns each variant's results and the 1-minute load average after each round."""
    for v in variants:
        one(v, 0)
    res, loads = {v: [] for v in variants}, []
    for r in range(rounds):
        for v in (variants if r % 2 == 0 else variants[::-1]):
            res[v].append(one(v, r + 1))
        loads.append(os.getloadavg()[0])
    return res, loads


def medians(res) -> dict:
    return {v: {k: statistics.median(x[k] for x in runs) for k in runs[0]} for v, runs in res.items()}


def print_json(out: dict, path) -> None:
    """Print ``out`` as JSON and, when ``path`` is given, write it there too."""
    text = json.dumps(out, indent=1)
    print(text)
    if path:
        with open(path, "w") as f:
            f.write(text + "\n")


def trim_heap():
    """Collect garbage and return free heap memory to the OS (glibc malloc_trim), so RSS measures live memory."""
    gc.collect()
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


class RssSampler:
    """Samples this process's RSS every ``interval`` seconds on a thread; ``peak`` since start()."""

    def __init__(self, interval=0.005):
        self.proc = psutil.Process()
        self.interval = interval
        self.peak = 0
        self._stop = threading.Event()
        self._thread = None

    def rss(self):
        return self.proc.memory_info().rss

    def start(self):
        self.peak = self.rss()
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="bench-rss", daemon=True)
        self._thread.start()
        return self

    def _run(self):
        while not self._stop.wait(self.interval):
            r = self.rss()
            if r > self.peak:
                self.peak = r

    def stop(self):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.rss())
        return self.peak


# --- the state -----------------------------------------------------------------------------------------
def state_shapes(size_bytes: int, n_tensors: int):
    """(name, shape) of a transformer-like fp32 state of about ``size_bytes`` in exactly ``n_tensors`` tensors:
    embedding and LM head (4H x H), per layer qkv (3H x H), out (H x H), fc1 (4H x H), fc2 (H x 4H) and eight
    vectors (biases, norms), a final norm, and extra (H,) vectors to reach the count."""
    if n_tensors < 4:
        raise SystemExit("--tensors must be at least 4")
    layers = (n_tensors - 4) // 12
    extra = n_tensors - 4 - 12 * layers
    floats = size_bytes // 4
    a, b = 8 + 12 * layers, 2 + 13 * layers + extra
    hidden = max(8, int((-b + math.sqrt(b * b + 4 * a * floats)) / (2 * a)))
    h = hidden
    shapes = [("embed.weight", (4 * h, h))]
    for i in range(layers):
        p = f"layers.{i}."
        shapes += [(p + "attn.qkv.weight", (3 * h, h)), (p + "attn.qkv.bias", (3 * h,)),
                   (p + "attn.out.weight", (h, h)), (p + "attn.out.bias", (h,)),
                   (p + "ln1.weight", (h,)), (p + "ln1.bias", (h,)),
                   (p + "mlp.fc1.weight", (4 * h, h)), (p + "mlp.fc1.bias", (4 * h,)),
                   (p + "mlp.fc2.weight", (h, 4 * h)), (p + "mlp.fc2.bias", (h,)),
                   (p + "ln2.weight", (h,)), (p + "ln2.bias", (h,))]
    shapes += [("final_norm.weight", (h,)), ("final_norm.bias", (h,))]
    shapes += [(f"extra.{i}.scale", (h,)) for i in range(extra)]
    shapes.append(("lm_head.weight", (4 * h, h)))
    assert len(shapes) == n_tensors, (len(shapes), n_tensors)
    return shapes, hidden


def build_state(size_bytes: int, n_tensors: int, dev, kind: str = "fp32"):
    """The benchmark state on ``dev``: ``(model, optimizer or None, hidden)``.

    ``fp32``: a model state dict of ``size_bytes`` in ``n_tensors`` float32 tensors. ``bf16-adam``: bf16
    parameters plus an Adam-like fp32 optimizer state (exp_avg, exp_avg_sq per parameter and a CPU ``step``),
    10 bytes per parameter, ``size_bytes`` in total; ``n_tensors`` counts the parameters."""
    gen = torch.Generator().manual_seed(1234)
    if kind == "fp32":
        shapes, hidden = state_shapes(size_bytes, n_tensors)
        model = {name: torch.randn(shape, generator=gen).to(dev) for name, shape in shapes}
        optim = None
    elif kind == "bf16-adam":
        shapes, hidden = state_shapes(size_bytes * 4 // 10, n_tensors)
        model = {name: torch.randn(shape, generator=gen).to(torch.bfloat16).to(dev) for name, shape in shapes}
        state = {i: {"step": torch.tensor(100.0),
                     "exp_avg": (torch.randn(shape, generator=gen) * 1e-3).to(dev),
                     "exp_avg_sq": torch.rand(shape, generator=gen).mul_(1e-6).to(dev)}
                 for i, (_, shape) in enumerate(shapes)}
        optim = {"state": state, "param_groups": [{"lr": 1e-4, "betas": (0.9, 0.999), "eps": 1e-8,
                                                   "weight_decay": 0.0, "params": list(range(len(shapes)))}]}
    else:
        raise SystemExit(f"--state must be fp32 or bf16-adam, got {kind!r}")
    torch_xla, _ = xla()
    torch_xla.sync()
    wait_device()
    return model, optim, hidden


def tensors_of(obj) -> list:
    """Every tensor in a nested dict/list/tuple, depth first (keys in insertion order)."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in tensors_of(v)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in tensors_of(v)]
    return []


def replace_tensors(obj, it):
    """``obj`` with its tensors replaced, in ``tensors_of`` order, by the next items of iterator ``it``."""
    if isinstance(obj, torch.Tensor):
        return next(it)
    if isinstance(obj, dict):
        return {k: replace_tensors(v, it) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(replace_tensors(v, it) for v in obj)
    return obj


def nbytes(obj) -> int:
    return sum(t.numel() * t.element_size() for t in tensors_of(obj))


def cpu_time() -> float:
    """CPU seconds (user + system) of this process, every thread."""
    import resource

    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def host_cpu_time() -> float:
    """CPU seconds every core of the host has been busy (``/proc/stat``: all but idle and iowait), which
    also counts the kernel's writeback threads that write a process's dirty pages; 0.0 off Linux."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return 0.0
    return (sum(fields) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")


_full_collections = [0]


def _count_full_collection(phase: str, info: dict) -> None:
    if phase == "start" and info.get("generation") == 2:
        _full_collections[0] += 1


gc.callbacks.append(_count_full_collection)


def full_collections() -> int:
    """Full (generation 2) garbage collections this process has run since this module was imported (the
    ``gc.callbacks`` hook above): each walks the whole heap (0.2-0.3 s for this benchmark's), so the ones a save
    sets off belong to its cost."""
    return _full_collections[0]


# --- limits --------------------------------------------------------------------------------------------
def minor_faults() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def limit_d2h(vals):
    torch_xla, _ = xla()
    gc.collect()
    f = minor_faults()
    t = time.perf_counter()
    host = torch_xla._XLAC._xla_get_cpu_tensors(vals)
    dt = time.perf_counter() - t
    return dt, host, minor_faults() - f


def limit_d2h_chunked(vals):
    from nxd_ckpt.staging import copy_to_host

    gc.collect()
    f = minor_faults()
    t = time.perf_counter()
    host = copy_to_host(vals)
    return time.perf_counter() - t, host, minor_faults() - f


def limit_h2d(host, dev):
    """One batched host-to-device transfer of ``host``, timed. The caller trims the heap first, as before every
    load, outside its CPU clock: the transfer then faults in its new memory (torch-xla's staging copy of each
    tensor, and the device buffers on PJRT CPU) as a load does. Without the trim it reused the memory the
    device-to-host copy had just freed: 55-336 MB faulted per GB against 1.1 GB in a load, 0.10 s against 0.5 s
    and more."""
    _, xm = xla()
    t = time.perf_counter()
    moved = xm.send_cpu_data_to_device(host, dev)
    wait_device()
    dt = time.perf_counter() - t
    del moved
    return dt


def limit_disk(path: str, total: int, cache: Cache):
    """Write ``total`` bytes in 64 MiB blocks to ``path`` + fsync; drop the cache; read it back. (s, s)."""
    block = bytearray(os.urandom(1 << 20)) * (BLOCK >> 20)
    view = memoryview(block)
    cache.drop()
    t = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        left = total
        while left > 0:
            n = os.write(fd, view[:min(left, BLOCK)])
            left -= n
        os.fsync(fd)
    finally:
        os.close(fd)
    dfd = os.open(os.path.dirname(path), os.O_RDONLY | os.O_DIRECTORY)
    os.fsync(dfd)
    os.close(dfd)
    write_s = time.perf_counter() - t
    cache.drop(path)
    t = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        while f.readinto(view):
            pass
    read_s = time.perf_counter() - t
    os.unlink(path)
    return write_s, read_s


def _write_file(path: str, size: int, block: memoryview, fsync: bool) -> None:
    """Create ``path`` and write ``size`` bytes from ``block`` (repeated) with bare os calls; fsync if asked."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        left = size
        while left > 0:
            left -= os.write(fd, block[:min(left, len(block))])
        if fsync:
            os.fsync(fd)
    finally:
        os.close(fd)


def _read_file(path: str, size: int) -> torch.Tensor:
    """``size`` bytes of ``path`` read with os.readv into a fresh host tensor."""
    out = torch.empty(size, dtype=torch.uint8)
    view = memoryview(out.numpy())
    fd = os.open(path, os.O_RDONLY)
    try:
        got = 0
        while got < size:
            n = os.readv(fd, [view[got:]])
            if not n:
                break
            got += n
    finally:
        os.close(fd)
    return out


def limit_disk_parallel(folder: str, total: int, cache: Cache, threads: int, files: int = 64, remove: bool = True):
    """Write ``total`` bytes as ``files`` files from ``threads`` threads, each file fsynced, then the folder;
    drop the cache and read them back with ``threads`` threads into fresh host tensors. (write s, read s).
    ``remove``: the files are removed after (else left for the caller)."""
    from concurrent.futures import ThreadPoolExecutor

    block = memoryview(bytearray(os.urandom(1 << 20)) * 16)
    remove_tree(folder)
    os.makedirs(folder)
    cache.drop()
    per = -(-total // files)
    sizes = [max(0, min(per, total - i * per)) for i in range(files)]
    path = lambda i: os.path.join(folder, f"f{i}")  # noqa: E731
    write = lambda i: _write_file(path(i), sizes[i], block, fsync=True)  # noqa: E731
    read = lambda i: _read_file(path(i), sizes[i])  # noqa: E731

    with ThreadPoolExecutor(threads) as pool:
        t = time.perf_counter()
        list(pool.map(write, range(files)))
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
        os.fsync(fd)
        os.close(fd)
        write_s = time.perf_counter() - t
        cache.drop(folder)
        gc.collect()
        t = time.perf_counter()
        host = list(pool.map(read, range(files)))
        read_s = time.perf_counter() - t
    del host
    if remove:
        remove_tree(folder)
    return write_s, read_s


def file_sizes(root: str) -> list:
    """Sizes of every file under ``root`` (a saved checkpoint: the file set the per-file floor writes)."""
    return sorted(os.path.getsize(f) for f in _files(root))


def limit_files(folder: str, sizes: list, cache: Cache, threads: int, remove: bool = True) -> dict:
    """The machine's per-file floor for one file set: ``len(sizes)`` files of those sizes, written by ``threads``
    threads with os.open/os.write/os.close into one folder, made durable with one syncfs and a folder fsync;
    then (page cache dropped) read back by ``threads`` threads with os.open/os.readv into fresh host
    tensors/os.close. Wall seconds and process CPU seconds (every thread, user + system) of each phase, and the
    host's CPU seconds of the write (``/proc/stat``: the kernel's writeback threads, which ``syncfs`` hands the
    dirty pages to, included)."""
    from concurrent.futures import ThreadPoolExecutor

    from nxd_ckpt.storage.local import _syncfs

    block = memoryview(bytearray(os.urandom(1 << 20)) * 16)
    remove_tree(folder)
    os.makedirs(folder)
    path = lambda i: os.path.join(folder, f"f{i}")  # noqa: E731
    write = lambda i: _write_file(path(i), sizes[i], block, fsync=False)  # noqa: E731
    read = lambda i: _read_file(path(i), sizes[i])  # noqa: E731

    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(lambda i: None, range(threads)))      # the threads exist before the clock starts
        trim_heap()
        cache.drop(folder)
        c, h, t = cpu_time(), host_cpu_time(), time.perf_counter()
        list(pool.map(write, range(len(sizes))))
        dfd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
        try:
            _syncfs(dfd)
            os.fsync(dfd)
        finally:
            os.close(dfd)
        out = {"write_s": time.perf_counter() - t, "write_cpu_s": cpu_time() - c,
               "write_host_cpu_s": host_cpu_time() - h}
        cache.drop(folder)
        trim_heap()
        c, t = cpu_time(), time.perf_counter()
        host = list(pool.map(read, range(len(sizes))))
        out.update(read_s=time.perf_counter() - t, read_cpu_s=cpu_time() - c)
    del host
    if remove:
        remove_tree(folder)
    return out


# --- methods -------------------------------------------------------------------------------------------
class Bench:
    def __init__(self, args):
        self.args = args
        self.dir = os.path.abspath(args.dir)
        self.cache = Cache()
        self.settled = settle_removals(self.dir, args.settle_timeout)
        print(f"settle_removals: {self.settled}", flush=True)
        self.dev = device()
        self.model, self.optim, self.hidden = build_state(int(args.size_gb * GB), args.tensors, self.dev, args.state)
        self.tensors = tensors_of(self.whole())
        self.bytes = nbytes(self.whole())
        self.rss = RssSampler()
        self.counter = 0
        self.created = {self.settled["path"]}
        self.file_set = None        # sizes of the files of nxd_ckpt's first save: the per-file floor's file set

    def whole(self) -> dict:
        """What the peers save: the model and, with an optimizer, both."""
        return {"model": self.model, "optimizer": self.optim} if self.optim is not None else self.model

    def save_kwargs(self) -> dict:
        kw = {"model": self.model, "num_workers": self.args.num_workers, "use_xser": True}
        if self.optim is not None:
            kw["optimizer"] = self.optim
        return kw

    def settle(self, path):
        """The same starting point for every measurement: a trimmed heap and no cached pages of ``path``."""
        trim_heap()
        self.cache.drop(path)

    def cleanup(self):
        for path in sorted(self.created):
            remove_tree(path)

    def fresh(self, name):
        """A new empty path for one save under --dir, then the cache is dropped. The earlier one of ``name`` is
        removed first, or with --keep-tags kept until the end of the run (a folder per save)."""
        self.counter += 1
        base = os.path.join(self.dir, f"{name}_{self.counter}" if self.args.keep_tags else name)
        self.created.add(base)
        if not self.args.keep_tags:
            remove_tree(base)
        os.makedirs(base, exist_ok=True)
        self.settle(base)
        return base

    def discard(self, path):
        """Remove a finished save's folder now, or with --keep-tags at the end of the run."""
        if not self.args.keep_tags:
            remove_tree(path)

    def per_gb(self, cpu_s: float) -> float:
        return cpu_s / (self.bytes / GB)

    # nxd_ckpt
    def nxd_save(self, root, async_save, device_snapshot):
        import nxd_ckpt

        tag = f"step_{self.counter}"
        f = minor_faults()
        g = full_collections()
        c, h = cpu_time(), host_cpu_time()
        t = time.perf_counter()
        nxd_ckpt.save_checkpoint(root, tag, async_save=async_save, device_snapshot=device_snapshot,
                                 **self.save_kwargs())
        stall = time.perf_counter() - t
        c_stall = cpu_time() - c
        faults = minor_faults() - f
        nxd_ckpt.finalize_checkpoint()
        finalized = time.perf_counter() - t
        c_all = cpu_time() - c
        out = {"stall_s": stall, "finalize_s": finalized, "stall_page_faults_mb": faults * 4096 / MB,
               "cpu_s_per_gb": self.per_gb(c_all), "stall_cpu_s_per_gb": self.per_gb(c_stall),
               "host_cpu_s_per_gb": self.per_gb(host_cpu_time() - h),
               "full_collections": full_collections() - g}
        st = nxd_ckpt.save_stats()[-1]
        assert st.get("ok", True) and st["tag"] == tag, st
        out["commit_s"] = st["commit_s"]
        out["write_done_s"] = st.get("write_done_s", float("nan"))
        out["stall_reported_s"] = st["stall_s"]
        return out, tag

    def nxd_load(self, root, tag, check=False):
        import nxd_ckpt

        model = dict(self.model)
        optim = replace_tensors(self.optim, iter(tensors_of(self.optim))) if self.optim is not None else None
        self.settle(root)
        c = cpu_time()
        t = time.perf_counter()
        nxd_ckpt.load_checkpoint(root, tag, model=model, optimizer=optim, num_workers=self.args.num_workers)
        wait_device()
        dt = time.perf_counter() - t
        c = cpu_time() - c
        if check:
            self._check({"model": model, "optimizer": optim} if optim is not None else model)
        del model, optim
        return dt, self.per_gb(c)

    def _check(self, loaded):
        torch_xla, _ = xla()
        want, got = self.tensors, tensors_of(loaded)
        if len(want) != len(got):
            raise SystemExit(f"bench: loaded {len(got)} tensors, saved {len(want)}")
        n = len(want)
        idx = sorted({0, 1, n // 2, n - 2, n - 1} & set(range(n)))
        a = torch_xla._XLAC._xla_get_cpu_tensors([want[i] for i in idx if want[i].device.type == "xla"])
        b = torch_xla._XLAC._xla_get_cpu_tensors([got[i] for i in idx if want[i].device.type == "xla"])
        for i, x, y in zip(idx, a, b):
            if got[i].device.type != "xla" or x.dtype != y.dtype or not torch.equal(x, y):
                raise SystemExit(f"bench: loaded tensor #{i} differs from the saved one")

    def _nxd_method(self, name, async_save, device_snapshot, check, load=True):
        root = self.fresh(name)
        out, tag = self.nxd_save(root, async_save, device_snapshot)
        if self.file_set is None:
            self.file_set = file_sizes(root)
        if load:
            out["load_s"], out["load_cpu_s_per_gb"] = self.nxd_load(root, tag, check)
        elif check:
            out["load_s_unrequired"], _ = self.nxd_load(root, tag, check)
            trim_heap()
        return out

    def m_nxd_ckpt_async(self, check):
        return self._nxd_method("nxd_async", True, False, check)

    def m_nxd_ckpt_async_device_snapshot(self, check):
        return self._nxd_method("nxd_async_dev", True, True, check, load=False)

    def m_nxd_ckpt_sync(self, check):
        return self._nxd_method("nxd_sync", False, False, check)

    # peers
    def host_copy(self):
        from nxd_ckpt.staging import copy_to_host

        return replace_tensors(self.whole(), iter(copy_to_host(self.tensors)))

    def to_device(self, host):
        _, xm = xla()
        flat = tensors_of(host)
        moved = xm.send_cpu_data_to_device(flat, self.dev)
        wait_device()
        return replace_tensors(host, iter(moved))

    def _timed_load(self, base, load):
        self.settle(base)
        c = cpu_time()
        t = time.perf_counter()
        loaded = self.to_device(load())
        return loaded, time.perf_counter() - t, self.per_gb(cpu_time() - c)

    def m_torch_xla_xser(self, check):
        import torch_xla.utils.serialization as xs

        base = self.fresh("xser")
        path = os.path.join(base, "model.pt")
        c, h = cpu_time(), host_cpu_time()
        t = time.perf_counter()
        xs.save(self.whole(), path)
        fsync_tree(path)
        fsync_tree(path + ".tensors")
        stall = time.perf_counter() - t
        cpu, host_cpu = self.per_gb(cpu_time() - c), self.per_gb(host_cpu_time() - h)
        loaded, load_s, load_cpu = self._timed_load(base, lambda: xs.load(path))
        if check:
            self._check(loaded)
        del loaded
        return {"stall_s": stall, "cpu_s_per_gb": cpu, "host_cpu_s_per_gb": host_cpu, "load_s": load_s,
                "load_cpu_s_per_gb": load_cpu}

    def m_torch_save(self, check):
        base = self.fresh("torch_save")
        path = os.path.join(base, "model.pt")
        c, h = cpu_time(), host_cpu_time()
        t = time.perf_counter()
        host = self.host_copy()
        with open(path, "wb") as f:
            torch.save(host, f)
            f.flush()
            os.fsync(f.fileno())
        fsync_tree(path)
        stall = time.perf_counter() - t
        cpu, host_cpu = self.per_gb(cpu_time() - c), self.per_gb(host_cpu_time() - h)
        del host
        loaded, load_s, load_cpu = self._timed_load(base, lambda: torch.load(path, weights_only=True))
        if check:
            self._check(loaded)
        del loaded
        return {"stall_s": stall, "cpu_s_per_gb": cpu, "host_cpu_s_per_gb": host_cpu, "load_s": load_s,
                "load_cpu_s_per_gb": load_cpu}

    def m_dcp_async(self, check):
        import torch.distributed.checkpoint as dcp

        base = self.fresh("dcp")
        path = os.path.join(base, "ckpt")
        c, h = cpu_time(), host_cpu_time()
        t = time.perf_counter()
        host = self.host_copy()
        fut = dcp.async_save(host, checkpoint_id=path, no_dist=True)
        stall = time.perf_counter() - t
        c_stall = cpu_time() - c
        del host
        fut = getattr(fut, "upload_completion", fut)
        fut.result()
        commit = time.perf_counter() - t
        return {"stall_s": stall, "commit_s": commit, "cpu_s_per_gb": self.per_gb(cpu_time() - c),
                "stall_cpu_s_per_gb": self.per_gb(c_stall), "host_cpu_s_per_gb": self.per_gb(host_cpu_time() - h)}

    # training-loop interference
    def train_step_slowdown(self):
        import nxd_ckpt

        torch_xla, _ = xla()
        n = self.args.train_dim
        gen = torch.Generator().manual_seed(7)
        x = torch.randn(n, n, generator=gen).to(self.dev)
        ws = [(torch.randn(n, n, generator=gen) / math.sqrt(n)).to(self.dev) for _ in range(3)]
        torch_xla.sync()
        wait_device()

        def step():
            t = time.perf_counter()
            y = x
            for w in ws:
                y = torch.tanh(y @ w)
            s = y.sum()
            torch_xla.sync()
            wait_device()
            del s
            return time.perf_counter() - t

        for _ in range(5):
            step()
        root = self.fresh("nxd_train")
        c, f = cpu_time(), minor_faults()
        base = [step() for _ in range(self.args.train_steps)]
        step_cpu, step_faults = (cpu_time() - c) / len(base), (minor_faults() - f) / len(base)
        done = threading.Event()
        c, f, t = cpu_time(), minor_faults(), time.perf_counter()
        nxd_ckpt.save_checkpoint(root, f"step_{self.counter}", async_save=True, **self.save_kwargs())
        stall_s, stall_faults = time.perf_counter() - t, minor_faults() - f
        waiter = threading.Thread(target=lambda: (nxd_ckpt.finalize_checkpoint(), done.set()), daemon=True)
        waiter.start()
        during = []
        while not done.is_set():
            during.append(step())
        waiter.join()
        c, f = cpu_time() - c, minor_faults() - f
        after = [step() for _ in range(self.args.train_steps)]
        baseline = statistics.median(base + after)
        loaded = statistics.median(during) if during else baseline
        out = {"ratio": loaded / baseline, "step_s_without": baseline, "step_s_during_save": loaded,
               "steps_during_save": len(during),
               # the save's own share of the process's CPU and page faults from the call to commit: the
               # window's minus what the training steps in it cost without a save (robust to other load)
               "save_cpu_s": c - step_cpu * len(during), "train_step_cpu_s": step_cpu,
               "save_page_faults_mb": (f - step_faults * len(during)) * 4096 / MB,
               "save_stall_s": stall_s, "save_stall_page_faults_mb": stall_faults * 4096 / MB}
        out["train_time_lost_s"] = time_lost(out)
        return out

    def rss_peak(self, method: str) -> dict:
        """Peak RSS above the pre-call RSS of one save of ``method`` (call to commit), after returning free heap
        memory to the OS so that the save cannot hide in memory an earlier round left mapped."""
        import nxd_ckpt

        base = self.fresh("rss_" + method)
        nxd_ckpt.release_host_buffers()    # the peak counts nxd_ckpt's kept snapshot buffers, not the RSS before
        trim_heap()
        before = self.rss.rss()
        self.rss.start()
        if method.startswith("nxd_ckpt"):
            nxd_ckpt.save_checkpoint(base, f"rss_{self.counter}", async_save=method != "nxd_ckpt_sync",
                                     device_snapshot=method == "nxd_ckpt_async_device_snapshot",
                                     **self.save_kwargs())
            nxd_ckpt.finalize_checkpoint()
        elif method == "torch_xla_xser":
            import torch_xla.utils.serialization as xs

            xs.save(self.whole(), os.path.join(base, "model.pt"))
            fsync_tree(base)
        elif method == "torch_save":
            host = self.host_copy()
            with open(os.path.join(base, "model.pt"), "wb") as f:
                torch.save(host, f)
                os.fsync(f.fileno())
            del host
        elif method == "dcp_async":
            import torch.distributed.checkpoint as dcp

            host = self.host_copy()
            fut = dcp.async_save(host, checkpoint_id=os.path.join(base, "ckpt"), no_dist=True)
            del host
            getattr(fut, "upload_completion", fut).result()
        peak = self.rss.stop()
        self.discard(base)
        return {"host_rss_peak_mb": (peak - before) / MB, "host_rss_before_mb": before / MB,
                "host_rss_peak_abs_mb": peak / MB}

    def rss_growth(self, saves: int):
        """``saves`` consecutive async saves (each waited for; retention keeps 2) after one that is not counted.
        RSS after each (raw: includes free memory the allocator keeps), and live memory (RSS after malloc_trim)
        before the first and after the last: a leak grows the live memory, allocator retention does not."""
        import nxd_ckpt

        root = self.fresh("nxd_rss")
        series, steady = [], []
        nxd_ckpt.save_checkpoint(root, "rss_warmup", async_save=True, num_kept_ckpts=2, **self.save_kwargs())
        nxd_ckpt.finalize_checkpoint()
        trim_heap()
        live_before = self.rss.rss()
        self.rss.start()
        for i in range(saves):
            c = cpu_time()
            nxd_ckpt.save_checkpoint(root, f"rss_{i}", async_save=True, num_kept_ckpts=2, **self.save_kwargs())
            nxd_ckpt.finalize_checkpoint()
            if i >= 2:      # retention retired a tag before this save: it takes that tag's files over (reuse.py)
                steady.append((self.per_gb(cpu_time() - c), nxd_ckpt.save_stats()[-1]["commit_s"]))
            gc.collect()
            series.append(self.rss.rss() / MB)
        peak = self.rss.stop()
        trim_heap()
        live_after = self.rss.rss()
        self.discard(root)
        n = len(series)
        return {"saves": n, "rss_first_mb": series[0], "rss_last_mb": series[-1], "rss_max_mb": max(series),
                "growth_mb": series[-1] - series[0], "slope_mb_per_save": _slope(series),
                "slope_second_half_mb_per_save": _slope(series[n // 2:]),
                "live_before_mb": live_before / MB, "live_after_mb": live_after / MB,
                "live_growth_mb": (live_after - live_before) / MB,
                "peak_above_live_before_mb": (peak - live_before) / MB, "series_mb": series,
                # a training job's steady state: saves with num_kept_ckpts=2 after the first retention
                "steady_saves": len(steady),
                "steady_cpu_s_per_gb": med([x[0] for x in steady]) if steady else float("nan"),
                "steady_commit_s": med([x[1] for x in steady]) if steady else float("nan")}


def _slope(values):
    """Least-squares slope of ``values`` over their index (0 for fewer than 3)."""
    n = len(values)
    if n < 3:
        return 0.0
    mx, my = (n - 1) / 2, sum(values) / n
    return sum((i - mx) * (v - my) for i, v in enumerate(values)) / sum((i - mx) ** 2 for i in range(n))


# --- the run -------------------------------------------------------------------------------------------
def med(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else float("nan")


class LoadSampler:
    """The 1-minute load average every 15 s while the benchmark runs (other processes share the machine)."""

    def __init__(self):
        self.samples = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-load", daemon=True)
        self._thread.start()

    def _run(self):
        while True:
            self.samples.append(round(os.getloadavg()[0], 2))
            if self._stop.wait(15):
                return

    def stop(self):
        self._stop.set()
        self._thread.join()
        return self.samples


def run(args) -> dict:
    os.makedirs(args.dir, exist_ok=True)
    started = time.time()
    load_start = os.getloadavg()
    loads = LoadSampler()
    b = Bench(args)
    methods = [m for m in METHODS if not args.methods or m in args.methods.split(",")]
    print(f"bench: {b.bytes / GB:.3f} GB in {len(b.tensors)} tensors ({args.state}, hidden {b.hidden}) on {b.dev}; "
          f"page cache: {b.cache.mode}; {args.repeat} rounds + 1 warm-up", flush=True)
    lim = {"d2h_batched_s": [], "d2h_chunked_s": [], "h2d_s": [], "write_s": [], "read_s": [],
           "write_parallel_s": [], "read_parallel_s": [], "d2h_batched_page_faults_mb": [],
           "d2h_chunked_page_faults_mb": [], "d2h_batched_cpu_s_per_gb": [], "h2d_cpu_s_per_gb": [],
           "d2h_chunked_cpu_s_per_gb": [], "files_write_s": [], "files_write_cpu_s_per_gb": [], "files_read_s": [],
           "files_read_cpu_s_per_gb": [], "files_write_host_cpu_s_per_gb": []}
    res = {m: {} for m in methods}
    probe = os.path.join(b.dir, "disk_probe.bin")
    for rnd in range(args.repeat + 1):
        warm = rnd == 0
        t_round = time.perf_counter()
        trim_heap()
        c = cpu_time()
        d2h, host, d2h_faults = limit_d2h(b.tensors)
        d2h_cpu = b.per_gb(cpu_time() - c)
        trim_heap()
        c = cpu_time()
        h2d = limit_h2d(host, b.dev)
        h2d_cpu = b.per_gb(cpu_time() - c)
        del host
        trim_heap()
        c = cpu_time()
        d2hc, host, d2hc_faults = limit_d2h_chunked(b.tensors)
        d2hc_cpu = b.per_gb(cpu_time() - c)
        del host
        trim_heap()
        gc.collect()
        w, r = limit_disk(probe, b.bytes, b.cache)
        wp, rp = limit_disk_parallel(b.fresh("disk_probe_parallel"), b.bytes, b.cache, args.num_workers,
                                     remove=not args.keep_tags)
        if not warm:
            for k, v in (("d2h_batched_s", d2h), ("d2h_chunked_s", d2hc), ("h2d_s", h2d), ("write_s", w),
                         ("read_s", r), ("write_parallel_s", wp), ("read_parallel_s", rp),
                         ("d2h_batched_cpu_s_per_gb", d2h_cpu), ("d2h_batched_page_faults_mb", d2h_faults * 4096 / MB),
                         ("d2h_chunked_page_faults_mb", d2hc_faults * 4096 / MB), ("h2d_cpu_s_per_gb", h2d_cpu),
                         ("d2h_chunked_cpu_s_per_gb", d2hc_cpu)):
                lim[k].append(v)
        shift = rnd % len(methods)      # rotate the order so no method always runs right after another
        for m in methods[shift:] + methods[:shift]:
            out = getattr(b, "m_" + m)(check=warm)
            gc.collect()
            if not warm:
                for k, v in out.items():
                    res[m].setdefault(k, []).append(v)
            print(f"  round {rnd}{' (warm-up)' if warm else ''} {m}: "
                  + ", ".join(f"{k}={v:.3f}" for k, v in out.items()), flush=True)
        # after the methods: the file set is that of nxd_ckpt's first save (one file per tensor otherwise)
        fl = limit_files(b.fresh("files_floor"), b.file_set or [t.nbytes for t in b.tensors], b.cache,
                         args.num_workers, remove=not args.keep_tags)
        if not warm:
            for k in ("write", "read"):
                lim[f"files_{k}_s"].append(fl[f"{k}_s"])
                lim[f"files_{k}_cpu_s_per_gb"].append(b.per_gb(fl[f"{k}_cpu_s"]))
            lim["files_write_host_cpu_s_per_gb"].append(b.per_gb(fl["write_host_cpu_s"]))
        print(f"  round {rnd}: limits d2h={d2h:.3f} ({d2h_faults * 4096 / MB:.0f} MB faulted) "
              f"d2h_chunked={d2hc:.3f} ({d2hc_faults * 4096 / MB:.0f} MB faulted) h2d={h2d:.3f} write={w:.3f} "
              f"write_parallel={wp:.3f} read={r:.3f} read_parallel={rp:.3f} files_write={fl['write_s']:.3f} "
              f"({fl['write_cpu_s']:.2f} CPU-s) files_read={fl['read_s']:.3f} ({fl['read_cpu_s']:.2f} CPU-s) "
              f"({time.perf_counter() - t_round:.0f}s, load avg {os.getloadavg()[0]:.1f})", flush=True)
    b.cleanup()

    limits = {"d2h_batched_s": med(lim["d2h_batched_s"]), "h2d_s": med(lim["h2d_s"]),
              "disk_write_gbps": b.bytes / med(lim["write_s"]) / GB,
              "disk_read_gbps": b.bytes / med(lim["read_s"]) / GB,
              "d2h_chunked_s": med(lim["d2h_chunked_s"]),
              "disk_write_parallel_gbps": b.bytes / med(lim["write_parallel_s"]) / GB,
              "disk_read_parallel_gbps": b.bytes / med(lim["read_parallel_s"]) / GB,
              "d2h_batched_cpu_s_per_gb": med(lim["d2h_batched_cpu_s_per_gb"]),
              "d2h_chunked_cpu_s_per_gb": med(lim["d2h_chunked_cpu_s_per_gb"]),
              "h2d_cpu_s_per_gb": med(lim["h2d_cpu_s_per_gb"]),
              "files_n": len(b.file_set or b.tensors),
              "files_bytes": sum(b.file_set) if b.file_set else b.bytes,
              "files_source": "nxd_ckpt's first save" if b.file_set else "one file per tensor",
              "files_write_s": med(lim["files_write_s"]),
              "files_write_cpu_s_per_gb": med(lim["files_write_cpu_s_per_gb"]),
              "files_write_host_cpu_s_per_gb": med(lim["files_write_host_cpu_s_per_gb"]),
              "files_read_s": med(lim["files_read_s"]),
              "files_read_cpu_s_per_gb": med(lim["files_read_cpu_s_per_gb"]),
              "samples": lim}
    methods_out = {m: {k: med(v) for k, v in res[m].items()} for m in methods}
    for m in methods:
        methods_out[m]["samples"] = res[m]

    # Before the RSS peaks, which release nxd_ckpt's kept host buffers: the training loop is measured in the
    # steady state of a job that saves periodically (buffers kept from the previous save), not while its first
    # save after release_host_buffers() faults in fresh buffers in the background (README, "Levers measured").
    slow = None
    if not args.skip_train:
        runs = [b.train_step_slowdown() for _ in range(max(1, args.repeat))]
        slow = {"ratio": med([r["ratio"] for r in runs]), "runs": runs}
        print(f"  train step slowdown: {slow['ratio']:.2f}x ("
              + ", ".join(f"{r['ratio']:.2f}: save {r['save_cpu_s']:.2f} CPU-s, {r['save_page_faults_mb']:.0f} MB "
                          "faulted" for r in runs) + ")", flush=True)

    if not args.skip_rss:
        for m in methods:
            out = b.rss_peak(m)
            methods_out[m].update(out)
            print(f"  RSS {m}: peak {out['host_rss_peak_mb']:.0f} MB above {out['host_rss_before_mb']:.0f} MB",
                  flush=True)
    growth = None
    if args.rss_saves > 0:
        growth = b.rss_growth(args.rss_saves)
        print(f"  RSS over {growth['saves']} async saves: first {growth['rss_first_mb']:.0f} MB, "
              f"last {growth['rss_last_mb']:.0f} MB; live (after malloc_trim) {growth['live_before_mb']:.0f} -> "
              f"{growth['live_after_mb']:.0f} MB; steady state ({growth['steady_saves']} saves): "
              f"{growth['steady_cpu_s_per_gb']:.2f} CPU-s/GB, commit {growth['steady_commit_s']:.3f} s", flush=True)
        if "nxd_ckpt_async" in methods_out:
            methods_out["nxd_ckpt_async"]["host_rss_peak_over_saves_mb"] = growth["peak_above_live_before_mb"]

    b.cleanup()
    from nxd_ckpt.engine import get_engine

    pool = get_engine().buffers
    result = {
        "bytes": b.bytes,
        "host_buffer_pool_mb": pool.held_bytes / MB if pool is not None else 0.0,
        "limits": limits,
        "methods": methods_out,
        "train_step_slowdown": slow["ratio"] if slow else float("nan"),
        "train_step": slow,
        "rss_growth": growth,
        "config": {"size_gb": args.size_gb, "tensors": len(b.tensors), "state": args.state, "hidden": b.hidden,
                   "dir": b.dir,
                   "repeat": args.repeat, "keep_tags": args.keep_tags, "num_workers": args.num_workers,
                   "rss_saves": args.rss_saves, "train_dim": args.train_dim, "settle_removals": b.settled},
        "environment": dict(environment(b, load_start, started), loadavg_1min_every_15s=loads.stop()),
        "notes": {
            "page_cache": f"before every save and every load: sync + {b.cache.mode}",
            "heap": "before every method and every limit measurement: gc + glibc malloc_trim(0), so every "
                    "measurement starts with the same (trimmed) heap and pays its own page faults; without it "
                    "memory freed by one method and kept by the allocator sped up or slowed down the next at "
                    "random, and the 4 GB run ran out of memory. *_page_faults_mb: minor faults (4 KiB) "
                    "during the call",
            "stall_s": "wall time the caller is blocked",
            "commit_s": "call to the checkpoint durable and marked complete (nxd_ckpt: save_stats; dcp: future done; "
                        "sync methods: equal to their stall, not reported)",
            "load_s": "until every tensor is on the XLA device (wait_device_ops)",
            "host_rss_peak_mb": "one extra save per method after malloc_trim and nxd_ckpt.release_host_buffers() "
                                "(so nxd_ckpt's kept snapshot buffers count in the peak): peak RSS (psutil, 5 ms "
                                "sampling) from the call to commit minus RSS just before the call. On the XLA CPU "
                                "device the device memory is host memory too; it is in both terms",
            "disk_write_parallel_gbps": "the same bytes as 64 files written by num_workers threads, each fsynced, "
                                        "then the folder",
            "disk_read_parallel_gbps": "those 64 files read back (page cache dropped) by num_workers threads into "
                                       "fresh host tensors",
            "files_write_s": "per-file floor: files_n files of the sizes of nxd_ckpt's files (files_source), "
                             "written by num_workers threads with os.open/os.write/os.close, then one syncfs and "
                             "a folder fsync, measured after the methods of each round; files_write_cpu_s_per_gb: "
                             "process CPU time of that, per GB of state; files_write_host_cpu_s_per_gb: the host's "
                             "(/proc/stat), the kernel's writeback threads included",
            "files_read_s": "those files read back (page cache dropped) by num_workers threads with "
                            "os.open/os.readv/os.close into fresh host tensors; files_read_cpu_s_per_gb: its CPU",
            "cpu_s_per_gb": "process CPU time (every thread, user + system, getrusage) from the call to commit (sync "
                            "methods: to return) per GB saved; stall_cpu_s_per_gb: during the call only; "
                            "load_cpu_s_per_gb: of the load; host_cpu_s_per_gb: every core of the host (/proc/stat), "
                            "the kernel's writeback threads included, from the call to commit",
            "train_time_lost_s": "derived (bench.train_time_lost): training_steps during the save x (step time "
                                 "during - without), median over the runs",
            "train_step_slowdown": "median step time of a small XLA training loop while an async save runs, over "
                                   "the median without; measured after the methods' rounds and before the RSS "
                                   "peaks (nxd_ckpt's host buffers kept, as between a job's periodic saves). "
                                   "train_step.runs[].save_cpu_s / save_page_faults_mb: the process's CPU and "
                                   "minor faults from the call to commit minus those of the training steps in "
                                   "that window at their rate without a save (the stall included: no "
                                   "training step runs during it); save_stall_page_faults_mb: in the call",
            "peer_host_copy": "torch_save and dcp_async copy to host with nxd_ckpt.staging.copy_to_host",
            "d2h_chunked_s": "nxd_ckpt.staging.copy_to_host of the same tensors into fresh memory (nxd_ckpt's "
                             "snapshot without its kept buffers: what its first save costs)",
            "host_buffer_pool_mb": "host buffers nxd_ckpt keeps between saves at the end of the run "
                                   "(keep_host_buffers=True): live RSS a training process pays between saves",
            "GB": "1e9 bytes",
        },
    }
    result["targets"] = targets(result)
    return result


def environment(b, load_start, started):
    import torch_xla

    vm = psutil.virtual_memory()
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
    except OSError:
        rev = ""
    return {"python": platform.python_version(), "torch": torch.__version__, "torch_xla": torch_xla.__version__,
            "device": str(b.dev), "pjrt_device": os.environ.get("PJRT_DEVICE"), "cpus": os.cpu_count(),
            "mem_total_gb": vm.total / GB, "mem_available_gb_at_end": vm.available / GB,
            "loadavg_start": load_start, "loadavg_end": os.getloadavg(), "git": rev,
            "wall_s": time.time() - started, "page_cache": b.cache.mode}


#: Issue 13's targets (ratios measured side by side in one run).
CPU_S_PER_GB_MAX = 1.0
COMMIT_VS_PARALLEL_WRITE_MIN = 0.85
TRAIN_SLOWDOWN_MAX = 1.3
LOAD_VS_LIMIT_MAX = 1.2
LOAD_VS_XSER_MAX = 0.6
STALL_VS_D2H_MAX = 1.15
DEVICE_STALL_VS_D2H_MAX = 0.2


def targets(r: dict) -> dict:
    lim, m, nbytes_ = r["limits"], r["methods"], r["bytes"]
    out = {}

    def add(name, value, bound, ok, text):
        out[name] = {"value": value, "bound": bound, "met": bool(ok), "text": text}

    a = m.get("nxd_ckpt_async")
    x = m.get("torch_xla_xser")
    if a:
        add("cpu_s_per_gb", a["cpu_s_per_gb"], CPU_S_PER_GB_MAX, a["cpu_s_per_gb"] <= CPU_S_PER_GB_MAX,
            f"nxd_ckpt_async cpu_s_per_gb <= {CPU_S_PER_GB_MAX}")
        bound = STALL_VS_D2H_MAX * lim["d2h_batched_s"]
        add("async_stall_vs_d2h", a["stall_s"], bound, a["stall_s"] <= bound,
            f"nxd_ckpt_async stall_s <= {STALL_VS_D2H_MAX} x d2h_batched_s")
        thr = nbytes_ / a["commit_s"] / GB
        par = lim["disk_write_parallel_gbps"]
        workers = r["config"]["num_workers"]
        add("commit_throughput", thr, COMMIT_VS_PARALLEL_WRITE_MIN * par, thr >= COMMIT_VS_PARALLEL_WRITE_MIN * par,
            f"bytes / nxd_ckpt_async commit_s >= {COMMIT_VS_PARALLEL_WRITE_MIN} x {workers}-thread write+fsync (GB/s)")
        bound = LOAD_VS_LIMIT_MAX * (nbytes_ / (lim["disk_read_parallel_gbps"] * GB) + lim["h2d_s"])
        add("load_vs_limits", a["load_s"], bound, a["load_s"] <= bound,
            f"nxd_ckpt load_s <= {LOAD_VS_LIMIT_MAX} x (bytes / {workers}-thread read + h2d_s)")
        if x:
            add("load_vs_xser", a["load_s"], LOAD_VS_XSER_MAX * x["load_s"], a["load_s"] <= LOAD_VS_XSER_MAX * x["load_s"],
                f"nxd_ckpt load_s <= {LOAD_VS_XSER_MAX} x torch_xla_xser load_s")
            add("async_stall_vs_xser", a["stall_s"], 0.25 * x["stall_s"], a["stall_s"] <= 0.25 * x["stall_s"],
                "nxd_ckpt_async stall_s <= 0.25 x torch_xla_xser stall_s")
        if "host_rss_peak_mb" in a:
            bound = 1.2 * nbytes_ / MB + 300
            add("rss_peak", a["host_rss_peak_mb"], bound, a["host_rss_peak_mb"] <= bound,
                "host_rss_peak_mb <= 1.2 x staged bytes + 300 MB")
        # stricter extras, not among the targets
        add("extra_async_stall_vs_chunked_d2h", a["stall_s"], STALL_VS_D2H_MAX * lim["d2h_chunked_s"],
            a["stall_s"] <= STALL_VS_D2H_MAX * lim["d2h_chunked_s"],
            f"(extra) nxd_ckpt_async stall_s <= {STALL_VS_D2H_MAX} x d2h_chunked_s")
        bound = 0.85 * lim["disk_write_gbps"]
        add("extra_commit_vs_one_stream", thr, bound, thr >= bound,
            "(extra) bytes / nxd_ckpt_async commit_s >= 0.85 x one-stream write+fsync (GB/s)")
        if "files_write_s" in lim:
            _file_floor_targets(add, a, lim, nbytes_, workers)
    slow = r.get("train_step_slowdown")
    if slow is not None and not math.isnan(slow):
        add("train_step_slowdown", slow, TRAIN_SLOWDOWN_MAX, slow <= TRAIN_SLOWDOWN_MAX,
            f"train_step_slowdown during an async save <= {TRAIN_SLOWDOWN_MAX}")
    d = m.get("nxd_ckpt_async_device_snapshot")
    if d:
        bound = DEVICE_STALL_VS_D2H_MAX * lim["d2h_batched_s"]
        add("device_snapshot_stall", d["stall_s"], bound, d["stall_s"] <= bound,
            f"device snapshot stall_s <= {DEVICE_STALL_VS_D2H_MAX} x d2h_batched_s")
    g = r.get("rss_growth")
    if g:
        # "No growth": live memory (RSS after malloc_trim) after the last save is within a small allowance
        # (5% of the snapshot, at least 64 MB) of live memory before the first. The raw RSS after each save
        # (which includes freed memory glibc keeps for reuse) is reported next to it, and judged as an extra.
        bound = max(64.0, 0.05 * nbytes_ / MB)
        add("rss_no_growth", g["live_growth_mb"], bound, g["live_growth_mb"] <= bound,
            f"live RSS (after malloc_trim) after {g['saves']} consecutive async saves - before them <= {bound:.0f} MB")
        add("extra_raw_rss_no_growth", g["growth_mb"], bound, g["growth_mb"] <= bound,
            f"(extra) raw RSS after save {g['saves']} - after save 1 <= {bound:.0f} MB")
        if g.get("steady_saves"):
            v = g["steady_cpu_s_per_gb"]
            add("extra_steady_cpu_s_per_gb", v, CPU_S_PER_GB_MAX, v <= CPU_S_PER_GB_MAX,
                f"(extra) steady state, {g['steady_saves']} saves with num_kept_ckpts=2 after the first retention: "
                f"cpu_s_per_gb <= {CPU_S_PER_GB_MAX}")
            thr, par = nbytes_ / g["steady_commit_s"] / GB, lim["disk_write_parallel_gbps"]
            add("extra_steady_commit_throughput", thr, COMMIT_VS_PARALLEL_WRITE_MIN * par,
                thr >= COMMIT_VS_PARALLEL_WRITE_MIN * par,
                f"(extra) steady state: bytes / commit_s >= {COMMIT_VS_PARALLEL_WRITE_MIN} x write+fsync (GB/s)")
    return out


def _file_floor_targets(add, a: dict, lim: dict, nbytes_: int, workers: int) -> None:
    """(extra) nxd_ckpt_async against the per-file floor of its own file set (``limit_files``)."""
    n = lim["files_n"]
    # the CPU after the call (writers, sync, commit; the snapshot's copy is in the call) against the CPU of
    # writing the same files bare: the chunked d2h limit copies into fresh memory, a kept-buffer save does not
    after = a["cpu_s_per_gb"] - a["stall_cpu_s_per_gb"]
    bound = lim["files_write_cpu_s_per_gb"]
    add("extra_cpu_vs_file_floor", after, bound, after <= bound,
        f"(extra) nxd_ckpt_async CPU-s/GB after the call <= {n}-file write floor (CPU-s/GB)")
    thr, floor = nbytes_ / a["commit_s"] / GB, nbytes_ / lim["files_write_s"] / GB
    add("extra_commit_vs_file_floor", thr, COMMIT_VS_PARALLEL_WRITE_MIN * floor,
        thr >= COMMIT_VS_PARALLEL_WRITE_MIN * floor,
        f"(extra) bytes / nxd_ckpt_async commit_s >= {COMMIT_VS_PARALLEL_WRITE_MIN} x {n}-file {workers}-thread "
        "write + syncfs (GB/s)")
    bound = LOAD_VS_LIMIT_MAX * (lim["files_read_s"] + lim["h2d_s"])
    add("extra_load_vs_file_floor", a["load_s"], bound, a["load_s"] <= bound,
        f"(extra) nxd_ckpt load_s <= {LOAD_VS_LIMIT_MAX} x ({n}-file {workers}-thread read + h2d_s)")
    bound = lim["files_read_cpu_s_per_gb"] + lim["h2d_cpu_s_per_gb"]
    add("extra_load_cpu_vs_file_floor", a["load_cpu_s_per_gb"], bound, a["load_cpu_s_per_gb"] <= bound,
        f"(extra) nxd_ckpt load_cpu_s_per_gb <= {n}-file read + h2d (CPU-s/GB)")


def _slowdown_text(r: dict) -> str:
    slow = r.get("train_step_slowdown")
    if slow is None or math.isnan(slow):
        return "not measured (--skip-train)"
    lost = train_time_lost(r)
    return f"{slow:.2f}x" + (f" (training time lost per save {lost:.2f} s: {_steps_text(r)})" if lost else "")


def train_time_lost(r: dict) -> float:
    """Median over the training-loop runs of the training time one async save cost: the steps that ran during it
    times how much longer each took than without a save. What the median ratio leaves out is how long the save
    lasted: a save that finishes in a third of the steps at the same ratio costs training a third of the time.
    Derived from each run's fields, so older JSON files give it too; 0.0 when not measured."""
    runs = (r.get("train_step") or {}).get("runs") or []
    return statistics.median(time_lost(x) for x in runs) if runs else 0.0


def time_lost(run: dict) -> float:
    """The training time one measured save cost (one ``train_step_slowdown`` run)."""
    return run["steps_during_save"] * (run["step_s_during_save"] - run["step_s_without"])


def _steps_text(r: dict) -> str:
    runs = r["train_step"]["runs"]
    return "the save ran through " + " / ".join(str(x["steps_during_save"]) for x in runs) + " training steps"


def file_floor_text(r: dict) -> str:
    """One sentence: the per-file floor of this run and how far nxd_ckpt_async is above it ('' if not measured)."""
    lim, nb, w = r["limits"], r["bytes"], r["config"]["num_workers"]
    if "files_write_s" not in lim:
        return ""
    text = (f"Per-file floor for the same {lim['files_n']} files ({lim['files_source']}): {w} threads "
            f"os.open/write/close + one syncfs {lim['files_write_s']:.3f} s ({nb / lim['files_write_s'] / GB:.2f} "
            f"GB/s, {lim['files_write_cpu_s_per_gb']:.2f} CPU-s/GB{_host_text(lim)}), read back with "
            f"os.open/readv/close {lim['files_read_s']:.3f} s ({lim['files_read_cpu_s_per_gb']:.2f} CPU-s/GB)")
    a = r["methods"].get("nxd_ckpt_async")
    if a:
        after = a["cpu_s_per_gb"] - a["stall_cpu_s_per_gb"]
        text += (f"; `nxd_ckpt_async` spends {after:.2f} CPU-s/GB after the call, "
                 f"{after / lim['files_write_cpu_s_per_gb']:.2f}x the floor's write CPU, commit "
                 f"{a['commit_s'] / lim['files_write_s']:.2f}x its write time, load "
                 f"{a['load_s'] / (lim['files_read_s'] + lim['h2d_s']):.2f}x its read + host-to-device time and "
                 f"{a['load_cpu_s_per_gb'] / (lim['files_read_cpu_s_per_gb'] + lim['h2d_cpu_s_per_gb']):.2f}x "
                 "their CPU")
        if lim.get("files_write_host_cpu_s_per_gb") and a.get("host_cpu_s_per_gb") is not None:  # 0: below a tick
            text += (f"; the host's CPU for the whole save (the snapshot's copy included) "
                     f"{a['host_cpu_s_per_gb'] / lim['files_write_host_cpu_s_per_gb']:.2f}x the floor's write")
    return text + "."


def _host_text(lim: dict) -> str:
    """' of the process, H of the host' (H: the host's CPU-s/GB of the floor's write, the writeback threads
    included) when measured, else ''."""
    h = lim.get("files_write_host_cpu_s_per_gb")
    return f" of the process, {h:.2f} of the host" if h is not None else ""


def _num(x, width=10, digits=3):
    ok = isinstance(x, (int, float)) and not (isinstance(x, float) and math.isnan(x))
    return f"{x:{width}.{digits}f}" if ok else f"{'-':>{width}}"


def print_table(r: dict) -> None:
    lim, nb = r["limits"], r["bytes"]
    print()
    la = r["environment"].get("loadavg_1min_every_15s") or [float("nan")]
    w = r["config"]["num_workers"]
    print(f"{nb / GB:.3f} GB in {r['config']['tensors']} tensors ({r['config']['state']}), {r['config']['repeat']} "
          f"rounds (medians), page cache: {r['environment']['page_cache']}, 1-min load average during the run "
          f"{min(la):.1f}-{max(la):.1f} (median {statistics.median(la):.1f}) on {r['environment']['cpus']} CPUs")
    print(f"limits: d2h batched {lim['d2h_batched_s']:.3f} s ({lim['d2h_batched_cpu_s_per_gb']:.2f} CPU-s/GB; nxd "
          f"chunked {lim['d2h_chunked_s']:.3f} s), h2d {lim['h2d_s']:.3f} s, {w}-thread write+fsync "
          f"{lim['disk_write_parallel_gbps']:.3f} GB/s, {w}-thread read {lim['disk_read_parallel_gbps']:.3f} GB/s; "
          f"one stream: write+fsync {lim['disk_write_gbps']:.3f} GB/s, read {lim['disk_read_gbps']:.3f} GB/s")
    cols = (("stall_s", 3), ("commit_s", 3), ("GB/s", 3), ("load_s", 3), ("cpu_s_per_gb", 2),
            ("stall_cpu_s_per_gb", 2), ("host_cpu_s_per_gb", 2), ("load_cpu_s_per_gb", 2), ("stall_page_faults_mb", 0),
            ("host_rss_peak_mb", 0))
    print(f"{'method':<32}" + "".join(f"{c:>{max(10, len(c) + 1)}}" for c, _ in cols))
    for name, v in r["methods"].items():
        c = v.get("commit_s")
        v = dict(v, **{"GB/s": nb / c / GB if c else None})
        print(f"{name:<32}" + "".join(_num(v.get(k), max(10, len(k) + 1), d) for k, d in cols))
    if file_floor_text(r):
        print(file_floor_text(r))
    print(f"train step slowdown during an async save: {_slowdown_text(r)}; host buffers kept between "
          f"saves: {r.get('host_buffer_pool_mb', float('nan')):.0f} MB")
    print("targets:")
    for name, t in r["targets"].items():
        print(f"  [{'MET ' if t['met'] else 'MISS'}] {t['text']}: {t['value']:.3f} vs {t['bound']:.3f}")


def markdown(r: dict) -> str:
    """The README's tables for one run: methods, limits, and targets."""
    lim, nb, cfg = r["limits"], r["bytes"], r["config"]
    la = r["environment"].get("loadavg_1min_every_15s") or [float("nan")]
    w = cfg["num_workers"]
    f = lambda x, d=3: _num(x, 0, d).strip()  # noqa: E731
    lines = [f"**{nb / GB:.2f} GB in {cfg['tensors']} tensors ({cfg.get('state', 'fp32')})**, {cfg['repeat']} round(s) "
             f"after a warm-up (medians), 1-minute load average during the run {min(la):.0f} to {max(la):.0f} "
             f"(median {statistics.median(la):.0f}) on {r['environment']['cpus']} CPUs, git {r['environment']['git']}",
             "",
             "| method | stall s | commit s | load s | CPU-s/GB (save) | of which in the stall | host CPU-s/GB (save) | "
             "CPU-s/GB (load) | stall page faults MB | host RSS peak MB |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for name, v in r["methods"].items():
        lines.append(f"| `{name}` | {f(v.get('stall_s'))} | {f(v.get('commit_s'))} | {f(v.get('load_s'))} | "
                     f"{f(v.get('cpu_s_per_gb'), 2)} | {f(v.get('stall_cpu_s_per_gb'), 2)} | "
                     f"{f(v.get('host_cpu_s_per_gb'), 2)} | {f(v.get('load_cpu_s_per_gb'), 2)} | {f(v.get('stall_page_faults_mb'), 0)} | "
                     f"{f(v.get('host_rss_peak_mb'), 0)} |")
    kept = "Every save in a folder of its own, all removed at the end (`--keep-tags`). " \
        if r.get("config", {}).get("keep_tags") else ""
    lines += ["", f"{kept}Limits in the same run: batched device-to-host {lim['d2h_batched_s']:.3f} s "
              f"({lim['d2h_batched_cpu_s_per_gb']:.2f} CPU-s/GB), host-to-device {lim['h2d_s']:.3f} s "
              f"({lim['h2d_cpu_s_per_gb']:.2f} CPU-s/GB), {w}-thread "
              f"write+fsync {lim['disk_write_parallel_gbps']:.2f} GB/s, {w}-thread read "
              f"{lim['disk_read_parallel_gbps']:.2f} GB/s (one stream: write+fsync {lim['disk_write_gbps']:.2f} GB/s, "
              f"read {lim['disk_read_gbps']:.2f} GB/s). Training step slowdown during an async save: "
              f"{_slowdown_text(r)}. Host buffers kept between saves (`keep_host_buffers`): "
              f"{r.get('host_buffer_pool_mb', float('nan')):.0f} MB. {file_floor_text(r)}".rstrip(), "",
              "| target | value | bound | met |",
              "|---|---|---|---|"]
    for t in r["targets"].values():
        lines.append(f"| {t['text']} | {t['value']:.3f} | {t['bound']:.3f} | {'yes' if t['met'] else '**no**'} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size-gb", type=float, default=1.0)
    p.add_argument("--tensors", type=int, default=300, help="tensors in the model (parameters for bf16-adam)")
    p.add_argument("--state", choices=("fp32", "bf16-adam"), default="fp32",
                   help="fp32 model state, or bf16 parameters + fp32 Adam state (exp_avg, exp_avg_sq, step)")
    p.add_argument("--dir", default="/tmp/nxd_ckpt_bench")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--out", default=None)
    p.add_argument("--num-workers", type=int, default=8)
    p.add_argument("--rss-saves", type=int, default=20, help="consecutive async saves for the RSS growth check")
    p.add_argument("--train-steps", type=int, default=20, help="baseline steps before and after the save")
    p.add_argument("--train-dim", type=int, default=1024)
    p.add_argument("--keep-tags", action="store_true",
                   help="each save (and each limit's file set) in a folder of its own, all removed only at the end "
                        "of the run; the default removes a method's previous save right before its next one "
                        f"({KEEP_TAGS_WHY}). Needs disk for every save of the run")
    p.add_argument("--settle-timeout", type=float, default=420.0,
                   help="seconds to probe at the start until earlier file removals stop slowing file creation "
                        "(settle_removals; before probing, until 380 s after the last removal the scripts noted; once a "
                        "dear probe turns cheap, until 380 s after the start; 0: probe once and go on)")
    p.add_argument("--skip-train", action="store_true")
    p.add_argument("--skip-rss", action="store_true", help="skip the per-method RSS peak saves")
    p.add_argument("--methods", default="", help="comma-separated subset (development)")
    p.add_argument("--endpoint-url", default=None, help="S3 endpoint for --dir s3://... (else the AWS environment)")
    p.add_argument("--markdown", metavar="JSON", help="print the README tables of an earlier run's JSON and exit")
    args = p.parse_args(argv)
    if args.markdown:
        with open(args.markdown) as f:
            r = json.load(f)
        if "limits" not in r:   # an S3 run (--dir s3://...)
            from bench_s3 import markdown_s3

            print(markdown_s3(r), end="")
        else:
            print(markdown(r), end="")
        return 0
    if args.repeat < 1:
        p.error("--repeat must be >= 1")
    if args.dir.startswith("s3://"):
        from bench_s3 import print_s3, run_s3

        result = run_s3(args, build_state, xla)
        print_s3(result)
    else:
        result = run(args)
        print_table(result)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)) or ".", exist_ok=True)
        tmp = args.out + ".tmp"
        with open(tmp, "w") as f:
            json.dump(result, f, indent=1, default=float)
        os.replace(tmp, args.out)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
