"""The one read side: every file of a checkpoint that anything reads (load_checkpoint and every offline tool)
goes through ``FileReader``, which verifies the bytes as read against the manifest, memory-maps only where
the backend is local, and unpickles safely unless the caller trusts the files.

Loading also lives here: no state is changed in this module: the result is a plain dict that loader.py checks
and applies. Tensor files of a DP-replicated shard are split among its replicas (the same largest-first split
the save used); each replica reads its share, verifies it against the manifest, and the share is broadcast to
the other replicas over a host-side gloo group.
"""
from __future__ import annotations

import contextlib
import io
import itertools
import logging
import queue
import threading
import warnings
import zlib
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Tuple, Union

import crc32c as _crc32c
import torch

import xser

from . import hostgroups, layout, plainpipe, rangecheck
from .errors import CorruptCheckpointError, UnsafeCheckpointError
from .manifest import FileEntry, Manifest, TensorMeta, info_entry
from .plan import assign_to_bins
from .readbuffers import ReadBuffers, read_span
from .storage import Storage
from .storage.base import READ_BLOCK, LocalFile, crc_hex
from .storage.s3 import S3Error

log = logging.getLogger("nxd_ckpt")


#: What load_checkpoint's errors advise (the offline tools say nothing more than what is wrong).
LOAD_HINT = ("load another tag (tag=None picks the newest intact one); `nxd-ckpt verify <dir>` lists every "
             "damaged file")


@dataclass
class FileReader:
    """Reads the files of one tag, verifying each against the manifest when there is one: size and CRC32C
    on the bytes as read (whole files or recorded byte ranges), or by a streaming pass (``check_file``).

    ``storage`` holds the tag under ``tag`` ("" when it is rooted at the tag itself); paths are relative to
    the tag. Errors name the file (``where``): CorruptCheckpointError for a missing, truncated, damaged,
    unlisted or unreadable file; UnsafeCheckpointError for a pickle that needs ``trusted=True``. Safe to use
    from several threads.
    """

    storage: Storage
    tag: str = ""
    manifest: Optional[Manifest] = None
    trusted: bool = False
    # Tensor files may come back memory-mapped (see _read_tensor_mapped): only when the caller copies
    # every loaded tensor into a device tensor or an existing parameter and keeps none of them.
    mapped: bool = False
    hint: str = ""           # appended to every error: what to do next

    @classmethod
    def at(cls, where, manifest: Optional[Manifest] = None, trusted: bool = False) -> "FileReader":
        """A reader of the tag at ``where`` (a path, an ``s3://`` URL or a Storage rooted at the tag)."""
        return cls(layout.storage_at(where), "", manifest, trusted)

    def _full(self, relpath: str) -> str:
        return f"{self.tag}/{relpath}" if self.tag else relpath

    def where(self, relpath: str) -> str:
        """How messages name the file: ``<tag>/<relpath>`` for a tag inside a checkpoint dir (load), else its
        local path or URL (the offline tools)."""
        if self.tag:
            return self._full(relpath)
        root = self.storage.root.rstrip("/")
        return self.storage.local_path(relpath) or (f"{root}/{relpath}" if relpath else root)

    def _corrupt(self, relpath: str, what: str, **kw) -> CorruptCheckpointError:
        where = self.where(relpath)
        return CorruptCheckpointError(f"{where} {what}{'; ' + self.hint if self.hint else ''}", path=where, **kw)

    def entry(self, relpath: str) -> Optional[FileEntry]:
        """The manifest's record of the file (None without a manifest); CorruptCheckpointError when the tag
        has a manifest that does not list it."""
        if self.manifest is None:
            return None
        entry = self.manifest.files.get(relpath)
        if entry is None:
            raise self._corrupt(relpath, f"is not listed in the manifest of {self.tag or self.storage.root!r}")
        return entry

    def exists(self, relpath: str) -> bool:
        """Whether the tag has the file: by the manifest when there is one (no request), else by the storage."""
        if self.manifest is not None:
            return relpath in self.manifest.files
        return self.storage.isfile(self._full(relpath))

    def read(self, relpath: str) -> bytes:
        """The whole file, verified."""
        entry = self.entry(relpath)
        try:
            data = self.storage.read(self._full(relpath))
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            raise self._corrupt(relpath, "is missing") from None
        if entry is not None:
            entry.check_bytes(data, self.where(relpath), self.hint)
        return data

    def read_range(self, relpath: str, offset: int, length: int, crc: str) -> bytes:
        """``length`` bytes at ``offset`` of a file the manifest lists, checked against ``crc`` (a CRC32C the
        manifest records for that range)."""
        if self.manifest is None:
            raise self._corrupt(relpath, "has no manifest to check a byte range against")
        self.entry(relpath)
        try:
            data = self.storage.read(self._full(relpath), offset, length)
        except FileNotFoundError:
            raise self._corrupt(relpath, "is missing") from None
        found = f"{_crc32c.crc32c(data):08x}"
        if len(data) != length or found != crc:
            raise self._corrupt(relpath, f"bytes {offset}-{offset + length} are damaged (expected {length} bytes "
                                f"with CRC32C {crc}, found {len(data)} bytes with {found})", expected=crc, found=found)
        return data

    def prefetch(self, relpaths: List[str]) -> None:
        """Start reading these files of the tag ahead (``Storage.prefetch``: blocks for their opens on a local
        disk, not for their reads)."""
        self.storage.prefetch([self._full(r) for r in relpaths])

    def check_file(self, relpath: str) -> None:
        """Stream-check a (possibly large) file against the manifest without holding it in memory; without a
        manifest, only that it exists. CorruptCheckpointError naming the file."""
        problem = self.mismatch(relpath)
        if problem is not None:
            raise self._corrupt(relpath, problem)

    def mismatch(self, relpath: str, records: bool = False) -> Optional[str]:
        """What is wrong with the file against the manifest ("is missing", wrong size, wrong CRC32C: the size
        is looked at first, so a truncated file is not read), or None. A streaming pass, not held in memory.
        ``records``: also each per-record CRC32C the manifest holds for the file (``verify``), in the same pass."""
        entry, full = self.entry(relpath), self._full(relpath)
        try:
            size = self.storage.size(full)
            if entry is None or entry.mismatch(size, None):
                return None if entry is None else entry.mismatch(size, None)
            if records and entry.ranges is not None:
                return rangecheck.stream_mismatch(self.storage.blocks(full), entry)
            size, crc = self.storage.crc32c(full)
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            return "is missing"
        except S3Error:
            raise    # the store did not answer in time: a failed read, not damage
        except OSError as exc:
            return f"cannot be read: {exc}"
        return entry.mismatch(size, crc)

    # --- unpickling ----------------------------------------------------------------------------------
    def _unpickled(self, relpath: str, load):
        """``load()``'s result, with xser's and torch's errors turned into ours, naming the file."""
        try:
            return load()
        except UnsafeCheckpointError:
            raise
        except xser.UnsafeCheckpointError as exc:
            raise UnsafeCheckpointError(str(exc), path=self.where(relpath),
                                        global_name=exc.global_name) from None
        except (CorruptCheckpointError, S3Error):   # S3Error: the store did not answer in time, not damage
            raise
        except Exception as exc:  # noqa: BLE001 - any other failure to unpickle verified bytes: damage
            detail = str(exc) if isinstance(exc, xser.XserError) else f"cannot be read: {exc}"
            raise CorruptCheckpointError(f"{detail}{'; ' + self.hint if self.hint else ''}",
                                         path=self.where(relpath)) from exc

    def load_pickle(self, relpath: str):
        """A ref file, ``.info.pt``, scheduler, user content or plain shard: the verified bytes unpickled (safely
        unless trusted); tensors inline in it are loaded, TensorReferences left as they are. A large file on an
        object store is read into one host buffer (parallel ranged GETs straight into it) and its tensors are
        views of that buffer: each byte copied once from the HTTP body, not three times (body, join, torch.load)."""
        return self.parse_pickle(relpath, self.read_pickle_bytes(relpath))

    def read_pickle_bytes(self, relpath: str):
        """The verified bytes of a pickle file, for ``parse_pickle``: a large file on an object store in a new
        uint8 host tensor (``read_buffer``: ranged GETs straight into it, no join), else ``bytes``."""
        entry = self.entry(relpath)
        if entry is not None and entry.size >= MAPPED_MIN_BYTES and not self.storage.caps.local:
            return self.read_buffer(relpath)
        return self.read(relpath)

    def parse_pickle(self, relpath: str, data):
        """Unpickle ``data`` (the verified bytes of ``relpath``, a readable view of them, or a uint8 tensor
        holding them, whose storage the tensors of the result then share) safely unless the reader is trusted."""
        name = self.where(relpath)
        if isinstance(data, torch.Tensor):   # bytes received from another rank, used in place
            return self._unpickled(relpath, lambda: xser.load_pickle_in_place(data, trusted=self.trusted, name=name))
        src = data if hasattr(data, "readinto") else io.BytesIO(data)
        return self._unpickled(relpath, lambda: xser.load_refs(src, trusted=self.trusted, name=name))

    def info(self, ref_relpath: str) -> Optional[dict]:
        """The shard's ``.info.pt`` ({tid: {dtype, shape, ...}}), None when it has none (older NxD)."""
        rel = layout.info_path(ref_relpath)
        return self.load_pickle(rel) if self.exists(rel) else None

    def tensor_metas(self, ref_relpath: str, info_file: bool = True) -> Tuple[Dict[int, TensorMeta], bool]:
        """What the save recorded of each tensor of a shard, and whether it came from the manifest: its records
        (state-dict keys included), else the shard's ``.info.pt`` when ``info_file`` (no keys), else none."""
        meta = self.manifest.tensors.get(ref_relpath) if self.manifest is not None else None
        if meta:
            return {int(t): m for t, m in meta.items()}, True
        info = (self.info(ref_relpath) if info_file else None) or {}
        return {int(t): TensorMeta.from_info(e) for t, e in info.items()}, False

    def pipelines(self, relpath: str) -> bool:
        """Whether the plain shard ``relpath`` is read by ``read_plain_pipelined``: PIPELINE_PLAIN_SHARDS is on,
        and it is a large file on an object store whose manifest entry holds its records' CRC32C."""
        entry = self.entry(relpath)
        return (PIPELINE_PLAIN_SHARDS and entry is not None and entry.ranges is not None
                and entry.size >= MAPPED_MIN_BYTES and not self.storage.caps.local)

    def plain(self, relpath: str, mmap: bool = True):
        """A non-xser shard (one torch.save file); with ``mmap`` and a local backend, checked by a streaming
        pass and then memory-mapped (its tensors read from the page cache), else read whole and verified."""
        local = self.storage.local_path(self._full(relpath)) if mmap else None
        if local is None:
            return self.load_pickle(relpath)
        self.check_file(relpath)
        name = self.where(relpath)
        try:
            return self._unpickled(relpath, lambda: xser.load_pickle(local, trusted=self.trusted, name=name, mmap=True))
        except CorruptCheckpointError:
            return self.load_pickle(relpath)    # a legacy (non-zip) file cannot be mapped; the full read decides

    def plain_lazy(self, relpath: str) -> Optional["xser.LazyFile"]:
        """A non-xser shard (one torch.save file) opened without reading its tensors: its zip directory and pickle
        read as byte ranges; ``.tensor(t)`` reads one tensor's bytes. Every byte read is verified: against the
        manifest's CRC32C of each zip record when it records them (``rangecheck``); with an older manifest, by one
        streaming pass over the whole file first (bounded memory); without a manifest (neuronx-distributed), each
        record against the zip's own CRC-32 where the file has one. None for a file that is not a zip torch.save
        file (legacy format): read it whole (``load_pickle``)."""
        entry = self.entry(relpath)
        if entry is None or entry.ranges is None:
            self.check_file(relpath)
        full, name = self._full(relpath), self.where(relpath)

        def read(offset: int, length: int) -> bytes:
            try:
                return self.storage.read(full, offset, length)
            except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
                raise self._corrupt(relpath, "is missing") from None

        try:
            size = self.storage.size(full)
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            raise self._corrupt(relpath, "is missing") from None
        if entry is not None and entry.ranges is not None:
            problem = entry.mismatch(size, None)
            if problem is not None:
                raise self._corrupt(relpath, problem)
            read = rangecheck.CheckedRanges(read, entry, name, self.hint, lambda: self.check_file(relpath)).read
        ends = {r.offset: r.end for r in entry.ranges} if entry is not None and entry.ranges is not None else None
        return self._unpickled(relpath, lambda: xser.open_lazy(read, size, trusted=self.trusted, name=name,
                                                               check_crc32=entry is None, record_ends=ends))

    def lazy_tensor(self, relpath: str, lazy: "xser.LazyFile", t) -> torch.Tensor:
        """``lazy.tensor(t)`` of the shard ``relpath`` that ``plain_lazy`` opened, its errors named as ours."""
        return self._unpickled(relpath, lambda: lazy.tensor(t))

    def read_buffer(self, relpath: str) -> torch.Tensor:
        """The whole file in a new uint8 host tensor, read in READ_BLOCK pieces straight into it, the CRC32C
        taken on each piece as it arrives (still in cache), verified against the manifest."""
        entry, full = self.entry(relpath), self._full(relpath)
        try:
            size = entry.size if entry is not None else self.storage.size(full)
            buf = torch.empty(size + 1, dtype=torch.uint8)     # one byte more: a longer file shows
            view = memoryview(buf.numpy())
            crc = got = 0
            # Locally block by block (each checksummed while still in cache); an object store in one call, whose
            # ranges are fetched in parallel.
            block = READ_BLOCK if self.storage.caps.local else len(view)
            while got < len(view):
                # The last piece takes the extra byte with the file's last bytes: alone, it would be read with
                # nothing expected, i.e. not at all, and a longer file would pass.
                want = len(view) - got if len(view) - got <= block + 1 else block
                n = self.storage.read_into(full, view[got:got + want], got, expect=size - got if entry else None)
                crc = _crc32c.crc32c(view[got:got + n], crc)
                got += n
                if n < want:
                    break
            if entry is not None and got > size:
                got = self.storage.size(full)                   # for the message: the file's real size
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            raise self._corrupt(relpath, "is missing") from None
        if entry is not None:
            entry.check(got, crc, self.where(relpath), self.hint)
        return buf[:got]

    def load_tensor(self, relpath: str, mapped: Optional[bool] = None) -> torch.Tensor:
        """One xser tensor file, verified; the tensor is a view of the file's bytes read into host memory
        once (``read_buffer``, ``xser.load_tensor_in_place``). ``mapped`` (default: the reader's): a large
        local file may come back memory-mapped instead (``_read_tensor_mapped``, verified in the same pass)."""
        direct = self._load_tensor_mapped(relpath) if (self.mapped if mapped is None else mapped) else None
        if direct is not None:
            return direct
        buf = self.read_buffer(relpath)
        name = self.where(relpath)
        tensor = self._unpickled(relpath, lambda: xser.load_tensor_in_place(buf, trusted=self.trusted, name=name))
        if not isinstance(tensor, torch.Tensor):
            raise self._corrupt(relpath, f"holds a {type(tensor).__name__}, not a tensor (a tensor file holds one "
                                "torch.save'd tensor)")
        return tensor

    def load_tensor_direct(self, relpath: str, buffers: ReadBuffers) -> Optional[Tuple[torch.Tensor, memoryview]]:
        """A large tensor file listed in the manifest, read past the page cache (``Storage.read_direct``) into a
        buffer from ``buffers`` and verified (size, CRC32C): (the tensor, the buffer it views, to give back once
        nothing reads the tensor again). None when that does not apply (no manifest, a small file, a backend
        without direct reads, the buffers' cap reached) or the file does not verify: ``load_tensor`` then reads
        it and names the damage."""
        entry = self.manifest.files.get(relpath) if self.manifest is not None else None
        if entry is None or not self.storage.reads_direct(entry.size):
            return None
        try:
            buffer = buffers.take(entry.size)
        except OSError:         # the kernel refused a new mapping: read as before
            return None
        if buffer is None:
            return None
        tensor = None
        try:
            got = self.storage.read_direct(self._full(relpath), buffer[:read_span(entry.size)])
            if got == entry.size and crc_hex(_crc32c.crc32c(buffer[:got])) == entry.crc32c:
                raw, name = torch.frombuffer(buffer[:got], dtype=torch.uint8), self.where(relpath)
                tensor = self._unpickled(relpath, lambda: xser.load_tensor_in_place(raw, trusted=self.trusted,
                                                                                    name=name))
        except OSError:
            pass        # missing, or direct reads refused: load_tensor's read names what is wrong, or reads it
        finally:
            if not isinstance(tensor, torch.Tensor):
                buffers.give_back(buffer)
        return (tensor, buffer) if isinstance(tensor, torch.Tensor) else None

    def _load_tensor_mapped(self, relpath: str) -> Optional[torch.Tensor]:
        """A large local tensor file memory-mapped: verified in the same pass when the manifest lists it
        (``_read_tensor_mapped``); as it is when there is no manifest (nothing to verify against). None when
        that does not apply (an object store, a small file) or the file does not verify; load_tensor then
        reads the bytes and names the damage."""
        entry = self.manifest.files.get(relpath) if self.manifest is not None else None
        if self.manifest is not None and (entry is None or entry.size < MAPPED_MIN_BYTES):
            return None
        try:
            with self.storage.open_local(self._full(relpath)) as local:
                if local is None:
                    return None
                if entry is None:
                    if local.size < MAPPED_MIN_BYTES:
                        return None
                    return xser.read_tensor(local.path, trusted=self.trusted, name=self.where(relpath), mmap=True)
                return _read_tensor_mapped(local, entry, self.trusted, self.where(relpath))
        except xser.UnsafeCheckpointError as exc:
            raise UnsafeCheckpointError(str(exc), path=self.where(relpath)) from None
        except Exception:  # noqa: BLE001 - any doubt: the byte-exact path decides and explains
            return None


#: Whether a large plain shard on an object store is used while it downloads (``read_plain_pipelined``: records
#: checked and tensors sent to the device as each ranged GET lands) instead of after (``read_pickle_bytes``).
#: Off: on the 2-core loopback test machine it did not pay consistently (A/B runs from 0.3 s faster to 0.5 s slower
#: per 0.25 GB, README "S3"); to be measured again on Trainium against S3 (``scripts/ab_s3load.py``).
PIPELINE_PLAIN_SHARDS = False

#: Smaller tensor files (Adam's ``step``, biases) are read into memory: a mapping is not worth it, and
#: optimizers keep some small host tensors (``step``) as loaded.
MAPPED_MIN_BYTES = 1 << 20


def _read_tensor_mapped(local: LocalFile, entry: FileEntry, trusted: bool, name: str) -> Optional[torch.Tensor]:
    """The tensor of a one-tensor torch.save file held open (``Storage.open_local``), backed by a private
    mapping of the file (``torch.load(mmap=True)``), verified against the manifest ``entry``: size, and
    CRC32C over the bytes before the data record, the mapped storage itself (this pass pages the file in)
    and the bytes after it. None when the layout is not that (not exactly one data record) or the checksum
    differs.

    The host-to-device copy then reads the page cache directly: no ``bytes`` copy of the file, no second
    copy while deserialising, no freshly faulted anonymous memory. On the XLA CPU device (2 cores) a cold
    1 GB load in 300 tensors took 1.0 s of CPU instead of 1.9 s, and 0.9-1.1 s instead of 1.4-1.7 s.
    Checkpoint files are immutable once committed (written to a temporary name and renamed), so the
    bytes verified are the bytes transferred; a file removed meanwhile stays readable through the map.
    """
    size = local.size
    if size != entry.size:
        return None
    zip_reader = torch._C.PyTorchFileReader(local.path)
    records = [r for r in zip_reader.get_all_records() if r.startswith("data/")]
    if len(records) != 1:
        return None
    offset = zip_reader.get_record_offset(records[0])
    del zip_reader
    tensor = xser.read_tensor(local.path, trusted=trusted, name=name, mmap=True)
    if not isinstance(tensor, torch.Tensor) or tensor.device.type != "cpu":
        return None
    storage = tensor.untyped_storage()
    nbytes = storage.nbytes()
    if offset + nbytes > size:
        return None
    body = torch.empty(0, dtype=torch.uint8).set_(storage)
    crc = _crc32c.crc32c(local.pread(offset, 0))
    crc = _crc32c.crc32c(body.numpy(), crc)
    crc = _crc32c.crc32c(local.pread(size - offset - nbytes, offset + nbytes), crc)
    return tensor if crc_hex(crc) == entry.crc32c else None


@dataclass
class ShardRead:
    """Phase one of reading a shard: the ref data and the tensors this rank read itself."""

    relpath: str
    ref_data: object
    tids: List[int]
    owner_of: Dict[int, int]                     # tid -> global rank that reads it
    info: Optional[dict]
    tensors: Dict[int, torch.Tensor] = field(default_factory=dict)
    replicas: List[int] = field(default_factory=list)
    # tid -> the sorted ranks that hold the same tensor and share its read (the shard's replicas; for a
    # non-expert tensor of an expert-parallel shard, every EP rank's replicas as well).
    group_of: Dict[int, Tuple[int, ...]] = field(default_factory=dict)
    # A plain (non-xser) shard is one pickle: one replica reads it and ships its verified bytes.
    raw_owner: Optional[int] = None
    raw: Union[bytes, torch.Tensor, None] = None       # the owner's verified bytes (a uint8 tensor: read_buffer)
    parse: Optional[Callable[[object], object]] = None
    absent: List[int] = field(default_factory=list)   # tids without a tensor file (filled by the caller)


def read_plain_pipelined(reader: FileReader, relpath: str, live=None,
                         batch_bytes: Optional[int] = None) -> Tuple[object, List[int], Dict[int, torch.Tensor]]:
    """A plain shard that ``reader.pipelines``, used while it downloads: its parallel ranged GETs fill one host
    buffer (the same requests as ``read_buffer``) and, as each range lands, the zip records it completes are
    checked against the manifest's CRC32C, the pickle is unpickled once its record is in (safely unless trusted),
    and the tensors of each checked record are handed, in batches of about ``batch_bytes``, to a host-to-device
    transfer to their targets' XLA devices (``live``, as in ``read_tensors``) while the other ranges download.
    Blocks until the file is in; the download runs on one thread of its own (its requests on the bucket's pool).

    Returns (ref_data, tids, tid -> tensor on its device or a view of the host buffer). A damaged or truncated
    file raises CorruptCheckpointError naming it after the download ended and before anything is returned:
    nothing is applied (what was moved are new device buffers, dropped with the error)."""
    entry, full, where = reader.entry(relpath), reader._full(relpath), reader.where(relpath)
    batch_bytes = PLACE_BATCH_BYTES if batch_bytes is None else batch_bytes
    buf = torch.empty(entry.size + 1, dtype=torch.uint8)     # one byte more: a longer file shows
    pipe = plainpipe.RecordPipe(buf, entry, where, reader.hint, lambda pkl: reader._unpickled(
        relpath, lambda: xser.unpickle_meta(pkl, trusted=reader.trusted, name=where)))
    landed: "queue.Queue[tuple]" = queue.Queue()
    _END = object()

    def download() -> None:
        try:
            n = reader.storage.read_into(full, memoryview(buf.numpy()), 0, lambda a, b: landed.put((a, b)))
            landed.put((_END, n))
        except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread
            landed.put((_END, exc))

    thread = threading.Thread(target=download, name="nxd-ckpt-plain-get", daemon=True)
    thread.start()
    out: Dict[int, torch.Tensor] = {}
    batch: List[Tuple[int, torch.Tensor]] = []
    targets: Optional[Dict[int, torch.device]] = None
    try:
        while True:
            start, end = landed.get()    # the download thread always ends with _END; its requests have deadlines
            if start is _END:
                break
            for tid, t in pipe.landed(start, end):
                if targets is None:
                    targets = targets_by_tid(pipe.ref_data, live)
                if tid in targets:
                    batch.append((tid, t))
                else:
                    out[tid] = t
            if sum(t.nbytes for _, t in batch) >= batch_bytes:
                out.update(_to_device(batch, targets))
                batch = []
    finally:
        thread.join()
    if isinstance(end, (FileNotFoundError, IsADirectoryError, NotADirectoryError)):
        raise reader._corrupt(relpath, "is missing") from None
    if isinstance(end, BaseException):
        raise end
    problem = entry.mismatch(end if end <= entry.size else reader.storage.size(full), None)
    if problem is not None:
        raise reader._corrupt(relpath, problem)
    pipe.finish()
    if not pipe.usual:        # a layout the pipe does not build (big-endian records): the whole file, verified
        ref_data, tensors = xser.to_refs(reader.parse_pickle(relpath, buf[:entry.size]))
        return ref_data, list(range(len(tensors))), dict(enumerate(tensors))
    out.update(_to_device(batch, targets or {}))
    return pipe.ref_data, pipe.tids, out


#: read_shard's ``skip`` for "no tensor file of this shard exists"
ALL = object()


def read_shard(reader: FileReader, relpath: str, replicas: List[int], rank: int, pool: ThreadPoolExecutor,
               cooperative: bool, xser_shard: bool = True, home_replicas: Optional[List[int]] = None,
               skip=(), home_of=layout.tensor_home, live=None, workers: int = 8) -> ShardRead:
    """Read the ref (and info) of a shard and this rank's share of its tensors (all of them when the
    replicas cannot cooperate: no info file, or no process group). A plain shard is read by one replica
    only (chosen by the file's name, so model and optimizer shards go to different replicas).

    ``home_replicas``: the ranks whose shards keep their non-expert tensors in the same folder as this one
    (``home_of``: ``layout.tensor_home``, all EP ranks of an expert-parallel shard; ``layout.own_home`` for the
    legacy EP layout), who share reading them. The ``skip`` tids (``ALL``: every one) have no tensor file:
    they are listed in ``absent``, for the caller to fill (avoid_saving_lower_precision_weights).

    ``live``: the state the shard will replace (``targets_by_tid``); the tensors this rank reads alone go to
    their targets' XLA devices while the reads go on (``read_tensors``, ``workers`` reads in flight)."""
    if cooperative and not xser_shard and len(replicas) > 1:
        owner = replicas[zlib.crc32(relpath.encode()) % len(replicas)]
        shard = ShardRead(relpath, None, [], {}, None, replicas=list(replicas), raw_owner=owner,
                          parse=lambda data: reader.parse_pickle(relpath, data))
        if rank == owner:
            shard.raw = reader.read_pickle_bytes(relpath)
            shard.ref_data = shard.parse(shard.raw)
        return shard
    if not xser_shard and not skip and reader.pipelines(relpath):
        ref_data, tids, tensors = read_plain_pipelined(reader, relpath, live)
        return ShardRead(relpath, ref_data, tids, {t: rank for t in tids}, None, tensors, [rank],
                         {t: (rank,) for t in tids})
    ref_data = reader.load_pickle(relpath)
    every = sorted(xser.collect_tids(ref_data))
    tids = [] if skip is ALL else [t for t in every if t not in skip]
    kept = set(tids)
    absent = [t for t in every if t not in kept]
    info = shard_info(reader, relpath, tids) if every else None
    complete = info is not None and all(t in info for t in tids)
    # Without .info.pt (NxD <= 0.6) nothing says which tensors are experts: each lives in its own folder.
    expert = {t: layout.is_expert(info[t]) if complete else True for t in tids}
    homes = {e: home_of(relpath, e) for e in (False, True)}    # once per shard, not per tensor
    home = {t: homes[expert[t]] for t in tids}
    if cooperative and complete:
        group_of = {t: tuple(sorted(replicas if expert[t] else (home_replicas or replicas))) for t in tids}
        owner_of = {}
        for group in set(group_of.values()):
            members = [t for t in tids if group_of[t] == group]
            bins = assign_to_bins([_info_nbytes(info[t]) for t in members], len(group))
            owner_of.update({members[i]: group[b] for b, idxs in enumerate(bins) for i in idxs})
    else:
        owner_of = {t: rank for t in tids}
        group_of = {t: (rank,) for t in tids}
        replicas = [rank]
    mine = [t for t in tids if owner_of[t] == rank]
    alone = {t: dev for t, dev in targets_by_tid(ref_data, live).items() if group_of.get(t) == (rank,)}
    tensors = read_tensors(reader, {t: layout.tensor_path(home[t], t) for t in mine}, pool, workers, alone)
    return ShardRead(relpath, ref_data, tids, owner_of, info, tensors, list(replicas), group_of, absent=absent)


def shard_info(reader: FileReader, relpath: str, tids: List[int]) -> Optional[dict]:
    """The shard's tensor metadata as its ``.info.pt`` holds it ({tid: {dtype, shape, expert_model_parallel,
    partition attributes}}): from the manifest when it records the dtype and shape of every tensor of ``tids``
    (parsed and verified already: no file read, and no safe unpickling of an entry per tensor, which took
    0.14 CPU-s and 0.25 s before the first tensor read for 5,000 tensors), else from the ``.info.pt`` file
    (verified), None when the shard has neither (NxD <= 0.6)."""
    info = _info_from_manifest(reader.manifest, relpath)
    if info is not None and all(t in info for t in tids):
        return info
    return reader.info(relpath)


def _info_from_manifest(manifest: Optional[Manifest], relpath: str) -> Optional[dict]:
    """``.info.pt``'s entries (``manifest.info_entry``, as the save writes them) from the manifest's tensor
    records of the shard; None when it has none, or one the file would say better (an unknown dtype name)."""
    meta = manifest.tensors.get(relpath) if manifest is not None else None
    if not meta:
        return None
    info = {}
    for tid, m in meta.items():
        entry = info_entry(m.dtype, m.shape, m.attrs)
        if entry is None or not tid.isdigit():
            return None
        info[int(tid)] = entry
    return info


#: The load pipeline's host-to-device batches: large enough that a transfer call costs little per byte, small
#: enough that the host holds little more than the files being read.
PLACE_BATCH_BYTES = 64 << 20


#: torch's intra-op threads of the loading thread while its pipeline runs (None: left as they are). torch-xla's
#: host-to-device copy runs OpenMP regions whose threads busy-wait for cores the readers need: in a profile of a
#: 0.5 GB / 5,000-tensor load on 2 cores, 47% of the process's CPU samples were in libgomp; with one thread,
#: 3.99 against 6.61 CPU-s/GB and 1.94 against 2.81 s (README "Load: the read pipeline").
PIPELINE_INTRAOP_THREADS: Optional[int] = 1


@contextlib.contextmanager
def pipeline_threads():
    """For the block (the read pipelines of a load, on the loading thread): torch's intra-op threads set to
    PIPELINE_INTRAOP_THREADS, then restored for the calling thread. ``torch.set_num_threads`` also sets torch's
    process-wide default, which a thread reads once, on its first parallel operation: another thread whose first
    one falls inside the block keeps PIPELINE_INTRAOP_THREADS (threads that used torch before keep theirs)."""
    n, before = PIPELINE_INTRAOP_THREADS, torch.get_num_threads()
    if n is None or n >= before:
        yield
        return
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def read_tensors(reader: FileReader, jobs: Dict[int, str], pool: ThreadPoolExecutor, workers: int,
                 targets: Optional[Dict[int, torch.device]] = None,
                 batch_bytes: Optional[int] = None) -> Dict[int, torch.Tensor]:
    """The load pipeline of one rank: the tensor files ``jobs`` (tid -> path in the tag), largest first, at most
    ``2 * workers`` tasks in flight on ``pool`` (a task: one file, or a group of small files, ``read_groups``,
    prefetched on this thread as it is handed out), each file verified (size, CRC32C) on the bytes as read. A
    tensor whose tid is in ``targets`` (tid -> XLA device) is handed, once read, to a host-to-device transfer of
    about ``batch_bytes`` that runs on this thread while the reads go on, and its host copy is dropped: the host
    holds the files in flight plus one batch, not the shard (``batch_bytes`` None: PLACE_BATCH_BYTES). tid ->
    tensor (on its device, or on the host).

    The first failure (damage, a missing file) stops further reads and is raised naming the file; nothing has
    been changed (what was moved are new device buffers, dropped with the error)."""
    targets = targets or {}
    batch_bytes = PLACE_BATCH_BYTES if batch_bytes is None else batch_bytes
    entries = reader.manifest.files if reader.manifest is not None else {}
    sizes = {t: entries[jobs[t]].size if jobs[t] in entries else None for t in jobs}
    order = sorted(jobs, key=lambda t: -(sizes[t] or 0))
    out: Dict[int, torch.Tensor] = {}
    buffers = ReadBuffers() if targets else None       # used where the storage reads direct
    moving = _Batch(targets, batch_bytes, out, buffers)
    pending: Dict[int, Future] = {}
    groups = read_groups(order, sizes)
    todo = enumerate(groups)
    done_groups = 0
    # Each task reports to this queue: one get per task here, instead of a futures.wait() that locks and
    # unlocks every future in flight per completion (about 18 us of this thread's CPU per file, 0.5 GB / 5,000).
    finished: "queue.SimpleQueue[Tuple[int, List[_Read], Optional[BaseException]]]" = queue.SimpleQueue()

    def read(key: int, group: Tuple[int, ...]) -> None:
        done: List[_Read] = []
        try:
            for tid in group:
                direct = reader.load_tensor_direct(jobs[tid], buffers) if tid in targets else None
                done.append((tid, *direct) if direct else (tid, reader.load_tensor(jobs[tid]), None))
            finished.put((key, done, None))
        except BaseException as exc:  # noqa: BLE001 - raised on the calling thread below
            finished.put((key, done, exc))

    def submit() -> None:
        for key, group in itertools.islice(todo, max(0, 2 * max(1, workers) - len(pending))):
            if PREFETCH_GROUPS and len(group) > 1:
                reader.prefetch([jobs[tid] for tid in group])
            pending[key] = pool.submit(read, key, group)

    try:
        submit()
        while pending:
            key, done, error = finished.get()
            del pending[key]
            done_groups += 1
            if error is not None:
                raise error
            submit()
            for tid, tensor, buffer in done:
                if tid in targets:
                    moving.add(tid, tensor, buffer)
                else:
                    out[tid] = tensor
            # Every read handed out: what is in moves while the last reads run, not as one batch after them.
            if moving.items and TAIL_FLUSH and done_groups + len(pending) == len(groups):
                moving.flush()
        moving.flush()
    except BaseException:
        for fut in pending.values():
            fut.cancel()
        raise
    finally:
        if buffers is not None:
            buffers.close()
    return out


# A read of the pipeline: (tid, tensor, the ReadBuffers buffer it views or None).
_Read = Tuple[int, torch.Tensor, Optional[memoryview]]


class _Batch:
    """The pipeline's tensors read and not yet on their devices: moved into ``out`` by one ``_to_device`` call
    once they reach ``limit`` bytes (and by ``flush``), so the host holds at most about one batch of them. The
    direct-read buffers they view go back to ``buffers`` once moved: torch-xla's transfer has copied them."""

    def __init__(self, targets: Dict[int, torch.device], limit: int, out: Dict[int, torch.Tensor],
                 buffers: Optional[ReadBuffers] = None):
        self.targets, self.limit, self.out, self.buffers = targets, limit, out, buffers
        self.items: List[Tuple[int, torch.Tensor]] = []
        self.viewed: List[memoryview] = []
        self.held = 0

    def add(self, tid: int, tensor: torch.Tensor, buffer: Optional[memoryview] = None) -> None:
        self.items.append((tid, tensor))
        if buffer is not None:
            self.viewed.append(buffer)
        self.held += tensor.nbytes
        if self.held >= self.limit:
            self.flush()

    def flush(self) -> None:
        self.out.update(_to_device(self.items, self.targets))
        self.items, self.held = [], 0
        for buffer in self.viewed:
            self.buffers.give_back(buffer)
        self.viewed = []


#: A group of small files is prefetched as it is handed out (``FileReader.prefetch``, on the loading thread): the
#: kernel reads the files of the 2 x num_workers groups in flight while the readers work, instead of each reader
#: waiting on the disk for one file at a time (A/B knob; README "Load: the read pipeline").
PREFETCH_GROUPS = True

#: The pipeline's last reads: each finished one moved to its device at once (A/B knob).
TAIL_FLUSH = True


#: Tensor files smaller than this are read in groups of up to this many bytes, one pool task per group: one hand-out
#: and one wake-up of the loading thread per group instead of per file (README "Load: the read pipeline").
GROUP_BYTES = 1 << 20


def read_groups(order: List[int], sizes: Dict[int, Optional[int]]) -> List[Tuple[int, ...]]:
    """``order`` (tids, largest first) cut into read tasks: a file of GROUP_BYTES or more (or of unknown size) alone,
    consecutive smaller files together up to GROUP_BYTES."""
    out: List[Tuple[int, ...]] = []
    group: List[int] = []
    held = 0
    for tid in order:
        size = sizes[tid]
        if size is None or size >= GROUP_BYTES:
            out.append((tid,))
            continue
        if group and held + size > GROUP_BYTES:
            out.append(tuple(group))
            group, held = [], 0
        group.append(tid)
        held += size
    if group:
        out.append(tuple(group))
    return out


def _to_device(batch: List[Tuple[int, torch.Tensor]], targets: Dict[int, torch.device]) -> Dict[int, torch.Tensor]:
    """One batched host-to-device transfer per device (``xm.send_cpu_data_to_device``) of a pipeline batch."""
    by_device: Dict[torch.device, List[Tuple[int, torch.Tensor]]] = {}
    for tid, t in batch:
        by_device.setdefault(targets[tid], []).append((tid, t))
    out = {}
    for device, items in by_device.items():
        import torch_xla.core.xla_model as xm

        moved = xm.send_cpu_data_to_device([t for _, t in items], device)
        out.update((tid, m) for (tid, _), m in zip(items, moved))
    return out


def targets_by_tid(ref_data, live) -> Dict[int, torch.device]:
    """tid -> the XLA device of the tensor that ``live`` (the state dict, or optimizer state dict, a shard will
    replace; None: unknown) holds at that reference's place in ``ref_data``: where the loaded tensor will go.
    Tensors whose target is not on an XLA device (or not found) are not listed: they stay on the host."""
    out: Dict[int, torch.device] = {}

    def walk(ref, cur) -> None:
        if xser.is_ref(ref):
            if isinstance(cur, torch.Tensor) and cur.device.type == "xla":
                out.setdefault(ref.tid, cur.device)
        elif isinstance(ref, dict) and isinstance(cur, dict):
            for k, v in ref.items():
                if k in cur:
                    walk(v, cur[k])
        elif isinstance(ref, (list, tuple)) and isinstance(cur, (list, tuple)) and len(ref) == len(cur):
            for a, b in zip(ref, cur):
                walk(a, b)

    if live is not None:
        walk(ref_data, live)
    return out


def _info_nbytes(entry: dict) -> int:
    n = 1
    for d in entry["shape"]:
        n *= int(d)
    return n * torch.empty((), dtype=entry["dtype"]).element_size()


def share_shard(shard: ShardRead, host_groups: Dict[Tuple[int, ...], object]) -> None:
    """Phase two: every replica receives the tensors it did not read, from their readers. ``host_groups``
    maps sorted rank tuples to gloo groups. Groups are served in one global order (sorted rank tuples),
    so ranks that share several groups never wait on each other in a cycle."""
    if shard.raw_owner is not None:
        if len(shard.replicas) > 1:
            _share_raw(shard, host_groups[tuple(sorted(shard.replicas))])
        return
    for group in sorted(set(shard.group_of.values())):
        if len(group) <= 1:
            continue
        for tid in (t for t in shard.tids if shard.group_of[t] == group):
            src = shard.owner_of[tid]
            if tid in shard.tensors:
                t = shard.tensors[tid].contiguous()
                shard.tensors[tid] = t
            else:
                e = shard.info[tid]
                t = torch.empty(tuple(e["shape"]), dtype=e["dtype"])
                shard.tensors[tid] = t
            hostgroups.broadcast_tensor(t, src, host_groups[group])


def _share_raw(shard: ShardRead, group) -> None:
    size = torch.tensor([len(shard.raw) if shard.raw is not None else 0], dtype=torch.int64)
    hostgroups.broadcast_tensor(size, shard.raw_owner, group)
    if isinstance(shard.raw, torch.Tensor):
        body, shard.raw = shard.raw, None     # the owner's tensors are views of it: sent as it is
    elif shard.raw is not None:
        with warnings.catch_warnings():   # the bytes are only sent, never written: no copy needed
            warnings.filterwarnings("ignore", message="The given buffer is not writable")
            body = torch.frombuffer(shard.raw, dtype=torch.uint8) if shard.raw else torch.empty(0, dtype=torch.uint8)
        shard.raw = None
    else:
        body = torch.empty(int(size.item()), dtype=torch.uint8)
    hostgroups.broadcast_tensor(body, shard.raw_owner, group)
    if shard.ref_data is None:
        shard.ref_data = shard.parse(body)   # its tensors are views of the received bytes: 1x, not 2x


def resolve(shard: ShardRead):
    """The shard's data with every reference replaced by its tensor; top-level entries whose tensor is
    absent (never filled) are left out."""
    gone = object()
    data = xser.from_refs(shard.ref_data, lambda tid: shard.tensors.get(tid, gone))
    if isinstance(data, dict):
        data = type(data)((k, v) for k, v in data.items() if v is not gone)
    return data
