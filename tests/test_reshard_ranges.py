"""Resharding reads only what a rank needs from plain (non-xser) shards, and its memory stays bounded.

A model and its Adam state saved at TP=2 as plain ``torch.save`` shards (one file per shard) is resharded for
each rank of TP=4, through a Storage that counts every byte read. Per rank and shard file: the ranged reads are
the file's non-tensor bytes (zip directory, headers, pickle) plus only the tensors that overlap the rank's new
shard, each read once. With our manifest every read is exactly one of the zip records whose CRC32C the manifest
records (verified as read; no other pass over the file); with an older manifest (no per-record sums) each file is
first checked by one streaming pass; without one (an NxD checkpoint) each record read is checked against the zip's
own CRC-32 and nothing else is read. On POSIX and on an object store (``objdir://``, where each range is a ranged
GET). The source tensors alive at any moment never exceed the rank's new shard plus the largest source tensor it
reads. A damaged record is reported by the rank that reads it, naming the file."""
from __future__ import annotations

import threading
import weakref

import pytest
import torch
from backends import root_for
from harness import run_ranks
from s3_fixtures import moto_endpoint, s3_url  # noqa: F401 - fixtures

from nxd_ckpt.partition import Partition, split_tp, tp_overlaps
from nxd_ckpt.storage import open_storage

SHAPES = {"col": (256, 64), "row": (64, 256), "norm": (64,)}
PARTS = {"col": Partition(0, 2), "row": Partition(1), "norm": None}


def _full(seed):
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(s, generator=g) for k, s in SHAPES.items()}


class _Model(torch.nn.Module):
    def __init__(self, tp: int, t: int):
        super().__init__()
        for k, v in _full(3).items():
            p = torch.nn.Parameter(split_tp(v, PARTS[k], tp, t).clone())
            if PARTS[k] is not None:
                p.tensor_model_parallel, p.partition_dim, p.partition_stride = True, PARTS[k].dim, PARTS[k].stride
            setattr(self, k, p)

    def step(self, opt, tp: int, t: int) -> None:
        grads = _full(4)
        for k, p in self.named_parameters():
            p.grad = split_tp(grads[k], PARTS[k], tp, t).clone()
        opt.step()


def _save_tp2(rank, world, root):
    import nxd_ckpt
    import parallel_state as ps

    ps.initialize_model_parallel(tensor_model_parallel_size=2)
    t = ps.get_tensor_model_parallel_rank()
    model = _Model(2, t)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    model.step(opt, 2, t)
    nxd_ckpt.save_checkpoint(root, "s", model=model, optimizer=opt, use_xser=False)
    return True


@pytest.fixture(scope="module", params=["posix", "objects"])
def tp2(request, tmp_path_factory):
    root = root_for(request.param, tmp_path_factory.mktemp("ranges"))
    run_ranks(_save_tp2, 2, root, timeout=120)
    ref = _Model(1, 0)
    opt = torch.optim.Adam(ref.parameters(), lr=0.1)
    ref.step(opt, 1, 0)
    state = {k: {"param": p.detach().clone(), "exp_avg": opt.state[p]["exp_avg"], "exp_avg_sq": opt.state[p]["exp_avg_sq"]}
             for k, p in ref.named_parameters()}
    return root, state


class _Counting:
    """A Storage (any backend) that records every read (path, bytes) and every streaming check."""

    def __init__(self, root):
        self._inner = open_storage(root)
        self.reads, self.streamed, self.lock = [], [], threading.Lock()

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def read(self, relpath, offset=0, length=None):
        data = self._inner.read(relpath, offset, length)
        with self.lock:
            self.reads.append((relpath, len(data), offset))
        return data

    def crc32c(self, relpath):
        self.streamed.append(relpath)
        return self._inner.crc32c(relpath)


class _Live:
    """Bytes of source tensors alive now (read, not yet freed), and the most at once."""

    def __init__(self):
        self.now = self.peak = 0
        self.largest = 0
        self.lock = threading.Lock()

    def track(self, t: torch.Tensor) -> torch.Tensor:
        n = t.untyped_storage().nbytes()
        with self.lock:
            self.now += n
            self.peak, self.largest = max(self.peak, self.now), max(self.largest, n)
        weakref.finalize(t, self._free, n)
        return t

    def _free(self, n):
        with self.lock:
            self.now -= n


def _reshard_for(root, tag, rank, with_manifest, old_manifest=False):
    """read_resharded for TP rank ``rank`` of 4, through a counting storage; (state, storage, live, model).
    ``old_manifest``: the manifest as releases before per-record checksums wrote it (no ``ranges``)."""
    import dataclasses

    from nxd_ckpt import loader, manifest as manifest_mod, reshard_load
    from nxd_ckpt.reader import FileReader
    from nxd_ckpt.world import World
    from parallel_state.topology import Topology

    storage = _Counting(root)
    manifest = manifest_mod.read(storage, tag) if with_manifest else None
    if old_manifest:
        manifest.files = {rel: dataclasses.replace(e, ranges=None) for rel, e in manifest.files.items()}
    saved = loader.saved_topology(storage, tag, manifest)
    model = _Model(4, rank)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    target = reshard_load.target_of(model, World(rank, 4, rank, 4, Topology(4, tp=4), False))
    reader = FileReader(storage, tag, manifest)
    live, lazy_tensor = _Live(), reader.lazy_tensor
    reader.lazy_tensor = lambda rel, lazy, t: live.track(lazy_tensor(rel, lazy, t))
    storage.reads.clear()
    out = reshard_load.read_resharded(reader, manifest, saved, target, want_model=True, optimizer=opt, num_workers=1)
    return out, storage, live, model


def _needed(rank: int):
    """{saved TP rank: keys whose saved shard overlaps TP rank ``rank`` of 4} (replicated: from TP rank 0)."""
    out = {0: set(), 1: set()}
    for k, shape in SHAPES.items():
        for r in (0, 1):
            part = PARTS[k]
            if part is None:
                hit = r == 0
            else:
                hit = bool(tp_overlaps(shape[part.dim], part, 2, r, 4, rank))
            if hit:
                out[r].add(k)
    return out


def _nbytes(k):
    return torch.empty(SHAPES[k]).nbytes // (2 if PARTS[k] is not None else 1)   # one saved TP=2 shard


def _copy(src_root: str, dst_root: str, tag: str, skip=()) -> None:
    src, dst = open_storage(src_root), open_storage(dst_root)
    for rel in src.list(tag):
        if rel.rsplit("/", 1)[-1] not in skip:
            dst.write_bytes(rel, src.read(rel))


@pytest.mark.parametrize("kind", ["ours", "old_manifest", "no_manifest"])
def test_plain_shards_are_read_by_ranges_with_bounded_memory(tp2, tmp_path, kind):
    root, full = tp2
    if kind == "no_manifest":    # as neuronx-distributed writes it: no manifest to check against
        nxd = root_for("posix" if "://" not in root else "objects", tmp_path / "nxd")
        _copy(root, nxd, "s", skip=("manifest.json",))
        root = nxd
    for rank in range(4):
        _check_rank(root, "s", rank, kind != "no_manifest", full, old_manifest=kind == "old_manifest")


def test_the_manifest_records_a_crc32c_per_zip_record_of_plain_shards(tp2):
    """Each plain shard's manifest entry covers every zip record (local header + data) and the central directory
    with a CRC32C of those bytes; only the 16-byte data descriptors lie outside."""
    import zipfile

    import crc32c

    from nxd_ckpt import manifest as manifest_mod

    root, _ = tp2
    st = open_storage(root)
    man = manifest_mod.read(st, "s")
    plain = [rel for rel in man.files if rel.endswith("_pp_rank_00.pt")]
    assert len(plain) == 4
    for rel in plain:
        data, entry = st.read(f"s/{rel}"), man.files[rel]
        infos = zipfile.ZipFile(__import__("io").BytesIO(data)).infolist()
        assert [r.offset for r in entry.ranges[:-1]] == [i.header_offset for i in infos]
        gaps = [b.offset - a.end for a, b in zip(entry.ranges, entry.ranges[1:])]
        assert set(gaps) == {16} and entry.ranges[-1].end == len(data) == entry.size
        for r in entry.ranges:
            assert f"{crc32c.crc32c(data[r.offset:r.end]):08x}" == r.crc32c
    assert all(e.ranges is None for rel, e in man.files.items() if rel not in plain)


@pytest.mark.parametrize("tp2", ["posix"], indirect=True)     # copied from the POSIX save
def test_plain_shards_on_s3_are_read_by_ranged_gets(tp2, s3_url):
    """The same through the S3 backend (moto): the zip directory, pickle and tensors come by ranged GETs."""
    root, full = tp2
    _copy(root, s3_url, "s")
    _check_rank(s3_url, "s", 1, True, full)


def _check_rank(root: str, tag: str, rank: int, with_manifest: bool, full, old_manifest: bool = False) -> None:
    out, storage, live, model = _reshard_for(root, tag, rank, with_manifest, old_manifest)
    # values: this rank's TP=4 shard of the full state, bit for bit
    for k, p in model.named_parameters():
        want = {f: split_tp(full[k][f], PARTS[k], 4, rank) for f in ("param", "exp_avg", "exp_avg_sq")}
        assert torch.equal(out["model"][k], want["param"]), (rank, k)
        i = list(SHAPES).index(k)
        for f in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(out["optim"]["state"][i][f], want[f]), (rank, k, f)
    needed = _needed(rank)
    for r in (0, 1):
        for folder in ("model", "optim"):
            rel = f"{folder}/dp_rank_00_tp_rank_{r:02d}_pp_rank_00.pt"
            size = storage.size(f"{tag}/{rel}")
            got = sum(n for p, n, _o in storage.reads if p == f"{tag}/{rel}")
            moments = 2 if folder == "optim" else 1
            tensors = moments * sum(_nbytes(k) for k in SHAPES)        # every key's saved shard
            want = moments * sum(_nbytes(k) for k in needed[r])
            if not needed[r]:
                assert got == 0, f"rank {rank} read {rel}, which holds nothing it needs"
                continue
            overhead = size - tensors          # zip directory, headers, pickle (and the steps)
            assert want <= got <= want + overhead, (rank, rel, got, want, overhead, size)
            assert got < size or want == tensors, (rank, rel, got, size)
    if old_manifest:     # each file it opened checked once against the manifest, by a streaming pass
        assert sorted(storage.streamed) == sorted(set(p for p, _n, _o in storage.reads))
    else:
        assert storage.streamed == []
    if with_manifest and not old_manifest:   # every read is one whole checksummed record, each read once
        from nxd_ckpt import manifest as manifest_mod
        files = manifest_mod.read(open_storage(root), tag).files
        reads = [(p, o, n) for p, n, o in storage.reads]
        assert len(reads) == len(set(reads))
        for p, o, n in reads:
            assert (o, n) in {(r.offset, r.length) for r in files[p[len(tag) + 1:]].ranges}, (p, o, n)
    new_shard = sum(3 * t.nbytes for t in model.parameters())           # parameter + two moments
    largest = max(_nbytes(k) for k in SHAPES)
    assert live.largest <= largest
    assert live.peak <= new_shard + largest, (rank, live.peak, new_shard, largest)


def _damage(root: str, rel: str, key: str) -> None:
    """Flip one byte in the middle of the data of tensor ``key``'s storage record in shard ``rel``."""
    import xser

    path = f"{root}/{rel}"
    with open(path, "rb") as f:
        data = bytearray(f.read())
    lazy = xser.open_lazy(lambda o, n: bytes(data[o:o + n]), len(data))
    rec, nbytes = lazy._storages[lazy.data[key].untyped_storage()._cdata]
    data[lazy._data_offset(rec) + nbytes // 2] ^= 0x40
    with open(path, "wb") as f:
        f.write(data)


@pytest.mark.parametrize("tp2", ["posix"], indirect=True)
@pytest.mark.parametrize("with_manifest", [True, False], ids=["ours", "no_manifest"])
def test_a_damaged_record_fails_the_rank_that_reads_it(tp2, tmp_path, with_manifest):
    """"row" (row-parallel) in saved TP shard 1 is damaged: TP=4 ranks 2 and 3 read it and fail naming the file
    (our manifest's per-record CRC32C; for an NxD file, the zip's CRC-32); ranks 0 and 1 never read that record."""
    from nxd_ckpt.errors import CorruptCheckpointError

    root, full = tp2
    copy = str(tmp_path / "c")
    _copy(root, copy, "s", skip=() if with_manifest else ("manifest.json",))
    rel = "s/model/dp_rank_00_tp_rank_01_pp_rank_00.pt"
    _damage(copy, rel, "row")
    for rank in (0, 1):
        _check_rank(copy, "s", rank, with_manifest, full)
    for rank in (2, 3):
        with pytest.raises(CorruptCheckpointError) as err:
            _reshard_for(copy, "s", rank, with_manifest)
        want = "fails its checksum on bytes" if with_manifest else "fails the CRC-32 its zip directory records"
        assert "dp_rank_00_tp_rank_01_pp_rank_00.pt" in str(err.value) and want in str(err.value)
