"""The converters' common currency: a checkpoint as a stream of full (unsharded) tensors.

A ``FullState`` names every model tensor in model order with its full shape, dtype and TP partition, and a
``load()`` that materialises it; the optimizer state per parameter name (Adam's moments as full tensors,
``step``, master weights when present), the param groups' hyper-parameters, scheduler state and user
content. Nothing is read until a sink calls ``load()``, one tensor at a time, so converting holds about one
full tensor (and its pieces) in memory; a sink that writes bytes in order may call ``pieces()`` instead, when
the source has it, and hold only a few pieces (``piece_stream``).

Sources: ``read_tag`` (an NxD / nxd-ckpt tag: TP shards joined by their partition attributes, PP stages
merged, ZeRO-1 pieces joined over DP; an expert-parallel tag through ``fullstate_ep``) here; ``convert.read_hf`` and ``dcpio.read_dcp`` elsewhere.
Sinks: ``tagwrite.write_tag``, ``dcpio.write_dcp``, ``export`` (Hugging Face safetensors).
"""
from __future__ import annotations

import contextlib
import dataclasses
import fnmatch
import math
import re
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch

import xser

from . import layout
from .errors import CheckpointArgumentError, CheckpointError, CorruptCheckpointError
from .partition import (Partition, PartitionError, assemble_zero1, copy_into_blocks, row_segments,
                        rows_tail, tp_block_views, zero1_piece_shape)
from .manifest import read as read_manifest
from .reader import FileReader



class ConversionError(CheckpointError, ValueError):
    """The input cannot be converted as asked; the message says what to pass."""


@dataclass
class TensorSource:
    """One full tensor, not loaded: ``load()`` reads (and joins) it."""

    name: str
    shape: tuple
    dtype: torch.dtype
    partition: Optional[Partition]
    load: Callable[[], torch.Tensor]
    #: when set, the tensor's bytes in order as contiguous tensors read one at a time (each valid until the
    #: next is asked for; checked by shape and dtype): a sink may write them one after the other instead of
    #: joining the full tensor first (``stream_pieces``)
    pieces: Optional[Callable[[], Iterator[torch.Tensor]]] = None

    @property
    def nbytes(self) -> int:
        n = torch.empty((), dtype=self.dtype).element_size()
        for d in self.shape:
            n *= int(d)
        return n

    def checked(self) -> torch.Tensor:
        t = self.load()
        if tuple(t.shape) != tuple(self.shape) or t.dtype != self.dtype:
            raise CorruptCheckpointError(f"{self.name}: read {t.dtype} {tuple(t.shape)}, its metadata says "
                                         f"{self.dtype} {tuple(self.shape)}")
        return t


@dataclass
class ParamState:
    """The optimizer state of one parameter: full moments, ``step`` (tensor or number), master weights."""

    moments: Dict[str, TensorSource] = field(default_factory=dict)
    step: Any = None
    master: Optional[TensorSource] = None


@dataclass
class OptimState:
    """Adam-style state by parameter name, and the param groups (hyper-parameters, parameter names)."""

    params: Dict[str, ParamState]
    groups: List[Tuple[dict, List[str]]]


@dataclass
class FullState:
    model: List[TensorSource]
    optim: Optional[OptimState] = None
    scheduler: Any = None
    user_content: Any = None
    model_dtypes: Dict[str, torch.dtype] = field(default_factory=dict)   # when ``model`` holds master weights
    topology: dict = field(default_factory=dict)                         # the source's, when known
    skipped: List[str] = field(default_factory=list)                     # non-tensor model entries left out
    experts: frozenset = frozenset()                                     # names of expert tensors (EP sources)

    def names(self) -> List[str]:
        return [t.name for t in self.model]

    def largest(self) -> int:
        return max([t.nbytes for t in self.model] or [0])


# --- partition rules (import / from-dcp) -------------------------------------------------------------
LLAMA_PRESET: Tuple[Tuple[str, int, int], ...] = (
    # The layers neuronx-distributed's Llama training example makes parallel (scripts/checkpoint_converter.py:
    # embeddings and LM head split along the vocabulary, attention and MLP projections column-parallel,
    # o_proj and down_proj row-parallel; a fused gate_up_proj is column-parallel with stride 2).
    ("*embed_tokens.weight", 0, 1), ("*lm_head.weight", 0, 1),
    ("*.q_proj.weight", 0, 1), ("*.k_proj.weight", 0, 1), ("*.v_proj.weight", 0, 1), ("*.qkv_proj.weight*", 0, 1),
    ("*.gate_proj.weight", 0, 1), ("*.up_proj.weight", 0, 1), ("*.gate_up_proj.weight", 0, 2),
    ("*.o_proj.weight", 1, 1), ("*.down_proj.weight", 1, 1),
)
PRESETS = {"llama": LLAMA_PRESET}


def partition_rules(specs: Sequence[str], preset: Optional[str]) -> List[Tuple[str, int, int]]:
    """``--partition GLOB=DIM[:STRIDE]`` rules first (they win), then the preset's."""
    from .export import parse_partition

    rules = [parse_partition(s) for s in specs]
    if preset is not None:
        if preset not in PRESETS:
            raise CheckpointArgumentError(f"--preset {preset!r} is not one of {', '.join(sorted(PRESETS))}")
        rules.extend(PRESETS[preset])
    return rules


def rule_partition(name: str, rules: Sequence[Tuple[str, int, int]]) -> Optional[Partition]:
    for glob, dim, stride in rules:
        if fnmatch.fnmatchcase(name, glob):
            return Partition(dim, stride)
    return None


# --- reading a tag ----------------------------------------------------------------------------------
def open_tag(tagdir, flag: str = "SRC_TAG"):
    """The Storage of a complete tag given as a path, URL or Storage; CheckpointArgumentError otherwise."""
    st = layout.storage_at(tagdir)
    if not st.isdir(""):
        raise CheckpointArgumentError(f"{flag} {st.root} is not a directory; pass DIR/TAG (see `nxd-ckpt ls DIR`)")
    if not st.isfile(layout.DONE_MARKER):
        raise CheckpointArgumentError(f"{flag} {st.root} has no 'done' marker: its save never finished; pass a "
                                      "complete tag (see `nxd-ckpt ls DIR`)")
    return st


def check_tag_dir(tagdir, flag: str = "SRC_TAG") -> str:
    """``open_tag``'s root (an absolute path, or the URL)."""
    return open_tag(tagdir, flag).root


def read_tag(tagdir, *, partitions: Sequence[str] = (), trusted: bool = False, optimizer: bool = True) -> FullState:
    """A tag (a path, URL or Storage) as a FullState (nothing but ref pickles and small files read yet).
    Master weights, when the ZeRO-1 state has them, stand in for the model tensors (recorded dtypes in
    ``model_dtypes``)."""
    from .export import _materialise, parse_partition, plan_export

    st = open_tag(tagdir)
    manifest = read_manifest(st)
    reader = FileReader.at(st, manifest, trusted)
    rules = [parse_partition(p) for p in partitions]
    from . import fullstate_ep

    if fullstate_ep.is_ep_tag(st):
        state = fullstate_ep.read_ep_tag(st, manifest, reader, rules, optimizer)
        state.scheduler = _small(reader, layout.SCHEDULER_FILE)
        state.user_content = _small(reader, layout.USER_CONTENT_FILE)
        return state
    outs, shards, skipped = plan_export(st, rules, None, trusted)
    model = [TensorSource(o.key, tuple(o.shape), o.src_dtype, _recorded_partition(o, rules),
                          lambda o=o: _materialise(o, shards)) for o in outs]
    stage_keys = {pp: list(shards[(0, pp)].flat) for (tp, pp) in shards if tp == 0}
    state = FullState(model, topology=dict(vars(manifest.topology)) if manifest is not None else {}, skipped=skipped)
    if optimizer and st.isdir(layout.OPTIM_DIR):
        state.optim = _read_optim(reader, {t.name: t for t in model}, stage_keys)
        _masters_as_model(state)
    state.scheduler = _small(reader, layout.SCHEDULER_FILE)
    state.user_content = _small(reader, layout.USER_CONTENT_FILE)
    return state


def _recorded_partition(out, rules) -> Optional[Partition]:
    """The partition of an exported tensor: a --partition rule, else as recorded -- also at TP=1, where the
    join needs none but a later split does."""
    part = rule_partition(out.key, rules)
    if part is not None:
        return part
    if out.partition:
        return Partition(*out.partition)
    for leaves in out.stages.values():
        if leaves[0].partition:
            return Partition(*leaves[0].partition)
    return None


def _small(reader: FileReader, name: str):
    if not reader.exists(name):
        return None
    return reader.plain(name, mmap=False)


def _masters_as_model(state: FullState) -> None:
    for i, t in enumerate(state.model):
        ps = state.optim.params.get(t.name)
        if ps is not None and ps.master is not None:
            state.model_dtypes[t.name] = t.dtype
            state.model[i] = ps.master


@dataclass
class _OptimFile:
    rel: str
    data: Any          # ref data (xser) or the loaded state (plain)


def _read_optim(reader: FileReader, model: Dict[str, TensorSource],
                stage_keys: Dict[int, List[str]]) -> OptimState:
    folder = reader.where(layout.OPTIM_DIR)
    names = layout.list_shard_files(reader.storage, layout.OPTIM_DIR)
    if not names and reader.storage.isfile(f"{layout.OPTIM_DIR}/{layout.DCP_METADATA_FILE}"):
        from . import zero1_dcp_full    # a ZeRO-1 state saved with use_zero1_dcp=True

        return zero1_dcp_full.read_optim(reader, model, stage_keys)
    if not names:
        raise ConversionError(f"{folder} holds no optimizer files; pass --no-optimizer to convert the model only")
    xser_folder = layout.folder_is_xser(reader.storage, layout.OPTIM_DIR)
    files: Dict[Tuple[int, int, int], _OptimFile] = {}
    for s, n in names.items():
        rel = f"{layout.OPTIM_DIR}/{n}"
        files[(s.tp, s.pp, s.dp)] = _OptimFile(rel, reader.load_pickle(rel) if xser_folder else reader.plain(rel, mmap=True))
    ntp = max(k[0] for k in files) + 1
    ndp = max(k[2] for k in files) + 1
    first = files[(0, min(stage_keys), 0)].data
    zero1 = isinstance(first, dict) and "base_state" in first
    params: Dict[str, ParamState] = {}
    groups: List[Tuple[dict, List[str]]] = []
    for pp, keys in sorted(stage_keys.items()):
        for t in range(ntp):
            for d in range(ndp if zero1 else 1):
                if (t, pp, d) not in files:
                    raise CorruptCheckpointError(f"{folder} lacks {layout.shard_filename(d, t, pp)}: the optimizer "
                                                 "state is incomplete")
        order = _param_names(files[(0, pp, 0)], keys, model, ntp, zero1, reader)
        per_tp = [[files[(t, pp, d)] for d in range(ndp if zero1 else 1)] for t in range(ntp)]
        for i, name in enumerate(order):
            params[name] = _param_state(reader, per_tp, i, model[name], zero1)
        for g in (first if pp == min(stage_keys) else files[(0, pp, 0)].data)["param_groups"]:
            hyper = {k: v for k, v in g.items() if k != "params"}
            groups.append((hyper, [order[int(i)] for i in g["params"] if int(i) < len(order)]))
    return OptimState(params, merge_groups(groups))


def merge_groups(groups: List[Tuple[dict, List[str]]]) -> List[Tuple[dict, List[str]]]:
    """Stages' groups with equal hyper-parameters become one group (group k of every stage)."""
    out: List[Tuple[dict, List[str]]] = []
    for hyper, names in groups:
        for h, ns in out:
            if h == hyper:
                ns.extend(n for n in names if n not in ns)
                break
        else:
            out.append((dict(hyper), list(names)))
    return out


NXD_NO_DECAY = ("bias", "norm")   # NxD's Llama example: get_param_groups_by_weight_decay's no-decay names


def param_orders(keys: List[str], sizes: Optional[List[int]], count: int,
                 recorded: Optional[List[str]] = None) -> List[List[str]]:
    """The candidate model keys of optimizer indices 0..count-1 (optimizers number parameters group by group):
    ``recorded`` names; with one group, ``keys`` (the model's parameter order); with two groups sized like NxD's
    weight-decay split, the names without 'bias'/'norm' then those with. ``sizes`` None (group sizes unknown):
    both of the latter. The caller checks shapes to choose."""
    decay = [k for k in keys if not any(nd in k for nd in NXD_NO_DECAY)]
    split = [len(decay), len(keys) - len(decay)]
    candidates = []
    if recorded is not None and len(recorded) == count and set(recorded) <= set(keys):
        candidates.append(list(recorded))
    if (sizes is None or len(sizes) == 1) and count == len(keys):
        candidates.append(list(keys))
    if sizes == split if sizes is not None else (count == len(keys) and 0 < split[0] < count):
        candidates.append(decay + [k for k in keys if k not in decay])
    return candidates


def _param_names(f: _OptimFile, keys: List[str], model: Dict[str, TensorSource], ntp: int, zero1: bool,
                 reader: FileReader) -> List[str]:
    """The model key of each optimizer parameter index of one stage. Optimizers number parameters group by
    group, so: the names our converters recorded; else, with one param group, the model shard's order
    (``model.parameters()``); with two groups sized like NxD's weight-decay split (names without
    'bias'/'norm', then those with), that order. The ZeRO-1 ``shape_info`` must agree with the choice."""
    data = f.data
    sizes = [len(g["params"]) for g in data["param_groups"]]
    count = len(data["shape_info"]) if zero1 else sum(sizes)
    recorded = ((reader.manifest.extra if reader.manifest is not None else {}).get("optim_params") or {}).get(f.rel)
    for order in param_orders(keys, sizes, count, recorded):
        if not zero1 or all(tuple(int(d) for d in data["shape_info"][i]) == local_shape(model[k], ntp)
                            for i, k in enumerate(order)):
            return order
    raise ConversionError(
        f"{reader.where(f.rel)} holds the state of {count} parameters in {len(sizes)} param group(s) of sizes {sizes}, "
        f"which matches neither the model shard's {len(keys)} tensors in order nor NxD's weight-decay grouping "
        "(buffers, tied weights or another parameter order): the optimizer state cannot be mapped to parameter "
        "names. Pass --no-optimizer to convert the model only")


def local_shape(t: TensorSource, ntp: int) -> tuple:
    from .partition import tp_shard_shape

    return tp_shard_shape(t.shape, t.partition, ntp, t.name)


def _leaf(reader: FileReader, f: _OptimFile, path: tuple, mapped: bool = False):
    """The leaf at ``path`` of an optimizer file: a tensor file read (``mapped``: a local one memory-mapped,
    for a caller that copies it out at once) or the value itself."""
    obj = f.data
    try:
        for k in path:
            obj = obj[k]
    except (KeyError, IndexError, TypeError):
        raise CorruptCheckpointError(f"{reader.where(f.rel)} lacks {'/'.join(map(str, path))}: the files do not come "
                                     "from one save") from None
    if xser.is_ref(obj):
        rel = layout.tensor_path(f.rel, obj.tid)
        return reader.load_tensor(rel, mapped=mapped)
    return obj


def _param_state(reader: FileReader, per_tp: List[List[_OptimFile]], i: int, param: TensorSource,
                 zero1: bool) -> ParamState:
    head = per_tp[0][0].data
    entry = (head["base_state"] if zero1 else head["state"]).get(i, {})
    ps = ParamState()
    root = "base_state" if zero1 else "state"
    for k, v in entry.items():
        if k == "step":
            step = _leaf(reader, per_tp[0][0], (root, i, "step"))
            ps.step = step.clone() if isinstance(step, torch.Tensor) else step
        elif xser.is_ref(v) or isinstance(v, torch.Tensor):
            ps.moments[k] = _joined(reader, per_tp, (root, i, k), param, zero1, f"{param.name} {k}")
    masters = head.get("sharded_master_weights") if zero1 else None
    if isinstance(masters, dict) and i in masters:
        m = _joined(reader, per_tp, ("sharded_master_weights", i), param, zero1, f"{param.name} master weights")
        ps.master = dataclasses.replace(m, name=param.name)
    return ps


class BufferPool:
    """Full-tensor buffers a sink hands back once it has written them (``give_back``), reused by the next
    joined tensor of the same byte size (``new_full``): a fresh buffer costs a page fault per 4 KiB page on
    first touch, most of the time of the copy into it. At most ``cap`` buffers wait in the pool; only
    buffers the pool made are taken back (it holds each until it drops it, so no other tensor can be given
    the same address meanwhile). Thread-safe."""

    def __init__(self, cap: int):
        self.cap = cap
        self._free: List[torch.Tensor] = []
        self._made: Dict[int, torch.Tensor] = {}
        self._lock = threading.Lock()

    def empty(self, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
        nbytes = torch.empty((), dtype=dtype).element_size() * math.prod(shape)
        with self._lock:
            i = next((i for i, b in enumerate(self._free) if b.numel() == nbytes), None)
            buf = self._free.pop(i) if i is not None else None
        if buf is None:
            buf = torch.empty(nbytes, dtype=torch.uint8)
            with self._lock:
                self._made[buf.data_ptr()] = buf
        return buf.view(dtype).view(shape)

    def give_back(self, t: torch.Tensor) -> None:
        """``t`` is no longer used by anyone (the caller dropped every other reference)."""
        with self._lock:
            buf = self._made.get(t.data_ptr())
            if buf is None or t.storage_offset() or not t.is_contiguous() or t.untyped_storage().nbytes() != buf.numel():
                return
            self._free.append(buf)
            while len(self._free) > self.cap:
                self._made.pop(self._free.pop(0).data_ptr(), None)


_POOL: Optional[BufferPool] = None


@contextlib.contextmanager
def reused_buffers(cap: int) -> Iterator[BufferPool]:
    """Within the block, joined tensors come from one BufferPool (single process; one block at a time)."""
    global _POOL
    _POOL = BufferPool(cap)
    try:
        yield _POOL
    finally:
        _POOL = None


def new_full(shape: tuple, dtype: torch.dtype) -> torch.Tensor:
    pool = _POOL
    return pool.empty(shape, dtype) if pool is not None else torch.empty(shape, dtype=dtype)


def _joined(reader: FileReader, per_tp: List[List[_OptimFile]], path: tuple, param: TensorSource, zero1: bool,
            label: str) -> TensorSource:
    """A state tensor of one parameter: ZeRO-1 pieces joined over DP per TP rank, then TP shards joined.
    Assembled in place in the full tensor, one input piece in memory at a time (about 1.x full tensors)."""
    local = local_shape(param, len(per_tp))
    dtype = _leaf_meta(reader, per_tp[0][0], path)

    def load():
        full = new_full(tuple(param.shape), dtype)
        for r, files in enumerate(per_tp):
            blocks = tp_block_views(full, param.partition, len(per_tp), r, label)
            if not blocks:      # replicated: TP rank 0's copy is the tensor
                continue
            if not zero1:
                copy_into_blocks(_leaf(reader, files[0], path, mapped=True), blocks, param.partition, label)
                continue
            direct = blocks[0] if len(blocks) == 1 and blocks[0].is_contiguous() else None
            shard = assemble_zero1(lambda d, files=files: _leaf(reader, files[d], path, mapped=True), len(files),
                                   local, direct, label)
            if direct is None:
                copy_into_blocks(shard, blocks, param.partition, label)
        return full

    ndp = len(per_tp[0]) if zero1 else 1
    want = zero1_piece_shape(local, ndp) if zero1 else local
    pieces = piece_stream(param, len(per_tp), want, dtype, label,
                          lambda r, d: _leaf(reader, per_tp[r][d], path, mapped=True))
    return TensorSource(label, tuple(param.shape), dtype, param.partition, load, pieces)


def piece_stream(param: TensorSource, ntp: int, want: tuple, dtype: torch.dtype, label: str,
                 load_piece: Callable[[int, int], torch.Tensor]) -> Optional[Callable[[], Iterator[torch.Tensor]]]:
    """``TensorSource.pieces`` of a tensor stored as TP shards, each in pieces of shape ``want`` (ZeRO-1 pieces,
    padding included; the whole shard without ZeRO-1) that ``load_piece(tp_rank, piece)`` reads. Shards that
    are runs of the full tensor's rows (``partition.row_segments``) are yielded as slices of their pieces;
    shards split along a later dim (row-parallel) are interleaved slab by slab into one small reused buffer
    (``_interleaved``). None when neither applies (a stride whose blocks cut a piece: join the tensor)."""
    per = rows_tail(want)[0]
    segments = row_segments(param.shape, param.partition, ntp, per, label)
    if segments is None and (param.partition is None or param.partition.normalised(len(param.shape), label).dim == 0):
        return None

    def piece(r: int, d: int) -> torch.Tensor:
        t = load_piece(r, d)
        if tuple(t.shape) != tuple(want) or t.dtype != dtype:
            raise PartitionError(f"{label}: piece {d} of TP rank {r} is {t.dtype} {tuple(t.shape)}; the state's "
                                 f"pieces are {dtype} {tuple(want)}")
        return t

    def pieces() -> Iterator[torch.Tensor]:
        for r, d, first, rows in segments:
            t = piece(r, d)
            yield t[first:first + rows]
            del t

    if segments is not None:
        return pieces
    return lambda: _interleaved(param, ntp, per, dtype, piece, label)


#: rows of a row-parallel tensor are interleaved into a buffer of about this size (it stays in the CPU cache)
SLAB_BYTES = 4 << 20


def _interleaved(param: TensorSource, ntp: int, per: int, dtype: torch.dtype,
                 piece: Callable[[int, int], torch.Tensor], label: str) -> Iterator[torch.Tensor]:
    """The full tensor of a shard split along dim >= 1, slab by slab of dim-0 rows: piece ``d`` of every TP
    rank read, and each slab assembled from their rows (``tp_block_views``) in one reused buffer."""
    full_rows = int(param.shape[0])
    row_numel = math.prod(int(x) for x in param.shape[1:])
    slab_rows = max(1, SLAB_BYTES // max(1, row_numel * dtype.itemsize))
    buf = torch.empty((min(slab_rows, full_rows), *param.shape[1:]), dtype=dtype)
    for d in range(-(-full_rows // per) if per else 0):
        shards = [piece(r, d) for r in range(ntp)]
        n = min(per, full_rows - d * per)
        for a in range(0, n, slab_rows):
            slab = buf[:min(slab_rows, n - a)]
            for r, shard in enumerate(shards):
                copy_into_blocks(shard[a:a + len(slab)], tp_block_views(slab, param.partition, ntp, r, label),
                                 param.partition, label)
            yield slab
        del shards


def _leaf_meta(reader: FileReader, f: _OptimFile, path: tuple) -> torch.dtype:
    """The dtype of a state tensor, from the manifest when it records it (no tensor read), else read."""
    manifest = reader.manifest
    obj = f.data
    for k in path:
        obj = obj[k]
    if xser.is_ref(obj):
        meta = manifest.tensors.get(f.rel, {}).get(str(obj.tid)) if manifest is not None else None
        if meta is not None:
            return getattr(torch, meta.dtype)
        return reader.load_tensor(layout.tensor_path(f.rel, obj.tid)).dtype
    return obj.dtype


def natural_step(state: FullState) -> Optional[int]:
    """The optimizer step count (Adam's ``step`` of the first parameter), or None."""
    if state.optim is None:
        return None
    for ps in state.optim.params.values():
        if ps.step is not None:
            return int(float(ps.step))
    return None
