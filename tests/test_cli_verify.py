"""nxd-ckpt verify: every kind of damage is found and named; intact checkpoints pass; --json parses."""
from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

import backends  # noqa: F401 - enables objdir://
from nxd_ckpt.cli import main
from nxd_ckpt.storage import open_storage
from nxd_ckpt.verify import verify_dir, verify_tag
from test_cli_fixtures import upload, write_tag, zero1_tag

REF = "model/dp_rank_00_tp_rank_00_pp_rank_00.pt"
TENSOR = REF + ".tensors/tensor_1.pt"


def _model():
    return {(0, 0): {"w": torch.randn(64, 64), "b": torch.randn(64)}, (1, 0): {"w": torch.randn(64, 64), "b": torch.randn(64)}}


@pytest.fixture
def ours(tmp_path):
    return write_tag(str(tmp_path / "ck"), "step_1", model=_model(), scheduler={"last_epoch": 1},
                     user_content={"step": 1})


@pytest.fixture(params=backends.BACKENDS)
def ours_on(request, tmp_path):
    """``ours`` on each backend: a POSIX tag directory, or the same files in an object store (objdir://)."""
    tag = write_tag(str(tmp_path / "ck"), "step_1", model=_model(), scheduler={"last_epoch": 1},
                    user_content={"step": 1})
    return tag if request.param == "posix" else upload(tag, backends.root_for("objects", tmp_path) + "/step_1")


@pytest.fixture
def nxd(tmp_path):
    return write_tag(str(tmp_path / "nxd"), "step_1", model=_model(), manifest=False)


def _verify(capsys, path, *extra):
    code = main(["verify", path, *extra])
    return code, capsys.readouterr()


def _flip(path, offset=None):
    data = bytearray(open(path, "rb").read())
    i = len(data) // 2 if offset is None else offset
    data[i] ^= 0x01
    open(path, "wb").write(bytes(data))


def test_intact_checkpoint_passes(ours_on, capsys):
    code, out = _verify(capsys, ours_on)
    assert code == 0, out.out
    assert out.out.startswith("OK")
    code, out = _verify(capsys, ours_on.rpartition("/")[0], "--json", "--workers", "2")
    assert code == 0
    doc = json.loads(out.out)
    assert doc["ok"] and doc["tags"][0]["tag"] == "step_1" and doc["tags"][0]["files_checked"] == 10


@pytest.mark.parametrize("damage,needle", [
    ("flip", "fails its checksum"),
    ("truncate", "manifest says"),
    ("delete_tensor", "missing"),
    ("delete_ref", "missing"),
])
def test_damage_is_named(ours_on, capsys, damage, needle):
    st = open_storage(ours_on)
    rel = REF if damage == "delete_ref" else TENSOR
    if damage == "flip":
        data = bytearray(st.read(rel))
        data[len(data) // 2] ^= 0x01
        st.write_bytes(rel, bytes(data))
    elif damage == "truncate":
        st.write_bytes(rel, st.read(rel)[:-7])
    else:
        st.delete_many([rel])
    code, out = _verify(capsys, ours_on)
    assert code == 1
    assert "DAMAGED" in out.out and needle in out.out
    assert (st.local_path(rel) or f"{ours_on}/{rel}") in out.out
    code, out = _verify(capsys, ours_on.rpartition("/")[0], "--json")
    doc = json.loads(out.out)
    assert code == 1 and not doc["ok"]
    assert [p["file"] for p in doc["tags"][0]["problems"]] == [rel]


def test_deleted_manifest_and_done(ours, capsys):
    os.unlink(os.path.join(ours, "manifest.json"))
    code, out = _verify(capsys, ours)
    assert code == 1 and "manifest.json: missing" in out.out
    os.unlink(os.path.join(ours, "done"))
    code, out = _verify(capsys, ours)
    assert code == 1 and "INCOMPLETE" in out.out and "done: missing" in out.out


def test_unreadable_manifest(ours, capsys):
    open(os.path.join(ours, "manifest.json"), "w").write("{not json")
    code, out = _verify(capsys, ours)
    assert code == 1 and "manifest.json" in out.out


def test_nxd_checkpoint_rules(nxd, capsys):
    code, out = _verify(capsys, nxd)
    assert code == 0, out.out
    assert "neuronx-distributed" in out.out
    os.unlink(os.path.join(nxd, TENSOR))
    code, out = _verify(capsys, nxd)
    assert code == 1 and os.path.join(nxd, TENSOR) in out.out and "named by its ref file" in out.out


def test_nxd_corrupt_tensor_and_ref(nxd, capsys):
    open(os.path.join(nxd, TENSOR), "r+b").truncate(30)
    shutil.rmtree(os.path.join(nxd, "model", "dp_rank_00_tp_rank_01_pp_rank_00.pt.tensors"))
    res = verify_tag(nxd)
    files = sorted(f for f, _ in res.problems)
    assert not res.ok
    assert files == sorted([TENSOR, "model/dp_rank_00_tp_rank_01_pp_rank_00.pt.tensors/tensor_0.pt",
                            "model/dp_rank_00_tp_rank_01_pp_rank_00.pt.tensors/tensor_1.pt"])
    _flip(os.path.join(nxd, REF), 40)
    os.truncate(os.path.join(nxd, REF), 50)
    assert any(f == REF for f, _ in verify_tag(nxd).problems)


def test_zero1_nxd_missing_dp_rank(tmp_path):
    path, _ = zero1_tag(str(tmp_path), "z", dp=4, manifest=False)
    victim = os.path.join(path, "optim", "dp_rank_02_tp_rank_00_pp_rank_00.pt")
    os.unlink(victim)
    shutil.rmtree(victim + ".tensors")
    os.unlink(victim + ".info.pt")
    res = verify_tag(path)
    assert not res.ok and res.problems == [("optim/dp_rank_02_tp_rank_00_pp_rank_00.pt",
                                            "missing: ZeRO-1 shards of tp 0 pp 0 lack dp rank(s) [2]")]


def test_verify_dir_mixed(tmp_path, capsys):
    root = str(tmp_path / "ck")
    write_tag(root, "a", model=_model())
    b = write_tag(root, "b", model=_model())
    write_tag(root, "c", model=_model(), done=False)
    _flip(os.path.join(b, TENSOR))
    results = {r.tag: r for r in verify_dir(root)}
    assert results["a"].ok and not results["b"].ok and not results["c"].ok
    code, out = _verify(capsys, root)
    assert code == 1 and "1 of 3 tags intact" in out.out


def test_usage(tmp_path, capsys):
    assert main(["verify", str(tmp_path / "nope")]) == 1
    assert "not a directory" in capsys.readouterr().err
    assert main(["verify", str(tmp_path)]) == 1
    assert "no checkpoint tags" in capsys.readouterr().err
    assert main(["verify"]) == 2
    assert main(["verify", str(tmp_path), "--frobnicate"]) == 2


def test_progress_bar_counts_every_byte(ours, capsys, monkeypatch):
    import tqdm

    bars = []

    class Recording(tqdm.tqdm):
        def close(self):
            if not getattr(self, "recorded", False):      # tqdm may close twice (explicitly, then on delete)
                self.recorded = True
                bars.append((self.desc, self.n, self.total))
            super().close()

    monkeypatch.setattr(tqdm, "tqdm", Recording)
    res = verify_tag(ours, workers=2, progress=True)
    assert res.ok and res.files_checked == 10
    assert bars == [("verify step_1", res.bytes_checked, res.bytes_checked)]
    assert "verify step_1" in capsys.readouterr().err                    # drawn on stderr
    verify_tag(ours, workers=2, progress=False)
    assert len(bars) == 1 and capsys.readouterr().err == ""              # and absent when not asked
