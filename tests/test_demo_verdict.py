"""make demo's verdict: equal runs say yes; one flipped bit, another dtype or a different loss says no."""
from __future__ import annotations

import importlib.util
import os

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _demo():
    spec = importlib.util.spec_from_file_location("demo_script", os.path.join(ROOT, "scripts", "demo.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _dumps(tmp_path, states_ref, states_res):
    for r, (a, b) in enumerate(zip(states_ref, states_res)):
        torch.save(a, tmp_path / f"final_ref.rank{r}.pt")
        torch.save(b, tmp_path / f"final_resume.rank{r}.pt")


def _state(seed):
    g = torch.Generator().manual_seed(seed)
    return {"model": {"w": torch.randn(4, 3, generator=g), "b": torch.randn(3, generator=g).bfloat16()},
            "optim": {"state": {0: {"step": torch.tensor(5.0)}}, "param_groups": [{"lr": 0.1, "params": [0]}]}}


REF = {"losses": {"10": 1.5, "11": 1.25}, "final_checksum": "abc"}


def test_identical_runs_are_bit_exact(tmp_path):
    demo = _demo()
    _dumps(tmp_path, [_state(0), _state(1)], [_state(0), _state(1)])
    assert demo.compare_runs(str(tmp_path), 2, REF, {"losses": {"11": 1.25}, "final_checksum": "abc"}) == \
        (True, [], True)


def test_one_flipped_bit_is_found_and_named(tmp_path):
    demo = _demo()
    changed = _state(1)
    w = changed["model"]["w"]
    w.view(torch.int32)[2, 1] ^= 1                                  # one ulp in one element
    _dumps(tmp_path, [_state(0), _state(1)], [_state(0), changed])
    exact, diffs, same = demo.compare_runs(str(tmp_path), 2, REF, {"losses": {"11": 1.25}, "final_checksum": "abc"})
    assert not exact and same
    assert diffs == [f"rank1/model/w: bytes differ (max abs diff {(w - _state(1)['model']['w']).abs().max().item():.3g})"]


def test_dtype_checksum_and_losses_count(tmp_path):
    demo = _demo()
    other = _state(0)
    other["model"]["b"] = other["model"]["b"].float()
    _dumps(tmp_path, [_state(0)], [other])
    exact, diffs, _ = demo.compare_runs(str(tmp_path), 1, REF, {"losses": {}, "final_checksum": "abc"})
    assert not exact and diffs == ["rank0/model/b: torch.bfloat16(3,) vs torch.float32(3,)"]
    _dumps(tmp_path, [_state(0)], [_state(0)])
    assert demo.compare_runs(str(tmp_path), 1, REF, {"losses": {"11": 1.5}, "final_checksum": "abc"}) == \
        (True, [], False)
    assert demo.compare_runs(str(tmp_path), 1, REF, {"losses": {}, "final_checksum": "abd"})[0] is False
    assert demo.bit_diff({"a": 1}, {"a": 1, "b": 2}) == "state: keys differ"
