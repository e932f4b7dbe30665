"""The storage writer of `nxd-ckpt to-dcp` (``dcpio.write_dcp``): a torch.distributed.checkpoint StorageWriter
onto a ``Storage`` for a no-process-group ``dcp.save``, and ``Streamed``, a tensor it writes piece by piece.
Imported only when writing DCP (it imports torch.distributed.checkpoint)."""
from __future__ import annotations

import dataclasses
import logging
import pickle
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional, Tuple

import torch
from torch.distributed.checkpoint import StorageWriter
from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION, _StorageInfo
from torch.distributed.checkpoint.metadata import StorageMeta
from torch.distributed.checkpoint.planner import WriteItemType
from torch.distributed.checkpoint.storage import WriteResult

import xser

from .errors import CorruptCheckpointError
from .fullstate import TensorSource
from .storage import local as _local

log = logging.getLogger("nxd_ckpt")

#: writer threads: while one reads and joins the next tensor the other writes one (2 cores measured here)
WRITE_THREADS = 2


@dataclass
class Streamed:
    """A tensor the storage writer writes piece by piece (``TensorSource.pieces``) between its file's
    ``frame`` (``xser.tensor_frame``): the same bytes as the joined tensor's file, with each piece copied
    once (into the file) instead of twice (into the full tensor, then into the file), and no full tensor
    in memory."""

    src: TensorSource
    frame: Tuple[bytes, bytes]
    progress: Optional[Callable[[int], Any]]

    def write(self, f) -> None:
        f.write(self.frame[0])
        written = 0
        for piece in self.src.pieces():
            data = piece.contiguous().reshape(-1).view(torch.uint8).numpy()
            f.write(data)
            written += len(data)
            if self.progress is not None:
                self.progress(len(data))
            del piece, data
        if written != self.src.nbytes:
            raise CorruptCheckpointError(f"{self.src.name}: its pieces hold {written} bytes, its metadata says "
                                         f"{self.src.nbytes}")
        f.write(self.frame[1])


class DcpStorageWriter(StorageWriter):
    """Writes onto ``store`` (a POSIX directory or an object store prefix) what
    FileSystemWriter(single_file_per_rank=False) writes: one ``__0_N.distcp`` per entry (the tensor in
    torch.save's format, the bytes of a non-tensor entry) and the pickled ``.metadata``, so torch's
    FileSystemReader reads the result. One file per entry also bounds memory: each tensor is dropped once
    written. Differences, invisible to readers: the zip CRC-32 fields are 0 (xser.write_tensor: nothing reads
    them, our CRC32C covers every byte), each file's size and CRC32C are taken as it is written (``records``),
    files are made durable together by the caller (each file's writeback is started as soon as it is written:
    by the local sink where it does, ``Storage.starts_writeback``, else here with ``start_writeback``; a hint
    whose failure is logged), and ``.metadata`` is written in place (the caller's
    ``done`` marker is the commit, not a rename). A joined tensor, once written, goes back to ``pool`` (a
    fullstate.BufferPool) for the next one. Called by dcp.save in one process; ``write_data`` blocks until
    every file is written."""

    def __init__(self, store, checkpoint_id: str, pool=None):
        super().__init__()
        self.store, self.checkpoint_id, self.pool = store, checkpoint_id, pool
        self.records: Dict[str, Any] = {}
        self.save_id = str(uuid.uuid4())
        self._writeback: Optional[ThreadPoolExecutor] = None

    def reset(self, checkpoint_id=None) -> None:
        pass

    def set_up_storage_writer(self, is_coordinator: bool, *args, **kwargs) -> None:
        pass

    def prepare_local_plan(self, plan):
        return plan

    def prepare_global_plan(self, plans):
        return plans

    def _write(self, name: str, item, planner) -> WriteResult:
        data = planner.resolve_data(item)
        if isinstance(data, Streamed):
            produce = data.write
        elif item.type == WriteItemType.BYTE_IO:
            produce = lambda f: f.write(data.getbuffer())  # noqa: E731
        else:
            produce = lambda f: xser.write_tensor(data, f)  # noqa: E731
        rec = self.store.write_file(name, produce, durable=False, atomic=False)
        del produce
        # Hint only the files whose writeback the local sink has not started as it closed them (storage/local.py),
        # so no file is hinted twice.
        started = self.store.starts_writeback(rec.size)
        local = self.store.local_path(name) if self._writeback is not None and not started else None
        if local is not None:
            self._writeback.submit(_local.start_writeback, local).add_done_callback(_log_writeback_error(local))
        if isinstance(data, torch.Tensor) and self.pool is not None:
            self.pool.give_back(data)
        self.records[name] = rec
        return WriteResult(index=item.index, size_in_bytes=rec.size, storage_data=_StorageInfo(name, 0, rec.size))

    def write_data(self, plan, planner):
        # one thread starts the disk writing each finished file (a hint; the caller's sync is the
        # durability) while the writer threads go on
        try:
            with ThreadPoolExecutor(1, thread_name_prefix="to-dcp-writeback") as self._writeback, \
                    ThreadPoolExecutor(WRITE_THREADS, thread_name_prefix="to-dcp") as pool:
                futures = [pool.submit(self._write, f"__0_{i}.distcp", item, planner)
                           for i, item in enumerate(plan.items)]
                try:
                    results = [f.result() for f in futures]
                except BaseException:
                    for f in futures:
                        f.cancel()
                    raise
        finally:
            self._writeback = None
        done = torch.futures.Future()
        done.set_result(results)
        return done

    def finish(self, metadata, results) -> None:
        metadata = dataclasses.replace(metadata, version=CURRENT_DCP_VERSION)
        metadata.storage_data = {wr.index: wr.storage_data for rs in results for wr in rs}
        metadata.storage_meta = self.storage_meta()
        self.records[".metadata"] = self.store.write_file(".metadata", lambda f: pickle.dump(metadata, f),
                                                          durable=False, atomic=False)

    def storage_meta(self):
        return StorageMeta(checkpoint_id=self.checkpoint_id, save_id=self.save_id)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id) -> bool:
        return True


def _log_writeback_error(path: str) -> Callable[[Future], None]:
    """The writeback is a hint (the caller's final sync makes the files durable and reports write errors), so
    its failure is logged, not raised."""
    def done(fut: Future) -> None:
        exc = None if fut.cancelled() else fut.exception()
        if exc is not None:
            log.warning("starting the writeback of %s failed (the final sync still makes it durable): %r", path, exc)
    return done


__all__ = ["DcpStorageWriter", "Streamed", "WRITE_THREADS"]
