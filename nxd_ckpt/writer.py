"""Background writer: one runner thread per process takes saves in order; a pool writes their files.

Per save the runner (1) waits for rank 0 to prepare the staging directory, (2) writes this rank's files
(CRC32C on the bytes as written; made durable in one parallel batch) with ``num_workers`` threads, releasing host
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

from . import commit, layout, manifest
from .coord import Coordinator
from .errors import RankFailureError, describe_causes
from .staging import HostBudget, release_host_memory
from .storage import FileRecord, Storage

log = logging.getLogger("nxd_ckpt")

_END = object()


@dataclass
class WriteTask:
    """One file to write, relative to the tag directory. ``produce(fileobj)`` writes its bytes;
    ``nbytes`` of host staging memory are released once it is written."""

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
    extra_report: dict = field(default_factory=dict)   # JSON-able, filled by tasks (use_zero1_dcp entry locations)

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
                release_host_memory()     # the snapshot's memory, freed by now (performance: RSS)
                job.finished.set()


def run_job(job: SaveJob, runner: SaveRunner) -> None:
    staging = commit.strategy_for(job.storage).workdir(job.tag)
    coord = job.coordinator
    _prepare(job, staging, runner)
    records, write_error = _write_all(job, runner, staging)
    report = {
        "ok": write_error is None,
        "error": write_error,
        "files": {r.relpath: r.to_json() for r in records},
        "tensors": job.manifest_info.get("tensors", {}),
        **job.extra_report,
    }
    coord.report("written", report)
    if job.rank == 0:
        outcome = _commit_as_root(job, report)
        coord.publish("result", outcome)
    else:
        outcome = _wait_outcome(job)
    job.stats["commit_s"] = time.monotonic() - job.called_at
    coord.cleanup([f"written/{job.rank}"])
    if not outcome["ok"]:
        causes = {int(r): c for r, c in outcome["causes"].items()}
        raise RankFailureError(
            f"checkpoint {job.tag!r} was not saved: {describe_causes(causes)}. It is not marked complete; "
            "earlier checkpoints are intact. Fix the cause on the rank(s) named (free space, permissions, a dead or "
            "hung host: see their logs) and save again; load_checkpoint(tag=None) resumes from the newest "
            "complete checkpoint.",
            causes,
        )


def _wait_outcome(job: SaveJob) -> dict:
    """A non-root rank: rank 0's verdict, or a failure naming whoever did not deliver in time."""
    coord = job.coordinator
    outcome, missing, all_reported = coord.wait_outcome("result", "written")
    if outcome is not None:
        return outcome
    t = f"{coord.timeout_s:.0f}s"
    if all_reported:
        # Rank 0 had every report and went quiet while committing: it may or may not have finished.
        raise RankFailureError(
            f"checkpoint {job.tag!r}: every rank reported its files but rank 0 did not publish the commit "
            f"outcome within {t} (hung or dead while committing), so this rank cannot tell whether the "
            "checkpoint is complete. Check rank 0's log; on restart load_checkpoint(tag=None) resumes from the "
            "newest complete checkpoint.",
            {0: f"no commit outcome within {t} after every rank reported (hung or dead)"})
    causes = {r: f"did not report its files within {t} (hung or dead)" for r in missing}
    if 0 not in missing:
        causes[0] = f"gave no verdict within {t} (hung or dead)"
    raise RankFailureError(
        f"checkpoint {job.tag!r} was not saved: {describe_causes(causes)}. It is not marked complete; earlier "
        "checkpoints are intact. Check those ranks' logs (and their hosts); on restart load_checkpoint(tag=None) "
        "resumes from the newest complete checkpoint.", causes)


def _prepare(job: SaveJob, staging: str, runner: SaveRunner) -> None:
    coord = job.coordinator
    if job.rank == 0:
        try:
            commit.prepare_staging(job.storage, job.tag, [t for t in job.in_flight() + list(job.protected()) if t != job.tag])
            coord.publish("prepared", {"ok": True})
        except Exception as exc:  # noqa: BLE001
            error = _describe(exc, 0)
            _abandon_quietly(job.storage, job.tag)
            coord.publish("prepared", {"ok": False, "error": error})
            _drain(job, runner.budget)
            raise RankFailureError(
                f"checkpoint {job.tag!r} was not saved: rank 0 could not create {staging} in "
                f"{job.storage.root}: {error}. Fix {job.storage.fix_hint} and save again; earlier checkpoints "
                "are intact.", {0: error}) from exc
    else:
        try:
            state = coord.wait_for("prepared", "the staging directory", owner=0)
        except RankFailureError:
            _drain(job, runner.budget)
            raise
        if not state["ok"]:
            _drain(job, runner.budget)
            raise RankFailureError(
                f"checkpoint {job.tag!r} was not saved: rank 0 could not create its staging directory: "
                f"{state['error']}. Fix {job.storage.fix_hint} and save again; earlier checkpoints are intact.", {0: state["error"]})


def _write_all(job: SaveJob, runner: SaveRunner, staging: str):
    """Write every task of the job; return (records, first error text or None). Always drains the
    task queue so the caller's snapshot never waits on a dead consumer."""
    pool = runner._ensure_pool(max(1, job.stats.get("num_workers", 1)))
    futures: List[Future] = []
    failed: List[Future] = []      # appended by done-callbacks: no rescan of every future per task (O(n^2))
    error: Optional[str] = None
    written_bytes = 0
    while True:
        task = job.tasks.get()
        if task is _END:
            break
        if error is None and failed:
            error = _describe(failed[0].exception(), job.rank)
        if error is not None:
            runner.budget.release(task.nbytes)
            continue
        fut = pool.submit(_write_one, job.storage, staging, task, runner.budget)
        fut.add_done_callback(lambda f: f.exception() is not None and failed.append(f))
        futures.append(fut)
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
            # Durability for the whole batch at once, before the report that lets rank 0 commit: the files
            # were written without a temporary name (the staging directory's rename is the atomic step) and
            # without a sync each.
            job.storage.sync_files(f"{staging}/{r.relpath}" for r in records)
            dirs = {staging + "/" + r.relpath.rsplit("/", 1)[0] if "/" in r.relpath else staging for r in records}
            job.storage.sync_dirs(dirs)
        except Exception as exc:  # noqa: BLE001
            error = _describe(exc, job.rank)
    job.stats["bytes"] = written_bytes
    job.stats["files"] = len(records)
    job.stats["write_done_s"] = time.monotonic() - job.called_at
    return records, error


def _write_one(storage: Storage, staging: str, task: WriteTask, budget: HostBudget) -> FileRecord:
    seen: List[OSError] = []

    def produce(f):
        try:
            task.produce(_OSErrorKeeper(f, seen))
        except Exception as exc:
            # torch.save's zip writer swallows the OSError of a failed write (a full disk, a quota) and
            # fails later with "unexpected pos ..."; report the real cause.
            if seen and exc is not seen[0]:
                raise seen[0] from exc
            raise

    try:
        rec = storage.write_file(f"{staging}/{task.relpath}", produce, durable=False, atomic=False)
        return FileRecord(task.relpath, rec.size, rec.crc32c)
    finally:
        budget.release(task.nbytes)


class _OSErrorKeeper(io.RawIOBase):
    """A pass-through writable file object that remembers the first OSError a write raised."""

    def __init__(self, f, seen: List[OSError]):
        super().__init__()
        self._f = f
        self._seen = seen

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        try:
            return self._f.write(data)
        except OSError as exc:
            if not self._seen:
                self._seen.append(exc)
            raise

    def flush(self) -> None:
        pass


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


def _write_dcp_metadata(storage: Storage, staging: str, dcp) -> FileRecord:
    """Rank 0: the ``.metadata`` of the use_zero1_dcp optimizer, from every rank's entry locations."""
    from .zero1_dcp import METADATA_FILE, metadata_bytes

    body = metadata_bytes(dcp)
    rel = f"{layout.OPTIM_DIR}/{METADATA_FILE}"
    rec = storage.write_file(f"{staging}/{rel}", lambda f: f.write(body))
    return FileRecord(rel, rec.size, rec.crc32c)


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
        if all(rep is not None for rep in reports.values()):
            # Every rank has stopped writing: free the space now (a full disk would otherwise stay full
            # until the next successful save). With a silent rank, retention removes it later.
            _abandon_quietly(job.storage, job.tag)
        return {"ok": False, "causes": {str(r): c for r, c in causes.items()}}
    try:
        files: Dict[str, dict] = {}
        tensors: Dict[str, dict] = {}
        for r, rep in sorted(reports.items()):
            for rel, meta in rep["files"].items():
                files[rel] = dict(meta, rank=r)
            tensors.update(rep["tensors"])
        dcp = [(r, rep["dcp"]) for r, rep in sorted(reports.items()) if rep.get("dcp") is not None]
        if dcp:
            rec = _write_dcp_metadata(job.storage, commit.strategy_for(job.storage).workdir(job.tag), dcp)
            files[rec.relpath] = dict(rec.to_json(), rank=0)
        man = manifest.build(job.tag, job.manifest_info["topology"], job.manifest_info["flags"], files, tensors)
        if dcp:
            from .zero1_dcp import RANGES_KEY, entry_ranges

            man.extra[RANGES_KEY] = entry_ranges(dcp)
        commit.publish(job.storage, job.tag, man)
        job.stats["committed"] = True
    except Exception as exc:  # noqa: BLE001
        log.error("nxd_ckpt: checkpoint %s could not be committed: %s", job.tag, exc)
        _abandon_quietly(job.storage, job.tag)
        return {"ok": False, "causes": {"0": f"commit failed: {_describe(exc, 0)}"}}
    # The checkpoint is complete from here on: a retention problem must not report the save as failed.
    try:
        # The tag just committed is never a candidate, even if another tag's `done` looks newer (clock skew).
        deleted = commit.apply_retention(job.storage, job.num_kept, list(job.protected()) + [job.tag],
                                         [t for t in job.in_flight() if t != job.tag])
        job.stats["retention_deleted"] = deleted
    except Exception as exc:  # noqa: BLE001
        job.stats["retention_error"] = _describe(exc, 0)
        log.warning("nxd_ckpt: checkpoint %s is complete, but removing old checkpoints failed: %s. The next "
                    "successful save retries; or delete old tags by hand (`nxd-ckpt ls` lists them)", job.tag, exc)
    return {"ok": True}


def _abandon_quietly(storage: Storage, tag: str) -> None:
    try:
        commit.strategy_for(storage).abandon(storage, tag)
    except Exception as exc:  # noqa: BLE001 - debris; the next successful save's retention removes it
        log.warning("nxd_ckpt: could not remove the files of the failed save of %s: %s", tag, exc)
