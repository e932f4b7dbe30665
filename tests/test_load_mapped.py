"""Loading large tensor files through a verified memory map (a performance path) loads the same values,
still catches damage, and is used only when every loaded tensor is copied into the target. The map is what a file
gets where the direct read does not apply (a network filesystem, tmpfs, no manifest; test_direct_reads.py): off
here, so that these tests reach it on any disk."""
from __future__ import annotations

import os

import pytest
import torch

from tiny_models import xla_device


@pytest.fixture(autouse=True)
def _no_direct_reads(monkeypatch):
    from nxd_ckpt.storage import local

    monkeypatch.setattr(local, "DIRECT_READS", False)


def _state(dev):
    g = torch.Generator().manual_seed(3)
    return {"big": torch.randn(512, 1024, generator=g).to(dev),       # 2 MiB: mapped
            "small": torch.randn(7, generator=g).to(dev)}             # read into memory


def _count_mapped(monkeypatch):
    from nxd_ckpt import reader

    calls = []
    original = reader._read_tensor_mapped

    def counting(*a, **k):
        t = original(*a, **k)
        calls.append(t is not None)
        return t

    monkeypatch.setattr(reader, "_read_tensor_mapped", counting)
    return calls


def test_mapped_load_is_bit_exact_and_used_for_device_targets(tmp_path, monkeypatch):
    import nxd_ckpt

    dev = xla_device()
    sd = _state(dev)
    root = str(tmp_path / "ckpt")
    nxd_ckpt.save_checkpoint(root, "a", model=sd, use_xser=True)
    calls = _count_mapped(monkeypatch)
    target = {k: torch.zeros_like(v) for k, v in sd.items()}
    nxd_ckpt.load_checkpoint(root, "a", model=target)
    assert calls == [True]
    for k in sd:
        assert target[k].device.type == "xla"
        assert torch.equal(target[k].cpu(), sd[k].cpu()), k


def test_mapped_load_still_names_a_damaged_file(tmp_path, monkeypatch):
    import nxd_ckpt
    from nxd_ckpt import CorruptCheckpointError

    dev = xla_device()
    root = str(tmp_path / "ckpt")
    nxd_ckpt.save_checkpoint(root, "a", model=_state(dev), use_xser=True)
    tensors = os.path.join(root, "a", "model", "dp_rank_00_tp_rank_00_pp_rank_00.pt.tensors")
    big = max((os.path.join(tensors, n) for n in os.listdir(tensors)), key=os.path.getsize)
    with open(big, "r+b") as f:
        f.seek(os.path.getsize(big) // 2)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0x10]))
    calls = _count_mapped(monkeypatch)
    target = {k: torch.zeros_like(v) for k, v in _state(dev).items()}
    with pytest.raises(CorruptCheckpointError, match="checksum"):
        nxd_ckpt.load_checkpoint(root, "a", model=target)
    assert calls == [False]          # the map did not verify; the byte path named the damage
    assert torch.count_nonzero(target["big"].cpu()) == 0


def test_host_targets_are_never_mapped():
    from nxd_ckpt.loader import copies_every_tensor

    dev = xla_device()
    xla_sd = _state(dev)
    assert copies_every_tensor(xla_sd, None)
    assert copies_every_tensor(torch.nn.Linear(2, 2), None)          # load_state_dict copies
    assert not copies_every_tensor({"w": torch.zeros(2)}, None)       # the dict would keep the loaded tensor
    cpu_opt = torch.optim.Adam([torch.nn.Parameter(torch.zeros(2))])
    assert not copies_every_tensor(None, cpu_opt)
    assert not copies_every_tensor(None, {"state": {}})
    xla_opt = torch.optim.Adam([torch.nn.Parameter(torch.zeros(2, device=dev))])
    assert copies_every_tensor(torch.nn.Linear(2, 2).to(dev), xla_opt)
