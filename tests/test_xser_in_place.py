"""xser.load_pickle_in_place: a torch.save file held in a uint8 tensor loads with its tensors as views of it."""
from __future__ import annotations

import io
import os
import pickle

import pytest
import torch

import xser


def _buffer_of(obj, **save_kw) -> torch.Tensor:
    buf = io.BytesIO()
    torch.save(obj, buf, **save_kw)
    return torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)


def _inside(t: torch.Tensor, buffer: torch.Tensor) -> bool:
    start = buffer.untyped_storage().data_ptr()
    return start <= t.untyped_storage().data_ptr() < start + buffer.numel()


def test_tensors_are_views_of_the_buffer_and_bit_exact():
    shared = torch.randn(100, dtype=torch.float64)
    state = {"state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.randn(7, 5),
                           "mask": torch.tensor([True, False])}},
             "param_groups": [{"lr": 0.1, "params": [0]}], "a": shared, "a_view": shared[10:20],
             "bf16": torch.arange(6, dtype=torch.bfloat16)}
    buffer = _buffer_of(state)
    back = xser.load_pickle_in_place(buffer)
    for got, want in ((back["state"][0]["exp_avg"], state["state"][0]["exp_avg"]), (back["a"], shared),
                      (back["bf16"], state["bf16"]), (back["state"][0]["mask"], state["state"][0]["mask"])):
        assert got.dtype == want.dtype and torch.equal(got, want)
        assert _inside(got, buffer)
    assert back["state"][0]["step"].item() == 3.0 and back["param_groups"] == state["param_groups"]
    # storage sharing is kept, as torch.load keeps it
    assert back["a_view"].untyped_storage().data_ptr() == back["a"].untyped_storage().data_ptr()
    assert torch.equal(back["a_view"], shared[10:20])
    # writes go to the buffer (the caller owns it), not to some other copy
    back["a"][0] = 42.0
    assert back["a_view"].untyped_storage().data_ptr() == back["a"].untyped_storage().data_ptr()


def test_refs_files_keep_torch_xla_references():
    ref_data, tensors = xser.to_refs({"w": torch.ones(3), "n": 5})
    buf = io.BytesIO()
    xser.dump_refs(ref_data, buf)
    back = xser.load_pickle_in_place(torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8))
    assert isinstance(back["w"], xser.TensorReference) and back["w"].tid == 0 and back["n"] == 5


class _Evil:
    def __reduce__(self):
        return (os.system, ("true",))


def test_unsafe_pickle_is_refused_unless_trusted():
    buffer = _buffer_of({"x": _Evil(), "t": torch.ones(2)})
    with pytest.raises(xser.UnsafeCheckpointError) as info:
        xser.load_pickle_in_place(buffer, name="optim/dp_rank_00.pt")
    assert "optim/dp_rank_00.pt" in str(info.value) and "trusted=True" in str(info.value)


def test_corrupt_and_legacy_buffers():
    good = _buffer_of({"t": torch.arange(1000)})
    with pytest.raises(xser.CorruptFileError) as info:
        xser.load_pickle_in_place(good[:len(good) // 2].clone(), name="model/x.pt")
    assert "model/x.pt" in str(info.value)
    legacy = _buffer_of({"t": torch.arange(4)}, _use_new_zipfile_serialization=False)
    assert torch.equal(xser.load_pickle_in_place(legacy)["t"], torch.arange(4))     # read the ordinary way
    with pytest.raises(xser.CorruptFileError):
        xser.load_pickle_in_place(torch.frombuffer(bytearray(pickle.dumps([1], protocol=2) + b"junk"), dtype=torch.uint8))
