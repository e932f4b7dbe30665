"""A read-only view of a Storage answered from one listing: what `nxd-ckpt ls` and `info` walk.

Describing a checkpoint directory asks, per tag and per file, whether a key exists, how large it is and when
it was written. On an object store each such question would be a request (a HEAD per file, a LIST per
"directory"); here the whole tree is listed once (``Storage.list_stats``: on S3 one LIST request per 1,000
keys, sizes and times included) and every such question is answered from that listing. Only file contents
(``read``) go to the backend, with the size already known (on S3 a single GET, no HEAD first).
"""
from __future__ import annotations

import bisect
from typing import Dict, Iterable, List, Optional, Tuple

from .base import Sink, Stat, Storage


class ListedStorage(Storage):
    """``inner`` as it was when listed. Directories are the prefixes of the listed keys; an empty POSIX
    directory, and the modification time of a directory, are asked of ``inner`` (one call, and only for
    what the listing cannot tell)."""

    def __init__(self, inner: Storage, _entries: Optional[Dict[str, Stat]] = None, _base: str = ""):
        self.inner = inner
        self.caps = inner.caps
        self.fix_hint = inner.fix_hint
        self.root = inner.root
        self._entries = inner.list_stats("") if _entries is None else _entries
        self._sorted = sorted(self._entries)
        self._base = _base     # this view's root, relative to the listed root ('' or 'a/b/')

    # --- the listing ---------------------------------------------------------------------------------
    def _full(self, relpath: str) -> str:
        return self._base + relpath.strip("/")

    def _under(self, relpath: str) -> List[str]:
        """Listed keys under directory ``relpath`` (full keys, sorted)."""
        prefix = self._full(relpath)
        prefix = f"{prefix}/" if prefix else ""
        lo = bisect.bisect_left(self._sorted, prefix)
        hi = bisect.bisect_left(self._sorted, prefix + "\uffff")
        return self._sorted[lo:hi]

    def list(self, prefix: str = "") -> List[str]:
        return [k[len(self._base):] for k in self._under(prefix)]

    def list_stats(self, prefix: str = "") -> Dict[str, Stat]:
        return {k[len(self._base):]: self._entries[k] for k in self._under(prefix)}

    def stat(self, relpath: str) -> Stat:
        full = self._full(relpath)
        if full in self._entries:
            return self._entries[full]
        if self.caps.local and self._under(relpath):   # a POSIX directory: its own time
            return self.inner.stat(full)
        raise FileNotFoundError(f"{self.root}/{relpath}")

    def isfile(self, relpath: str) -> bool:
        return self._full(relpath) in self._entries

    def isdir(self, relpath: str) -> bool:
        return bool(self._under(relpath)) or (self.caps.local and self.inner.isdir(self._full(relpath)))

    def exists(self, relpath: str) -> bool:
        return self.isfile(relpath) or self.isdir(relpath)

    def listdir(self, relpath: str) -> List[str]:
        full = self._full(relpath)
        skip = len(full) + 1 if full else 0
        names = {k[skip:].split("/", 1)[0] for k in self._under(relpath)}
        if self.caps.local:   # empty directories hold no keys
            names.update(self.inner.listdir(full))
        return sorted(names)

    def child(self, relpath: str) -> "ListedStorage":
        view = ListedStorage.__new__(ListedStorage)
        view.__dict__.update(self.__dict__)
        view.root = f"{self.root}/{relpath.strip('/')}"
        view._base = self._full(relpath) + "/"
        return view

    def parent(self) -> Tuple[Storage, str]:
        return self.inner.parent()

    def local_path(self, relpath: str) -> Optional[str]:
        return self.inner.local_path(self._full(relpath))

    def canonical_root(self) -> str:
        return self.inner.canonical_root()

    # --- contents, from the backend --------------------------------------------------------------------
    def read(self, relpath: str, offset: int = 0, length: Optional[int] = None) -> bytes:
        full = self._full(relpath)
        if length is None and full in self._entries:
            length = max(0, self._entries[full].size - offset)
        return self.inner.read(full, offset, length)

    # --- a view is read-only ---------------------------------------------------------------------------
    def _sink(self, relpath: str, atomic: bool, exclusive: bool, size_hint: int = 0) -> Sink:
        raise PermissionError(f"{self.root} is a read-only listing")

    def delete_many(self, relpaths: Iterable[str]) -> None:
        raise PermissionError(f"{self.root} is a read-only listing")


def listed(storage: Storage) -> ListedStorage:
    """``storage`` listed once (see the module docstring); a ListedStorage is returned as it is."""
    return storage if isinstance(storage, ListedStorage) else ListedStorage(storage)
