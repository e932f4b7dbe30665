"""The converting commands: `import`, `reshard`, `to-dcp`, `from-dcp`: a source, a sink, and their checks.

Every command reads its input as a FullState (fullstate.py), checks that it can be written as asked before
anything is written, then streams it into a sink (tagwrite.py, dcpio.py) one tensor at a time.
"""
from __future__ import annotations

import fnmatch
import json
import re
import struct
import time
from dataclasses import dataclass, replace
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from .errors import CheckpointArgumentError
from .fullstate import (ConversionError, FullState, TensorSource, check_tag_dir, partition_rules, read_tag,
                        rule_partition)
from .layout import storage_at
from .outdir import check_output_dir
from .partition import layer_index
from .storage import Storage, open_storage
from .tagwrite import TagSizes, plan_check, write_tag


# --- Hugging Face safetensors source ---------------------------------------------------------------
def _st_dtypes() -> Dict[str, torch.dtype]:
    from .export import _ST_DTYPES

    return {code: dt for dt, code in _ST_DTYPES.items()}


INDEX_FILE = "model.safetensors.index.json"


def _hf_files(st: Storage) -> Dict[str, str]:
    """{tensor name: file} of a Hugging Face checkpoint directory (an index, or one model.safetensors)."""
    if st.isfile(INDEX_FILE):
        try:
            weight_map = json.loads(st.read(INDEX_FILE)).get("weight_map")
        except ValueError as exc:
            raise ConversionError(f"{st.root}/{INDEX_FILE} is not JSON: {exc}") from None
        if not isinstance(weight_map, dict) or not weight_map:
            raise ConversionError(f"{st.root}/{INDEX_FILE} has no weight_map: it is not a safetensors index")
        return dict(weight_map)
    files = [n for n in st.listdir("") if n.endswith(".safetensors")]
    if len(files) != 1:
        raise CheckpointArgumentError(
            f"HF_DIR {st.root} has {len(files)} .safetensors files and no {INDEX_FILE}; pass a "
            "directory written by save_pretrained (one model.safetensors, or shards with their index)")
    return {k: files[0] for k in _st_header(st, files[0])[0]}


def _st_header(st: Storage, rel: str) -> Tuple[Dict[str, dict], int]:
    """({tensor name: {dtype, shape, data_offsets}}, where the data starts) of one safetensors file, from
    its header alone (two ranged reads)."""
    where = f"{st.root}/{rel}"
    try:
        head = st.read(rel, 0, 8)
        (n,) = struct.unpack("<Q", head) if len(head) == 8 else (None,)
        header = json.loads(st.read(rel, 8, n)) if n is not None and n < (100 << 20) else None
    except FileNotFoundError:
        raise ConversionError(f"{where} is missing, although the index names it") from None
    except ValueError:
        header = None
    if not isinstance(header, dict):
        raise ConversionError(f"{where} is not a safetensors file (its header cannot be read)")
    header.pop("__metadata__", None)
    return header, 8 + n


def _model_order(names: Sequence[str]) -> List[str]:
    """Names in a decoder's order (safetensors files sort by name): embeddings, then layers by number, then
    the rest (final norm, LM head). Pipeline stages are cut in this order."""
    def key(n):
        i = layer_index(n)
        if i is not None:
            return (1, i)
        return (0, 0) if re.search(r"embed|wte|wpe", n) else (2, 0)

    return sorted(names, key=key)


def read_hf(hf_dir: str, rules: Sequence[Tuple[str, int, int]]) -> FullState:
    """A Hugging Face safetensors checkpoint (a POSIX directory or a URL) as a FullState (model only),
    partitions from ``rules``. Only the headers are read here; each tensor is read when the sink asks for
    it: memory-mapped from a local file, else one ranged read of its bytes."""
    st = open_storage(hf_dir)
    if not st.isdir(""):
        raise CheckpointArgumentError(f"HF_DIR {hf_dir} is not a directory")
    where = _hf_files(st)
    headers = {rel: _st_header(st, rel) for rel in sorted(set(where.values()))}
    codes = _st_dtypes()
    model = []
    for name in _model_order(list(where)):
        rel = where[name]
        header, base = headers[rel]
        if name not in header:
            raise ConversionError(f"{st.root}/{rel} lacks {name!r}, which the index places there")
        entry = header[name]
        if entry.get("dtype") not in codes:
            raise ConversionError(f"{st.root}/{rel}: {name!r} has safetensors dtype {entry.get('dtype')}, which torch "
                                  "cannot hold")
        shape, dtype = tuple(int(d) for d in entry["shape"]), codes[entry["dtype"]]
        model.append(TensorSource(name, shape, dtype, rule_partition(name, rules),
                                  lambda st=st, rel=rel, name=name, entry=entry, base=base, shape=shape, dtype=dtype:
                                  _st_tensor(st, rel, name, entry, base, shape, dtype)))
    return FullState(model)


def _st_tensor(st: Storage, rel: str, name: str, entry: dict, base: int, shape, dtype) -> torch.Tensor:
    local = st.local_path(rel)
    if local is not None:
        from safetensors import safe_open

        with safe_open(local, framework="pt") as f:
            return f.get_tensor(name)
    start, end = (int(o) for o in entry["data_offsets"])
    data = bytearray(st.read(rel, base + start, end - start))
    if len(data) != end - start:
        raise ConversionError(f"{st.root}/{rel} is truncated: {name!r} needs bytes {base + start}-{base + end}")
    if not data:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(data, dtype=dtype).reshape(shape)


def return_freed_memory() -> None:
    """Have glibc hand every large freed buffer back to the system at once: converters allocate and free one
    full tensor after another, and glibc's adaptive mmap threshold would otherwise keep them on the heap,
    so the process's RSS would grow with the checkpoint instead of staying near one tensor. No-op elsewhere."""
    import ctypes

    try:
        ctypes.CDLL("libc.so.6").mallopt(-3, 1 << 20)   # M_MMAP_THRESHOLD: fixed at 1 MiB
    except (OSError, AttributeError):
        pass


# --- checks shared by the commands -----------------------------------------------------------------
def check_rules(state: FullState, rules: Sequence[Tuple[str, int, int]], specs: Sequence[str], tp: int,
                recorded: bool, flag_src: str) -> None:
    """A --partition rule must match something; TP > 1 needs partition information from somewhere."""
    names = state.names()
    for spec, (glob, _d, _s) in zip(specs, rules):
        if not any(fnmatch.fnmatchcase(n, glob) for n in names):
            raise CheckpointArgumentError(f"--partition {spec!r} matches no tensor of {flag_src} (e.g. "
                                          f"{', '.join(names[:3])}); fix the pattern")
    if tp > 1 and not rules and not recorded:
        raise ConversionError(
            f"{flag_src} records no partition attributes, so splitting it over --tp {tp} needs rules: pass "
            "--preset llama (Llama-family names) or --partition GLOB=DIM[:STRIDE] for each TP-split tensor "
            "(e.g. --partition '*.q_proj.weight=0' --partition '*.o_proj.weight=1'); unmatched tensors are replicated")


@dataclass
class ConvertSummary:
    command: str
    output: str
    seconds: float
    detail: dict

    def to_json(self) -> dict:
        return {"command": self.command, "output": self.output, "seconds": self.seconds, **self.detail}


def _sizes(args, default: Optional[TagSizes] = None) -> TagSizes:
    d = default or TagSizes()
    zero1 = d.zero1 if args.zero1 is None else args.zero1
    return TagSizes(args.tp if args.tp is not None else d.tp, args.pp if args.pp is not None else d.pp,
                    args.dp if args.dp is not None else d.dp, zero1)


def _finish(command: str, dst: str, t0: float, res) -> ConvertSummary:
    return ConvertSummary(command, dst, time.monotonic() - t0, res.to_json())


# --- commands --------------------------------------------------------------------------------------
def mark_experts(state: FullState, globs: Sequence[str], ep: int, flag_src: str) -> None:
    """``--expert GLOB`` rules (import, from-dcp) name the expert tensors (dim 0 holds the experts, as NxD's
    ExpertFused layers keep them) that ``--ep`` splits; without rules, what the source recorded stays."""
    # (a tag saved at EP=1 marks no expert: NxD sets expert_model_parallel only at EP > 1)
    if globs and ep == 1:
        raise CheckpointArgumentError("--expert marks tensors to split over expert-parallel ranks; it needs --ep E "
                                      "with E > 1 (or drop --expert)")
    names = state.names()
    for glob in globs:
        if not any(fnmatch.fnmatchcase(n, glob) for n in names):
            raise CheckpointArgumentError(f"--expert {glob!r} matches no tensor of {flag_src} (e.g. "
                                          f"{', '.join(names[:3])}); fix the pattern")
    if globs:
        state.experts = frozenset(n for n in names if any(fnmatch.fnmatchcase(n, g) for g in globs))
    # --ep > 1 with no expert tensor at all is refused by tagwrite.plan_check, for every writer


def import_hf(args) -> ConvertSummary:
    t0 = time.monotonic()
    return_freed_memory()
    rules = partition_rules(args.partition, args.preset)
    dst = check_output_dir(args.hf_dir, args.dst, flag="DST_TAG", example="ckpts/imported", overwrite=args.overwrite)
    state = read_hf(args.hf_dir, rules)
    sizes = replace(_sizes(args), ep=args.ep)
    if sizes.zero1:
        raise CheckpointArgumentError("import brings in weights only; --zero1 needs an optimizer state")
    check_rules(state, rules, args.partition, sizes.tp, False, f"HF_DIR {args.hf_dir}")
    mark_experts(state, args.expert, sizes.ep, f"HF_DIR {args.hf_dir}")
    plan_check(state, sizes)
    res = write_tag(state, dst, sizes, converted_from={"path": open_storage(args.hf_dir).root, "format": "safetensors"})
    return _finish("import", dst, t0, res)


def _source_sizes(state: FullState, tagdir: str) -> TagSizes:
    topo = state.topology
    if not topo:
        from .inspect import derived_topology

        topo = derived_topology(tagdir)
    from . import layout

    zero1 = layout.folder_is_zero1(tagdir, layout.OPTIM_DIR)
    return TagSizes(int(topo.get("tp") or 1), int(topo.get("pp") or 1), int(topo.get("dp") or 1), zero1)


def _read_source_tag(args, flag: str, example: str) -> Tuple[str, str, FullState]:
    """reshard's and to-dcp's input: SRC_TAG checked, the output directory checked (``flag`` and ``example``
    name it in errors), then the tag read as full tensors. Returns (source tag, output dir, state)."""
    src = check_tag_dir(args.src)
    dst = check_output_dir(src, args.dst, flag=flag, example=example, overwrite=args.overwrite)
    state = read_tag(src, partitions=args.partition, trusted=args.trusted, optimizer=not args.no_optimizer)
    return src, dst, state


def reshard(args) -> ConvertSummary:
    t0 = time.monotonic()
    return_freed_memory()
    src, dst, state = _read_source_tag(args, "DST_TAG", "ckpts/step_1000_tp4")
    before = _source_sizes(state, src)
    sizes = _sizes(args, TagSizes(before.tp, before.pp, before.dp, before.zero1 and state.optim is not None))
    sizes = replace(sizes, ep=args.ep)
    mark_experts(state, args.expert, sizes.ep, f"SRC_TAG {src}")
    plan_check(state, sizes)
    res = write_tag(state, dst, sizes, converted_from={"path": src, "tp": before.tp, "pp": before.pp, "dp": before.dp})
    return _finish("reshard", dst, t0, res)


def to_dcp(args) -> ConvertSummary:
    from .dcpio import write_dcp

    t0 = time.monotonic()
    return_freed_memory()
    src, dst, state = _read_source_tag(args, "OUT_DIR", "dcp/step_1000")
    res = write_dcp(state, dst, args.layout, source=src)
    return _finish("to-dcp", dst, t0, res)


def from_dcp(args) -> ConvertSummary:
    from .dcpio import read_dcp

    t0 = time.monotonic()
    return_freed_memory()
    rules = partition_rules(args.partition, args.preset)
    dst = check_output_dir(args.src, args.dst, flag="DST_TAG", example="ckpts/from_dcp", overwrite=args.overwrite)
    state = read_dcp(args.src, rules=rules, trusted=args.trusted, optimizer=not args.no_optimizer)
    sizes = replace(_sizes(args), ep=args.ep)
    if sizes.zero1 and state.optim is None:
        raise ConversionError(f"DCP_DIR {args.src} holds no optimizer state ('optim' / 'optimizer' entries), so "
                              "--zero1 cannot be written; drop --zero1 to bring in the model only")
    recorded = any(t.partition is not None for t in state.model)
    check_rules(state, rules, args.partition, sizes.tp, recorded, f"DCP_DIR {args.src}")
    mark_experts(state, args.expert, sizes.ep, f"DCP_DIR {args.src}")
    plan_check(state, sizes)
    res = write_tag(state, dst, sizes, converted_from={"path": storage_at(args.src).root, "format": "dcp"})
    return _finish("from-dcp", dst, t0, res)


# --- command line ----------------------------------------------------------------------------------
def _sizes_args(p, dp: bool = True, zero1: bool = True) -> None:
    p.add_argument("--tp", type=int, metavar="N", help="tensor parallel size of the new tag")
    p.add_argument("--pp", type=int, metavar="M", help="pipeline parallel size (must divide the layer count)")
    if dp:
        p.add_argument("--dp", type=int, metavar="K", help="data parallel size (matters for a ZeRO-1 optimizer)")
    if zero1:
        p.add_argument("--zero1", dest="zero1", action="store_true", default=None,
                       help="write the optimizer as a ZeRO-1 state sharded over --dp ranks")
        p.add_argument("--no-zero1", dest="zero1", action="store_false", help="write a plain (replicated) optimizer state")


def _rules_args(p, preset: bool = True) -> None:
    p.add_argument("--partition", action="append", default=[], metavar="GLOB=DIM[:STRIDE]",
                   help="tensors matching GLOB are split over TP along DIM (strided when STRIDE > 1); repeatable; "
                        "tensors matching no rule are replicated")
    if preset:
        p.add_argument("--preset", choices=["llama"], help="built-in rules: 'llama' splits the layers "
                                                            "neuronx-distributed's Llama example makes parallel")


def _common(p) -> None:
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty output directory")
    p.add_argument("--trusted", action="store_true",
                   help="unpickle without weights_only restrictions (only for checkpoints from a trusted source)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")


def _ep_arg(p, what: str) -> None:
    p.add_argument("--ep", type=int, default=1, metavar="E",
                   help=f"expert parallel size of the new tag (default 1); E > 1 {what} over E ranks in NxD's "
                        "layout (dp_rank_00_ep_rank_EE_... files; a ZeRO-1 optimizer as NxD's expert-parallel "
                        "ZeRO-1 state); --dp must be a multiple of E")


def _expert_args(p, what: str = "splits the expert tensors (--expert, or as the source records them) along "
                                 "dim 0") -> None:
    _ep_arg(p, what)
    p.add_argument("--expert", action="append", default=[], metavar="GLOB",
                   help="tensors matching GLOB hold experts along dim 0 (NxD's ExpertFused layers) and are split "
                        "over --ep ranks; repeatable; needs --ep > 1")


def add_import(p) -> None:
    p.add_argument("hf_dir", metavar="HF_DIR", help="a Hugging Face checkpoint directory (safetensors)")
    p.add_argument("dst", metavar="DST_TAG", help="the tag directory to write, e.g. ckpts/imported")
    _sizes_args(p, zero1=False)
    p.set_defaults(zero1=False)
    _rules_args(p)
    _expert_args(p)
    _common(p)


def _state_args(p, src: str, src_help: str, dst: str, dst_help: str, *, tag_out: bool, preset: bool) -> None:
    """The arguments reshard, to-dcp and from-dcp share: SRC and DST (``src``/``dst`` their metavars), the new
    tag's sizes when ``tag_out``, the partition rules (with --preset when ``preset``), --no-optimizer, and
    --overwrite/--trusted/--json."""
    p.add_argument("src", metavar=src, help=src_help)
    p.add_argument("dst", metavar=dst, help=dst_help)
    if tag_out:
        _sizes_args(p)
    _rules_args(p, preset=preset)
    p.add_argument("--no-optimizer", action="store_true", help="write the model only")
    _common(p)


def add_reshard(p) -> None:
    _state_args(p, "SRC_TAG", "the tag to reshard (never modified)", "DST_TAG", "the new tag directory",
                tag_out=True, preset=False)
    _expert_args(p, "splits the expert tensors (--expert, or those an expert-parallel source marks) along dim 0 "
                    "(default 1: an expert-parallel source has its experts joined)")


def add_to_dcp(p) -> None:
    from .dcpio import LAYOUTS

    _state_args(p, "SRC_TAG", "the tag to convert (never modified)", "OUT_DIR",
                "the DCP checkpoint directory to write", tag_out=False, preset=False)
    p.add_argument("--layout", choices=LAYOUTS, default="plain",
                   help="plain: top-level 'model' and 'optim' (get_state_dict's form); torchtitan: TorchTitan's "
                        "checkpoint keys (default: plain)")


def add_from_dcp(p) -> None:
    _state_args(p, "DCP_DIR", "a torch.distributed.checkpoint directory (holds .metadata)", "DST_TAG",
                "the tag directory to write", tag_out=True, preset=True)
    _expert_args(p)


EPILOGS = {
    "import": "example:\n  nxd-ckpt import hf/Llama-3-8B ckpts/llama_tp8 --tp 8 --pp 4 --preset llama\n"
              "  nxd-ckpt import hf/moe ckpts/moe_ep4 --ep 4 --dp 8 --expert '*.experts.*'",
    "reshard": "example:\n  nxd-ckpt reshard ckpts/step_1000 ckpts/step_1000_tp4 --tp 4 --dp 2",
    "to-dcp": "example:\n  nxd-ckpt to-dcp ckpts/step_1000 dcp/step_1000\n"
              "  nxd-ckpt to-dcp ckpts/step_1000 outputs/checkpoint/step-1000 --layout torchtitan",
    "from-dcp": "example:\n  nxd-ckpt from-dcp dcp/step_1000 ckpts/step_1000 --tp 2 --dp 2 --zero1",
}
COMMANDS = {"import": (add_import, import_hf), "reshard": (add_reshard, reshard), "to-dcp": (add_to_dcp, to_dcp),
            "from-dcp": (add_from_dcp, from_dcp)}
