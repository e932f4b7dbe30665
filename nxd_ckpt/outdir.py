"""Output directories of the offline tools that write a new tree (convert-zero1, export, to-dcp, from-dcp,
reshard): the checks before anything is written, the staging directory, the final move into place, and the
byte-count progress bar shown while they write."""
from __future__ import annotations

import contextlib
import os
import shutil
import sys
from typing import Any, Iterator, Optional

from .commit import STAGING_SUFFIX
from .errors import CheckpointArgumentError
from .layout import OLD_SUFFIX


def check_output_dir(input_dir: str, output_dir: str, *, flag: str, example: str, overwrite: bool) -> str:
    """Return the real path of ``output_dir`` once it is safe to write; raise before anything is touched.

    Refused: the input itself, a directory inside the input or containing it (writing or replacing it would
    destroy the input), a file, and a non-empty directory unless ``overwrite``. ``flag`` names the option in
    the messages and ``example`` is the suggested alternative.
    """
    src, dst = os.path.realpath(input_dir), os.path.realpath(output_dir)
    if src == dst:
        raise CheckpointArgumentError(f"{flag} {output_dir} is the input directory ({src}); writing there would "
                                      f"destroy the input. Pass a new directory, e.g. {example}")
    if dst.startswith(src + os.sep):
        raise CheckpointArgumentError(f"{flag} {output_dir} is inside the input directory {src}; pass a directory "
                                      f"outside it, e.g. {example}")
    if src.startswith(dst + os.sep):
        raise CheckpointArgumentError(f"{flag} {output_dir} contains the input directory {src}; replacing it would "
                                      f"destroy the input. Pass a new directory, e.g. {example}")
    if os.path.exists(dst):
        if not os.path.isdir(dst):
            raise CheckpointArgumentError(f"{flag} {output_dir} exists and is not a directory")
        if os.listdir(dst) and not overwrite:
            raise CheckpointArgumentError(f"{flag} {output_dir} exists and is not empty; pass --overwrite to "
                                          "replace it, or choose a new directory")
    return dst


@contextlib.contextmanager
def staged_output(dst: str) -> Iterator[str]:
    """Yield a fresh, empty staging directory beside ``dst`` to write the new tree into.

    On normal exit the tree is published with ``publish_output`` (fsynced, then renamed over ``dst``); on any
    exception (KeyboardInterrupt included) the staging directory is removed and ``dst`` is left as it was.
    Single process; blocks for the fsyncs and renames.
    """
    stage = dst + STAGING_SUFFIX
    shutil.rmtree(stage, ignore_errors=True)   # a leftover of an earlier interrupted run
    os.makedirs(stage)
    try:
        yield stage
        publish_output(stage, dst)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
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


def publish_output(stage: str, dst: str) -> None:
    """Make the finished tree ``stage`` durable and rename it to ``dst``, replacing an existing ``dst``
    only once the new tree is complete (the old one is moved aside, then removed)."""
    for root, _dirs, _names in os.walk(stage):
        _fsync_dir(root)
    if os.path.isdir(dst) and os.listdir(dst):
        old = dst + OLD_SUFFIX
        shutil.rmtree(old, ignore_errors=True)
        os.replace(dst, old)
        os.replace(stage, dst)
        _fsync_dir(os.path.dirname(dst))
        shutil.rmtree(old, ignore_errors=True)
    else:
        if os.path.isdir(dst):
            os.rmdir(dst)
        os.makedirs(os.path.dirname(dst) or ".", exist_ok=True)
        os.replace(stage, dst)
    _fsync_dir(os.path.dirname(dst))


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass   # some network filesystems refuse fsync on directories
    finally:
        os.close(fd)
