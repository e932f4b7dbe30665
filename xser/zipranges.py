"""The CRC32C of each zip record of a ``torch.save`` file, taken as the file is written.

A ``torch.save`` file is a zip of uncompressed records, each a local header (30 bytes, the name, torch's
alignment padding), the data and a data descriptor, followed by the central directory and end records. A reader
that needs a few tensors reads a few records (``xser.open_lazy``); with a checksum per record it can verify just
those instead of the whole file. ``RecordSums`` is a pass-through writable file object for ``torch.save``: it
takes the CRC32C of every record (local header + data; the 16-byte data descriptors, which no reader here uses, are
left out) and of the tail (central directory to the end) as the bytes go by, so no byte is read back.

torch's writer issues one write per local header, name, padding, data and descriptor; a record starts at a write
of a local header and ends at its data descriptor (an empty tensor's, whose header gives its sizes, has none); the
tail starts at a central-directory entry. Headers and descriptors are recognised only where they can be (between
records; a descriptor names the size of the data written since its header), as a tensor's data may start with any
bytes, and the tail is kept only up to ``TAIL_MAX`` bytes. The boundaries are then checked against the file's own
central directory; anything unexpected (another writer, another torch, a tail over the bound) gives no ranges
(None), logged once at warning level, and a reader then checks the whole file instead.
"""
from __future__ import annotations

import io
import logging
import struct
import zipfile
from typing import List, Optional, Tuple

import crc32c as _crc32c

from .pickling import RangeFile

_LOCAL = b"PK\x03\x04"
_CENTRAL = b"PK\x01\x02"
_DESCRIPTOR = b"PK\x07\x08"
_LOCAL_SIZE = 30
#: the most tail (central directory and end records, ~100 bytes per record) kept in memory before giving up
TAIL_MAX = 16 << 20

log = logging.getLogger("nxd_ckpt")

#: (offset, length, CRC32C) of one checksummed byte range of the file
Range = Tuple[int, int, int]


class RecordSums(io.RawIOBase):
    """Writes through to ``f``; ``ranges()`` after the last write gives the records' checksums (see the module
    docstring). Single thread (one file)."""

    def __init__(self, f, name: Optional[str] = None):
        super().__init__()
        self._f = f
        self._name = name or getattr(f, "name", None) or "a torch.save file"
        self._logged = False
        self._pos = 0
        self._records: List[List[int]] = []      # [offset, length, crc, data offset, end or -1]
        self._open: Optional[List[int]] = None
        self._tail: Optional[bytearray] = None
        self._tail_at = 0
        self._failed: Optional[str] = None        # why no ranges: the layout is not torch's, or the tail too big

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        self._f.write(data)
        mv = memoryview(data).cast("B")
        if self._failed is None:
            self._see(mv)
        self._pos += len(mv)
        return len(mv)

    def flush(self) -> None:
        pass

    def _see(self, mv: memoryview) -> None:
        if self._tail is not None:
            if len(self._tail) + len(mv) > TAIL_MAX:
                self._give_up(f"the central directory is over {TAIL_MAX} bytes")
            else:
                self._tail += mv
        elif self._open is None:
            self._between_records(mv)
        elif self._open[4] < 0 and self._is_descriptor(mv, self._pos - self._open[3]):
            self._open = None
        else:
            self._open[1] += len(mv)
            self._open[2] = _crc32c.crc32c(mv, self._open[2])
            if self._open[4] >= 0 and self._open[0] + self._open[1] >= self._open[4]:
                # sizes in the header (torch's empty records): no descriptor follows
                if self._open[0] + self._open[1] > self._open[4]:
                    self._give_up(f"a write runs past the end of the record at offset {self._open[0]}")
                self._open = None

    @staticmethod
    def _is_descriptor(mv: memoryview, data_len: int) -> bool:
        """A data descriptor naming the ``data_len`` (> 0) bytes written since the header, not data that starts
        like one."""
        if data_len <= 0 or len(mv) not in (16, 24) or bytes(mv[:4]) != _DESCRIPTOR:
            return False
        sizes = struct.unpack_from("<II" if len(mv) == 16 else "<QQ", mv, 8)
        return sizes == (data_len, data_len)

    def _between_records(self, mv: memoryview) -> None:
        head = bytes(mv[:4])
        if head == _LOCAL and len(mv) == _LOCAL_SIZE:
            flags, = struct.unpack_from("<H", mv, 6)
            size, = struct.unpack_from("<I", mv, 18)
            name_len, extra_len = struct.unpack_from("<HH", mv, 26)
            data_at = self._pos + _LOCAL_SIZE + name_len + extra_len
            # bit 3: sizes in a data descriptor after the data; else the record ends after ``size`` bytes of data
            end = -1 if flags & 0x08 else data_at + size
            self._open = [self._pos, len(mv), _crc32c.crc32c(mv), data_at, end]
            self._records.append(self._open)
        elif head == _CENTRAL:
            self._tail, self._tail_at = bytearray(mv), self._pos
        else:
            self._give_up(f"{len(mv)} bytes at offset {self._pos} outside any zip record")

    def _give_up(self, why: str) -> None:
        self._failed, self._tail, self._records, self._open = why, None, [], None

    def ranges(self) -> Optional[Tuple[Range, ...]]:
        """The records' and the tail's (offset, length, CRC32C), in file order; None when the bytes written do
        not have the expected layout (checked against the central directory)."""
        why = self._check()
        if why is not None:
            if not self._logged:
                self._logged = True
                log.warning("per-record checksums are off for %s (the file is checked whole instead): %s",
                            self._name, why)
            return None
        tail = bytes(self._tail)
        return tuple((r[0], r[1], r[2]) for r in self._records) + ((self._tail_at, len(tail), _crc32c.crc32c(tail)),)

    def _check(self) -> Optional[str]:
        """Why the records seen do not match the file's central directory, or None when they do."""
        if self._failed is not None:
            return self._failed
        if self._tail is None:
            return "no central directory was written"
        tail, at = bytes(self._tail), self._tail_at

        def read(offset: int, length: int) -> bytes:
            if offset < at:
                raise ValueError("outside the tail")
            return tail[offset - at:offset - at + length]

        try:
            infos = zipfile.ZipFile(RangeFile(read, self._pos)).infolist()
        except (zipfile.BadZipFile, ValueError, OSError, struct.error) as e:
            return f"its central directory does not parse ({e})"
        if len(infos) != len(self._records):
            return f"{len(infos)} entries in the central directory, {len(self._records)} records seen"
        ours = {r[0]: r for r in self._records}
        for info in infos:
            r = ours.get(info.header_offset)
            if r is None or info.compress_type != zipfile.ZIP_STORED or r[3] + info.file_size != r[0] + r[1]:
                return f"record {info.filename!r} is not where or as it was written"
        return None


__all__ = ["RecordSums", "Range"]
