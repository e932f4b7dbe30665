"""Exceptions raised by xser. Every message names the file and says how to fix the problem."""
from __future__ import annotations

from typing import Optional


class XserError(Exception):
    """Base class of every xser error. ``path`` is the file the error is about, when known."""

    def __init__(self, message: str, *, path: Optional[str] = None):
        super().__init__(message)
        self.path = path


class MissingFileError(XserError, FileNotFoundError):
    """A ref file or tensor file is missing, or a directory was passed where a file was expected."""


class CorruptFileError(XserError, ValueError):
    """A file exists but cannot be read: truncated, garbage, or not what xser expects in it."""


class UnsafeCheckpointError(XserError):
    """A pickle would import or call something other than tensor data; nothing was executed."""

    def __init__(self, message: str, *, path: Optional[str] = None, global_name: Optional[str] = None):
        super().__init__(message, path=path)
        self.global_name = global_name
