"""The per-process checkpoint engine: save sequence numbers, the background runner, the host-memory
budget, the snapshot that feeds a save's files to the writers, saves in flight, and errors waiting to be
raised. One instance per process, created lazily."""
from __future__ import annotations

import atexit
import logging
import queue
import threading
import time
from typing import Dict, List, Optional


from . import layout, masters
from .coord import Coordinator, default_store
from .errors import RankFailureError
from .plan import SavePlan, tensor_nbytes
from .saveprotocol import ManifestInfo, SaveJob, SaveRunner, SaveStats
from .staging import (HostBudget, HostBufferPool, chunk_by_bytes, copy_to_host, default_host_budget,
                      device_snapshot)
from .storage import Storage
from .storage.local import BOUNCES
from .world import World
from .writepool import WriteTask, bytes_task, failing_task, plain_shard_producer, tensor_file_lead, tensor_task

log = logging.getLogger("nxd_ckpt")

EXIT_TIMEOUT_S = 600.0
#: The snapshot copies a budget chunk to host and hands its files to the writers this many bytes at a time, so the
#: writers start on the first files while the rest is still copied (the copy releases the GIL). One hand-out per
#: chunk made every write wait for the whole copy.
HANDOUT_BYTES = 128 << 20
#: Only files of at least this many bytes are handed out early; smaller ones wait for the end of their chunk.
#: Writing a large file is mostly I/O with the GIL released; writing small ones is Python that takes the GIL from the
#: copy loop and the cores from the copy (A/Bs in README "Levers measured").
EARLY_MIN_BYTES = 4 << 20


class Feeder:
    """One daemon thread that runs the on-device saves' host copies in turn. Started once: a save hands its
    copy over with a queue put, where starting a thread made the caller wait until the new thread ran
    (10-15 ms of the stall on a busy host: the device is copying the clones meanwhile)."""

    def __init__(self):
        self._queue: "queue.SimpleQueue" = queue.SimpleQueue()
        self._thread: Optional[threading.Thread] = None
        self._lock = threading.Lock()

    def run(self, fn, *args) -> None:
        """Queue ``fn(*args)``; returns at once. ``fn`` reports its own failures (Engine._feed_units does)."""
        with self._lock:
            if self._thread is None or not self._thread.is_alive():     # first use, or after a fork
                self._thread = threading.Thread(target=self._loop, name="nxd_ckpt-feeder", daemon=True)
                self._thread.start()
        self._queue.put((fn, args))

    def _loop(self) -> None:
        while True:
            fn, args = self._queue.get()
            try:
                fn(*args)
            except BaseException:  # noqa: BLE001 - keep serving the next saves
                log.exception("nxd_ckpt: the on-device snapshot's host copy failed")
            del fn, args


class Engine:
    def __init__(self):
        self.seq = 0
        self._tag_saves: Dict[str, int] = {}
        self.runner: Optional[SaveRunner] = None
        self.budget: Optional[HostBudget] = None
        self.buffers: Optional[HostBufferPool] = None   # snapshot buffers kept between saves (staging.py)
        self.feeder = Feeder()                           # host copies of on-device snapshots
        self.jobs: List[SaveJob] = []
        self.history: List[SaveStats] = []
        self.loading: set = set()
        self.last_ordering_wait_s = 0.0
        self._lock = threading.Lock()

    # --- saves -------------------------------------------------------------------------------------
    def start_job(self, world: World, storage: Storage, tag: str, plan: SavePlan, num_kept, num_workers: int,
                  timeout_s: float, budget_bytes: Optional[int], called_at: float,
                  keep_buffers: bool = True, reuse_files: bool = True) -> SaveJob:
        self._ensure_runner(world, budget_bytes, keep_buffers)
        self.seq += 1
        # Keys are per tag (and per save of that tag), not per call: a rank that raised before starting
        # a save (a bad argument, a pending error) must never have its next save's files combined with
        # another rank's save of a different tag, which would mark a checkpoint complete that lacks them.
        self._tag_saves[tag] = self._tag_saves.get(tag, 0) + 1
        prefix = f"nxd_ckpt/save/{tag}/{self._tag_saves[tag]}"
        coord = Coordinator(default_store(), world.rank, world.world_size, prefix, timeout_s)
        job = SaveJob(
            seq=self.seq, tag=tag, storage=storage, rank=world.rank, coordinator=coord,
            info=_manifest_info(world, plan), num_kept=num_kept, num_workers=num_workers,
            in_flight=self.in_flight_tags, protected=lambda: sorted(self.loading), called_at=called_at,
            reuse_files=reuse_files,
        )
        with self._lock:
            self.jobs.append(job)
        self.runner.submit(job)
        return job

    def _ensure_runner(self, world: World, budget_bytes: Optional[int], keep_buffers: bool = True) -> None:
        cap = budget_bytes or default_host_budget(world.local_world_size)
        if self.budget is None:
            self.budget = HostBudget(cap)
        elif budget_bytes and budget_bytes != self.budget.capacity:
            self.budget.capacity = int(budget_bytes)
        if self.buffers is None:
            self.buffers = HostBufferPool(self.budget.capacity, keep=keep_buffers, lead_of=tensor_file_lead)
        self.buffers.set_capacity(self.budget.capacity)
        self.buffers.keep = keep_buffers
        if not keep_buffers:
            self.buffers.release()
        if self.runner is None:
            self.runner = SaveRunner()

    def snapshot(self, job: SaveJob, plan: SavePlan, *, on_device: bool, timeout_s: float) -> None:
        """Feed the job every file of ``plan``. Blocks for the host copy (host mode) or only for the
        on-device clone (device mode: the host copy continues on the feeder thread). A failure before the files
        are handed out (the on-device clone, say) fails the job like a failed copy does, on every rank: raised
        by this save when synchronous, else by the next call; the job's queue is always closed."""
        try:
            tensors = plan.staged_tensors()
            if on_device:
                self.feeder.run(self._feed_units, job, plan, device_snapshot(tensors), timeout_s)
                return
        except BaseException as exc:  # noqa: BLE001 - reported through the job, as _feed_units does
            job.tasks.add(failing_task(exc))
            job.tasks.close()
            return
        self._feed_units(job, plan, tensors, timeout_s)

    def _feed_units(self, job: SaveJob, plan: SavePlan, tensors, timeout_s: float) -> None:
        """Copy ``tensors`` (``plan.staged_tensors()`` or their on-device clones) to host in budget-sized chunks
        and hand each file to the writers with its share of the chunk's lease (released by the write pool once
        the file is written). The files of no staged bytes go with the first chunk. Always closes the queue."""
        try:
            head = _unstaged_files(plan)
            units = _units(plan, job)
            sizes, starts = [], [0]
            for _, _, n in units:
                start = starts[-1]
                sizes.append(sum(tensor_nbytes(t) for t in tensors[start:start + n]) if n != 1
                             else tensor_nbytes(tensors[start]))
                starts.append(start + n)
            if starts[-1] != len(tensors):     # the two walks of the plan disagree: never pair a tensor with another's file
                raise RuntimeError(f"nxd_ckpt internal error: {starts[-1]} staged tensors planned, {len(tensors)} given")
            job.stats.staged_bytes = sum(sizes)
            for chunk in chunk_by_bytes(sizes, self.budget.capacity):
                need = sum(sizes[i] for i in chunk)
                with self.budget.lease(need, timeout_s) as lease:   # what is not handed out returns on exit
                    if lease.waited_s > 0.01:
                        log.info("nxd_ckpt: save %s waited %.3fs for %d MB of host staging memory (budget %d MB)",
                                 job.tag, lease.waited_s, need >> 20, self.budget.capacity >> 20)
                        job.stats.budget_wait_s = (job.stats.budget_wait_s or 0.0) + lease.waited_s
                    self._feed_chunk(job, range(chunk[0], chunk[-1] + 1), units, sizes, tensors, starts, lease, head)
                    head = []
            job.tasks.add_many(head)
        except BaseException as exc:  # noqa: BLE001
            job.tasks.add(failing_task(exc))
        finally:
            job.tasks.close()

    def _feed_chunk(self, job: SaveJob, chunk: range, units, sizes: List[int], tensors, starts: List[int], lease,
                    head: List[WriteTask]) -> None:
        """Copy the units ``chunk`` (one budget chunk; unit ``i``'s tensors are ``tensors[starts[i]:starts[i + 1]]``)
        to host ``HANDOUT_BYTES`` at a time and queue their files: those of ``EARLY_MIN_BYTES`` or more as each
        part is copied, so that the writers start on them while the rest is copied; the smaller ones, and
        ``head``, once the whole chunk is. Why hold the small ones: writing them is Python on the writer threads,
        which takes the GIL from the copy loop (0.5 GB in 5,000 tensors: a stall of 0.76 s instead of 0.36 with
        every file queued early). Why in parts, not one by one: each queued file wakes a writer (0.1-0.4 s more
        at 5,000 tensors). The buffers of files written meanwhile are not reused by this chunk
        (``HostBufferPool.holding_returns``). On a failure the held files give their memory back."""
        held: List[WriteTask] = list(head)
        try:
            with self.buffers.holding_returns():
                for part in chunk_by_bytes(sizes[chunk.start:chunk.stop], HANDOUT_BYTES):
                    a, b = chunk.start + part[0], chunk.start + part[-1] + 1
                    tasks = self._hand_out(units[a:b], sizes[a:b], tensors[starts[a]:starts[b]], lease)
                    held += [t for t in tasks if t.lease.nbytes < EARLY_MIN_BYTES]
                    job.tasks.add_many([t for t in tasks if t.lease.nbytes >= EARLY_MIN_BYTES])
        except BaseException:
            for task in held:
                task.lease.release()
            raise
        job.tasks.add_many(held)

    def _hand_out(self, units, sizes: List[int], tensors, lease) -> List[WriteTask]:
        """Copy one chunk's ``tensors`` into pool buffers; a file task per unit, whose part of the lease gives
        its buffers back to the pool when the file is written or dropped. On a failure nothing leaks: the
        parts handed out so far are released and the buffers not handed out go back to the pool."""
        pool = self.buffers
        host = copy_to_host(tensors, pool)
        give_back, give_back_one = pool.give_back, pool.give_back_one
        tasks: List[WriteTask] = []
        start = 0
        part = None
        try:
            for (make_file, arg, n), size in zip(units, sizes):
                mine = host[start:start + n]
                # A one-tensor file's part keeps the tensor, not a list of it: one object fewer per file that
                # lives until the file is written (the collector's next full collection comes sooner with each)
                part = lease.part(size, give_back_one, mine[0]) if n == 1 else lease.part(size, give_back, mine)
                start += n
                tasks.append(make_file(arg, mine, part))
                part = None
        except BaseException:
            for task in tasks:
                task.lease.release()
            if part is not None:
                part.release()
            pool.give_back(host[start:])        # not handed out: nothing will write them
            raise
        return tasks

    def release_buffers(self) -> int:
        """Drop the snapshot buffers kept between saves (those of saves in flight when they are written), and
        the direct writes' bounce buffers not in use."""
        return (self.buffers.release() if self.buffers is not None else 0) + BOUNCES.release()

    def wait(self, job: SaveJob, timeout_s: float) -> None:
        """Block the caller (a synchronous save) until ``job`` is committed or failed; raise its error.
        The caller's stall then covers the whole save, so stall_s is set before the save is logged."""
        # Every wait inside a save has its own deadline (rank 0's staging directory, the other ranks'
        # reports, rank 0's verdict: up to three rounds of the save's timeout), so give the job that long
        # to fail on its own with the precise error before declaring it stuck here.
        limit = max(timeout_s, 3 * job.coordinator.timeout_s + 60)
        finished = job.finished.wait(limit)
        job.stats.stall_s = job.since_call()
        if not finished:
            raise RankFailureError(
                f"checkpoint {job.tag!r} did not finish within {limit:.0f}s on this rank (its writes are stuck: "
                "check the filesystem); it is not marked complete and earlier checkpoints are intact")
        self._retire(job)
        if job.error is not None:
            err, job.error = job.error, None
            raise err

    def in_flight_tags(self) -> List[str]:
        with self._lock:
            return [j.tag for j in self.jobs if not j.finished.is_set()]

    def raise_pending(self, starting: bool = True) -> None:
        """Raise, once, the error of an earlier background save (oldest first). ``starting``: called by
        save_checkpoint before it starts a save (which it then does not start).

        Waits for the saves still in flight first: whether this call raises must not depend on how far
        this rank's background happens to be, or one rank would skip the new save while the others start
        it (and every later save would fail in turn). Their outcome is the same on every rank, and every
        wait inside a save has a deadline."""
        with self._lock:
            pending = [j for j in self.jobs if not j.finished.is_set()]
        started = time.monotonic()
        for j in pending:
            limit = 3 * j.coordinator.timeout_s + 60
            if not j.finished.wait(limit):
                raise RankFailureError(
                    f"the previous checkpoint {j.tag!r} is still being written after {limit:.0f}s (its writes are "
                    "stuck: check the filesystem); this save was not started")
        waited = time.monotonic() - started
        if pending and starting:
            self.last_ordering_wait_s = waited
            if waited > 0.01:
                log.info("nxd_ckpt: waited %.3fs for the previous checkpoint %s to commit before starting this one "
                         "(save less often than a commit takes to avoid this stall)", waited, pending[-1].tag)
        with self._lock:
            finished = [j for j in self.jobs if j.finished.is_set()]
        errors = []
        for j in finished:
            self._retire(j)
            if j.error is not None:
                errors.append(j.error)
                j.error = None
        if errors:
            err = errors[0]
            if starting and isinstance(err, RankFailureError):
                raise RankFailureError(
                    f"an earlier asynchronous save failed: {err} This save_checkpoint call therefore saved nothing; "
                    "call it again to save.", err.causes) from err
            raise err

    def finalize(self, timeout_s: float) -> None:
        """Wait for every save in flight; raise the first background error once."""
        with self._lock:
            jobs = list(self.jobs)
        deadline = time.monotonic() + timeout_s
        for j in jobs:
            if not j.finished.wait(max(0.0, deadline - time.monotonic())):
                raise RankFailureError(f"checkpoint {j.tag!r} did not finish within {timeout_s:.0f}s")
        self.raise_pending(starting=False)

    def _retire(self, job: SaveJob) -> None:
        with self._lock:
            if job in self.jobs:
                self.jobs.remove(job)
                job.stats.ok = job.error is None
                self.history.append(job.stats)
                _log_done(job)

    def shutdown_at_exit(self) -> None:
        """atexit: wait for saves in flight with a timeout; no collectives; report failures in the log."""
        with self._lock:
            jobs = list(self.jobs)
        if not jobs:
            return
        log.info("nxd_ckpt: waiting up to %.0fs for %d checkpoint save(s) in flight", EXIT_TIMEOUT_S, len(jobs))
        deadline = time.monotonic() + EXIT_TIMEOUT_S
        for j in jobs:
            if not j.finished.wait(max(0.0, deadline - time.monotonic())):
                log.error("nxd_ckpt: checkpoint %s still unfinished at exit; it is not marked complete", j.tag)
            elif j.error is not None:
                log.error("nxd_ckpt: checkpoint %s failed: %s", j.tag, j.error)


def _info_task(shard) -> WriteTask:
    """The shard's ``.info.pt``, pickled by the writer that writes it (from the meta captured at call time)."""
    from .capture import info_bytes

    return WriteTask(layout.info_path(shard.relpath), lambda f, meta=shard.tensor_meta: f.write(info_bytes(meta)))


def _unstaged_files(plan: SavePlan) -> List[WriteTask]:
    """The files of no staged tensor bytes: scheduler and user content (rank 0), and each xser shard's ref
    file and ``.info.pt`` (its first replica), pickled by the writer that writes them."""
    head = [bytes_task(rel, data) for rel, data in plan.small_files.items()]
    for shard in plan.shards:
        if shard.xser and shard.writes_ref:
            head.append(WriteTask(shard.relpath, lambda f, refs=shard.refs: f.write(refs.get())))
            head.append(_info_task(shard))
    return head


def _units(plan: SavePlan, job: SaveJob) -> list:
    """The files this rank writes with staged tensors: a unit ``(make_file, arg, n)`` is a file of the next
    ``n`` tensors of ``plan.staged_tensors()`` (the same order); ``make_file(arg, host copies, lease)`` gives its
    WriteTask. One unit per xser tensor file, one per whole non-xser shard, one for the use_zero1_dcp data file
    (its entries' locations go into the job's report, for rank 0's .metadata).
    Plain tuples and module functions, not a closure per file: a save of 5,000 tensors made 66,000 objects
    for the garbage collector, whose collections then ran inside the stall."""
    units: list = []
    if plan.dcp is not None:
        units.append((_dcp_file, (job, plan.dcp), len(plan.dcp.tensors())))
    for shard in plan.shards:
        if shard.xser:
            units.extend((_tensor_file, layout.tensor_path(shard.relpath, tid), 1) for tid in shard.my_tids)
        elif shard.writes_ref:
            units.append((_plain_file, shard, len(shard.my_tids)))
    return units


def _tensor_file(relpath: str, host, lease) -> WriteTask:
    return tensor_task(relpath, host[0], lease)


def _plain_file(shard, host, lease) -> WriteTask:
    return WriteTask(shard.relpath, plain_shard_producer(shard.refs, dict(zip(shard.my_tids, host))), lease)


def _dcp_file(job_dcp, host, lease) -> WriteTask:
    job, dcp = job_dcp
    name = dcp.relpath.rsplit("/", 1)[1]

    def produce(f):
        from .zero1_dcp import write_data

        job.dcp_locations = write_data(f, dcp.items, host, name)

    return WriteTask(dcp.relpath, produce, lease)


def _manifest_info(world: World, plan: SavePlan) -> ManifestInfo:
    topo = world.topology
    tensors = {}
    for shard in plan.shards:
        if shard.writes_ref:
            tensors[shard.relpath] = {str(tid): m for tid, m in shard.tensor_meta.items()}
    return ManifestInfo(
        topology={"world_size": topo.world_size, "tp": topo.tp, "pp": topo.pp, "dp": topo.dp,
                  "cp": topo.cp, "ep": topo.ep, "layout": topo.layout},
        flags={"zero1": plan.zero1, "xser": plan.xser, "has_model": plan.has_model,
               "has_optim": plan.has_optim, masters.FLAG: plan.model_from_masters,
               "zero1_dcp": plan.dcp is not None},
        tensors=tensors,
    )


def _log_done(job: SaveJob) -> None:
    s = job.stats
    if job.error is not None:
        log.error("nxd_ckpt: checkpoint %s failed after %.3fs: %s", job.tag,
                  s.commit_s if s.commit_s is not None else job.since_call(), job.error)
        return
    nbytes = s.bytes or 0
    commit_s = s.commit_s if s.commit_s is not None else float("nan")
    log.info("nxd_ckpt: checkpoint %s: stall %.1f ms, %.1f MB from this rank, committed after %.3fs, %.2f GB/s",
             job.tag, 1000 * (s.stall_s or 0.0), nbytes / 1e6, commit_s,
             nbytes / commit_s / 1e9 if commit_s and commit_s > 0 else 0.0)


_ENGINE: Optional[Engine] = None
_ENGINE_LOCK = threading.Lock()


def get_engine() -> Engine:
    global _ENGINE
    with _ENGINE_LOCK:
        if _ENGINE is None:
            _ENGINE = Engine()
            _register_exit_wait(_ENGINE.shutdown_at_exit)
        return _ENGINE


def _register_exit_wait(fn) -> None:
    """Run ``fn`` at interpreter exit *before* concurrent.futures refuses new work: its own hook is a
    threading-shutdown hook, and those run in reverse order of registration, before atexit handlers."""
    register = getattr(threading, "_register_atexit", None)
    if register is None:
        atexit.register(fn)
        return
    try:
        register(fn)
    except RuntimeError:  # already shutting down
        atexit.register(fn)
