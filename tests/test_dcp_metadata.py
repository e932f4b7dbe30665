"""DCP ``.metadata`` files are read without running code unless trusted: real files written by torch's own
dcp.save read back equal; crafted pickles are refused by load_checkpoint, ``verify`` and ``from-dcp`` before
anything they name runs."""
from __future__ import annotations

import os
import pickle
import struct

import pytest
import torch

import nxd_ckpt
from nxd_ckpt.cli import main as cli_main
from nxd_ckpt.dcpmeta import read_metadata
from tiny_models import TinyShard


def _unicode(s: str) -> bytes:
    b = s.encode()
    return b"\x8c" + struct.pack("<B", len(b)) + b        # SHORT_BINUNICODE


def _crafted(module: str, name: str, marker) -> bytes:
    """A protocol-4 pickle calling ``module.name("touch marker")`` (STACK_GLOBAL resolves dotted names)."""
    return (b"\x80\x04" + _unicode(module) + _unicode(name) + b"\x93" + _unicode(f"touch {marker}")
            + b"\x85R.")


EXPLOITS = [("torch.distributed.checkpoint.filesystem", "os.system"), ("os", "system"),
            ("torch.distributed.checkpoint.metadata", "os.system")]


def _real_dcp(path, optimizer: bool) -> None:
    import torch.distributed.checkpoint as dcp

    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3))
    sd = {"model": model.state_dict(), "extra": {"s": "x", "n": 3, "t": (1, 2.0)},
          "cl": torch.zeros(2, 3, 4, 5, dtype=torch.bfloat16).to(memory_format=torch.channels_last)}
    if optimizer:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        for p in model.parameters():
            p.grad = torch.ones_like(p)
        opt.step()
        sd["optim"] = opt.state_dict()
    dcp.save(sd, checkpoint_id=str(path), no_dist=True)


@pytest.mark.parametrize("optimizer", [False, True])
def test_reads_what_torch_dcp_save_writes(tmp_path, optimizer):
    from torch.distributed.checkpoint import FileSystemReader

    _real_dcp(tmp_path, optimizer)
    data = (tmp_path / ".metadata").read_bytes()
    mine = read_metadata(data, "m")
    theirs = FileSystemReader(str(tmp_path)).read_metadata()
    assert mine.state_dict_metadata == theirs.state_dict_metadata
    assert mine.storage_data == theirs.storage_data and mine.planner_data == theirs.planner_data
    assert ("optim.state.0.exp_avg" in mine.state_dict_metadata) == optimizer


@pytest.mark.parametrize("module,name", EXPLOITS)
def test_crafted_metadata_is_refused_naming_the_global(tmp_path, module, name):
    marker = tmp_path / "marker"
    with pytest.raises(nxd_ckpt.UnsafeCheckpointError, match=f"{module}.{name}".replace(".", r"\.")):
        read_metadata(_crafted(module, name, marker), "x/.metadata")
    assert not marker.exists()


def test_not_a_metadata_is_corrupt():
    with pytest.raises(nxd_ckpt.CorruptCheckpointError, match="holds a dict, not a torch.distributed.checkpoint"):
        read_metadata(pickle.dumps({"a": 1}), "x/.metadata")


def _nxd_dcp_tag(root, marker, module="torch.distributed.checkpoint.filesystem", name="os.system"):
    """An NxD use_zero1_dcp tag (no manifest) whose optim/.metadata is a crafted pickle."""
    tag = root / "t"
    (tag / "model").mkdir(parents=True)
    (tag / "optim").mkdir()
    model = TinyShard(hidden=4, device="cpu")
    torch.save(model.state_dict(), tag / "model" / "dp_rank_00_tp_rank_00_pp_rank_00.pt")
    (tag / "optim" / ".metadata").write_bytes(_crafted(module, name, marker))
    (tag / "optim" / "__0_0.distcp").write_bytes(b"")
    (tag / "checkpoint").write_text("1")
    (tag / "done").write_text("1")
    return model, tag


def test_load_checkpoint_refuses_a_crafted_dcp_optimizer(tmp_path):
    from nxd_ckpt.testing import ZeroOneAdam

    marker = tmp_path / "marker"
    model, _ = _nxd_dcp_tag(tmp_path, marker)
    opt = ZeroOneAdam(model.parameters(), save_master_weights=False)
    with pytest.raises(nxd_ckpt.UnsafeCheckpointError, match=r"optim/\.metadata.*os\.system"):
        nxd_ckpt.load_checkpoint(str(tmp_path), "t", model=model, optimizer=opt)
    assert not marker.exists()


def test_verify_refuses_a_crafted_dcp_optimizer(tmp_path, capsys):
    marker = tmp_path / "marker"
    _, tag = _nxd_dcp_tag(tmp_path, marker)
    assert cli_main(["verify", str(tag)]) == 1
    out = capsys.readouterr()
    assert "not checkable without --trusted" in out.out + out.err and "os.system" in out.out + out.err
    assert not marker.exists()


def test_from_dcp_refuses_a_crafted_metadata(tmp_path, capsys):
    marker = tmp_path / "marker"
    src = tmp_path / "dcp"
    src.mkdir()
    (src / ".metadata").write_bytes(_crafted("torch.distributed.checkpoint.filesystem", "os.system", marker))
    assert cli_main(["from-dcp", str(src), str(tmp_path / "out"), "--tp", "1", "--dp", "1"]) == 1
    assert "os.system" in capsys.readouterr().err
    assert not marker.exists() and not (tmp_path / "out").exists()
