"""Export a checkpoint's model as Hugging Face style safetensors: `nxd-ckpt export`.

Tensor-parallel shards are merged with the partition attributes recorded at save time (manifest or
``.info.pt``: ``partition_dim``, and ``partition_stride`` > 1 for Megatron-style strided interleaving), or
with ``--partition NAME_GLOB=DIM[:STRIDE]`` for checkpoints that do not record them (neuronx-distributed's
own). A tensor identical on every TP rank is replicated and taken once; one that differs without partition
information is an error. Pipeline stages contribute the union of their keys; a key present in several
stages must hold the same value in each.

Files are written one tensor at a time: the safetensors header is computed from the metadata first, then
each tensor is read from its TP shards, merged, cast and appended, so memory stays near the largest tensor.
"""
from __future__ import annotations

import fnmatch
import json
import re
import struct
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

import xser

from . import layout, masters
from .errors import CheckpointArgumentError, CheckpointError, CorruptCheckpointError
from .outdir import check_output, output_tree, progress_bar
from .partition import merge_tp
from .manifest import read as read_manifest
from .reader import FileReader


class ExportError(CheckpointError, ValueError):
    """The model cannot be exported as asked (missing partition information, inconsistent shards, ...)."""


_ST_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL",
}
for _name, _code in (("uint16", "U16"), ("uint32", "U32"), ("uint64", "U64"), ("float8_e4m3fn", "F8_E4M3"),
                     ("float8_e5m2", "F8_E5M2")):
    if hasattr(torch, _name):
        _ST_DTYPES[getattr(torch, _name)] = _code

DTYPE_ALIASES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16,
                 "half": torch.float16, "fp32": torch.float32, "float32": torch.float32, "float": torch.float32}

_UNITS = {"": 1, "B": 1, "KB": 10 ** 3, "MB": 10 ** 6, "GB": 10 ** 9, "TB": 10 ** 12,
          "KIB": 2 ** 10, "MIB": 2 ** 20, "GIB": 2 ** 30, "TIB": 2 ** 40}


def parse_size(text) -> int:
    """'5GB' -> 5e9, '500MiB' -> 500 * 2**20, '1000' -> 1000 bytes (Hugging Face's convention)."""
    if isinstance(text, int) and not isinstance(text, bool):
        if text <= 0:
            raise CheckpointArgumentError(f"--max-shard-size must be positive, got {text}")
        return text
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", str(text))
    if not m or m.group(2).upper() not in _UNITS:
        raise CheckpointArgumentError(
            f"--max-shard-size {text!r} is not a size; write e.g. 5GB, 500MB, 2GiB or a number of bytes")
    n = int(float(m.group(1)) * _UNITS[m.group(2).upper()])
    if n <= 0:
        raise CheckpointArgumentError(f"--max-shard-size must be positive, got {text!r}")
    return n


def parse_partition(spec: str) -> Tuple[str, int, int]:
    """'NAME_GLOB=DIM' or 'NAME_GLOB=DIM:STRIDE' -> (glob, dim, stride)."""
    m = re.fullmatch(r"(.+)=(-?\d+)(?::(\d+))?", spec.strip())
    if not m:
        raise CheckpointArgumentError(
            f"--partition {spec!r} is not NAME_GLOB=DIM[:STRIDE]; e.g. --partition '*.qkv_proj.weight=0' "
            "or --partition '*.gate_up.weight=0:2'")
    stride = int(m.group(3)) if m.group(3) else 1
    if stride < 1:
        raise CheckpointArgumentError(f"--partition {spec!r}: the stride must be >= 1")
    return m.group(1), int(m.group(2)), stride


def parse_dtype(name: Optional[str]) -> Optional[torch.dtype]:
    if name is None:
        return None
    d = DTYPE_ALIASES.get(str(name).lower())
    if d is None:
        raise CheckpointArgumentError(f"--dtype {name!r} is not one of bf16, fp16, fp32")
    return d


def bit_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.reshape(-1).contiguous().view(torch.uint8), b.reshape(-1).contiguous().view(torch.uint8))


def _dtype(name) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    d = getattr(torch, str(name).replace("torch.", ""), None)
    if not isinstance(d, torch.dtype):
        raise CorruptCheckpointError(f"unknown dtype {name!r} in the checkpoint's metadata")
    return d


# --- reading the model shards ----------------------------------------------------------------------
@dataclass
class Leaf:
    """One tensor of one (tp, pp) shard, not loaded."""

    rel: str                      # the shard's ref file, relative to the tag
    ref: Any                      # TensorReference or inline tensor
    dtype: torch.dtype
    shape: tuple
    partition: Optional[Tuple[int, int]]   # (dim, stride) when TP-partitioned


@dataclass
class OutTensor:
    key: str
    stages: Dict[int, List[Leaf]] = field(default_factory=dict)   # pp -> leaves by tp rank
    partition: Optional[Tuple[int, int]] = None
    shape: tuple = ()
    dtype: torch.dtype = torch.float32      # as written (after --dtype)
    src_dtype: torch.dtype = torch.float32
    stage_parts: Dict[int, Optional[Tuple[int, int]]] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= int(d)
        return n * torch.empty((), dtype=self.dtype).element_size()


def _flatten(obj, prefix="", out=None, skipped=None):
    """{dotted key: TensorReference or tensor} of a (possibly nested) model state dict."""
    if out is None:
        out, skipped = {}, []
    if xser.is_ref(obj) or isinstance(obj, torch.Tensor):
        out[prefix] = obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            _flatten(v, f"{prefix}.{k}" if prefix else str(k), out, skipped)
    else:
        skipped.append(prefix)
    return out, skipped


class _Shard:
    def __init__(self, reader: FileReader, rel: str, xser_folder: bool):
        self.reader, self.rel = reader, rel
        self.xser = xser_folder
        data = reader.load_pickle(rel) if xser_folder else reader.plain(rel, mmap=True)
        self.flat, self.skipped = _flatten(data)
        metas, self.keyed = reader.tensor_metas(rel, info_file=xser_folder)
        self.meta = {t: m.to_json() for t, m in metas.items()}
        # tid of each inline tensor (non-xser shards): the order xser.to_refs gives, as the manifest uses
        self.tid_of_obj = {} if xser_folder else {id(t): tid for tid, t in enumerate(xser.to_refs(data)[1])}
        self.masters: Optional[_Masters] = None

    def describe(self, key: str, ref) -> Leaf:
        part = None
        if xser.is_ref(ref):
            m = self.meta.get(ref.tid)
            if m is None:
                t = self._peek(ref.tid)
                dtype, shape = t.dtype, tuple(t.shape)
            else:
                dtype, shape = _dtype(m["dtype"]), tuple(int(d) for d in m["shape"])
                if m.get("tensor_model_parallel"):
                    part = (int(m.get("partition_dim", 0)), int(m.get("partition_stride", 1)))
        else:
            dtype, shape = ref.dtype, tuple(ref.shape)
            m = self.meta.get(self.tid_of_obj.get(id(ref), -1), {})
            if m.get("tensor_model_parallel"):
                part = (int(m.get("partition_dim", 0)), int(m.get("partition_stride", 1)))
            elif getattr(ref, "tensor_model_parallel", False):
                part = (int(getattr(ref, "partition_dim", 0)), int(getattr(ref, "partition_stride", 1)))
        return Leaf(self.rel, ref, dtype, shape, part)

    def _peek(self, tid: int) -> torch.Tensor:
        """The tensor, for its dtype and shape only: memory-mapped where the file is local (no read of its
        data), else read (and checked) whole."""
        rel = layout.tensor_path(self.rel, tid)
        local = self.reader.storage.local_path(rel)
        if local is not None:
            try:
                return torch.load(local, map_location="cpu", weights_only=True, mmap=True)
            except Exception:  # noqa: BLE001 - fall back to a full, checked read
                pass
        return self.reader.load_tensor(rel)

    def load(self, leaf: Leaf) -> torch.Tensor:
        if xser.is_ref(leaf.ref) and self.masters is not None and leaf.ref.tid in self.masters.index:
            t = self.masters.tensor(leaf.ref.tid).to(leaf.dtype)
        elif xser.is_ref(leaf.ref):
            t = self.reader.load_tensor(layout.tensor_path(self.rel, leaf.ref.tid))
        else:
            t = leaf.ref
        if t.dtype != leaf.dtype or tuple(t.shape) != leaf.shape:
            raise CorruptCheckpointError(
                f"{self.reader.where(self.rel)}: a tensor is {t.dtype} {tuple(t.shape)}, its metadata says "
                f"{leaf.dtype} {leaf.shape}", path=self.reader.where(self.rel))
        return t


class _Masters:
    """The tensors of one (tp, pp) model shard that lie in the ZeRO-1 master weights
    (avoid_saving_lower_precision_weights), joined from the DP shards on demand."""

    def __init__(self, reader: FileReader, shard: "_Shard", tp: int, pp: int):
        names = sorted((s.dp, n) for s, n in layout.list_shard_files(reader.storage, layout.OPTIM_DIR).items()
                       if s.tp == tp and s.pp == pp and s.ep is None)
        if not names:
            raise ExportError(f"{reader.storage.root} keeps its model weights as ZeRO-1 master weights but optim/ has no shard "
                              f"for tp rank {tp}, pp rank {pp}")
        self.reader = reader
        self.files = [f"{layout.OPTIM_DIR}/{n}" for _, n in names]
        refs = [reader.load_pickle(f) for f in self.files]
        for f, r in zip(self.files, refs):
            if masters.MASTERS not in r:
                raise ExportError(f"{reader.where(f)} has no sharded_master_weights, which hold this tag's model "
                                  "weights")
        self.refs = [r[masters.MASTERS] for r in refs]
        self.shape_info = refs[0]["shape_info"]
        self.group_sizes = masters.group_sizes(refs[0])
        self.index = self._index(shard)

    def _index(self, shard: "_Shard") -> Dict[int, int]:
        found = {tid: int(m[masters.INDEX_META]) for tid, m in shard.meta.items() if masters.INDEX_META in m}
        if found or shard.keyed:
            return found
        keys_shapes = [(k, tuple(shard.meta[r.tid]["shape"])) for k, r in shard.flat.items() if xser.is_ref(r)]
        by_key = masters.keys_by_order(keys_shapes, self.shape_info, self.group_sizes)
        if by_key is None:
            raise ExportError(f"{self.reader.where(shard.rel)}: the model's weights are kept as ZeRO-1 master weights "
                              "and which key each belongs to is not recorded (a neuronx-distributed checkpoint whose "
                              "model tensors are not exactly the optimizer's parameters in order); load it with "
                              "load_checkpoint(model=<the nn.Module>, optimizer=<the ZeRO-1 optimizer>) instead")
        return {shard.flat[k].tid: i for k, i in by_key.items()}

    def tensor(self, tid: int) -> torch.Tensor:
        i = self.index[tid]
        parts = [self.reader.load_tensor(layout.tensor_path(f, r[i].tid)) if xser.is_ref(r[i]) else r[i]
                 for f, r in zip(self.files, self.refs)]
        return masters.join_shards(parts, self.shape_info[i])


def plan_export(tagdir, partitions: Sequence[Tuple[str, int, int]] = (), dtype: Optional[torch.dtype] = None,
                trusted: bool = False) -> Tuple[List[OutTensor], Dict[Tuple[int, int], _Shard], List[str]]:
    """Every output tensor of tag ``tagdir`` (a path, URL or Storage) with its sources, full shape and output
    dtype; no tensor data is read."""
    st = layout.storage_at(tagdir)
    folder = f"{st.root}/{layout.MODEL_DIR}"
    if not st.isdir(layout.MODEL_DIR):
        raise ExportError(f"{st.root} has no model/ folder: the checkpoint was saved without a model")
    manifest = read_manifest(st)
    reader = FileReader.at(st, manifest, trusted)
    names = layout.list_shard_files(st, layout.MODEL_DIR)
    if any(s.ep is not None for s in names):
        raise ExportError(f"{folder} holds expert-parallel shards (ep_rank in the names), which plan_export does not "
                          "join; read the tag with fullstate.read_tag (as export_model does), which joins the experts")
    names = {s: n for s, n in names.items() if s.dp == 0}
    if not names:
        raise ExportError(f"{folder} holds no model shard files (dp_rank_00_tp_rank_TT_pp_rank_PP.pt)")
    tps = sorted({s.tp for s in names})
    pps = sorted({s.pp for s in names})
    for tp in range(max(tps) + 1):
        for pp in range(max(pps) + 1):
            if layout.ShardName(0, tp, pp) not in names:
                raise ExportError(f"{folder} lacks {layout.shard_filename(0, tp, pp)}: the checkpoint is incomplete")
    ntp = max(tps) + 1
    from_masters = manifest.extra.get(masters.FLAG) if manifest is not None else layout.model_data_absent(st)
    xser_folder = from_masters or layout.folder_is_xser(st, layout.MODEL_DIR)   # no .tensors folder when all data is in optim/
    shards = {(s.tp, s.pp): _Shard(reader, f"{layout.MODEL_DIR}/{n}", xser_folder) for s, n in names.items()}
    if from_masters:
        for (tp, pp), sh in shards.items():
            sh.masters = _Masters(reader, sh, tp, pp)
    skipped = sorted({k for sh in shards.values() for k in sh.skipped if k})
    outs: Dict[str, OutTensor] = {}
    for pp in range(max(pps) + 1):
        keys = list(shards[(0, pp)].flat)
        for tp in range(ntp):
            other = shards[(tp, pp)].flat
            if set(other) != set(keys):
                diff = sorted(set(other) ^ set(keys))
                raise ExportError(f"pp stage {pp}: tp ranks 0 and {tp} hold different keys (e.g. {diff[0]!r}); "
                                  "the shards do not come from one save")
        for key in keys:
            leaves = [shards[(tp, pp)].describe(key, shards[(tp, pp)].flat[key]) for tp in range(ntp)]
            out = outs.setdefault(key, OutTensor(key))
            out.stages[pp] = leaves
    result = []
    for out in outs.values():
        _resolve(out, partitions, ntp, dtype)
        result.append(out)
    return result, shards, skipped


def _resolve(out: OutTensor, partitions, ntp: int, dtype: Optional[torch.dtype]) -> None:
    """Partition, full shape and dtypes of one output tensor, checked across TP ranks and PP stages."""
    override = next(((d, s) for g, d, s in partitions if fnmatch.fnmatchcase(out.key, g)), None)
    full_shapes = {}
    for pp, leaves in out.stages.items():
        first = leaves[0]
        for tp, leaf in enumerate(leaves):
            if leaf.dtype != first.dtype:
                raise ExportError(f"{out.key!r} is {first.dtype} on tp rank 0 but {leaf.dtype} on tp rank {tp}")
        part = override if override is not None else first.partition
        if override is None and any(leaf.partition != first.partition for leaf in leaves):
            raise ExportError(f"{out.key!r} has different partition attributes on different TP ranks; pass "
                              f"--partition '{out.key}=DIM' to say how it is split")
        shapes = {leaf.shape for leaf in leaves}
        if part is None or ntp == 1:
            if len(shapes) > 1:
                dims = [i for i in range(len(first.shape)) if len({s[i] for s in shapes if len(s) > i}) > 1]
                raise ExportError(
                    f"{out.key!r} has different shapes on different TP ranks ({sorted(shapes)}) but no partition "
                    f"information; pass --partition '{out.key}=DIM' (probably DIM={dims[0] if dims else 0})")
            full = first.shape
            part = None if ntp == 1 else part
        else:
            if len(shapes) > 1:
                raise ExportError(f"{out.key!r} is partitioned but its TP shards have different shapes {sorted(shapes)}")
            dim, stride = part
            nd = len(first.shape)
            if not -nd <= dim < nd:
                raise ExportError(f"{out.key!r} has {nd} dims; partition dim {dim} is out of range (--partition)")
            dim %= nd
            part = (dim, stride)
            if first.shape[dim] % stride:
                raise ExportError(f"{out.key!r}: {first.shape[dim]} rows along dim {dim} are not a multiple of "
                                  f"partition_stride {stride}")
            full = tuple(d * ntp if i == dim else d for i, d in enumerate(first.shape))
        full_shapes[pp] = (full, first.dtype, part)
    vals = list(full_shapes.values())
    if any(v[:2] != vals[0][:2] for v in vals):
        raise ExportError(f"{out.key!r} appears in several pipeline stages with different shapes or dtypes "
                          f"({', '.join(f'pp {p}: {v[1]} {v[0]}' for p, v in full_shapes.items())})")
    out.shape, out.src_dtype, out.partition = vals[0]
    out.dtype = dtype if (dtype is not None and out.src_dtype.is_floating_point) else out.src_dtype
    if out.dtype not in _ST_DTYPES:
        raise ExportError(f"{out.key!r} has dtype {out.dtype}, which safetensors cannot store; pass --dtype")
    out.stage_parts = {pp: v[2] for pp, v in full_shapes.items()}


def _materialise(out: OutTensor, shards: Dict[Tuple[int, int], _Shard]) -> torch.Tensor:
    """The full tensor: TP shards merged (or the replicated copy, checked), equal across PP stages, cast."""
    result = None
    first_pp = None
    for pp, leaves in sorted(out.stages.items()):
        part = out.stage_parts[pp]
        tensors = [shards[(tp, pp)].load(leaf) for tp, leaf in enumerate(leaves)]
        if part is None:
            for tp in range(1, len(tensors)):
                if not bit_equal(tensors[0], tensors[tp]):
                    raise ExportError(
                        f"{out.key!r} differs between tp rank 0 and tp rank {tp} but has no partition information "
                        f"(checkpoints written by neuronx-distributed do not record it); if it is TP-sharded, pass "
                        f"--partition '{out.key}=DIM' (DIM = the dimension it is split along, e.g. 0 for column-"
                        f"parallel and 1 for row-parallel weights)")
            full = tensors[0]
        else:
            full = merge_tp(tensors, *part)
        del tensors
        if result is None:
            result, first_pp = full, pp
        elif not bit_equal(result, full):
            raise ExportError(f"{out.key!r} appears in pipeline stages {first_pp} and {pp} with different values; "
                              "a key may only be shared by stages (e.g. tied embeddings) when it is equal in both")
    if result.dtype != out.dtype:
        result = result.to(out.dtype)
    return result.contiguous()


# --- writing ----------------------------------------------------------------------------------------
def split_files(outs: List[OutTensor], max_bytes: int) -> List[List[OutTensor]]:
    """Tensors in order, cut into files of at most ``max_bytes`` (a larger tensor gets a file of its own)."""
    files: List[List[OutTensor]] = [[]]
    size = 0
    for o in outs:
        if files[-1] and size + o.nbytes > max_bytes:
            files.append([])
            size = 0
        files[-1].append(o)
        size += o.nbytes
    return [f for f in files if f] or [[]]


def safetensors_header(outs: List[OutTensor], metadata: Optional[Dict[str, str]] = None) -> bytes:
    header: Dict[str, Any] = {"__metadata__": dict(metadata or {"format": "pt"})}
    off = 0
    for o in outs:
        header[o.key] = {"dtype": _ST_DTYPES[o.dtype], "shape": [int(d) for d in o.shape],
                         "data_offsets": [off, off + o.nbytes]}
        off += o.nbytes
    body = json.dumps(header, separators=(",", ":")).encode("utf-8")
    body += b" " * (-len(body) % 8)
    return struct.pack("<Q", len(body)) + body


def _tensor_bytes(t: torch.Tensor) -> memoryview:
    flat = t.reshape(-1)
    if flat.numel() == 0:
        return memoryview(b"")
    return memoryview(flat.view(torch.uint8).numpy())


@dataclass
class ExportResult:
    output: str
    files: List[str]
    tensors: int
    total_size: int
    skipped: List[str]
    dtype: Optional[str]

    def to_json(self) -> dict:
        return dict(self.__dict__)


def export_model(tagdir: str, output: str, *, max_shard_size="5GB", dtype: Optional[str] = None,
                 partitions: Sequence[str] = (), overwrite: bool = False, trusted: bool = False,
                 progress: Optional[bool] = None) -> ExportResult:
    """Write the merged model of tag ``tagdir`` to ``output`` (each a POSIX path or an ``s3://`` URL) as
    safetensors files plus an index: the tag read as full tensors (fullstate.read_tag, model only), written
    by ``write_safetensors``. Single process; blocks until the output is in place."""
    from .fullstate import read_tag

    max_bytes = parse_size(max_shard_size)
    target = parse_dtype(dtype)
    for p in partitions:
        parse_partition(p)
    src = layout.storage_at(tagdir)
    if not src.isdir(""):
        raise CheckpointArgumentError(f"{tagdir} is not a directory; pass DIR/TAG (see `nxd-ckpt ls DIR`)")
    if not src.isfile(layout.DONE_MARKER):
        raise CheckpointArgumentError(f"{tagdir} has no 'done' marker: its save never finished; export a complete tag")
    dst = check_output(src, output, flag="--output", example="./hf_export", overwrite=overwrite)
    state = read_tag(src, partitions=partitions, trusted=trusted, optimizer=False)
    files, total = write_safetensors(state.model, dst, max_bytes=max_bytes, dtype=target, progress=progress)
    return ExportResult(dst.root, files, len(state.model), total, state.skipped,
                        str(target).replace("torch.", "") if target else None)


def write_safetensors(model, dst, *, max_bytes: int, dtype: Optional[torch.dtype] = None,
                      progress: Optional[bool] = None) -> Tuple[List[str], int]:
    """Sink: full tensors (fullstate.TensorSource, in order) as Hugging Face safetensors in ``dst`` (a path,
    URL or Storage, checked with outdir.check_output), one tensor in memory at a time; floating-point tensors
    cast to ``dtype`` when given. The index, when there is one, is written last (on an object store, where the
    files appear one by one, a reader that finds the index finds every file). Returns (file names, bytes)."""
    outs, source = [], {}
    for t in model:
        out_dtype = dtype if (dtype is not None and t.dtype.is_floating_point) else t.dtype
        if out_dtype not in _ST_DTYPES:
            raise ExportError(f"{t.name!r} has dtype {out_dtype}, which safetensors cannot store; pass --dtype")
        outs.append(OutTensor(t.name, shape=tuple(t.shape), dtype=out_dtype, src_dtype=t.dtype))
        source[t.name] = t
    groups = split_files(outs, max_bytes)
    n = len(groups)
    names = ["model.safetensors"] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    with progress_bar(sum(o.nbytes for o in outs), "export", progress) as bar, output_tree(dst) as store:
        for name, group in zip(names, groups):
            header = safetensors_header(group)

            def produce(f, group=group, header=header):
                f.write(header)
                for o in group:
                    t = source[o.key].checked().to(o.dtype).contiguous()
                    f.write(_tensor_bytes(t))
                    if bar is not None:
                        bar.update(o.nbytes)
                    del t

            store.write_file(name, produce, durable=False)
        total = sum(o.nbytes for o in outs)
        if n > 1:
            index = {"metadata": {"total_size": total},
                     "weight_map": {o.key: name for name, group in zip(names, groups) for o in group}}
            body = json.dumps(index, indent=2).encode()
            store.write_file("model.safetensors.index.json", lambda f: f.write(body))
    return names + (["model.safetensors.index.json"] if n > 1 else []), total


def add_arguments(p) -> None:
    p.add_argument("tag", metavar="DIR/TAG", help="the checkpoint tag to export")
    p.add_argument("--output", "-o", required=True, metavar="OUT", help="directory for the safetensors files")
    p.add_argument("--max-shard-size", default="5GB", metavar="SIZE",
                   help="largest file size, e.g. 5GB (default), 500MB, 2GiB")
    p.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], help="cast floating-point tensors (others unchanged)")
    p.add_argument("--partition", action="append", default=[], metavar="NAME_GLOB=DIM[:STRIDE]",
                   help="how tensors matching NAME_GLOB are split over TP ranks, for checkpoints that do not "
                        "record it; repeatable")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty --output directory")
    p.add_argument("--trusted", action="store_true",
                   help="unpickle without weights_only restrictions (only for checkpoints from a trusted source)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")


EPILOG = """example:
  nxd-ckpt export ckpts/step_1000 --output hf_model --dtype bf16
  nxd-ckpt export ckpts/step_1000 --output hf_model --max-shard-size 2GB \\
      --partition '*.qkv_proj.weight=0' --partition '*.o_proj.weight=1'
"""


def run_from_args(args) -> ExportResult:
    return export_model(args.tag, args.output, max_shard_size=args.max_shard_size, dtype=args.dtype,
                        partitions=args.partition, overwrite=args.overwrite, trusted=args.trusted)


__all__ = ["export_model", "plan_export", "merge_tp", "parse_size", "parse_partition", "ExportError", "ExportResult"]
