"""The CRC32C of each zip record of a ``torch.save`` file, taken as the file is written.

A ``torch.save`` file is a zip of uncompressed records, each a local header (30 bytes, the name, torch's
alignment padding), the data and a data descriptor, followed by the central directory and end records. A reader
that needs a few tensors reads a few records (``xser.open_lazy``); with a checksum per record it can verify just
those instead of the whole file. ``RecordSums`` is a pass-through writable file object for ``torch.save``: it
takes the CRC32C of every record (local header + data; the 16-byte data descriptors, which no reader here uses, are
left out) and of the tail (central directory to the end) as the bytes go by, so no byte is read back.

torch's writer issues one write per local header, name, padding, data and descriptor; a record starts at a write
of a local header, the tail at the first central-directory entry. The boundaries are then checked against the
file's own central directory; anything unexpected (another writer, another torch) gives no ranges (None), and a
reader then checks the whole file instead.
"""
from __future__ import annotations

import io
import struct
import zipfile
from typing import List, Optional, Tuple

import crc32c as _crc32c

from .pickling import RangeFile

_LOCAL = b"PK\x03\x04"
_CENTRAL = b"PK\x01\x02"
_DESCRIPTOR = b"PK\x07\x08"
_LOCAL_SIZE = 30

#: (offset, length, CRC32C) of one checksummed byte range of the file
Range = Tuple[int, int, int]


class RecordSums(io.RawIOBase):
    """Writes through to ``f``; ``ranges()`` after the last write gives the records' checksums (see the module
    docstring). Single thread (one file)."""

    def __init__(self, f):
        super().__init__()
        self._f = f
        self._pos = 0
        self._records: List[List[int]] = []      # [offset, length, crc, data offset]
        self._open: Optional[List[int]] = None
        self._tail: Optional[bytearray] = None
        self._tail_at = 0
        self._stray = False                       # bytes outside any record: the layout is not torch's

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        self._f.write(data)
        mv = memoryview(data).cast("B")
        self._see(mv)
        self._pos += len(mv)
        return len(mv)

    def flush(self) -> None:
        pass

    def _see(self, mv: memoryview) -> None:
        if self._tail is not None:
            self._tail += mv
            return
        head = bytes(mv[:4])
        if head == _LOCAL and len(mv) == _LOCAL_SIZE:
            name_len, extra_len = struct.unpack_from("<HH", mv, 26)
            self._open = [self._pos, 0, 0, self._pos + _LOCAL_SIZE + name_len + extra_len]
            self._records.append(self._open)
        elif head == _DESCRIPTOR and len(mv) in (16, 24):
            self._open = None
            return
        elif head == _CENTRAL:
            self._open, self._tail, self._tail_at = None, bytearray(mv), self._pos
            return
        if self._open is None:
            self._stray = True
            return
        self._open[1] += len(mv)
        self._open[2] = _crc32c.crc32c(mv, self._open[2])

    def ranges(self) -> Optional[Tuple[Range, ...]]:
        """The records' and the tail's (offset, length, CRC32C), in file order; None when the bytes written do
        not have the expected layout (checked against the central directory)."""
        if self._stray or self._tail is None:
            return None
        tail, at = bytes(self._tail), self._tail_at

        def read(offset: int, length: int) -> bytes:
            if offset < at:
                raise ValueError("outside the tail")
            return tail[offset - at:offset - at + length]

        try:
            infos = zipfile.ZipFile(RangeFile(read, self._pos)).infolist()
        except (zipfile.BadZipFile, ValueError, OSError, struct.error):
            return None
        ours = {r[0]: r for r in self._records}
        if len(infos) != len(self._records):
            return None
        for info in infos:
            r = ours.get(info.header_offset)
            if r is None or info.compress_type != zipfile.ZIP_STORED or r[3] + info.file_size != r[0] + r[1]:
                return None
        return tuple((o, n, c) for o, n, c, _ in self._records) + ((at, len(tail), _crc32c.crc32c(tail)),)


__all__ = ["RecordSums", "Range"]
