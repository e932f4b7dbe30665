"""Every error nxd-ckpt raises on purpose. All derive from CheckpointError; messages say what to do next."""
from __future__ import annotations

from xser.errors import UnsafeCheckpointError as _XserUnsafe


class CheckpointError(Exception):
    """Base class of nxd-ckpt's errors."""


class CheckpointArgumentError(CheckpointError, ValueError):
    """An argument to save_checkpoint / load_checkpoint cannot work; nothing was written or changed."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """No (complete) checkpoint where one was asked for."""


class IncompleteCheckpointError(CheckpointError):
    """The tag exists but has no `done` marker: its save never finished."""


class CorruptCheckpointError(CheckpointError):
    """A file of a complete checkpoint is missing, truncated or does not match its checksum."""

    def __init__(self, message: str, *, path: str | None = None, expected: str | None = None,
                 found: str | None = None):
        super().__init__(message)
        self.path = path
        self.expected = expected
        self.found = found


class UnsafeCheckpointError(CheckpointError, _XserUnsafe):
    """A pickle in the checkpoint needs code outside the safe allowlist; load it only if the files are
    trusted (``trusted=True``). Also an ``xser.UnsafeCheckpointError``: the reader raises this one class
    whichever layer refused the pickle."""


class TopologyMismatchError(CheckpointError):
    """The checkpoint was saved at a parallel layout the current job cannot load directly."""


class StateMismatchError(CheckpointError):
    """The checkpoint's content does not fit the model / optimizer it is loaded into."""


class RankFailureError(CheckpointError):
    """Some rank's part of a save failed or never reported. ``causes`` maps global rank -> cause."""

    def __init__(self, message: str, causes: dict | None = None):
        super().__init__(message)
        self.causes = dict(causes or {})


def describe_causes(causes: dict) -> str:
    return "; ".join(f"rank {r}: {c}" for r, c in sorted(causes.items()))
