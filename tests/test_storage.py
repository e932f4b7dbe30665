"""The storage interface, the same assertions on every backend: POSIX, in-memory objects, shared-directory
objects."""
import os
import subprocess
import sys

import crc32c
import pytest
import torch

import nxd_ckpt
from nxd_ckpt import storage as storage_pkg
from nxd_ckpt.storage import AlreadyExistsError, LocalStorage, ObjectStorage, open_storage
from nxd_ckpt.storage.objects import memory_bucket
from nxd_ckpt.storage.testing import enable_test_schemes

enable_test_schemes()


@pytest.fixture(params=["posix", "mem", "objdir"])
def storage(request, tmp_path):
    if request.param == "posix":
        return open_storage(str(tmp_path / "root"))
    if request.param == "mem":
        s = open_storage(f"mem://{request.node.name.replace('[', '-').rstrip(']')}/some/prefix")
        s.bucket.page_size = 3            # listing must paginate
        return s
    s = open_storage(f"objdir://{tmp_path}/bucket//pre")
    s.bucket.page_size = 3
    return s


def test_write_records_size_and_crc32c_of_the_bytes(storage):
    rec = storage.write_file("a/b/c.bin", lambda f: (f.write(b"hello "), f.write(memoryview(b"world"))))
    assert (rec.relpath, rec.size, rec.crc32c) == ("a/b/c.bin", 11, crc32c.crc32c(b"hello world"))
    assert storage.read("a/b/c.bin") == b"hello world"
    assert storage.read("a/b/c.bin", 6, 3) == b"wor"
    assert storage.stat("a/b/c.bin").size == 11


def test_write_parts_records_and_writes_the_parts_in_order(storage):
    data = memoryview(bytearray(range(256)) * 40)
    rec = storage.write_parts("x/p.bin", (b"head", data, b"", b"tail"))
    want = b"head" + bytes(data) + b"tail"
    assert (rec.relpath, rec.size, rec.crc32c) == ("x/p.bin", len(want), crc32c.crc32c(want))
    assert storage.read("x/p.bin") == want
    assert storage.write_bytes("x/b.bin", b"abc").crc32c == crc32c.crc32c(b"abc")


def test_posix_write_parts_finishes_a_short_writev(tmp_path, monkeypatch):
    """writev may write less than asked (a signal, the last bytes of a full disk): the rest follows."""
    real = os.writev
    monkeypatch.setattr(os, "writev", lambda fd, views: real(fd, [bytes(b"".join(views))[:5]]))
    storage = LocalStorage(str(tmp_path))
    rec = storage.write_parts("s.bin", (b"abc", b"defgh", b"ijklmnop"), durable=False, atomic=False)
    assert (tmp_path / "s.bin").read_bytes() == b"abcdefghijklmnop" and rec.size == 16


def test_listing_directories_and_deletion(storage):
    names = [f"t/model/f{i}.pt" for i in range(7)] + ["t/done", "u/x", "top"]
    for n in names:
        storage.write_bytes(n, n.encode())
    assert storage.list("t") == sorted(n for n in names if n.startswith("t/"))
    assert storage.list("") == sorted(names)
    assert storage.listdir("") == ["t", "top", "u"]
    assert storage.listdir("t") == ["done", "model"]
    assert storage.isdir("t/model") and not storage.isdir("t/done") and not storage.isdir("nope")
    assert storage.exists("t") and storage.exists("t/done") and not storage.exists("t/missing")
    storage.remove_tree("t")
    assert storage.list("") == ["top", "u/x"]
    storage.delete_many(["top", "u/x", "not/there"])
    assert storage.list("") == []


def test_failed_producer_leaves_nothing_under_the_key(storage):
    storage.write_bytes("k", b"old")

    def boom(f):
        f.write(b"partial")
        raise RuntimeError("producer failed")

    with pytest.raises(RuntimeError, match="producer failed"):
        storage.write_file("k", boom)
    assert storage.read("k") == b"old"


def test_exclusive_write_refuses_an_existing_key(storage):
    storage.write_bytes("done", b"1", exclusive=True)
    with pytest.raises(AlreadyExistsError):
        storage.write_bytes("done", b"2", exclusive=True)
    assert storage.read("done") == b"1"


def test_missing_key_is_file_not_found(storage):
    with pytest.raises(FileNotFoundError):
        storage.read("nope")
    with pytest.raises(FileNotFoundError):
        storage.stat("nope")


def test_open_local_holds_the_file_open_where_the_backend_is_local(storage):
    storage.write_bytes("d/f", b"0123456789")
    with storage.open_local("d/f") as local:
        if not storage.caps.local:
            assert local is None             # object stores: no local file, callers read through the store
            return
        storage.write_bytes("d/f", b"replaced")  # a new file under the name: the one held open is unchanged
        assert local.size == 10 and local.pread(4, 3) == b"3456" and local.pread(9, 8) == b"89"
        with open(local.path, "rb") as f:
            assert f.read() == b"0123456789"
    with pytest.raises(FileNotFoundError):
        with storage.open_local("d/nope"):
            pass


def test_capabilities():
    assert LocalStorage("/tmp").caps.rename and LocalStorage("/tmp").caps.local
    obj = open_storage("mem://caps/x")
    assert isinstance(obj, ObjectStorage) and not obj.caps.rename and obj.local_path("a") is None
    with pytest.raises(NotImplementedError, match="marker commit"):
        obj.rename("a", "b")


def test_unsupported_url_is_refused_clearly():
    from nxd_ckpt.errors import CheckpointArgumentError

    with pytest.raises(CheckpointArgumentError, match="ftp:// URL"):
        open_storage("ftp://host/x")


TEST_URLS = ["mem://b/run/ckpt", "objdir:///tmp/bucket//run"]


@pytest.mark.parametrize("url", TEST_URLS)
@pytest.mark.parametrize("call", [
    lambda u: nxd_ckpt.save_checkpoint(u, "step_1", model={"w": torch.ones(2)}),
    lambda u: nxd_ckpt.load_checkpoint(u, "step_1", model={}),
    lambda u: nxd_ckpt.has_checkpoint(u),
    lambda u: nxd_ckpt.list_checkpoints(u),
    lambda u: nxd_ckpt.newest_checkpoint(u),
    lambda u: open_storage(u),
], ids=["save", "load", "has", "list", "newest", "open_storage"])
def test_test_only_schemes_are_refused_unless_a_test_enables_them(monkeypatch, url, call):
    """mem:// would "save" into process memory and lose it at exit: without the testing hook it is refused
    like any other unknown scheme, before anything is written."""
    monkeypatch.setattr(storage_pkg, "_ENABLED_TEST_SCHEMES", set())
    scheme = url.split("://")[0]
    with pytest.raises(nxd_ckpt.CheckpointArgumentError, match=f"{scheme}:// URL, which nxd-ckpt does not serve"):
        call(url)


def test_the_library_never_enables_test_schemes_itself():
    """A fresh process that imports everything the user can reach still refuses mem:// and objdir://."""
    code = ("import nxd_ckpt, nxd_ckpt.cli, nxd_ckpt.storage as s\n"
            "for u in ('mem://b/x', 'objdir:///tmp/b//x'):\n"
            "    try:\n        s.open_storage(u)\n    except nxd_ckpt.CheckpointArgumentError as e:\n"
            "        print('refused', e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "PJRT_DEVICE": "CPU"}).stdout
    assert out.count("does not serve") == 2, out


def test_posix_staging_write_is_in_place_and_synced_in_batch(tmp_path):
    s = LocalStorage(str(tmp_path))
    s.write_file("stage/f", lambda f: f.write(b"x" * 10), durable=False, atomic=False)
    assert os.listdir(tmp_path / "stage") == ["f"]      # no temporary name
    s.sync_files(["stage/f"])
    assert (tmp_path / "stage" / "f").read_bytes() == b"x" * 10


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="sync_file_range is Linux-only")
@pytest.mark.parametrize("fs_type, own, beside, small_started", [
    (0xEF53, True, True, True),         # ext4, an async save: every file, by its writer at the save's niceness
    (0x58465342, True, True, True),     # xfs
    (0xEF53, True, False, False),       # a save the caller waits for, an offline tool: large files only
    (0xEF53, False, True, False),       # OWN_WRITEBACK off: files of WRITEBACK_MIN_BYTES or more only
    (0x01021994, True, True, False),    # tmpfs: no disk behind it, large files only (as before)
    (0x6969, True, True, False),        # NFS: large files only
])
def test_batch_files_start_their_writeback_as_they_are_closed(tmp_path, monkeypatch, fs_type, own, beside,
                                                              small_started):
    """A file written for the batch sync (durable=False) has its writeback started on its own descriptor before
    it is closed: during an async save on a disk of this host every file (OWN_WRITEBACK), else files of
    WRITEBACK_MIN_BYTES or more; never a file synced at once. ``starts_writeback`` says the same, so DCP's writer
    does not hint them again."""
    from nxd_ckpt.storage import local

    started = []
    real = local._start_writeback_fd

    def spy(fd):
        started.append(os.readlink(f"/proc/self/fd/{fd}"))
        return real(fd)

    monkeypatch.setattr(local, "_start_writeback_fd", spy)
    monkeypatch.setattr(local, "_filesystem_type", lambda p: fs_type)
    monkeypatch.setattr(local, "OWN_WRITEBACK", own)
    s = LocalStorage(str(tmp_path))
    s.beside_training = beside
    big = os.urandom(local.WRITEBACK_MIN_BYTES)
    s.write_file("stage/big", lambda f: f.write(big), durable=False, atomic=False)
    s.write_file("stage/small", lambda f: f.write(big[:-1]), durable=False, atomic=False)
    s.write_file("synced", lambda f: f.write(big))
    s.sync_files(["stage/big", "stage/small"])
    want = [str(tmp_path / "stage" / "big")] + ([str(tmp_path / "stage" / "small")] if small_started else [])
    assert started == want
    assert s.starts_writeback(len(big)) and s.starts_writeback(len(big) - 1) == small_started
    assert (tmp_path / "stage" / "big").read_bytes() == big and (tmp_path / "synced").read_bytes() == big
    assert (tmp_path / "stage" / "small").read_bytes() == big[:-1]
    fd = os.open(__file__, os.O_RDONLY)
    try:
        assert real(fd) is True        # available on this kernel (else the lever would silently do nothing)
    finally:
        os.close(fd)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="sync_file_range is Linux-only")
@pytest.mark.parametrize("async_save", [True, False])
def test_only_an_async_save_starts_the_writeback_of_its_small_files(tmp_path, monkeypatch, async_save):
    """save_checkpoint marks its storage ``beside_training`` when async: then each small tensor file's writeback
    is started by its writer; a synchronous save leaves small files to the batch's sync (the caller waits)."""
    from nxd_ckpt.storage import local

    started = []
    monkeypatch.setattr(local, "_start_writeback_fd", lambda fd: started.append(os.readlink(f"/proc/self/fd/{fd}")))
    monkeypatch.setattr(local, "_filesystem_type", lambda p: 0xEF53)
    model = {"w": torch.arange(6.0), "b": torch.ones(3)}
    nxd_ckpt.save_checkpoint(str(tmp_path), "t", model=model, async_save=async_save, use_xser=True)
    nxd_ckpt.finalize_checkpoint()
    tensor_files = sorted(os.path.basename(p) for p in started if ".tensors/" in p)
    assert tensor_files == (["tensor_0.pt", "tensor_1.pt"] if async_save else [])
    got = {}
    nxd_ckpt.load_checkpoint(str(tmp_path), "t", model=got, strict=False)
    assert torch.equal(got["w"], model["w"]) and torch.equal(got["b"], model["b"])


def _count_syncs(monkeypatch):
    from nxd_ckpt.storage import local

    calls = {"syncfs": 0, "fdatasync": []}
    real_syncfs, real_fdatasync = local._syncfs, local._fdatasync

    def syncfs(fd):
        calls["syncfs"] += 1
        real_syncfs(fd)

    def fdatasync(path):
        calls["fdatasync"].append(os.path.basename(path))
        real_fdatasync(path)

    monkeypatch.setattr(local, "_syncfs", syncfs)
    monkeypatch.setattr(local, "_fdatasync", fdatasync)
    return calls


def _write_three(s):
    for name in ("a", "b", "c"):
        s.write_file(f"stage/sub/{name}", lambda f: f.write(b"x" * 10), durable=False, atomic=False)
    s.sync_files([f"stage/sub/{n}" for n in ("a", "b", "c")])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="syncfs is Linux-only")
def test_posix_batch_is_made_durable_by_one_syncfs_on_a_local_filesystem(tmp_path, monkeypatch):
    from nxd_ckpt.storage import local

    fd = os.open(tmp_path, os.O_RDONLY)
    try:
        if not local._syncfs_usable(fd):
            pytest.skip("the test directory is not on ext4/xfs/btrfs/tmpfs or the kernel is older than 5.8")
    finally:
        os.close(fd)
    calls = _count_syncs(monkeypatch)
    s = LocalStorage(str(tmp_path))
    _write_three(s)
    assert calls == {"syncfs": 1, "fdatasync": []}
    _write_three(s)                       # the next batch arms a new anchor
    assert calls == {"syncfs": 2, "fdatasync": []}
    assert sorted(os.listdir(tmp_path / "stage" / "sub")) == ["a", "b", "c"]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="syncfs is Linux-only")
def test_start_sync_uses_a_descriptor_of_its_own_and_its_error_is_raised_by_sync_files(tmp_path, monkeypatch):
    """The early sync runs ``syncfs`` on a new descriptor of the batch's folder, not on the batch's anchor (whose
    view of writeback errors ``sync_files`` reports); a failure it gets is not raised there but by the batch's
    ``sync_files``, even when the final ``syncfs`` succeeds (the kernel reports some errors only once)."""
    from nxd_ckpt.storage import local

    s = LocalStorage(str(tmp_path))
    s.write_file("stage/a", lambda f: f.write(b"x"), durable=False, atomic=False)
    if s._anchor._fd is None:
        pytest.skip("no syncfs anchor: the test directory is not on ext4/xfs/btrfs/tmpfs or the kernel is older than 5.8")
    seen = []

    def syncfs_failing_once(fd):
        seen.append((fd, os.readlink(f"/proc/self/fd/{fd}")))
        if len(seen) == 1:
            raise OSError(5, "syncfs: Input/output error (injected)")

    monkeypatch.setattr(local, "_syncfs", syncfs_failing_once)
    s.start_sync()
    assert len(seen) == 1 and seen[0][0] != s._anchor._fd and seen[0][1] == str(tmp_path / "stage")
    with pytest.raises(OSError, match="injected"):
        s.sync_files(["stage/a"])
    s.write_file("stage/b", lambda f: f.write(b"y"), durable=False, atomic=False)
    s.sync_files(["stage/b"])                               # the next batch starts clean


def test_start_sync_does_nothing_where_the_batch_is_not_synced_by_syncfs(tmp_path, monkeypatch):
    from nxd_ckpt.storage import local

    monkeypatch.setattr(local, "_syncfs", lambda fd: pytest.fail("syncfs called"))
    s = LocalStorage(str(tmp_path))
    s.start_sync()                                          # nothing written yet: no anchor
    monkeypatch.setattr(local, "_syncfs_usable", lambda fd: False)     # NFS, Lustre, FUSE
    s.write_file("stage/a", lambda f: f.write(b"x"), durable=False, atomic=False)
    s.start_sync()


def test_posix_sync_anchor_is_closed_when_nobody_takes_it(tmp_path):
    import gc

    s = LocalStorage(str(tmp_path))
    s.write_file("stage/a", lambda f: f.write(b"x"), durable=False, atomic=False)
    fd = s._anchor._fd
    if fd is None:
        pytest.skip("no syncfs anchor on this filesystem")
    assert os.readlink(f"/proc/self/fd/{fd}") == str(tmp_path / "stage")
    del s
    gc.collect()
    try:                                   # closed (or the number reused by something else meanwhile)
        assert os.readlink(f"/proc/self/fd/{fd}") != str(tmp_path / "stage")
    except FileNotFoundError:
        pass


def test_posix_batch_falls_back_to_fdatasync_per_file_elsewhere(tmp_path, monkeypatch):
    from nxd_ckpt.storage import local

    monkeypatch.setattr(local, "_syncfs_usable", lambda fd: False)       # NFS, Lustre, FUSE, old kernels
    calls = _count_syncs(monkeypatch)
    _write_three(LocalStorage(str(tmp_path)))
    assert calls["syncfs"] == 0 and sorted(calls["fdatasync"]) == ["a", "b", "c"]


def test_posix_syncfs_failure_is_raised(tmp_path, monkeypatch):
    import errno

    from nxd_ckpt.storage import local

    monkeypatch.setattr(local, "_syncfs_usable", lambda fd: True)

    class Libc:
        def syncfs(self, fd):
            import ctypes

            ctypes.set_errno(errno.EIO)
            return -1

    monkeypatch.setattr(local, "_libc", lambda: Libc())
    s = LocalStorage(str(tmp_path))
    with pytest.raises(OSError, match="syncfs: Input/output error"):
        _write_three(s)
    assert s._anchor.take() == (None, None, None)     # the anchor was closed and disarmed


def test_memory_buckets_are_shared_by_name():
    a = open_storage("mem://shared-bucket/p")
    a.write_bytes("x", b"1")
    assert open_storage("mem://shared-bucket/p").read("x") == b"1"
    assert memory_bucket("shared-bucket").get("p/x") == b"1"


def test_local_blocks_read_one_open_file_into_one_buffer(tmp_path, monkeypatch):
    """A streaming pass (crc32c, verify's per-record check) over a local file opens it once and reads every block
    into the same buffer; the base class's ranged blocks give the same bytes and checksum."""
    import builtins

    import crc32c as crc32c_mod

    from nxd_ckpt.storage import base, local

    data = os.urandom(5500)
    (tmp_path / "f").write_bytes(data)
    monkeypatch.setattr(local, "READ_BLOCK", 1000)
    monkeypatch.setattr(base, "READ_BLOCK", 1000)
    opened = []
    monkeypatch.setattr(local, "open", lambda *a, **k: opened.append(a[0]) or builtins.open(*a, **k), raising=False)
    store = local.LocalStorage(str(tmp_path))
    blocks = [(bytes(b), b.obj) for b in store.blocks("f")]
    assert [len(b) for b, _ in blocks] == [1000] * 5 + [500] and b"".join(b for b, _ in blocks) == data
    assert len({id(o) for _, o in blocks}) == 1 and opened == [str(tmp_path / "f")]
    assert store.crc32c("f") == (5500, crc32c_mod.crc32c(data))
    ranged = [bytes(b) for b in base.Storage.blocks(store, "f")]
    assert ranged == [b for b, _ in blocks] and len(opened) == 1 + 1 + 6     # crc32c once, then a read per block
