"""Retired checkpoints' files taken over by the next save (nxd_ckpt.reuse): which files, with what bytes, what is
never overwritten, and what the tag holds afterwards."""
from __future__ import annotations

import os

import pytest
import torch

from backends import retired, tags_on_disk
from harness import run_ranks
from tiny_models import TinyShard, all_files, assert_bit_equal, to_cpu_state, train_steps, xla_device

REUSE = ".nxd_ckpt_reuse"


def _inodes(path: str) -> dict:
    return {rel: os.stat(os.path.join(path, rel)).st_ino for rel in all_files(path)}


def _verified(root: str, tag: str) -> None:
    from nxd_ckpt.verify import verify_tag

    res = verify_tag(os.path.join(root, tag))
    assert res.ok and res.kind == "nxd-ckpt", res.problems


def test_the_next_save_takes_over_every_file_of_the_retired_tag(tmp_path):
    import nxd_ckpt

    root = str(tmp_path / "ckpt")
    model = TinyShard()
    nxd_ckpt.save_checkpoint(root, "s0", model=model, num_kept_ckpts=1, use_xser=True)
    nxd_ckpt.save_checkpoint(root, "s1", model=model, num_kept_ckpts=1, use_xser=True)
    assert tags_on_disk(root) == ["newest", "s1"] and retired(root) == ["s0.nxdold"]
    held = _inodes(os.path.join(root, REUSE, "s0.nxdold"))
    with torch.no_grad():
        model.bias.add_(1.0)
    nxd_ckpt.save_checkpoint(root, "s2", model=model, num_kept_ckpts=1, use_xser=True)
    new = _inodes(os.path.join(root, "s2"))
    # every file the save writes through its writers was there to take; the markers and the manifest are new
    taken = {rel for rel, ino in held.items() if new.get(rel) == ino}
    assert taken == set(held) - {"checkpoint"}, sorted(set(held) ^ taken)
    assert retired(root) == ["s1.nxdold"]
    _verified(root, "s2")
    fresh = TinyShard(seed_offset=3)
    nxd_ckpt.load_checkpoint(root, model=fresh)
    assert_bit_equal(to_cpu_state(model.state_dict()), to_cpu_state(fresh.state_dict()))


def test_the_tag_holds_exactly_its_own_files_after_a_take_over(tmp_path):
    """The retired tag held an optimizer, user content and stray files and folders; the next save writes the model
    only: what it did not write is gone before `done`, and the tag holds the file set of a save from scratch."""
    import nxd_ckpt

    root, fresh_root = str(tmp_path / "ckpt"), str(tmp_path / "fresh")
    model = TinyShard()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    train_steps(model, opt, 1, seed=0)
    for tag in ("s0", "s1"):
        nxd_ckpt.save_checkpoint(root, tag, model=model, optimizer=opt, user_content={"n": 1}, num_kept_ckpts=1,
                                 use_xser=True)
    held = os.path.join(root, REUSE, "s0.nxdold")
    os.makedirs(os.path.join(held, "extra", "empty"))
    (tmp_path / "ckpt" / REUSE / "s0.nxdold" / "model" / "stray.bin").write_bytes(b"x")
    assert any(rel.startswith("optim/") for rel in all_files(held))
    nxd_ckpt.save_checkpoint(root, "s2", model=model, num_kept_ckpts=1, use_xser=True)
    nxd_ckpt.save_checkpoint(fresh_root, "s2", model=model, use_xser=True)
    assert all_files(os.path.join(root, "s2")) == all_files(os.path.join(fresh_root, "s2"))
    assert sorted(os.listdir(os.path.join(root, "s2"))) == sorted(os.listdir(os.path.join(fresh_root, "s2")))
    _verified(root, "s2")


def test_files_taken_over_are_cut_to_their_new_length(tmp_path):
    """A larger retired file under the same name: written directly (2 MB and more) or through the page cache."""
    import nxd_ckpt

    root = str(tmp_path / "ckpt")
    gen = torch.Generator().manual_seed(0)
    big = {"w": torch.randn(1 << 20, generator=gen), "b": torch.randn(5000, generator=gen)}
    nxd_ckpt.save_checkpoint(root, "big", model=big, user_content={"note": "x" * 10000}, num_kept_ckpts=1,
                             use_xser=True)
    nxd_ckpt.save_checkpoint(root, "big2", model=big, num_kept_ckpts=1, use_xser=True)
    held = _inodes(os.path.join(root, REUSE, "big.nxdold"))
    small = {"w": torch.randn(600_000, generator=gen), "b": torch.randn(7, generator=gen)}
    nxd_ckpt.save_checkpoint(root, "small", model=small, user_content={"note": "y"}, num_kept_ckpts=1, use_xser=True)
    new = _inodes(os.path.join(root, "small"))
    taken = {rel for rel, ino in held.items() if new.get(rel) == ino}
    tensor_files = {rel for rel in held if ".tensors/" in rel}
    assert tensor_files and tensor_files | {"user_content.pt"} <= taken
    _verified(root, "small")
    loaded = {"w": torch.zeros(600_000), "b": torch.zeros(7)}
    assert nxd_ckpt.load_checkpoint(root, model=loaded) == {"note": "y"}
    assert_bit_equal(small, loaded)


def test_links_and_folders_in_the_reuse_folder_are_never_written_through(tmp_path):
    """A hard link shares its bytes with another name, a symlink points elsewhere, a folder or a FIFO is no file:
    none is written through; the save creates its own files and the outside ones keep their bytes."""
    import nxd_ckpt

    root = str(tmp_path / "ckpt")
    model = TinyShard()
    nxd_ckpt.save_checkpoint(root, "s0", model=model, num_kept_ckpts=1, use_xser=True)
    nxd_ckpt.save_checkpoint(root, "s1", model=model, num_kept_ckpts=1, use_xser=True)
    tensors = os.path.join(root, REUSE, "s0.nxdold", "model", "dp_rank_00_tp_rank_00_pp_rank_00.pt.tensors")
    outside = tmp_path / "outside.bin"
    outside.write_bytes(b"keep me")
    os.unlink(os.path.join(tensors, "tensor_0.pt"))
    os.link(outside, os.path.join(tensors, "tensor_0.pt"))
    os.unlink(os.path.join(tensors, "tensor_1.pt"))
    os.symlink(outside, os.path.join(tensors, "tensor_1.pt"))
    os.unlink(os.path.join(tensors, "tensor_2.pt"))
    os.makedirs(os.path.join(tensors, "tensor_2.pt", "inside"))
    os.unlink(os.path.join(tensors, "tensor_3.pt"))
    os.mkfifo(os.path.join(tensors, "tensor_3.pt"))          # opened for writing, it would block forever
    nxd_ckpt.save_checkpoint(root, "s2", model=model, num_kept_ckpts=1, use_xser=True)
    assert outside.read_bytes() == b"keep me" and os.stat(outside).st_nlink == 1
    _verified(root, "s2")
    fresh = TinyShard(seed_offset=3)
    nxd_ckpt.load_checkpoint(root, model=fresh)
    assert_bit_equal(to_cpu_state(model.state_dict()), to_cpu_state(fresh.state_dict()))


def test_a_tag_holding_a_symlink_is_deleted_not_kept(tmp_path):
    """Renaming files out of a tag whose folder is a link would move the linked-to tag's files into the next save
    (and overwrite them): such a tag is deleted (the link, not what it points at), never kept for reuse."""
    import shutil

    import nxd_ckpt

    root = str(tmp_path / "ckpt")
    model = TinyShard()
    for tag in ("s0", "s1"):
        nxd_ckpt.save_checkpoint(root, tag, model=model, use_xser=True)
    shutil.rmtree(os.path.join(root, "s0", "model"))
    os.symlink(os.path.join(root, "s1", "model"), os.path.join(root, "s0", "model"))
    held = _inodes(os.path.join(root, "s1"))
    nxd_ckpt.save_checkpoint(root, "s2", model=model, num_kept_ckpts=2, use_xser=True)
    assert tags_on_disk(root) == ["newest", "s1", "s2"] and retired(root) == []
    nxd_ckpt.save_checkpoint(root, "s3", model=model, num_kept_ckpts=2, use_xser=True)
    # s1 untouched until retired itself (its `done` and manifest go first, as in any delete)
    assert _inodes(os.path.join(root, REUSE, "s1.nxdold")) == {k: v for k, v in held.items()
                                                               if k not in ("done", "manifest.json")}
    _verified(root, "s3")


def test_reuse_retired_files_false_deletes_and_empties_the_folder(tmp_path):
    import nxd_ckpt

    root = str(tmp_path / "ckpt")
    model = TinyShard()
    for tag in ("s0", "s1"):
        nxd_ckpt.save_checkpoint(root, tag, model=model, num_kept_ckpts=1, use_xser=True)
    assert retired(root) == ["s0.nxdold"]
    held = set(_inodes(os.path.join(root, REUSE, "s0.nxdold")).values())
    nxd_ckpt.save_checkpoint(root, "s2", model=model, num_kept_ckpts=1, use_xser=True, reuse_retired_files=False)
    assert not held & set(_inodes(os.path.join(root, "s2")).values())
    assert sorted(os.listdir(root)) == ["newest", "s2"]
    with pytest.raises(nxd_ckpt.CheckpointArgumentError, match="reuse_retired_files must be True or False"):
        nxd_ckpt.save_checkpoint(root, "s3", model=model, reuse_retired_files=1)
    with pytest.raises(nxd_ckpt.CheckpointArgumentError, match="reserves"):
        nxd_ckpt.save_checkpoint(root, REUSE, model=model)


def _dp_rank(rank, world, root):
    """Both ranks hold the same (DP-replicated) state and split its tensor files; each takes over its own."""
    import torch.distributed as dist

    import nxd_ckpt

    model = TinyShard().to(xla_device())
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    held = None
    for step in range(3):
        train_steps(model, opt, 1, seed=step)
        dist.barrier()
        if step == 2 and rank == 0:
            held = _inodes(os.path.join(root, REUSE, "s0.nxdold"))
        dist.barrier()
        nxd_ckpt.save_checkpoint(root, f"s{step}", model=model, optimizer=opt, num_kept_ckpts=1, async_save=True,
                                 use_xser=True)
        nxd_ckpt.finalize_checkpoint()
    want = to_cpu_state({"model": model.state_dict(), "optim": opt.state_dict()})
    fresh = TinyShard(seed_offset=9).to(xla_device())
    fresh_opt = torch.optim.Adam(fresh.parameters(), lr=0.5)
    nxd_ckpt.load_checkpoint(root, model=fresh, optimizer=fresh_opt)
    assert_bit_equal(want, to_cpu_state({"model": fresh.state_dict(), "optim": fresh_opt.state_dict()}))
    return held


def test_dp_replicas_take_over_their_own_files(tmp_path):
    root = str(tmp_path / "ckpt")
    held = run_ranks(_dp_rank, 2, root, timeout=180)[0]
    new = _inodes(os.path.join(root, "s2"))
    tensor_files = {rel for rel in new if ".tensors/" in rel}
    assert len(tensor_files) > 4 and all(new[rel] == held[rel] for rel in tensor_files)
    assert tags_on_disk(root) == ["newest", "s2"] and retired(root) == ["s1.nxdold"]
    _verified(root, "s2")


def test_a_retired_file_where_the_save_wants_a_folder_is_replaced(tmp_path):
    """The retired tag holds a file at the path of a folder this save writes into: the file goes, the save
    succeeds."""
    import shutil

    import nxd_ckpt

    root = str(tmp_path / "ckpt")
    model = TinyShard()
    for tag in ("s0", "s1"):
        nxd_ckpt.save_checkpoint(root, tag, model=model, num_kept_ckpts=1, use_xser=True)
    tensors = os.path.join(root, REUSE, "s0.nxdold", "model", "dp_rank_00_tp_rank_00_pp_rank_00.pt.tensors")
    shutil.rmtree(tensors)
    with open(tensors, "wb") as f:
        f.write(b"in the way")
    nxd_ckpt.save_checkpoint(root, "s2", model=model, num_kept_ckpts=1, use_xser=True)
    _verified(root, "s2")
    fresh = TinyShard(seed_offset=3)
    nxd_ckpt.load_checkpoint(root, model=fresh)
    assert_bit_equal(to_cpu_state(model.state_dict()), to_cpu_state(fresh.state_dict()))


def test_a_retired_tag_that_cannot_be_listed_is_deleted_and_retention_goes_on(tmp_path, monkeypatch):
    """The link check cannot read the tag (permissions, removed meanwhile): it is deleted as without reuse, and
    retention is not stopped by it."""
    import nxd_ckpt
    from nxd_ckpt import reuse

    root = str(tmp_path / "ckpt")
    model = TinyShard()
    real = reuse._holds_link

    def refuse(folder):
        if "s0" in folder:
            raise PermissionError(13, "Permission denied", folder)
        return real(folder)

    monkeypatch.setattr(reuse, "_holds_link", refuse)
    for tag in ("s0", "s1", "s2"):
        nxd_ckpt.save_checkpoint(root, tag, model=model, num_kept_ckpts=1, use_xser=True)
        assert nxd_ckpt.save_stats()[-1].get("retention_error") is None
    assert tags_on_disk(root) == ["newest", "s2"] and retired(root) == ["s1.nxdold"]
