"""xser.open_lazy: the tensors of a torch.save file, read one at a time by byte ranges."""
from __future__ import annotations

import collections
import io

import pytest
import torch

import xser
from xser import container


def _state():
    g = torch.Generator().manual_seed(0)
    return {"a": torch.randn(5, 7, generator=g), "view": torch.arange(10, dtype=torch.int64)[2:6],
            "t": torch.randn(4, 3, generator=g).t(), "s": torch.tensor(3.0), "empty": torch.empty(0, 3),
            "bf16": torch.randn(3, 3, generator=g).bfloat16(), "mask": torch.tensor([True, False]), "n": 5,
            "nested": {"x": [torch.ones(2), "text"]}}


def _reader(data: bytes, log: list):
    def read(offset, length):
        log.append((offset, length))
        return data[offset:offset + length]
    return read


@pytest.mark.parametrize("save", [torch.save, container.save], ids=["torch.save", "no_crc"])
@pytest.mark.parametrize("trusted", [False, True])
def test_every_tensor_reads_back_exactly_and_only_its_bytes(save, trusted):
    state = _state()
    buf = io.BytesIO()
    save(state, buf)
    data, log = buf.getvalue(), []
    lazy = xser.open_lazy(_reader(data, log), len(data), trusted=trusted)
    assert lazy.data["a"].device.type == "meta" and lazy.data["n"] == 5 and lazy.data["nested"]["x"][1] == "text"
    for key in ("a", "view", "t", "s", "empty", "bf16", "mask"):
        before = len(log)
        got = lazy.tensor(lazy.data[key])
        want = state[key]
        assert got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want), key
        reads = [n for _, n in log[before:]]
        if want.is_contiguous() and want.numel() and want.storage_offset():   # a view: just its own span
            assert reads[-1] == want.nbytes, (key, log[before:])
        elif want.is_contiguous() and want.numel():   # one read: the record's local header (<= 128 bytes), data
            assert len(reads) == 1 and want.nbytes < reads[0] <= want.nbytes + 128, (key, log[before:])
    assert torch.equal(lazy.tensor(lazy.data["nested"]["x"][0]), torch.ones(2))


def test_not_a_zip_file_is_none_and_damage_is_named():
    buf = io.BytesIO()
    torch.save(_state(), buf, _use_new_zipfile_serialization=False)
    legacy = buf.getvalue()
    assert xser.open_lazy(_reader(legacy, []), len(legacy)) is None
    buf = io.BytesIO()
    torch.save({"big": torch.zeros(1000)}, buf)
    data = buf.getvalue()
    lazy = xser.open_lazy(_reader(data, []), len(data), name="shard.pt")
    short = xser.open_lazy(lambda o, n: data[o:o + n][: max(0, n - 8)] if n > 1000 else data[o:o + n], len(data),
                           name="shard.pt")
    with pytest.raises(xser.CorruptFileError, match="shard.pt is truncated"):
        short.tensor(short.data["big"])
    assert torch.equal(lazy.tensor(lazy.data["big"]), torch.zeros(1000))


class Custom:
    def __init__(self, v):
        self.v = v


def test_unsafe_pickle_is_refused_unless_trusted():
    buf = io.BytesIO()
    torch.save({"d": collections.OrderedDict(a=torch.ones(1)), "c": Custom(3)}, buf)
    data = buf.getvalue()
    with pytest.raises(xser.UnsafeCheckpointError, match="Custom"):
        xser.open_lazy(_reader(data, []), len(data), name="f")
    lazy = xser.open_lazy(_reader(data, []), len(data), trusted=True)
    assert lazy.data["c"].v == 3 and torch.equal(lazy.tensor(lazy.data["d"]["a"]), torch.ones(1))


@pytest.mark.parametrize("alignment,reads", [(16, 1), (256, 2)])
def test_a_file_with_another_alignment_still_reads_exactly(alignment, reads):
    """The data offset predicted from the 64-byte alignment is checked against each record's header: data that
    starts earlier is in the same read; data that starts later costs a second read of the missing tail."""
    import torch.utils.serialization

    cfg = torch.utils.serialization.config.save
    state, buf, saved = _state(), io.BytesIO(), cfg.storage_alignment
    cfg.storage_alignment = alignment
    try:
        torch.save(state, buf)
    finally:
        cfg.storage_alignment = saved
    data, log = buf.getvalue(), []
    lazy = xser.open_lazy(_reader(data, log), len(data))
    counts = []
    for key in ("a", "t", "s", "bf16", "mask"):      # records read from their start
        before = len(log)
        got = lazy.tensor(lazy.data[key])
        assert torch.equal(got, state[key]) and got.dtype == state[key].dtype, key
        counts.append(len(log) - before)
    assert max(counts) == reads, counts


def test_check_crc32_verifies_each_record_read_against_the_zip():
    """check_crc32: each record read is checked against the CRC-32 in the zip directory; a view then costs its
    whole record; damage in a record is named; a file written without CRC-32 (CRC fields 0) reads unchecked."""
    state = _state()
    buf = io.BytesIO()
    torch.save(state, buf)
    data, log = buf.getvalue(), []
    lazy = xser.open_lazy(_reader(data, log), len(data), check_crc32=True, name="shard.pt")
    for key in ("a", "view", "t", "s", "empty", "bf16", "mask"):
        before = len(log)
        got = lazy.tensor(lazy.data[key])
        assert torch.equal(got, state[key]) and got.dtype == state[key].dtype, key
        if key == "view":     # the whole record (10 int64), not just its 4 elements, so its CRC-32 can be checked
            assert sum(n for _, n in log[before:]) >= 80
            assert got.untyped_storage().nbytes() == got.nbytes      # and the rest of the record is not kept
    rec, nbytes = lazy._storages[lazy.data["a"].untyped_storage()._cdata]
    bad = bytearray(data)
    bad[lazy._data_offset(rec) + nbytes - 1] ^= 1
    damaged = xser.open_lazy(_reader(bytes(bad), []), len(bad), check_crc32=True, name="shard.pt")
    with pytest.raises(xser.CorruptFileError, match=f"shard.pt: storage record {rec} fails the CRC-32"):
        damaged.tensor(damaged.data["a"])
    assert torch.equal(damaged.tensor(damaged.data["bf16"]), state["bf16"])      # other records are intact
    unchecked = xser.open_lazy(_reader(bytes(bad), []), len(bad), name="shard.pt")
    assert not torch.equal(unchecked.tensor(unchecked.data["a"]), state["a"])    # without the check: not noticed
    buf = io.BytesIO()
    container.save(state, buf)          # CRC fields 0: nothing to check against
    data = buf.getvalue()
    lazy = xser.open_lazy(_reader(data, []), len(data), check_crc32=True)
    assert torch.equal(lazy.tensor(lazy.data["a"]), state["a"])


def test_a_damaged_pickle_record_is_named_with_check_crc32():
    buf = io.BytesIO()
    torch.save({"n": 12345678}, buf)
    data = bytearray(buf.getvalue())
    i = data.index((12345678).to_bytes(4, "little"))
    data[i] ^= 1
    with pytest.raises(xser.CorruptFileError, match="data.pkl is truncated or fails the CRC-32"):
        xser.open_lazy(_reader(bytes(data), []), len(data), check_crc32=True, name="f.pt")
