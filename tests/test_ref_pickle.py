"""The ref pickle's fast path (C pickler + torch-xla's GLOBAL patched in) writes the pure-Python pickler's bytes."""
import io
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
