"""Large files on a local disk are written with O_DIRECT from a bounce buffer: exact bytes for every length,
buffered where the filesystem refuses, nothing left behind by a failure, and only where it pays."""
import ctypes
import errno
import os

import crc32c
import pytest
import torch

import xser
from nxd_ckpt import writepool
from nxd_ckpt.staging import HostBudget
from nxd_ckpt.storage import local
from nxd_ckpt.storage.local import DIRECT_CHUNK, LocalStorage
from nxd_ckpt.writepool import TaskQueue, WritePool

EXT4, TMPFS, NFS, LUSTRE = 0xEF53, 0x01021994, 0x6969, 0x0BD00BD0
MIB = 1 << 20


@pytest.fixture
def direct_ok(tmp_path):
    """Skip where tmp_path's filesystem refuses O_DIRECT (tmpfs before Linux 6.6): what a test asserts about direct
    writes cannot happen there."""
    try:
        os.close(os.open(tmp_path / "probe", os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o644))
    except OSError:
        pytest.skip("this filesystem refuses O_DIRECT")
    os.unlink(tmp_path / "probe")


@pytest.fixture
def opened(monkeypatch, tmp_path):
    """The flags each file under tmp_path was first opened with, the filesystem told to be ext4."""
    monkeypatch.setattr(local, "_filesystem_type", lambda p: EXT4)
    flags = {}
    real_open = os.open

    def spy(path, fl, *a, **kw):
        if str(path).startswith(str(tmp_path)) and fl & os.O_CREAT:
            flags.setdefault(os.path.basename(path), fl)      # what was asked first
        return real_open(path, fl, *a, **kw)

    monkeypatch.setattr(os, "open", spy)
    return flags


def _write(storage: LocalStorage, rel: str, pieces, hint: int):
    def produce(f):
        for p in pieces:
            f.write(p)
    return storage.write_file(rel, produce, durable=False, atomic=False, size_hint=hint)


@pytest.mark.parametrize("n", [0, 1, 4095, 4096, 4097, MIB, DIRECT_CHUNK - 1, DIRECT_CHUNK, DIRECT_CHUNK + 1,
                               2 * DIRECT_CHUNK + 12345])
def test_direct_file_holds_exactly_the_bytes_written_for_every_length(tmp_path, opened, n):
    """Header, data in uneven pieces (writable: copied without the GIL) and trailer, as xser writes them."""
    data = os.urandom(n)
    pieces = [b"h" * 333] + [bytearray(data[i:i + 700_001]) for i in range(0, n, 700_001)] + [b"tail"]
    storage = LocalStorage(str(tmp_path))
    rec = _write(storage, "d/f", pieces, hint=2 * MIB)
    expect = b"h" * 333 + data + b"tail"
    assert opened["f"] & os.O_DIRECT
    with open(tmp_path / "d" / "f", "rb") as f:
        assert f.read() == expect
    assert (rec.size, rec.crc32c) == (len(expect), crc32c.crc32c(expect))


@pytest.mark.parametrize("f_type, hint, direct_writes, expected", [
    (EXT4, MIB, True, True), (EXT4, MIB - 1, True, False), (EXT4, 0, True, False), (EXT4, 64 * MIB, False, False),
    (TMPFS, 64 * MIB, True, False), (NFS, 64 * MIB, True, False), (LUSTRE, 64 * MIB, True, False),
    (None, 64 * MIB, True, False)])
def test_only_large_files_on_a_local_disk_are_written_directly(tmp_path, monkeypatch, f_type, hint, direct_writes,
                                                                expected):
    monkeypatch.setattr(local, "_filesystem_type", lambda p: f_type)
    monkeypatch.setattr(local, "DIRECT_WRITES", direct_writes)
    flags = []
    real_open = os.open
    monkeypatch.setattr(os, "open", lambda p, fl, *a: flags.append(fl) or real_open(p, fl, *a))
    _write(LocalStorage(str(tmp_path)), "f", [b"x" * 5000], hint)
    assert bool(flags[0] & os.O_DIRECT) is expected
    assert (tmp_path / "f").read_bytes() == b"x" * 5000


def test_a_filesystem_that_refuses_o_direct_at_open_gets_the_bytes_buffered(tmp_path, opened, monkeypatch):
    spied = os.open

    def refuse(path, fl, *a):
        if fl & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument", path)
        return spied(path, fl, *a)

    monkeypatch.setattr(os, "open", refuse)
    data = os.urandom(DIRECT_CHUNK + 5)
    _write(LocalStorage(str(tmp_path)), "sub/f", [data], hint=8 * MIB)
    assert not opened["f"] & os.O_DIRECT
    assert (tmp_path / "sub" / "f").read_bytes() == data


@pytest.mark.parametrize("refused_at", [0, 1])
def test_a_direct_write_refused_with_einval_goes_on_buffered(tmp_path, opened, monkeypatch, refused_at):
    """A device with another alignment: the chunk refused and every later one are written buffered."""
    real_pwritev, calls = os.pwritev, []

    def pwritev(fd, views, offset):
        calls.append(offset)
        if len(calls) == refused_at + 1:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_pwritev(fd, views, offset)

    monkeypatch.setattr(os, "pwritev", pwritev)
    data = os.urandom(2 * DIRECT_CHUNK + 777)
    _write(LocalStorage(str(tmp_path)), "f", [b"head", data], hint=8 * MIB)
    assert (tmp_path / "f").read_bytes() == b"head" + data


def test_a_failed_direct_write_leaves_no_file_and_gives_its_bounce_buffer_back(tmp_path, opened, monkeypatch):
    storage = LocalStorage(str(tmp_path))
    _write(storage, "warm", [b"w" * 10], hint=8 * MIB)      # one bounce buffer now free
    free = len(local.BOUNCES._free)

    def full(fd, view, offset):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "pwritev", full)
    with pytest.raises(OSError) as err:
        _write(storage, "f", [os.urandom(DIRECT_CHUNK + 1)], hint=8 * MIB)
    assert err.value.errno == errno.ENOSPC
    assert not (tmp_path / "f").exists()
    assert len(local.BOUNCES._free) == free


def test_the_write_pool_hints_each_files_leased_bytes_and_its_tensor_files_load(tmp_path, opened):
    """A save's large tensor files go direct and load bit-exact with xser; a small one stays buffered."""
    big, small = torch.randn(700, 1000), torch.randn(10)
    budget = HostBudget(64 * MIB)
    q = TaskQueue()
    for name, t in (("big.pt", big), ("small.pt", small)):
        q.add(writepool.tensor_task(name, t, budget.lease(t.numel() * t.element_size(), timeout=5)))
    q.close()
    res = WritePool().write_all(q, LocalStorage(str(tmp_path)), "w", workers=2)
    assert res.error is None
    assert opened["big.pt"] & os.O_DIRECT and not opened["small.pt"] & os.O_DIRECT
    for name, t in (("big.pt", big), ("small.pt", small)):
        assert torch.equal(xser.read_tensor(str(tmp_path / "w" / name)), t)
        assert (tmp_path / "w" / name).read_bytes() == xser.tensor_to_bytes(t)


def test_a_direct_files_blocks_are_reserved_first_and_what_it_did_not_use_is_freed(tmp_path, opened, monkeypatch):
    """Reserved in one piece (KEEP_SIZE: the size stays that of the bytes written), then cut to the bytes written:
    a size hint larger than the file leaves no allocated blocks behind it."""
    reserved = []
    real = local._fallocate()
    monkeypatch.setattr(local, "_fallocate", lambda: lambda fd, mode, off, n: reserved.append((mode, off, n)) or
                        real(fd, mode, off, n))
    _write(LocalStorage(str(tmp_path)), "f", [b"x" * 5000], hint=64 * MIB)
    assert reserved == [(1, 0, 64 * MIB + 4096)]
    st = os.stat(tmp_path / "f")
    assert st.st_size == 5000
    assert st.st_blocks * 512 <= 8192


def test_without_fallocate_a_direct_file_is_written_all_the_same(tmp_path, opened, monkeypatch):
    monkeypatch.setattr(local, "_fallocate", lambda: None)
    data = os.urandom(DIRECT_CHUNK + 3)
    _write(LocalStorage(str(tmp_path)), "f", [data], hint=8 * MIB)
    assert (tmp_path / "f").read_bytes() == data


def _direct_save_rank(rank, world, root):
    """Two DP ranks save a model of 2.4 MB tensors asynchronously (its files split between them), on a filesystem
    told to be ext4 (so O_DIRECT is asked for whatever the test machine's /tmp is), then load it back. Returns
    (O_DIRECT asked, last two parts of the path) of every file this rank created."""
    import nxd_ckpt
    from nxd_ckpt.storage import local as local_mod
    from tiny_models import xla_device

    local_mod._filesystem_type = lambda p: EXT4
    flags = []
    real_open = os.open

    def spy(path, fl, *a, **kw):
        if str(path).endswith(".pt") and fl & os.O_CREAT:
            flags.append((fl, str(path)))
        return real_open(path, fl, *a, **kw)

    os.open = spy
    dev = xla_device()
    gen = torch.Generator().manual_seed(11)
    model = {f"w{i}": torch.randn(600 + i, 1000, generator=gen).to(dev) for i in range(4)}
    model["bias"] = torch.randn(7, generator=gen).to(dev)
    nxd_ckpt.save_checkpoint(root, "step_1", model=model, use_xser=True, async_save=True)
    nxd_ckpt.finalize_checkpoint()
    os.open = real_open
    target = {k: torch.zeros_like(v) for k, v in model.items()}
    nxd_ckpt.load_checkpoint(root, "step_1", model=target)
    for k in model:
        assert torch.equal(target[k].cpu(), model[k].cpu()), k
    return [(bool(fl & os.O_DIRECT), path.rsplit("/", 2)[-2:]) for fl, path in flags]


def test_an_async_save_of_large_tensors_writes_them_directly_and_loads_bit_exact(tmp_path):
    from harness import run_ranks

    root = str(tmp_path / "ckpt")
    per_rank = run_ranks(_direct_save_rank, 2, root, timeout=120)
    direct = [{name for d, (_, name) in opened if d} for opened in per_rank]
    buffered = {name for opened in per_rank for d, (_, name) in opened if not d}
    # the four 2.4 MB tensor files, split between the replicas; the bias, the ref and .info.pt files buffered
    assert direct[0] | direct[1] == {"tensor_0.pt", "tensor_1.pt", "tensor_2.pt", "tensor_3.pt"}
    assert direct[0] and direct[1] and not direct[0] & direct[1]
    assert buffered == {"tensor_4.pt", "dp_rank_00_tp_rank_00_pp_rank_00.pt",
                        "dp_rank_00_tp_rank_00_pp_rank_00.pt.info.pt"}
    # torch-xla's own loader reads the direct-written files
    import torch_xla.utils.serialization as txs

    for name in os.listdir(os.path.join(root, "step_1", "model")):
        if name.endswith(".pt") and not name.endswith(".info.pt"):
            path = os.path.join(root, "step_1", "model", name)
            assert set(txs.load(path)) == {"w0", "w1", "w2", "w3", "bias"}


def test_release_host_buffers_unmaps_the_free_bounce_buffers(tmp_path, opened, monkeypatch):
    """Also when a view of one is still alive: a failed write's traceback holds the slice it was writing."""
    import nxd_ckpt

    storage = LocalStorage(str(tmp_path))

    def full(fd, view, offset):
        raise OSError(errno.ENOSPC, "No space left on device")

    with monkeypatch.context() as m:
        m.setattr(os, "pwritev", full)
        with pytest.raises(OSError) as failed:
            _write(storage, "lost", [os.urandom(DIRECT_CHUNK)], hint=8 * MIB)
    _write(storage, "f", [b"x" * 10], hint=8 * MIB)
    free = len(local.BOUNCES._free)
    assert free >= 1
    assert nxd_ckpt.release_host_buffers() >= free * DIRECT_CHUNK
    assert local.BOUNCES._free == []
    _write(LocalStorage(str(tmp_path)), "g", [b"y" * 10], hint=8 * MIB)    # a new one is mapped when needed
    assert (tmp_path / "g").read_bytes() == b"y" * 10
    assert failed.value.errno == errno.ENOSPC


def test_a_direct_file_that_cannot_be_created_gives_its_bounce_buffer_back(tmp_path, opened):
    storage = LocalStorage(str(tmp_path))
    _write(storage, "warm", [b"w"], hint=8 * MIB)
    free = len(local.BOUNCES._free)
    (tmp_path / "taken").mkdir()                    # a folder where the file should go: the open fails
    with pytest.raises(IsADirectoryError):
        _write(storage, "taken", [b"x"], hint=8 * MIB)
    assert len(local.BOUNCES._free) == free


@pytest.mark.parametrize("huge", [True, False])
def test_a_bounce_buffer_is_aligned_for_huge_pages_or_pages_and_unmaps(monkeypatch, huge):
    monkeypatch.setattr(local, "HUGE_BOUNCES", huge)
    buf, view, addr = local._new_bounce()
    assert addr % (2 * MIB if huge else 4096) == 0
    assert len(view) == DIRECT_CHUNK and len(buf) == DIRECT_CHUNK + (2 * MIB if huge else 0)
    view[:] = b"\x07" * DIRECT_CHUNK                # the whole buffer is writable memory at that address
    assert (ctypes.c_char * 4).from_address(addr + DIRECT_CHUNK - 4).raw == b"\x07" * 4
    view.release()
    buf.close()                                     # no other view of the mapping is left behind
    assert buf.closed


def test_a_kernel_without_huge_pages_gets_a_bounce_buffer_of_small_pages(tmp_path, opened, monkeypatch):
    monkeypatch.setattr(local, "HUGE_BOUNCES", True)
    monkeypatch.setattr(local.mmap, "MADV_HUGEPAGE", 0x7FFF, raising=False)    # advice the kernel refuses
    local.BOUNCES.release()
    data = os.urandom(DIRECT_CHUNK + 5)
    _write(LocalStorage(str(tmp_path)), "f", [data], hint=len(data))
    assert (tmp_path / "f").read_bytes() == data
    local.BOUNCES.release()


# ---- snapshot buffers written from where they are ---------------------------------------------------------
def _placed(nbytes, lead):
    """A uint8 tensor of ``nbytes`` cut from a slab of its own at ``lead`` (as the snapshot pool places one)."""
    return torch.frombuffer(local.PlacedSlabs().cut(nbytes, lead), dtype=torch.uint8)


def _copied(monkeypatch):
    """Bytes that went through the bounce buffer (local._copy), counted."""
    count = [0]
    real = local._copy

    def spy(dst, addr, at, src):
        count[0] += len(src)
        real(dst, addr, at, src)

    monkeypatch.setattr(local, "_copy", spy)
    return count


@pytest.mark.parametrize("shape", [(1024, 1024), (3001, 777), (1_048_577,)])
def test_a_pool_buffer_placed_for_its_file_is_written_without_the_bounce_copy(tmp_path, direct_ok, opened,
                                                                            monkeypatch, shape):
    """A snapshot buffer (placed at its file's lead) goes to the disk from where it is: only the header,
    the data's first and last partial blocks and the trailer are copied; the file is byte for byte what torch's
    writer makes. The same tensor placed 64 bytes off goes through the bounce buffer."""
    from nxd_ckpt.staging import HostBufferPool
    from nxd_ckpt.writepool import tensor_file_lead

    src = torch.randn(shape)
    expect = xser.tensor_to_bytes(src)
    pool = HostBufferPool(1 << 30, lead_of=tensor_file_lead)
    placed = pool.empty_like(src).copy_(src)
    assert (placed.data_ptr() - tensor_file_lead(src)) % 4096 == 0
    storage = LocalStorage(str(tmp_path))
    copied = _copied(monkeypatch)
    storage.write_parts("placed.pt", xser.tensor_parts(placed), durable=False, atomic=False)
    assert (tmp_path / "placed.pt").read_bytes() == expect
    assert opened["placed.pt"] & os.O_DIRECT
    assert copied[0] < len(expect) - src.nbytes + 2 * 4096
    copied[0] = 0
    off = _placed(src.nbytes, tensor_file_lead(src) + 64)
    plain = torch.empty(0, dtype=src.dtype).set_(off.untyped_storage(), 0, src.shape).copy_(src)
    storage.write_parts("plain.pt", xser.tensor_parts(plain), durable=False, atomic=False)
    assert (tmp_path / "plain.pt").read_bytes() == expect
    assert copied[0] == len(expect)


@pytest.mark.parametrize("fault", ["einval", "short", "full_bounce"])
def test_an_in_place_write_refused_or_cut_short_still_holds_exactly_the_bytes(tmp_path, direct_ok, opened, monkeypatch,
                                                                            fault):
    """Header, the held middle and the rest go in one pwritev: refused by the device (EINVAL: written buffered),
    written short by the kernel (the rest continues; misaligned, the device refuses it and all is rewritten
    buffered), or after a bounce buffer already filled by a large header (two flushes)."""
    lead = DIRECT_CHUNK + 704 if fault == "full_bounce" else 704
    data = _placed(3 * MIB + 123, lead)
    data.copy_(torch.randint(0, 256, (3 * MIB + 123,), dtype=torch.uint8))
    real_pwritev, calls = os.pwritev, []

    def pwritev(fd, views, offset):
        calls.append(offset)
        if fault == "einval" and len(calls) == 1:
            raise OSError(errno.EINVAL, "Invalid argument")
        if fault == "short" and len(calls) == 1:
            return min(real_pwritev(fd, views, offset), len(views[0]) + 100)   # told short, past a block
        if fault == "short" and offset % 4096 and os.O_DIRECT & __import__("fcntl").fcntl(fd, __import__("fcntl").F_GETFL):
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_pwritev(fd, views, offset)

    monkeypatch.setattr(os, "pwritev", pwritev)
    copied = _copied(monkeypatch)
    view = memoryview((ctypes.c_char * data.numel()).from_address(data.data_ptr())).cast("B")
    head = os.urandom(lead)
    LocalStorage(str(tmp_path)).write_parts("f", [head, view, b"tail"], durable=False, atomic=False)
    assert (tmp_path / "f").read_bytes() == head + data.numpy().tobytes() + b"tail"
    assert copied[0] < lead + 2 * 4096 + 4           # the middle was never copied
    assert len(calls) == {"einval": 2, "short": 3, "full_bounce": 2}[fault]


def test_slab_buffers_sit_at_their_lead_in_huge_page_slabs_and_never_overlap():
    slabs = local.PlacedSlabs(slab_bytes=8 * MIB)
    sizes = [(MIB + 1, 0), (3 * MIB, 64), (MIB, 704), (2 * MIB + 5, 4095), (20 * MIB, 4096 + 128), (MIB, 704)]
    bufs = []
    for i, (n, lead) in enumerate(sizes):
        buf = torch.frombuffer(slabs.cut(n, lead), dtype=torch.uint8)
        assert buf.numel() == n and buf.data_ptr() % 4096 == lead % 4096
        buf.fill_(i + 1)
        bufs.append(buf)
    for i, buf in enumerate(bufs):                  # no buffer was written over by another
        assert int(buf.min()) == int(buf.max()) == i + 1
    starts = sorted((b.data_ptr(), b.numel()) for b in bufs)
    assert all(a + n <= b for (a, n), (b, _) in zip(starts, starts[1:]))
    first = bufs[0].data_ptr()
    assert first % (2 * MIB) == 0                   # a slab starts on a huge page (lead 0)
    assert bufs[1].data_ptr() - first < MIB + 1 + 4096 + 64     # the next is cut right after it
    assert bufs[4].data_ptr() % (2 * MIB) == 128    # larger than a slab: one of its own, at its lead


def test_discarded_pages_of_one_slab_buffer_read_as_zeros_and_spare_its_neighbours():
    slabs = local.PlacedSlabs()
    a, b, c = (torch.frombuffer(slabs.cut(3 * MIB + 100, 704), dtype=torch.uint8) for _ in range(3))
    for t in (a, b, c):
        t.fill_(9)
    local.discard_pages(b.data_ptr(), b.numel())
    inner = -b.data_ptr() % 4096
    whole = (b.numel() - inner) // 4096 * 4096
    assert int(b[inner:inner + whole].max()) == 0                  # its whole pages went back to the OS
    assert int(b[:inner].min()) == int(b[inner + whole:].min()) == 9     # the pages it shares did not
    assert int(a.min()) == int(c.min()) == 9


def test_the_pool_places_only_large_pooled_buffers_and_gives_a_dropped_ones_pages_back(monkeypatch):
    from nxd_ckpt import staging
    from nxd_ckpt.staging import HostBufferPool

    discarded = []
    monkeypatch.setattr(staging, "discard_pages", lambda addr, n: discarded.append((addr, n)))
    pool = HostBufferPool(8 * MIB, lead_of=lambda t: 704)
    big, small = pool.empty_like(torch.empty(MIB)), pool.empty_like(torch.empty(MIB // 4 - 1))
    assert big.data_ptr() % 4096 == 704 and small.data_ptr() % 4096 != 704
    pool.give_back([big, small])
    again = pool.empty_like(torch.empty(MIB))
    assert again.data_ptr() == big.data_ptr()       # kept and reused as placed
    over = pool.empty_like(torch.empty(2 * MIB))    # past the capacity: lent unpooled, from torch's allocator
    assert over.data_ptr() % 4096 != 704
    pool.give_back([again, over])
    assert discarded == []
    pool.release()                                  # the placed buffer leaves the pool: its pages go back
    assert discarded == [(big.data_ptr(), 4 * MIB)]
    pool.keep = False
    lent = pool.empty_like(torch.empty(MIB + 1))
    pool.give_back([lent])                          # not kept: dropped as soon as it is written
    assert discarded[-1] == (lent.data_ptr(), 4 * MIB + 4)


def test_a_placed_buffer_the_kernel_refuses_is_allocated_unplaced(monkeypatch):
    """mmap's ENOMEM (out of mappings or of commit) costs the zero-copy write, never the snapshot."""
    from nxd_ckpt import staging

    def refused(self, nbytes, lead):
        raise OSError(errno.ENOMEM, "Cannot allocate memory")

    monkeypatch.setattr(local.PlacedSlabs, "cut", refused)
    pool = staging.HostBufferPool(1 << 30, lead_of=lambda t: 704)
    buf = pool.empty_like(torch.empty(MIB))
    assert buf.shape == (MIB,) and buf.untyped_storage().nbytes() == 4 * MIB


def test_a_tensor_whose_file_torchs_writer_makes_gets_an_unplaced_buffer():
    """tensor_file_lead is None for what xser's own container does not write (float8 here): such a tensor of
    1 MiB or more is copied into an ordinary buffer, and a save of it works."""
    from nxd_ckpt.staging import HostBufferPool, copy_to_host
    from nxd_ckpt.writepool import tensor_file_lead

    src = torch.randn(MIB).to(torch.float8_e4m3fn)
    assert tensor_file_lead(src) is None
    pool = HostBufferPool(1 << 30, lead_of=tensor_file_lead)
    (host,) = copy_to_host([src], pool)
    assert torch.equal(host.view(torch.uint8), src.view(torch.uint8))
    assert not pool._placed


def _vma_flags(address):
    """The VmFlags of the mapping of this process that holds ``address`` (/proc/self/smaps)."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and all(c in "0123456789abcdef-" for c in head):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= address < hi
            elif inside and line.startswith("VmFlags:"):
                return line.split()[1:]
    return None


@pytest.mark.skipif(not hasattr(local.mmap, "MADV_NOHUGEPAGE") or not os.path.exists("/proc/self/smaps"),
                    reason="Linux transparent huge pages")
def test_a_discarded_buffer_s_huge_page_regions_stop_asking_for_huge_pages():
    """Else khugepaged, which rebuilds a huge page around any page still present, would fault the dropped pages
    back in next to a live neighbour."""
    slabs = local.PlacedSlabs(slab_bytes=16 * MIB)
    a, b, c = (torch.frombuffer(slabs.cut(3 * MIB + 100, 704), dtype=torch.uint8) for _ in range(3))
    local.discard_pages(b.data_ptr(), b.numel())
    assert "nh" in _vma_flags(b.data_ptr() + MIB)
    assert "hg" in _vma_flags(a.data_ptr()) and "nh" not in _vma_flags(a.data_ptr())    # 2 MiB away from b


def test_release_unmaps_the_slabs_once_their_buffers_are_freed():
    import gc

    from nxd_ckpt.staging import HostBufferPool

    pool = HostBufferPool(1 << 30, lead_of=lambda t: 704)
    buf = pool.empty_like(torch.empty(MIB))
    address = buf.data_ptr()
    pool.give_back([buf])
    del buf
    assert _vma_flags(address) is not None
    pool.release()
    gc.collect()
    assert _vma_flags(address) is None          # the current slab too: nothing holds it any more
