"""Where the offline tools that write a new tree (convert-zero1, export, import, reshard, to-dcp, from-dcp) write
it, on any Storage (a POSIX path or an object store URL): the checks before anything is written, the writing
of a new checkpoint tag through the commit strategies of ``commit.py``, the writing of any other tree, and the
byte-count progress bar shown while they write.

A new tag (``output_tag``) is written exactly as a save writes one: on POSIX in ``<tag>.nxdtmp`` and renamed
into place (``RenameCommit``), on an object store at its final keys with `done` last (``MarkerCommit``); a
failed run removes what it wrote and never leaves a complete-looking tag. Any other tree (``output_tree``: a
Hugging Face export, a DCP directory) is staged and renamed the same way on POSIX; an object store has no
rename, so there the writer puts the file that makes the tree usable last (the safetensors index, DCP's
``.metadata``) and a failed run deletes what it wrote.
"""
from __future__ import annotations

import contextlib
import sys
from typing import Any, Iterator, Optional, Union

from . import commit
from .errors import CheckpointArgumentError
from .manifest import Manifest
from .storage import Storage, open_storage

Where = Union[str, Storage]


def _storage(where: Where) -> Storage:
    return open_storage(where) if isinstance(where, str) else where


def check_output(source: Where, output: str, *, flag: str, example: str, overwrite: bool) -> Storage:
    """The Storage of ``output`` once it is safe to write there; raise before anything is touched.

    Refused: the input itself, a location inside the input or containing it (writing or replacing it would
    destroy the input), an existing file, a non-empty directory (or prefix) unless ``overwrite``, and a
    location with no parent (the top of a bucket). ``flag`` names the option in the messages and ``example``
    is the suggested alternative.
    """
    src_root = _storage(source).canonical_root()
    dst = open_storage(output)
    dst_root = dst.canonical_root()
    if src_root == dst_root:
        raise CheckpointArgumentError(f"{flag} {output} is the input directory ({src_root}); writing there would "
                                      f"destroy the input. Pass a new directory, e.g. {example}")
    if dst_root.startswith(src_root + "/"):
        raise CheckpointArgumentError(f"{flag} {output} is inside the input directory {src_root}; pass a directory "
                                      f"outside it, e.g. {example}")
    if src_root.startswith(dst_root + "/"):
        raise CheckpointArgumentError(f"{flag} {output} contains the input directory {src_root}; replacing it would "
                                      f"destroy the input. Pass a new directory, e.g. {example}")
    try:
        dst.parent()
    except ValueError as exc:
        raise CheckpointArgumentError(f"{flag} {output}: {exc}") from None
    if dst.isfile(""):
        raise CheckpointArgumentError(f"{flag} {output} exists and is not a directory")
    if dst.listdir("") and not overwrite:
        raise CheckpointArgumentError(f"{flag} {output} exists and is not empty; pass --overwrite to "
                                      "replace it, or choose a new directory")
    return dst


def check_output_dir(input_dir: Where, output_dir: str, *, flag: str, example: str, overwrite: bool) -> str:
    """``check_output`` for callers that take the output as a path or URL: its root."""
    return check_output(input_dir, output_dir, flag=flag, example=example, overwrite=overwrite).root


def sync_tree(storage: Storage, rels) -> None:
    """Make files written with ``durable=False`` durable, with the directory entries of every directory
    that holds them (no-op on object stores, where an acknowledged write is durable)."""
    rels = list(rels)
    storage.sync_files(rels)
    dirs = {""}
    for rel in rels:
        while "/" in rel:
            rel = rel.rpartition("/")[0]
            dirs.add(rel)
    storage.sync_dirs(dirs)


class TagOutput:
    """A new tag being written by an offline tool: write its files into ``storage`` (keys relative to the
    tag; the `checkpoint` marker is already there), then ``commit`` its manifest. Single process."""

    def __init__(self, parent: Storage, name: str, strategy: commit.CommitStrategy, root: str):
        self.parent, self.name, self.strategy = parent, name, strategy
        self.storage = parent.child(strategy.workdir(name))
        self.root = root
        self.committed = False

    def commit(self, manifest: Manifest) -> None:
        """Make every file durable, write the manifest and `done` last, and put the tag in place."""
        sync_tree(self.storage, self.storage.list(""))
        self.strategy.publish(self.parent, self.name, manifest, newest=False)
        self.committed = True


@contextlib.contextmanager
def output_tag(dst: Where) -> Iterator[TagOutput]:
    """Yield a TagOutput for the new tag ``dst`` (checked with ``check_output``). An existing tree at
    ``dst`` is replaced: on POSIX only once the new tag is complete; on an object store (no rename) it is
    deleted first, `done` first. On any exception (KeyboardInterrupt included) what was written is removed
    and no complete-looking tag is left. Raises RuntimeError when the body returns without ``commit``."""
    dst = _storage(dst)
    parent, name = dst.parent()
    strategy = commit.strategy_for(parent)
    strategy.begin(parent, name)
    out = TagOutput(parent, name, strategy, dst.root)
    try:
        yield out
        if not out.committed:
            raise RuntimeError(f"the new tag {dst.root} was never committed")
    except BaseException:
        strategy.abandon(parent, name)
        raise


@contextlib.contextmanager
def output_tree(dst: Where) -> Iterator[Storage]:
    """Yield the Storage to write a new tree (not a checkpoint tag) into, published as ``dst`` (checked with
    ``check_output``) on normal exit; on any exception what was written is removed.

    POSIX: written in ``<dst>.nxdtmp``, made durable, then renamed over ``dst`` (an existing ``dst`` is
    replaced only once the new tree is complete). Object stores: an existing ``dst`` is deleted first, then
    the files are written at their final keys (the caller writes the file that makes the tree usable last).
    Single process; blocks for the syncs and renames.
    """
    dst = _storage(dst)
    parent, name = dst.parent()
    if not parent.caps.rename:
        dst.delete_many(dst.list(""))
        try:
            yield dst
        except BaseException:
            dst.delete_many(dst.list(""))
            raise
        return
    stage = commit.staging_name(name)
    parent.remove_tree(stage)   # a leftover of an earlier interrupted run
    parent.makedirs(stage)
    try:
        out = parent.child(stage)
        yield out
        sync_tree(out, out.list(""))
        commit.place_tree(parent, stage, name)
    except BaseException:
        parent.remove_tree(stage)
        raise


@contextlib.contextmanager
def progress_bar(total: int, desc: str, progress: Optional[bool]) -> Iterator[Optional[Any]]:
    """Yield a tqdm byte bar of ``total`` bytes, or None when not shown; closed on exit.

    ``progress=None`` shows it only when stderr is a terminal.
    """
    show = sys.stderr.isatty() if progress is None else bool(progress)
    if not show:
        yield None
        return
    from tqdm import tqdm

    bar = tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=desc)
    try:
        yield bar
    finally:
        bar.close()
