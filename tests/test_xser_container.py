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
    monkeypatch.setattr(container, "_template_state", [])  # (so the direct writer is not learnt either)
    buf = io.BytesIO()
    xser.write_tensor(t, buf)
    assert any(crc != 0 for _, crc, _, _ in _local_headers(buf.getvalue()))
    assert torch.equal(torch.load(io.BytesIO(buf.getvalue()), weights_only=True), t)


def _torch_writer_bytes(t: torch.Tensor) -> bytes:
    buf = io.BytesIO()
    container.save(t, buf)                  # torch's own writer (private PyTorchFileWriter, CRC off)
    return buf.getvalue()


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_direct_writer_bytes_equal_torch_writer_for_every_dtype_shape_and_stride(dtype):
    shapes = [(), (1,), (7,), (5, 3), (2, 3, 4), (300, 301), (70000,), (3, 1 << 16)]
    direct = total = 0
    for i, shape in enumerate(shapes):
        t = random_tensor(dtype, shape, seed=i)
        for v in ([t, t.t(), t.permute(1, 0)] if t.dim() == 2 else [t]):
            v = xser.compact_cpu(v)
            mine = io.BytesIO()
            container.write_tensor(v, mine)
            assert mine.getvalue() == _torch_writer_bytes(v), (dtype, shape, v.stride())
            parts = xser.tensor_parts(v)      # what Storage.write_parts writes: the same bytes, data not copied
            if parts is not None:
                assert b"".join(parts) == mine.getvalue() and parts[1].obj is not None
                direct += 1
            total += 1
    # the legacy-typed dtypes take the direct path (the test is not vacuous); the newer ones (pickled through
    # an untyped storage) go to torch's writer
    legacy = dtype in torch.storage._dtype_to_storage_type_map() and dtype not in torch.storage._new_dtypes()
    assert direct == (total if legacy else 0)


def test_direct_writer_large_tensor_is_written_in_three_parts_and_loads(tmp_path):
    t = torch.randn(600_000)                                   # 2.4 MB: above the single-write size
    writes = []

    class Sink(io.BytesIO):
        def write(self, data):
            writes.append(len(data))
            return super().write(data)

    out = Sink()
    container.write_tensor(t, out)
    assert len(writes) == 3 and writes[1] == t.numel() * 4
    assert out.getvalue() == _torch_writer_bytes(t)
    path = tmp_path / "t.pt"
    path.write_bytes(out.getvalue())
    assert_bit_equal(t, torch.load(path, weights_only=True, mmap=True), "mmap")
    small = Sink()
    writes.clear()
    container.write_tensor(torch.ones(10), small)
    assert len(writes) == 1


def test_direct_writer_leaves_unusual_tensors_to_torch(monkeypatch):
    monkeypatch.setattr(container, "FAST_MAX_BYTES", 1000)
    big = torch.randn(1000)                                     # 4000 bytes: over the (patched) limit
    assert container._template().parts(big) is None
    assert container._template().parts(torch.zeros(0)) is None  # no bytes: torch writes no data record id
    assert container._template().parts(torch.randn(10)[2:]) is None       # a view into a larger storage
    param = torch.nn.Parameter(torch.randn(3))
    assert container._template().parts(param) is None                     # a subclass
    for t in (big, torch.zeros(0), param.detach()):
        mine = io.BytesIO()
        container.write_tensor(t, mine)
        assert mine.getvalue() == _torch_writer_bytes(t)


def test_direct_writer_is_not_used_when_its_self_check_fails(monkeypatch):
    real = container._Template.parts
    monkeypatch.setattr(container._Template, "parts",
                        lambda self, t: (lambda p: p and (p[0] + b"!", p[1], p[2]))(real(self, t)))
    monkeypatch.setattr(container, "_template_state", [])
    assert container._template() is None                        # relearnt, failed the byte check
    t = torch.randn(5)
    mine = io.BytesIO()
    container.write_tensor(t, mine)
    assert mine.getvalue() == _torch_writer_bytes(t)
