"""Change the data-parallel degree of a ZeRO-1 optimizer checkpoint (DESIGN 2.4).

A ZeRO-1 shard of parameter ``i`` is the parameter padded with zeros along dim 0 to a multiple of the group
size G and cut into G pieces; rank ``d`` holds piece ``d``. Converting to G' ranks concatenates the pieces,
trims the padding (``shape_info[i][0]`` rows), re-pads and re-cuts. ``step`` and every non-tensor are copied.

The conversion streams: one parameter at a time, and within a parameter one state tensor at a time, it reads
only the input pieces that overlap the output piece being built and writes each output tensor file as soon as
it is computed. Peak memory is therefore about two output pieces of the largest state tensor, not the state.

Input and output are paths or URLs (``s3://bucket/prefix``), read and written through Storage. Output is a
complete tag (``checkpoint`` marker, model/ and the small files linked or copied, manifest with the new
topology and the checksums of every file, ``done`` last), written through the commit strategy of its storage
(``outdir.output_tag``: staged and renamed on POSIX, `done` last on an object store). The input is never
modified.
"""
from __future__ import annotations

import copy
import multiprocessing
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

import xser

from . import layout, masters
from . import manifest as manifest_mod
from .errors import CheckpointArgumentError, CheckpointError, CorruptCheckpointError
from .outdir import TagOutput, check_output, output_tag, output_tree, progress_bar
from .partition import EP_BASE_OFFSET_KEY, EP_OFFSET_KEY, make_piece, piece_rows as _per, rows_tail as _rows_tail
from .storage import FileRecord, Storage, forget_clients, open_storage
from .manifest import read as read_manifest
from .reader import FileReader


class Zero1FormatError(CheckpointError, ValueError):
    """The input is not a ZeRO-1 optimizer checkpoint this tool can convert (missing, mixed, not ZeRO-1)."""


# --- slots: where each output tensor comes from ----------------------------------------------------
@dataclass(eq=False)
class Slot:
    """A tensor position in the output state: ``shard`` (re-sharded over DP) or ``copy`` (taken from the
    first input shard, e.g. Adam's ``step``)."""

    kind: str
    path: tuple
    leaf: Any = None          # copy: the input leaf (TensorReference or inline tensor) of source 0
    param: Any = None         # shard: the parameter index (a key of shape_info)


def _get_path(obj, path):
    for k in path:
        obj = obj[k]
    return obj


def _is_leaf(x) -> bool:
    return xser.is_ref(x) or isinstance(x, torch.Tensor)


def _template(obj, memo: Dict[Any, Slot], path=()):
    """Copy of ``obj`` with every tensor / TensorReference replaced by a copy Slot (shared leaves share one)."""
    if _is_leaf(obj):
        key = ("ref", obj.tid) if xser.is_ref(obj) else ("obj", id(obj))
        if key not in memo:
            memo[key] = Slot("copy", path, leaf=obj)
        return memo[key]
    if isinstance(obj, dict):
        out = copy.copy(obj)
        for k in list(out.keys()):
            out[k] = _template(obj[k], memo, path + (k,))
        return out
    if isinstance(obj, list):
        return [_template(v, memo, path + (i,)) for i, v in enumerate(obj)]
    if isinstance(obj, tuple):
        items = [_template(v, memo, path + (i,)) for i, v in enumerate(obj)]
        return type(obj)._make(items) if hasattr(type(obj), "_make") else type(obj)(items)
    return obj


def _fill(tpl, value: Callable[[Slot], Any]):
    """``tpl`` with each Slot replaced by ``value(slot)`` (called once per slot object)."""
    cache: Dict[int, Any] = {}

    def walk(obj):
        if isinstance(obj, Slot):
            if id(obj) not in cache:
                cache[id(obj)] = value(obj)
            return cache[id(obj)]
        if isinstance(obj, dict):
            out = copy.copy(obj)
            for k in list(out.keys()):
                out[k] = walk(obj[k])
            return out
        if isinstance(obj, list):
            return [walk(v) for v in obj]
        if isinstance(obj, tuple):
            items = [walk(v) for v in obj]
            return type(obj)._make(items) if hasattr(type(obj), "_make") else type(obj)(items)
        return obj

    return walk(tpl)




def build_template(state, where: str) -> Tuple[Any, List[Slot], Dict[Any, tuple]]:
    """(template, shard slots, shape_info) of one ZeRO-1 state (ref data). Raises Zero1FormatError when
    ``state`` is not a ZeRO-1 optimizer state dict."""
    if not isinstance(state, dict) or "base_state" not in state or "shape_info" not in state:
        have = sorted(map(str, state.keys()))[:8] if isinstance(state, dict) else type(state).__name__
        raise Zero1FormatError(
            f"{where} is not a ZeRO-1 optimizer state (no 'base_state'/'shape_info'; it has {have}). "
            "convert-zero1 only converts torch-xla ZeroRedundancyOptimizer checkpoints (saved with "
            "zero1_optimizer=True); a plain optimizer state does not depend on the DP size and needs no conversion")
    base, shapes = state["base_state"], state["shape_info"]
    masters = state.get("sharded_master_weights")
    tpl = _template(state, {})
    slots: List[Slot] = []
    for i, st in base.items():
        if i not in shapes:
            raise Zero1FormatError(f"{where}: base_state has parameter {i!r} but shape_info does not; the file is "
                                   "not a consistent ZeRO-1 state")
        if not isinstance(st, dict):
            continue
        for k, v in st.items():
            if k != "step" and _is_leaf(v):
                s = Slot("shard", ("base_state", i, k), param=i)
                tpl["base_state"][i][k] = s
                slots.append(s)
    if isinstance(masters, dict):
        for i, v in masters.items():
            if i not in shapes:
                raise Zero1FormatError(f"{where}: sharded_master_weights has parameter {i!r} but shape_info does not")
            if _is_leaf(v):
                s = Slot("shard", ("sharded_master_weights", i), param=i)
                tpl["sharded_master_weights"][i] = s
                slots.append(s)
    shape_info = {i: tuple(int(d) for d in s) for i, s in shapes.items()}
    return tpl, slots, shape_info


# --- the row arithmetic ------------------------------------------------------------------------------


@dataclass
class Geometry:
    shape: tuple
    g_in: int
    full_in: bool
    g_out: int
    full_out: bool

    @property
    def rows_tail(self):
        return _rows_tail(self.shape)

    @property
    def per_in(self) -> int:
        rows, _ = self.rows_tail
        return rows if self.full_in else _per(rows, self.g_in)

    @property
    def per_out(self) -> int:
        rows, _ = self.rows_tail
        return rows if self.full_out else _per(rows, self.g_out)

    def out_shape(self) -> tuple:
        _, tail = self.rows_tail
        return tuple(self.shape) if self.full_out else (self.per_out, *tail)

    def normalise_input(self, t: torch.Tensor, where: str) -> torch.Tensor:
        """An input piece as (per_in, *tail), after checking its shape."""
        rows, tail = self.rows_tail
        if self.full_in:
            if tuple(t.shape) not in (tuple(self.shape), (rows, *tail)):
                raise CorruptCheckpointError(
                    f"{where} has shape {tuple(t.shape)}, but shape_info says the parameter is {tuple(self.shape)}",
                    path=where)
            return t.reshape(rows, *tail)
        want = (self.per_in, *tail)
        if tuple(t.shape) != want:
            raise CorruptCheckpointError(
                f"{where} has shape {tuple(t.shape)}; a ZeRO-1 piece of a {tuple(self.shape)} parameter over "
                f"{self.g_in} DP ranks must be {want}. The checkpoint's shards do not match its shape_info",
                path=where)
        return t

    def finish(self, piece: torch.Tensor) -> torch.Tensor:
        return piece.reshape(self.shape) if self.full_out else piece


def stream_pieces(geo: Geometry, load_raw: Callable[[int], Tuple[torch.Tensor, str]],
                  buffers: Optional["BufferRing"] = None):
    """Yield (r, piece) for every output rank, keeping only the overlapping input pieces in memory.

    With ``buffers`` (a BufferRing the caller keeps across calls) pieces are assembled in reused buffers,
    which saves allocating (and page-faulting) fresh memory for every piece; the caller must then be done
    with a piece before the ring comes back to its buffer (``buffers.size`` pieces later)."""
    cache: Dict[int, torch.Tensor] = {}
    rows, tail = geo.rows_tail
    per_in, per_out = geo.per_in, geo.per_out
    dtype: List[torch.dtype] = []

    def load(j):
        if j not in cache:
            t, where = load_raw(j)
            cache[j] = geo.normalise_input(t, where)
            if not dtype:
                dtype.append(cache[j].dtype)
            elif cache[j].dtype != dtype[0]:
                raise CorruptCheckpointError(f"{where} has dtype {cache[j].dtype}, the other DP pieces {dtype[0]}",
                                             path=where)
        return cache[j]

    def dtype_of():
        return dtype[0] if dtype else load(0).dtype

    for r in range(geo.g_out):
        out_buffer = None
        if buffers is not None:
            out_buffer = lambda: buffers.next((per_out, *tail), dtype_of())  # noqa: E731
        piece = make_piece(r, load, per_in, rows, tail, per_out, dtype_of, out_buffer)
        b = (r + 1) * per_out
        for j in [j for j in cache if (j + 1) * per_in <= b]:
            del cache[j]
        yield r, geo.finish(piece)


# --- the plan -------------------------------------------------------------------------------------
@dataclass
class Group:
    """All input files of one (ep, tp, pp) and the output files they become."""

    coords: layout.ShardName
    in_rels: List[str]                    # by input DP rank (one entry for a full file)
    out_rels: List[str]                   # by output DP rank (one entry for a full file)
    sources: List[Any] = field(default_factory=list)   # ref data of each input file
    template: Any = None
    slots: List[Slot] = field(default_factory=list)
    shape_info: Dict[Any, tuple] = field(default_factory=dict)
    ep: int = 1                           # EP of an expert-parallel ZeRO-1 state, else 1
    expert_from: Optional[int] = None     # its first expert parameter (base_state key)

    def ep_of(self, param) -> int:
        """How many expert-DP sub-groups shard parameter ``param``: EP for an expert parameter (DP rank d holds
        expert-DP piece d // EP of EP rank d % EP, NxD's row-major grid), else 1 (sharded over all of DP)."""
        return self.ep if self.expert_from is not None and param >= self.expert_from else 1


def _scan_optim(root: Storage, folder_rel: str) -> Tuple[Dict[tuple, Dict[int, str]], bool]:
    """{(ep, tp, pp): {dp (-1 for full): file name}} and whether the inputs are full files."""
    folder = f"{root.root}/{folder_rel}" if folder_rel else root.root
    shards: Dict[tuple, Dict[int, str]] = {}
    fulls: Dict[tuple, Dict[int, str]] = {}
    for name in root.listdir(folder_rel):
        s = layout.parse_shard_filename(name)
        if s is not None:
            shards.setdefault((s.ep, s.tp, s.pp), {})[s.dp] = name
            continue
        f = layout.parse_full_filename(name)
        if f is not None:
            fulls.setdefault((f.ep, f.tp, f.pp), {})[-1] = name
    if shards and fulls:
        raise Zero1FormatError(
            f"{folder} holds both dp_rank_* shards and full_* files; keep one kind (move the other away) and retry")
    dcp_metadata = f"{folder_rel}/{layout.DCP_METADATA_FILE}" if folder_rel else layout.DCP_METADATA_FILE
    if not shards and not fulls and root.isfile(dcp_metadata):
        raise Zero1FormatError(
            f"{folder} holds a use_zero1_dcp optimizer (a torch.distributed.checkpoint): load_checkpoint reads it at "
            "any DP size directly, no conversion is needed")
    if not shards and not fulls:
        raise Zero1FormatError(
            f"{folder} holds no optimizer files (dp_rank_*_tp_rank_*_pp_rank_*.pt or full_tp_rank_*_pp_rank_*.pt)")
    if fulls:
        return fulls, True
    sizes = {k: sorted(v) for k, v in shards.items()}
    g = max(max(v) for v in sizes.values()) + 1
    problems = []
    for k, dps in sorted(sizes.items(), key=lambda kv: str(kv[0])):
        missing = sorted(set(range(g)) - set(dps))
        if missing:
            where = f"tp {k[1]} pp {k[2]}" + (f" ep {k[0]}" if k[0] is not None else "")
            problems.append(f"{where} has dp ranks {_ranges(dps)} (missing {_ranges(missing)})")
    if problems:
        counts = sorted({len(v) for v in sizes.values()})
        kind = "mixed DP sizes" if len(counts) > 1 else "missing dp ranks"
        raise Zero1FormatError(
            f"{folder}: {kind}: the largest dp rank is {g - 1}, so every (tp, pp) needs dp ranks 0-{g - 1}, but "
            + "; ".join(problems) + ". The checkpoint is incomplete or mixes two saves: convert a complete tag")
    return shards, False


def _ep_error(input_dir: str, problem: str) -> str:
    return (f"{input_dir}: {problem}. NxD's ZeRO-1 optimizer for MoE shards non-expert parameters over DP and "
            "expert parameters over expert-DP, so converting it needs the EP size and NxD's row-major rank grid")


def expert_parallel_size(input_dir: str, tagdir: Optional[Storage], manifest: Optional[manifest_mod.Manifest],
                         groups_in: Dict[tuple, Dict[int, str]], legacy_names: bool = False) -> int:
    """EP of the input (1 without expert parallelism), from the manifest or the model/ file names. Raises
    Zero1FormatError, before anything is written, for what cannot be converted: optimizer files named by
    ep rank (a plain, not ZeRO-1, optimizer; ``legacy_names``: nxd-ckpt's legacy ZeRO-1 names, accepted), or an
    EP checkpoint in a non-row-major rank layout."""
    named = [] if legacy_names else sorted(name for files in groups_in.values() for name in files.values()
                   if (layout.parse_shard_filename(name) or layout.parse_full_filename(name)).ep is not None)
    if named:
        raise Zero1FormatError(_ep_error(
            input_dir, f"its optimizer files are named by ep rank (e.g. {named[0]}): that is a plain expert-parallel "
            "optimizer, which does not depend on the DP size; convert-zero1 converts "
            "ZeRO-1 state only"))
    topo = dict(vars(manifest.topology)) if manifest is not None else {}
    ep = int(topo.get("ep") or 1)
    if manifest is None and tagdir is not None:
        model = layout.list_shard_files(tagdir, layout.MODEL_DIR)
        ep = 1 + max((sh.ep or 0 for sh in model), default=0)
    if ep > 1 and (topo.get("layout") or "row_major") != "row_major":
        raise Zero1FormatError(_ep_error(input_dir, f"it was saved at EP={ep} in the {topo['layout']} rank layout, "
                                                    "where DP ranks do not map to EP ranks row-major"))
    return ep


def _from_legacy_ep_names(groups_in: Dict[tuple, Dict[int, str]], ep: int) -> Dict[tuple, Dict[int, str]]:
    """``_scan_optim``'s groups of nxd-ckpt's legacy EP ZeRO-1 names (``manifest.legacy_ep_folders``:
    ``dp_rank_{expert-DP rank}_ep_rank_{EP rank}``) keyed as NxD names them, by the full DP rank
    ``edp * EP + ep``: the row-major grid, the only one that writer had."""
    out: Dict[tuple, Dict[int, str]] = {}
    for (e, tp, pp), files in groups_in.items():
        for edp, name in files.items():
            out.setdefault((None, tp, pp), {})[edp * ep + (e or 0)] = name
    return out


def _ep_split(input_dir: str, state, where: str, ep: int, g_in: int, g_out: int, to_full: bool) -> Optional[int]:
    """The first expert parameter index (a base_state key) of an EP ZeRO-1 state, None without EP."""
    has_key = isinstance(state, dict) and EP_OFFSET_KEY in state
    if ep == 1 and not has_key:
        return None
    if ep == 1:
        raise Zero1FormatError(_ep_error(input_dir, f"{where} holds {EP_OFFSET_KEY!r} but the EP size is unknown "
                                                    "(pass the tag directory: its model/ file names or manifest "
                                                    "give it)"))
    if not has_key or EP_BASE_OFFSET_KEY not in state:
        raise Zero1FormatError(_ep_error(input_dir, f"it was saved at EP={ep}, but {where} has no "
                                                    f"{EP_OFFSET_KEY!r}/{EP_BASE_OFFSET_KEY!r}, so its expert "
                                                    "parameters cannot be told apart"))
    if to_full:
        raise Zero1FormatError(_ep_error(input_dir, f"--convert_to_full cannot hold EP={ep} ranks' different "
                                                    "experts in one full file; use --convert_to_sharded --dp_size N"))
    for what, g in (("saved", g_in), ("new", g_out)):
        if g % ep:
            raise CheckpointArgumentError(_ep_error(input_dir, f"the {what} DP size {g} is not a multiple of "
                                                               f"EP={ep}; pick --dp_size as a multiple of {ep}"))
    return int(state[EP_BASE_OFFSET_KEY])


def _ranges(nums) -> str:
    nums = sorted(nums)
    out, start = [], None
    for i, n in enumerate(nums):
        if start is None:
            start = n
        if i + 1 == len(nums) or nums[i + 1] != n + 1:
            out.append(f"{start}" if start == n else f"{start}-{n}")
            start = None
    return ",".join(out) if out else "none"


@dataclass
class ConvertResult:
    output_dir: str
    input_dp: Optional[int]
    output_dp: Optional[int]
    xser: bool
    groups: int
    params: int
    bytes_written: int
    files_written: int
    linked: int
    copied: int
    seconds: float = 0.0

    def to_json(self) -> dict:
        return dict(self.__dict__)


@dataclass
class _Input:
    """What convert-zero1 reads: the storage holding ``folder`` (a tag, or the parent of a bare optim/ folder)."""

    root: Storage                  # the tag (tag mode) or the folder's parent
    folder: str                    # the optimizer folder under ``root`` ('optim' for a tag)
    tag_mode: bool                 # a whole tag: the output is a complete tag too
    manifest: Optional[manifest_mod.Manifest]


def _open_input(input_dir: str) -> _Input:
    """The input as a Storage, checked: a complete tag with optim/, or an optimizer folder itself."""
    src = open_storage(input_dir)
    if not src.isdir(""):
        raise CheckpointArgumentError(f"--input_dir {input_dir} is not a directory; pass a checkpoint tag directory "
                                      "such as ckpts/step_1000")
    if src.isdir(layout.OPTIM_DIR):
        if not src.isfile(layout.DONE_MARKER):
            raise CheckpointArgumentError(
                f"{input_dir} has no 'done' marker: its save never finished, so its files may be incomplete. "
                "Convert a complete tag (see `nxd-ckpt ls`)")
        return _Input(src, layout.OPTIM_DIR, True, read_manifest(src))
    if not any(layout.parse_shard_filename(n) or layout.parse_full_filename(n) for n in src.listdir("")):
        raise Zero1FormatError(
            f"{input_dir} has no optim/ folder: it holds no optimizer state to convert. Pass the tag directory "
            "of a checkpoint saved with a ZeRO-1 optimizer (e.g. ckpts/step_1000, which contains optim/)")
    try:
        parent, name = src.parent()
    except ValueError as exc:
        raise CheckpointArgumentError(f"--input_dir {input_dir}: {exc}") from None
    return _Input(parent, name, False, read_manifest(parent) if name == layout.OPTIM_DIR else None)


def _plan_groups(inp: _Input, input_dir: str, groups_in, full_in: bool, g_in: int, g_out: int, to_full: bool,
                 ep_size: int, xser_in: bool, reader: FileReader, plain_reader: FileReader) -> List[Group]:
    """One Group per (ep, tp, pp): its input and output files and the template of its state."""
    in_prefix = f"{inp.folder}/" if inp.folder else ""
    out_prefix = f"{layout.OPTIM_DIR}/" if inp.tag_mode else ""
    groups: List[Group] = []
    for key in sorted(groups_in, key=lambda k: (k[0] or 0, k[1], k[2])):
        ep, tp, pp = key
        files = groups_in[key]
        in_rels = [in_prefix + files[d] for d in sorted(files)]
        if to_full:
            out_rels = [out_prefix + layout.full_filename(tp, pp, ep)]
        else:
            out_rels = [out_prefix + layout.shard_filename(d, tp, pp, ep) for d in range(g_out)]
        grp = Group(layout.ShardName(0, tp, pp, ep), in_rels, out_rels)
        grp.sources = [reader.load_pickle(r) if xser_in else None for r in in_rels]
        first = grp.sources[0] if xser_in else plain_reader.plain(in_rels[0], mmap=True)
        grp.template, grp.slots, grp.shape_info = build_template(first, reader.where(in_rels[0]))
        expert_from = _ep_split(input_dir, first, in_rels[0], ep_size, g_in, g_out, to_full)
        grp.ep = ep_size if expert_from is not None else 1
        grp.expert_from = expert_from
        if xser_in:
            for j, s in enumerate(grp.sources[1:], 1):
                if not isinstance(s, dict) or "base_state" not in s:
                    raise Zero1FormatError(f"{reader.where(in_rels[j])} is not a ZeRO-1 optimizer state, "
                                           f"unlike {reader.where(in_rels[0])}")
        groups.append(grp)
    return groups


def convert_zero1(input_dir: str, output_dir: str, *, to_full: bool = False, dp_size: Optional[int] = None,
                  num_workers: int = 1, overwrite: bool = False, trusted: bool = False,
                  progress: Optional[bool] = None) -> ConvertResult:
    """Convert the ZeRO-1 optimizer state of tag ``input_dir`` to ``dp_size`` DP shards (or, with
    ``to_full``, to one full file per (tp, pp)) in a new complete tag ``output_dir``. Both are POSIX paths
    or object-store URLs (``s3://bucket/prefix``). Single process (``num_workers`` worker processes).

    ``input_dir`` may also be an ``optim/`` folder itself; then only optimizer files are written to
    ``output_dir`` (NxD's converter's behaviour), without markers or manifest.
    """
    if not to_full:
        if isinstance(dp_size, bool) or not isinstance(dp_size, int) or dp_size < 1:
            raise CheckpointArgumentError(f"--dp_size must be a positive integer with --convert_to_sharded, got {dp_size!r}")
    if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 1:
        raise CheckpointArgumentError(f"--num_workers must be a positive integer, got {num_workers!r}")
    started = time.monotonic()
    inp = _open_input(input_dir)
    dst = check_output(inp.root if inp.tag_mode else inp.root.child(inp.folder), output_dir, flag="--output_dir",
                       example="ckpts/step_1000_dp8", overwrite=overwrite)
    manifest = inp.manifest
    reader = FileReader.at(inp.root, manifest, trusted)
    groups_in, full_in = _scan_optim(inp.root, inp.folder)
    legacy = layout.OPTIM_DIR in manifest_mod.legacy_ep_folders(manifest) and not full_in
    if legacy:
        groups_in = _from_legacy_ep_names(groups_in, manifest.topology.ep)
    ep_size = expert_parallel_size(input_dir, inp.root if inp.tag_mode else None, manifest, groups_in, legacy)
    if to_full and full_in:
        raise CheckpointArgumentError(f"{input_dir} already holds full optimizer files; nothing to do with "
                                      "--convert_to_full (use --convert_to_sharded --dp_size N)")
    g_in = 1 if full_in else len(next(iter(groups_in.values())))
    g_out = 1 if to_full else dp_size
    xser_in = layout.folder_is_xser(inp.root, inp.folder)
    plain_reader = reader
    if not xser_in:
        # Check each plain (torch.save) input file once, streaming; then read them memory-mapped unchecked.
        in_prefix = f"{inp.folder}/" if inp.folder else ""
        for files in groups_in.values():
            for name in files.values():
                reader.check_file(in_prefix + name)
        plain_reader = FileReader.at(inp.root, None, trusted)
    groups = _plan_groups(inp, input_dir, groups_in, full_in, g_in, g_out, to_full, ep_size, xser_in, reader,
                          plain_reader)
    plan = _Plan(groups, g_in, full_in, g_out, to_full, xser_in, num_workers, progress)
    try:
        if inp.tag_mode:
            with output_tag(dst) as tag_out:
                written, linked, copied = _write(plan, inp, reader, tag_out.storage, trusted, tag_out)
        else:
            with output_tree(dst) as out:
                written, linked, copied = _write(plan, inp, reader, out, trusted, None)
    finally:
        _BUFFERS.clear()
    nparams = sum(len(g.shape_info) for g in groups)
    return ConvertResult(dst.root, None if full_in else g_in, None if to_full else g_out, xser_in, len(groups),
                         nparams, sum(r.size for r in written), len(written), linked, copied,
                         time.monotonic() - started)


@dataclass
class _Plan:
    groups: List[Group]
    g_in: int
    full_in: bool
    g_out: int
    full_out: bool
    xser: bool
    num_workers: int
    progress: Optional[bool]


def _write(plan: _Plan, inp: _Input, reader: FileReader, out: Storage, trusted: bool,
           tag_out: Optional[TagOutput]) -> Tuple[List[FileRecord], int, int]:
    """Write every converted optimizer file into ``out``; in tag mode also the rest of the tag and its
    manifest (``tag_out.commit``). Returns (the optimizer files' records, files linked, files copied)."""
    records: Dict[str, FileRecord] = {}
    optim_tensors: Dict[str, dict] = {}
    ctx = _WorkerContext(inp.root.root, plan.xser and inp.manifest or None, trusted, out.root, inp.root, out)
    if plan.xser:
        _convert_xser(plan.groups, plan.g_in, plan.full_in, plan.g_out, plan.full_out, ctx, reader, out, records,
                      optim_tensors, plan.num_workers, plan.progress)
    else:
        _convert_plain(plan.groups, plan.g_in, plan.full_in, plan.g_out, plan.full_out, ctx, records,
                       optim_tensors, plan.num_workers, plan.progress)
    written = list(records.values())
    linked = copied = 0
    if tag_out is not None:
        linked, copied = _copy_rest(inp.root, out, inp.manifest, records)
        tag_out.commit(_manifest(tag_out.name, inp.manifest, inp.root, plan.g_out, plan.full_out, plan.xser, records,
                                 optim_tensors))
    return written, linked, copied

# --- workers --------------------------------------------------------------------------------------
@dataclass
class _WorkerContext:
    """What a conversion unit needs: the input and output locations (paths or URLs, which a worker process
    opens itself) and, in the converting process, the open Storages."""

    in_root: str
    manifest: Optional[manifest_mod.Manifest]
    trusted: bool
    out_root: str
    in_storage: Optional[Storage] = None
    out_storage: Optional[Storage] = None

    def for_worker(self) -> "_WorkerContext":
        return _WorkerContext(self.in_root, self.manifest, self.trusted, self.out_root)

    def shareable(self) -> bool:
        """Whether worker processes can open both locations (an in-process ``mem://`` store they cannot)."""
        return not any(r.startswith("mem://") for r in (self.in_root, self.out_root))

    def reader(self) -> FileReader:
        return FileReader.at(self.in_storage, self.manifest, self.trusted)


_CTX: Optional[_WorkerContext] = None


class BufferRing:
    """``size`` reusable output-piece buffers of one shape and dtype, handed out in turn."""

    def __init__(self, size: int = 2):
        self.size = size
        self._key = None
        self._bufs: List[Optional[torch.Tensor]] = []
        self._i = 0

    def next(self, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
        if self._key != (shape, dtype):
            # A new shape: forget the old buffers (a write still in flight keeps its own reference).
            self._key, self._bufs, self._i = (shape, dtype), [None] * self.size, 0
        k = self._i % self.size
        self._i += 1
        if self._bufs[k] is None:
            self._bufs[k] = torch.empty(shape, dtype=dtype)
        return self._bufs[k]

    def clear(self) -> None:
        self._key, self._bufs = None, []


_BUFFERS = BufferRing(2)   # per process: two pieces, one being written while the next is assembled


def _init_worker(ctx: _WorkerContext) -> None:
    """A worker process: open both locations afresh (a forked S3 client is the parent's)."""
    global _CTX
    forget_clients()
    ctx.in_storage, ctx.out_storage = open_storage(ctx.in_root), open_storage(ctx.out_root)
    _CTX = ctx
    torch.set_num_threads(1)


def _load_leaf(reader: FileReader, spec) -> Tuple[torch.Tensor, str]:
    kind, val = spec
    if kind == "file":
        return reader.load_tensor(val, mapped=True), reader.where(val)
    return val[0], val[1]


def _run_unit(unit: dict) -> List[tuple]:
    """Re-shard every state tensor of one parameter; write each output tensor file as soon as it is
    assembled, on a writer thread, so that writing piece r overlaps reading and assembling piece r+1."""
    from concurrent.futures import ThreadPoolExecutor

    ctx = _CTX
    reader, out = ctx.reader(), ctx.out_storage
    geo: Geometry = unit["geometry"]
    results = []
    pending: List = []

    def write(rel, out_rel, tid, piece):
        rec = out.write_file(rel, lambda f: xser.write_tensor(piece, f), durable=False)
        return (rel, rec.size, rec.crc32c, out_rel, tid, str(piece.dtype).replace("torch.", ""), list(piece.shape))

    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="nxd_ckpt-convert-write") as writer:
        try:
            for _label, specs, tid in unit["keys"]:
                for r, piece in stream_pieces(geo, lambda j, specs=specs: _load_leaf(reader, specs[j]), _BUFFERS):
                    out_rel = unit["out_rels"][r]
                    pending.append(writer.submit(write, layout.tensor_path(out_rel, tid), out_rel, tid, piece))
                    del piece
                    # At most one write in flight once the next piece is assembled: the ring has two buffers.
                    while len(pending) > 1:
                        results.append(pending.pop(0).result())
            while pending:
                results.append(pending.pop(0).result())
        finally:
            for f in pending:
                f.cancel()
    return results


def _pool_map(fn, units: List, ctx: _WorkerContext, num_workers: int, progress, desc: str, weight):
    """Yield fn(unit) for each unit, in worker processes when num_workers > 1, with a tqdm bar on a tty."""
    with progress_bar(sum(weight(u) for u in units), desc, progress) as bar:
        if num_workers <= 1 or len(units) <= 1 or not ctx.shareable():
            _init_worker_inline(ctx)
            # Copies of a few MB gain nothing from intra-op threads, and on a busy host they lose.
            threads = torch.get_num_threads()
            torch.set_num_threads(1)
            try:
                for u in units:
                    res = fn(u)
                    if bar is not None:
                        bar.update(weight(u))
                    yield res
            finally:
                torch.set_num_threads(threads)
        else:
            method = "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"
            mp = multiprocessing.get_context(method)
            with mp.Pool(min(num_workers, len(units)), initializer=_init_worker, initargs=(ctx.for_worker(),)) as pool:
                for u, res in pool.imap_unordered(_tagged(fn), [(i, u) for i, u in enumerate(units)]):
                    if bar is not None:
                        bar.update(weight(units[u]))
                    yield res


def _init_worker_inline(ctx: _WorkerContext) -> None:
    global _CTX
    _CTX = ctx


class _tagged:
    """Picklable wrapper returning (index, fn(unit))."""

    def __init__(self, fn):
        self.fn = fn

    def __call__(self, item):
        i, u = item
        return i, self.fn(u)


def _nbytes(shape, dtype_size: int = 4) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n * dtype_size


def _convert_xser(groups: List[Group], g_in: int, full_in: bool, g_out: int, full_out: bool, ctx: _WorkerContext,
                  reader: FileReader, out: Storage, records: Dict[str, FileRecord],
                  optim_tensors: Dict[str, dict], num_workers: int, progress) -> None:
    units = []
    group_plans = []
    for grp in groups:
        # One placeholder tensor per slot: xser.to_refs gives the tids torch-xla's save would give.
        holders = {}
        filled = _fill(grp.template, lambda s, h=holders: h.setdefault(id(s), (s, torch.zeros(1)))[1])
        ref_data, ordered = xser.to_refs(filled)
        by_holder = {id(t): s for s, t in holders.values()}
        tid_of = {id(by_holder[id(t)]): tid for tid, t in enumerate(ordered)}
        slot_of_tid = {tid: by_holder[id(t)] for tid, t in enumerate(ordered)}
        group_plans.append((grp, ref_data, slot_of_tid))
        per_param: Dict[Any, list] = {}
        for s in grp.slots:
            specs = []
            for j, src in enumerate(grp.sources):
                try:
                    leaf = _get_path(src, s.path)
                except (KeyError, IndexError, TypeError):
                    raise Zero1FormatError(
                        f"{reader.where(grp.in_rels[j])} has no {'/'.join(map(str, s.path))}, unlike "
                        f"{grp.in_rels[0]}: the DP shards do not come from one ZeRO-1 optimizer") from None
                if xser.is_ref(leaf):
                    specs.append(("file", layout.tensor_path(grp.in_rels[j], leaf.tid)))
                elif isinstance(leaf, torch.Tensor):
                    specs.append(("inline", (leaf, f"{reader.where(grp.in_rels[j])} [{'/'.join(map(str, s.path))}]")))
                else:
                    raise Zero1FormatError(f"{reader.where(grp.in_rels[j])}: {'/'.join(map(str, s.path))} is a "
                                           f"{type(leaf).__name__}, not a tensor, unlike in {grp.in_rels[0]}")
            per_param.setdefault(s.param, []).append(("/".join(map(str, s.path)), specs, tid_of[id(s)]))
        for i, keys in per_param.items():
            e_size = grp.ep_of(i)
            geo = Geometry(grp.shape_info[i], g_in // e_size, full_in, g_out // e_size, full_out)
            for e in range(e_size):   # one unit per expert-DP sub-group (the whole DP group without EP)
                sub = [(label, specs[e::e_size], tid) for label, specs, tid in keys]
                units.append({"geometry": geo, "keys": sub, "out_rels": grp.out_rels[e::e_size]})
    units.sort(key=lambda u: -_nbytes(u["geometry"].shape) * len(u["keys"]))

    written: Dict[str, Dict[int, tuple]] = {}
    for res in _pool_map(_run_unit, units, ctx, num_workers, progress, "convert-zero1",
                         lambda u: _nbytes(u["geometry"].shape) * len(u["keys"])):
        for rel, size, crc, out_rel, tid, dtype, shape in res:
            records[rel] = FileRecord(rel, size, crc)
            written.setdefault(out_rel, {})[tid] = (dtype, shape)

    for grp, ref_data, slot_of_tid in group_plans:
        copies = {tid: s for tid, s in slot_of_tid.items() if s.kind == "copy"}
        for tid, s in sorted(copies.items()):
            if xser.is_ref(s.leaf):
                t = reader.load_tensor(layout.tensor_path(grp.in_rels[0], s.leaf.tid))
            else:
                t = s.leaf
            # Only DP rank 0's copy is used; the others' are still checked, so damage never goes unreported.
            for j in range(1, len(grp.sources)):
                leaf = _get_path(grp.sources[j], s.path)
                if xser.is_ref(leaf):
                    reader.check_file(layout.tensor_path(grp.in_rels[j], leaf.tid))
            for out_rel in grp.out_rels:
                rel = layout.tensor_path(out_rel, tid)
                records[rel] = out.write_file(rel, lambda f, t=t: xser.write_tensor(t, f), durable=False)
                written.setdefault(out_rel, {})[tid] = (str(t.dtype).replace("torch.", ""), list(t.shape))
        for out_rel in grp.out_rels:
            metas = written.get(out_rel, {})
            info = {tid: manifest_mod.info_entry(d, shape, {}) for tid, (d, shape) in sorted(metas.items())}
            records[layout.info_path(out_rel)] = out.write_file(
                layout.info_path(out_rel), lambda f, info=info: torch.save(info, f), durable=False)
            records[out_rel] = out.write_file(out_rel, lambda f, r=ref_data: xser.dump_refs(r, f),
                                              durable=False)
            optim_tensors[out_rel] = {
                str(tid): {"dtype": d, "shape": shape, "key": "/".join(map(str, slot_of_tid[tid].path))}
                for tid, (d, shape) in sorted(metas.items())}


def _run_plain_unit(unit: dict) -> List[tuple]:
    """Non-xser: build output rank r's whole state (inputs memory-mapped) and torch.save it."""
    ctx = _CTX
    reader, out = ctx.reader(), ctx.out_storage
    sources = [reader.plain(rel, mmap=True) for rel in unit["in_rels"]]
    tpl, _slots, shape_info = build_template(sources[0], reader.where(unit["in_rels"][0]))
    g_in, full_in, g_out, full_out, r = unit["g_in"], unit["full_in"], unit["g_out"], unit["full_out"], unit["r"]
    metas = []

    def value(slot: Slot):
        if slot.kind == "copy":
            v = slot.leaf.clone()
        else:
            expert_from = unit.get("expert_from")
            e_size = unit.get("ep", 1) if expert_from is not None and slot.param >= expert_from else 1
            geo = Geometry(shape_info[slot.param], g_in // e_size, full_in, g_out // e_size, full_out)
            rows, tail = geo.rows_tail
            where = [f"{reader.where(rel)} [{'/'.join(map(str, slot.path))}]" for rel in unit["in_rels"]]
            e = r % e_size   # an expert parameter: the DP ranks of this EP rank, in expert-DP order

            def load(j):
                j = j * e_size + e
                try:
                    t = _get_path(sources[j], slot.path)
                except (KeyError, IndexError, TypeError):
                    raise Zero1FormatError(f"{where[j]} is missing: the DP shards do not come from one ZeRO-1 "
                                           "optimizer") from None
                if not isinstance(t, torch.Tensor):
                    raise Zero1FormatError(f"{where[j]} is a {type(t).__name__}, not a tensor")
                return geo.normalise_input(t, where[j])

            piece = make_piece(r // e_size, load, geo.per_in, rows, tail, geo.per_out, lambda: load(0).dtype)
            v = geo.finish(piece).clone()
        metas.append(("/".join(map(str, slot.path)), str(v.dtype).replace("torch.", ""), list(v.shape)))
        return v

    state = _fill(tpl, value)
    sums: Dict[str, Any] = {}

    def produce(f):     # each zip record's CRC32C too, as a save records a plain shard's (resharding reads by them)
        summer = xser.RecordSums(f)
        torch.save(state, summer)
        sums["ranges"] = summer.ranges()

    rec = out.write_file(unit["out_rel"], produce, durable=False)
    return [(unit["out_rel"], rec.size, rec.crc32c, metas, sums.get("ranges"))]


def _convert_plain(groups: List[Group], g_in: int, full_in: bool, g_out: int, full_out: bool, ctx: _WorkerContext,
                   records: Dict[str, FileRecord], optim_tensors: Dict[str, dict], num_workers: int, progress) -> None:
    units = []
    for grp in groups:
        for r, out_rel in enumerate(grp.out_rels):
            units.append({"in_rels": grp.in_rels, "out_rel": out_rel, "r": r, "g_in": g_in, "full_in": full_in,
                          "g_out": g_out, "full_out": full_out, "ep": grp.ep, "expert_from": grp.expert_from,
                          "bytes": sum(_nbytes(s) for s in grp.shape_info.values()) // max(1, g_out)})
    for res in _pool_map(_run_plain_unit, units, ctx, num_workers, progress, "convert-zero1", lambda u: u["bytes"]):
        for rel, size, crc, metas, ranges in res:
            records[rel] = FileRecord(rel, size, crc, ranges)
            optim_tensors[rel] = {str(i): {"dtype": d, "shape": s, "key": k} for i, (k, d, s) in enumerate(metas)}


# --- the rest of the tag ------------------------------------------------------------------------------
_SKIP_TOP = {layout.OPTIM_DIR, layout.CHECKPOINT_MARKER, layout.DONE_MARKER, layout.MANIFEST_FILE}


def _copy_rest(src: Storage, out: Storage, manifest: Optional[manifest_mod.Manifest],
               records: Dict[str, FileRecord]) -> Tuple[int, int]:
    """Hard-link (one POSIX filesystem) or copy everything of the input tag but optim/ and the markers.
    A copied file is checked against the input's manifest on the bytes copied: damage is never carried
    into the new tag under a fresh checksum."""
    known = manifest.files if manifest else {}
    linked = copied = 0
    for top in src.listdir(""):
        if top in _SKIP_TOP or top.endswith(layout.TMP_SUFFIX):
            continue
        rels = src.list(top) if src.isdir(top) else [top]
        for rel in rels:
            if any(part.endswith(layout.TMP_SUFFIX) for part in rel.split("/")):
                continue
            entry = known.get(rel)
            if out.link_from(src, rel, rel):
                linked += 1
                size = out.size(rel)
                if entry is not None and entry.size == size:
                    records[rel] = FileRecord(rel, size, int(entry.crc32c, 16), _record_sums(entry))
                else:
                    records[rel] = FileRecord(rel, *out.crc32c(rel))
                continue
            rec = out.copy_from(src, rel, rel, durable=False)
            if entry is not None:
                entry.check(rec.size, rec.crc32c, f"{src.root}/{rel}")
                rec = FileRecord(rec.relpath, rec.size, rec.crc32c, _record_sums(entry))
            records[rel] = rec
            copied += 1
    return linked, copied


def _manifest(tag: str, in_manifest: Optional[manifest_mod.Manifest], src: Storage, g_out: int, full_out: bool,
              xser_out: bool, records: Dict[str, FileRecord], optim_tensors: Dict[str, dict]) -> manifest_mod.Manifest:
    """The new tag's manifest: the input's topology at the new DP size, every file's size and CRC32C."""
    if in_manifest is not None:
        topo = dict(vars(in_manifest.topology))
    else:
        from .inspect import derived_topology

        topo = derived_topology(src)
    ep = int(topo.get("ep") or 1)
    cp = int(topo.get("cp") or 1)
    tp = int(topo.get("tp") or 1)
    pp = int(topo.get("pp") or 1)
    dp = g_out   # ZeRO-1 files are named by the full DP rank, with or without EP
    topo.update(tp=tp, pp=pp, cp=cp, ep=ep, dp=dp, world_size=tp * pp * dp * cp)
    flags = {"zero1": True, "xser": xser_out, "has_model": src.isdir(layout.MODEL_DIR), "has_optim": True}
    if full_out:
        flags["zero1_full"] = True
    if (in_manifest.extra.get(masters.FLAG) if in_manifest is not None else layout.model_data_absent(src)):
        flags[masters.FLAG] = True    # the model's weights still lie only in the (converted) master weights
    files = {}
    in_files = in_manifest.files if in_manifest else {}
    for rel, rec in sorted(records.items()):
        if rel in (layout.CHECKPOINT_MARKER, layout.DONE_MARKER, layout.MANIFEST_FILE):
            continue
        entry = rec.to_json()
        entry["rank"] = _rank_of(rel, topo) if rel.startswith(layout.OPTIM_DIR + "/") else \
            int(getattr(in_files.get(rel), "rank", None) or 0)
        files[rel] = entry
    tensors = {}
    if in_manifest is not None:
        tensors.update({k: {tid: m.to_json() for tid, m in v.items()} for k, v in in_manifest.tensors.items()
                        if not k.startswith(layout.OPTIM_DIR + "/")})
    tensors.update(optim_tensors)
    man = manifest_mod.build(tag, topo, flags, files, tensors)
    man.extra["converted_from"] = {"path": src.root, "tag": src.root.rstrip("/").rpartition("/")[2],
                                   "dp": in_manifest.topology.dp if in_manifest else None}
    return man


def _record_sums(entry) -> Optional[tuple]:
    """A file taken over unchanged keeps its per-record checksums (a plain model shard's)."""
    return tuple((r.offset, r.length, int(r.crc32c, 16)) for r in entry.ranges) if entry.ranges else None


def _rank_of(rel: str, topo: dict) -> int:
    """The global rank that owns optimizer file ``rel`` in the new topology, on the row-major grid of
    DESIGN 2.3 (informational: a converted tag was written by no rank)."""
    name = rel.split("/")[-1]
    s = layout.parse_shard_filename(name)
    if s is None:
        f = layout.parse_full_filename(name)
        if f is None:
            return 0
        s = layout.ShardName(0, f.tp, f.pp, f.ep)
    tp, dp, cp, ep = (int(topo.get(k) or 1) for k in ("tp", "dp", "cp", "ep"))
    # an ep_rank file is written by expert-DP rank 0 of its EP rank: NxD's _get_path names it with dp=False, so
    # its dp field is always 00 (read as the expert-DP rank were it not), and (edp, ep) is DP rank edp * EP + ep
    # of the [PP, EDP, EP, TP] view; ZeRO-1 files carry the full DP rank and no ep field
    d = s.dp * ep + s.ep if s.ep is not None else s.dp
    return ((s.pp * dp + d) * cp) * tp + s.tp


# --- command line ---------------------------------------------------------------------------------------
def add_arguments(p) -> None:
    """The flags of NxD's converter, plus --overwrite and --trusted. Dashed spellings are accepted too."""
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--convert_to_full", "--convert-to-full", action="store_true",
                      help="merge the DP shards into one full_tp_rank_TT_pp_rank_PP.pt per (tp, pp)")
    mode.add_argument("--convert_to_sharded", "--convert-to-sharded", action="store_true",
                      help="re-shard to --dp_size DP ranks (input: dp_rank_* shards or full_* files)")
    p.add_argument("--input_dir", "--input-dir", required=True, metavar="TAGDIR",
                   help="the checkpoint tag to convert (contains optim/); it is never modified")
    p.add_argument("--output_dir", "--output-dir", required=True, metavar="TAGDIR",
                   help="the new tag to write (must not exist or be empty, unless --overwrite)")
    p.add_argument("--dp_size", "--dp-size", type=int, metavar="N", help="the new DP size (with --convert_to_sharded)")
    p.add_argument("--num_workers", "--num-workers", type=int, default=1, metavar="K",
                   help="worker processes (default 1; each holds about one parameter's state at a time)")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty --output_dir")
    p.add_argument("--trusted", action="store_true",
                   help="unpickle without weights_only restrictions (only for checkpoints from a trusted source)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")


EPILOG = """example:
  nxd-ckpt convert-zero1 --input_dir ckpts/step_1000 --output_dir ckpts/step_1000_dp4 \\
      --convert_to_sharded --dp_size 4 --num_workers 4
  nxd-ckpt convert-zero1 --input_dir ckpts/step_1000 --output_dir /tmp/step_1000_full --convert_to_full
"""


def run_from_args(args) -> ConvertResult:
    if args.convert_to_sharded and args.dp_size is None:
        raise CheckpointArgumentError("--convert_to_sharded needs --dp_size N (the new data-parallel size)")
    if args.convert_to_full and args.dp_size is not None:
        raise CheckpointArgumentError(f"--convert_to_full merges every DP shard, so --dp_size {args.dp_size} has "
                                      "no meaning there; drop it, or use --convert_to_sharded --dp_size N")
    return convert_zero1(args.input_dir, args.output_dir, to_full=args.convert_to_full, dp_size=args.dp_size,
                         num_workers=args.num_workers, overwrite=args.overwrite, trusted=args.trusted)
