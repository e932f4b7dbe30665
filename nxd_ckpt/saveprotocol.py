"""The per-save protocol between ranks, run by one background thread per process, saves in order.

Per save (see README "How a save works"): (1) rank 0 prepares the working directory and publishes that
it did, the others wait for it; (2) every rank writes its files through the write pool; (3) every rank
reports its file list through the store; rank 0 (4) gathers every report, commits or declares failure,
applies retention and publishes the outcome that (5) every rank waits for. All waits go through
``coord.Coordinator`` and have deadlines. A failure becomes RankFailureError, kept on the job until the
caller's next save_checkpoint / finalize_checkpoint raises it once.
"""
from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional

from . import commit, layout, manifest, reuse
from .coord import Coordinator
from .errors import RankFailureError, describe_causes
from .staging import release_host_memory
from .storage import FileRecord, Storage
from .writepool import TaskQueue, WritePool, WriteResult, describe, lower_thread_priority

log = logging.getLogger("nxd_ckpt")


@dataclass
class SaveStats:
    """One save's numbers on this rank (``nxd_ckpt.save_stats()`` returns them as dicts, without unset fields)."""

    tag: str
    num_workers: int
    stall_s: Optional[float] = None          # the caller's wait: the snapshot (async) or the whole save (sync)
    staged_bytes: Optional[int] = None       # bytes of this rank's snapshot
    ordering_wait_s: Optional[float] = None  # waited for the previous save to commit first
    budget_wait_s: Optional[float] = None    # waited for host staging memory
    bytes: Optional[int] = None              # written by this rank
    files: Optional[int] = None
    write_done_s: Optional[float] = None     # call to this rank's files durable
    commit_s: Optional[float] = None         # call to the outcome known on this rank
    committed: Optional[bool] = None         # rank 0: it committed the checkpoint
    retention_deleted: Optional[List[str]] = None
    retention_error: Optional[str] = None
    ok: Optional[bool] = None

    def as_dict(self) -> dict:
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}


@dataclass
class ManifestInfo:
    """What this rank contributes to the manifest besides its files (JSON-shaped)."""

    topology: dict
    flags: dict
    tensors: dict        # this rank's ref files -> {tid: tensor metadata}


@dataclass
class RankReport:
    """What a rank tells rank 0 when its writes are over (travels as JSON through the store)."""

    ok: bool
    error: Optional[str]
    files: Dict[str, dict]                   # relpath -> FileRecord JSON
    tensors: dict
    dcp: Optional[list] = None               # use_zero1_dcp: this rank's entry locations

    def to_json(self) -> dict:
        out = {"ok": self.ok, "error": self.error, "files": self.files, "tensors": self.tensors}
        if self.dcp is not None:
            out["dcp"] = self.dcp
        return out

    @classmethod
    def from_json(cls, d: dict) -> "RankReport":
        return cls(d["ok"], d["error"], d["files"], d["tensors"], d.get("dcp"))


@dataclass
class Outcome:
    """Rank 0's verdict on a step of a save: the working directory prepared, the save committed (travels as
    JSON through the store)."""

    ok: bool
    causes: Dict[int, str] = field(default_factory=dict)      # failing rank -> why
    reused: bool = False        # prepared: the working directory holds a retired tag's files (reuse.take)

    def to_json(self) -> dict:
        return {"ok": self.ok, "causes": {str(r): c for r, c in self.causes.items()}, "reused": self.reused}

    @classmethod
    def from_json(cls, d: dict) -> "Outcome":
        return cls(d["ok"], {int(r): c for r, c in d.get("causes", {}).items()}, bool(d.get("reused", False)))


@dataclass
class SaveJob:
    seq: int
    tag: str
    storage: Storage
    rank: int
    coordinator: Coordinator
    info: ManifestInfo
    num_kept: Optional[int]
    num_workers: int
    in_flight: Callable[[], List[str]]
    protected: Callable[[], List[str]]
    called_at: float
    reuse_files: bool = True                # take over a retired tag's files; retention retires (reuse.py)
    tasks: TaskQueue = field(default_factory=TaskQueue)
    finished: threading.Event = field(default_factory=threading.Event)
    error: Optional[BaseException] = None
    stats: SaveStats = field(init=False)
    dcp_locations: Optional[list] = None    # use_zero1_dcp: set by the data file's producer, for rank 0's .metadata

    def __post_init__(self):
        self.stats = SaveStats(tag=self.tag, num_workers=self.num_workers)

    def since_call(self) -> float:
        return time.monotonic() - self.called_at


class SaveRunner:
    """The background thread of one process: runs each submitted save's protocol, in order."""

    def __init__(self):
        self._jobs: "queue.Queue[SaveJob]" = queue.Queue()
        self._pool = WritePool()
        self._thread = threading.Thread(target=self._loop, name="nxd_ckpt-runner", daemon=True)
        self._thread.start()

    def submit(self, job: SaveJob) -> None:
        self._jobs.put(job)

    def _loop(self) -> None:
        lower_thread_priority()
        while True:
            job = self._jobs.get()
            try:
                run_job(job, self._pool)
            except BaseException as exc:  # noqa: BLE001 - becomes the job's error, raised to the caller
                job.error = exc
            finally:
                release_host_memory()     # the snapshot's memory, freed by now (performance: RSS)
                job.finished.set()


def run_job(job: SaveJob, pool: WritePool) -> None:
    """Every rank, on the runner thread: the whole protocol of one save. Blocks until the outcome is known
    (each wait bounded by the coordinator's timeout); raises RankFailureError when the save failed."""
    workdir = commit.strategy_for(job.storage).workdir(job.tag)
    coord = job.coordinator
    reused = _prepare(job, workdir)
    written = pool.write_all(job.tasks, job.storage, workdir, job.num_workers, overwrite=reused)
    job.stats.bytes, job.stats.files, job.stats.write_done_s = written.nbytes, len(written.records), job.since_call()
    report = _report_of(job, written).to_json()
    del written     # one record per file, now in the report: not kept through the commit
    # Rank 0 keeps its own report (``_commit_as_root``); the others only look for its key, so it publishes that it
    # reported, not the thousands of records (encoding them cost 40 ms a save at 5,000 files).
    coord.report("written", report if job.rank else {"ok": report["ok"], "kept_by_rank_0": True})
    if job.rank == 0:
        outcome = _commit_as_root(job, workdir, report, reused)
        coord.publish("result", outcome.to_json())
    else:
        outcome = _wait_outcome(job)
    job.stats.commit_s = job.since_call()
    coord.cleanup([f"written/{job.rank}"])
    if not outcome.ok:
        raise RankFailureError(
            f"checkpoint {job.tag!r} was not saved: {describe_causes(outcome.causes)}. It is not marked complete; "
            "earlier checkpoints are intact. Fix the cause on the rank(s) named (free space, permissions, a dead or "
            "hung host: see their logs) and save again; load_checkpoint(tag=None) resumes from the newest "
            "complete checkpoint.",
            outcome.causes,
        )


def _report_of(job: SaveJob, written: WriteResult) -> RankReport:
    return RankReport(ok=written.error is None, error=written.error,
                      files={r.relpath: r.to_json() for r in written.records}, tensors=job.info.tensors,
                      dcp=job.dcp_locations)


def _prepare(job: SaveJob, workdir: str) -> bool:
    """Rank 0 prepares the working directory and publishes whether it could; the others wait for that.
    On failure this rank's tasks are dropped (their memory released) and RankFailureError is raised. True when
    the working directory holds a retired tag's files, which the ranks overwrite in place (reuse.py)."""
    coord = job.coordinator
    if job.rank == 0:
        try:
            busy = [t for t in job.in_flight() + list(job.protected()) if t != job.tag]
            reused = commit.prepare_staging(job.storage, job.tag, busy, job.reuse_files)
        except Exception as exc:  # noqa: BLE001
            error = describe(exc)
            _abandon_quietly(job.storage, job.tag)
            coord.publish("prepared", Outcome(False, {0: error}).to_json())
            job.tasks.drain()
            raise RankFailureError(
                f"checkpoint {job.tag!r} was not saved: rank 0 could not create {workdir} in "
                f"{job.storage.root}: {error}. Fix {job.storage.fix_hint} and save again; earlier checkpoints "
                "are intact.", {0: error}) from exc
        coord.publish("prepared", Outcome(True, reused=reused).to_json())
        return reused
    try:
        prepared = Outcome.from_json(coord.wait_for("prepared", "the staging directory", owner=0))
    except RankFailureError:
        job.tasks.drain()
        raise
    if not prepared.ok:
        job.tasks.drain()
        raise RankFailureError(
            f"checkpoint {job.tag!r} was not saved: rank 0 could not create its staging directory: "
            f"{prepared.causes[0]}. Fix {job.storage.fix_hint} and save again; earlier checkpoints are intact.",
            prepared.causes)
    return prepared.reused


def _wait_outcome(job: SaveJob) -> Outcome:
    """A non-root rank: rank 0's verdict, or a failure naming whoever did not deliver in time."""
    coord = job.coordinator
    outcome, missing, all_reported = coord.wait_outcome("result", "written")
    if outcome is not None:
        return Outcome.from_json(outcome)
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


def _commit_as_root(job: SaveJob, workdir: str, own: dict, reused: bool) -> Outcome:
    """Rank 0: gather all reports (``own``: its own, not read back); commit when every rank succeeded, then apply
    retention; else describe the failures. ``reused``: the working directory held a retired tag's files, and
    those no rank wrote are removed first. Never raises: the outcome is what every rank raises or not."""
    coord = job.coordinator
    gathered = coord.gather("written", known={0: own})
    reports = {r: RankReport.from_json(rep) for r, rep in gathered.items() if rep is not None}
    causes: Dict[int, str] = {}
    for r in sorted(gathered):
        if r not in reports:
            causes[r] = f"did not report within {coord.timeout_s:.0f}s (hung or dead)"
        elif not reports[r].ok:
            causes[r] = reports[r].error or "failed"
    if causes:
        log.error("nxd_ckpt: checkpoint %s failed: %s", job.tag, describe_causes(causes))
        if len(reports) == len(gathered):
            # Every rank has stopped writing: free the space now (a full disk would otherwise stay full
            # until the next successful save). With a silent rank, retention removes it later.
            _abandon_quietly(job.storage, job.tag)
        return Outcome(False, causes)
    try:
        draft = _build_manifest(job, workdir, reports)
        if reused:
            reuse.sweep(job.storage, workdir, set(draft.data["files"]) | {layout.CHECKPOINT_MARKER})
        commit.publish(job.storage, job.tag, draft)
        job.stats.committed = True
    except Exception as exc:  # noqa: BLE001
        log.error("nxd_ckpt: checkpoint %s could not be committed: %s", job.tag, exc)
        _abandon_quietly(job.storage, job.tag)
        return Outcome(False, {0: f"commit failed: {describe(exc)}"})
    _retain(job)
    return Outcome(True)


def _build_manifest(job: SaveJob, workdir: str, reports: Dict[int, RankReport]) -> manifest.ManifestDraft:
    """Rank 0: the manifest of every rank's files (and, for use_zero1_dcp, the `.metadata` it writes now)."""
    files: Dict[str, dict] = {}
    tensors: Dict[str, dict] = {}
    for r, rep in sorted(reports.items()):
        for rel, record in rep.files.items():
            record["rank"] = r      # the report's dict, already sent and read by no one else: no copy per file
            files[rel] = record
        tensors.update(rep.tensors)
    dcp = [(r, rep.dcp) for r, rep in sorted(reports.items()) if rep.dcp is not None]
    extra = {}
    if dcp:
        from .zero1_dcp import RANGES_KEY, entry_ranges

        rec = _write_dcp_metadata(job.storage, workdir, dcp)
        files[rec.relpath] = dict(rec.to_json(), rank=0)
        extra[RANGES_KEY] = entry_ranges(dcp)
    return manifest.draft(job.tag, job.info.topology, job.info.flags, files, tensors, extra)


def _write_dcp_metadata(storage: Storage, workdir: str, dcp) -> FileRecord:
    """Rank 0: the ``.metadata`` of the use_zero1_dcp optimizer, from every rank's entry locations."""
    from .zero1_dcp import METADATA_FILE, metadata_bytes

    body = metadata_bytes(dcp)
    rel = f"{layout.OPTIM_DIR}/{METADATA_FILE}"
    rec = storage.write_file(f"{workdir}/{rel}", lambda f: f.write(body))
    return FileRecord(rel, rec.size, rec.crc32c)


def _retain(job: SaveJob) -> None:
    """Rank 0, after the commit: retention. The checkpoint is complete, so a problem here is logged and
    recorded in the stats, never reported as a failed save."""
    try:
        # The tag just committed is never a candidate, even if another tag's `done` looks newer (clock skew).
        job.stats.retention_deleted = commit.apply_retention(
            job.storage, job.num_kept, list(job.protected()) + [job.tag], [t for t in job.in_flight() if t != job.tag],
            job.reuse_files)
    except Exception as exc:  # noqa: BLE001
        job.stats.retention_error = describe(exc)
        log.warning("nxd_ckpt: checkpoint %s is complete, but removing old checkpoints failed: %s. The next "
                    "successful save retries; or delete old tags by hand (`nxd-ckpt ls` lists them)", job.tag, exc)


def _abandon_quietly(storage: Storage, tag: str) -> None:
    try:
        commit.strategy_for(storage).abandon(storage, tag)
    except Exception as exc:  # noqa: BLE001 - debris; the next successful save's retention removes it
        log.warning("nxd_ckpt: could not remove the files of the failed save of %s: %s", tag, exc)
