"""Async save behaviour (never timed): what blocks, what is captured when, errors on every rank."""
from __future__ import annotations

import os
import threading
import time

import pytest
import torch

from backends import ckpt_root, exists, files_under, tags_on_disk, top_level  # noqa: F401 - ckpt_root is a fixture
from harness import run_ranks
from tiny_models import TinyShard, assert_bit_equal, sync, to_cpu_state, train_steps, xla_device


@pytest.fixture
def clean_hook():
    from nxd_ckpt.storage import set_write_hook

    yield set_write_hook
    set_write_hook(None)


def _wait_for(pred, timeout=60.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.02)
    return False


def test_call_returns_before_any_file_exists(ckpt_root, clean_hook):
    import nxd_ckpt

    gate = threading.Event()
    clean_hook(lambda rel: gate.wait(60))
    model = TinyShard().to(xla_device())
    root = ckpt_root
    nxd_ckpt.save_checkpoint(root, "a", model=model, async_save=True, use_xser=True)
    assert not files_under(root), "files appeared before the writers were released"
    assert nxd_ckpt.list_checkpoints(root) == []
    gate.set()
    nxd_ckpt.finalize_checkpoint()
    assert nxd_ckpt.list_checkpoints(root) == ["a"]


def test_done_appears_without_a_further_save(ckpt_root):
    import nxd_ckpt

    model = TinyShard().to(xla_device())
    root = ckpt_root
    nxd_ckpt.save_checkpoint(root, "a", model=model, async_save=True, use_xser=True)
    assert _wait_for(lambda: exists(root, "a/done"))
    nxd_ckpt.finalize_checkpoint()


def test_stats_and_log_of_a_sync_save_count_the_whole_save_as_stall(tmp_path, caplog):
    import nxd_ckpt

    model = TinyShard().to(xla_device())
    root = str(tmp_path / "ckpt")
    with caplog.at_level("INFO", logger="nxd_ckpt"):
        nxd_ckpt.save_checkpoint(root, "s", model=model, use_xser=True)
    stats = nxd_ckpt.save_stats()[-1]
    assert stats["tag"] == "s" and stats["ok"]
    assert stats["stall_s"] >= stats["commit_s"], "a sync save blocks until its commit"
    line = next(r.getMessage() for r in caplog.records if "checkpoint s: stall" in r.getMessage())
    assert f"stall {1000 * stats['stall_s']:.1f} ms" in line


def test_later_mutations_do_not_reach_the_files(ckpt_root, clean_hook):
    import nxd_ckpt

    gate = threading.Event()
    clean_hook(lambda rel: gate.wait(60))
    dev = xla_device()
    model = TinyShard().to(dev)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    train_steps(model, opt, 1, seed=7)
    user = {"step": 1, "items": [1, 2]}
    expect_model, expect_opt = to_cpu_state(model.state_dict()), to_cpu_state(opt.state_dict())
    root = ckpt_root
    nxd_ckpt.save_checkpoint(root, "a", model=model, optimizer=opt, user_content=user, async_save=True, use_xser=True)
    # mutate everything: device params in place, Adam's CPU step tensor, the user's dict
    with torch.no_grad():
        for p in model.parameters():
            p.add_(100.0)
    sync()
    for st in opt.state.values():
        st["step"].add_(50)
    opt.param_groups[0]["lr"] = 0.5                # the ref file is pickled by a writer, after the call
    opt.param_groups[0]["betas"] = (0.0, 0.0)
    user["step"] = 999
    user["items"].append(3)
    gate.set()
    nxd_ckpt.finalize_checkpoint()
    fresh = TinyShard(seed_offset=3).to(dev)
    fresh_opt = torch.optim.Adam(fresh.parameters(), lr=0.1)
    uc = nxd_ckpt.load_checkpoint(root, model=fresh, optimizer=fresh_opt)
    assert uc == {"step": 1, "items": [1, 2]}
    assert_bit_equal(expect_model, to_cpu_state(fresh.state_dict()))
    assert_bit_equal(expect_opt, to_cpu_state(fresh_opt.state_dict()))


def test_twenty_async_saves_keep_exactly_two(ckpt_root):
    import nxd_ckpt

    model = TinyShard().to(xla_device())
    root = ckpt_root
    for i in range(20):
        with torch.no_grad():
            model.bias.add_(1.0)
        nxd_ckpt.save_checkpoint(root, f"step_{i}", model=model, async_save=True, num_kept_ckpts=2, use_xser=True)
    nxd_ckpt.finalize_checkpoint()
    assert nxd_ckpt.list_checkpoints(root) == ["step_19", "step_18"]
    assert tags_on_disk(root) == ["newest", "step_18", "step_19"]
    fresh = TinyShard(seed_offset=1).to(xla_device())
    nxd_ckpt.load_checkpoint(root, model=fresh)
    assert_bit_equal(to_cpu_state(model.state_dict()), to_cpu_state(fresh.state_dict()))


def test_small_budget_streams_and_stays_correct(ckpt_root):
    import nxd_ckpt

    model = TinyShard(hidden=64).to(xla_device())
    root = ckpt_root
    # 64x64 float32 = 16 KiB per matrix: a 20 KiB budget forces one tensor at a time
    nxd_ckpt.save_checkpoint(root, "a", model=model, async_save=True, host_memory_budget=20 << 10, use_xser=True)
    nxd_ckpt.finalize_checkpoint()
    fresh = TinyShard(hidden=64, seed_offset=1).to(xla_device())
    nxd_ckpt.load_checkpoint(root, model=fresh)
    assert_bit_equal(to_cpu_state(model.state_dict()), to_cpu_state(fresh.state_dict()))


def test_device_snapshot_mode(ckpt_root):
    import nxd_ckpt

    dev = xla_device()
    model = TinyShard().to(dev)
    expect = to_cpu_state(model.state_dict())
    root = ckpt_root
    nxd_ckpt.save_checkpoint(root, "a", model=model, async_save=True, device_snapshot=True, use_xser=True)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(3.0)
    sync()
    nxd_ckpt.finalize_checkpoint()
    fresh = TinyShard(seed_offset=1).to(dev)
    nxd_ckpt.load_checkpoint(root, model=fresh)
    assert_bit_equal(expect, to_cpu_state(fresh.state_dict()))


def test_host_lease_gives_back_exactly_what_it_took():
    """A snapshot chunk's lease hands parts to its files; each part and the undistributed rest go back once."""
    from nxd_ckpt.staging import HostBudget

    budget = HostBudget(100)
    with budget.lease(60, timeout=1) as chunk:
        first, second = chunk.part(25), chunk.part(25)
        assert budget.used == 60
    assert budget.used == 50                      # the 10 bytes no file took went back with the chunk
    first.release()
    first.release()                               # a second release gives nothing back twice
    assert budget.used == 25
    second.release()
    assert budget.used == 0
    big = budget.lease(150, timeout=1)            # above capacity: granted alone, on an empty budget
    with pytest.raises(TimeoutError, match="150 of 100 still held"):
        budget.lease(1, timeout=0.05)
    big.release()
    assert budget.used == 0


def test_a_failed_snapshot_gives_its_host_memory_back(tmp_path, monkeypatch):
    """The device-to-host copy fails after the snapshot took its host staging memory: the save raises the
    copy's error, and the memory is back in the budget (it used to stay taken until the process ended)."""
    import nxd_ckpt
    import nxd_ckpt.engine as engine_mod

    root = str(tmp_path / "ckpt")
    model = TinyShard().to(xla_device())
    nxd_ckpt.save_checkpoint(root, "good", model=model, use_xser=True)

    def broken_copy(tensors, pool=None):
        raise RuntimeError("device lost (injected)")

    monkeypatch.setattr(engine_mod, "copy_to_host", broken_copy)
    with pytest.raises(nxd_ckpt.RankFailureError, match="device lost"):
        nxd_ckpt.save_checkpoint(root, "bad", model=model, use_xser=True)
    assert engine_mod.get_engine().budget.used == 0
    assert nxd_ckpt.list_checkpoints(root) == ["good"]


def test_a_failure_while_handing_out_files_leaks_no_budget_or_buffers(tmp_path, monkeypatch):
    """The copy succeeded but building the third file's task fails: the files built so far are never queued,
    their shares of the lease and every pool buffer come back, and nothing of the save is committed."""
    import nxd_ckpt
    import nxd_ckpt.engine as engine_mod

    root = str(tmp_path / "ckpt")
    state = {f"t{i}": torch.full((64,), float(i)).to(xla_device()) for i in range(6)}
    nxd_ckpt.save_checkpoint(root, "good", model=state, use_xser=True)
    real, calls = engine_mod.tensor_task, []

    def third_fails(relpath, t, lease):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("producer broke (injected)")
        return real(relpath, t, lease)

    monkeypatch.setattr(engine_mod, "tensor_task", third_fails)
    _save_fails_leaving_nothing(root, state, "producer broke")


def _save_fails_leaving_nothing(root, state, match):
    """The save of ``state`` raises ``match`` on this rank; no host budget or pool buffer stays taken, and only
    the earlier checkpoint ``good`` is listed."""
    import nxd_ckpt
    import nxd_ckpt.engine as engine_mod

    with pytest.raises(nxd_ckpt.RankFailureError, match=match):
        nxd_ckpt.save_checkpoint(root, "bad", model=state, use_xser=True)
    eng = engine_mod.get_engine()
    assert eng.budget.used == 0
    assert eng.buffers._lent == {}
    assert nxd_ckpt.list_checkpoints(root) == ["good"]


def _big_and_small_state():
    """Three 64 KiB matrices, each followed by a 256-byte vector (the snapshot copies them in that order)."""
    g = torch.Generator().manual_seed(9)
    state = {}
    for i in range(3):
        state[f"big{i}"] = torch.randn(128, 128, generator=g).to(xla_device())
        state[f"small{i}"] = torch.randn(64, generator=g).to(xla_device())
    sync()
    return state


def test_large_files_are_written_while_the_rest_is_still_copied(tmp_path, monkeypatch, clean_hook):
    """The snapshot copies a chunk HANDOUT_BYTES at a time and queues each part's large files at once, so a writer
    writes the first matrix while the second part is being copied; the small files wait for the whole chunk. The
    second copy waits for a tensor file to be written: with every file queued after the last copy it times out."""
    import nxd_ckpt
    import nxd_ckpt.engine as engine_mod

    monkeypatch.setattr(engine_mod, "HANDOUT_BYTES", 80 << 10)     # parts: (big0, small0), (big1, small1), ...
    monkeypatch.setattr(engine_mod, "EARLY_MIN_BYTES", 32 << 10)
    root = str(tmp_path / "ckpt")
    state = _big_and_small_state()
    expect = to_cpu_state(state)
    real_copy, copies, written, first = engine_mod.copy_to_host, [], [], threading.Event()

    def copy(tensors, pool=None):
        copies.append(len(tensors))
        if len(copies) == 2:
            assert first.wait(20), "no tensor file was written before the second part was copied"
        return real_copy(tensors, pool)

    def hook(rel):
        if ".tensors/" in rel:
            written.append((rel.rsplit("/", 1)[1], len(copies)))
            first.set()

    monkeypatch.setattr(engine_mod, "copy_to_host", copy)
    clean_hook(hook)
    nxd_ckpt.release_host_buffers()
    # one budget chunk (an earlier test's small budget stays with the process's engine until a save sets another)
    nxd_ckpt.save_checkpoint(root, "a", model=state, use_xser=True, async_save=True, host_memory_budget=64 << 20)
    nxd_ckpt.finalize_checkpoint()
    assert copies == [2, 2, 2]
    # no buffer was taken twice in the snapshot, though big0's came back while the rest was copied
    assert engine_mod.get_engine().buffers.held_bytes == 3 * (128 * 128 * 4) + 3 * 64 * 4
    tdir = next(os.path.join(d, n) for d, ns, _ in os.walk(root) for n in ns if n.endswith(".tensors"))
    big = {n for n in os.listdir(tdir) if os.path.getsize(os.path.join(tdir, n)) > 32 << 10}
    assert len(big) == 3 and len(written) == 6
    assert [n for n, _ in written if n not in big] and all(c == 3 for n, c in written if n not in big), written
    assert min(c for n, c in written if n in big) < 3, written
    got = {}
    nxd_ckpt.load_checkpoint(root, "a", model=got, strict=False)
    assert_bit_equal(expect, got)


def test_a_copy_failing_after_large_files_were_handed_out_leaks_nothing(tmp_path, monkeypatch):
    """The second part's copy fails after the first part's matrix went to the writers and its vector was held
    back: the save raises the copy's error, the held file's memory and every pool buffer come back, and only
    the earlier checkpoint is listed."""
    import nxd_ckpt
    import nxd_ckpt.engine as engine_mod

    monkeypatch.setattr(engine_mod, "HANDOUT_BYTES", 80 << 10)
    monkeypatch.setattr(engine_mod, "EARLY_MIN_BYTES", 32 << 10)
    root = str(tmp_path / "ckpt")
    state = _big_and_small_state()
    nxd_ckpt.save_checkpoint(root, "good", model=state, use_xser=True, host_memory_budget=64 << 20)
    real_copy, copies = engine_mod.copy_to_host, []

    def copy(tensors, pool=None):
        copies.append(1)
        if len(copies) == 2:
            raise RuntimeError("device lost in the second part (injected)")
        return real_copy(tensors, pool)

    monkeypatch.setattr(engine_mod, "copy_to_host", copy)
    _save_fails_leaving_nothing(root, state, "device lost in the second part")


# ---- a write error on one rank of four ---------------------------------------------------------------
def _failing_rank(rank, world, root):
    import nxd_ckpt
    from nxd_ckpt.storage import set_write_hook

    model = TinyShard(seed_offset=rank).to(xla_device())
    nxd_ckpt.save_checkpoint(root, "good", model={"w": model.up}, async_save=True, use_xser=True)
    nxd_ckpt.finalize_checkpoint()

    def hook(rel):
        if rank == 2 and ".tensors/" in rel:
            raise OSError(28, "No space left on device (injected)")

    set_write_hook(hook)
    state = {f"t{i}": torch.full((16,), float(i)).to(xla_device()) for i in range(8)}  # 2 files per rank
    nxd_ckpt.save_checkpoint(root, "bad", model=state, async_save=True, use_xser=True)
    try:
        nxd_ckpt.finalize_checkpoint()
    except nxd_ckpt.RankFailureError as exc:
        set_write_hook(None)
        # raised exactly once
        nxd_ckpt.finalize_checkpoint()
        return {"causes": {int(k): v for k, v in exc.causes.items()}, "msg": str(exc)}
    return None


def test_write_error_on_one_rank_raises_on_all(ckpt_root):
    import nxd_ckpt

    root = ckpt_root
    results = run_ranks(_failing_rank, 4, root, timeout=180)
    for r, res in enumerate(results):
        assert res is not None, f"rank {r} did not raise"
        assert list(res["causes"]) == [2], res
        assert "No space left on device" in res["causes"][2]
        assert "rank 2" in res["msg"]
    assert nxd_ckpt.list_checkpoints(root) == ["good"]
    assert top_level(root) == ["good", "newest"]      # the failed save's files are gone


def test_exit_waits_for_the_save_in_flight(tmp_path):
    """A script that returns right after an async save still leaves a complete checkpoint."""
    import subprocess
    import sys

    root = tmp_path / "ckpt"
    code = (
        "import sys, torch; sys.path.insert(0, %r)\n"
        "import nxd_ckpt\n"
        "from nxd_ckpt.storage import set_write_hook\n"
        "import time\n"
        "set_write_hook(lambda rel: time.sleep(0.05))\n"
        "nxd_ckpt.save_checkpoint(%r, 'last', model={'w': torch.arange(10.0)}, async_save=True, use_xser=True)\n"
    ) % (os.path.dirname(__file__), str(root))
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
    assert (root / "last" / "done").exists()


@pytest.mark.parametrize("on_device", [False, True])
@pytest.mark.parametrize("caller_gc", [True, False])
def test_no_garbage_collection_while_the_caller_is_blocked_in_the_snapshot(tmp_path, monkeypatch, caller_gc,
                                                                           on_device):
    """The collector is held from planning to the end of the host snapshot (with device_snapshot, only while
    planning: the clones start the background copy) and given back as the caller had it, also when planning
    fails."""
    import gc

    import nxd_ckpt
    import nxd_ckpt.api as api_mod
    import nxd_ckpt.engine as engine_mod

    seen = {}
    real_plan, real_snapshot = api_mod.build_plan, engine_mod.Engine.snapshot

    def plan(*a, **kw):
        seen["plan"] = gc.isenabled()
        if seen.get("fail"):
            raise RuntimeError("planning broke (injected)")
        return real_plan(*a, **kw)

    def snapshot(self, *a, **kw):
        seen["snapshot"] = gc.isenabled()
        return real_snapshot(self, *a, **kw)

    monkeypatch.setattr(api_mod, "build_plan", plan)
    monkeypatch.setattr(engine_mod.Engine, "snapshot", snapshot)
    state = {"w": torch.arange(8.0).to(xla_device())}
    (gc.enable if caller_gc else gc.disable)()
    try:
        nxd_ckpt.save_checkpoint(str(tmp_path / "ck"), "a", model=state, use_xser=True, device_snapshot=on_device)
        assert seen == {"plan": False, "snapshot": caller_gc if on_device else False}
        assert gc.isenabled() is caller_gc
        seen["fail"] = True
        with pytest.raises(RuntimeError, match="planning broke"):
            nxd_ckpt.save_checkpoint(str(tmp_path / "ck"), "b", model=state, use_xser=True)
        assert gc.isenabled() is caller_gc
        assert nxd_ckpt.list_checkpoints(str(tmp_path / "ck")) == ["a"]
    finally:
        gc.enable()


def test_a_failed_device_clone_fails_the_save_on_every_path_and_the_next_save_works(tmp_path, monkeypatch):
    """The on-device clone fails (device memory, say) before any file is handed out: the save fails like a
    failed copy, earlier checkpoints stay, and the next save is not stuck behind a job waiting for files."""
    import nxd_ckpt
    import nxd_ckpt.engine as engine_mod

    root = str(tmp_path / "ckpt")
    state = {"w": torch.arange(8.0).to(xla_device())}
    nxd_ckpt.save_checkpoint(root, "good", model=state, use_xser=True)
    real = engine_mod.device_snapshot

    def broken(tensors):
        raise RuntimeError("device out of memory (injected)")

    monkeypatch.setattr(engine_mod, "device_snapshot", broken)
    with pytest.raises(nxd_ckpt.RankFailureError, match="device out of memory"):
        nxd_ckpt.save_checkpoint(root, "bad", model=state, use_xser=True, device_snapshot=True, timeout_s=60)
    monkeypatch.setattr(engine_mod, "device_snapshot", real)
    nxd_ckpt.save_checkpoint(root, "next", model=state, use_xser=True, device_snapshot=True, timeout_s=60)
    assert sorted(nxd_ckpt.list_checkpoints(root)) == ["good", "next"]
    assert engine_mod.get_engine().budget.used == 0
