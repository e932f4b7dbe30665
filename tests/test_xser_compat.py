"""xser <-> torch_xla.utils.serialization, both ways; XLA tensors; reading and writing without torch-xla."""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import textwrap
from collections import OrderedDict

import pytest
import torch
from hypothesis import given

import xser
from test_xser_support import SETTINGS, Box, assert_same, nested, tensor_pool

os.environ.setdefault("PJRT_DEVICE", "CPU")
pytest.importorskip("torch_xla")
import torch_xla  # noqa: E402
import torch_xla.utils.serialization as txs  # noqa: E402
import torch_xla.utils.utils as xu  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")
POOL = tensor_pool()


def xla_device():
    return torch_xla.device()


def as_torch_xla_loads(x):
    """What torch-xla's rewrite makes of ``x``: tuples (also namedtuples, torch.Size) -> lists,
    dict subclasses -> dict. Tensors and sharing are kept."""
    memo = {}

    def go(v):
        if isinstance(v, torch.Tensor) or id(v) in memo:
            return memo.get(id(v), v)
        if isinstance(v, dict):
            out = memo[id(v)] = {}
            for k, val in v.items():
                out[go(k)] = go(val)
            return out
        if isinstance(v, (list, tuple)):
            out = memo[id(v)] = []
            out.extend(go(e) for e in v)
            return out
        return v

    return go(x)


# ---- tid order ---------------------------------------------------------------------------------
@SETTINGS
@given(nested(POOL, custom=True))
def test_tid_order_matches_torch_xla_traversal(data):
    expected = []
    xu.for_each_instance(data, lambda v: type(v) == torch.Tensor, expected.append)
    _, tensors = xser.to_refs(data)
    assert [id(t) for t in tensors] == [id(t) for t in expected]


def _xla_nested(custom=True):
    """Nested XLA data with distinct values per tensor (value = index), tied weights and a tensor key.
    ``custom`` puts a custom object in it (then a weights-only load needs ``trusted=True``)."""
    dev = xla_device()
    t = [torch.full((3,), float(i), device=dev) for i in range(8)]
    inner = (Box if custom else lambda a, b: [a, b])(t[2], {"q": t[1], "r": t[7]})
    return t, {
        "z": [t[3], (t[1], t[3])],
        t[6]: t[0],
        "m": OrderedDict(b=t[5], a=inner),
        "s": {t[4]},
        "cpu": torch.ones(2),  # torch-xla keeps CPU tensors inline
    }


def _value_at(path, tid):
    return int(torch.load(xser.tensor_file(path, tid), weights_only=True)[0].item())


def test_tid_order_matches_torch_xla_save(tmp_path):
    tensors, data = _xla_nested()
    theirs = str(tmp_path / "theirs.pt")
    txs.save(data, theirs)
    n = len(os.listdir(xser.tensors_dir(theirs)))
    their_order = [_value_at(theirs, tid) for tid in range(n)]
    _, ours = xser.to_refs(data)
    ours_xla = [int(t[0].item()) for t in ours if t.device.type == "xla"]
    assert ours_xla == their_order and len(their_order) == 8
    assert ours[ours_xla.index(3)] is tensors[3]
    mine = str(tmp_path / "mine.pt")
    xser.save({k: v for k, v in data.items() if k != "cpu"}, mine)
    assert [_value_at(mine, tid) for tid in range(n)] == their_order


# ---- files both ways ---------------------------------------------------------------------------
@SETTINGS
@given(nested(POOL, custom=False))
def test_our_files_load_with_torch_xla(data):
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "m.pt")
        xser.save(data, path)
        assert_same(as_torch_xla_loads(data), txs.load(path))


def test_our_files_load_with_torch_xla_every_dtype(tmp_path):
    from test_xser_support import ALL_DTYPES, assert_bit_equal, random_tensor

    data = {str(dt): random_tensor(dt, (2, 3), seed=i) for i, dt in enumerate(ALL_DTYPES)}
    path = str(tmp_path / "m.pt")
    xser.save(data, path)
    back = txs.load(path)
    for k, t in data.items():
        assert_bit_equal(t, back[k], k)


@pytest.mark.parametrize("custom", [False, True], ids=["safe", "custom-trusted"])
def test_torch_xla_files_load_with_xser(tmp_path, custom):
    tensors, data = _xla_nested(custom)
    path = str(tmp_path / "theirs.pt")
    txs.save(data, path)
    ours = xser.load(path, trusted=custom)
    assert_same(txs.load(path), ours)
    assert torch.equal(ours["z"][0], torch.full((3,), 3.0)) and ours["z"][0] is ours["z"][1][1]
    assert torch.equal(ours["cpu"], torch.ones(2)) and ours["cpu"].device.type == "cpu"


# ---- XLA tensors on save -----------------------------------------------------------------------
def test_save_xla_tensors_in_one_batched_copy(tmp_path, monkeypatch):
    dev = xla_device()
    base = torch.arange(12.0, device=dev)
    param = torch.nn.Parameter(torch.ones(2, 2, device=dev))
    data = {"pending": base * 2 + 1, "view": base.view(3, 4)[:, 1], "param": param, "cpu": torch.zeros(1)}
    expected = {"pending": torch.arange(12.0) * 2 + 1, "view": torch.arange(12.0).view(3, 4)[:, 1],
                "param": torch.ones(2, 2), "cpu": torch.zeros(1)}
    real = torch_xla._XLAC._xla_get_cpu_tensors
    calls = []
    monkeypatch.setattr(torch_xla._XLAC, "_xla_get_cpu_tensors", lambda ts: calls.append(len(ts)) or real(ts))
    path = str(tmp_path / "m.pt")
    xser.save(data, path)
    assert calls == [3]
    back = xser.load(path)
    for k, v in expected.items():
        assert torch.equal(back[k], v) and back[k].device.type == "cpu", k
    assert os.path.getsize(xser.tensor_file(path, 1)) < 3 * 4 + 2048
    assert_same(as_torch_xla_loads(back), txs.load(path))


def test_save_falls_back_to_per_tensor_copies(tmp_path, monkeypatch):
    def broken(ts):
        raise RuntimeError("no batched copy here")

    monkeypatch.setattr(torch_xla._XLAC, "_xla_get_cpu_tensors", broken)
    x = torch.arange(4, device=xla_device())
    path = str(tmp_path / "m.pt")
    xser.save([x, x], path)
    back = xser.load(path)
    assert torch.equal(back[0], torch.arange(4)) and back[0] is back[1]


# ---- without torch-xla -------------------------------------------------------------------------
_NO_XLA_SCRIPT = textwrap.dedent("""
    import importlib.abc, sys

    class BlockTorchXla(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name == "torch_xla" or name.startswith("torch_xla."):
                raise ImportError(name + " is blocked in this test")

    sys.meta_path.insert(0, BlockTorchXla())
    import torch, xser
    try:
        import torch_xla
    except ImportError:
        pass
    else:
        raise SystemExit("torch_xla was importable")
    theirs, mine, out = sys.argv[1:4]
    safe = xser.load(theirs)
    trusted = xser.load(theirs, trusted=True)
    assert safe["z"][0] is safe["z"][1][1]
    refs = xser.load_refs(theirs)
    assert type(refs["z"][0]) is xser.TensorReference, type(refs["z"][0])
    w = torch.randn(3, 3)
    data = {"w": w, "tied": w, "nested": [torch.arange(5), {"b": torch.tensor(True)}], "step": 7}
    xser.save(data, mine)
    torch.save({"safe": safe, "trusted": trusted, "written": data}, out)
    assert not any(m.startswith("torch_xla") for m in sys.modules), sorted(sys.modules)
    print("OK")
""")


def test_read_and_write_without_torch_xla(tmp_path):
    _, data = _xla_nested(custom=False)
    theirs = str(tmp_path / "theirs.pt")
    txs.save(data, theirs)
    mine, out = str(tmp_path / "mine.pt"), str(tmp_path / "out.pt")
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-c", _NO_XLA_SCRIPT, theirs, mine, out], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "OK", proc.stdout + proc.stderr
    got = torch.load(out, weights_only=False)
    expected = txs.load(theirs)
    assert_same(expected, got["safe"])
    assert_same(expected, got["trusted"])
    written = got["written"]
    back = txs.load(mine)
    assert_same(as_torch_xla_loads(written), back)
    assert back["w"] is back["tied"] and back["step"] == 7
