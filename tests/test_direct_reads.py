"""Large tensor files that a load moves to an XLA device are read with O_DIRECT into buffers reused between files:
exact bytes for every length, a buffer reused only once its tensor is on the device (bit-exact loads), damage still
named, and the memory-mapped read wherever the direct one does not apply."""
import errno
import os

import pytest
import torch

from nxd_ckpt import readbuffers, reader
from nxd_ckpt.readbuffers import ReadBuffers, buffer_bytes, read_span
from nxd_ckpt.storage import local
from nxd_ckpt.storage.local import LocalStorage
from tiny_models import assert_bit_equal, to_cpu_state, xla_device

EXT4, TMPFS, NFS = 0xEF53, 0x01021994, 0x6969
MIB = 1 << 20
SHARD = "model/dp_rank_00_tp_rank_00_pp_rank_00.pt"


@pytest.fixture
def direct_disk(tmp_path, monkeypatch):
    """tmp_path told to be ext4; skipped where its filesystem refuses O_DIRECT (tmpfs before Linux 6.6)."""
    try:
        os.close(os.open(tmp_path / "probe", os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o644))
    except OSError:
        pytest.skip("this filesystem refuses O_DIRECT")
    os.unlink(tmp_path / "probe")
    monkeypatch.setattr(local, "_filesystem_type", lambda p: EXT4)


@pytest.mark.parametrize("n", [MIB, MIB + 1, 4 * MIB - 1, 4 * MIB, 10 * MIB + 12345])
def test_a_direct_read_holds_exactly_the_file_and_a_longer_file_shows(tmp_path, direct_disk, n):
    data = os.urandom(n + 1)
    (tmp_path / "f").write_bytes(data[:n])
    (tmp_path / "longer").write_bytes(data)
    storage, buffers = LocalStorage(str(tmp_path)), ReadBuffers()
    buf = buffers.take(n)
    assert len(buf) == buffer_bytes(n) and len(buf) % (2 * MIB) == 0
    assert storage.read_direct("f", buf[:read_span(n)]) == n and bytes(buf[:n]) == data[:n]
    assert storage.read_direct("longer", buf[:read_span(n)]) == n + 1
    with pytest.raises(ValueError, match="whole 4096-byte blocks"):
        storage.read_direct("f", buf[:4097])
    with pytest.raises(FileNotFoundError):
        storage.read_direct("missing", buf[:read_span(n)])


@pytest.mark.parametrize("f_type, size, on, direct", [
    (EXT4, MIB, True, True), (EXT4, MIB - 1, True, False), (EXT4, 64 * MIB, False, False),
    (TMPFS, 64 * MIB, True, False), (NFS, 64 * MIB, True, False)])
def test_only_large_files_on_a_local_disk_are_read_directly(tmp_path, monkeypatch, f_type, size, on, direct):
    monkeypatch.setattr(local, "_filesystem_type", lambda p: f_type)
    monkeypatch.setattr(local, "DIRECT_READS", on)
    assert LocalStorage(str(tmp_path)).reads_direct(size) is direct


def test_buffers_go_to_the_smallest_free_fit_within_the_cap_and_close_forgets_them():
    buffers = ReadBuffers(hold_bytes=16 * MIB)
    big, small = buffers.take(9 * MIB), buffers.take(3 * MIB)
    assert (len(big), len(small), buffers.held) == (10 * MIB, 4 * MIB, 14 * MIB)
    assert buffers.take(3 * MIB) is None, "past the cap: the caller reads the file as before"
    buffers.give_back(big)
    buffers.give_back(small)
    again = buffers.take(MIB)
    assert again is small and buffers.reused == 1
    assert buffers.take(5 * MIB) is big and buffers.reused == 2
    buffers.give_back(again)
    buffers.close()
    assert buffers.held == 10 * MIB and buffers.take(MIB) is None
    buffers.give_back(big)
    assert buffers.held == 0


def _state(dev, n=8):
    """Tensors of 1.1-2.9 MiB, all of distinct sizes (read largest first, so later files reuse earlier buffers),
    and one small one that is read as before."""
    g = torch.Generator().manual_seed(3)
    state = {f"w{i}": torch.randn(280 + 60 * i, 1024, generator=g).to(dev) for i in range(n)}
    state["bias"] = torch.randn(100, generator=g).to(dev)
    return state


class _Spy:
    """Counts direct reads and remembers every ReadBuffers a load made."""

    def __init__(self, monkeypatch):
        self.reads, self.pools = [], []
        real_read, spy = LocalStorage.read_direct, self

        def read_direct(storage, relpath, view):
            spy.reads.append(relpath)
            return real_read(storage, relpath, view)

        class Buffers(ReadBuffers):
            def __init__(self, *a, **kw):
                super().__init__(*a, **kw)
                spy.pools.append(self)

        monkeypatch.setattr(LocalStorage, "read_direct", read_direct)
        monkeypatch.setattr(reader, "ReadBuffers", Buffers)


def test_a_load_reads_large_files_into_reused_buffers_and_is_bit_exact(tmp_path, direct_disk, monkeypatch):
    """Every tensor a batch of its own: each buffer is reused as soon as its tensor is on the device, so a
    transfer that read its source later than it returns would load another file's bytes."""
    import nxd_ckpt

    dev = xla_device()
    saved = _state(dev)
    nxd_ckpt.save_checkpoint(str(tmp_path / "c"), "a", model=saved, use_xser=True)
    spy = _Spy(monkeypatch)
    monkeypatch.setattr(reader, "PLACE_BATCH_BYTES", 1)
    target = {k: torch.zeros_like(v) for k, v in saved.items()}
    nxd_ckpt.load_checkpoint(str(tmp_path / "c"), "a", model=target, num_workers=1)
    assert sorted(spy.reads) == sorted(f"a/{SHARD}.tensors/tensor_{i}.pt" for i in range(8)), spy.reads
    pool, = spy.pools
    assert pool.reused >= 4 and pool.held == 0, (pool.reused, pool.held)
    assert all(v.device.type == "xla" for v in target.values())
    assert_bit_equal(to_cpu_state(saved), to_cpu_state(target))


@pytest.mark.parametrize("damage", ["flip", "truncate", "remove"])
def test_damage_in_a_directly_read_file_is_named_and_nothing_is_applied(tmp_path, direct_disk, monkeypatch, damage):
    import nxd_ckpt

    dev = xla_device()
    nxd_ckpt.save_checkpoint(str(tmp_path / "c"), "a", model=_state(dev), use_xser=True)
    rel = f"a/{SHARD}.tensors/tensor_3.pt"
    path = tmp_path / "c" / rel
    data = bytearray(path.read_bytes())
    if damage == "flip":
        data[len(data) // 2] ^= 0x10
        path.write_bytes(bytes(data))
    elif damage == "truncate":
        path.write_bytes(bytes(data[:-4096]))
    else:
        path.unlink()
    spy = _Spy(monkeypatch)
    target = _state(dev)
    want = to_cpu_state(target)
    before = dict(target)
    with pytest.raises(nxd_ckpt.CorruptCheckpointError) as info:
        nxd_ckpt.load_checkpoint(str(tmp_path / "c"), "a", model=target, num_workers=2)
    assert info.value.path == rel, str(info.value)
    expected = {"flip": "fails its checksum", "truncate": "(truncated or overwritten)", "remove": "is missing"}[damage]
    assert expected in str(info.value), str(info.value)
    assert rel in spy.reads, "the damaged file was read directly first"
    assert all(target[k] is before[k] for k in before), "a tensor of the target was replaced"
    assert_bit_equal(want, to_cpu_state(target))


@pytest.mark.parametrize("why", ["cap", "einval", "off"])
def test_where_a_direct_read_does_not_apply_the_file_is_mapped_and_the_load_is_bit_exact(tmp_path, direct_disk,
                                                                                        monkeypatch, why):
    """The buffers' cap reached (the largest file fits, the rest are mapped), a filesystem that refuses O_DIRECT
    at open, or direct reads off: the same tensors."""
    import nxd_ckpt

    dev = xla_device()
    saved = _state(dev)
    nxd_ckpt.save_checkpoint(str(tmp_path / "c"), "a", model=saved, use_xser=True)
    spy = _Spy(monkeypatch)
    mapped = []
    real_mapped = reader._read_tensor_mapped
    monkeypatch.setattr(reader, "_read_tensor_mapped", lambda *a: mapped.append(a[1]) or real_mapped(*a))
    if why == "cap":
        monkeypatch.setattr(readbuffers, "HOLD_BYTES", 4 * MIB)     # the largest file's buffer: 4 MiB
        monkeypatch.setattr(reader, "PLACE_BATCH_BYTES", 64 * MIB)  # given back only at the end
        monkeypatch.setattr(reader, "TAIL_FLUSH", False)
    elif why == "einval":
        real_open = os.open

        def refuse(path, flags, *a, **kw):
            if flags & os.O_DIRECT:
                raise OSError(errno.EINVAL, "Invalid argument", path)
            return real_open(path, flags, *a, **kw)

        monkeypatch.setattr(os, "open", refuse)
    else:
        monkeypatch.setattr(local, "DIRECT_READS", False)
    target = {k: torch.zeros_like(v) for k, v in saved.items()}
    nxd_ckpt.load_checkpoint(str(tmp_path / "c"), "a", model=target, num_workers=1)
    assert len(spy.reads) == {"cap": 1, "einval": 8, "off": 0}[why], spy.reads
    assert len(mapped) == {"cap": 7, "einval": 8, "off": 8}[why], len(mapped)
    assert_bit_equal(to_cpu_state(saved), to_cpu_state(target))
