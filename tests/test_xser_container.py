"""xser.container: tensor files in torch.save's format without the zip CRC-32, torch's settings untouched."""
from __future__ import annotations

import io
import struct
import zipfile

import pytest
import torch
import torch.utils.serialization as tus

import xser
from xser import container
from test_xser_support import ALL_DTYPES, assert_bit_equal, random_tensor

pytestmark = pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")


def _local_headers(data: bytes):
    """(name, crc32, size, data offset) of every record of a stored zip, from its central directory (zipfile
    only checks a CRC when a record is extracted)."""
    out = []
    with zipfile.ZipFile(io.BytesIO(data)) as zf:
        for info in zf.infolist():
            assert info.compress_type == zipfile.ZIP_STORED
            pos = info.header_offset
            assert data[pos:pos + 4] == b"PK\x03\x04"
            name_len, extra_len = struct.unpack_from("<HH", data, pos + 26)
            out.append((info.filename, info.CRC, info.file_size, pos + 30 + name_len + extra_len))
    return out


def test_bytes_equal_torch_save_with_crc_off_and_setting_untouched():
    t = torch.randn(1000, 7)
    assert tus.config.save.compute_crc32 is True
    mine = xser.tensor_to_bytes(t)
    assert tus.config.save.compute_crc32 is True          # the process-wide setting is never flipped
    buf = io.BytesIO()
    try:
        tus.config.save.compute_crc32 = False
        torch.save(t, buf)
    finally:
        tus.config.save.compute_crc32 = True
    assert mine == buf.getvalue()
    headers = _local_headers(mine)
    assert [h[0].split("/", 1)[1] for h in headers][:5] == ["data.pkl", ".format_version", ".storage_alignment",
                                                            "byteorder", "data/0"]
    assert all(crc == 0 for _, crc, _, _ in headers)
    # torch.save with its default setting does write CRCs: the difference is real
    ref = io.BytesIO()
    torch.save(t, ref)
    assert any(crc != 0 for _, crc, _, _ in _local_headers(ref.getvalue()))


def test_tensor_bytes_are_stored_verbatim_and_aligned():
    t = torch.arange(12345, dtype=torch.int32)
    data = xser.tensor_to_bytes(t)
    (name, _, size, start), = [h for h in _local_headers(data) if h[0].endswith("data/0")]
    assert start % 64 == 0 and size == t.numel() * 4
    assert data[start:start + size] == t.numpy().tobytes()


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_torch_load_reads_every_dtype_weights_only_and_mmap(tmp_path, dtype):
    t = random_tensor(dtype, (5, 3), seed=11)
    path = tmp_path / "t.pt"
    with open(path, "wb") as f:
        xser.write_tensor(t, f)
    assert_bit_equal(t, torch.load(path, weights_only=True), "weights_only")
    assert_bit_equal(t, torch.load(path, weights_only=True, mmap=True), "mmap")
    assert_bit_equal(t, xser.read_tensor(str(path), mmap=True), "xser mmap")


def test_torch_xla_loads_crc_free_files(tmp_path):
    import torch_xla.utils.serialization as txs

    data = {"w": torch.randn(64, 3), "b": torch.arange(5, dtype=torch.bfloat16), "n": 3}
    path = str(tmp_path / "m.pt")
    xser.save(data, path)
    assert all(crc == 0 for *_, crc, _, _ in
               [(None,) + h[1:] for h in _local_headers(open(xser.tensor_file(path, 0), "rb").read())])
    back = txs.load(path)
    assert back["n"] == 3
    assert_bit_equal(data["w"], back["w"], "w")
    assert_bit_equal(data["b"], back["b"], "b")


def test_path_destination_and_fallback_to_torch_save(tmp_path, monkeypatch):
    t = torch.randn(9)
    container.save(t, str(tmp_path / "a.pt"))
    assert torch.equal(torch.load(tmp_path / "a.pt", weights_only=True), t)
    monkeypatch.setattr(container, "_usable", False)     # a torch without the private writer
    buf = io.BytesIO()
    xser.write_tensor(t, buf)
    assert any(crc != 0 for _, crc, _, _ in _local_headers(buf.getvalue()))
    assert torch.equal(torch.load(io.BytesIO(buf.getvalue()), weights_only=True), t)
