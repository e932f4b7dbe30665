"""Background writer: one runner thread per process takes saves in order; a pool writes their files.

Per save the runner (1) waits for rank 0 to prepare the staging directory, (2) writes this rank's files
(temp + fsync + rename, CRC32C on the bytes as written) with ``num_workers`` threads, releasing host
staging memory as each tensor file lands, (3) reports its file list through the store, and on rank 0
(4) gathers every report, commits or declares failure, applies retention and publishes the outcome that
(5) every rank waits for. Failures become RankFailureError, kept until the caller's next
save_checkpoint / finalize_checkpoint raises it once.
"""
from __future__ import annotations

import io
import logging
import queue
import threading
import time
import traceback
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional

import torch

import xser

from . import commit
from .coord import Coordinator
from .errors import RankFailureError, describe_causes
from .staging import HostBudget
from .storage import FileRecord, Storage

log = logging.getLogger("nxd_ckpt")

_END = object()


@dataclass
class WriteTask:
    """One file to write, relative to the tag directory. ``produce(fileobj)`` writes its bytes;
    ``nbytes`` of host staging memory are released once it is durable."""

    relpath: str
    produce: Callable
    nbytes: int = 0


def bytes_task(relpath: str, data: bytes) -> WriteTask:
    return WriteTask(relpath, lambda f: f.write(data), 0)


def tensor_task(relpath: str, tensor: torch.Tensor) -> WriteTask:
    return WriteTask(relpath, lambda f: xser.write_tensor(tensor, f), tensor.numel() * tensor.element_size())


def plain_shard_task(relpath: str, ref_bytes: bytes, host: Dict[int, torch.Tensor], nbytes: int) -> WriteTask:
    """A non-xser shard: the ref data with its tensors put back, written as one torch.save file."""

    def produce(f):
        refs = xser.load_refs(io.BytesIO(ref_bytes), trusted=True)
        torch.save(xser.from_refs(refs, host.__getitem__), f)

    return WriteTask(relpath, produce, nbytes)


@dataclass
class SaveJob:
    seq: int
    tag: str
    storage: Storage
    rank: int
    coordinator: Coordinator
    manifest_info: dict                 # topology + flags + this rank's tensor metadata
    num_kept: Optional[int]
    in_flight: Callable[[], List[str]]
    protected: Callable[[], List[str]]
    called_at: float
    tasks: "queue.Queue" = field(default_factory=queue.Queue)
    finished: threading.Event = field(default_factory=threading.Event)
    error: Optional[BaseException] = None
    stats: dict = field(default_factory=dict)

    def add(self, task: WriteTask) -> None:
        self.tasks.put(task)

    def close(self) -> None:
        self.tasks.put(_END)


class SaveRunner:
    """Owns the background thread and the writer pool of one process."""

    def __init__(self, budget: HostBudget):
        self.budget = budget
        self._jobs: "queue.Queue" = queue.Queue()
        self._pool: Optional[ThreadPoolExecutor] = None
        self._pool_size = 0
        self._thread = threading.Thread(target=self._loop, name="nxd_ckpt-runner", daemon=True)
        self._thread.start()

    def submit(self, job: SaveJob) -> None:
        self._jobs.put(job)

    def _ensure_pool(self, workers: int) -> ThreadPoolExecutor:
        if self._pool is None or self._pool_size != workers:
            if self._pool is not None:
                self._pool.shutdown(wait=True)
            self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="nxd_ckpt-write")
            self._pool_size = workers
        return self._pool

    def _loop(self) -> None:
        while True:
            job = self._jobs.get()
            try:
                run_job(job, self)
            except BaseException as exc:  # noqa: BLE001 - becomes the job's error, raised to the caller
                job.error = exc
            finally:
                job.finished.set()


def run_job(job: SaveJob, runner: SaveRunner) -> None:
    staging = commit.staging_name(job.tag)
    coord = job.coordinator
    _prepare(job, staging)
    records, write_error = _write_all(job, runner, staging)
    report = {
        "ok": write_error is None,
        "error": write_error,
        "files": {r.relpath: r.to_json() for r in records},
        "tensors": job.manifest_info.get("tensors", {}),
    }
    coord.report("written", report)
    if job.rank == 0:
        outcome = _commit_as_root(job, report)
        coord.publish("result", outcome)
    else:
        outcome = coord.wait_for("result", "the commit result", owner=0)
    job.stats["commit_s"] = time.monotonic() - job.called_at
    coord.cleanup([f"written/{job.rank}"])
    if not outcome["ok"]:
        causes = {int(r): c for r, c in outcome["causes"].items()}
        raise RankFailureError(
            f"checkpoint {job.tag!r} was not saved: {describe_causes(causes)}. It is not marked complete; "
            "earlier checkpoints are intact.",
            causes,
        )


def _prepare(job: SaveJob, staging: str) -> None:
    coord = job.coordinator
    if job.rank == 0:
        try:
            commit.prepare_staging(job.storage, job.tag)
            coord.publish("prepared", {"ok": True})
        except Exception as exc:  # noqa: BLE001
            coord.publish("prepared", {"ok": False, "error": f"{type(exc).__name__}: {exc}"})
            _drain(job, runner_budget=None)
            raise RankFailureError(f"checkpoint {job.tag!r}: rank 0 could not prepare {staging}: {exc}",
                                   {0: str(exc)}) from exc
    else:
        state = coord.wait_for("prepared", "the staging directory", owner=0)
        if not state["ok"]:
            raise RankFailureError(f"checkpoint {job.tag!r}: rank 0 could not prepare it: {state['error']}",
                                   {0: state["error"]})


def _write_all(job: SaveJob, runner: SaveRunner, staging: str):
    """Write every task of the job; return (records, first error text or None). Always drains the
    task queue so the caller's snapshot never waits on a dead consumer."""
    pool = runner._ensure_pool(max(1, job.stats.get("num_workers", 1)))
    futures: List[Future] = []
    error: Optional[str] = None
    written_bytes = 0
    while True:
        task = job.tasks.get()
        if task is _END:
            break
        if error is not None:
            runner.budget.release(task.nbytes)
            continue
        futures.append(pool.submit(_write_one, job.storage, staging, task, runner.budget))
        done = [f for f in futures if f.done() and f.exception() is not None]
        if done:
            error = _describe(done[0].exception(), job.rank)
    wait(futures)
    records: List[FileRecord] = []
    for f in futures:
        exc = f.exception()
        if exc is not None:
            error = error or _describe(exc, job.rank)
        else:
            records.append(f.result())
            written_bytes += f.result().size
    if error is None:
        try:
            dirs = {staging + "/" + r.relpath.rsplit("/", 1)[0] if "/" in r.relpath else staging for r in records}
            job.storage.sync_dirs(dirs)
        except Exception as exc:  # noqa: BLE001
            error = _describe(exc, job.rank)
    job.stats["bytes"] = written_bytes
    job.stats["files"] = len(records)
    job.stats["write_done_s"] = time.monotonic() - job.called_at
    return records, error


def _write_one(storage: Storage, staging: str, task: WriteTask, budget: HostBudget) -> FileRecord:
    try:
        rec = storage.write_file(f"{staging}/{task.relpath}", task.produce)
        return FileRecord(task.relpath, rec.size, rec.crc32c)
    finally:
        budget.release(task.nbytes)


def _drain(job: SaveJob, runner_budget) -> None:
    while True:
        task = job.tasks.get()
        if task is _END:
            return
        if runner_budget is not None:
            runner_budget.release(task.nbytes)


def _describe(exc: BaseException, rank: int) -> str:
    where = "".join(traceback.format_exception_only(type(exc), exc)).strip()
    return f"{where}"


def _commit_as_root(job: SaveJob, own_report: dict) -> dict:
    """Rank 0: gather all reports; commit when every rank succeeded; else describe the failures."""
    coord = job.coordinator
    reports = coord.gather("written")
    causes: Dict[int, str] = {}
    for r, rep in reports.items():
        if rep is None:
            causes[r] = f"did not report within {coord.timeout_s:.0f}s (hung or dead)"
        elif not rep["ok"]:
            causes[r] = rep["error"]
    if causes:
        log.error("nxd_ckpt: checkpoint %s failed: %s", job.tag, describe_causes(causes))
        return {"ok": False, "causes": {str(r): c for r, c in causes.items()}}
    try:
        files: Dict[str, dict] = {}
        tensors: Dict[str, dict] = {}
        for r, rep in sorted(reports.items()):
            for rel, meta in rep["files"].items():
                files[rel] = dict(meta, rank=r)
            tensors.update(rep["tensors"])
        manifest = commit.build_manifest(job.tag, job.manifest_info["topology"], job.manifest_info["flags"],
                                         files, tensors)
        commit.publish(job.storage, job.tag, manifest)
        job.stats["committed"] = True
        deleted = commit.apply_retention(job.storage, job.num_kept, job.protected(),
                                         [t for t in job.in_flight() if t != job.tag])
        job.stats["retention_deleted"] = deleted
    except Exception as exc:  # noqa: BLE001
        return {"ok": False, "causes": {"0": f"commit failed: {_describe(exc, 0)}"}}
    return {"ok": True}
