"""Fault injection: ranks SIGKILLed at every phase of an async save, a hung (SIGSTOPped) rank, a full disk.

After every crash a brand-new job (new processes, new process group) must resume bit for bit from the
newest checkpoint that had completed, and its next save must clean up the debris. Survivors of a crash
must raise RankFailureError naming the dead rank, not hang. Nothing here asserts a duration.
"""
from __future__ import annotations

import errno
import json
import os
import subprocess

import pytest

import crash_worker as cw
from backends import tags_on_disk
from harness import run_ranks
from s3_fixtures import moto_endpoint, s3_url  # noqa: F401 - fixtures
from tiny_models import all_files

WORLD = 2
TIMEOUT_S = 4.0     # the failing save's timeout_s: how long survivors wait for a dead rank


def _tag_files_exact(storage, tag: str) -> None:
    """A complete tag holds exactly what its manifest lists plus the three markers (no temp files)."""
    manifest = json.loads(storage.read(f"{tag}/manifest.json"))
    want = set(manifest["files"]) | {"manifest.json", "done", "checkpoint"}
    have = {k[len(tag) + 1:] for k in storage.list(tag)}
    assert have == want, sorted(have ^ want)


def _root(tmp_path, backend: str, request) -> str:
    """The checkpoint directory: a POSIX path (rename commit), a shared object bucket or S3 on a local
    server (marker commit)."""
    if backend == "s3":
        return request.getfixturevalue("s3_url")
    return str(tmp_path / "ckpt") if backend == "posix" else f"objdir://{tmp_path}/bucket//ckpt"


# (phase, victims when one rank dies, num_kept_ckpts, complete tags after the crash, newest first)
PHASES = {
    "snapshot": ([1], 2, [cw.FIRST]),
    "write": ([1], 2, [cw.FIRST]),
    "commit": ([0], 2, [cw.FIRST]),
    "newest": ([0], 2, [cw.SECOND, cw.FIRST]),
    "retention": ([0], 1, [cw.SECOND]),
}


# Every kill point on both commit strategies: POSIX (rename) and the shared-directory object store (marker),
# one victim and every rank; S3 (moto's server on 127.0.0.1) one and all ranks killed mid-upload.
CASES = ([(backend, phase, "one") for backend in ("posix", "objects") for phase in PHASES]
         + [pytest.param(backend, phase, "all", marks=pytest.mark.slow)
            for backend in ("posix", "objects") for phase in PHASES]
         + [("s3", "write", "one"), ("s3", "write", "all")])


@pytest.mark.parametrize("backend,phase,who", CASES)
def test_sigkill_during_async_save(tmp_path, backend, phase, who, request):
    import nxd_ckpt
    from nxd_ckpt.storage import open_storage

    one_victims, num_kept, complete_after = PHASES[phase]
    victims = one_victims if who == "one" else list(range(WORLD))
    root, side = _root(tmp_path, backend, request), str(tmp_path / "side")
    storage = open_storage(root)

    # --- job 1: FIRST completes, SECOND is interrupted by SIGKILL --------------------------------------
    outcomes = cw.run_ranks_tolerant(cw.crash_run, WORLD, root, side, phase, victims, TIMEOUT_S, num_kept,
                                     timeout=120)
    for r, o in enumerate(outcomes):
        if r in victims:
            assert o.status == "died" and "SIGKILL" in o.value, cw.describe(outcomes)
        else:
            # a survivor raised, naming the dead rank, instead of hanging
            assert o.status == "ok", cw.describe(outcomes)
            assert o.value["raised"] == "RankFailureError", cw.describe(outcomes)
            assert set(victims) <= set(o.value["causes"]), cw.describe(outcomes)
            assert all(f"rank {v}" in o.value["message"] for v in victims), o.value["message"]

    # on disk: the last complete checkpoint is intact; nothing half-written looks complete
    assert nxd_ckpt.list_checkpoints(root) == complete_after
    assert not storage.exists(f"{cw.SECOND}/done") or cw.SECOND in complete_after
    if phase == "newest":   # committed, but the pointer still names FIRST: loading must not trust it
        assert storage.read("newest").decode() == cw.FIRST
    if phase == "retention":  # FIRST's deleter died half-way: what is left must never look like a checkpoint
        doomed = cw.FIRST + ".nxdold" if backend == "posix" else cw.FIRST
        assert storage.isdir(doomed) and (backend != "posix" or not storage.exists(cw.FIRST))
        assert not storage.exists(f"{doomed}/done") and not storage.exists(f"{doomed}/manifest.json")
        with pytest.raises((nxd_ckpt.CheckpointNotFoundError, nxd_ckpt.IncompleteCheckpointError),
                           match=f"no checkpoint '{cw.FIRST}'|'{cw.FIRST}' .*no 'done' marker"):
            nxd_ckpt.load_checkpoint(root, tag=cw.FIRST, model={})

    # --- job 2: new processes resume bit for bit from the newest complete tag, then save --------------
    expect_step = int(complete_after[0].split("_")[1])
    run_ranks(cw.restart_run, WORLD, root, side, expect_step, num_kept, timeout=120)
    kept = [cw.RESUMED] + complete_after[: num_kept - 1]
    assert nxd_ckpt.list_checkpoints(root) == kept
    assert tags_on_disk(root) == sorted(kept + ["newest"]), "debris left behind"
    assert storage.read("newest").decode() == cw.RESUMED
    for tag in kept:
        _tag_files_exact(storage, tag)


def test_hung_rank_is_named_and_nobody_hangs(tmp_path):
    """Rank 1 of 3 SIGSTOPs itself in the middle of a save: ranks 0 and 2 raise RankFailureError naming
    rank 1 (and only rank 1, although rank 0 finished writing last) after timeout_s. The stopped rank is
    SIGKILLed once they have returned."""
    import nxd_ckpt

    root = str(tmp_path / "ckpt")
    outcomes = cw.run_ranks_tolerant(cw.hung_run, 3, root, 1, TIMEOUT_S, 1.0, timeout=120, stragglers=[1])
    assert outcomes[1].status == "stopped", cw.describe(outcomes)
    for r in (0, 2):
        o = outcomes[r]
        assert o.status == "ok" and o.value["raised"] == "RankFailureError", cw.describe(outcomes)
        assert list(o.value["causes"]) == [1], cw.describe(outcomes)   # rank 1 alone, rank 0 is not blamed
        assert "rank 1" in o.value["message"] and "hung or dead" in o.value["message"]
    assert nxd_ckpt.list_checkpoints(root) == ["good"]
    assert not os.path.exists(os.path.join(root, "hung"))


# ---- disk full ---------------------------------------------------------------------------------------
@pytest.fixture
def small_disk(tmp_path):
    """A 200 KiB tmpfs when this process may mount one (root), else a plain directory where the ranks
    inject ENOSPC with a write hook. Yields (directory, inject)."""
    mnt = tmp_path / "small_disk"
    mnt.mkdir()
    mounted = False
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=200k", "tmpfs", str(mnt)], capture_output=True)
        mounted = r.returncode == 0
    try:
        yield str(mnt / "ckpt"), not mounted
    finally:
        if mounted:
            subprocess.run(["umount", "-l", str(mnt)], check=False)


def _disk_full_rank(rank, world, root, inject):
    import torch

    import nxd_ckpt
    import parallel_state as ps
    from nxd_ckpt.storage import set_write_hook
    from tiny_models import TinyShard, assert_bit_equal, to_cpu_state, xla_device

    if inject:
        def hook(rel):
            if rel.startswith("big"):
                raise OSError(errno.ENOSPC, "No space left on device (injected)")

        set_write_hook(hook)
    ps.initialize_model_parallel(tensor_model_parallel_size=world)
    model = TinyShard(rank)
    expect = to_cpu_state(model.state_dict())
    nxd_ckpt.save_checkpoint(root, "small", model=model, num_kept_ckpts=1, use_xser=True)
    big = {f"b{i}": torch.randn(16 << 10).to(xla_device()) for i in range(3)}   # 3 x 64 KiB per rank
    raised = {}
    try:
        nxd_ckpt.save_checkpoint(root, "big_sync", model=big, num_kept_ckpts=1, timeout_s=30, use_xser=True)
    except nxd_ckpt.RankFailureError as exc:
        raised["sync"] = exc.causes
    # rank 0 removed the failed save's files before reporting the failure: the disk is not left full
    listing_after_sync = sorted(os.listdir(root)) if rank == 0 else None
    nxd_ckpt.save_checkpoint(root, "big_async", model=big, num_kept_ckpts=1, async_save=True, timeout_s=30, use_xser=True)
    try:
        nxd_ckpt.finalize_checkpoint()
    except nxd_ckpt.RankFailureError as exc:
        raised["async"] = exc.causes
    complete = nxd_ckpt.list_checkpoints(root)
    fresh = TinyShard(rank, seed_offset=9)
    nxd_ckpt.load_checkpoint(root, model=fresh)
    assert_bit_equal(expect, to_cpu_state(fresh.state_dict()))
    # a save that fits still succeeds on the same disk, and retention replaces the old one
    nxd_ckpt.save_checkpoint(root, "small2", model=fresh, num_kept_ckpts=1, use_xser=True)
    return {"raised": {k: {int(r): c for r, c in v.items()} for k, v in raised.items()},
            "listing_after_sync": listing_after_sync, "complete": complete}


def test_disk_full(small_disk):
    import nxd_ckpt

    root, inject = small_disk
    results = run_ranks(_disk_full_rank, WORLD, root, inject, timeout=120)
    for r, res in enumerate(results):
        assert set(res["raised"]) == {"sync", "async"}, (r, res)        # raised on every rank, both modes
        for mode, causes in res["raised"].items():
            assert causes and all("No space left on device" in c for c in causes.values()), (r, mode, causes)
        assert res["complete"] == ["small"], res
    assert results[0]["listing_after_sync"] == ["newest", "small"], results[0]
    assert nxd_ckpt.list_checkpoints(root) == ["small2"]
    assert tags_on_disk(root) == ["newest", "small2"]
    from nxd_ckpt.storage import open_storage

    _tag_files_exact(open_storage(root), "small2")


def test_failed_prepare_leaks_neither_memory_nor_files(tmp_path):
    """Rank 0 cannot even create the staging directory (disk full): the save raises, leaves no staging
    directory, and gives back its host staging memory, so the next save with the same small budget runs."""
    import nxd_ckpt
    from nxd_ckpt.engine import get_engine
    from nxd_ckpt.storage import set_write_hook
    from tiny_models import TinyShard

    root = str(tmp_path / "ckpt")
    model = TinyShard(hidden=32)          # 4 KiB matrices: a 4 KiB budget stages one at a time
    nxd_ckpt.save_checkpoint(root, "good", model=model, use_xser=True)
    budget = get_engine().budget
    capacity = budget.capacity

    def hook(rel):
        if rel.startswith("bad"):
            raise OSError(errno.ENOSPC, "No space left on device (injected)")

    set_write_hook(hook)
    try:
        with pytest.raises(nxd_ckpt.RankFailureError, match="No space left on device") as info:
            nxd_ckpt.save_checkpoint(root, "bad", model=model, host_memory_budget=4096, timeout_s=10, use_xser=True)
        assert "save again" in str(info.value)
        set_write_hook(None)
        assert tags_on_disk(root) == ["good", "newest"]
        nxd_ckpt.save_checkpoint(root, "next", model=model, host_memory_budget=4096, timeout_s=10, use_xser=True)
        assert budget.used == 0
    finally:
        set_write_hook(None)
        budget.capacity = capacity
    assert nxd_ckpt.list_checkpoints(root) == ["next", "good"]


def _caught_failure_rank(rank, world, root):
    import time

    import torch

    import nxd_ckpt
    from nxd_ckpt.storage import set_write_hook

    def hook(rel):
        if rel.startswith("bad.") and ".tensors/" in rel:
            if rank == 1:
                raise OSError(errno.ENOSPC, "No space left on device (injected)")
            time.sleep(0.5)      # rank 0 is still busy with 'bad' when it starts the next save

    set_write_hook(hook)
    state = {f"t{i}": torch.full((4,), float(i)) for i in range(4)}   # replicated: both ranks write files
    nxd_ckpt.save_checkpoint(root, "bad", model=state, async_save=True, timeout_s=20, use_xser=True)
    if rank == 1:
        time.sleep(2.0)          # ... while rank 1's 'bad' has already failed when it starts the next save
    raised = []
    for tag in ("s0", "s1"):
        try:
            nxd_ckpt.save_checkpoint(root, tag, model=state, async_save=True, timeout_s=20, use_xser=True)
        except nxd_ckpt.RankFailureError as exc:
            raised.append((tag, str(exc)))
    nxd_ckpt.finalize_checkpoint()
    return raised


def test_a_caught_async_failure_leaves_the_ranks_in_step(tmp_path):
    """A training loop that catches a failed async save and carries on: the failure is raised once on
    every rank, by the same call (which saves nothing and says so), and every later checkpoint is complete
    and intact: the ranks never combine files of different saves."""
    import nxd_ckpt

    root = str(tmp_path / "ckpt")
    results = run_ranks(_caught_failure_rank, WORLD, root, timeout=120)
    for r, raised in enumerate(results):
        assert [t for t, _ in raised] == ["s0"], (r, raised)
        assert "'bad'" in raised[0][1] and "No space left on device" in raised[0][1]
        assert "call it again" in raised[0][1]
    assert nxd_ckpt.list_checkpoints(root) == ["s1"]
    assert tags_on_disk(root) == ["newest", "s1"]
    from nxd_ckpt.storage import open_storage

    for tag in ("s1",):
        _tag_files_exact(open_storage(root), tag)
        target = {}
        nxd_ckpt.load_checkpoint(root, tag=tag, model=target)   # every file against its checksum
        assert sorted(target) == ["t0", "t1", "t2", "t3"]
