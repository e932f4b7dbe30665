"""What is in a checkpoint directory and in one tag: `nxd-ckpt ls` and `nxd-ckpt info`.

Reads only small files (manifest, ref pickles, ``.info.pt``, scheduler and user content); tensor data is
never read, except the header of tensor files whose shape is recorded nowhere else (older NxD, --tensors).
"""
from __future__ import annotations

import datetime as _dt
import io
from typing import List, Optional

import torch

import xser

from . import commit, layout, masters
from .errors import CheckpointError, CheckpointNotFoundError, CorruptCheckpointError, UnsafeCheckpointError
from .manifest import NO_MANIFEST as _NO_MANIFEST, Manifest, TagDescription, describe_tag
from .storage import Storage
from .storage.listed import listed
from .manifest import read as read_manifest
from .reader import FileReader
from .verify import shard_refs, walk_refs


def _iso(ts: Optional[float]) -> Optional[str]:
    if ts is None:
        return None
    return _dt.datetime.fromtimestamp(ts, tz=_dt.timezone.utc).isoformat(timespec="seconds")


def _sizes(st: Storage, folder: str = ""):
    """(path relative to ``folder``, size) of every file under ``folder`` of ``st``."""
    base = f"{folder}/" if folder else ""
    for rel, stat in st.list_stats(folder).items():
        yield rel[len(base):], stat.size


def derived_topology(tagdir) -> dict:
    """tp/pp/dp/ep of a tag (a path, URL or Storage) without a manifest, from its file names
    (``manifest.describe_tag``). ``dp`` is only known for ZeRO-1 optimizer states (the number of DP shards);
    otherwise None."""
    return dict(vars(_describe(layout.storage_at(tagdir)).topology))


def _describe(st: Storage, manifest: Optional[Manifest] = None) -> TagDescription:
    return describe_tag(st, "", manifest if manifest is not None else _NO_MANIFEST)


def _name(st: Storage) -> str:
    return st.root.rstrip("/").rpartition("/")[2]


def _written_at(st: Storage, has_done: bool) -> Optional[float]:
    """When the tag was committed (its `done`), else when its directory last changed (None on an object
    store, which has no directories)."""
    try:
        return st.mtime(layout.DONE_MARKER if has_done else "")
    except OSError:
        return None


def tag_summary(tagdir, committed_at: Optional[float] = None) -> dict:
    """One row of `nxd-ckpt ls` for a tag (a path, URL or Storage rooted at it): status with a quick check
    (presence and sizes, no checksums). Sizes come from one listing of the tag (see storage.listed)."""
    st = listed(layout.storage_at(tagdir))
    tagdir = st.root
    has_done = st.isfile(layout.DONE_MARKER)
    row = {"tag": _name(st), "path": tagdir, "status": "complete" if has_done else "incomplete",
           "problem": None, "size": 0, "files": 0, "written_at": None, "format": None,
           "tp": None, "pp": None, "dp": None, "ep": None, "zero1": None, "xser": None}
    try:
        manifest = read_manifest(st)
    except CorruptCheckpointError as exc:
        manifest = None
        row.update(status="damaged", problem=str(exc))
    if manifest is not None:
        row["format"] = "nxd-ckpt"
        topo = manifest.topology
        row.update(tp=topo.tp, pp=topo.pp, dp=topo.dp, ep=topo.ep, zero1=manifest.zero1, xser=manifest.xser)
        files = manifest.files
        row["files"] = len(files)
        row["size"] = sum(e.size for e in files.values())
        if has_done:
            for rel, entry in sorted(files.items()):
                try:
                    size = st.size(rel)
                except OSError:
                    row.update(status="damaged", problem=f"{rel} is missing")
                    break
                if entry.mismatch(size, None):
                    row.update(status="damaged", problem=f"{rel} {entry.mismatch(size, None)}")
                    break
    else:
        row["format"] = "neuronx-distributed"
        d = _describe(st)
        topo = d.topology
        row.update(tp=topo.tp, pp=topo.pp, dp=topo.dp, ep=topo.ep, zero1=d.zero1, xser=d.xser)
        for rel, size in _sizes(st):
            if rel in (layout.CHECKPOINT_MARKER, layout.DONE_MARKER) or rel.endswith(layout.TMP_SUFFIX):
                continue
            row["files"] += 1
            row["size"] += size
    row["model_from_master_weights"] = (bool(manifest.extra.get(masters.FLAG)) if manifest is not None
                                        else layout.model_data_absent(st))
    row["written_at"] = _iso(committed_at if committed_at is not None else _written_at(st, has_done))
    return row


def list_tags(checkpoint_dir) -> List[dict]:
    """Every tag under ``checkpoint_dir`` (a path, an ``s3://`` URL or a Storage), newest first, with status
    complete / incomplete / damaged (a quick check: files missing or of the wrong size; checksums are
    `nxd-ckpt verify`'s job). The directory is listed once (on S3 one LIST request per 1,000 keys, no
    request per file); then only each tag's manifest and `done` are read."""
    storage = listed(layout.storage_at(checkpoint_dir))
    if not storage.isdir(""):
        raise CheckpointNotFoundError(f"{storage.root} is not a directory")
    dated = [(t.committed_at, tag_summary(storage.child(t.tag), t.committed_at))
             for t in commit.scan_tags(storage)]
    for tag, name in commit.recoverable_tags(storage).items():
        when = storage.mtime(f"{name}/{layout.DONE_MARKER}")
        row = tag_summary(storage.child(name), when)
        row["tag"] = tag
        row["problem"] = row["problem"] or (f"left as {name} by a crash while it was published; it loads from "
                                            "there, and the next save renames it back")
        dated.append((when, row))
    dated.sort(key=lambda d: d[0], reverse=True)
    return [row for _, row in dated]


def _small_file(name: str, trusted: bool, reader: FileReader) -> Optional[dict]:
    if not reader.exists(name):
        return None
    out = {"file": name, "bytes": reader.storage.size(name)}
    try:
        data = reader.read(name)
    except CorruptCheckpointError as exc:
        out["error"] = str(exc)
        return out
    try:
        obj = torch.load(io.BytesIO(data), map_location="cpu", weights_only=not trusted)
    except Exception as exc:  # noqa: BLE001
        if trusted:
            out["error"] = f"cannot be read: {str(exc).splitlines()[0]}"
        else:
            out["error"] = "not inspectable without --trusted (holds objects a safe load refuses)"
        return out
    if isinstance(obj, dict):
        out["keys"] = [str(k) for k in obj.keys()]
    else:
        out["type"] = type(obj).__name__
    return out


def _key_of(path) -> str:
    return "/".join(str(p) for p in path)


def _dtype_name(d) -> str:
    return str(d).replace("torch.", "")


def _nbytes(dtype_name: str, shape) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    try:
        return n * torch.empty((), dtype=getattr(torch, dtype_name)).element_size()
    except (AttributeError, TypeError):
        return 0


def shard_tensor_meta(reader: FileReader, rel: str, manifest: Optional[Manifest], xser_folder: bool,
                      want_missing_shapes: bool) -> List[dict]:
    """[{tid, key, dtype, shape, partition...}] of one shard ref file, from the manifest, else from the
    ref pickle + ``.info.pt`` (reading tensor headers only where neither records a shape)."""
    if manifest is not None and rel in manifest.tensors:
        out = []
        for tid, m in manifest.tensors[rel].items():
            e = {"tid": int(tid), "key": m.key, "dtype": m.dtype, "shape": list(m.shape)}
            for k in ("tensor_model_parallel", "partition_dim", "partition_stride", "expert_model_parallel"):
                if k in m.attrs:
                    e[k] = m.attrs[k]
            out.append(e)
        return sorted(out, key=lambda e: e["tid"])
    if xser_folder:
        data = reader.load_pickle(rel)
        info = reader.info(rel) or {}
    else:
        data = reader.plain(rel, mmap=True)
        info = {}
    out, seen = [], set()
    for path, leaf in walk_refs(data):
        if xser.is_ref(leaf):
            tid = leaf.tid
            if tid in seen:
                continue
            seen.add(tid)
            e = {"tid": tid, "key": _key_of(path)}
            meta = info.get(tid)
            if meta is not None:
                e["dtype"] = _dtype_name(meta["dtype"])
                e["shape"] = [int(d) for d in meta["shape"]]
                for k in ("tensor_model_parallel", "partition_dim", "partition_stride", "expert_model_parallel"):
                    if k in meta:
                        e[k] = meta[k]
            elif want_missing_shapes:
                t = reader.load_tensor(layout.tensor_path(rel, tid))
                e["dtype"], e["shape"] = _dtype_name(t.dtype), list(t.shape)
            else:
                e["dtype"], e["shape"] = None, None
        else:  # an inline tensor
            e = {"tid": None, "key": _key_of(path), "dtype": _dtype_name(leaf.dtype), "shape": list(leaf.shape),
                 "inline": True}
        out.append(e)
    return out


def _files_per_shard(st: Storage, folder: str) -> dict:
    """{shard ref file name: (file count, bytes)} counting the ref, its .info.pt and its tensor files."""
    out: dict = {}
    for rel, size in _sizes(st, folder):
        if "/" in rel:
            name = rel.split("/", 1)[0]
            if name.endswith(layout.TENSORS_SUFFIX):
                name = name[: -len(layout.TENSORS_SUFFIX)]
        elif rel.endswith(layout.INFO_SUFFIX):
            name = rel[: -len(layout.INFO_SUFFIX)]
        else:
            name = rel
        n, b = out.get(name, (0, 0))
        out[name] = (n + 1, b + size)
    return out


def describe(tagdir, tensors: bool = False, trusted: bool = False) -> dict:
    """Everything `nxd-ckpt info` shows about one tag (a path, an ``s3://`` URL or a Storage rooted at it)."""
    st = listed(layout.storage_at(tagdir))
    tagdir = st.root
    if not st.isdir(""):
        raise CheckpointNotFoundError(f"{tagdir} does not exist; pass DIR/TAG (see `nxd-ckpt ls DIR`)")
    summary = tag_summary(st)
    manifest = None
    try:
        manifest = read_manifest(st)
    except CorruptCheckpointError:
        pass
    reader = FileReader.at(st, manifest, trusted)
    out = {
        "tag": summary["tag"], "path": tagdir, "status": summary["status"], "problem": summary["problem"],
        "format": summary["format"], "written_at": summary["written_at"],
        "library_version": manifest.library_version if manifest else None,
        "topology": dict(vars(manifest.topology)) if manifest else derived_topology(st),
        "zero1": summary["zero1"], "xser": summary["xser"],
        "model_from_master_weights": summary["model_from_master_weights"],
        "has_model": st.isdir(layout.MODEL_DIR), "has_optim": st.isdir(layout.OPTIM_DIR),
        "total_bytes": summary["size"], "total_files": summary["files"],
        "shards": [], "dtypes": {}, "tensor_count": 0, "errors": [],
    }
    all_tensors = []
    for folder in (layout.MODEL_DIR, layout.OPTIM_DIR):
        xser_folder = layout.folder_is_xser(st, folder)
        per_shard = _files_per_shard(st, folder)
        for name in shard_refs(st, folder):
            rel = f"{folder}/{name}"
            coords = layout.parse_shard_filename(name) or layout.parse_full_filename(name)
            nfiles, nbytes = per_shard.get(name, (0, 0))
            row = {"file": rel, "kind": folder, "dp": coords.dp if coords.dp >= 0 else "full", "tp": coords.tp,
                   "pp": coords.pp, "ep": coords.ep, "files": nfiles, "bytes": nbytes}
            try:
                metas = shard_tensor_meta(reader, rel, manifest, xser_folder, want_missing_shapes=tensors)
            except (CheckpointError, xser.XserError) as exc:
                msg = str(exc)
                if isinstance(exc, xser.UnsafeCheckpointError):
                    msg = f"not inspectable without --trusted: {msg}"
                out["errors"].append({"file": rel, "error": msg})
                metas = []
            row["tensors"] = len(metas)
            out["shards"].append(row)
            for m in metas:
                out["tensor_count"] += 1
                d = m.get("dtype") or "unknown"
                slot = out["dtypes"].setdefault(d, {"count": 0, "bytes": 0})
                slot["count"] += 1
                if m.get("shape") is not None and d != "unknown":
                    slot["bytes"] += _nbytes(d, m["shape"])
                if tensors:
                    all_tensors.append(dict(m, shard=rel))
    out["dcp_optimizer"] = _dcp_optimizer(st, trusted, out["errors"])
    out["scheduler"] = _small_file(layout.SCHEDULER_FILE, trusted, reader)
    out["user_content"] = _small_file(layout.USER_CONTENT_FILE, trusted, reader)
    if tensors:
        out["tensors"] = all_tensors
    return out


def _dcp_optimizer(st: Storage, trusted: bool, errors: List[dict]) -> Optional[dict]:
    """A use_zero1_dcp optimizer (optim/.metadata + .distcp files): its entries, data files and size, read from
    .metadata safely; None when the tag has none (a read problem is added to ``errors``)."""
    from .dcpmeta import read_metadata

    rel = f"{layout.OPTIM_DIR}/{layout.DCP_METADATA_FILE}"
    if not st.isfile(rel):
        return None
    try:
        meta = read_metadata(st.read_bytes(rel), rel, trusted)
    except CheckpointError as exc:
        msg = str(exc)
        if isinstance(exc, UnsafeCheckpointError):
            msg = f"not inspectable without --trusted: {msg}"
        errors.append({"file": rel, "error": msg})
        return {"file": rel, "entries": None, "tensor_entries": None, "data_files": None, "bytes": None}
    files = sorted({i.relative_path for i in (meta.storage_data or {}).values()})
    sizes = [st.size(f"{layout.OPTIM_DIR}/{f}") for f in files if st.isfile(f"{layout.OPTIM_DIR}/{f}")]
    tensors = sum(1 for m in meta.state_dict_metadata.values() if hasattr(m, "chunks"))
    return {"file": rel, "entries": len(meta.state_dict_metadata), "tensor_entries": tensors,
            "data_files": len(files), "bytes": sum(sizes)}


def format_bytes(n: Optional[int]) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def format_list(rows: List[dict]) -> str:
    if not rows:
        return "no checkpoints"
    head = ["TAG", "STATUS", "SIZE", "FILES", "WRITTEN (UTC)", "TP", "PP", "DP", "ZERO1", "XSER"]
    body = []
    for r in rows:
        body.append([r["tag"], r["status"], format_bytes(r["size"]), str(r["files"]),
                     (r["written_at"] or "-").replace("+00:00", ""), _s(r["tp"]), _s(r["pp"]), _s(r["dp"]),
                     _yn(r["zero1"]), _yn(r["xser"])])
    lines = _table(head, body)
    for r in rows:
        if r.get("model_from_master_weights"):
            lines.append(f"  {r['tag']}: model weights kept only as ZeRO-1 master weights "
                         "(avoid_saving_lower_precision_weights)")
        if r.get("problem"):
            lines.append(f"  {r['tag']}: {r['problem']}")
    return "\n".join(lines)


def _format_dcp(o: dict) -> str:
    head = "optimizer:  use_zero1_dcp (a torch.distributed.checkpoint in optim/; loads at any DP size)"
    if o["entries"] is None:
        return f"{head}, {o['file']} unreadable"
    return (f"{head}: {o['entries']} entries ({o['tensor_entries']} tensors) in {o['data_files']} data files, "
            f"{format_bytes(o['bytes'])}")


def _s(v) -> str:
    return "?" if v is None else str(v)


def _yn(v) -> str:
    return "?" if v is None else ("yes" if v else "no")


def _table(head: List[str], body: List[List[str]]) -> List[str]:
    widths = [max(len(str(x)) for x in col) for col in zip(head, *body)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    return [fmt.format(*head).rstrip()] + [fmt.format(*row).rstrip() for row in body]


def format_describe(d: dict) -> str:
    t = d["topology"]
    lines = [
        f"tag:        {d['tag']}  ({d['path']})",
        f"status:     {d['status']}" + (f"  ({d['problem']})" if d.get("problem") else ""),
        f"format:     {d['format']}" + (f" {d['library_version']}" if d.get("library_version") else ""),
        f"written:    {d['written_at'] or '-'}",
        "topology:   " + "  ".join(f"{k}={_s(t.get(k))}" for k in ("world_size", "tp", "pp", "dp", "cp", "ep"))
        + (f"  layout={t['layout']}" if t.get("layout") not in (None, "row_major") else ""),
        f"zero1:      {_yn(d['zero1'])}    xser: {_yn(d['xser'])}",
        *(["model:      weights kept only as ZeRO-1 master weights in optim/ "
           "(avoid_saving_lower_precision_weights)"] if d.get("model_from_master_weights") else []),
        *([_format_dcp(d["dcp_optimizer"])] if d.get("dcp_optimizer") else []),
        f"size:       {format_bytes(d['total_bytes'])} in {d['total_files']} files",
        f"tensors:    {d['tensor_count']}  " + ", ".join(
            f"{k}: {v['count']} ({format_bytes(v['bytes'])})" for k, v in sorted(d["dtypes"].items())),
        "",
    ]
    body = [[s["file"], str(s["dp"]), str(s["tp"]), str(s["pp"]), str(s["tensors"]), str(s["files"]),
             format_bytes(s["bytes"])] for s in d["shards"]]
    lines += _table(["SHARD", "DP", "TP", "PP", "TENSORS", "FILES", "SIZE"], body) if body else ["no shard files"]
    for e in d["errors"]:
        lines.append(f"  {e['file']}: {e['error']}")
    for name in ("scheduler", "user_content"):
        s = d.get(name)
        if s is None:
            lines.append(f"{name}: none")
        elif "error" in s:
            lines.append(f"{name}: {s['error']}")
        elif "keys" in s:
            lines.append(f"{name}: keys {', '.join(s['keys']) or '(empty dict)'}")
        else:
            lines.append(f"{name}: a {s['type']}")
    if "tensors" in d:
        lines.append("")
        body = [[m["shard"], m.get("key", ""), _s(m.get("dtype")),
                 _shape(m.get("shape")),
                 _partition(m)] for m in d["tensors"]]
        lines += _table(["SHARD", "NAME", "DTYPE", "SHAPE", "PARTITION"], body)
    return "\n".join(lines)


def _shape(shape) -> str:
    if shape is None:
        return "?"
    return "x".join(str(x) for x in shape) if len(shape) else "scalar"


def _partition(m: dict) -> str:
    if not m.get("tensor_model_parallel"):
        return "-"
    s = f"dim {m.get('partition_dim', 0)}"
    if m.get("partition_stride", 1) != 1:
        s += f" stride {m['partition_stride']}"
    return s


__all__ = ["list_tags", "describe", "tag_summary", "derived_topology", "format_list", "format_describe",
           "format_bytes"]

