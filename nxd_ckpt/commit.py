"""The commit protocol: markers, manifest, atomic publish of a tag, the `newest` pointer, retention.

A save writes into ``<dir>/<tag>.nxdtmp/``. Once every rank has reported its files durable, rank 0
writes ``manifest.json`` and ``done`` there (both fsynced) and renames the directory to ``<dir>/<tag>``;
then replaces ``<dir>/newest``. A crash at any moment therefore leaves either the old state or the new
complete tag, plus at worst a ``.nxdtmp`` directory that the next successful save deletes.
"""
from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from typing import Dict, Iterable, List, Optional, Set, Tuple

import crc32c as _crc32c

from . import layout
from ._version import __version__
from .storage import Storage

log = logging.getLogger("nxd_ckpt")

STAGING_SUFFIX = layout.TMP_SUFFIX
OLD_SUFFIX = layout.OLD_SUFFIX
MANIFEST_FORMAT = "nxd-ckpt-manifest"
MANIFEST_VERSION = 1


def staging_name(tag: str) -> str:
    return f"{tag}{STAGING_SUFFIX}"


def prepare_staging(storage: Storage, tag: str, busy: Iterable[str] = ()) -> None:
    """Rank 0, before any rank writes: a fresh staging directory with NxD's `checkpoint` marker. Tags a
    crash left under a suffixed name are restored first (``busy``: other saves in flight)."""
    staging = staging_name(tag)
    repair_interrupted(storage, busy)
    if storage.exists(staging):
        delete_tag(storage, staging)
    storage.makedirs(staging)
    storage.write_file(f"{staging}/{layout.CHECKPOINT_MARKER}", lambda f: f.write(b"1"))


def build_manifest(tag: str, topology: dict, flags: dict, files: Dict[str, dict],
                   tensors: Dict[str, dict]) -> dict:
    return {
        "format": MANIFEST_FORMAT,
        "format_version": MANIFEST_VERSION,
        "library_version": __version__,
        "tag": tag,
        "created_at": time.time(),
        "topology": topology,
        **flags,
        "files": dict(sorted(files.items())),
        "tensors": tensors,
    }


def publish(storage: Storage, tag: str, manifest: dict) -> None:
    """Rank 0, after every rank's files are durable: manifest, `done`, rename into place, `newest`."""
    staging = staging_name(tag)
    body = json.dumps(manifest, indent=1, sort_keys=False).encode()
    storage.write_file(f"{staging}/{layout.MANIFEST_FILE}", lambda f: f.write(body))
    storage.write_file(f"{staging}/{layout.DONE_MARKER}", lambda f: f.write(done_body(body)))
    storage.sync_dirs([staging])
    if storage.exists(tag):
        _replace_tag(storage, staging, tag)
    else:
        storage.rename(staging, tag)
    storage.sync_dirs([""])
    try:
        write_newest(storage, tag)
    except Exception as exc:  # noqa: BLE001 - the tag is complete; `newest` is informational only
        log.warning("nxd_ckpt: checkpoint %s is complete but %s could not be updated: %s (load_checkpoint does not "
                    "rely on it; the next save rewrites it)", tag, layout.NEWEST_FILE, exc)


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


def recoverable_tags(storage: Storage, busy: Iterable[str] = ()) -> Dict[str, str]:
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


def repair_interrupted(storage: Storage, busy: Iterable[str] = ()) -> List[str]:
    """Rank 0 of a saving job, before it creates staging directories or removes debris: give each
    ``recoverable_tags`` entry its name back. Returns the tags restored."""
    restored = []
    for tag, name in sorted(recoverable_tags(storage, busy).items()):
        log.warning("nxd_ckpt: checkpoint %s was left as %s by a crash while it was published; restoring it",
                    tag, name)
        storage.rename(name, tag)
        restored.append(tag)
    if restored:
        storage.sync_dirs([""])
    return restored


def write_newest(storage: Storage, tag: str) -> None:
    storage.write_file(layout.NEWEST_FILE, lambda f: f.write(tag.encode()))


_DONE_PREFIX = b"nxd-ckpt manifest"


def done_body(manifest_body: bytes) -> bytes:
    """What nxd-ckpt writes into `done` (NxD only checks that it exists): the manifest's size and CRC32C,
    so a tag that lost its manifest, or whose manifest changed, is recognised as damaged."""
    return b"%s size=%d crc32c=%08x\n" % (_DONE_PREFIX, len(manifest_body), _crc32c.crc32c(manifest_body))


def _sealed(done: Optional[bytes]) -> Optional[Tuple[int, str]]:
    """(size, crc32c) of the manifest recorded in a `done` body, or None for NxD's (and older) markers."""
    if not done or not done.startswith(_DONE_PREFIX):
        return None
    fields = dict(f.split(b"=", 1) for f in done.split()[2:] if b"=" in f)
    try:
        return int(fields[b"size"]), fields[b"crc32c"].decode()
    except (KeyError, ValueError, UnicodeDecodeError):
        return -1, ""    # ours, but the record itself is damaged: nothing will match it


def parse_manifest(body: Optional[bytes], done: Optional[bytes], where: str) -> Optional[dict]:
    """The manifest of a tag from the bytes of its manifest file (None: no file) and of its `done`
    (None: none). None when the tag has no manifest and `done` does not name one (a neuronx-distributed
    checkpoint). ValueError, saying what is wrong, when it is missing, altered or not a manifest."""
    sealed = _sealed(done)
    if body is None:
        if sealed is not None:
            raise ValueError(f"{where}/{layout.MANIFEST_FILE} is missing although `done` records one")
        return None
    if sealed is not None:
        found = (len(body), f"{_crc32c.crc32c(body):08x}")
        if found != sealed:
            raise ValueError(f"{where}/{layout.MANIFEST_FILE} does not match the size and crc32c recorded in `done` "
                             f"(expected {sealed[0]} bytes, crc32c {sealed[1]}; found {found[0]}, {found[1]})")
    data = json.loads(body)
    if not isinstance(data, dict) or data.get("format") != MANIFEST_FORMAT:
        raise ValueError(f"{where}/{layout.MANIFEST_FILE} is not an nxd-ckpt manifest")
    wrong = [k for k, kind in _MANIFEST_FIELDS.items() if not isinstance(data.get(k), kind)]
    if wrong:
        raise ValueError(f"{where}/{layout.MANIFEST_FILE} lacks or garbles the fields {wrong}")
    return data


_MANIFEST_FIELDS = {"topology": dict, "files": dict, "tensors": dict, "zero1": bool, "xser": bool}


def read_manifest(storage: Storage, tag: str) -> Optional[dict]:
    """The tag's manifest, or None when it has none (NxD checkpoints). ValueError when it is missing
    although `done` records one, altered, or unreadable."""
    rel = f"{tag}/{layout.MANIFEST_FILE}"
    done = f"{tag}/{layout.DONE_MARKER}"
    body = storage.read_bytes(rel) if storage.exists(rel) else None
    return parse_manifest(body, storage.read_bytes(done) if storage.exists(done) else None, tag)


def expects_manifest(storage: Storage, tag: str) -> bool:
    """True when complete ``tag`` has no manifest although nxd-ckpt wrote it, i.e. the manifest was lost:
    `newest` names it, or it was committed no earlier than a tag of this directory that has a manifest.
    neuronx-distributed tags committed before nxd-ckpt first saved here still load without one."""
    if storage.exists(f"{tag}/{layout.MANIFEST_FILE}") or not storage.exists(f"{tag}/{layout.DONE_MARKER}"):
        return False
    if _sealed(storage.read_bytes(f"{tag}/{layout.DONE_MARKER}")) is not None:
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
        when = storage.mtime(done) if complete else storage.mtime(name)
        out.append(TagInfo(name, complete, when, storage.exists(f"{name}/{layout.MANIFEST_FILE}")))
    out.sort(key=lambda t: (t.committed_at, _natural_key(t.tag)), reverse=True)
    return out


def _is_tag_dir(storage: Storage, name: str) -> bool:
    """True for what retention may delete: ours (a manifest) or NxD's (`checkpoint` + model/ or optim/)."""
    if storage.exists(f"{name}/{layout.MANIFEST_FILE}"):
        return True
    return storage.exists(f"{name}/{layout.CHECKPOINT_MARKER}") and _has_state_dirs(storage, name)


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


def delete_tag(storage: Storage, name: str) -> None:
    """Remove a tag so that an interrupted delete never leaves a complete-looking directory: `done`
    first, then the manifest; then the directory is renamed to ``<name>.nxdold`` before its files go, so
    a crash part-way through leaves debris that the next retention recognises by name (rather than a
    directory that has lost its `checkpoint` marker and would never be cleaned up)."""
    storage.remove_file(f"{name}/{layout.DONE_MARKER}")
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
    storage.remove_tree(name)


def apply_retention(storage: Storage, num_kept: Optional[int], protected: Iterable[str] = (),
                    in_flight: Iterable[str] = ()) -> List[str]:
    """Rank 0 after a successful commit: keep the newest ``num_kept`` complete tags (all when None or
    -1), delete older complete ones, incomplete ones left by crashes and staging debris. Never deletes the
    newest complete tag, a protected tag, or anything not recognisably a checkpoint. Returns what it
    deleted."""
    protected = set(protected)
    repair_interrupted(storage, set(in_flight) | protected)
    busy: Set[str] = set(in_flight) | {staging_name(t) for t in in_flight}
    tags = scan_tags(storage)
    complete = [t.tag for t in tags if t.complete]
    # Debris goes first: were a crash to stop retention after a tag went but before the debris did, a
    # leftover could otherwise outlive the tag it belongs to.
    doomed: List[str] = []
    for name in storage.listdir(""):
        if not _is_special(name) or name in busy or name in protected:
            continue
        if storage.isdir(name):
            doomed.append(name)
        elif name.endswith(layout.TMP_SUFFIX):
            storage.remove_file(name)   # e.g. `newest.nxdtmp` of a crash while replacing `newest`
    if num_kept is not None and num_kept != -1:
        keep = set(complete[: max(1, num_kept)])
        doomed += [t for t in complete if t not in keep and t not in protected]
    doomed += [t.tag for t in tags if not t.complete and t.tag not in busy and t.tag not in protected]
    doomed = [t for t in doomed if _is_special(t) or _is_tag_dir(storage, t)]
    for name in doomed:
        log.info("nxd_ckpt: retention removes %s", name)
        delete_tag(storage, name)
    if doomed:
        storage.sync_dirs([""])
    return doomed
