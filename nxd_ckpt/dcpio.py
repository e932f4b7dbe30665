"""PyTorch Distributed Checkpoint (DCP) as a sink and a source: `nxd-ckpt to-dcp` and `nxd-ckpt from-dcp`.

Writing is a no-process-group ``dcp.save`` (DCP's planner and ``.metadata``) with a planner that hands the
writer each tensor only when it asks for it: the state dict passed to ``dcp.save`` holds zero-stride
placeholders (shape and dtype, no memory), and ``resolve_data`` gives either the joined tensor or, when the
source can give its bytes in order piece by piece (``TensorSource.pieces``: ZeRO-1 pieces, per-TP-rank state),
a ``dcpwrite.Streamed`` that the storage writer copies straight into the file, so no full tensor is built for it
(tensors of 1 GiB or more and the dtypes ``xser.tensor_frame`` declines are joined; a row-parallel tensor whose
pieces are whole TP shards has all of them mapped at once while it is interleaved: README "Moving to native
PyTorch"). The files
are what ``FileSystemWriter(single_file_per_rank=False)`` writes: ``.metadata`` and one ``__0_N.distcp`` per
entry (one file per entry is also what bounds memory). Our ``manifest.json`` (size and CRC32C of every file)
and ``done`` sit beside them, and the directory is built under ``<out>.nxdtmp`` and renamed into place.

Layouts (``--layout``):

- ``plain``: ``{"model": {fqn: tensor}, "optim": {"state": {fqn: {"step", "exp_avg", "exp_avg_sq"}},
  "param_groups": [{..AdamW's keys.., "params": [fqn, ...]}]}, "scheduler": ..., "user_content": ...}`` -- the
  form ``torch.distributed.checkpoint.state_dict.get_state_dict(model, AdamW)`` gives, so
  ``dcp.load({"model": m, "optim": o}, ...)`` + ``set_state_dict`` resume a native PyTorch job.
- ``torchtitan``: TorchTitan's checkpoint manager's keys: model FQNs at the top level, ``optimizer`` flat
  (``state.{fqn}.{name}``, ``param_groups.{fqn}.{key}``), ``lr_scheduler`` (``last_epoch``) and
  ``train_state`` (``step``, ``ntokens_seen``); no ``dataloader`` (exclude it from loading).

Both layouts also hold ``nxd_ckpt``: the partition attributes, the model's dtypes, scheduler and user
content, so ``from-dcp`` gives back the tag without partition rules.
"""
from __future__ import annotations

import contextlib
import functools
import io
import warnings
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

import xser

from . import manifest as manifest_mod
from .errors import CheckpointArgumentError, CorruptCheckpointError
from .fullstate import (ConversionError, FullState, OptimState, ParamState, TensorSource, natural_step,
                        reused_buffers, rule_partition)
from .outdir import output_tree, progress_bar
from .partition import Partition

LAYOUTS = ("plain", "torchtitan")
META_KEY = "nxd_ckpt"
META_FORMAT = 1
_TT_PREFIXES = ("optimizer.", "lr_scheduler.", "dataloader.", "train_state.")


@dataclass
class DcpResult:
    output: str
    layout: str
    tensors: int
    optimizer: bool
    bytes_written: int
    files: List[str]

    def to_json(self) -> dict:
        return dict(self.__dict__)


@functools.lru_cache(maxsize=1)
def _adamw_defaults() -> Tuple[Tuple[str, Any], ...]:
    """The keys and default values of an AdamW param group, from the constructors' signatures (building an
    optimizer would import torch._dynamo: seconds and 100+ MB for a table of defaults)."""
    import inspect

    out = {}
    for cls in (torch.optim.AdamW, torch.optim.Adam):
        for name, prm in inspect.signature(cls.__init__).parameters.items():
            if name not in ("self", "params") and prm.default is not inspect.Parameter.empty and name not in out:
                out[name] = prm.default
    if "decoupled_weight_decay" in out:
        out["decoupled_weight_decay"] = True     # what AdamW passes to Adam
    return tuple(out.items())


def adamw_group(hyper: dict) -> dict:
    """A param group as ``torch.optim.AdamW`` has it (every default key), with the source's values."""
    group = dict(_adamw_defaults())
    if "weight_decay" not in hyper:
        group["weight_decay"] = 0.0   # a plain Adam state: no decoupled weight decay
    group.update(hyper)
    return group


# --- the state dict and its loaders -------------------------------------------------------------------
def _placeholder(t: TensorSource) -> torch.Tensor:
    return torch.empty((), dtype=t.dtype).expand(*t.shape) if t.shape else torch.empty((), dtype=t.dtype)


def build_state_dict(state: FullState, layout_kind: str) -> Tuple[dict, Dict[str, TensorSource]]:
    """(state dict of placeholders for dcp.save, flattened key -> source)."""
    sd: Dict[str, Any] = {}
    loaders: Dict[str, TensorSource] = {}
    prefix = "model." if layout_kind == "plain" else ""
    model = {}
    for t in state.model:
        model[t.name] = _placeholder(t)
        loaders[prefix + t.name] = t
    sd.update({"model": model} if layout_kind == "plain" else model)
    step = natural_step(state)
    if state.optim is not None:
        if layout_kind == "plain":
            sd["optim"] = _plain_optim(state.optim, loaders)
        else:
            sd["optimizer"] = _titan_optim(state.optim, loaders)
    if layout_kind == "plain":
        for key, obj in (("scheduler", state.scheduler), ("user_content", state.user_content)):
            if obj is not None:
                sd[key] = obj
    else:
        sd["lr_scheduler"] = {"last_epoch": _last_epoch(state.scheduler, step)}
        sd["train_state"] = {"step": int(step or 0), "ntokens_seen": 0}
    sd[META_KEY] = _meta_bytes(state, layout_kind)
    return sd, loaders


def _plain_optim(optim: OptimState, loaders: Dict[str, TensorSource]) -> dict:
    st = {}
    for name, ps in optim.params.items():
        entry: Dict[str, Any] = {}
        if ps.step is not None:
            entry["step"] = ps.step
        for k, src in ps.moments.items():
            entry[k] = _placeholder(src)
            loaders[f"optim.state.{name}.{k}"] = src
        st[name] = entry
    groups = [{**adamw_group(h), "params": list(names)} for h, names in optim.groups]
    return {"state": st, "param_groups": groups}


def _titan_optim(optim: OptimState, loaders: Dict[str, TensorSource]) -> dict:
    flat: Dict[str, Any] = {}
    for name, ps in optim.params.items():
        if ps.step is not None:
            flat[f"state.{name}.step"] = ps.step
        for k, src in ps.moments.items():
            flat[f"state.{name}.{k}"] = _placeholder(src)
            loaders[f"optimizer.state.{name}.{k}"] = src
    for hyper, names in optim.groups:
        for name in names:
            for k, v in adamw_group(hyper).items():
                flat[f"param_groups.{name}.{k}"] = v
    return flat


def _last_epoch(scheduler, step) -> int:
    if isinstance(scheduler, dict):
        for k in ("last_epoch", "last_step", "_step_count"):
            if isinstance(scheduler.get(k), int):
                return int(scheduler[k])
    return int(step or 0)


def _meta_bytes(state: FullState, layout_kind: str) -> bytes:
    meta = {"format": META_FORMAT, "layout": layout_kind, "topology": state.topology,
            "partitions": {t.name: [t.partition.dim, t.partition.stride] for t in state.model if t.partition},
            "experts": sorted(state.experts),     # an EP source's expert tensors: from-dcp --ep splits them again
            "model_dtypes": {k: str(v).replace("torch.", "") for k, v in state.model_dtypes.items()},
            "scheduler": state.scheduler, "user_content": state.user_content,
            # the source optimizer's own hyper-parameter keys: from-dcp keeps those, not AdamW's extra ones
            "group_keys": [list(h) for h, _n in state.optim.groups] if state.optim is not None else None}
    buf = io.BytesIO()
    torch.save(meta, buf)
    return buf.getvalue()


def _streaming_planner(loaders: Dict[str, TensorSource], bar):
    """A SavePlanner that loads each tensor from its source when the writer asks for it (in the writer's
    threads)."""
    from torch.distributed.checkpoint import DefaultSavePlanner
    from torch.distributed.checkpoint.planner import WriteItemType

    from .dcpwrite import Streamed

    class StreamingSavePlanner(DefaultSavePlanner):
        def resolve_data(self, write_item):
            src = loaders.get(write_item.index.fqn)
            if src is None or write_item.type == WriteItemType.BYTE_IO:
                return super().resolve_data(write_item)
            frame = xser.tensor_frame(src.shape, src.dtype) if src.pieces is not None else None
            if frame is not None:
                return Streamed(src, frame, bar.update if bar is not None else None)
            t = src.checked()
            if bar is not None:
                bar.update(src.nbytes)
            return t

    return StreamingSavePlanner()


@contextlib.contextmanager
def _quiet_dcp():
    """DCP warns that a no-process-group save or load is one process (intended here) and about its own
    TypedStorage use."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        warnings.filterwarnings("ignore", message=".*TypedStorage is deprecated.*")
        yield


def write_dcp(state: FullState, dst: str, layout_kind: str = "plain", *, progress: Optional[bool] = None,
              source: str = "") -> DcpResult:
    """Write ``state`` as a DCP checkpoint at ``dst``, a directory or an object-store URL (checked by the
    caller with check_output_dir). Blocks; a failure leaves nothing at ``dst`` (the staging directory, or
    every object written, is removed) and raises the source's error. Files are made durable together at the
    end (output_tree), not one by one: the kernel writes them back while the next tensors are read."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from .dcpwrite import WRITE_THREADS, DcpStorageWriter

    if layout_kind not in LAYOUTS:
        raise CheckpointArgumentError(f"--layout {layout_kind!r} is not one of {', '.join(LAYOUTS)}")
    sd, loaders = build_state_dict(state, layout_kind)
    with progress_bar(sum(s.nbytes for s in loaders.values()), "to-dcp", progress) as bar, \
            output_tree(dst) as store:
        try:
            with _quiet_dcp(), reused_buffers(WRITE_THREADS) as pool:
                writer = DcpStorageWriter(store, dst, pool)
                dcp.save(sd, storage_writer=writer, planner=_streaming_planner(loaders, bar), no_dist=True)
        except CheckpointException as exc:
            raise _first_cause(exc) from None
        _seal(store, dst.rstrip("/").rsplit("/", 1)[-1], writer.records, layout_kind, state, source)
    files = sorted(writer.records)
    total = sum(r.size for r in writer.records.values())
    return DcpResult(dst, layout_kind, len(state.model), state.optim is not None, total, files)


def _first_cause(exc) -> BaseException:
    """The error a source raised inside dcp.save (which wraps every rank's failure in CheckpointException)."""
    for wrapped in (getattr(exc, "failures", None) or {}).values():
        inner = wrapped[0] if isinstance(wrapped, tuple) and wrapped else wrapped   # (exception, traceback)
        if isinstance(inner, BaseException):
            return inner
    return exc


def _seal(store, name: str, records: Dict[str, Any], layout_kind: str, state: FullState, source: str) -> None:
    """Our manifest (size + CRC32C of every DCP file, taken as they were written) and ``done``, as for a tag."""
    entries = {rel: {**rec.to_json(), "rank": 0} for rel, rec in sorted(records.items())}
    man = manifest_mod.build(name, dict(state.topology), {"dcp": True, "layout": layout_kind, "zero1": False,
                                                            "xser": False, "has_model": True,
                                                            "has_optim": state.optim is not None}, entries, {})
    man.extra["converted_from"] = {"path": source}
    body = man.body()
    store.write_bytes("manifest.json", body)
    store.write_bytes("done", manifest_mod.seal(body))


# --- reading -------------------------------------------------------------------------------------------
def _range_stream(store, rel: str):
    """A read-only, seekable file over one key of a Storage, read in ranges (what torch's FileSystemReader
    needs from a file: seek, read, tell)."""
    from xser import RangeFile

    return RangeFile(lambda offset, n: store.read(rel, offset, n), store.size(rel))


class _StorageFS:
    """What torch's FileSystemReader calls on its ``fs``, served by a Storage (keys relative to its root)."""

    def __init__(self, store):
        self.store = store

    def init_path(self, path):
        return ""

    def concat_path(self, path, suffix):
        return f"{path}/{suffix}" if path else str(suffix)

    @contextlib.contextmanager
    def create_stream(self, path, mode: str):
        if "r" not in mode:
            raise ValueError(f"{self.store.root}: a DCP checkpoint is only read here")
        with io.BufferedReader(_range_stream(self.store, str(path)), buffer_size=8 << 20) as stream:
            yield stream


def _fs_reader_with(store, metadata):
    """torch's FileSystemReader over a Storage, with the .metadata already read by dcpmeta: its own
    read_metadata is a plain pickle.load of the file."""
    from torch.distributed.checkpoint import FileSystemReader

    class Reader(FileSystemReader):
        def read_metadata(self, *args, **kwargs):
            if metadata.storage_meta is not None:
                metadata.storage_meta.load_id = self.load_id
            return metadata

    reader = Reader("")
    reader.fs = _StorageFS(store)
    reader.path = ""
    return reader


class _DcpReader:
    """Reads single entries of a DCP checkpoint (a directory or an object-store prefix): tensors through
    dcp.load, non-tensors unpickled safely."""

    def __init__(self, path: str, trusted: bool):
        from . import layout
        from .dcpmeta import read_metadata

        self.store = layout.storage_at(path)
        self.path, self.trusted = self.store.root, trusted
        if not self.store.isfile(".metadata"):
            raise CheckpointArgumentError(f"DCP_DIR {path} has no .metadata file: it is not a torch.distributed."
                                          "checkpoint directory (pass the folder dcp.save wrote)")
        self.metadata = read_metadata(self.store.read_bytes(".metadata"), self._where(".metadata"), trusted)
        self.entries = self.metadata.state_dict_metadata
        # the original key path of each flattened key (DefaultSavePlanner records them); names may hold dots
        mapping = self.metadata.planner_data if isinstance(self.metadata.planner_data, dict) else {}
        self.paths = {k: tuple(mapping.get(k, (k,))) for k in self.entries}
        self._check_files()

    def _where(self, rel: str) -> str:
        return f"{self.path}/{rel}"

    def _check_files(self) -> None:
        """Against our manifest when the directory has one (written by to-dcp)."""
        from .manifest import read as read_manifest
        from .reader import FileReader

        man = read_manifest(self.store)
        if man is None:
            return
        reader = FileReader.at(self.store, man)
        for rel in man.files:
            reader.check_file(rel)

    def _read_range(self, rel: str, offset: int, length: int) -> bytes:
        try:
            return self.store.read(rel, offset, length)
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            raise CorruptCheckpointError(f"{self._where(rel)} is missing", path=self._where(rel)) from None

    def is_tensor(self, key: str) -> bool:
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        return isinstance(self.entries.get(key), TensorStorageMetadata)

    def source(self, key: str, name: str, partition: Optional[Partition]) -> TensorSource:
        md = self.entries[key]
        return TensorSource(name, tuple(md.size), md.properties.dtype, partition, lambda: self.tensor(key))

    def tensor(self, key: str) -> torch.Tensor:
        import torch.distributed.checkpoint as dcp

        md = self.entries[key]
        whole = self._whole_chunk(key, md)
        if whole is not None:
            return whole
        out = {key: torch.empty(tuple(md.size), dtype=md.properties.dtype)}
        with _quiet_dcp():
            dcp.load(out, storage_reader=_fs_reader_with(self.store, self.metadata), no_dist=True)
        return out[key]

    def _whole_chunk(self, key: str, md) -> Optional[torch.Tensor]:
        """A tensor saved as one untransformed chunk (what to-dcp and any single-process save write), read
        straight from its byte range; None when DCP's own loader must assemble it (sharded saves)."""
        from torch.distributed.checkpoint.metadata import MetadataIndex

        if len(md.chunks) != 1 or tuple(md.chunks[0].sizes) != tuple(md.size) or any(md.chunks[0].offsets):
            return None
        info = self.metadata.storage_data.get(MetadataIndex(key, md.chunks[0].offsets))
        if info is None or getattr(info, "transform_descriptors", None):
            return None
        data = self._read_range(info.relative_path, info.offset, info.length)
        try:
            t = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
        except Exception as exc:  # noqa: BLE001
            raise CorruptCheckpointError(f"{self.path}: entry {key!r} cannot be read: {exc}") from exc
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != tuple(md.size) or t.dtype != md.properties.dtype:
            raise CorruptCheckpointError(f"{self.path}: entry {key!r} does not hold the {md.properties.dtype} "
                                         f"{tuple(md.size)} tensor its metadata describes")
        return t

    def value(self, key: str):
        from torch.distributed.checkpoint.metadata import MetadataIndex

        info = self.metadata.storage_data[MetadataIndex(key)]
        data = self._read_range(info.relative_path, info.offset, info.length)
        try:
            return torch.load(io.BytesIO(data), weights_only=not self.trusted)
        except Exception as exc:  # noqa: BLE001
            if not self.trusted and "weights_only" in str(exc):
                raise CheckpointArgumentError(f"{self.path}: entry {key!r} holds objects a safe load refuses; if you "
                                              "trust its origin pass --trusted") from None
            raise CorruptCheckpointError(f"{self.path}: entry {key!r} cannot be read: {exc}") from exc


def read_dcp(path: str, *, rules: Sequence[Tuple[str, int, int]] = (), trusted: bool = False,
             optimizer: bool = True) -> FullState:
    """A DCP checkpoint (plain or torchtitan layout, by nxd-ckpt or by a PyTorch job) as a FullState."""
    r = _DcpReader(path, trusted)
    meta = _read_meta(r)
    kind = meta.get("layout") or ("plain" if any(p[0] == "model" for p in r.paths.values()) else "torchtitan")
    recorded = {k: Partition(int(v[0]), int(v[1])) for k, v in meta.get("partitions", {}).items()}
    model_keys = {}
    for key, p in r.paths.items():
        if not r.is_tensor(key):
            continue
        if kind == "plain" and len(p) == 2 and p[0] == "model":
            model_keys[str(p[1])] = key
        elif kind == "torchtitan" and len(p) == 1 and not str(p[0]).startswith(_TT_PREFIXES):
            model_keys[str(p[0])] = key
    if not model_keys:
        raise ConversionError(f"{path} holds no model tensors (no 'model' entry, nor TorchTitan's top-level "
                              "parameter names)")
    model = [r.source(key, n, rule_partition(n, rules) if rules else recorded.get(n)) for n, key in model_keys.items()]
    state = FullState(model, topology=dict(meta.get("topology") or {}))
    state.model_dtypes = {k: getattr(torch, v) for k, v in meta.get("model_dtypes", {}).items()}
    state.experts = frozenset(str(k) for k in meta.get("experts") or ()) & frozenset(model_keys)
    state.scheduler, state.user_content = meta.get("scheduler"), meta.get("user_content")
    if not meta and kind == "torchtitan":     # a TorchTitan job's own checkpoint: its schedule and train state
        state.scheduler = _values(r, "lr_scheduler") or None
        state.user_content = _values(r, "train_state") or None
    if optimizer:
        state.optim = _read_optim(r, kind, {t.name: t for t in model})
        keys = meta.get("group_keys")
        if state.optim is not None and keys and len(keys) == len(state.optim.groups):
            state.optim.groups = [({k: h[k] for k in ks if k in h}, names)
                                  for ks, (h, names) in zip(keys, state.optim.groups)]
    return state


def _values(r: _DcpReader, top: str) -> dict:
    """{key: value} of the non-tensor entries under ``top`` (e.g. TorchTitan's ``train_state``)."""
    return {str(p[1]): r.value(k) for k, p in r.paths.items() if len(p) == 2 and p[0] == top and not r.is_tensor(k)}


def _read_meta(r: _DcpReader) -> dict:
    if META_KEY not in r.entries:
        return {}
    raw = r.value(META_KEY)
    meta = torch.load(io.BytesIO(raw), weights_only=not r.trusted) if isinstance(raw, bytes) else raw
    return meta if isinstance(meta, dict) else {}


def _optim_entries(r: _DcpReader, kind: str):
    """Yield (kind, parameter name, leaf, key): kind 'state' or 'group' ('group' name: the group index
    for the plain layout, the parameter for TorchTitan's flat one)."""
    for key, p in r.paths.items():
        if kind == "plain" and len(p) == 4 and p[0] == "optim" and p[1] in ("state", "param_groups"):
            yield ("state" if p[1] == "state" else "group"), str(p[2]), str(p[3]), key
        elif kind == "torchtitan" and len(p) == 2 and p[0] == "optimizer":
            head, _, rest = str(p[1]).partition(".")
            name, _, leaf = rest.rpartition(".")
            if head in ("state", "param_groups"):
                yield ("state" if head == "state" else "group"), name, leaf, key


def _read_optim(r: _DcpReader, kind: str, model: Dict[str, TensorSource]) -> Optional[OptimState]:
    params: Dict[str, ParamState] = {}
    groups: Dict[str, dict] = {}
    for what, name, leaf, key in _optim_entries(r, kind):
        if what == "group":
            groups.setdefault(name, {})[leaf] = r.value(key)
            continue
        if name not in model:
            raise ConversionError(f"{r.path}: optimizer entry {key!r} names parameter {name!r}, which the model does "
                                  f"not have (model keys: {sorted(model)[:4]}...): the names do not match")
        ps = params.setdefault(name, ParamState())
        if leaf == "step":
            ps.step = r.tensor(key) if r.is_tensor(key) else r.value(key)
        elif r.is_tensor(key):
            ps.moments[leaf] = r.source(key, f"{name} {leaf}", model[name].partition)
    if not params:
        return None
    if kind == "plain":
        out = [({k: v for k, v in g.items() if k != "params"}, [str(n) for n in g.get("params", [])])
               for _i, g in sorted(groups.items(), key=lambda kv: int(kv[0]))]
    else:
        out = []
        for name in params:
            hyper = groups.get(name, {})
            for h, names in out:
                if h == hyper:
                    names.append(name)
                    break
            else:
                out.append((hyper, [name]))
    return OptimState(params, out or [({}, list(params))])
