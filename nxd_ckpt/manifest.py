"""The manifest of a tag (``manifest.json``) as typed records, and the `done` record that seals it.

Build (rank 0 at commit, the offline tools), parse and validate (every reader), seal (`done` records the
manifest's size and CRC32C, so a tag that lost or altered its manifest is recognised as damaged), and the
one check of a file's bytes against its entry.
"""
from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from typing import Dict, Optional, Tuple

import crc32c as _crc32c
import torch

from . import layout
from ._version import __version__
from .errors import CorruptCheckpointError
from .storage.s3 import S3Error

FORMAT = "nxd-ckpt-manifest"
VERSION = 1
_DONE_PREFIX = b"nxd-ckpt manifest"


@dataclass(frozen=True)
class RangeSum:
    """The CRC32C (8 hex digits) of ``length`` bytes at ``offset`` of a file: one zip record of a plain
    (non-xser) shard (its local header and data) or the zip's central directory and end records, so a reader
    that needs a few tensors of the file checks just the records it reads (``rangecheck``)."""

    offset: int
    length: int
    crc32c: str

    @property
    def end(self) -> int:
        return self.offset + self.length

    def to_json(self) -> list:
        return [self.offset, self.length, self.crc32c]

    @classmethod
    def from_json(cls, v) -> "RangeSum":
        offset, length, crc = v
        if int(offset) < 0 or int(length) < 0:
            raise ValueError(f"a byte range has a negative offset or length: {v!r}")
        return cls(int(offset), int(length), str(crc))


@dataclass(frozen=True)
class FileEntry:
    """One file of the tag: its size, CRC32C (8 hex digits) and the global rank that wrote it; for a plain
    shard also the CRC32C of each of its zip records (``ranges``: sorted, disjoint; None for other files and in
    manifests written before they were recorded)."""

    size: int
    crc32c: str
    rank: Optional[int] = None
    ranges: Optional[Tuple[RangeSum, ...]] = None

    def to_json(self) -> dict:
        out: Dict[str, object] = {"size": self.size, "crc32c": self.crc32c}
        if self.rank is not None:
            out["rank"] = self.rank
        if self.ranges is not None:
            out["ranges"] = [r.to_json() for r in self.ranges]
        return out

    @classmethod
    def from_json(cls, e: dict) -> "FileEntry":
        ranges = e.get("ranges")
        if ranges is not None:
            ranges = tuple(sorted((RangeSum.from_json(r) for r in ranges), key=lambda r: r.offset))
            if any(a.end > b.offset for a, b in zip(ranges, ranges[1:])) or (ranges and ranges[-1].end > int(e["size"])):
                raise ValueError(f"byte ranges overlap or run past the file's {e['size']} bytes")
        return cls(int(e["size"]), str(e["crc32c"]), e.get("rank"), ranges)

    def range_mismatch(self, r: RangeSum, crc: int) -> Optional[str]:
        """What is wrong with range ``r`` of this file whose bytes have CRC32C ``crc``, or None."""
        if f"{crc:08x}" == r.crc32c:
            return None
        return (f"fails its checksum on bytes {r.offset}..{r.end}: expected crc32c {r.crc32c}, found {crc:08x} "
                "(damaged)")

    def mismatch(self, size: int, crc: Optional[int]) -> Optional[str]:
        """What is wrong with a file of ``size`` bytes and CRC32C ``crc`` (None: not computed), or None."""
        if size != self.size:
            return f"has {size} bytes, the manifest says {self.size} (truncated or overwritten)"
        if crc is not None and f"{crc:08x}" != self.crc32c:
            return f"fails its checksum: expected crc32c {self.crc32c}, found {crc:08x} (damaged)"
        return None

    def check(self, size: int, crc: Optional[int], where: str, hint: str = "") -> None:
        """Raise CorruptCheckpointError naming ``where`` when the file does not match this entry."""
        problem = self.mismatch(size, crc)
        if problem is None:
            return
        if size != self.size:
            expected, found = str(self.size), str(size)
        else:
            expected, found = self.crc32c, f"{crc:08x}"
        raise CorruptCheckpointError(f"{where} {problem}{'; ' + hint if hint else ''}", path=where,
                                     expected=expected, found=found)

    def check_bytes(self, data, where: str, hint: str = "") -> None:
        self.check(len(data), _crc32c.crc32c(data), where, hint)


@dataclass(frozen=True)
class TensorMeta:
    """One tensor of a shard: dtype name, shape, state-dict key and its partition attributes
    (``tensor_model_parallel``, ``partition_dim``, ``partition_stride``, ``expert_model_parallel``)."""

    dtype: str
    shape: Tuple[int, ...]
    key: str = ""
    attrs: Dict[str, object] = field(default_factory=dict)

    @classmethod
    def from_json(cls, d: dict) -> "TensorMeta":
        rest = {k: v for k, v in d.items() if k not in ("dtype", "shape", "key")}
        return cls(str(d["dtype"]), tuple(int(x) for x in d["shape"]), str(d.get("key", "")), rest)

    @classmethod
    def from_info(cls, entry: dict) -> "TensorMeta":
        """From an ``.info.pt`` entry (torch dtype, torch.Size, attributes; it records no state-dict key)."""
        rest = {k: v for k, v in entry.items() if k not in ("dtype", "shape")}
        return cls(str(entry["dtype"]).replace("torch.", ""), tuple(int(d) for d in entry["shape"]), "", rest)

    def to_json(self) -> dict:
        return {"dtype": self.dtype, "shape": list(self.shape), "key": self.key, **self.attrs}


#: The partition attributes an ``.info.pt`` entry carries besides dtype, shape and expert_model_parallel (NxD's).
INFO_ATTRS = ("tensor_model_parallel", "partition_dim", "partition_stride")


def info_entry(dtype: str, shape, attrs) -> Optional[dict]:
    """NxD's ``.info.pt`` entry of one tensor ({dtype, shape, expert_model_parallel, partition attributes})
    from what the manifest records of it: its dtype name, shape and attributes (a TensorMeta's ``attrs``, or a
    whole tensor_meta dict). The one place that builds it: the save's ``.info.pt``, the offline tools' and the
    load's view of a manifest must hold the same entries, in the same key order (the same pickle bytes).
    None for a dtype name this torch does not know."""
    torch_dtype = getattr(torch, dtype, None)
    if not isinstance(torch_dtype, torch.dtype):
        return None
    entry = {"dtype": torch_dtype, "shape": torch.Size(shape),
             "expert_model_parallel": bool(attrs.get("expert_model_parallel", False))}
    for k in INFO_ATTRS:
        if k in attrs:
            entry[k] = attrs[k]
    return entry


@dataclass(frozen=True)
class Topology:
    world_size: Optional[int] = None
    tp: int = 1
    pp: int = 1
    dp: Optional[int] = None
    cp: Optional[int] = None
    ep: int = 1
    layout: Optional[str] = None      # NxD's rank layout (parallel_state); None: not recorded (row-major)

    @classmethod
    def from_json(cls, d: dict) -> "Topology":
        known = {k: d.get(k) for k in ("world_size", "dp", "cp", "layout")}
        return cls(tp=int(d.get("tp") or 1), pp=int(d.get("pp") or 1), ep=int(d.get("ep") or 1), **known)


_MANIFEST_FIELDS = frozenset({"format", "format_version", "library_version", "tag", "created_at", "topology", "zero1",
                              "xser", "has_model", "has_optim", "files", "tensors"})


@dataclass
class Manifest:
    tag: str
    topology: Topology
    zero1: bool
    xser: bool
    files: Dict[str, FileEntry]
    tensors: Dict[str, Dict[str, TensorMeta]]     # shard ref path -> tid (str) -> meta
    has_model: bool = True
    has_optim: bool = True
    library_version: str = __version__
    created_at: float = field(default_factory=time.time)
    extra: Dict[str, object] = field(default_factory=dict)   # fields other writers added, kept as they are

    def to_json(self) -> dict:
        return {
            "format": FORMAT, "format_version": VERSION, "library_version": self.library_version,
            "tag": self.tag, "created_at": self.created_at,
            "topology": {k: v for k, v in asdict(self.topology).items() if not (k == "layout" and v is None)},
            "zero1": self.zero1, "xser": self.xser, "has_model": self.has_model, "has_optim": self.has_optim,
            **self.extra,
            "files": {rel: e.to_json() for rel, e in sorted(self.files.items())},
            "tensors": {rel: {tid: m.to_json() for tid, m in ts.items()} for rel, ts in self.tensors.items()},
        }

    def body(self) -> bytes:
        # Compact: json's C encoder only runs without ``indent`` (5x cheaper for a 5,000-file manifest).
        return json.dumps(self.to_json(), separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, data: dict) -> "Manifest":
        return cls(
            tag=str(data.get("tag", "")), topology=Topology.from_json(data["topology"]),
            zero1=bool(data["zero1"]), xser=bool(data["xser"]),
            files={rel: FileEntry.from_json(e) for rel, e in data["files"].items()},
            tensors={rel: {str(tid): TensorMeta.from_json(m) for tid, m in ts.items()}
                     for rel, ts in data["tensors"].items()},
            has_model=bool(data.get("has_model", True)), has_optim=bool(data.get("has_optim", True)),
            library_version=str(data.get("library_version", "")), created_at=float(data.get("created_at", 0.0)),
            extra={k: v for k, v in data.items() if k not in _MANIFEST_FIELDS},
        )

    @property
    def zero1_shards(self) -> Optional[int]:
        """How many DP shards a ZeRO-1 optimizer state has: ZeRO-1 files are named by the full DP rank,
        with or without EP."""
        return self.topology.dp


def legacy_ep_folders(manifest: Optional[Manifest]) -> frozenset:
    """The folders (``model``, ``optim``) of an expert-parallel checkpoint that nxd-ckpt wrote in its layout
    before it took NxD's (0.1.0 up to commit 5310e3a; read, never written): there every shard keeps all its
    tensors in its own ``.tensors/`` folder (``layout.own_home``), and ZeRO-1 optimizer files are named
    ``dp_rank_{expert-DP rank}_ep_rank_{EP rank}_...``. Told by the manifest (NxD writes none): ZeRO-1 files
    with an ep field, or an ``ep_rank`` > 0 shard listing the tensor file of a tensor not marked expert,
    which NxD's layout keeps only under ``ep_rank_00``. Per folder, as convert-zero1 rewrites optim/ only."""
    if manifest is None or manifest.topology.ep <= 1:
        return frozenset()
    found = set()
    if manifest.zero1 and any(_ep_named(rel, layout.OPTIM_DIR) for rel in manifest.files):
        found.add(layout.OPTIM_DIR)
    for rel, metas in manifest.tensors.items():
        folder = rel.partition("/")[0]
        if folder in found or not _ep_named(rel, folder, above_zero=True):
            continue
        if any(not m.attrs.get("expert_model_parallel")
               and f"{layout.tensors_dir(rel)}/{layout.tensor_filename(int(t))}" in manifest.files
               for t, m in metas.items()):
            found.add(folder)
    return frozenset(found)


def _ep_named(relpath: str, folder: str, above_zero: bool = False) -> bool:
    """Whether ``relpath`` is a shard ref file directly in ``folder`` with an ep field (> 0 if ``above_zero``)."""
    head, _, name = relpath.rpartition("/")
    s = layout.parse_shard_filename(name)
    return head == folder and s is not None and s.ep is not None and (s.ep > 0 or not above_zero)


def build(tag: str, topology: dict, flags: dict, files: Dict[str, dict], tensors: Dict[str, dict]) -> Manifest:
    """A manifest from JSON-shaped pieces (the per-rank reports gathered at commit)."""
    data = {"library_version": __version__, "created_at": time.time(), "tag": tag, "topology": topology, **flags,
            "files": files, "tensors": tensors}
    data.setdefault("zero1", False)
    data.setdefault("xser", True)
    return Manifest.from_json(data)


@dataclass
class ManifestDraft:
    """The manifest rank 0 commits, as JSON-shaped data (what ``Manifest.to_json`` returns), serialized once by
    :meth:`body`. Built from the ranks' reports without a FileEntry and a TensorMeta per file and tensor: at
    5,000 tensor files those objects and their JSON copies were tens of thousands of GC-tracked objects per save,
    enough to set off a full collection of the training process's heap in nearly every save (README
    "Levers measured")."""

    data: dict

    def body(self) -> bytes:
        return json.dumps(self.data, separators=(",", ":")).encode()


def draft(tag: str, topology: dict, flags: dict, files: Dict[str, dict], tensors: Dict[str, dict],
          extra: Optional[Dict[str, object]] = None) -> ManifestDraft:
    """The committed manifest from the reports: ``files`` relpath -> FileRecord JSON with the writing rank added,
    ``tensors`` ref path -> {tid: tensor_meta}. Holds the same JSON as ``build(...).to_json()``: a file with byte
    ranges goes through FileEntry (which checks them), the others are taken as they are."""
    man = Manifest(tag=tag, topology=Topology.from_json(topology), zero1=bool(flags.get("zero1", False)),
                   xser=bool(flags.get("xser", True)), files={}, tensors={},
                   has_model=bool(flags.get("has_model", True)), has_optim=bool(flags.get("has_optim", True)),
                   extra={k: v for k, v in flags.items() if k not in _MANIFEST_FIELDS})
    man.extra.update(extra or {})
    data = man.to_json()
    data["files"] = {rel: _entry_json(files[rel]) for rel in sorted(files)}
    data["tensors"] = tensors       # tids as the reports hold them: json writes an int key as its string
    return ManifestDraft(data)


def _entry_json(record: dict) -> dict:
    return FileEntry.from_json(record).to_json() if "ranges" in record else record


def seal(body: bytes) -> bytes:
    """What nxd-ckpt writes into `done` (NxD only checks that it exists): the manifest's size and CRC32C,
    so a tag that lost its manifest, or whose manifest changed, is recognised as damaged."""
    return b"%s size=%d crc32c=%08x\n" % (_DONE_PREFIX, len(body), _crc32c.crc32c(body))


def sealed(done: Optional[bytes]) -> Optional[Tuple[int, str]]:
    """(size, crc32c) of the manifest recorded in a `done` body, or None for NxD's (and older) markers."""
    if not done or not done.startswith(_DONE_PREFIX):
        return None
    fields = dict(f.split(b"=", 1) for f in done.split()[2:] if b"=" in f)
    try:
        return int(fields[b"size"]), fields[b"crc32c"].decode()
    except (KeyError, ValueError, UnicodeDecodeError):
        return -1, ""    # ours, but the record itself is damaged: nothing will match it


_FIELDS = {"topology": dict, "files": dict, "tensors": dict, "zero1": bool, "xser": bool}


def parse(body: Optional[bytes], done: Optional[bytes], where: str) -> Optional[Manifest]:
    """The manifest of a tag from the bytes of its manifest file (None: no file) and of its `done`
    (None: none). None when the tag has no manifest and `done` does not name one (a neuronx-distributed
    checkpoint). ValueError, saying what is wrong, when it is missing, altered or not a manifest."""
    seal_ = sealed(done)
    name = f"{where}/{layout.MANIFEST_FILE}"
    if body is None:
        if seal_ is not None:
            raise ValueError(f"{name} is missing although `done` records one")
        return None
    if seal_ is not None:
        found = (len(body), f"{_crc32c.crc32c(body):08x}")
        if found != seal_:
            raise ValueError(f"{name} does not match the size and crc32c recorded in `done` "
                             f"(expected {seal_[0]} bytes, crc32c {seal_[1]}; found {found[0]}, {found[1]})")
    try:
        data = json.loads(body)
    except ValueError:
        raise ValueError(f"{name} is not valid JSON") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ValueError(f"{name} is not an nxd-ckpt manifest")
    wrong = [k for k, kind in _FIELDS.items() if not isinstance(data.get(k), kind)]
    if wrong:
        raise ValueError(f"{name} lacks or garbles the fields {wrong}")
    try:
        return Manifest.from_json(data)
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"{name} has a malformed entry ({exc!r})") from None


def _in(tag: str, rel: str) -> str:
    """``rel`` inside ``tag`` ("" when the storage is rooted at the tag itself)."""
    return f"{tag}/{rel}" if tag else rel


def read(where, tag: str = "") -> Optional[Manifest]:
    """The one way to load a tag's manifest: ``tag`` in ``where`` (a path, URL or Storage; ``tag`` "" when it
    is rooted at the tag itself). None when the tag has none (NxD checkpoints). CorruptCheckpointError naming
    the file when it is missing although `done` records one, altered, or unreadable."""
    storage = layout.storage_at(where)
    name = _in(tag, layout.MANIFEST_FILE) if tag else f"{storage.root}/{layout.MANIFEST_FILE}"
    try:
        return parse(_read_if_file(storage, _in(tag, layout.MANIFEST_FILE)),
                     _read_if_file(storage, _in(tag, layout.DONE_MARKER)), tag or storage.root)
    except S3Error:
        raise    # the store did not answer in time: a failed load, not damage (tag=None must not skip the tag)
    except (OSError, ValueError) as exc:
        detail = str(exc) if isinstance(exc, ValueError) else f"{name} cannot be read ({exc})"
        raise CorruptCheckpointError(
            f"{detail}: the manifest cannot be trusted, so the tag's files cannot be verified. Load another tag "
            f"(tag=None picks the newest intact one); `nxd-ckpt verify {storage.root}` checks every tag",
            path=name) from None


def _read_if_file(storage, rel: str) -> Optional[bytes]:
    try:
        return storage.read(rel)
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
        return None


# --- what a tag is ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class TagDescription:
    """What a tag directory holds, from its manifest (ours) or from its file names (NxD's).

    ``topology.dp`` is known from names only for ZeRO-1 optimizer states (the shards); ``zero1_shards``
    is the number of DP shards of a ZeRO-1 optimizer state (None otherwise)."""

    name: str
    ours: bool
    complete: bool
    topology: Topology
    zero1: bool
    zero1_shards: Optional[int]
    xser: bool
    has_model: bool
    has_optim: bool
    manifest: Optional[Manifest]
    zero1_dcp: bool = False      # NxD's use_zero1_dcp optimizer (a torch.distributed.checkpoint in optim/)


#: describe_tag(..., manifest=NO_MANIFEST): describe from the file names only (the manifest is known to be
#: absent, or cannot be trusted and the caller reports that itself).
NO_MANIFEST = object()


@dataclass(frozen=True)
class SavedLayout:
    """How a tag with a manifest was saved, from the manifest alone (no request)."""
    topology: Topology
    zero1: bool
    zero1_shards: Optional[int]
    xser: bool
    zero1_dcp: bool


def saved_layout(manifest: Manifest) -> SavedLayout:
    dcp = bool(manifest.extra.get("zero1_dcp"))
    return SavedLayout(manifest.topology, manifest.zero1, manifest.zero1_shards if manifest.zero1 and not dcp else None,
                       manifest.xser, dcp)


def describe_tag(storage, name: str, manifest=None) -> TagDescription:
    """The one answer to "what is this tag": ours or NxD's, complete or not, topology, ZeRO-1, xser. Pass
    ``manifest`` when it has been read already, or NO_MANIFEST; else it is read here (CorruptCheckpointError
    when it cannot be trusted)."""
    if manifest is None:
        manifest = read(storage, name)
    elif manifest is NO_MANIFEST:
        manifest = None
    complete = storage.isfile(_in(name, layout.DONE_MARKER))
    has_model, has_optim = storage.isdir(_in(name, layout.MODEL_DIR)), storage.isdir(_in(name, layout.OPTIM_DIR))
    if manifest is not None:
        s = saved_layout(manifest)
        return TagDescription(name, True, complete, s.topology, s.zero1, s.zero1_shards, s.xser,
                              manifest.has_model and has_model, manifest.has_optim and has_optim, manifest, s.zero1_dcp)
    model = storage.listdir(_in(name, layout.MODEL_DIR)) if has_model else []
    optim = storage.listdir(_in(name, layout.OPTIM_DIR)) if has_optim else []
    shards = [layout.parse_shard_filename(n) for n in optim]
    optim_shards = [s for s in shards if s is not None]
    names = [s for s in (layout.parse_shard_filename(n) for n in model) if s is not None] + optim_shards
    names += [f for f in (layout.parse_full_filename(n) for n in optim) if f is not None]
    ep = 1 + max((s.ep or 0 for s in names), default=0)
    zero1 = any(s.dp >= 1 for s in optim_shards)
    n_shards = 1 + max(s.dp for s in optim_shards) if zero1 else None
    topo = Topology(tp=1 + max((s.tp for s in names), default=0), pp=1 + max((s.pp for s in names), default=0),
                    dp=n_shards, ep=ep)   # ZeRO-1 files are named by the full DP rank, with or without EP
    xser_ = any(n.endswith(layout.TENSORS_SUFFIX) for n in model + optim)
    if layout.DCP_METADATA_FILE in optim:
        return TagDescription(name, False, complete, topo, True, None, xser_, has_model, has_optim, None, True)
    return TagDescription(name, False, complete, topo, zero1, n_shards, xser_, has_model, has_optim, None)
