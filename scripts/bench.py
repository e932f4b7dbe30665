#!/usr/bin/env python3
"""Benchmark nxd_ckpt's save and load against what the machine allows and against peer checkpointers.

One process, XLA device (``PJRT_DEVICE=CPU`` here; the code is device-agnostic). The state is a transformer-like
model state dict of ``--size-gb`` GB in ``--tensors`` float32 tensors on the XLA device (embedding, LM head and
four matrices per layer hold the bytes; biases and norms are many small vectors).

Measured (medians over ``--repeat`` rounds, after one warm-up round that is not counted; every method saves
the same tensors; before every save and every load the page cache is written back and dropped the same way):

- limits: one batched device-to-host copy of all tensors (``torch_xla._XLAC._xla_get_cpu_tensors``), one batched
  host-to-device copy (``xm.send_cpu_data_to_device``), write+fsync and read of the same number of bytes in
  64 MiB blocks to one file in ``--dir``;
- nxd_ckpt async (host snapshot), async with ``device_snapshot=True``, and sync: stall (call to return), commit
  (call to ``done`` being durable, from ``nxd_ckpt.save_stats()``) and load (``load_checkpoint`` into a dict of
  XLA tensors, until the device holds them); host RSS peak above the pre-save RSS for the async save;
- torch_xla_xser: ``torch_xla.utils.serialization.save`` + fsync of its files; load + batched host-to-device;
- torch_save: host copy + ``torch.save`` + fsync; ``torch.load`` + batched host-to-device;
- dcp_async: host copy + ``torch.distributed.checkpoint.async_save`` (no_dist); commit when its future is done.
  DCP's default stager cannot copy XLA storages, so the host copy is made by the caller and counted in the stall.
  The peers' host copies use the same routine as nxd_ckpt (``nxd_ckpt.staging.copy_to_host``);
- train_step_slowdown: median step time of a small XLA training loop (matmuls, each step synced) while an async
  save runs in the background, over the median step time without;
- RSS after each of ``--rss-saves`` consecutive async saves (first vs last).

Writes JSON (``--out``) and prints a table and a verdict per target.

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


def build_state(size_bytes: int, n_tensors: int, dev):
    shapes, hidden = state_shapes(size_bytes, n_tensors)
    gen = torch.Generator().manual_seed(1234)
    sd = {}
    for name, shape in shapes:
        sd[name] = torch.randn(shape, generator=gen).to(dev)
    torch_xla, _ = xla()
    torch_xla.sync()
    wait_device()
    return sd, hidden


def nbytes(sd) -> int:
    return sum(t.numel() * t.element_size() for t in sd.values())


# --- limits --------------------------------------------------------------------------------------------
def minor_faults() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def limit_d2h(sd):
    torch_xla, _ = xla()
    vals = list(sd.values())
    gc.collect()
    f = minor_faults()
    t = time.perf_counter()
    host = torch_xla._XLAC._xla_get_cpu_tensors(vals)
    dt = time.perf_counter() - t
    return dt, host, minor_faults() - f


def limit_d2h_chunked(sd):
    from nxd_ckpt.staging import copy_to_host

    gc.collect()
    f = minor_faults()
    t = time.perf_counter()
    host = copy_to_host(list(sd.values()))
    return time.perf_counter() - t, host, minor_faults() - f


def limit_h2d(host, dev):
    _, xm = xla()
    gc.collect()
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


def limit_disk_parallel(folder: str, total: int, cache: Cache, files: int = 64, threads: int = 8):
    """Write ``total`` bytes as ``files`` files from ``threads`` threads, each file fsynced, then the folder."""
    from concurrent.futures import ThreadPoolExecutor

    block = memoryview(bytearray(os.urandom(1 << 20)) * 16)
    shutil.rmtree(folder, ignore_errors=True)
    os.makedirs(folder)
    cache.drop()
    per = -(-total // files)

    def one(i):
        fd = os.open(os.path.join(folder, f"f{i}"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            left = min(per, total - i * per)
            while left > 0:
                left -= os.write(fd, block[:min(left, len(block))])
            os.fsync(fd)
        finally:
            os.close(fd)

    t = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(one, range(files)))
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    os.fsync(fd)
    os.close(fd)
    dt = time.perf_counter() - t
    shutil.rmtree(folder, ignore_errors=True)
    return dt


# --- methods -------------------------------------------------------------------------------------------
class Bench:
    def __init__(self, args):
        self.args = args
        self.dir = os.path.abspath(args.dir)
        self.cache = Cache()
        self.dev = device()
        self.sd, self.hidden = build_state(int(args.size_gb * GB), args.tensors, self.dev)
        self.bytes = nbytes(self.sd)
        self.rss = RssSampler()
        self.counter = 0
        self.created = set()

    def settle(self, path):
        """The same starting point for every measurement: a trimmed heap and no cached pages of ``path``."""
        trim_heap()
        self.cache.drop(path)

    def cleanup(self):
        for path in sorted(self.created):
            shutil.rmtree(path, ignore_errors=True)

    def fresh(self, name):
        """A new empty path for one save under --dir; earlier ones are removed first, then the cache is dropped."""
        self.counter += 1
        base = os.path.join(self.dir, name)
        self.created.add(base)
        shutil.rmtree(base, ignore_errors=True)
        os.makedirs(base, exist_ok=True)
        self.settle(base)
        return base

    # nxd_ckpt
    def nxd_save(self, root, async_save, device_snapshot):
        import nxd_ckpt

        tag = f"step_{self.counter}"
        f = minor_faults()
        t = time.perf_counter()
        nxd_ckpt.save_checkpoint(root, tag, model=self.sd, async_save=async_save, device_snapshot=device_snapshot,
                                 num_workers=self.args.num_workers)
        stall = time.perf_counter() - t
        faults = minor_faults() - f
        nxd_ckpt.finalize_checkpoint()
        finalized = time.perf_counter() - t
        out = {"stall_s": stall, "finalize_s": finalized, "stall_page_faults_mb": faults * 4096 / MB}
        st = nxd_ckpt.save_stats()[-1]
        assert st.get("ok", True) and st["tag"] == tag, st
        out["commit_s"] = st["commit_s"]
        out["write_done_s"] = st.get("write_done_s", float("nan"))
        out["stall_reported_s"] = st["stall_s"]
        return out, tag

    def nxd_load(self, root, tag, check=False):
        import nxd_ckpt

        target = dict(self.sd)
        self.settle(root)
        t = time.perf_counter()
        nxd_ckpt.load_checkpoint(root, tag, model=target)
        wait_device()
        dt = time.perf_counter() - t
        if check:
            self._check(target)
        del target
        return dt

    def _check(self, loaded):
        torch_xla, _ = xla()
        keys = list(self.sd)
        keys = keys[:2] + keys[len(keys) // 2:len(keys) // 2 + 1] + keys[-2:]
        a = torch_xla._XLAC._xla_get_cpu_tensors([self.sd[k] for k in keys])
        b = torch_xla._XLAC._xla_get_cpu_tensors([loaded[k] for k in keys])
        for k, x, y in zip(keys, a, b):
            if loaded[k].device.type != "xla" or not torch.equal(x, y):
                raise SystemExit(f"bench: loaded tensor {k} differs from the saved one")

    def m_nxd_ckpt_async(self, check):
        root = self.fresh("nxd_async")
        out, tag = self.nxd_save(root, True, False)
        out["load_s"] = self.nxd_load(root, tag, check)
        return out

    def m_nxd_ckpt_async_device_snapshot(self, check):
        root = self.fresh("nxd_async_dev")
        out, tag = self.nxd_save(root, True, True)
        if check:
            out["load_s_unrequired"] = self.nxd_load(root, tag, check)
            trim_heap()
        return out

    def m_nxd_ckpt_sync(self, check):
        root = self.fresh("nxd_sync")
        out, tag = self.nxd_save(root, False, False)
        out["load_s"] = self.nxd_load(root, tag, check)
        return out

    # peers
    def host_copy(self):
        from nxd_ckpt.staging import copy_to_host

        keys = list(self.sd)
        return dict(zip(keys, copy_to_host([self.sd[k] for k in keys])))

    def to_device(self, host_sd):
        _, xm = xla()
        keys = list(host_sd)
        moved = xm.send_cpu_data_to_device([host_sd[k] for k in keys], self.dev)
        wait_device()
        return dict(zip(keys, moved))

    def m_torch_xla_xser(self, check):
        import torch_xla.utils.serialization as xs

        base = self.fresh("xser")
        path = os.path.join(base, "model.pt")
        t = time.perf_counter()
        xs.save(self.sd, path)
        fsync_tree(path)
        fsync_tree(path + ".tensors")
        stall = time.perf_counter() - t
        self.settle(base)
        t = time.perf_counter()
        loaded = self.to_device(xs.load(path))
        load_s = time.perf_counter() - t
        if check:
            self._check(loaded)
        del loaded
        return {"stall_s": stall, "load_s": load_s}

    def m_torch_save(self, check):
        base = self.fresh("torch_save")
        path = os.path.join(base, "model.pt")
        t = time.perf_counter()
        host = self.host_copy()
        with open(path, "wb") as f:
            torch.save(host, f)
            f.flush()
            os.fsync(f.fileno())
        fsync_tree(path)
        stall = time.perf_counter() - t
        del host
        self.settle(base)
        t = time.perf_counter()
        loaded = self.to_device(torch.load(path, weights_only=True))
        load_s = time.perf_counter() - t
        if check:
            self._check(loaded)
        del loaded
        return {"stall_s": stall, "load_s": load_s}

    def m_dcp_async(self, check):
        import torch.distributed.checkpoint as dcp

        base = self.fresh("dcp")
        path = os.path.join(base, "ckpt")
        t = time.perf_counter()
        host = self.host_copy()
        fut = dcp.async_save(host, checkpoint_id=path, no_dist=True)
        stall = time.perf_counter() - t
        del host
        fut = getattr(fut, "upload_completion", fut)
        fut.result()
        commit = time.perf_counter() - t
        return {"stall_s": stall, "commit_s": commit}

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
        base = [step() for _ in range(self.args.train_steps)]
        root = self.fresh("nxd_train")
        done = threading.Event()
        nxd_ckpt.save_checkpoint(root, f"step_{self.counter}", model=self.sd, async_save=True,
                                 num_workers=self.args.num_workers)
        waiter = threading.Thread(target=lambda: (nxd_ckpt.finalize_checkpoint(), done.set()), daemon=True)
        waiter.start()
        during = []
        while not done.is_set():
            during.append(step())
        waiter.join()
        after = [step() for _ in range(self.args.train_steps)]
        baseline = statistics.median(base + after)
        loaded = statistics.median(during) if during else baseline
        return {"ratio": loaded / baseline, "step_s_without": baseline, "step_s_during_save": loaded,
                "steps_during_save": len(during)}

    def rss_peak(self, method: str) -> dict:
        """Peak RSS above the pre-call RSS of one save of ``method`` (call to commit), after returning free heap
        memory to the OS so that the save cannot hide in memory an earlier round left mapped."""
        import nxd_ckpt

        base = self.fresh("rss_" + method)
        trim_heap()
        before = self.rss.rss()
        self.rss.start()
        if method.startswith("nxd_ckpt"):
            nxd_ckpt.save_checkpoint(base, f"rss_{self.counter}", model=self.sd, async_save=method != "nxd_ckpt_sync",
                                     device_snapshot=method == "nxd_ckpt_async_device_snapshot",
                                     num_workers=self.args.num_workers)
            nxd_ckpt.finalize_checkpoint()
        elif method == "torch_xla_xser":
            import torch_xla.utils.serialization as xs

            xs.save(self.sd, os.path.join(base, "model.pt"))
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
        shutil.rmtree(base, ignore_errors=True)
        return {"host_rss_peak_mb": (peak - before) / MB, "host_rss_before_mb": before / MB,
                "host_rss_peak_abs_mb": peak / MB}

    def rss_growth(self, saves: int):
        """``saves`` consecutive async saves (each waited for; retention keeps 2) after one that is not counted.
        RSS after each (raw: includes free memory the allocator keeps), and live memory (RSS after malloc_trim)
        before the first and after the last: a leak grows the live memory, allocator retention does not."""
        import nxd_ckpt

        root = self.fresh("nxd_rss")
        series = []
        nxd_ckpt.save_checkpoint(root, "rss_warmup", model=self.sd, async_save=True, num_kept_ckpts=2,
                                 num_workers=self.args.num_workers)
        nxd_ckpt.finalize_checkpoint()
        trim_heap()
        live_before = self.rss.rss()
        self.rss.start()
        for i in range(saves):
            nxd_ckpt.save_checkpoint(root, f"rss_{i}", model=self.sd, async_save=True, num_kept_ckpts=2,
                                     num_workers=self.args.num_workers)
            nxd_ckpt.finalize_checkpoint()
            gc.collect()
            series.append(self.rss.rss() / MB)
        peak = self.rss.stop()
        trim_heap()
        live_after = self.rss.rss()
        shutil.rmtree(root, ignore_errors=True)
        n = len(series)
        return {"saves": n, "rss_first_mb": series[0], "rss_last_mb": series[-1], "rss_max_mb": max(series),
                "growth_mb": series[-1] - series[0], "slope_mb_per_save": _slope(series),
                "slope_second_half_mb_per_save": _slope(series[n // 2:]),
                "live_before_mb": live_before / MB, "live_after_mb": live_after / MB,
                "live_growth_mb": (live_after - live_before) / MB,
                "peak_above_live_before_mb": (peak - live_before) / MB, "series_mb": series}


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
    print(f"bench: {b.bytes / GB:.3f} GB in {args.tensors} tensors (hidden {b.hidden}) on {b.dev}; "
          f"page cache: {b.cache.mode}; {args.repeat} rounds + 1 warm-up", flush=True)
    lim = {"d2h_batched_s": [], "d2h_chunked_s": [], "h2d_s": [], "write_s": [], "read_s": [],
           "write_parallel_s": [], "d2h_batched_page_faults_mb": [], "d2h_chunked_page_faults_mb": []}
    res = {m: {} for m in methods}
    probe = os.path.join(b.dir, "disk_probe.bin")
    for rnd in range(args.repeat + 1):
        warm = rnd == 0
        t_round = time.perf_counter()
        trim_heap()
        d2h, host, d2h_faults = limit_d2h(b.sd)
        h2d = limit_h2d(host, b.dev)
        del host
        trim_heap()
        d2hc, host, d2hc_faults = limit_d2h_chunked(b.sd)
        del host
        trim_heap()
        gc.collect()
        w, r = limit_disk(probe, b.bytes, b.cache)
        wp = limit_disk_parallel(os.path.join(b.dir, "disk_probe_parallel"), b.bytes, b.cache)
        if not warm:
            for k, v in (("d2h_batched_s", d2h), ("d2h_chunked_s", d2hc), ("h2d_s", h2d), ("write_s", w),
                         ("read_s", r), ("write_parallel_s", wp), ("d2h_batched_page_faults_mb", d2h_faults * 4096 / MB),
                         ("d2h_chunked_page_faults_mb", d2hc_faults * 4096 / MB)):
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
        print(f"  round {rnd}: limits d2h={d2h:.3f} ({d2h_faults * 4096 / MB:.0f} MB faulted) "
              f"d2h_chunked={d2hc:.3f} ({d2hc_faults * 4096 / MB:.0f} MB faulted) h2d={h2d:.3f} write={w:.3f} "
              f"write_parallel={wp:.3f} read={r:.3f} "
              f"({time.perf_counter() - t_round:.0f}s, load avg {os.getloadavg()[0]:.1f})", flush=True)
    b.cleanup()

    limits = {"d2h_batched_s": med(lim["d2h_batched_s"]), "h2d_s": med(lim["h2d_s"]),
              "disk_write_gbps": b.bytes / med(lim["write_s"]) / GB,
              "disk_read_gbps": b.bytes / med(lim["read_s"]) / GB,
              "d2h_chunked_s": med(lim["d2h_chunked_s"]),
              "disk_write_parallel_gbps": b.bytes / med(lim["write_parallel_s"]) / GB,
              "samples": lim}
    methods_out = {m: {k: med(v) for k, v in res[m].items()} for m in methods}
    for m in methods:
        methods_out[m]["samples"] = res[m]

    if not args.skip_rss:
        for m in methods:
            out = b.rss_peak(m)
            methods_out[m].update(out)
            print(f"  RSS {m}: peak {out['host_rss_peak_mb']:.0f} MB above {out['host_rss_before_mb']:.0f} MB",
                  flush=True)

    slow = None
    if not args.skip_train:
        runs = [b.train_step_slowdown() for _ in range(max(1, args.repeat))]
        slow = {"ratio": med([r["ratio"] for r in runs]), "runs": runs}
        print(f"  train step slowdown: {slow['ratio']:.2f}x "
              "(" + ", ".join(f"{r['ratio']:.2f}" for r in runs) + ")", flush=True)
    growth = None
    if args.rss_saves > 0:
        growth = b.rss_growth(args.rss_saves)
        print(f"  RSS over {growth['saves']} async saves: first {growth['rss_first_mb']:.0f} MB, "
              f"last {growth['rss_last_mb']:.0f} MB; live (after malloc_trim) {growth['live_before_mb']:.0f} -> "
              f"{growth['live_after_mb']:.0f} MB", flush=True)
        if "nxd_ckpt_async" in methods_out:
            methods_out["nxd_ckpt_async"]["host_rss_peak_over_saves_mb"] = growth["peak_above_live_before_mb"]

    b.cleanup()
    result = {
        "bytes": b.bytes,
        "limits": limits,
        "methods": methods_out,
        "train_step_slowdown": slow["ratio"] if slow else float("nan"),
        "train_step": slow,
        "rss_growth": growth,
        "config": {"size_gb": args.size_gb, "tensors": args.tensors, "hidden": b.hidden, "dir": b.dir,
                   "repeat": args.repeat, "num_workers": args.num_workers, "rss_saves": args.rss_saves,
                   "train_dim": args.train_dim},
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
            "host_rss_peak_mb": "one extra save per method after malloc_trim: peak RSS (psutil, 5 ms sampling) from "
                                "the call to commit minus RSS just before the call. On the XLA CPU device the "
                                "device memory is host memory too; it is in both terms",
            "disk_write_parallel_gbps": "extra: the same bytes as 64 files from 8 threads, each fsynced",
            "peer_host_copy": "torch_save and dcp_async copy to host with nxd_ckpt.staging.copy_to_host",
            "d2h_chunked_s": "nxd_ckpt.staging.copy_to_host of the same tensors (what nxd_ckpt's snapshot runs)",
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


def targets(r: dict) -> dict:
    lim, m, nbytes_ = r["limits"], r["methods"], r["bytes"]
    out = {}

    def add(name, value, bound, ok, text):
        out[name] = {"value": value, "bound": bound, "met": bool(ok), "text": text}

    a = m.get("nxd_ckpt_async")
    x = m.get("torch_xla_xser")
    if a:
        add("async_stall_vs_d2h", a["stall_s"], 1.15 * lim["d2h_batched_s"],
            a["stall_s"] <= 1.15 * lim["d2h_batched_s"], "nxd_ckpt_async stall_s <= 1.15 x d2h_batched_s")
        if x:
            add("async_stall_vs_xser", a["stall_s"], 0.25 * x["stall_s"], a["stall_s"] <= 0.25 * x["stall_s"],
                "nxd_ckpt_async stall_s <= 0.25 x torch_xla_xser stall_s")
        thr = nbytes_ / a["commit_s"] / GB
        add("commit_throughput", thr, 0.85 * lim["disk_write_gbps"], thr >= 0.85 * lim["disk_write_gbps"],
            "bytes / nxd_ckpt_async commit_s >= 0.85 x disk_write_gbps (GB/s)")
        if x:
            add("load_vs_xser", a["load_s"], x["load_s"], a["load_s"] <= x["load_s"],
                "nxd_ckpt load_s <= torch_xla_xser load_s")
        bound = 1.2 * (nbytes_ / (lim["disk_read_gbps"] * GB) + lim["h2d_s"])
        add("load_vs_limits", a["load_s"], bound, a["load_s"] <= bound,
            "nxd_ckpt load_s <= 1.2 x (bytes / disk_read + h2d_s)")
        if "host_rss_peak_mb" in a:
            bound = 1.2 * nbytes_ / MB + 300
            add("rss_peak", a["host_rss_peak_mb"], bound, a["host_rss_peak_mb"] <= bound,
                "host_rss_peak_mb <= 1.2 x staged bytes + 300 MB")
        # stricter extras, not among the targets: against the chunked D2H nxd_ckpt runs and a parallel writer
        add("extra_async_stall_vs_chunked_d2h", a["stall_s"], 1.15 * lim["d2h_chunked_s"],
            a["stall_s"] <= 1.15 * lim["d2h_chunked_s"], "(extra) nxd_ckpt_async stall_s <= 1.15 x d2h_chunked_s")
        par = lim.get("disk_write_parallel_gbps")
        if par:
            add("extra_commit_vs_parallel_disk", thr, 0.85 * par, thr >= 0.85 * par,
                "(extra) bytes / nxd_ckpt_async commit_s >= 0.85 x 8-thread disk write (GB/s)")
    d = m.get("nxd_ckpt_async_device_snapshot")
    if d:
        add("device_snapshot_stall", d["stall_s"], 0.2 * lim["d2h_batched_s"],
            d["stall_s"] <= 0.2 * lim["d2h_batched_s"], "device snapshot stall_s <= 0.2 x d2h_batched_s")
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
    return out


def print_table(r: dict) -> None:
    lim, nb = r["limits"], r["bytes"]
    print()
    la = r["environment"].get("loadavg_1min_every_15s") or [float("nan")]
    print(f"{nb / GB:.3f} GB in {r['config']['tensors']} tensors, {r['config']['repeat']} rounds (medians), "
          f"page cache: {r['environment']['page_cache']}, 1-min load average during the run "
          f"{min(la):.1f}-{max(la):.1f} (median {statistics.median(la):.1f}) on {r['environment']['cpus']} CPUs")
    print(f"limits: d2h batched {lim['d2h_batched_s']:.3f} s (nxd chunked {lim['d2h_chunked_s']:.3f} s), "
          f"h2d {lim['h2d_s']:.3f} s, disk write {lim['disk_write_gbps']:.3f} GB/s "
          f"({nb / GB / lim['disk_write_gbps']:.2f} s), read {lim['disk_read_gbps']:.3f} GB/s "
          f"({nb / GB / lim['disk_read_gbps']:.2f} s); extra: 8-thread write {lim['disk_write_parallel_gbps']:.3f} GB/s")
    print(f"{'method':<32}{'stall_s':>10}{'commit_s':>10}{'GB/s':>8}{'load_s':>10}{'rss_mb':>9}")
    for name, v in r["methods"].items():
        c = v.get("commit_s")
        f = (lambda x: f"{x:10.3f}" if isinstance(x, (int, float)) and not math.isnan(x) else f"{'-':>10}")
        gbps = f"{nb / c / GB:8.3f}" if c else f"{'-':>8}"
        rss = v.get("host_rss_peak_mb")
        print(f"{name:<32}{f(v.get('stall_s'))}{f(c)}{gbps}{f(v.get('load_s'))}"
              f"{(f'{rss:9.0f}' if rss is not None else f'{chr(45):>9}')}")
    print(f"train step slowdown during an async save: {r['train_step_slowdown']:.2f}x")
    print("targets:")
    for name, t in r["targets"].items():
        print(f"  [{'MET ' if t['met'] else 'MISS'}] {t['text']}: {t['value']:.3f} vs {t['bound']:.3f}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size-gb", type=float, default=1.0)
    p.add_argument("--tensors", type=int, default=300)
    p.add_argument("--dir", default="/tmp/nxd_ckpt_bench")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--out", default=None)
    p.add_argument("--num-workers", type=int, default=8)
    p.add_argument("--rss-saves", type=int, default=20, help="consecutive async saves for the RSS growth check")
    p.add_argument("--train-steps", type=int, default=20, help="baseline steps before and after the save")
    p.add_argument("--train-dim", type=int, default=1024)
    p.add_argument("--skip-train", action="store_true")
    p.add_argument("--skip-rss", action="store_true", help="skip the per-method RSS peak saves")
    p.add_argument("--methods", default="", help="comma-separated subset (development)")
    args = p.parse_args(argv)
    if args.repeat < 1:
        p.error("--repeat must be >= 1")
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
