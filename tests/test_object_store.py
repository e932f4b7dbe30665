"""The save/load path on an object store (keys only, no rename, no directories) with the marker commit.

What is particular to the marker commit, on the in-memory bucket (``mem://``): the key layout, re-save and
retention deleting `done` first, a second job committing the same tag, crash debris; and a 4-rank async
save and load on the shared-directory bucket (``objdir://``). The matrices that run on both backends
(damage, async, crashes, multi-rank save/load) are parametrized in their own files (``backends.py``).
"""
from __future__ import annotations

import uuid

import pytest

from harness import run_ranks
from test_integrity import _assert_state, _objects, _state
from tiny_models import TinyShard, assert_bit_equal, to_cpu_state, train_steps, xla_device

from nxd_ckpt.storage.testing import enable_test_schemes  # noqa: E402

enable_test_schemes()   # objdir:// / mem:// in this process and in every rank process that imports this module


def _mem_url() -> str:
    return f"mem://b{uuid.uuid4().hex[:8]}/run/ckpt"


def _store(url):
    from nxd_ckpt.storage import open_storage

    return open_storage(url)


def save_two(url: str) -> dict:
    """Save two complete xser checkpoints 'a' (step 1) and 'b' (step 2) to ``url``; the state saved in each."""
    import nxd_ckpt

    model, opt, sched = _objects()
    states = {}
    for step, tag in ((1, "a"), (2, "b")):
        train_steps(model, opt, 1, seed=3, sched=sched, start=step - 1)
        states[tag] = _state(model, opt, sched)
        nxd_ckpt.save_checkpoint(url, tag, use_xser=True, model=model, optimizer=opt, scheduler=sched,
                                 user_content={"step": step})
    return states


@pytest.fixture
def saved():
    """Two complete checkpoints 'a' and 'b' in a fresh in-memory bucket, and the state saved in each."""
    url = _mem_url()
    return url, save_two(url)


def test_marker_commit_writes_final_keys_and_no_directory_objects(saved):
    import nxd_ckpt

    url, states = saved
    s = _store(url)
    keys = s.list("")
    assert not any(k.endswith("/") or ".nxdtmp" in k or ".nxdold" in k for k in keys), keys
    assert {"a/done", "a/checkpoint", "a/manifest.json", "b/done", "newest"} <= set(keys)
    man = s.read("b/manifest.json")
    assert s.read("b/done").startswith(b"nxd-ckpt manifest size=%d" % len(man))
    assert nxd_ckpt.list_checkpoints(url) == ["b", "a"]
    model, opt, sched = _objects(seed_offset=5)
    assert nxd_ckpt.load_checkpoint(url, tag="a", model=model, optimizer=opt, scheduler=sched) == {"step": 1}
    _assert_state(states["a"], model, opt, sched)


def test_resave_deletes_done_first_and_retention_keeps_newest(saved):
    """Re-saving 'a' removes its old `done` (and old objects) before anything else; retention with
    num_kept_ckpts=1 then removes 'b' entirely, `done` first."""
    import nxd_ckpt
    from nxd_ckpt.storage import base

    url, _ = saved
    s = _store(url)
    s.write_bytes("a/model/stale_extra.bin", b"from the old version")
    order = []
    real_delete = type(s).delete_many

    def spy(self, relpaths):
        relpaths = list(relpaths)
        order.extend(relpaths)
        real_delete(self, relpaths)

    type(s).delete_many = spy
    try:
        model = TinyShard(seed_offset=8)
        nxd_ckpt.save_checkpoint(url, "a", use_xser=True, model=model, user_content={"step": 9}, num_kept_ckpts=1)
    finally:
        type(s).delete_many = real_delete
    assert order.index("a/done") < order.index("a/model/stale_extra.bin")
    assert order.index("b/done") < min(order.index(k) for k in order if k.startswith("b/") and k != "b/done")
    assert nxd_ckpt.list_checkpoints(url) == ["a"]
    assert sorted(s.listdir("")) == ["a", "newest"]
    assert "a/model/stale_extra.bin" not in s.list("a")
    assert base._write_hook is None


def test_second_job_committing_the_same_tag_fails_instead_of_interleaving(saved):
    """`done` is written exclusively (If-None-Match): a `done` that appeared meanwhile is a conflict."""
    import nxd_ckpt
    from nxd_ckpt.storage import set_write_hook

    url, _ = saved
    s = _store(url)

    def other_job_commits(rel):
        if rel == "c/manifest.json":
            s.write_bytes("c/done", b"1")          # another job's marker lands first

    set_write_hook(other_job_commits)
    try:
        with pytest.raises(nxd_ckpt.RankFailureError, match="another job committed the same tag"):
            nxd_ckpt.save_checkpoint(url, "c", use_xser=True, model=TinyShard(), user_content={"step": 3})
    finally:
        set_write_hook(None)
    assert s.read("c/done") == b"1"


# --- multi-rank, over a bucket the processes share ------------------------------------------------------
def _tp2_dp2_rank(rank, world, url):
    import torch

    import nxd_ckpt
    import parallel_state as ps

    ps.initialize_model_parallel(tensor_model_parallel_size=2)
    dev = xla_device()
    model = TinyShard(ps.get_tensor_model_parallel_rank()).to(dev)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    train_steps(model, opt, 2, seed=1, dp_rank=0)
    nxd_ckpt.save_checkpoint(url, "step_2", use_xser=True, model=model, optimizer=opt, user_content={"step": 2}, async_save=True)
    nxd_ckpt.finalize_checkpoint()
    fresh = TinyShard(ps.get_tensor_model_parallel_rank(), seed_offset=5).to(dev)
    fresh_opt = torch.optim.Adam(fresh.parameters(), lr=0.5)
    assert nxd_ckpt.load_checkpoint(url, model=fresh, optimizer=fresh_opt) == {"step": 2}
    assert_bit_equal(to_cpu_state(model.state_dict()), to_cpu_state(fresh.state_dict()), "model")
    assert_bit_equal(to_cpu_state(opt.state_dict()), to_cpu_state(fresh_opt.state_dict()), "optim")
    return True


def test_multirank_async_save_and_load_on_shared_object_store(tmp_path):
    url = f"objdir://{tmp_path}/bucket//run"
    assert run_ranks(_tp2_dp2_rank, 4, url, timeout=240) == [True] * 4
    keys = set(_store(url).list(""))
    model = {k.split("/", 2)[2] for k in keys if k.startswith("step_2/model/") and ".tensors/" not in k}
    assert model == {f"dp_rank_00_tp_rank_{t:02d}_pp_rank_00.pt{s}" for t in (0, 1) for s in ("", ".info.pt")}
    assert {"newest", "step_2/done", "step_2/manifest.json", "step_2/checkpoint"} <= keys


@pytest.mark.parametrize("left", [["checkpoint"], ["checkpoint", "scheduler.pt"],
                                  ["checkpoint", "scheduler.pt", "user_content.pt"]])
def test_save_interrupted_before_any_shard_is_debris_the_next_save_removes(saved, left):
    """A save killed after rank 0 wrote its marker and small files but before any rank's model/optim object
    arrived leaves a prefix with no model/ or optim/: it is still an interrupted save, removed by the next
    successful save. A prefix holding anything else beside `checkpoint` is not ours and stays."""
    import nxd_ckpt

    url, _ = saved
    s = _store(url)
    for name in left:
        s.write_bytes(f"c/{name}", b"1")
    for name in ("checkpoint", "notes.txt"):
        s.write_bytes(f"not_a_tag/{name}", b"1")
    nxd_ckpt.save_checkpoint(url, "d", use_xser=True, model=TinyShard(seed_offset=3))
    assert sorted(s.listdir("")) == ["a", "b", "d", "newest", "not_a_tag"]
    assert sorted(s.listdir("not_a_tag")) == ["checkpoint", "notes.txt"]
