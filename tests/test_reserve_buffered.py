"""A buffered file created on ext4 gets its blocks reserved in one piece before its write
(``storage.local.RESERVE_BUFFERED_MIN_BYTES``): only new files of 64 KiB or more, only on ext4, the exact size,
the bytes unchanged and no block left reserved past them."""
import os

import pytest
import torch

from nxd_ckpt.storage import local
from nxd_ckpt.storage.local import LocalStorage

EXT4, XFS, TMPFS = 0xEF53, 0x58465342, 0x01021994
KIB = 1 << 10


@pytest.fixture
def reserved(monkeypatch):
    """Every fallocate the storage asks for, as (mode, offset, length); each is still done."""
    calls = []
    real = local._fallocate()
    monkeypatch.setattr(local, "_fallocate", lambda: lambda fd, mode, off, n: calls.append((mode, off, n)) or
                        (real(fd, mode, off, n) if real is not None else 0))
    return calls


def _fs(monkeypatch, kind):
    monkeypatch.setattr(local, "_filesystem_type", lambda p: kind)


def _put(storage, rel, data, reuse=False):
    half = len(data) // 2
    return storage.write_parts(rel, (data[:half], data[half:]), durable=False, atomic=False, reuse=reuse)


def test_a_new_file_of_64_kib_or_more_is_reserved_once_with_its_exact_size(tmp_path, monkeypatch, reserved):
    _fs(monkeypatch, EXT4)
    data = os.urandom(100_000)
    record = _put(LocalStorage(str(tmp_path)), "t/tensor_1.pt", data)
    assert reserved == [(1, 0, 100_000)]     # KEEP_SIZE: the size is what the write makes it
    assert record.size == 100_000 and (tmp_path / "t" / "tensor_1.pt").read_bytes() == data
    assert os.stat(tmp_path / "t" / "tensor_1.pt").st_blocks * 512 <= -(-100_000 // 4096) * 4096


def test_smaller_files_and_files_taken_over_are_not_reserved(tmp_path, monkeypatch, reserved):
    _fs(monkeypatch, EXT4)
    storage = LocalStorage(str(tmp_path))
    _put(storage, "small.pt", os.urandom(64 * KIB - 1))
    (tmp_path / "old.pt").write_bytes(os.urandom(300 * KIB))       # a retired checkpoint's file, taken over
    data = os.urandom(200 * KIB)
    _put(storage, "old.pt", data, reuse=True)
    assert reserved == []
    assert (tmp_path / "old.pt").read_bytes() == data


@pytest.mark.parametrize("kind", [XFS, TMPFS])
def test_other_filesystems_are_not_reserved(tmp_path, monkeypatch, reserved, kind):
    _fs(monkeypatch, kind)
    _put(LocalStorage(str(tmp_path)), "f.pt", os.urandom(100_000))
    assert reserved == []


def test_the_knob_at_never_turns_it_off(tmp_path, monkeypatch, reserved):
    _fs(monkeypatch, EXT4)
    monkeypatch.setattr(local, "RESERVE_BUFFERED_MIN_BYTES", 1 << 62)
    _put(LocalStorage(str(tmp_path)), "f.pt", os.urandom(100_000))
    assert reserved == []


def test_a_refused_reservation_leaves_the_file_written_all_the_same(tmp_path, monkeypatch):
    _fs(monkeypatch, EXT4)
    asked = []
    monkeypatch.setattr(local, "_fallocate", lambda: lambda fd, mode, off, n: asked.append(n) or -1)
    data = os.urandom(100_000)
    _put(LocalStorage(str(tmp_path)), "f.pt", data)
    assert asked == [100_000] and (tmp_path / "f.pt").read_bytes() == data


def test_an_async_save_reserves_each_buffered_tensor_file_of_64_kib_or_more(tmp_path, monkeypatch, reserved):
    """Sizes the save's tensor files come in: 4 KiB (not reserved), 100 KB (reserved), 2 MiB (direct, reserved
    by the direct sink with its padding); the checkpoint loads bit-exact."""
    import nxd_ckpt
    from tiny_models import xla_device

    _fs(monkeypatch, EXT4)
    dev = xla_device()
    model = torch.nn.ParameterDict({"a": torch.nn.Parameter(torch.randn(1024)),
                                    "b": torch.nn.Parameter(torch.randn(25_000)),
                                    "c": torch.nn.Parameter(torch.randn(512 * KIB))}).to(dev)
    nxd_ckpt.save_checkpoint(str(tmp_path), "s", model=model, use_xser=True, async_save=True)
    nxd_ckpt.finalize_checkpoint()
    assert sorted(n for mode, off, n in reserved if n < local.DIRECT_MIN_BYTES) == [100_000 + _xser_frame(tmp_path)]
    fresh = torch.nn.ParameterDict({k: torch.nn.Parameter(torch.zeros_like(v)) for k, v in model.items()}).to(dev)
    nxd_ckpt.load_checkpoint(str(tmp_path), "s", model=fresh)
    assert all(torch.equal(fresh[k].cpu(), model[k].cpu()) for k in model)


def _xser_frame(root) -> int:
    """The bytes of the 100 KB tensor's file beyond its data (the stored zip's frame)."""
    sizes = [os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(root) for f in fs if f.startswith("tensor_")]
    return next(s for s in sizes if 100_000 < s < 1 << 20) - 100_000
