"""The load pipeline (reader.read_tensors): tensors go to their device in batches while the reads go on, the
host holds only the files in flight plus one batch, and damage found mid-pipeline raises naming the file with
nothing applied."""
from __future__ import annotations

import os
import threading

import pytest
import torch

from tiny_models import assert_bit_equal, to_cpu_state, xla_device

SHARD = "model/dp_rank_00_tp_rank_00_pp_rank_00.pt"


def _state(dev):
    """Tensors of distinct sizes (read largest first), each above no threshold that matters here."""
    g = torch.Generator().manual_seed(7)
    return {f"w{i}": torch.randn(64 + 16 * i, 32, generator=g).to(dev) for i in range(10)}


def test_damage_found_mid_pipeline_names_the_file_and_applies_nothing(tmp_path, monkeypatch):
    import nxd_ckpt
    from nxd_ckpt import reader

    dev = xla_device()
    root = str(tmp_path / "ckpt")
    nxd_ckpt.save_checkpoint(root, "a", model=_state(dev), use_xser=True)
    # w0 is the smallest tensor: read last, after the others went to the device
    tensors = os.path.join(root, "a", f"{SHARD}.tensors")
    smallest = min(os.listdir(tensors), key=lambda n: os.path.getsize(os.path.join(tensors, n)))
    path = os.path.join(tensors, smallest)
    data = bytearray(open(path, "rb").read())
    data[-40] ^= 0x01          # inside the tensor's data record, before the zip's directory
    open(path, "wb").write(bytes(data))

    placed = []
    original = reader._to_device
    monkeypatch.setattr(reader, "PLACE_BATCH_BYTES", 1)       # every tensor is its own batch
    monkeypatch.setattr(reader, "GROUP_BYTES", 0)             # and its own read task
    monkeypatch.setattr(reader, "_to_device", lambda batch, targets: (placed.extend(t for t, _ in batch),
                                                                         original(batch, targets))[1])
    target = _state(dev)
    before = {k: v for k, v in target.items()}
    want = to_cpu_state(target)
    with pytest.raises(nxd_ckpt.CorruptCheckpointError) as info:
        nxd_ckpt.load_checkpoint(root, "a", model=target, num_workers=1)
    rel = f"a/{SHARD}.tensors/{smallest}"
    assert info.value.path == rel and rel in str(info.value), str(info.value)
    assert "fails its checksum" in str(info.value)
    assert len(placed) >= 5, f"the damage should be found after other tensors went to the device: {placed}"
    assert all(target[k] is before[k] for k in before), "a tensor of the target was replaced"
    assert_bit_equal(want, to_cpu_state(target))


def test_load_moves_tensors_while_reading_and_is_bit_exact(tmp_path, monkeypatch):
    import nxd_ckpt
    from nxd_ckpt import reader

    dev = xla_device()
    root = str(tmp_path / "ckpt")
    saved = _state(dev)
    nxd_ckpt.save_checkpoint(root, "a", model=saved, use_xser=True)
    batches = []
    original = reader._to_device
    monkeypatch.setattr(reader, "PLACE_BATCH_BYTES", 100_000)
    monkeypatch.setattr(reader, "_to_device", lambda batch, targets: (batches.append(len(batch)),
                                                                         original(batch, targets))[1])
    target = {k: torch.zeros_like(v) for k, v in saved.items()}
    nxd_ckpt.load_checkpoint(root, "a", model=target, num_workers=2)
    assert sum(batches) == len(saved) and len([b for b in batches if b]) > 1, batches
    assert all(v.device.type == "xla" for v in target.values())
    assert_bit_equal(to_cpu_state(saved), to_cpu_state(target))


class _CountingReader:
    """A reader whose tensor files are synthetic, counting the host tensors alive (read, not yet moved)."""

    manifest = None

    def __init__(self):
        self.lock = threading.Lock()
        self.alive = 0
        self.most = 0

    def load_tensor(self, rel):
        with self.lock:
            self.alive += 1
            self.most = max(self.most, self.alive)
        return torch.full((1000,), float(rel.rsplit("_", 1)[1]))   # 4,000 bytes

    def load_tensor_direct(self, rel, buffers):
        return None             # no direct reads: load_tensor reads every file


def test_host_memory_holds_the_files_in_flight_plus_one_batch(monkeypatch):
    from concurrent.futures import ThreadPoolExecutor

    from nxd_ckpt import reader

    fake = _CountingReader()

    def to_device(batch, targets):
        with fake.lock:
            fake.alive -= len(batch)
        return {tid: t.clone() for tid, t in batch}     # the "device" copy; the host one is dropped

    monkeypatch.setattr(reader, "_to_device", to_device)
    jobs = {tid: f"model/x.pt.tensors/tensor_{tid}" for tid in range(60)}
    workers = 2
    with ThreadPoolExecutor(workers) as pool:
        out = reader.read_tensors(fake, jobs, pool, workers, targets={t: "dev" for t in jobs}, batch_bytes=3 * 4000)
    assert sorted(out) == list(range(60))
    assert all(torch.equal(out[t], torch.full((1000,), float(t))) for t in out)
    # at most 2 * workers reads in flight, plus a batch of 3 tensors waiting for its transfer
    assert fake.most <= 2 * workers + 3, fake.most
    assert fake.alive == 0


@pytest.mark.parametrize("tail_flush", [True, False])
def test_the_last_reads_move_to_the_device_as_each_finishes(monkeypatch, tail_flush):
    """Once every read is handed out, what is held moves at once and each later read on its own (the transfers
    overlap the last reads); without TAIL_FLUSH the rest moved as one batch after the last read."""
    from concurrent.futures import ThreadPoolExecutor

    from nxd_ckpt import reader

    monkeypatch.setattr(reader, "TAIL_FLUSH", tail_flush)
    batches = []
    monkeypatch.setattr(reader, "_to_device", lambda batch, targets: (batches.append(len(batch)),
                                                                         {tid: t for tid, t in batch})[1])
    jobs = {tid: f"model/x.pt.tensors/tensor_{tid}" for tid in range(60)}
    with ThreadPoolExecutor(2) as pool:     # 2 workers: 4 reads in flight; the batch size is never reached
        out = reader.read_tensors(_CountingReader(), jobs, pool, 2, targets={t: "dev" for t in jobs}, batch_bytes=1 << 30)
    assert sorted(out) == list(range(60))
    assert [b for b in batches if b] == ([56, 1, 1, 1, 1] if tail_flush else [60])


def test_shard_info_comes_from_the_manifest_without_reading_the_info_file(tmp_path, monkeypatch):
    """The .info.pt entries the load uses are built from the manifest (no per-tensor safe unpickling), equal to
    the file's own, expert and partition attributes included; a manifest without tensor records falls back to
    the file."""
    import dataclasses

    import nxd_ckpt
    from nxd_ckpt import layout, reader
    from nxd_ckpt import manifest as manifest_mod
    from nxd_ckpt.storage.local import LocalStorage

    dev = xla_device()
    root = str(tmp_path / "ckpt")
    state = _state(dev)
    state["w3"].expert_model_parallel = True
    nxd_ckpt.save_checkpoint(root, "a", model=state, use_xser=True)
    storage = LocalStorage(root)
    man = manifest_mod.read(storage, "a")
    rd = reader.FileReader(storage, "a", man)
    from_file = rd.load_pickle(layout.info_path(SHARD))
    tids = sorted(from_file)
    assert any(e["expert_model_parallel"] for e in from_file.values())

    read = []
    original = reader.FileReader.load_pickle
    monkeypatch.setattr(reader.FileReader, "load_pickle", lambda self, rel: (read.append(rel), original(self, rel))[1])
    assert reader.shard_info(rd, SHARD, tids) == from_file
    assert read == []
    bare = reader.FileReader(storage, "a", dataclasses.replace(man, tensors={}))
    assert reader.shard_info(bare, SHARD, tids) == from_file
    assert read == [layout.info_path(SHARD)]
    # the offline tools' view (FileReader.tensor_metas): the manifest's records, keys included, else the file's
    metas, keyed = rd.tensor_metas(SHARD)
    assert keyed and sorted(m.key for m in metas.values()) == sorted(state)
    from_info, keyed = bare.tensor_metas(SHARD)
    assert not keyed and sorted(from_info) == tids and all(m.key == "" for m in from_info.values())
    assert {t: manifest_mod.info_entry(m.dtype, m.shape, m.attrs) for t, m in from_info.items()} == from_file
    assert bare.tensor_metas(SHARD, info_file=False) == ({}, False)

    read.clear()
    target = {k: torch.zeros_like(v) for k, v in state.items()}
    nxd_ckpt.load_checkpoint(root, "a", model=target)
    assert layout.info_path(SHARD) not in read and SHARD in read, read
    assert_bit_equal(to_cpu_state(state), to_cpu_state(target))


def test_plain_shard_pipe_refuses_a_tensor_reaching_past_its_storage_record(tmp_path):
    """A plain shard's pickle that lays a tensor beyond its storage record (a file written wrong: every record's
    checksum is right) is an error naming the tensor, as torch.load's would be, not a view of the next record."""
    import nxd_ckpt
    import xser
    from nxd_ckpt import manifest as manifest_mod
    from nxd_ckpt import plainpipe
    from nxd_ckpt.errors import CorruptCheckpointError
    from nxd_ckpt.storage.local import LocalStorage

    root = str(tmp_path / "ckpt")
    nxd_ckpt.save_checkpoint(root, "a", model={"w": torch.arange(8.0), "b": torch.ones(4)}, use_xser=False)
    entry = manifest_mod.read(LocalStorage(root), "a").files[SHARD]
    assert entry.ranges, "the save records the CRC32C of each zip record"
    raw = open(os.path.join(root, "a", SHARD), "rb").read()

    def run(shrink: int):
        def unpickle(pkl):
            data, storages = xser.unpickle_meta(pkl)
            cdata = data["w"].untyped_storage()._cdata
            storages[cdata] = (storages[cdata][0], storages[cdata][1] - shrink)
            return data, storages

        buf = torch.empty(entry.size, dtype=torch.uint8)
        buf.numpy()[:] = memoryview(raw)
        pipe = plainpipe.RecordPipe(buf, entry, SHARD, "", unpickle)
        got = dict(pipe.landed(0, entry.size))
        pipe.finish()
        return {pipe.ref_data[k].tid: k for k in ("w", "b")}, got

    names, got = run(0)
    assert {names[t]: v.tolist() for t, v in got.items()} == {"w": list(range(8)), "b": [1.0] * 4}
    with pytest.raises(CorruptCheckpointError, match=r"tensor 0 reaching byte 32 of its storage record \S+, which "
                                                     r"holds 28 bytes"):
        run(4)


def test_a_file_of_the_expected_size_is_read_in_one_call_and_a_longer_or_shorter_one_shows(tmp_path, monkeypatch):
    from nxd_ckpt.storage.local import LocalStorage

    storage = LocalStorage(str(tmp_path))
    calls = []
    preadv = os.preadv
    monkeypatch.setattr(os, "preadv", lambda fd, bufs, off: (calls.append(off), preadv(fd, bufs, off))[1])
    for name, size in (("exact", 1000), ("longer", 1003), ("shorter", 997)):
        (tmp_path / name).write_bytes((bytes(range(256)) * 4)[:size])
        calls.clear()
        buf = bytearray(1001)                       # the expected 1000 bytes and one more
        got = storage.read_into(name, memoryview(buf), 0, expect=1000)
        assert got == min(size, 1001) and bytes(buf[:got]) == (bytes(range(256)) * 4)[:got]
        # no read only to confirm the end of a file of the expected size; a short one is read until its end
        assert len(calls) == {"exact": 1, "longer": 1, "shorter": 2}[name], (name, calls)


def test_a_longer_file_shows_when_its_size_is_a_whole_number_of_read_blocks(tmp_path, monkeypatch):
    """read_buffer reads in READ_BLOCK pieces into a buffer one byte longer than the manifest's size: when the size
    is a multiple of the block, the extra byte goes with the last piece (alone, it was never read)."""
    import nxd_ckpt
    from nxd_ckpt import manifest as manifest_mod
    from nxd_ckpt import reader
    from nxd_ckpt.errors import CorruptCheckpointError
    from nxd_ckpt.storage.local import LocalStorage

    root = str(tmp_path / "ckpt")
    nxd_ckpt.save_checkpoint(root, "a", model={"w": torch.arange(3000.0)}, use_xser=True)
    storage = LocalStorage(root)
    man = manifest_mod.read(storage, "a")
    rel = next(r for r in man.files if "/tensor_" in r)
    size = man.files[rel].size
    rd = reader.FileReader(storage, "a", man)
    for block in (size, size // 2 if size % 2 == 0 else size):
        monkeypatch.setattr(reader, "READ_BLOCK", block)
        assert torch.equal(rd.load_tensor(rel, mapped=False), torch.arange(3000.0))
    with open(os.path.join(root, "a", rel), "ab") as f:
        f.write(b"extra")
    for block in (size, 1 << 20):
        monkeypatch.setattr(reader, "READ_BLOCK", block)
        with pytest.raises(CorruptCheckpointError):
            rd.load_tensor(rel, mapped=False)


def test_the_read_pipeline_runs_torch_with_one_intraop_thread_and_restores_the_setting(tmp_path, monkeypatch):
    import nxd_ckpt
    from nxd_ckpt import reader

    dev = xla_device()
    root = str(tmp_path / "ckpt")
    nxd_ckpt.save_checkpoint(root, "a", model=_state(dev), use_xser=True)
    seen = []
    original = reader._to_device
    monkeypatch.setattr(reader, "_to_device", lambda batch, targets: (seen.append(torch.get_num_threads()),
                                                                         original(batch, targets))[1])
    before = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        target = {k: torch.zeros_like(v) for k, v in _state(dev).items()}
        nxd_ckpt.load_checkpoint(root, "a", model=target)
        assert torch.get_num_threads() == 3
    finally:
        torch.set_num_threads(before)
    assert seen and set(seen) == {1}, seen
    assert_bit_equal(to_cpu_state(_state(dev)), to_cpu_state(target))


def test_small_files_are_read_in_groups_and_damage_in_a_group_names_its_file(tmp_path, monkeypatch):
    import nxd_ckpt
    from nxd_ckpt import reader

    assert reader.read_groups([5, 4, 3, 2, 1, 0], {5: None, 4: 3 << 20, 3: 600 << 10, 2: 300 << 10, 1: 200 << 10,
                                                     0: 100 << 10}) == [(5,), (4,), (3, 2), (1, 0)]
    dev = xla_device()
    root = str(tmp_path / "ckpt")
    nxd_ckpt.save_checkpoint(root, "a", model=_state(dev), use_xser=True)
    tasks = []
    original = reader.read_groups
    monkeypatch.setattr(reader, "read_groups", lambda order, sizes: (tasks.append(original(order, sizes)),
                                                                      tasks[-1])[1])
    target = {k: torch.zeros_like(v) for k, v in _state(dev).items()}
    nxd_ckpt.load_checkpoint(root, "a", model=target)
    assert tasks == [[tuple(range(9, -1, -1))]], "ten small files, largest first, in one task"
    assert_bit_equal(to_cpu_state(_state(dev)), to_cpu_state(target))

    tensors = os.path.join(root, "a", f"{SHARD}.tensors")
    path = os.path.join(tensors, "tensor_4.pt")                # in the middle of the group
    data = bytearray(open(path, "rb").read())
    data[-40] ^= 0x01
    open(path, "wb").write(bytes(data))
    target = {k: torch.zeros_like(v) for k, v in _state(dev).items()}
    with pytest.raises(nxd_ckpt.CorruptCheckpointError, match="fails its checksum") as info:
        nxd_ckpt.load_checkpoint(root, "a", model=target)
    assert info.value.path == f"a/{SHARD}.tensors/tensor_4.pt"
    assert all(torch.equal(v.cpu(), torch.zeros_like(v.cpu())) for v in target.values()), "nothing applied"


def test_groups_of_small_files_are_prefetched_as_they_are_handed_out(monkeypatch):
    """Each group of more than one file is prefetched (its files, in order) before its read task is handed out;
    a file alone (1 MiB or more) is not: its read already asks the disk for all of it."""
    from concurrent.futures import ThreadPoolExecutor

    from nxd_ckpt import reader

    events = []

    class Recording(_CountingReader):
        def prefetch(self, relpaths):
            events.append(("prefetch", tuple(relpaths)))

        def load_tensor(self, rel):
            events.append(("read", rel))
            return super().load_tensor(rel)

    monkeypatch.setattr(reader, "_to_device", lambda batch, targets: dict(batch))
    monkeypatch.setattr(reader, "read_groups", lambda order, sizes: [(0,), (1, 2, 3), (4,), (5, 6)])
    jobs = {tid: f"model/x.pt.tensors/tensor_{tid}" for tid in range(7)}
    with ThreadPoolExecutor(1) as pool:
        out = reader.read_tensors(Recording(), jobs, pool, 1, targets={t: "dev" for t in jobs})
    assert sorted(out) == list(range(7))
    prefetched = [e[1] for e in events if e[0] == "prefetch"]
    assert prefetched == [tuple(jobs[t] for t in (1, 2, 3)), tuple(jobs[t] for t in (5, 6))]
    for group in prefetched:      # asked for before the first of its files is read
        assert events.index(("prefetch", group)) < events.index(("read", group[0]))

    events.clear()
    monkeypatch.setattr(reader, "PREFETCH_GROUPS", False)
    with ThreadPoolExecutor(1) as pool:
        reader.read_tensors(Recording(), jobs, pool, 1, targets={t: "dev" for t in jobs})
    assert [e for e in events if e[0] == "prefetch"] == []


def _cached(path: str) -> list:
    """Whether each page of the file is in the page cache, by mincore(2) on a mapping that is never touched (a
    read, even with RWF_NOWAIT, would start the readahead these tests look for)."""
    import ctypes
    import mmap

    from nxd_ckpt.storage.local import _libc

    libc = _libc()
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    size = os.path.getsize(path)
    pages = -(-size // mmap.PAGESIZE)
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        assert addr not in (None, ctypes.c_void_p(-1).value), os.strerror(ctypes.get_errno())
        vec = ctypes.create_string_buffer(pages)
        try:
            assert libc.mincore(addr, size, vec) == 0, os.strerror(ctypes.get_errno())
        finally:
            libc.munmap(addr, size)
        return [bool(b & 1) for b in vec.raw]
    finally:
        os.close(fd)


def _uncached_files(folder, names, nbytes):
    """Files of ``nbytes`` random bytes, written, synced and their pages dropped; skips the test where a
    prefetch has nothing to do (LocalStorage reads ahead only on a disk of this host)."""
    from nxd_ckpt.storage import local

    if local.LocalStorage(str(folder))._filesystem not in local._PREFETCH_FS_TYPES:
        pytest.skip("not a disk filesystem (ext4, xfs, btrfs): LocalStorage.prefetch does nothing here")
    os.makedirs(folder, exist_ok=True)
    for name in names:
        with open(os.path.join(folder, name), "wb") as f:
            f.write(os.urandom(nbytes))
            f.flush()
            os.fsync(f.fileno())
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    assert not any(any(_cached(os.path.join(folder, n))) for n in names), "pages not dropped"


def _wait_cached(paths, timeout_s=10.0):
    import time

    deadline = time.monotonic() + timeout_s
    while not all(all(_cached(p)) for p in paths) and time.monotonic() < deadline:
        time.sleep(0.01)


def test_local_prefetch_reads_whole_files_ahead_and_skips_what_it_cannot_open(tmp_path):
    """Every page of each file is asked for (one WILLNEED call reads ahead at most the device's window, 128 KiB by
    default: a file of 900 KB in pieces); a missing path, a path through a file and a FIFO with no writer (which a
    blocking open would wait on forever) are skipped without an error."""
    import threading

    from nxd_ckpt.storage.local import LocalStorage

    names = [f"f{i}" for i in range(4)]
    _uncached_files(tmp_path, names, 900_000)
    os.mkfifo(tmp_path / "fifo")
    storage = LocalStorage(str(tmp_path))
    worker = threading.Thread(target=storage.prefetch, daemon=True,
                              args=(["missing", "fifo", *names[:3], "f3/not_a_folder"],))
    worker.start()
    worker.join(30)
    assert not worker.is_alive(), "prefetch blocked (on the FIFO?)"
    _wait_cached([str(tmp_path / n) for n in names[:3]])
    assert [all(_cached(str(tmp_path / n))) for n in names] == [True, True, True, False]


def test_a_group_is_prefetched_inside_its_tag_and_a_missing_file_is_still_named(tmp_path):
    import nxd_ckpt
    from nxd_ckpt import reader
    from nxd_ckpt.storage.local import LocalStorage

    folder = tmp_path / "a" / "model"
    _uncached_files(folder, ["x.pt", "y.pt"], 200_000)
    reader.FileReader(LocalStorage(str(tmp_path)), tag="a").prefetch(["model/x.pt", "model/y.pt"])
    _wait_cached([str(folder / "x.pt"), str(folder / "y.pt")])
    assert all(_cached(str(folder / "x.pt"))) and all(_cached(str(folder / "y.pt")))

    dev = xla_device()
    root = str(tmp_path / "ckpt")
    nxd_ckpt.save_checkpoint(root, "a", model=_state(dev), use_xser=True)
    os.remove(os.path.join(root, "a", f"{SHARD}.tensors", "tensor_4.pt"))       # in the middle of the one group
    target = {k: torch.zeros_like(v) for k, v in _state(dev).items()}
    with pytest.raises(nxd_ckpt.CorruptCheckpointError, match="is missing") as info:
        nxd_ckpt.load_checkpoint(root, "a", model=target)
    assert info.value.path == f"a/{SHARD}.tensors/tensor_4.pt"
