"""Offline verification of checkpoint tags (reading through reader.FileReader, like everything else).

A tag written by nxd-ckpt has a manifest listing every file with its size and CRC32C: verifying it means
re-reading every byte. A tag written by neuronx-distributed has no manifest: the best we can do is check
that it is marked complete (`done`), that every file named by its ref pickles exists, and that every
tensor file opens.
"""
from __future__ import annotations

import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import torch

import xser

from . import commit, layout
from . import manifest as manifest_mod
from .manifest import Manifest
from .reader import FileReader
from .storage import Storage, open_storage
from .errors import CheckpointError, CorruptCheckpointError, UnsafeCheckpointError

def walk_refs(obj, path=()):
    """Yield (key path tuple, leaf) for every TensorReference or tensor in a nested structure."""
    if xser.is_ref(obj) or isinstance(obj, torch.Tensor):
        yield path, obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from walk_refs(v, path + (k,))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from walk_refs(v, path + (i,))


def shard_refs(where, folder: str = "") -> List[str]:
    """Names of the ref files (``dp_rank_*`` and ``full_*``) directly in ``folder`` of ``where`` (a path or a
    Storage), sorted."""
    return sorted(n for n in layout.storage_at(where).listdir(folder)
                  if layout.parse_shard_filename(n) is not None or layout.parse_full_filename(n) is not None)


# --- verification ----------------------------------------------------------------------------------
@dataclass
class VerifyResult:
    tag: str
    path: str
    ok: bool
    kind: str                                    # "nxd-ckpt" (manifest) or "neuronx-distributed"
    problems: List[Tuple[str, str]] = field(default_factory=list)   # (file relative to the tag, what)
    notes: List[str] = field(default_factory=list)
    files_checked: int = 0
    bytes_checked: int = 0

    def to_json(self) -> dict:
        return {"tag": self.tag, "path": self.path, "ok": self.ok, "kind": self.kind,
                "problems": [{"file": f, "problem": p} for f, p in self.problems], "notes": self.notes,
                "files_checked": self.files_checked, "bytes_checked": self.bytes_checked}


def _progress_bar(total: int, desc: str, progress: Optional[bool]):
    show = sys.stderr.isatty() if progress is None else bool(progress)
    if not show:
        return None
    from tqdm import tqdm

    return tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=desc, leave=False)


def _split_root(root: str) -> Tuple[str, str]:
    """(parent, name) of a tag's root path or URL."""
    parent, _, name = root.rstrip("/").rpartition("/")
    return parent or "/", name


def _dir_is_managed(st: Storage) -> bool:
    """True when the tag's parent directory is managed by nxd-ckpt: it has our `newest` pointer or another
    tag with a manifest. A tag there whose manifest is missing has most likely lost it."""
    parent_root, me = _split_root(st.root)
    if parent_root.endswith(":/"):          # the tag is a bucket's top level: no parent to look at
        return False
    try:
        parent = open_storage(parent_root)
        if parent.isfile(layout.NEWEST_FILE):
            return True
        names = parent.listdir("")
    except OSError:
        return False
    return any(n != me and parent.isfile(f"{n}/{layout.MANIFEST_FILE}") for n in names)


def verify_tag(tagdir, workers: int = 8, progress: Optional[bool] = None, *,
               require_manifest: Optional[bool] = None, trusted: bool = False) -> VerifyResult:
    """Check one tag directory (a path, an ``s3://`` URL or a Storage rooted at the tag). With a manifest:
    every listed file's size and CRC32C (``workers`` threads). Without one: NxD's completeness rules
    (``done``, every file named by the ref pickles, tensor files open).

    ``require_manifest``: None (default) requires one when the parent directory is managed by nxd-ckpt
    (a ``newest`` pointer or another tag with a manifest); True always; False never.
    """
    st = layout.storage_at(tagdir)
    res = VerifyResult(_split_root(st.root)[1], st.root, False, "nxd-ckpt")
    if not st.isdir(""):
        res.problems.append((".", "the tag directory does not exist"))
        return res
    try:
        manifest = manifest_mod.read(st)
    except CorruptCheckpointError as exc:
        res.problems.append((layout.MANIFEST_FILE, str(exc)))
        manifest = None
        require_manifest = False  # already reported; still check what can be checked
    if not st.isfile(layout.DONE_MARKER):
        res.problems.append((layout.DONE_MARKER, "missing: the checkpoint is incomplete (its save never finished)"))
    if manifest is not None:
        _verify_manifest(st, manifest, res, workers, progress)
    else:
        res.kind = "neuronx-distributed"
        if require_manifest is None:
            require_manifest = _dir_is_managed(st)
        if require_manifest and not any(p[0] == layout.MANIFEST_FILE for p in res.problems):
            res.kind = "nxd-ckpt"
            res.problems.append((layout.MANIFEST_FILE,
                                 "missing: nxd-ckpt writes one for every checkpoint it saves, so this tag is "
                                 "incomplete or damaged (if neuronx-distributed wrote it, check it with --nxd)"))
        _verify_nxd(st, res, workers, progress, trusted)
    res.ok = not res.problems
    return res


def _verify_manifest(st: Storage, manifest: Manifest, res: VerifyResult, workers: int, progress) -> None:
    files = manifest.files
    reader = FileReader.at(st, manifest)
    bar = _progress_bar(sum(e.size for e in files.values()), f"verify {res.tag}", progress)

    def job(item):
        rel, entry = item
        problem = reader.mismatch(rel, records=True)
        if bar is not None:
            bar.update(entry.size)
        return rel, entry, problem

    try:
        with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
            for rel, entry, problem in pool.map(job, sorted(files.items())):
                res.files_checked += 1
                if problem is None:
                    res.bytes_checked += entry.size
                else:
                    res.problems.append((rel, problem))
    finally:
        if bar is not None:
            bar.close()
    # Files the manifest does not know (other than markers) are not part of the checkpoint; mention them.
    known = set(files) | {layout.CHECKPOINT_MARKER, layout.DONE_MARKER, layout.MANIFEST_FILE}
    extra = [rel for rel in st.list("") if rel not in known]
    if extra:
        res.notes.append(f"{len(extra)} file(s) not listed in the manifest (ignored), e.g. {sorted(extra)[0]}")


def _verify_nxd(st: Storage, res: VerifyResult, workers: int, progress, trusted: bool) -> None:
    """NxD rules: every ref file loads, every tensor file it names exists and opens."""
    reader = FileReader.at(st, None, trusted)
    tensor_files: List[str] = []
    folders = [f for f in (layout.MODEL_DIR, layout.OPTIM_DIR) if st.isdir(f)]
    if not folders:
        res.problems.append((".", "no model/ or optim/ folder: nothing was saved in this tag"))
    from_masters = layout.model_data_absent(st)
    if from_masters:
        res.notes.append("model weights kept only as ZeRO-1 master weights (avoid_saving_lower_precision_weights): "
                         "model/ has no tensor files by design; optim/ must hold sharded_master_weights")
    for folder in folders:
        if folder == layout.OPTIM_DIR and st.isfile(f"{folder}/{layout.DCP_METADATA_FILE}"):
            _check_dcp(st, res, trusted)
            continue
        tensor_files += _check_refs(reader, folder, res, from_masters)
        if folder == layout.OPTIM_DIR:
            _check_dp_ranks(st, res)
    _check_tensor_files(reader, tensor_files, res, workers, progress)
    res.notes.append("no manifest: checked completeness and that every file opens, not checksums")


def _check_refs(reader: FileReader, folder: str, res: VerifyResult, from_masters: bool) -> List[str]:
    """Load every ref file of ``folder``; the tensor files the xser ones name."""
    tensor_files: List[str] = []
    xser_folder = layout.folder_is_xser(reader.storage, folder)
    refs = shard_refs(reader.storage, folder)
    if not refs:
        res.problems.append((folder, "holds no shard files (dp_rank_*_tp_rank_*_pp_rank_*.pt)"))
    for name in refs:
        rel = f"{folder}/{name}"
        res.files_checked += 1
        if xser_folder:
            data = _read_noting(res, rel, lambda: reader.load_pickle(rel))
            if data is _UNREADABLE:
                continue
            if from_masters and folder == layout.OPTIM_DIR and "sharded_master_weights" not in data:
                res.problems.append((rel, "has no sharded_master_weights, which hold this tag's model weights"))
            if from_masters and folder == layout.MODEL_DIR:
                continue
            info = None
            if (layout.parse_shard_filename(name) or layout.ShardName(0, 0, 0)).ep:
                try:   # non-expert tensors of ep_rank > 0 live in ep_rank_00's folder (layout.tensor_home)
                    info = reader.info(rel)
                except CheckpointError as exc:
                    res.problems.append((layout.info_path(rel), str(exc)))
            for tid in xser.collect_tids(data):
                expert = layout.is_expert(info.get(tid)) if info is not None else True
                tensor_files.append(layout.tensor_path(layout.tensor_home(rel, expert), tid))
        else:
            try:
                reader.plain(rel, mmap=True)
            except UnsafeCheckpointError as exc:
                res.problems.append((rel, f"not checkable without --trusted: {exc}"))
            except CheckpointError as exc:
                res.problems.append((rel, str(exc)))
    return tensor_files


def _check_tensor_files(reader: FileReader, tensor_files: List[str], res: VerifyResult, workers: int,
                        progress) -> None:
    """Every tensor file named by a ref file exists and opens (``workers`` threads)."""
    sizes = {}
    for rel in tensor_files:
        try:
            sizes[rel] = reader.storage.size(rel)
        except OSError:
            sizes[rel] = 0
    bar = _progress_bar(sum(sizes.values()), f"verify {res.tag}", progress)

    def job(rel):
        problem = None
        if not reader.exists(rel):
            problem = "missing (named by its ref file)"
        else:
            try:
                reader.load_tensor(rel)
            except UnsafeCheckpointError as exc:
                problem = f"not checkable without --trusted: {exc}"
            except CheckpointError as exc:
                problem = f"does not open: {exc}"
        if bar is not None:
            bar.update(sizes[rel])
        return rel, problem

    try:
        with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
            for rel, problem in pool.map(job, tensor_files):
                res.files_checked += 1
                if problem is None:
                    res.bytes_checked += sizes[rel]
                else:
                    res.problems.append((rel, problem))
    finally:
        if bar is not None:
            bar.close()


_UNREADABLE = object()


def _read_noting(res: "VerifyResult", rel: str, read):
    """``read()``, or _UNREADABLE with the reason noted as a problem of ``rel`` (unsafe without --trusted, or
    damaged)."""
    try:
        return read()
    except UnsafeCheckpointError as exc:
        res.problems.append((rel, f"not checkable without --trusted: {exc}"))
    except CheckpointError as exc:
        res.problems.append((rel, str(exc)))
    return _UNREADABLE


def _check_dcp(st: Storage, res: VerifyResult, trusted: bool) -> None:
    """NxD's use_zero1_dcp optimizer: .metadata reads, and every data file it names holds the bytes it points at."""
    from .dcpmeta import read_metadata

    rel = f"{layout.OPTIM_DIR}/{layout.DCP_METADATA_FILE}"
    meta = _read_noting(res, rel, lambda: read_metadata(st.read_bytes(rel), rel, trusted))
    if meta is _UNREADABLE:
        return
    res.files_checked += 1
    ends: Dict[str, int] = {}
    for info in (meta.storage_data or {}).values():
        ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
    for name, end in sorted(ends.items()):
        data_rel = f"{layout.OPTIM_DIR}/{name}"
        res.files_checked += 1
        if not st.isfile(data_rel):
            res.problems.append((data_rel, "missing (named by optim/.metadata)"))
        elif st.size(data_rel) < end:
            res.problems.append((data_rel, f"has {st.size(data_rel)} bytes, optim/.metadata needs {end} (truncated)"))
        else:
            res.bytes_checked += st.size(data_rel)


def _check_dp_ranks(st: Storage, res: VerifyResult) -> None:
    groups: Dict[tuple, set] = {}
    for sh in layout.list_shard_files(st, layout.OPTIM_DIR):
        groups.setdefault((sh.ep, sh.tp, sh.pp), set()).add(sh.dp)
    sets = {k: v for k, v in groups.items() if v}
    if not sets:
        return
    size = max(max(v) for v in sets.values()) + 1
    for (ep, tp, pp), dps in sorted(sets.items(), key=lambda kv: str(kv[0])):
        missing = sorted(set(range(size)) - dps)
        if missing and size > 1:
            name = layout.shard_filename(missing[0], tp, pp, ep)
            res.problems.append((f"{layout.OPTIM_DIR}/{name}",
                                 f"missing: ZeRO-1 shards of tp {tp} pp {pp} lack dp rank(s) {missing}"))


def list_tag_dirs(checkpoint_dir) -> List[str]:
    """Tag directories under a checkpoint dir (a path, URL or Storage): what load_checkpoint can read, newest
    first (including a tag a crash left under a suffixed name), then the incomplete ones; other staging
    debris excluded."""
    storage = layout.storage_at(checkpoint_dir)
    return [name for _, name in commit.loadable(storage)] + [t.tag for t in commit.scan_tags(storage)
                                                             if not t.complete]


def verify_dir(checkpoint_dir, workers: int = 8, progress: Optional[bool] = None, **kw) -> List[VerifyResult]:
    """verify_tag for every tag under ``checkpoint_dir`` (a path, URL or Storage), newest first."""
    storage = layout.storage_at(checkpoint_dir)
    return [verify_tag(storage.child(t), workers, progress, **kw) for t in list_tag_dirs(storage)]


def is_tag_dir(path) -> bool:
    """True when ``path`` (a path, URL or Storage) looks like one tag (markers, manifest, model/ or optim/),
    not a checkpoint dir."""
    st = layout.storage_at(path)
    return any(st.exists(n) for n in (
        layout.DONE_MARKER, layout.CHECKPOINT_MARKER, layout.MANIFEST_FILE, layout.MODEL_DIR, layout.OPTIM_DIR))
