"""The ref pickle's fast path (C pickler + torch-xla's GLOBAL patched in) writes the pure-Python pickler's bytes."""
import io
import sys
import types

import pytest
import torch

import xser
from xser import pickling
from xser.refs import TensorReference


def _slow_bytes(obj) -> bytes:
    """What the pure-Python pickler alone writes (the ref pickle before the fast path)."""
    slow = types.ModuleType("slow_ref_pickle")
    slow.Pickler = pickling._RefPickler
    buf = io.BytesIO()
    torch.save(obj, buf, pickle_module=slow)
    return buf.getvalue()


def _fast_bytes(obj) -> bytes:
    buf = io.BytesIO()
    xser.dump_refs(obj, buf)
    return buf.getvalue()


CASES = {
    "flat": {f"layer{i}.weight": TensorReference(i) for i in range(2500)},
    "nested": {"model": {"a": TensorReference(0), "b": [TensorReference(1), (TensorReference(2), 3.5)]},
               "optimizer": {"state": {0: {"step": 7, "exp_avg": TensorReference(3)}},
                             "param_groups": [{"lr": 1e-4, "betas": (0.9, 0.999), "params": [0, 1]}]},
               "inline": torch.arange(6, dtype=torch.float32).reshape(2, 3), "none": None, "s": "x" * 300},
    "repeated": [TensorReference(3), TensorReference(3)],
    "no_refs": {"a": 1, "t": torch.ones(3)},
    # a string holding our own GLOBAL opcode: the fast path must fall back, never patch the string
    "own_global_in_a_key": {"c" + "xser.refs\nTensorReference\n": TensorReference(0)},
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_fast_ref_pickle_is_byte_identical_and_loads(name, monkeypatch):
    obj = CASES[name]
    slow_calls = []
    real_slow = pickling._FastRefPickler._slow
    monkeypatch.setattr(pickling._FastRefPickler, "_slow", lambda self, o: slow_calls.append(1) or real_slow(self, o))
    fast = _fast_bytes(obj)
    assert len(slow_calls) == (1 if name == "own_global_in_a_key" else 0)
    assert fast == _slow_bytes(obj)
    back = xser.load_refs(io.BytesIO(fast))
    if name == "flat":
        assert back == obj
    if name == "own_global_in_a_key":
        assert list(back) == list(obj) and back[list(obj)[0]] == TensorReference(0)


class _HoldsStorage:
    """A custom object whose pickle holds a raw storage: only torch.save's persistent_id can write it."""

    def __init__(self):
        self.s = torch.arange(4, dtype=torch.int32).untyped_storage()


@pytest.mark.parametrize("obj", [{"x": _HoldsStorage(), "r": TensorReference(1)},
                                 [torch.ones(2).untyped_storage()], {"p": torch.nn.Parameter(torch.ones(2))}],
                         ids=["storage_in_object", "raw_storage", "parameter"])
def test_tensors_and_storages_anywhere_take_torch_saves_persistent_path(obj):
    """Without persistent_id a storage would be pickled by value (or fail): the fast path must notice it
    wherever it sits, and write what the pure-Python pickler writes."""
    assert _fast_bytes(obj) == _slow_bytes(obj)


def _persistent_id_calls(obj, pickle_module) -> int:
    """How often torch.save's own ``persistent_id`` (a Python function in torch/serialization.py) runs while
    saving ``obj``: counted by a profile hook, since torch.save's pickler subclass overrides any
    ``persistent_id`` a test's Pickler class would define."""
    calls = []

    def hook(frame, event, arg):
        code = frame.f_code
        if event == "call" and code.co_name == "persistent_id" and code.co_filename == torch.serialization.__file__:
            calls.append(1)

    old = sys.getprofile()
    sys.setprofile(hook)
    try:
        torch.save(obj, io.BytesIO(), pickle_module=pickle_module)
    finally:
        sys.setprofile(old)
    return len(calls)


def test_no_storage_pickle_never_calls_persistent_id():
    """The point of the fast path: torch.save's per-object persistent_id is not called for plain data (the
    pure-Python pickler, the same bytes, calls it once per object)."""
    slow = types.ModuleType("slow_ref_pickle")
    slow.Pickler = pickling._RefPickler
    assert _persistent_id_calls(CASES["flat"], slow) > len(CASES["flat"])
    assert _persistent_id_calls(CASES["flat"], xser.REF_PICKLE) == 0
    assert _fast_bytes(CASES["flat"]) == _slow_bytes(CASES["flat"])


def test_info_pickle_is_what_torch_save_writes():
    """``.info.pt`` built from the meta captured at call time (by a writer thread) holds exactly the bytes
    torch.save wrote from the tensors themselves."""
    from nxd_ckpt.capture import info_bytes, tensor_meta

    tensors = [torch.ones(3, 2), torch.zeros(4, dtype=torch.bfloat16), torch.tensor(5, dtype=torch.int64)]
    tensors[0].expert_model_parallel = True
    attrs = {"b": {"tensor_model_parallel": True, "partition_dim": 0, "partition_stride": 1}}
    meta = tensor_meta(tensors, {0: "a", 1: "b", 2: "c"}, attrs)
    expected = {0: {"dtype": torch.float32, "shape": torch.Size([3, 2]), "expert_model_parallel": True},
                1: {"dtype": torch.bfloat16, "shape": torch.Size([4]), "expert_model_parallel": False,
                    "tensor_model_parallel": True, "partition_dim": 0, "partition_stride": 1},
                2: {"dtype": torch.int64, "shape": torch.Size([]), "expert_model_parallel": False}}
    buf = io.BytesIO()
    torch.save(expected, buf)
    assert info_bytes(meta) == buf.getvalue()
    assert torch.load(io.BytesIO(info_bytes(meta)), weights_only=True) == expected


# --- reading: plain ref data through the restricted C unpickler (load_plain_refs) ----------------------
_RAN = []


def _side_effect(what):
    _RAN.append(what)
    return what


class _Runs:
    """Its pickle calls a function on load: what a malicious ref file would do."""

    def __reduce__(self):
        return _side_effect, ("ran",)


def _torch_safe(data: bytes):
    """What torch's safe loader makes of the bytes (load_refs before the C fast path)."""
    return pickling.load_pickle(io.BytesIO(data), trusted=False, name="ref")


@pytest.mark.parametrize("name", ["flat", "repeated", "ordered"])
def test_plain_refs_load_as_torch_safe_loader_does(name, monkeypatch):
    from collections import OrderedDict
    obj = CASES.get(name) or OrderedDict(a=TensorReference(1), b=[1, 2.5, None, "s", (True, TensorReference(2))])
    data = _fast_bytes(obj)
    plain, back = pickling.load_plain_refs(data)
    assert plain
    assert type(back) is type(obj) and back == obj and back == _torch_safe(data)
    torch_load = pytest.fail                   # load_refs takes the fast path: torch.load is never called
    monkeypatch.setattr(torch, "load", lambda *a, **k: torch_load("torch.load called"))
    assert xser.load_refs(io.BytesIO(data)) == obj


def test_plain_refs_refuse_other_globals_without_running_them():
    _RAN.clear()
    buf = io.BytesIO()
    torch.save({"w": TensorReference(0), "x": _Runs()}, buf)
    assert pickling.load_plain_refs(buf.getvalue()) == (False, None)
    assert _RAN == []
    with pytest.raises(xser.UnsafeCheckpointError, match="_side_effect"):
        xser.load_refs(io.BytesIO(buf.getvalue()))
    assert _RAN == []


@pytest.mark.parametrize("name", ["nested", "no_refs"])
def test_ref_files_with_inline_tensors_take_torch_safe_loader(name):
    data = _fast_bytes(CASES[name])
    assert pickling.load_plain_refs(data) == (False, None)
    back = xser.load_refs(io.BytesIO(data))
    assert torch.equal(back["inline" if name == "nested" else "t"], CASES[name]["inline" if name == "nested" else "t"])


def test_damaged_ref_bytes_are_left_to_torch_loader_to_explain():
    data = bytearray(_fast_bytes(CASES["flat"]))
    data[len(data) // 3: len(data) // 3 + 64] = b"\xff" * 64
    assert pickling.load_plain_refs(bytes(data)) == (False, None)
    with pytest.raises(xser.XserError):
        xser.load_refs(io.BytesIO(bytes(data)))
