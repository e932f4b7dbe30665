"""xser files: save/load round trips, every dtype, compact views, safety, error messages, old NxD refs."""
from __future__ import annotations

import io
import os
import tempfile
import zipfile

import pytest
import torch
from hypothesis import given

import xser
from test_xser_support import (ALL_DTYPES, SETTINGS, Box, assert_bit_equal, assert_same, nested, random_tensor,
                               tensor_pool)

pytestmark = pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")
POOL = tensor_pool()


# ---- round trips -------------------------------------------------------------------------------
def _save_load(data, trusted):
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "m.pt")
        xser.save(data, path)
        _, tensors = xser.to_refs(data)
        names = sorted(os.listdir(xser.tensors_dir(path)))
        assert names == sorted(f"tensor_{i}.pt" for i in range(len(tensors)))
        return xser.load(path, trusted=trusted)


@SETTINGS
@given(nested(POOL, custom=False))
def test_roundtrip_safe_types_with_safe_load(data):
    assert_same(data, _save_load(data, trusted=False))


@SETTINGS
@given(nested(POOL, custom=True))
def test_roundtrip_custom_types_with_trusted_load(data):
    assert_same(data, _save_load(data, trusted=True))


@pytest.mark.parametrize("shape", [(), (3, 5)], ids=["0d", "2d"])
@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_every_dtype_roundtrips_bit_exactly(tmp_path, dtype, shape):
    t = random_tensor(dtype, shape, seed=hash(str(dtype)) % 1000)
    path = str(tmp_path / "m.pt")
    xser.save({"t": t, "same": t}, path)
    back = xser.load(path)
    assert_bit_equal(t, back["t"], str(dtype))
    assert back["t"] is back["same"]
    buf = io.BytesIO()
    xser.write_tensor(t, buf)
    assert_bit_equal(t, xser.read_tensor(io.BytesIO(buf.getvalue())), str(dtype))


def test_custom_object_needs_trusted_and_says_so(tmp_path):
    path = str(tmp_path / "m.pt")
    xser.save({"box": Box(torch.ones(1), 2)}, path)
    with pytest.raises(xser.UnsafeCheckpointError) as info:
        xser.load(path)
    assert "Box" in str(info.value) and path in str(info.value) and "trusted=True" in str(info.value)
    back = xser.load(path, trusted=True)
    assert type(back["box"]) is Box and torch.equal(back["box"].left, torch.ones(1))


# ---- compact tensor files ----------------------------------------------------------------------
@pytest.mark.parametrize("make", [
    lambda big: big[1000:1100],                          # slice
    lambda big: big.view(1000, 1000)[10:20, 5:15],      # non-contiguous window
    lambda big: big.view(1000, 1000)[:, 3],             # strided column
    lambda big: big[5].expand(100),                      # stride 0
], ids=["slice", "window", "column", "expanded"])
def test_views_of_big_storage_are_written_compactly(tmp_path, make):
    big = torch.randn(1_000_000)
    view = make(big)
    path = str(tmp_path / "m.pt")
    xser.save({"v": view}, path)
    size = os.path.getsize(xser.tensor_file(path, 0))
    assert size < view.numel() * view.element_size() + 2048, size
    back = xser.load(path)["v"]
    assert torch.equal(back, view) and back.untyped_storage().nbytes() == view.numel() * 4


def test_full_permuted_tensor_is_kept_as_is():
    t = torch.randn(4, 6).t()
    assert xser.is_compact(t) and xser.compact_cpu(t).stride() == t.stride()
    c = torch.randn(3, dtype=torch.complex64).conj()
    assert torch.equal(xser.read_tensor(io.BytesIO(xser.tensor_to_bytes(c))), c)


def test_write_tensor_accepts_a_write_only_file_object():
    class WriteOnly:
        def __init__(self):
            self.chunks = []

        def write(self, b):
            self.chunks.append(bytes(b))
            return len(b)

    sink = WriteOnly()
    t = torch.arange(10)[2:5]
    xser.write_tensor(t, sink)
    assert torch.equal(xser.read_tensor(io.BytesIO(b"".join(sink.chunks))), t)


def test_parameters_and_grad_tensors_are_saved_detached(tmp_path):
    p = torch.nn.Parameter(torch.randn(3))
    path = str(tmp_path / "m.pt")
    xser.save({"p": p, "g": p * 2}, path)
    back = xser.load(path)
    assert type(back["p"]) is torch.Tensor and not back["p"].requires_grad
    assert torch.equal(back["g"], p.detach() * 2)


# ---- save semantics ----------------------------------------------------------------------------
def test_tensor_files_first_ref_last_and_stale_files_removed(tmp_path):
    path = str(tmp_path / "m.pt")
    os.makedirs(xser.tensors_dir(path))
    open(xser.tensor_file(path, 9), "wb").close()
    xser.save([torch.ones(1), torch.zeros(1)], path)
    assert sorted(os.listdir(xser.tensors_dir(path))) == ["tensor_0.pt", "tensor_1.pt"]
    assert os.path.getmtime(path) >= os.path.getmtime(xser.tensor_file(path, 1))
    assert sorted(os.listdir(tmp_path)) == ["m.pt", "m.pt.tensors"]  # no temp file left


@pytest.mark.parametrize("env,kwargs,writes", [
    ({"LOCAL_RANK": "1"}, {}, False),
    ({"LOCAL_RANK": "1"}, {"master_only": False}, True),
    ({"LOCAL_RANK": "0", "RANK": "3"}, {}, True),
    ({"LOCAL_RANK": "0", "RANK": "3"}, {"global_master": True}, False),
    ({"LOCAL_RANK": "2", "RANK": "0"}, {"global_master": True}, True),
])
def test_master_only_rules(tmp_path, monkeypatch, env, kwargs, writes):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    path = str(tmp_path / "m.pt")
    xser.save({"a": torch.ones(1)}, path, **kwargs)
    assert os.path.exists(path) == writes and os.path.exists(xser.tensors_dir(path)) == writes


# ---- old NxD files, info files ------------------------------------------------------------------
def test_ref_without_info_file_loads(tmp_path):
    path = str(tmp_path / "m.pt")
    xser.save({"a": torch.ones(2)}, path)
    assert not os.path.exists(xser.info_file(path)) and xser.read_info(path) is None
    assert torch.equal(xser.load(path)["a"], torch.ones(2))


def test_ref_with_inlined_tensors_loads(tmp_path):
    path = str(tmp_path / "m.pt")
    os.makedirs(xser.tensors_dir(path))
    with open(xser.tensor_file(path, 0), "wb") as f:
        xser.write_tensor(torch.arange(4), f)
    inline = torch.full((2,), 5.0)
    with open(path, "wb") as f:
        xser.dump_refs({"ref": xser.TensorReference(0), "inline": inline, "n": 3}, f)
    back = xser.load(path)
    assert torch.equal(back["ref"], torch.arange(4)) and torch.equal(back["inline"], inline) and back["n"] == 3
    plain = str(tmp_path / "plain.pt")
    torch.save({"only": inline}, plain)  # a converter's fully inlined output: no .tensors folder at all
    assert torch.equal(xser.load(plain)["only"], inline)


def test_read_info(tmp_path):
    path = str(tmp_path / "m.pt")
    info = {0: {"dtype": torch.bfloat16, "shape": torch.Size([2, 3]), "expert_model_parallel": False}}
    torch.save(info, xser.info_file(path))
    assert xser.read_info(path) == info


# ---- errors ------------------------------------------------------------------------------------
def _saved(tmp_path, n=2):
    path = str(tmp_path / "m.pt")
    xser.save({f"t{i}": torch.full((100,), float(i)) for i in range(n)}, path)
    return path


def test_missing_ref_file(tmp_path):
    path = str(tmp_path / "nope.pt")
    with pytest.raises(xser.MissingFileError) as info:
        xser.load(path)
    assert path in str(info.value) and "does not exist" in str(info.value)
    assert isinstance(info.value, FileNotFoundError) and isinstance(info.value, xser.XserError)


def test_missing_tensor_file_names_file_and_tid(tmp_path):
    path = _saved(tmp_path)
    os.remove(xser.tensor_file(path, 1))
    with pytest.raises(xser.MissingFileError) as info:
        xser.load(path)
    msg = str(info.value)
    assert "tensor_1.pt" in msg and "tid 1" in msg and path in msg and "copy" in msg
    assert info.value.path == xser.tensor_file(path, 1)


def test_truncated_tensor_file(tmp_path):
    path = _saved(tmp_path)
    file = xser.tensor_file(path, 0)
    data = open(file, "rb").read()
    with open(file, "wb") as f:
        f.write(data[: len(data) // 2])
    with pytest.raises(xser.CorruptFileError) as info:
        xser.load(path)
    assert "tensor_0.pt" in str(info.value) and "tid 0" in str(info.value) and "corrupt" in str(info.value)


@pytest.mark.parametrize("content", [b"", b"\x00garbage" * 50, b"PK\x03\x04" + b"x" * 100],
                         ids=["empty", "garbage", "fake-zip"])
def test_corrupt_ref_file(tmp_path, content):
    path = _saved(tmp_path)
    with open(path, "wb") as f:
        f.write(content)
    with pytest.raises(xser.CorruptFileError) as info:
        xser.load(path)
    assert path in str(info.value)


def test_tensor_file_that_holds_no_tensor(tmp_path):
    path = _saved(tmp_path, n=1)
    torch.save({"not": "a tensor"}, xser.tensor_file(path, 0))
    with pytest.raises(xser.CorruptFileError, match="not a tensor"):
        xser.load(path)


def test_invalid_tid_is_rejected_before_any_path_is_built(tmp_path):
    path = str(tmp_path / "m.pt")
    ref = xser.TensorReference("../../etc/passwd")
    with open(path, "wb") as f:
        xser.dump_refs({"a": ref}, f)
    with pytest.raises(xser.CorruptFileError, match="invalid tid"):
        xser.load(path)


def test_directory_passed_as_path(tmp_path):
    path = _saved(tmp_path)
    for target in (str(tmp_path), xser.tensors_dir(path)):
        with pytest.raises(xser.MissingFileError) as info:
            xser.load(target)
        assert "is a directory; pass the ref file" in str(info.value) and target in str(info.value)
    with pytest.raises(xser.XserError, match="is a directory"):
        xser.save({"a": torch.ones(1)}, str(tmp_path))


# ---- malicious pickles -------------------------------------------------------------------------
class _RunsCommand:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


class _OpensFile:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


@pytest.mark.parametrize("evil,global_part", [(_RunsCommand, "system"), (_OpensFile, "open")],
                         ids=["os.system", "builtins.open"])
@pytest.mark.parametrize("where", ["ref", "tensor", "info"])
def test_malicious_pickle_is_refused(tmp_path, evil, global_part, where):
    marker = str(tmp_path / "MARKER")
    path = _saved(tmp_path, n=1)
    target = {"ref": path, "tensor": xser.tensor_file(path, 0), "info": xser.info_file(path)}[where]
    torch.save({"payload": evil(marker)} if where != "tensor" else evil(marker), target)
    with pytest.raises(xser.UnsafeCheckpointError) as info:
        xser.read_info(path) if where == "info" else xser.load(path)
    err = info.value
    assert target in str(err) and global_part in str(err) and global_part in err.global_name
    assert "trusted=True" in str(err) and "trusted source" in str(err)
    assert not os.path.exists(marker), "the payload ran"


def test_unsafe_error_names_file_object_source():
    buf = io.BytesIO()
    torch.save(_RunsCommand("/nonexistent/never"), buf)
    buf.seek(0)
    with pytest.raises(xser.UnsafeCheckpointError, match=r"step_3/model/x\.pt.*posix\.system|nt\.system"):
        xser.load_refs(buf, name="step_3/model/x.pt")


def test_legacy_torch_save_format_reads(tmp_path):
    path = str(tmp_path / "m.pt")
    torch.save({"a": torch.arange(3)}, path, _use_new_zipfile_serialization=False)
    assert torch.equal(xser.load(path)["a"], torch.arange(3))


def test_ref_zip_names_torch_xla_class(tmp_path):
    path = _saved(tmp_path, n=1)
    with zipfile.ZipFile(path) as zf:
        pkl = zf.read(next(n for n in zf.namelist() if n.endswith("data.pkl")))
    assert b"torch_xla.utils.serialization\nTensorReference" in pkl


def test_module_state_dict_keeps_metadata_and_loads_safely(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    sd = model.state_dict()
    path = str(tmp_path / "m.pt")
    xser.save(sd, path)
    back = xser.load(path)
    assert type(back) is type(sd) and list(back) == list(sd) and back._metadata == sd._metadata
    for k in sd:
        assert torch.equal(back[k], sd[k]), k
    fresh = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    fresh.load_state_dict(back)
    assert torch.equal(fresh[0].weight, model[0].weight)
