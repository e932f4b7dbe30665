"""Names and paths of everything nxd-ckpt and neuronx-distributed put on disk.

Pure string and path arithmetic: no I/O except the small `scan_*` helpers that list a directory.
The name grammar is NxD's (see DESIGN 2.1): ``dp_rank_{dp:02d}[_ep_rank_{ep:02d}]_tp_rank_{tp:02d}_pp_rank_{pp:02d}.pt``.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

MODEL_DIR = "model"
OPTIM_DIR = "optim"
SCHEDULER_FILE = "scheduler.pt"
USER_CONTENT_FILE = "user_content.pt"
CHECKPOINT_MARKER = "checkpoint"   # written by global rank 0 when a save begins (NxD)
DONE_MARKER = "done"               # written last, once every rank has finished (NxD)
MANIFEST_FILE = "manifest.json"     # ours: every file with size and checksum, written just before `done`
NEWEST_FILE = "newest"              # ours, in the checkpoint dir: the newest complete tag
TMP_SUFFIX = ".nxdtmp"              # files being written; never part of a complete checkpoint
OLD_SUFFIX = ".nxdold"              # a tag being replaced or deleted
RESERVED_SUFFIXES = (TMP_SUFFIX, OLD_SUFFIX)
REUSE_DIR = ".nxd_ckpt_reuse"        # ours, in the checkpoint dir: the files of a tag retention retired (reuse.py)
INFO_SUFFIX = ".info.pt"
DCP_METADATA_FILE = ".metadata"      # torch.distributed.checkpoint's metadata (NxD's use_zero1_dcp optimizer)
TENSORS_SUFFIX = ".tensors"

_SHARD_RE = re.compile(
    r"^dp_rank_(?P<dp>\d+)(?:_ep_rank_(?P<ep>\d+))?_tp_rank_(?P<tp>\d+)_pp_rank_(?P<pp>\d+)\.pt$"
)
_FULL_RE = re.compile(r"^full(?:_ep_rank_(?P<ep>\d+))?_tp_rank_(?P<tp>\d+)_pp_rank_(?P<pp>\d+)\.pt$")


@dataclass(frozen=True, order=True)
class ShardName:
    """The coordinates encoded in a shard file name. ``ep`` is None when the name has no ep field."""

    dp: int
    tp: int
    pp: int
    ep: Optional[int] = None

    @property
    def filename(self) -> str:
        return shard_filename(self.dp, self.tp, self.pp, self.ep)


def shard_filename(dp: int, tp: int, pp: int, ep: Optional[int] = None) -> str:
    """NxD's shard file name; ``ep`` is included only when not None (expert parallel > 1)."""
    ep_part = "" if ep is None else f"_ep_rank_{ep:02d}"
    return f"dp_rank_{dp:02d}{ep_part}_tp_rank_{tp:02d}_pp_rank_{pp:02d}.pt"


def full_filename(tp: int, pp: int, ep: Optional[int] = None) -> str:
    """Name NxD's ZeRO-1 converter gives a merged (full) optimizer file."""
    ep_part = "" if ep is None else f"_ep_rank_{ep:02d}"
    return f"full{ep_part}_tp_rank_{tp:02d}_pp_rank_{pp:02d}.pt"


def parse_shard_filename(name: str) -> Optional[ShardName]:
    """Coordinates of a shard file name, or None when ``name`` is not one. Ranks may exceed two digits."""
    m = _SHARD_RE.match(name)
    if not m:
        return None
    ep = m.group("ep")
    return ShardName(int(m.group("dp")), int(m.group("tp")), int(m.group("pp")), None if ep is None else int(ep))


def parse_full_filename(name: str) -> Optional[ShardName]:
    """Coordinates (dp=-1) of a ``full_..._tp_rank_TT_pp_rank_PP.pt`` name, or None."""
    m = _FULL_RE.match(name)
    if not m:
        return None
    ep = m.group("ep")
    return ShardName(-1, int(m.group("tp")), int(m.group("pp")), None if ep is None else int(ep))


def info_path(ref_path: str) -> str:
    return ref_path + INFO_SUFFIX


def tensors_dir(ref_path: str) -> str:
    return ref_path + TENSORS_SUFFIX


def tensor_filename(tid: int) -> str:
    return f"tensor_{tid}.pt"


def tensor_path(ref_path: str, tid: int) -> str:
    return f"{tensors_dir(ref_path)}/{tensor_filename(tid)}"


def tensor_home(ref_relpath: str, expert: bool) -> str:
    """The shard whose ``.tensors/`` folder holds a tensor of ``ref_relpath`` (NxD's rule): the non-expert
    tensors of an expert-parallel shard (a name with an ``ep_rank`` field) are written only under
    ``ep_rank_00``'s folder, and read from there by every EP rank; everything else lives in its own folder."""
    head, _, name = ref_relpath.rpartition("/")
    s = parse_shard_filename(name)
    if expert or s is None or not s.ep:
        return ref_relpath
    moved = shard_filename(s.dp, s.tp, s.pp, 0)
    return f"{head}/{moved}" if head else moved


def own_home(ref_relpath: str, expert: bool) -> str:
    """``tensor_home`` of nxd-ckpt's legacy EP layout (``manifest.legacy_ep_folders``): every tensor in its own
    shard's folder."""
    return ref_relpath


def is_expert(info_entry) -> bool:
    """Whether an ``.info.pt`` (or manifest) entry marks its tensor expert-parallel."""
    return bool(info_entry and info_entry.get("expert_model_parallel"))


def validate_tag(tag) -> str:
    """Return ``tag`` as a string, or raise ValueError when it cannot name a directory under the checkpoint dir."""
    if not isinstance(tag, (str, int)) or isinstance(tag, bool):
        raise ValueError(f"checkpoint tag must be a str (or int), got {type(tag).__name__}: {tag!r}")
    text = str(tag)
    if text == "" or text.strip() == "":
        raise ValueError("checkpoint tag is empty: pass a name such as 'step_1000'")
    if "/" in text or "\\" in text or ".." in text or text == ".":
        raise ValueError(
            f"checkpoint tag {text!r} is '.' or contains '/', '\\' or '..': a tag names one directory directly "
            "under checkpoint_dir; pass e.g. 'step_1000'"
        )
    if text.endswith(RESERVED_SUFFIXES) or text in (NEWEST_FILE, REUSE_DIR):
        raise ValueError(f"checkpoint tag {text!r} is a name nxd-ckpt reserves (`newest`, `{REUSE_DIR}`, or ending in "
                         f"{' or '.join(RESERVED_SUFFIXES)}); choose another, e.g. 'step_1000'")
    return text


def storage_at(where):
    """The Storage for a directory given as a Storage (its root), a POSIX path or an ``s3://`` URL."""
    if isinstance(where, str):
        from .storage import open_storage

        return open_storage(where)
    return where


def _join(*parts: str) -> str:
    return "/".join(p for p in parts if p)


def holds_checkpoint_data(where) -> bool:
    """True when a tag directory (a POSIX path or a Storage rooted at the tag) holds something load_checkpoint
    reads: a shard (ref file, or NxD's DCP optimizer) in model/ or optim/, or scheduler.pt / user_content.pt."""
    st = storage_at(where)
    if any(st.isfile(n) for n in (SCHEDULER_FILE, USER_CONTENT_FILE)):
        return True
    if list_shard_files(st, MODEL_DIR) or list_shard_files(st, OPTIM_DIR):
        return True
    return st.isfile(_join(OPTIM_DIR, DCP_METADATA_FILE))


def model_data_absent(where) -> bool:
    """True for NxD's ``avoid_saving_lower_precision_weights`` layout in a tag directory (a POSIX path or a
    Storage rooted at the tag): model/ holds xser ref and info files but none of their tensor files, and
    optim/ holds shards (whose ZeRO-1 master weights hold the model's weights)."""
    st = storage_at(where)
    refs = list_shard_files(st, MODEL_DIR)
    if not refs or not list_shard_files(st, OPTIM_DIR):
        return False
    for name in refs.values():
        if not st.isfile(_join(MODEL_DIR, name + INFO_SUFFIX)):
            return False
        if any(n.startswith("tensor_") for n in st.listdir(_join(MODEL_DIR, name + TENSORS_SUFFIX))):
            return False
    return True


def list_shard_files(where, folder: str = "") -> dict:
    """Map ShardName -> file name for every shard ref file directly in ``folder`` of ``where`` (a POSIX path
    or a Storage); empty when missing."""
    out = {}
    for name in storage_at(where).listdir(folder):
        parsed = parse_shard_filename(name)
        if parsed is not None:
            out[parsed] = name
    return out


def folder_is_xser(where, folder: str = "") -> bool:
    """xser is detected, as NxD does, by the presence of ``*.tensors`` folders."""
    st = storage_at(where)
    return any(n.endswith(TENSORS_SUFFIX) and st.isdir(_join(folder, n)) for n in st.listdir(folder))


def folder_is_zero1(where, folder: str = "") -> bool:
    """ZeRO-1 is detected, as NxD does, by the presence of any ``dp_rank_01_*`` shard in ``folder`` of
    ``where`` (a POSIX path, URL or Storage)."""
    return any(s.dp >= 1 for s in list_shard_files(where, folder))
