"""Device -> host snapshot into bounded host memory.

The training thread blocks here, and only here, during an async save: the batched transfer of this
rank's planned XLA tensors (``torch_xla._XLAC._xla_get_cpu_tensors``; pending graphs are materialised
first, all in one execution), host-tensor copies for CPU tensors (Adam's ``step``). A HostBudget bounds
the bytes held by snapshots that are not yet written; a snapshot larger than what is free waits for
writers to release.

The batched transfer is issued in sub-batches of at most ``D2H_BATCH_BYTES``: ``_xla_get_cpu_tensors``
stages every tensor through an intermediate host literal before building the CPU tensor, so one call
over a whole snapshot holds twice the snapshot at its peak, and whatever the allocator does not have at
hand is page-faulted in (the dominant cost: ~0.3-0.9 s per GB here). Sub-batches recycle a small
literal buffer, so only the snapshot itself can need fresh pages. Measured on the XLA CPU device (2
cores), 1 GB in 300 tensors: one call 0.2 s with warm memory, 0.6-0.9 s when it faulted in 0.9-1.7 GB;
sub-batches 0.2-0.3 s. Sub-batches are fetched by ``D2H_THREADS`` threads.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import List, Optional, Sequence

import torch

log = logging.getLogger("nxd_ckpt")


def is_xla(t: torch.Tensor) -> bool:
    return t.device.type == "xla"


def default_host_budget(local_world_size: int) -> int:
    """Half of the host's available RAM shared by the ranks of this node, at least 256 MiB."""
    import psutil

    avail = psutil.virtual_memory().available
    return max(256 << 20, int(avail * 0.5) // max(1, local_world_size))


class HostBudget:
    """A byte-counting semaphore for host memory held by snapshots awaiting their write."""

    def __init__(self, capacity: int):
        if capacity <= 0:
            raise ValueError(f"host memory budget must be positive, got {capacity}")
        self.capacity = int(capacity)
        self.used = 0
        self._cond = threading.Condition()

    def lease(self, nbytes: int, timeout: float) -> "HostLease":
        """Take ``nbytes`` as a lease; block until they are free. A request above capacity waits for an empty
        budget and is then granted alone. Raises TimeoutError after ``timeout``. The only way to take
        budget; :meth:`HostLease.release` is the only way to give it back."""
        start = time.monotonic()
        need = min(nbytes, self.capacity)
        with self._cond:
            ok = self._cond.wait_for(lambda: self.capacity - self.used >= need, timeout=timeout)
            if not ok:
                raise TimeoutError(
                    f"waited {timeout:.0f}s for {nbytes} bytes of host staging memory "
                    f"({self.used} of {self.capacity} still held by unfinished writes)"
                )
            self.used += nbytes
        return HostLease(self, nbytes, time.monotonic() - start)

    def _give_back(self, nbytes: int) -> None:
        with self._cond:
            self.used = max(0, self.used - nbytes)
            self._cond.notify_all()


class HostLease:
    """Bytes taken from a HostBudget, given back exactly once, by :meth:`release` (and nowhere else).

    A snapshot chunk takes one lease and hands a ``part`` of it to each file it feeds to the writers; each
    part is released when its file is written or dropped, and what the chunk did not hand out is released
    when its ``with`` block ends (a failed copy never leaks budget)."""

    def __init__(self, budget: Optional[HostBudget], nbytes: int, waited_s: float = 0.0):
        self._budget = budget
        self._lock = threading.Lock()
        self.nbytes = int(nbytes)
        self.waited_s = waited_s

    def part(self, nbytes: int) -> "HostLease":
        """Move ``nbytes`` (at most what is left) of this lease to a new lease."""
        with self._lock:
            moved = min(int(nbytes), self.nbytes)
            self.nbytes -= moved
        return HostLease(self._budget, moved)

    def release(self) -> None:
        with self._lock:
            nbytes, self.nbytes = self.nbytes, 0
        if nbytes and self._budget is not None:
            self._budget._give_back(nbytes)

    def __enter__(self) -> "HostLease":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def no_lease() -> HostLease:
    """The lease of a file whose bytes are not counted against the budget (small pickled state)."""
    return HostLease(None, 0)


def copy_to_host(tensors: Sequence[torch.Tensor]) -> List[torch.Tensor]:
    """Host copies of ``tensors`` (same order): XLA tensors in one batched transfer, CPU tensors cloned
    compactly (a view of a large storage becomes a tensor of its own bytes)."""
    out: List[torch.Tensor] = [None] * len(tensors)  # type: ignore[list-item]
    xla_idx = [i for i, t in enumerate(tensors) if is_xla(t)]
    if xla_idx:
        for i, host in zip(xla_idx, _xla_to_cpu([tensors[i] for i in xla_idx])):
            out[i] = host
    for i, t in enumerate(tensors):
        if out[i] is None:
            out[i] = t.detach().clone(memory_format=torch.contiguous_format)
    return out


#: Largest sub-batch of one ``_xla_get_cpu_tensors`` call (a larger tensor forms a sub-batch of its own).
D2H_BATCH_BYTES = 32 << 20
#: Sub-batches in flight at once. The call releases the GIL and its host-side copies run on the calling
#: thread, so two threads use two cores: 1 GB in 300 tensors took 0.15-0.16 s instead of 0.19-0.27 s
#: sequentially (2-core host). The training thread waits for the snapshot anyway.
D2H_THREADS = max(1, min(4, os.cpu_count() or 1))

_pool: Optional[ThreadPoolExecutor] = None
_pool_lock = threading.Lock()


def _d2h_pool() -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(max_workers=D2H_THREADS, thread_name_prefix="nxd_ckpt-d2h")
        return _pool


def _xla_to_cpu(tensors: List[torch.Tensor]) -> List[torch.Tensor]:
    import torch_xla

    xlac = getattr(torch_xla, "_XLAC", None)
    get_cpu = getattr(xlac, "_xla_get_cpu_tensors", None)
    if get_cpu is None:  # older or newer torch-xla without the batched call
        return [t.detach().cpu() for t in tensors]
    tensors = [t.detach() for t in tensors]
    batches = chunk_by_bytes([t.numel() * t.element_size() for t in tensors], D2H_BATCH_BYTES)
    if len(batches) == 1:
        return list(get_cpu(tensors))
    _materialize(xlac, tensors)
    fetch = lambda batch: get_cpu([tensors[i] for i in batch])  # noqa: E731
    if D2H_THREADS > 1:
        results = list(_d2h_pool().map(fetch, batches))
    else:
        results = [fetch(b) for b in batches]
    return [t for r in results for t in r]


def _materialize(xlac, tensors: List[torch.Tensor]) -> None:
    """Run the pending computations of ``tensors`` as one graph, so that fetching them in sub-batches does
    not execute (and compile) one graph per sub-batch. Costs under a millisecond when nothing is pending."""
    need = getattr(xlac, "_check_tensor_need_materialization", None)
    try:
        pending = any(need(tensors)) if need is not None else True
    except (RuntimeError, TypeError):
        pending = True
    if pending:
        xlac._xla_sync_multi(tensors, devices=[], wait=True, sync_xla_data=False)


def device_snapshot(tensors: Sequence[torch.Tensor]) -> List[torch.Tensor]:
    """Snapshot XLA tensors on the device without a host copy: lazy clones that pin the current
    (immutable) device buffers, launched asynchronously. CPU tensors are cloned on the host.
    Costs device memory equal to the snapshot until the background moves it to host."""
    out = []
    xla = []
    for t in tensors:
        if is_xla(t):
            c = t.detach().clone()
            xla.append(c)
            out.append(c)
        else:
            out.append(t.detach().clone(memory_format=torch.contiguous_format))
    if xla:
        import torch_xla

        torch_xla._XLAC._xla_sync_multi(xla, devices=[], wait=False, sync_xla_data=False)
    return out


_malloc_trim = None


def release_host_memory() -> None:
    """Give the heap memory a finished save freed back to the OS (glibc ``malloc_trim``; a no-op elsewhere).

    The snapshot is allocated by torch-xla in the threads that fetch it and freed by the writer threads;
    glibc keeps freed memory in per-thread arenas, so without this the process RSS climbed by about a
    snapshot's size every few saves (4 GB state: 9.3 -> 14.4 GB over 20 saves) although live memory did
    not grow. The cost: the next snapshot faults its pages in afresh (included in the benchmark's stall)."""
    global _malloc_trim
    if _malloc_trim is None:
        try:
            import ctypes
            import ctypes.util

            _malloc_trim = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
        except (OSError, AttributeError):
            _malloc_trim = False
    if _malloc_trim:
        try:
            _malloc_trim(0)
        except Exception:  # noqa: BLE001 - an optimisation; never let it disturb a save
            pass


def chunk_by_bytes(nbytes: Sequence[int], limit: int) -> List[List[int]]:
    """Consecutive index groups whose byte totals stay within ``limit`` (an oversize item stands alone)."""
    chunks: List[List[int]] = []
    cur: List[int] = []
    total = 0
    for i, n in enumerate(nbytes):
        if cur and total + n > limit:
            chunks.append(cur)
            cur, total = [], 0
        cur.append(i)
        total += n
    if cur:
        chunks.append(cur)
    return chunks
