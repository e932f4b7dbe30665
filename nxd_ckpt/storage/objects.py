"""Storage over an object store: keys only, no directories, no rename.

``ObjectStorage`` implements the Storage verbs on any ``Bucket`` (the handful of calls an object store
offers: put, ranged get, head, one page of a listing, a batch delete). Directory views are prefixes of
keys; there are no placeholder objects. Two buckets live here for tests and development: an in-process
dict (``mem://bucket/prefix``) and a flat directory of objects that several processes share
(``objdir:///abs/dir``); S3 is another Bucket (``s3.py``, ``s3://bucket/prefix``).
"""
from __future__ import annotations

import io
import os
import threading
import time
import urllib.parse
from abc import ABC, abstractmethod
from typing import Callable, Dict, Iterable, List, Optional, Tuple

from .base import AlreadyExistsError, Capabilities, FileRecord, Sink, Stat, Storage


class Bucket(ABC):
    """The object-store calls ObjectStorage needs. Keys are full keys (prefix included)."""

    page_size = 1000

    @abstractmethod
    def put(self, key: str, data: bytes, crc32c: int, if_none_match: bool = False) -> None:
        """Store ``data``; AlreadyExistsError when ``if_none_match`` and the key exists."""

    @abstractmethod
    def get(self, key: str, offset: int = 0, length: Optional[int] = None) -> bytes:
        """FileNotFoundError when the key does not exist."""

    def get_into(self, key: str, view: memoryview, offset: int = 0,
                 on_range: Optional[Callable[[int, int], None]] = None) -> int:
        """Fill ``view`` with the object's bytes from ``offset`` (fewer only at its end); how many were filled.
        ``on_range(start, end)``: told of each span of ``view`` once it is filled (``Storage.read_into``).
        FileNotFoundError when the key does not exist. Default: ``get``, then one copy into ``view``."""
        data = self.get(key, offset, len(view))
        view[:len(data)] = data
        if on_range is not None:
            on_range(0, len(data))
        return len(data)

    @abstractmethod
    def head(self, key: str) -> Stat: ...

    @abstractmethod
    def list_page(self, prefix: str, after: Optional[str],
                  limit: Optional[int] = None) -> Tuple[List[Tuple[str, Stat]], Optional[str]]:
        """Up to ``page_size`` (or ``limit``, when smaller) (key, Stat) of the keys starting with ``prefix``,
        sorted, after the continuation token ``after``; returns (entries, token for the next page or None at
        the end). The sizes and times come with the listing (S3's LIST response has them): no request per key."""

    @abstractmethod
    def delete_batch(self, keys: List[str]) -> None:
        """Delete up to ``page_size`` keys in one request; missing keys are ignored."""

    def sink(self, key: str, exclusive: bool) -> Sink:
        """Where one object's bytes go while it is produced (default: memory, then one put)."""
        return _BufferSink(self, key, exclusive)

    def close(self) -> None:
        pass


class _BufferSink(Sink):
    def __init__(self, bucket: Bucket, key: str, exclusive: bool):
        self._bucket, self._key, self._exclusive = bucket, key, exclusive
        self._buf = io.BytesIO()

    def write(self, view: memoryview) -> None:
        self._buf.write(view)

    def finish(self, record: FileRecord, durable: bool) -> None:
        self._bucket.put(self._key, self._buf.getbuffer().tobytes(), record.crc32c, self._exclusive)
        self._buf = None

    def abort(self) -> None:
        self._buf = None


class ObjectStorage(Storage):
    caps = Capabilities(rename=False, create_exclusive=True)
    fix_hint = "the bucket access (credentials, permissions, endpoint, network)"

    def __init__(self, bucket: Bucket, prefix: str, url: str):
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.root = url.rstrip("/")

    def key(self, relpath: str) -> str:
        rel = relpath.strip("/")
        if not self.prefix:
            return rel
        return f"{self.prefix}/{rel}" if rel else self.prefix

    def _dir_key(self, relpath: str) -> str:
        k = self.key(relpath)
        return f"{k}/" if k else ""

    def child(self, relpath: str) -> "ObjectStorage":
        return type(self)(self.bucket, self.key(relpath), f"{self.root}/{relpath.strip('/')}")

    def parent(self) -> Tuple["ObjectStorage", str]:
        if not self.prefix:
            raise ValueError(f"{self.root} is the top of its bucket, which has no parent: pass a prefix "
                             f"({self.root}/NAME)")
        up, _, name = self.prefix.rpartition("/")
        return type(self)(self.bucket, up, self.root[: -len(name) - 1]), name

    def _sink(self, relpath: str, atomic: bool, exclusive: bool, size_hint: int = 0) -> Sink:
        return self.bucket.sink(self.key(relpath), exclusive)

    def read(self, relpath: str, offset: int = 0, length: Optional[int] = None) -> bytes:
        return self.bucket.get(self.key(relpath), offset, length)

    def read_into(self, relpath: str, view: memoryview, offset: int = 0,
                  on_range: Optional[Callable[[int, int], None]] = None, expect: Optional[int] = None) -> int:
        # ``expect`` saves nothing here: a ranged GET ends where the object does
        return self.bucket.get_into(self.key(relpath), view, offset, on_range)

    def _entries(self, prefix: str, first_only: bool = False) -> List[Tuple[str, Stat]]:
        out: List[Tuple[str, Stat]] = []
        token = None
        while True:
            # first_only: a page of one key (S3: MaxKeys=1), not a page of 1,000 keys with their sizes and times
            entries, token = self.bucket.list_page(prefix, token, 1 if first_only else None)
            out += entries
            if token is None or (first_only and out):
                return out

    def _keys(self, prefix: str, first_only: bool = False) -> List[str]:
        return [k for k, _ in self._entries(prefix, first_only)]

    def list(self, prefix: str = "") -> List[str]:
        base = self._dir_key("")
        return sorted(k[len(base):] for k in self._keys(self._dir_key(prefix)))

    def list_stats(self, prefix: str = "") -> Dict[str, Stat]:
        base = self._dir_key("")
        return {k[len(base):]: st for k, st in sorted(self._entries(self._dir_key(prefix)))}

    def stat(self, relpath: str) -> Stat:
        return self.bucket.head(self.key(relpath))

    def delete_many(self, relpaths: Iterable[str]) -> None:
        keys = [self.key(r) for r in relpaths]
        n = self.bucket.page_size
        for i in range(0, len(keys), n):
            self.bucket.delete_batch(keys[i:i + n])

    def isdir(self, relpath: str) -> bool:
        return bool(self._keys(self._dir_key(relpath), first_only=True))

    def listdir(self, relpath: str) -> List[str]:
        base = self._dir_key(relpath)
        return sorted({k[len(base):].split("/", 1)[0] for k in self._keys(base)})


class MemoryBucket(Bucket):
    """An in-process object store (a dict), shared by every ObjectStorage opened on the same name."""

    def __init__(self):
        self._objects: Dict[str, Tuple[bytes, float]] = {}
        self._lock = threading.Lock()

    def put(self, key: str, data: bytes, crc32c: int, if_none_match: bool = False) -> None:
        with self._lock:
            if if_none_match and key in self._objects:
                raise AlreadyExistsError(f"{key} already exists")
            self._objects[key] = (bytes(data), time.time())

    def get(self, key: str, offset: int = 0, length: Optional[int] = None) -> bytes:
        with self._lock:
            if key not in self._objects:
                raise FileNotFoundError(key)
            data = self._objects[key][0]
        return data[offset:] if length is None else data[offset:offset + length]

    def head(self, key: str) -> Stat:
        with self._lock:
            if key not in self._objects:
                raise FileNotFoundError(key)
            data, mtime = self._objects[key]
        return Stat(len(data), mtime)

    def list_page(self, prefix: str, after: Optional[str],
                  limit: Optional[int] = None) -> Tuple[List[Tuple[str, Stat]], Optional[str]]:
        n = min(self.page_size, limit or self.page_size)
        with self._lock:
            keys = sorted(k for k in self._objects if k.startswith(prefix) and (after is None or k > after))
            page = [(k, Stat(len(self._objects[k][0]), self._objects[k][1])) for k in keys[:n]]
        return page, (page[-1][0] if len(keys) > n else None)

    def delete_batch(self, keys: List[str]) -> None:
        with self._lock:
            for k in keys:
                self._objects.pop(k, None)

    def corrupt(self, key: str, data: bytes) -> None:
        """Tests: replace an object's bytes in place (a damaged object)."""
        with self._lock:
            self._objects[key] = (data, self._objects[key][1])


class DirBucket(Bucket):
    """An object store in one flat directory (one file per key, the key %-encoded into its name) that
    several processes share: multi-rank tests of the object-store code paths without a server. A put is
    atomic (temporary file + rename, like an object PUT); there is no rename of keys."""

    def __init__(self, directory: str):
        self.directory = os.path.abspath(directory)
        os.makedirs(self.directory, exist_ok=True)

    def _path(self, key: str) -> str:
        return os.path.join(self.directory, urllib.parse.quote(key, safe=""))

    def put(self, key: str, data: bytes, crc32c: int, if_none_match: bool = False) -> None:
        final = self._path(key)
        tmp = f"{final}.{os.getpid()}.{threading.get_ident()}.part"
        with open(tmp, "wb") as f:
            f.write(data)
        try:
            if if_none_match:
                try:
                    os.link(tmp, final)
                except FileExistsError:
                    raise AlreadyExistsError(f"{key} already exists") from None
            else:
                os.replace(tmp, final)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)

    def get(self, key: str, offset: int = 0, length: Optional[int] = None) -> bytes:
        with open(self._path(key), "rb") as f:
            f.seek(offset)
            return f.read() if length is None else f.read(length)

    def head(self, key: str) -> Stat:
        st = os.stat(self._path(key))
        return Stat(st.st_size, st.st_mtime)

    def list_page(self, prefix: str, after: Optional[str],
                  limit: Optional[int] = None) -> Tuple[List[Tuple[str, Stat]], Optional[str]]:
        n = min(self.page_size, limit or self.page_size)
        keys = sorted(k for k in (urllib.parse.unquote(name) for name in os.listdir(self.directory)
                                  if not name.endswith(".part"))
                      if k.startswith(prefix) and (after is None or k > after))
        page = []
        for k in keys[:n]:
            try:
                page.append((k, self.head(k)))
            except FileNotFoundError:
                continue   # deleted since the directory was read
        return page, (keys[n - 1] if len(keys) > n else None)

    def delete_batch(self, keys: List[str]) -> None:
        for k in keys:
            try:
                os.unlink(self._path(k))
            except FileNotFoundError:
                pass


_MEMORY: Dict[str, MemoryBucket] = {}
_MEMORY_LOCK = threading.Lock()


def memory_bucket(name: str) -> MemoryBucket:
    """The process-wide in-memory bucket called ``name`` (created on first use)."""
    with _MEMORY_LOCK:
        return _MEMORY.setdefault(name, MemoryBucket())


def open_object_url(url: str) -> ObjectStorage:
    """``mem://bucket/prefix`` or ``objdir:///abs/dir[/prefix]`` (the directory is everything before a
    ``//`` in the path, else the whole path)."""
    scheme, _, rest = url.partition("://")
    if scheme == "mem":
        name, _, prefix = rest.partition("/")
        return ObjectStorage(memory_bucket(name), prefix, url)
    directory, _, prefix = rest.partition("//")
    return ObjectStorage(DirBucket(directory), prefix, url)
