"""The small interface every storage backend implements: bytes in and out under a root directory."""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Callable, Iterable, List


@dataclass(frozen=True)
class FileRecord:
    """What was written: path relative to the tag directory, byte count and CRC32C of those bytes."""

    relpath: str
    size: int
    crc32c: int

    def to_json(self) -> dict:
        return {"size": self.size, "crc32c": f"{self.crc32c:08x}"}


class Storage(ABC):
    """Paths given to a Storage are relative to its root and use '/' separators."""

    @abstractmethod
    def write_file(self, relpath: str, produce: Callable, *, durable: bool = True) -> FileRecord:
        """Call ``produce(fileobj)`` to write ``relpath`` atomically (temp name, fsync, rename); checksum
        the bytes as they pass."""

    @abstractmethod
    def read_bytes(self, relpath: str) -> bytes: ...

    @abstractmethod
    def exists(self, relpath: str) -> bool: ...

    @abstractmethod
    def isdir(self, relpath: str) -> bool: ...

    @abstractmethod
    def listdir(self, relpath: str) -> List[str]: ...

    @abstractmethod
    def makedirs(self, relpath: str) -> None: ...

    @abstractmethod
    def remove_file(self, relpath: str) -> None: ...

    @abstractmethod
    def remove_tree(self, relpath: str) -> None: ...

    @abstractmethod
    def rename(self, src: str, dst: str) -> None: ...

    def exchange(self, a: str, b: str) -> bool:
        """Atomically swap two existing directories; False when this storage cannot (nothing changed)."""
        return False

    @abstractmethod
    def sync_dirs(self, relpaths: Iterable[str]) -> None:
        """Make directory entries (new files, renames) durable."""

    @abstractmethod
    def size(self, relpath: str) -> int: ...

    @abstractmethod
    def mtime(self, relpath: str) -> float: ...
