"""xser.load_tensor_in_place: one-tensor files read from a buffer give what torch.load gives, bit for bit, the
pickle's safe load reused for files whose pickle is identical, and the ordinary path for anything else."""
from __future__ import annotations

import io

import pytest
import torch

import xser
from xser import tensorfile


def _buffer(t) -> torch.Tensor:
    data = xser.tensor_to_bytes(t) if isinstance(t, torch.Tensor) and not t.requires_grad else _torch_save(t)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def _torch_save(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.bool, torch.float16])
def test_same_values_as_torch_load_and_the_second_file_reuses_the_layout(dtype, monkeypatch):
    g = torch.Generator().manual_seed(1)
    a, b = (torch.randn(33, 7, generator=g).mul(50).to(dtype) for _ in range(2))
    monkeypatch.setattr(tensorfile, "_layouts", {})
    calls = []
    original = tensorfile.load_pickle_in_place
    monkeypatch.setattr(tensorfile, "load_pickle_in_place", lambda *x, **k: (calls.append(1), original(*x, **k))[1])
    got_a = xser.load_tensor_in_place(_buffer(a))
    got_b = xser.load_tensor_in_place(_buffer(b))          # same dtype and shape: the remembered layout
    assert calls == [1]
    for want, got in ((a, got_a), (b, got_b)):
        assert got.dtype == want.dtype and got.shape == want.shape and got.stride() == want.stride()
        assert torch.equal(got.view(torch.uint8) if dtype != torch.bool else got, want.view(torch.uint8)
                           if dtype != torch.bool else want)


def test_views_and_0d_and_empty_tensors_round_trip(monkeypatch):
    monkeypatch.setattr(tensorfile, "_layouts", {})
    for t in (torch.tensor(3.5), torch.empty(0, 4), torch.arange(12.0).reshape(3, 4).t(), torch.arange(10)[3:7]):
        for _ in range(2):                                  # learned, then reused
            got = xser.load_tensor_in_place(_buffer(t))
            assert torch.equal(got, t) and got.shape == t.shape and got.dtype == t.dtype


def test_tensors_with_state_take_the_ordinary_path_and_keep_it(monkeypatch):
    monkeypatch.setattr(tensorfile, "_layouts", {})
    p = torch.nn.Parameter(torch.ones(4))
    for _ in range(2):
        got = xser.load_tensor_in_place(_buffer(p), trusted=True)
        assert isinstance(got, torch.nn.Parameter) and torch.equal(got, p)
    t = torch.zeros(3)
    t.tensor_model_parallel = True
    for _ in range(2):
        got = xser.load_tensor_in_place(torch.frombuffer(bytearray(_torch_save(t)), dtype=torch.uint8), trusted=True)
        assert getattr(got, "tensor_model_parallel", False) is True
    assert not tensorfile._layouts


def test_unsafe_pickle_is_refused_even_when_its_tensor_layout_is_known(monkeypatch):
    import os

    class Evil:
        def __reduce__(self):
            return (os.system, ("true",))

    monkeypatch.setattr(tensorfile, "_layouts", {})
    with pytest.raises(xser.UnsafeCheckpointError):
        xser.load_tensor_in_place(torch.frombuffer(bytearray(_torch_save(Evil())), dtype=torch.uint8))


def test_a_file_whose_frame_was_seen_is_read_without_parsing_its_directory(monkeypatch):
    g = torch.Generator().manual_seed(2)
    a, b = (torch.randn(40, 3, generator=g) for _ in range(2))
    # the same zip directory as a and b (record names, sizes and places), another pickle: not a's frame
    c = torch.randint(0, 1000, (80, 3), dtype=torch.int16, generator=g)
    assert tensorfile._directory(memoryview(_buffer(c).numpy())) == tensorfile._directory(memoryview(_buffer(a).numpy()))
    monkeypatch.setattr(tensorfile, "_layouts", {})
    monkeypatch.setattr(tensorfile, "_frames", {})
    parsed = []
    records = tensorfile.records
    monkeypatch.setattr(tensorfile, "records", lambda view: (parsed.append(1), records(view))[1])
    got = [xser.load_tensor_in_place(_buffer(t)) for t in (a, b, c, c)]
    assert len(parsed) == 2, "the second float and the second int file reuse their frames"
    for want, t in zip((a, b, c, c), got):
        assert t.dtype == want.dtype and t.shape == want.shape and torch.equal(t, want)


def test_files_with_a_zip_crc_are_not_remembered(monkeypatch):
    monkeypatch.setattr(tensorfile, "_layouts", {})
    monkeypatch.setattr(tensorfile, "_frames", {})
    for i in range(2):                                      # torch.save's files: a CRC-32 per record
        t = torch.full((5,), float(i))
        assert torch.equal(xser.load_tensor_in_place(torch.frombuffer(bytearray(_torch_save(t)), dtype=torch.uint8)), t)
    assert tensorfile._layouts and not tensorfile._frames
