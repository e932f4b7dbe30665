"""Per-record CRC32C of plain shards: taken while torch.save writes (xser.RecordSums), recorded in the manifest
(FileEntry.ranges; older manifests have none), checked by readers of a few records (rangecheck.CheckedRanges)
and by verify (rangecheck.stream_mismatch: the whole file and each record in one pass)."""
from __future__ import annotations

import io
import json
import os
import zipfile

import crc32c
import pytest
import torch
from harness import run_ranks

import xser
from nxd_ckpt import manifest as manifest_mod
from nxd_ckpt.cli import main
from nxd_ckpt.errors import CorruptCheckpointError
from nxd_ckpt.manifest import FileEntry
from nxd_ckpt.rangecheck import CheckedRanges, covering, stream_mismatch
from xser import container


def _state():
    g = torch.Generator().manual_seed(1)
    return {"a": torch.randn(300, generator=g), "b": torch.randn(4, 4, generator=g).t(), "e": torch.empty(0),
            "v": torch.arange(10)[3:7], "n": 3}


def _summed(save=torch.save):
    buf = io.BytesIO()
    sums = xser.RecordSums(buf)
    save(_state(), sums)
    data = buf.getvalue()
    ranges = sums.ranges()
    entry = FileEntry.from_json({"size": len(data), "crc32c": f"{crc32c.crc32c(data):08x}",
                                 "ranges": [[o, n, f"{c:08x}"] for o, n, c in ranges]})
    return data, entry


@pytest.mark.parametrize("save", [torch.save, container.save], ids=["torch.save", "no_crc"])
def test_record_sums_cover_every_record_and_the_directory(save):
    data, entry = _summed(save)
    infos = zipfile.ZipFile(io.BytesIO(data)).infolist()
    assert [r.offset for r in entry.ranges[:-1]] == [i.header_offset for i in infos]
    for r, i in zip(entry.ranges, infos):   # the local header and the data; a data descriptor (16) left out
        assert data[r.end:r.end + 4] in (b"PK\x07\x08", b"PK\x03\x04", b"PK\x01\x02"), i.filename
        assert data[r.end - i.file_size:r.end] == zipfile.ZipFile(io.BytesIO(data)).open(i).read() if \
            save is torch.save else True
    assert entry.ranges[-1].end == len(data) and data[entry.ranges[-1].offset:][:4] == b"PK\x01\x02"
    for r in entry.ranges:
        assert f"{crc32c.crc32c(data[r.offset:r.end]):08x}" == r.crc32c


def test_another_writers_layout_gives_no_ranges():
    """A zip written by Python's zipfile (no separate header writes): no ranges, so readers check the file whole."""
    sums = xser.RecordSums(io.BytesIO())
    with zipfile.ZipFile(sums, "w") as zf:
        zf.writestr("archive/data.pkl", b"x" * 100)
    assert sums.ranges() is None


def test_another_writers_layout_logs_once_why(caplog):
    sums = xser.RecordSums(io.BytesIO(), name="shard.pt")
    with zipfile.ZipFile(sums, "w") as zf:
        zf.writestr("archive/data.pkl", b"x" * 100)
    with caplog.at_level("WARNING", logger="nxd_ckpt"):
        assert sums.ranges() is None and sums.ranges() is None
    msgs = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(msgs) == 1 and "per-record checksums are off for shard.pt" in msgs[0], msgs
    assert "outside any zip record" in msgs[0]


class _Sink(io.RawIOBase):
    """Counts bytes, keeps none (a 24 MB save without 24 MB in the test)."""

    def __init__(self):
        super().__init__()
        self.n = 0

    def writable(self):
        return True

    def write(self, data):
        self.n += memoryview(data).nbytes
        return memoryview(data).nbytes


@pytest.mark.parametrize("magic", [b"PK\x01\x02", b"PK\x03\x04" + bytes(26), b"PK\x07\x08" + bytes(12)])
def test_tensor_data_that_looks_like_a_zip_header_is_data(magic):
    """A uint8 tensor whose bytes start like a central-directory entry, a local header or (16 bytes) a data
    descriptor stays one record: ranges recorded, the tail kept is the directory only (not the tensor)."""
    big = torch.zeros(24 << 20, dtype=torch.uint8)
    big[:len(magic)] = torch.frombuffer(bytearray(magic), dtype=torch.uint8)
    small = torch.frombuffer(bytearray(magic[:4] + bytes(12)), dtype=torch.uint8)
    sink = _Sink()
    sums = xser.RecordSums(sink)
    torch.save({"big": big, "small": small, "after": torch.arange(3)}, sums)
    assert sums._tail is not None and len(sums._tail) < 4096
    ranges = sums.ranges()
    assert ranges is not None and ranges[-1][0] + ranges[-1][1] == sink.n
    assert max(n for _, n, _ in ranges) > 24 << 20     # the big tensor's record, whole


def test_record_sums_match_for_data_starting_like_a_header():
    """Same, byte-checked on a small file: every range's CRC32C is that of the bytes written."""
    t = torch.frombuffer(bytearray(b"PK\x01\x02" + bytes(60)), dtype=torch.uint8)
    buf = io.BytesIO()
    sums = xser.RecordSums(buf)
    torch.save({"t": t, "u": torch.arange(4)}, sums)
    data, ranges = buf.getvalue(), sums.ranges()
    assert ranges is not None and len(ranges) == len(zipfile.ZipFile(io.BytesIO(data)).infolist()) + 1
    for o, n, c in ranges:
        assert crc32c.crc32c(data[o:o + n]) == c


def test_an_oversized_tail_gives_up_with_a_bounded_buffer(monkeypatch):
    monkeypatch.setattr(xser.zipranges, "TAIL_MAX", 64)
    sums = xser.RecordSums(io.BytesIO())
    torch.save({"a": torch.arange(4), "b": torch.arange(5)}, sums)
    assert sums._tail is None and sums.ranges() is None


def test_entry_json_round_trip_and_old_manifests():
    _, entry = _summed()
    assert FileEntry.from_json(json.loads(json.dumps(entry.to_json()))) == entry
    old = FileEntry.from_json({"size": 10, "crc32c": "00000000", "rank": 3})
    assert old.ranges is None and old.to_json() == {"size": 10, "crc32c": "00000000", "rank": 3}
    with pytest.raises(ValueError, match="overlap or run past"):
        FileEntry.from_json({"size": 100, "crc32c": "0", "ranges": [[0, 50, "0"], [40, 10, "0"]]})
    with pytest.raises(ValueError, match="overlap or run past"):
        FileEntry.from_json({"size": 100, "crc32c": "0", "ranges": [[90, 20, "0"]]})


def test_checked_ranges_read_only_and_verify_what_is_asked():
    data, entry = _summed()
    log = []

    def raw(o, n):
        log.append((o, n))
        return data[o:o + n]

    whole = []
    lazy = xser.open_lazy(CheckedRanges(raw, entry, "f.pt", "", lambda: whole.append(1)).read, len(data), name="f.pt")
    for k in ("a", "b", "e", "v"):
        assert torch.equal(lazy.tensor(lazy.data[k]), _state()[k]), k
    assert whole == [] and len(log) == len(set(log))
    assert all((o, n) in {(r.offset, r.length) for r in entry.ranges} for o, n in log)
    gap = entry.ranges[0].end                   # a data descriptor: outside every range
    assert covering(entry.ranges, gap, gap + 4) is None
    reader = CheckedRanges(raw, entry, "f.pt", "", lambda: whole.append(1))
    assert reader.read(gap, 4) == b"PK\x07\x08" and reader.read(gap, 4) and whole == [1]   # the whole check, once
    bad = bytearray(data)
    rec = entry.ranges[4]
    bad[rec.end - 1] ^= 1
    reader = CheckedRanges(lambda o, n: bytes(bad[o:o + n]), entry, "f.pt", "restore it", lambda: None)
    with pytest.raises(CorruptCheckpointError, match=f"f.pt fails its checksum on bytes {rec.offset}..{rec.end}.*"
                                                     "restore it"):
        reader.read(rec.offset + 10, 4)
    assert reader.read(entry.ranges[3].offset, 8) == data[entry.ranges[3].offset:][:8]    # the others are intact


def test_stream_mismatch_checks_the_file_and_each_record():
    data, entry = _summed()
    read = lambda: (memoryview(data)[o:o + 100] for o in range(0, len(data), 100))  # noqa: E731
    assert stream_mismatch(read(), entry) is None
    r = entry.ranges[2]
    wrong = FileEntry(entry.size, entry.crc32c, None,
                      entry.ranges[:2] + (manifest_mod.RangeSum(r.offset, r.length, "deadbeef"),) + entry.ranges[3:])
    assert stream_mismatch(read(), wrong) == (f"fails its checksum on bytes {r.offset}..{r.end}: expected crc32c "
                                            f"deadbeef, found {r.crc32c} (damaged)")


def _save_plain(rank, world, root):
    import nxd_ckpt
    import parallel_state as ps

    ps.initialize_model_parallel()
    model = torch.nn.Linear(8, 8)
    nxd_ckpt.save_checkpoint(root, "t", model=model, use_xser=False)
    nxd_ckpt.finalize_checkpoint()
    return True


def test_verify_checks_each_record_of_a_plain_shard(tmp_path, capsys):
    """verify passes a plain tag, and reports a record whose recorded CRC32C disagrees even when the file's own
    CRC32C matches (a manifest re-sealed with one wrong record sum)."""
    root = str(tmp_path / "ck")
    assert run_ranks(_save_plain, 1, root, timeout=120) == [True]
    assert main(["verify", f"{root}/t"]) == 0
    path = f"{root}/t/{manifest_mod.layout.MANIFEST_FILE}"
    doc = json.load(open(path))
    rel = "model/dp_rank_00_tp_rank_00_pp_rank_00.pt"
    assert doc["files"][rel]["ranges"]
    doc["files"][rel]["ranges"][1][2] = "00000000"
    body = json.dumps(doc).encode()
    open(path, "wb").write(body)
    open(f"{root}/t/done", "wb").write(manifest_mod.seal(body))
    capsys.readouterr()
    assert main(["verify", f"{root}/t"]) == 1
    out = capsys.readouterr()
    assert rel in out.out + out.err and "fails its checksum on bytes" in out.out + out.err
    assert os.path.exists(f"{root}/t/{rel}")


def _save_zero1_plain(rank, world, root):
    import nxd_ckpt
    import parallel_state as ps
    from nxd_ckpt.testing import ZeroOneAdam

    ps.initialize_model_parallel()                       # DP=2
    model = torch.nn.Linear(8, 8)
    opt = ZeroOneAdam(model.parameters(), dp_group=ps.get_data_parallel_host_group(),
                      dp_rank=ps.get_data_parallel_rank(), dp_size=ps.get_data_parallel_size())
    nxd_ckpt.save_checkpoint(root, "z", model=model, optimizer=opt, zero1_optimizer=True, use_xser=False)
    nxd_ckpt.finalize_checkpoint()
    return True


def test_convert_zero1_keeps_the_record_sums_of_the_files_it_takes_over(tmp_path):
    """A plain ZeRO-1 tag converted to DP=1: the model shard it hard-links keeps its per-record sums, and the
    optimizer shard it writes gets its own, so resharding reads of the new tag are checked by record too."""
    root = str(tmp_path / "ck")
    assert run_ranks(_save_zero1_plain, 2, root, timeout=120) == [True, True]
    out = str(tmp_path / "dp1" / "z")
    assert main(["convert-zero1", "--input_dir", f"{root}/z", "--output_dir", out, "--convert_to_sharded",
                 "--dp_size", "1"]) == 0
    rel = "model/dp_rank_00_tp_rank_00_pp_rank_00.pt"
    before, after = manifest_mod.read(f"{root}/z").files[rel], manifest_mod.read(out).files[rel]
    assert before.ranges and after == FileEntry(before.size, before.crc32c, after.rank, before.ranges)
    assert manifest_mod.read(out).files["optim/dp_rank_00_tp_rank_00_pp_rank_00.pt"].ranges   # its own output too
    assert main(["verify", out]) == 0          # which checks every record sum against the bytes


def test_checked_ranges_keep_a_bounded_amount(monkeypatch):
    """Checked ranges are kept for repeated small reads, but never more than the bound in all (LRU)."""
    from nxd_ckpt import rangecheck

    data, entry = _summed()
    monkeypatch.setattr(rangecheck, "_KEEP", 1500)
    log = []
    reader = CheckedRanges(lambda o, n: log.append(o) or data[o:o + n], entry, "f.pt", "", lambda: None)
    for r in entry.ranges:
        reader.read(r.offset, 4)
        assert reader._kept_bytes <= 1500
    before = len(log)
    reader.read(entry.ranges[-1].offset, 4)          # the last one read is still kept
    assert len(log) == before
    reader.read(entry.ranges[0].offset, 4)           # the first was evicted: read (and checked) again
    assert log[-1] == entry.ranges[0].offset


def test_a_view_into_a_record_over_the_keep_bound_reads_the_record_once(monkeypatch):
    """A tensor at a storage offset > 0 whose record is too big to keep: its data offset comes from the record's
    checksummed range (record end less data size), so the record is read (and checked) once, not once for the
    local header and again for the data."""
    from nxd_ckpt import rangecheck

    monkeypatch.setattr(rangecheck, "_KEEP", 4096)
    full = torch.arange(1 << 14, dtype=torch.float32)
    buf = io.BytesIO()
    sums = xser.RecordSums(buf)
    torch.save({"v": full[100:]}, sums)
    data = buf.getvalue()
    entry = FileEntry.from_json({"size": len(data), "crc32c": f"{crc32c.crc32c(data):08x}",
                                 "ranges": [[o, n, f"{c:08x}"] for o, n, c in sums.ranges()]})
    big = max(entry.ranges, key=lambda r: r.length)
    log = []
    raw = lambda o, n: log.append((o, n)) or data[o:o + n]    # noqa: E731
    lazy = xser.open_lazy(CheckedRanges(raw, entry, "f.pt", "", lambda: None).read, len(data), name="f.pt",
                          record_ends={r.offset: r.end for r in entry.ranges})
    log.clear()
    assert torch.equal(lazy.tensor(lazy.data["v"]), full[100:])
    assert log == [(big.offset, big.length)]


def test_a_written_file_without_record_sums_is_named_in_the_warning(tmp_path, caplog):
    """RecordSums over Storage.write_file's file object names the key in its one warning."""
    from nxd_ckpt.storage import LocalStorage

    def produce(f):
        sums = xser.RecordSums(f)
        sums.write(b"not a zip")
        assert sums.ranges() is None

    with caplog.at_level("WARNING", logger="nxd_ckpt"):
        LocalStorage(str(tmp_path)).write_file("model/x.pt", produce)
    assert ["per-record checksums are off for model/x.pt" in r.getMessage() for r in caplog.records] == [True]
