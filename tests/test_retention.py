"""Retention (num_kept_ckpts): what it may delete, what it must never delete, and interrupted deletes."""
from __future__ import annotations

import os
import threading

import pytest
import torch

from backends import retired, tags_on_disk
from tiny_models import TinyShard, all_files, assert_bit_equal, to_cpu_state


def _model(offset=0):
    return TinyShard(seed_offset=offset)


def _write(path, data=b"1"):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(data)


def _nxd_tag(root, tag, done=True, mtime=None):
    """A minimal NxD-looking tag: `checkpoint` marker, model/ with a plain shard, optionally `done`."""
    path = os.path.join(root, tag)
    _write(os.path.join(path, "checkpoint"))
    os.makedirs(os.path.join(path, "model"))
    torch.save({"w": torch.ones(2)}, os.path.join(path, "model", "dp_rank_00_tp_rank_00_pp_rank_00.pt"))
    if done:
        _write(os.path.join(path, "done"))
        if mtime is not None:
            os.utime(os.path.join(path, "done"), (mtime, mtime))
    return path


def _snapshot_tree(path):
    return {rel: open(os.path.join(path, rel), "rb").read() for rel in all_files(path)}


def test_only_checkpoints_are_deleted(tmp_path):
    import nxd_ckpt

    root = str(tmp_path / "ckpt")
    # not checkpoints: a user folder that holds a file named `checkpoint` (no model/ or optim/), one that
    # holds a file named `done`, any folder, any file
    _write(os.path.join(root, "user_folder", "checkpoint"), b"my notes")
    _write(os.path.join(root, "user_folder", "notes.txt"), b"keep me")
    _write(os.path.join(root, "has_done", "done"), b"finished reading")
    _write(os.path.join(root, "has_done", "log.txt"), b"keep me too")
    _write(os.path.join(root, "random_dir", "data.bin"), b"\x00" * 10)
    _write(os.path.join(root, "random_file.txt"), b"x")
    users = {d: _snapshot_tree(os.path.join(root, d)) for d in ("user_folder", "has_done", "random_dir")}
    # checkpoints: an old complete NxD tag, an NxD tag whose save never finished; crash debris
    _nxd_tag(root, "nxd_old", mtime=1000.0)
    _nxd_tag(root, "nxd_unfinished", done=False)
    _write(os.path.join(root, "newest.nxdtmp"), b"half")
    _write(os.path.join(root, "s0.nxdtmp", "model", "x.pt"), b"half")

    assert nxd_ckpt.list_checkpoints(root) == ["nxd_old"]      # has_done is not a checkpoint
    model = _model()
    for tag in ("s1", "s2"):
        nxd_ckpt.save_checkpoint(root, tag, model=model, num_kept_ckpts=1, use_xser=True)
    assert nxd_ckpt.list_checkpoints(root) == ["s2"]
    assert tags_on_disk(root) == ["has_done", "newest", "random_dir", "random_file.txt", "s2", "user_folder"]
    assert retired(root) == ["s1.nxdold"]        # kept for the next save to take its files over (reuse.py)
    for d, files in users.items():
        assert _snapshot_tree(os.path.join(root, d)) == files, d
    # a newer user folder with a `done` file is not a candidate for loading either
    _write(os.path.join(root, "zz_user", "done"))
    fresh = _model(offset=4)
    nxd_ckpt.load_checkpoint(root, model=fresh)
    assert_bit_equal(to_cpu_state(model.state_dict()), to_cpu_state(fresh.state_dict()))


def test_the_checkpoint_just_saved_is_never_deleted(tmp_path):
    """Even when another tag's `done` is dated in the future (clock skew on a shared filesystem)."""
    import time

    import nxd_ckpt

    root = str(tmp_path / "ckpt")
    _nxd_tag(root, "skewed", mtime=time.time() + 3600)
    nxd_ckpt.save_checkpoint(root, "s1", model=_model(), num_kept_ckpts=1, use_xser=True)
    assert os.path.isfile(os.path.join(root, "s1", "done"))
    assert set(nxd_ckpt.list_checkpoints(root)) == {"s1", "skewed"}


def test_a_checkpoint_being_loaded_is_not_deleted(tmp_path, monkeypatch):
    import nxd_ckpt
    from nxd_ckpt.reader import FileReader

    root = str(tmp_path / "ckpt")
    model = _model()
    expect = to_cpu_state(model.state_dict())
    nxd_ckpt.save_checkpoint(root, "old", model=model, use_xser=True)

    reading, gate = threading.Event(), threading.Event()
    original = FileReader.read

    def slow_read(self, relpath):
        if self.tag == "old":
            reading.set()
            gate.wait(60)
        return original(self, relpath)

    monkeypatch.setattr(FileReader, "read", slow_read)
    target, errors = {}, []

    def load():
        try:
            nxd_ckpt.load_checkpoint(root, tag="old", model=target)
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    loader = threading.Thread(target=load)
    loader.start()
    try:
        assert reading.wait(60)
        with torch.no_grad():
            model.bias.add_(1.0)
        for tag in ("n1", "n2"):
            nxd_ckpt.save_checkpoint(root, tag, model=model, num_kept_ckpts=1, use_xser=True)
        assert os.path.isfile(os.path.join(root, "old", "done")), "retention deleted a checkpoint being loaded"
    finally:
        gate.set()
        loader.join(60)
    assert not errors, errors
    assert_bit_equal(expect, target)
    nxd_ckpt.save_checkpoint(root, "n3", model=model, num_kept_ckpts=1, use_xser=True)   # no longer protected
    assert tags_on_disk(root) == ["n3", "newest"] and retired(root) == ["n2.nxdold"]


def test_an_interrupted_delete_never_looks_complete(tmp_path):
    import nxd_ckpt

    root = str(tmp_path / "ckpt")
    model = _model()
    for tag in ("t1", "t2"):
        nxd_ckpt.save_checkpoint(root, tag, model=model, use_xser=True)
    # retention's first step on t1, then a crash: the rest of t1 is still there
    os.unlink(os.path.join(root, "t1", "done"))
    assert nxd_ckpt.list_checkpoints(root) == ["t2"]
    with pytest.raises(nxd_ckpt.IncompleteCheckpointError) as info:
        nxd_ckpt.load_checkpoint(root, tag="t1", model=_model(1))
    assert "'t2'" in str(info.value) and "tag=None" in str(info.value)
    nxd_ckpt.save_checkpoint(root, "t3", model=model, use_xser=True)     # keep all: only the debris goes
    assert tags_on_disk(root) == ["newest", "t2", "t3"] and retired(root) == ["t1.nxdold"]


def test_a_crash_inside_the_delete_leaves_recognisable_debris(tmp_path, monkeypatch):
    """The delete dies part-way through removing the files (here: after the `checkpoint` marker went).
    The save that ran it is still complete, and the next save removes what is left."""
    import shutil

    import nxd_ckpt
    from nxd_ckpt.storage.local import LocalStorage

    root = str(tmp_path / "ckpt")
    model = _model()
    nxd_ckpt.save_checkpoint(root, "t1", model=model, num_kept_ckpts=1, use_xser=True)
    original = LocalStorage.remove_tree

    def dies_midway(self, relpath):
        path = self.path(relpath)
        if os.path.isfile(os.path.join(path, "checkpoint")):
            os.unlink(os.path.join(path, "checkpoint"))
            shutil.rmtree(os.path.join(path, "model", os.listdir(os.path.join(path, "model"))[0]),
                          ignore_errors=True)
            raise OSError(5, "Input/output error (injected)")
        return original(self, relpath)

    monkeypatch.setattr(LocalStorage, "remove_tree", dies_midway)
    nxd_ckpt.save_checkpoint(root, "t2", model=model, num_kept_ckpts=1, use_xser=True)   # committed; retention failed
    assert nxd_ckpt.list_checkpoints(root) == ["t2"]
    monkeypatch.setattr(LocalStorage, "remove_tree", original)
    nxd_ckpt.save_checkpoint(root, "t3", model=model, num_kept_ckpts=1, use_xser=True)
    assert tags_on_disk(root) == ["newest", "t3"]


def test_at_most_num_kept_plus_one_tags_on_disk(tmp_path, monkeypatch):
    """Counted in bytes: the kept tags, the one being written and what the reuse folder holds (the tag retired
    last, whose files the save being written takes over) never add up to more than num_kept + 1 tags."""
    import nxd_ckpt
    import nxd_ckpt.commit as commit
    from nxd_ckpt.storage import set_write_hook

    root = str(tmp_path / "ckpt")
    peak = [0]

    def sample(*_):
        sizes = [os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(root) for f in fs]
        peak[0] = max(peak[0], sum(sizes))

    original_delete = commit.delete_tag

    def sampling_delete(storage, name, *rest):
        sample()
        original_delete(storage, name, *rest)
        sample()

    monkeypatch.setattr(commit, "delete_tag", sampling_delete)
    model = _model()
    nxd_ckpt.save_checkpoint(root, "s0", model=model, num_kept_ckpts=2, use_xser=True)
    one_tag = sum(os.path.getsize(os.path.join(root, "s0", rel)) for rel in all_files(os.path.join(root, "s0")))
    set_write_hook(sample)
    try:
        for i in range(1, 7):
            with torch.no_grad():
                model.bias.add_(1.0)
            nxd_ckpt.save_checkpoint(root, f"s{i}", model=model, async_save=True, num_kept_ckpts=2, use_xser=True)
        nxd_ckpt.finalize_checkpoint()
    finally:
        set_write_hook(None)
    # plus a few bytes: the `newest` pointer, the retired tag's `checkpoint` marker (written, never taken over)
    assert 2 * one_tag < peak[0] <= 3 * one_tag + 64, (peak, one_tag)
    assert tags_on_disk(root) == ["newest", "s5", "s6"] and retired(root) == ["s4.nxdold"]
    fresh = _model(offset=2)
    nxd_ckpt.load_checkpoint(root, model=fresh)
    assert_bit_equal(to_cpu_state(model.state_dict()), to_cpu_state(fresh.state_dict()))
