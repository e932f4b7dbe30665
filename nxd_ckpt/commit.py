"""The commit protocol: markers, manifest, publishing a tag, the `newest` pointer, retention.

Two strategies behind one interface (``CommitStrategy``), each with its crash-recovery rules:
``RenameCommit`` (POSIX: stage in ``<tag>.nxdtmp/``, rename into place) and ``MarkerCommit`` (object
stores: objects at their final keys, `done` last). ``strategy_for(storage)`` picks one from the
storage's capabilities. In both, a crash at any moment leaves either the old state or the new complete
tag, plus at worst debris that the next successful save deletes.
"""
from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Dict, Iterable, List, Optional, Set, Tuple, Union

from . import layout, reuse
from .manifest import Manifest, ManifestDraft, sealed, seal
from .storage import AlreadyExistsError, Storage
from .storage.listed import listed

log = logging.getLogger("nxd_ckpt")

STAGING_SUFFIX = layout.TMP_SUFFIX
OLD_SUFFIX = layout.OLD_SUFFIX


def staging_name(tag: str) -> str:
    return f"{tag}{STAGING_SUFFIX}"


class CommitConflictError(RuntimeError):
    """Another job committed the same tag while this one was saving it."""


class CommitStrategy(ABC):
    """How a save becomes complete, and what a crash at any point leaves behind.

    Every rank writes its files under ``workdir(tag)``; rank 0 calls ``prepare`` before any rank writes
    and ``publish`` once every rank's files are durable; ``abandon`` removes a failed save's files;
    ``recoverable``/``repair`` find and restore a complete version a crash left under another name."""

    name = ""

    @abstractmethod
    def workdir(self, tag: str) -> str:
        ...

    def prepare(self, storage: Storage, tag: str, busy: Iterable[str] = (), reuse_files: bool = False) -> bool:
        """Rank 0 of a save, before any rank writes: repair what a crash left, then ``begin``."""
        self.repair(storage, busy)
        return self.begin(storage, tag, reuse_files)

    @abstractmethod
    def begin(self, storage: Storage, tag: str, reuse_files: bool = False) -> bool:
        """Make ``workdir(tag)`` an incomplete tag holding the `checkpoint` marker: fresh, or (``reuse_files``,
        where the strategy can) the files of a retired tag (reuse.take), to be overwritten; True in that case."""

    @abstractmethod
    def publish(self, storage: Storage, tag: str, manifest: Union[Manifest, ManifestDraft], *,
                newest: bool = True) -> None:
        """Write the manifest and `done`, and make ``tag`` complete under its name; then point `newest` at it
        (``newest=False``: an offline tool's output, which is no training job's newest save)."""

    def abandon(self, storage: Storage, tag: str) -> None:
        """Rank 0 after a failed save: remove what it wrote (never a complete tag)."""
        work = self.workdir(tag)
        if storage.exists(work) and not storage.isfile(f"{work}/{layout.DONE_MARKER}"):
            delete_tag(storage, work)

    def recoverable(self, storage: Storage, busy: Iterable[str] = ()) -> Dict[str, str]:
        return {}

    def repair(self, storage: Storage, busy: Iterable[str] = ()) -> List[str]:
        return []


class RenameCommit(CommitStrategy):
    """POSIX: write into ``<tag>.nxdtmp/``; rank 0 writes the manifest and `done` there, then renames the
    directory to ``<tag>`` (or swaps it in atomically when re-saving). Crash rules: a staging directory
    without `done` is debris (removed by the next successful save); one with `done` is a complete
    version whose rename was interrupted, and so is a ``.nxdold`` left by a re-save (``recoverable``)."""

    name = "rename"

    def workdir(self, tag: str) -> str:
        return staging_name(tag)

    def begin(self, storage: Storage, tag: str, reuse_files: bool = False) -> bool:
        staging = staging_name(tag)
        if storage.exists(staging):
            delete_tag(storage, staging)
        taken = reuse_files and reuse.take(storage, staging)
        if not taken:
            storage.makedirs(staging)
        storage.write_bytes(f"{staging}/{layout.CHECKPOINT_MARKER}", b"1")
        return taken

    def publish(self, storage: Storage, tag: str, manifest: Union[Manifest, ManifestDraft], *,
                newest: bool = True) -> None:
        staging = staging_name(tag)
        body = manifest.body()
        storage.write_bytes(f"{staging}/{layout.MANIFEST_FILE}", body)
        storage.write_bytes(f"{staging}/{layout.DONE_MARKER}", seal(body))
        storage.sync_dirs([staging])
        place_tree(storage, staging, tag)
        if newest:
            _update_newest(storage, tag)

    def recoverable(self, storage: Storage, busy: Iterable[str] = ()) -> Dict[str, str]:
        return _recoverable_renames(storage, busy)

    def repair(self, storage: Storage, busy: Iterable[str] = ()) -> List[str]:
        restored = []
        for tag, name in sorted(self.recoverable(storage, busy).items()):
            log.warning("nxd_ckpt: checkpoint %s was left as %s by a crash while it was published; restoring it",
                        tag, name)
            storage.rename(name, tag)
            restored.append(tag)
        if restored:
            storage.sync_dirs([""])
        return restored


class MarkerCommit(CommitStrategy):
    """Object stores (no rename): every object is written at its final key; rank 0 writes the manifest,
    then `done` last (exclusively where the store supports it, so a second job committing the same tag
    fails instead of interleaving). Crash rules: a tag is complete only with `done`, and `done` is
    written after every rank's objects were acknowledged; a re-save deletes `done` first (and then the
    previous version's objects), so no moment shows a mix of versions as complete; retention deletes
    `done` first too. An interrupted save is an incomplete tag, removed by the next successful save."""

    name = "marker"

    def workdir(self, tag: str) -> str:
        return tag

    def begin(self, storage: Storage, tag: str, reuse_files: bool = False) -> bool:
        if storage.isdir(tag):              # a prefix: a key named like the tag is no part of it (no HEAD)
            delete_tag(storage, tag)        # `done` first: the old version is never complete-looking again
        storage.write_bytes(f"{tag}/{layout.CHECKPOINT_MARKER}", b"1")
        return False

    def publish(self, storage: Storage, tag: str, manifest: Union[Manifest, ManifestDraft], *,
                newest: bool = True) -> None:
        body = manifest.body()
        storage.write_bytes(f"{tag}/{layout.MANIFEST_FILE}", body)
        try:
            storage.write_bytes(f"{tag}/{layout.DONE_MARKER}", seal(body), exclusive=storage.caps.create_exclusive)
        except AlreadyExistsError:
            raise CommitConflictError(
                f"{storage.root}/{tag}/{layout.DONE_MARKER} appeared while this job was saving {tag!r}: another job "
                "committed the same tag. Each job needs its own checkpoint directory or tags") from None
        if newest:
            _update_newest(storage, tag)


def strategy_for(storage: Storage) -> CommitStrategy:
    """Rename where the storage can rename directories atomically (POSIX), markers elsewhere (objects)."""
    return RenameCommit() if storage.caps.rename else MarkerCommit()


def prepare_staging(storage: Storage, tag: str, busy: Iterable[str] = (), reuse_files: bool = False) -> bool:
    """Rank 0, before any rank writes (see ``CommitStrategy.prepare``): True when the working directory holds a
    retired tag's files to overwrite."""
    return strategy_for(storage).prepare(storage, tag, busy, reuse_files)


def publish(storage: Storage, tag: str, manifest: Union[Manifest, ManifestDraft]) -> None:
    """Rank 0, after every rank's files are durable: manifest, `done`, into place, `newest`."""
    strategy_for(storage).publish(storage, tag, manifest)


def _update_newest(storage: Storage, tag: str) -> None:
    try:
        write_newest(storage, tag)
    except Exception as exc:  # noqa: BLE001 - the tag is complete; `newest` is informational only
        log.warning("nxd_ckpt: checkpoint %s is complete but %s could not be updated: %s (load_checkpoint does not "
                    "rely on it; the next save rewrites it)", tag, layout.NEWEST_FILE, exc)


def place_tree(storage: Storage, staging: str, name: str) -> None:
    """Rename the finished directory ``staging`` to ``name`` (POSIX), replacing an existing ``name`` only
    once the new tree is complete (``_replace_tag``), and make the rename durable."""
    if storage.exists(name):
        _replace_tag(storage, staging, name)
    else:
        storage.rename(staging, name)
    storage.sync_dirs([""])


def _replace_tag(storage: Storage, staging: str, tag: str) -> None:
    """Re-saving an existing tag. Where the filesystem can swap two directories atomically, the new
    version takes the name in one step and the old one, now under the staging name, is removed as debris.
    Elsewhere the old version is moved aside first; a crash between the two renames leaves both versions
    complete under their suffixed names, which ``recoverable_tags`` finds and ``repair_interrupted``
    renames back."""
    # The replaced version is removed `done` first (delete_tag), so it can never pass for a committed
    # publish that recoverable_tags would restore.
    if storage.exchange(staging, tag):
        storage.sync_dirs([""])
        delete_tag(storage, staging)
        return
    old = f"{tag}{OLD_SUFFIX}"
    if storage.exists(old):
        delete_tag(storage, old)
    storage.rename(tag, old)
    try:
        storage.rename(staging, tag)
    except BaseException:
        storage.rename(old, tag)   # put the previous version back
        raise
    storage.sync_dirs([""])
    delete_tag(storage, old)


def _recoverable_renames(storage: Storage, busy: Iterable[str] = ()) -> Dict[str, str]:
    """Tags whose name is missing after a crash during publish, mapped to the directory holding their
    newest complete version: ``<tag>.nxdtmp`` once it has `done` (every rank's files were durable and the
    manifest written), else the ``<tag>.nxdold`` that a re-save moved aside. ``busy``: tags being saved
    now (their staging directory is not debris). A deleted tag's ``.nxdold`` never qualifies: deletion
    removes `done` before renaming."""
    names = set(storage.listdir(""))
    found: Dict[str, str] = {}
    for suffix in (OLD_SUFFIX, STAGING_SUFFIX):   # a committed staging version wins over the old one
        for name in names:
            tag = name[: -len(suffix)]
            if (name.endswith(suffix) and tag and tag not in names and tag not in busy and name not in busy
                    and storage.exists(f"{name}/{layout.DONE_MARKER}")):
                found[tag] = name
    return found


def recoverable_tags(storage: Storage, busy: Iterable[str] = ()) -> Dict[str, str]:
    """Tags whose complete version a crash left under another name -> that name (``CommitStrategy``)."""
    return strategy_for(storage).recoverable(storage, busy)


def repair_interrupted(storage: Storage, busy: Iterable[str] = ()) -> List[str]:
    """Rank 0 of a saving job, before it creates staging directories or removes debris: give each
    ``recoverable_tags`` entry its name back. Returns the tags restored."""
    return strategy_for(storage).repair(storage, busy)


def write_newest(storage: Storage, tag: str) -> None:
    storage.write_bytes(layout.NEWEST_FILE, tag.encode())


def expects_manifest(storage: Storage, tag: str) -> bool:
    """True when complete ``tag`` has no manifest although nxd-ckpt wrote it, i.e. the manifest was lost:
    `newest` names it, or it was committed no earlier than a tag of this directory that has a manifest.
    neuronx-distributed tags committed before nxd-ckpt first saved here still load without one."""
    if storage.exists(f"{tag}/{layout.MANIFEST_FILE}") or not storage.exists(f"{tag}/{layout.DONE_MARKER}"):
        return False
    if sealed(storage.read_bytes(f"{tag}/{layout.DONE_MARKER}")) is not None:
        return True
    try:
        if storage.read_bytes(layout.NEWEST_FILE).decode().strip() == tag:
            return True
    except (OSError, UnicodeDecodeError):
        pass
    when = storage.mtime(f"{tag}/{layout.DONE_MARKER}")
    return any(t.ours and t.complete and t.tag != tag and t.committed_at <= when for t in scan_tags(storage))


@dataclass(frozen=True)
class TagInfo:
    tag: str
    complete: bool
    committed_at: float   # mtime of `done` (complete) or of the directory (incomplete)
    ours: bool            # has a manifest


def _is_special(name: str) -> bool:
    return name.endswith(STAGING_SUFFIX) or name.endswith(OLD_SUFFIX) or name.endswith(layout.TMP_SUFFIX)


def scan_tags(storage: Storage) -> List[TagInfo]:
    """Every checkpoint tag directory (ours or NxD's), newest first; staging debris excluded."""
    out = []
    for name in storage.listdir(""):
        if _is_special(name) or not storage.isdir(name):
            continue
        done = f"{name}/{layout.DONE_MARKER}"
        complete = storage.exists(done)
        # A user's folder that happens to hold a file named `done` or `checkpoint` is not a tag: a tag
        # has our manifest, NxD's `checkpoint` marker with model/ or optim/, or `done` with model/, optim/
        # or the `checkpoint` marker (older NxD, converter output, a save of user_content only).
        if not _is_tag_dir(storage, name) and not (complete and (
                _has_state_dirs(storage, name) or storage.exists(f"{name}/{layout.CHECKPOINT_MARKER}"))):
            continue
        when = storage.mtime(done) if complete else _dir_mtime(storage, name)
        out.append(TagInfo(name, complete, when, storage.exists(f"{name}/{layout.MANIFEST_FILE}")))
    out.sort(key=lambda t: (t.committed_at, _natural_key(t.tag)), reverse=True)
    return out


def _dir_mtime(storage: Storage, name: str) -> float:
    """When an incomplete tag was last touched: the directory's mtime, or (object stores have no
    directories) its `checkpoint` marker's."""
    for rel in (name, f"{name}/{layout.CHECKPOINT_MARKER}"):
        try:
            return storage.mtime(rel)
        except FileNotFoundError:
            continue
    return 0.0


def _is_tag_dir(storage: Storage, name: str) -> bool:
    """True for what retention may delete: ours (a manifest) or NxD's (`checkpoint` + model/ or optim/). On
    an object store also a prefix holding `checkpoint` and nothing but rank 0's small files: a save
    interrupted before any shard arrived, or a delete interrupted after every shard went."""
    if storage.exists(f"{name}/{layout.MANIFEST_FILE}"):
        return True
    if not storage.exists(f"{name}/{layout.CHECKPOINT_MARKER}"):
        return False
    return _has_state_dirs(storage, name) or (not storage.caps.rename
                                              and set(storage.listdir(name)) <= _ROOT_WRITTEN)


# What global rank 0 writes at the top of a tag besides the shards (NxD's files and ours).
_ROOT_WRITTEN = {layout.CHECKPOINT_MARKER, layout.SCHEDULER_FILE, layout.USER_CONTENT_FILE}


def _has_state_dirs(storage: Storage, name: str) -> bool:
    return storage.isdir(f"{name}/{layout.MODEL_DIR}") or storage.isdir(f"{name}/{layout.OPTIM_DIR}")


def _natural_key(s: str):
    import re

    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", s)]


def loadable(storage: Storage) -> List[Tuple[str, str]]:
    """(tag, directory) of every checkpoint ``load_checkpoint`` can read, newest first: the complete tags,
    plus each ``recoverable_tags`` entry with the directory it lies in (loading never renames)."""
    dated = [(t.committed_at, t.tag, t.tag) for t in scan_tags(storage) if t.complete]
    dated += [(storage.mtime(f"{name}/{layout.DONE_MARKER}"), tag, name)
              for tag, name in recoverable_tags(storage).items()]
    dated.sort(key=lambda d: (d[0], _natural_key(d[1])), reverse=True)
    return [(tag, name) for _, tag, name in dated]


def complete_tags(storage: Storage) -> List[str]:
    """Complete tags (a `done` marker), newest first."""
    return [t.tag for t in scan_tags(storage) if t.complete]


def delete_tag(storage: Storage, name: str, seen: Optional[Storage] = None, reuse_files: bool = False) -> None:
    """Remove a tag so that an interrupted delete never leaves a complete-looking directory, nor one that
    retention no longer recognises: `done` first. On POSIX the manifest next, then the directory is
    renamed to ``<name>.nxdold`` before its files go (debris recognised by name). Without rename see
    ``_delete_objects``. ``seen``: a listing the caller already holds (retention's), which names the tag's
    objects without another LIST. ``reuse_files``: its files are kept for the next save to take over
    (``reuse.retire``) where the storage can, instead of deleted."""
    storage.remove_file(f"{name}/{layout.DONE_MARKER}")
    if not storage.caps.rename:
        _delete_objects(storage, name, seen or storage)
        return
    storage.remove_file(f"{name}/{layout.MANIFEST_FILE}")
    storage.sync_dirs([name])
    if not _is_special(name):
        doomed = f"{name}{OLD_SUFFIX}"
        try:
            storage.remove_tree(doomed)
            storage.rename(name, doomed)
            name = doomed
        except OSError:
            pass   # remove it in place
    if reuse_files and reuse.retire(storage, name):
        return
    storage.remove_tree(name)


def _delete_objects(storage: Storage, name: str, seen: Storage) -> None:
    """An object store's tag whose `done` is gone: every object but the `checkpoint` marker in batched
    deletes (the manifest among them), the marker last. Whatever part of a batch a crash leaves is still an
    incomplete tag (``_is_tag_dir``: the manifest, or the marker with model/ or optim/ or only rank 0's
    small files), which the next successful save removes."""
    marker, done = f"{name}/{layout.CHECKPOINT_MARKER}", f"{name}/{layout.DONE_MARKER}"
    storage.delete_many([k for k in seen.list(name) if k not in (marker, done)])
    storage.remove_file(marker)


def apply_retention(storage: Storage, num_kept: Optional[int], protected: Iterable[str] = (),
                    in_flight: Iterable[str] = (), reuse_files: bool = False) -> List[str]:
    """Rank 0 after a successful commit: keep the newest ``num_kept`` complete tags (all when None or
    -1), delete older complete ones, incomplete ones left by crashes and staging debris. Never deletes the
    newest complete tag, a protected tag, or anything not recognisably a checkpoint. Returns what it
    deleted. ``reuse_files``: the last one deleted is kept for the next save to take its files over
    (reuse.py); False also empties what an earlier retirement kept."""
    protected = set(protected)
    repair_interrupted(storage, set(in_flight) | protected)
    busy: Set[str] = set(in_flight) | {staging_name(t) for t in in_flight}
    # On an object store every question below would be a request (a HEAD per marker, a LIST per prefix);
    # one listing answers them all (listdir("") lists every key anyway). Deletes still go to `storage`.
    seen = storage if storage.caps.local else listed(storage)
    tags = scan_tags(seen)
    complete = [t.tag for t in tags if t.complete]
    # Debris goes first: were a crash to stop retention after a tag went but before the debris did, a
    # leftover could otherwise outlive the tag it belongs to.
    doomed: List[str] = []
    for name in seen.listdir(""):
        if not _is_special(name) or name in busy or name in protected:
            continue
        if seen.isdir(name):
            doomed.append(name)
        elif name.endswith(layout.TMP_SUFFIX):
            storage.remove_file(name)   # e.g. `newest.nxdtmp` of a crash while replacing `newest`
    doomed += [t.tag for t in tags if not t.complete and t.tag not in busy and t.tag not in protected]
    if num_kept is not None and num_kept != -1:
        keep = set(complete[: max(1, num_kept)])
        # complete tags last and oldest first: a crash part-way leaves the newer ones, and the last one removed,
        # the one kept for the next save to reuse (reuse.py), is the newest complete one
        doomed += [t for t in reversed(complete) if t not in keep and t not in protected]
    doomed = [t for t in doomed if _is_special(t) or _is_tag_dir(seen, t)]
    for name in doomed:
        log.info("nxd_ckpt: retention removes %s", name)
        delete_tag(storage, name, seen, reuse_files)
    if not reuse_files and storage.caps.reuse_files:
        storage.remove_tree(reuse.REUSE_DIR)
    if doomed:
        storage.sync_dirs([""])
    return doomed
