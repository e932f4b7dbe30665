"""Offline verification of checkpoint tags, and a checksum-checking reader the other offline tools share.

A tag written by nxd-ckpt has a manifest listing every file with its size and CRC32C: verifying it means
re-reading every byte. A tag written by neuronx-distributed has no manifest: the best we can do is check
that it is marked complete (`done`), that every file named by its ref pickles exists, and that every
tensor file opens.
"""
from __future__ import annotations

import io
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import torch

import xser

from . import commit, layout
from .manifest import FileEntry, Manifest, parse as parse_manifest
from .storage import Storage, open_storage
from .errors import CheckpointError, CorruptCheckpointError, UnsafeCheckpointError

# --- reading with checks ---------------------------------------------------------------------------
def _tag_storage(where) -> Storage:
    """The Storage rooted at a tag directory given as a path, an ``s3://`` URL or a Storage."""
    return layout.storage_at(where)


def load_manifest_file(tagdir) -> Optional[Manifest]:
    """The tag's manifest (``tagdir``: a path, URL or Storage rooted at the tag), None when it has none;
    CorruptCheckpointError when it cannot be parsed."""
    st = _tag_storage(tagdir)
    try:
        return parse_manifest(_read_if_file(st, layout.MANIFEST_FILE), _read_if_file(st, layout.DONE_MARKER), st.root)
    except (OSError, ValueError) as exc:
        raise CorruptCheckpointError(f"the tag's manifest cannot be trusted: {exc}",
                                     path=f"{st.root}/{layout.MANIFEST_FILE}") from None


def _read_if_file(st: Storage, rel: str) -> Optional[bytes]:
    return st.read_bytes(rel) if st.isfile(rel) else None


class CheckedReader:
    """Reads the files of one tag (a path, an ``s3://`` URL or a Storage rooted at the tag), checking each
    against the manifest when there is one (``FileEntry.check``); memory-maps only where the backend is local.

    Paths are relative to the tag directory. Errors name the file: CorruptCheckpointError for missing,
    truncated, damaged or unreadable files; xser.UnsafeCheckpointError (from ref pickles that need
    ``trusted=True``) is passed through.
    """

    def __init__(self, tagdir, manifest: Optional[Manifest] = None, trusted: bool = False):
        self.storage = _tag_storage(tagdir)
        self.tagdir = self.storage.root
        self.manifest = manifest
        self.files: Dict[str, FileEntry] = dict(manifest.files) if manifest else {}
        self.trusted = trusted

    def path(self, relpath: str) -> str:
        """The file's local path, or its URL on an object store (for messages)."""
        return self.storage.local_path(relpath) or (f"{self.tagdir}/{relpath}" if relpath else self.tagdir)

    def read(self, relpath: str) -> bytes:
        where = self.path(relpath)
        try:
            data = self.storage.read_bytes(relpath)
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            raise CorruptCheckpointError(f"{where} is missing", path=where) from None
        entry = self.files.get(relpath)
        if entry is not None:
            entry.check_bytes(data, where)
        return data

    def exists(self, relpath: str) -> bool:
        return self.storage.isfile(relpath)

    def check_file(self, relpath: str) -> None:
        """Stream-check a (possibly large) file against the manifest without keeping it in memory."""
        entry = self.files.get(relpath)
        where = self.path(relpath)
        if not self.storage.isfile(relpath):
            raise CorruptCheckpointError(f"{where} is missing", path=where)
        if entry is None:
            return
        size, crc = self.storage.crc32c(relpath)
        entry.check(size, crc, where)

    def refs(self, relpath: str):
        """The ref pickle of a shard (TensorReferences, or inline tensors) loaded safely."""
        data = self.read(relpath)
        try:
            return xser.load_refs(io.BytesIO(data), trusted=self.trusted, name=self.path(relpath))
        except xser.UnsafeCheckpointError:
            raise
        except Exception as exc:  # noqa: BLE001 - any unpickling failure means a damaged file
            raise CorruptCheckpointError(f"{self.path(relpath)} cannot be read: {exc}",
                                         path=self.path(relpath)) from exc

    def _torch_load(self, relpath: str, mmap: bool):
        """torch.load of a checked file: memory-mapped from the local file, else from its verified bytes."""
        local = self.storage.local_path(relpath) if mmap else None
        if local is None:
            return torch.load(io.BytesIO(self.read(relpath)), map_location="cpu", weights_only=not self.trusted)
        return torch.load(local, map_location="cpu", weights_only=not self.trusted, mmap=True)

    def plain(self, relpath: str, mmap: bool = True):
        """A non-xser shard (one torch.save file), tensors memory-mapped when possible."""
        self.check_file(relpath)
        where = self.path(relpath)
        try:
            try:
                return self._torch_load(relpath, mmap)
            except RuntimeError as exc:
                if mmap and "mmap" in str(exc):  # legacy (non-zip) format cannot be memory-mapped
                    return self._torch_load(relpath, False)
                raise
        except Exception as exc:  # noqa: BLE001
            if not self.trusted and "weights_only" in str(exc):
                raise xser.UnsafeCheckpointError(
                    f"{where} holds objects a safe load refuses; if you trust its origin pass --trusted "
                    f"({str(exc).splitlines()[0]})") from None
            raise CorruptCheckpointError(f"{where} cannot be read: {exc}", path=where) from exc

    def tensor(self, relpath: str) -> torch.Tensor:
        """One xser tensor file, checked."""
        data = self.read(relpath)
        try:
            t = xser.read_tensor(io.BytesIO(data), trusted=self.trusted)
        except xser.UnsafeCheckpointError:
            raise
        except Exception as exc:  # noqa: BLE001
            raise CorruptCheckpointError(f"{self.path(relpath)} is not a readable tensor file: {exc}",
                                         path=self.path(relpath)) from exc
        if not isinstance(t, torch.Tensor):
            raise CorruptCheckpointError(f"{self.path(relpath)} does not hold a tensor", path=self.path(relpath))
        return t

    def tensor_mapped(self, relpath: str) -> torch.Tensor:
        """One xser tensor file, checked by a streaming read, then memory-mapped (no copy of its bytes on
        the heap: slicing it reads straight from the page cache). Falls back to ``tensor`` for files that
        cannot be mapped (legacy format, or a backend with no local file)."""
        local = self.storage.local_path(relpath)
        if local is None:
            return self.tensor(relpath)
        entry = self.files.get(relpath)
        if entry is not None:   # the loader's one-pass verified mapping; None: the full read says why
            from .reader import _read_tensor_mapped

            try:
                t = _read_tensor_mapped(local, entry, self.trusted, self.path(relpath))
            except xser.UnsafeCheckpointError:
                raise
            except Exception:  # noqa: BLE001 - any doubt: the byte-exact path decides and explains
                t = None
            return t if t is not None else self.tensor(relpath)
        self.check_file(relpath)
        try:
            t = torch.load(local, map_location="cpu", weights_only=not self.trusted, mmap=True)
        except Exception:  # noqa: BLE001 - legacy format, or damaged: the full read says which
            return self.tensor(relpath)
        if not isinstance(t, torch.Tensor):
            raise CorruptCheckpointError(f"{local} does not hold a tensor", path=local)
        return t

    def info(self, ref_relpath: str) -> Optional[dict]:
        """The shard's ``.info.pt`` ({tid: {dtype, shape, ...}}), None when absent (older NxD)."""
        rel = layout.info_path(ref_relpath)
        if not self.storage.isfile(rel):
            return None
        data = self.read(rel)
        try:
            return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
        except Exception as exc:  # noqa: BLE001
            raise CorruptCheckpointError(f"{self.path(rel)} cannot be read: {exc}", path=self.path(rel)) from exc


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


def _check_one(st: Storage, relpath: str, entry: FileEntry) -> Optional[str]:
    try:
        size = st.size(relpath)
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
        return "missing"
    except OSError as exc:
        return f"cannot be read: {exc}"
    if entry.mismatch(size, None):
        return entry.mismatch(size, None)
    try:
        size, crc = st.crc32c(relpath)
    except OSError as exc:
        return f"cannot be read: {exc}"
    return entry.mismatch(size, crc)


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
    st = _tag_storage(tagdir)
    res = VerifyResult(_split_root(st.root)[1], st.root, False, "nxd-ckpt")
    if not st.isdir(""):
        res.problems.append((".", "the tag directory does not exist"))
        return res
    try:
        manifest = load_manifest_file(st)
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
    bar = _progress_bar(sum(e.size for e in files.values()), f"verify {res.tag}", progress)

    def job(item):
        rel, entry = item
        problem = _check_one(st, rel, entry)
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
    reader = CheckedReader(st, None, trusted)
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


def _check_refs(reader: CheckedReader, folder: str, res: VerifyResult, from_masters: bool) -> List[str]:
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
            try:
                data = reader.refs(rel)
            except xser.UnsafeCheckpointError as exc:
                res.problems.append((rel, f"not checkable without --trusted: {exc}"))
                continue
            except CheckpointError as exc:
                res.problems.append((rel, str(exc)))
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
            except xser.UnsafeCheckpointError as exc:
                res.problems.append((rel, f"not checkable without --trusted: {exc}"))
            except CheckpointError as exc:
                res.problems.append((rel, str(exc)))
    return tensor_files


def _check_tensor_files(reader: CheckedReader, tensor_files: List[str], res: VerifyResult, workers: int,
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
                reader.tensor(rel)
            except xser.UnsafeCheckpointError as exc:
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


def _check_dcp(st: Storage, res: VerifyResult, trusted: bool) -> None:
    """NxD's use_zero1_dcp optimizer: .metadata reads, and every data file it names holds the bytes it points at."""
    from .dcpmeta import read_metadata

    rel = f"{layout.OPTIM_DIR}/{layout.DCP_METADATA_FILE}"
    try:
        meta = read_metadata(st.read_bytes(rel), rel, trusted)
    except UnsafeCheckpointError as exc:
        res.problems.append((rel, f"not checkable without --trusted: {exc}"))
        return
    except CheckpointError as exc:
        res.problems.append((rel, str(exc)))
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
