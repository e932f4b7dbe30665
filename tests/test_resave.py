"""Re-saving an existing tag: one atomic swap where the filesystem has it; where it has not, a crash between
the two renames still loses nothing (the tag is read where it lies and the next save renames it back)."""
from __future__ import annotations

import os

import pytest

from backends import tags_on_disk
from tiny_models import TinyShard, assert_bit_equal, to_cpu_state


def _save(root, tag, offset, **kw):
    import nxd_ckpt

    model = TinyShard(seed_offset=offset)
    nxd_ckpt.save_checkpoint(root, tag, model=model, **kw)
    return to_cpu_state(model.state_dict())


def _loaded(root, tag=None):
    import nxd_ckpt

    model = TinyShard(seed_offset=99)
    nxd_ckpt.load_checkpoint(root, tag=tag, model=model)
    return to_cpu_state(model.state_dict())


def _crashed_between_renames(tmp_path):
    """The directory a SIGKILL leaves between publish's two renames when the filesystem cannot swap:
    the old `x` moved aside as x.nxdold, the new one complete (manifest, done) still in x.nxdtmp."""
    root, other = str(tmp_path / "ckpt"), str(tmp_path / "other")
    _save(root, "a", 1)
    v1 = _save(root, "x", 2)
    v2 = _save(other, "x", 3)
    os.rename(os.path.join(root, "x"), os.path.join(root, "x.nxdold"))
    os.rename(os.path.join(other, "x"), os.path.join(root, "x.nxdtmp"))
    return root, v1, v2


@pytest.mark.parametrize("can_swap", [True, False])
def test_resaving_a_tag_replaces_it_and_leaves_no_debris(tmp_path, monkeypatch, can_swap):
    from nxd_ckpt.storage.local import LocalStorage

    calls = []
    original = LocalStorage.exchange

    def exchange(self, a, b):
        calls.append((a, b))
        return original(self, a, b) if can_swap else False

    monkeypatch.setattr(LocalStorage, "exchange", exchange)
    root = str(tmp_path / "ckpt")
    _save(root, "x", 1)
    v2 = _save(root, "x", 2)
    assert calls == [("x.nxdtmp", "x")]
    assert tags_on_disk(root) == ["newest", "x"]
    assert_bit_equal(_loaded(root, "x"), v2)


def test_a_crash_between_the_renames_loses_nothing(tmp_path, capsys):
    import nxd_ckpt

    root, _, v2 = _crashed_between_renames(tmp_path)
    assert nxd_ckpt.list_checkpoints(root) == ["x", "a"]
    assert nxd_ckpt.has_checkpoint(root)
    assert_bit_equal(_loaded(root), v2)            # tag=None: the new version, read where it lies
    assert_bit_equal(_loaded(root, "x"), v2)
    assert sorted(os.listdir(root)) == ["a", "newest", "x.nxdold", "x.nxdtmp"], "loading never renames"
    from nxd_ckpt.cli import main

    assert main(["verify", root]) == 0
    assert "x.nxdtmp" in capsys.readouterr().out                  # verify checks what load would read
    assert main(["ls", root]) == 0
    listing = capsys.readouterr().out
    assert [line.split()[:2] for line in listing.splitlines()[1:3]] == [["x", "complete"], ["a", "complete"]]
    assert "x: left as x.nxdtmp by a crash while it was published" in listing
    _save(root, "b", 4)                            # the next save puts x back, then removes the debris
    assert tags_on_disk(root) == ["a", "b", "newest", "x"]
    assert_bit_equal(_loaded(root, "x"), v2)


def test_a_resave_of_the_same_tag_after_the_crash_restores_before_it_stages(tmp_path):
    import nxd_ckpt

    root, _, _ = _crashed_between_renames(tmp_path)
    v3 = _save(root, "x", 5)
    assert tags_on_disk(root) == ["a", "newest", "x"]
    assert nxd_ckpt.list_checkpoints(root) == ["x", "a"]
    assert_bit_equal(_loaded(root, "x"), v3)


def test_the_moved_aside_version_alone_is_restored(tmp_path):
    """The new version never got its `done` (or was lost): the old one, moved aside, is the tag."""
    import nxd_ckpt

    root, v1, _ = _crashed_between_renames(tmp_path)
    os.unlink(os.path.join(root, "x.nxdtmp", "done"))
    assert nxd_ckpt.list_checkpoints(root) == ["x", "a"]
    assert_bit_equal(_loaded(root, "x"), v1)
    _save(root, "b", 4)
    assert tags_on_disk(root) == ["a", "b", "newest", "x"]
    assert_bit_equal(_loaded(root, "x"), v1)


def test_debris_of_a_delete_is_never_taken_for_a_checkpoint(tmp_path):
    """Retention removes `done` before it renames a tag to .nxdold: such debris stays debris."""
    import nxd_ckpt

    root = str(tmp_path / "ckpt")
    _save(root, "a", 1)
    _save(root, "x", 2)
    os.unlink(os.path.join(root, "x", "done"))
    os.rename(os.path.join(root, "x"), os.path.join(root, "x.nxdold"))
    assert nxd_ckpt.list_checkpoints(root) == ["a"]
    with pytest.raises(nxd_ckpt.CheckpointNotFoundError, match="no checkpoint 'x'"):
        _loaded(root, "x")
    _save(root, "b", 3)
    assert tags_on_disk(root) == ["a", "b", "newest"]


def test_a_replaced_version_half_removed_is_never_restored(tmp_path, monkeypatch):
    """The version a re-save replaced is removed `done` first: if that removal dies half-way and the tag
    is later deleted, what is left is debris, not a checkpoint to bring back."""
    import shutil

    import nxd_ckpt
    from nxd_ckpt import commit
    from nxd_ckpt.storage.local import LocalStorage

    root = str(tmp_path / "ckpt")
    _save(root, "a", 1)
    _save(root, "x", 2)
    original = LocalStorage.remove_tree

    def dies_half_way(self, relpath):
        if relpath == "x.nxdtmp":
            shutil.rmtree(os.path.join(self.path(relpath), "model"))
            raise KeyboardInterrupt("killed while removing the replaced version")
        original(self, relpath)

    monkeypatch.setattr(LocalStorage, "remove_tree", dies_half_way)
    with pytest.raises(KeyboardInterrupt):
        _save(root, "x", 3)
    monkeypatch.setattr(LocalStorage, "remove_tree", original)
    assert not os.path.exists(os.path.join(root, "x.nxdtmp", "done"))
    commit.delete_tag(LocalStorage(root), "x")            # e.g. retention, or by hand
    assert nxd_ckpt.list_checkpoints(root) == ["a"]
    _save(root, "b", 4)
    assert tags_on_disk(root) == ["a", "b", "newest"]
