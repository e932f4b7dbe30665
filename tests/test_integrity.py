"""Damaged checkpoints: every kind of damage is caught on load, named, changes nothing, and tag=None falls
back to the previous complete checkpoint. Checkpoints without a manifest (written by neuronx-distributed)
still load, and a missing file in one is reported as damage."""
from __future__ import annotations

import logging
import os
import shutil

import pytest
import torch

from backends import BACKENDS, overwrite, remove, root_for, storage_of
from tiny_models import TinyShard, assert_bit_equal, to_cpu_state, train_steps

SHARD = "model/dp_rank_00_tp_rank_00_pp_rank_00.pt"
OSHARD = "optim/dp_rank_00_tp_rank_00_pp_rank_00.pt"


def _objects(seed_offset=0):
    model = TinyShard(seed_offset=seed_offset)
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    return model, opt, sched


def _state(model, opt, sched):
    return {"model": to_cpu_state(model.state_dict()), "optim": to_cpu_state(opt.state_dict()),
            "sched": dict(sched.state_dict())}


def _assert_state(want, model, opt, sched):
    got = _state(model, opt, sched)
    assert_bit_equal(want["model"], got["model"], "model")
    assert_bit_equal(want["optim"], got["optim"], "optim")
    assert want["sched"] == got["sched"]


@pytest.fixture(scope="module", params=BACKENDS)
def pristine(request, tmp_path_factory):
    """Two complete checkpoints, 'a' (step 1) and 'b' (step 2), on POSIX or the object store: (backend, the
    directory holding them, the state saved in each)."""
    import nxd_ckpt

    base = tmp_path_factory.mktemp("integrity")
    root = root_for(request.param, base)
    model, opt, sched = _objects()
    states = {}
    for step, tag in ((1, "a"), (2, "b")):
        train_steps(model, opt, 1, seed=3, sched=sched, start=step - 1)
        states[tag] = _state(model, opt, sched)
        nxd_ckpt.save_checkpoint(root, tag, model=model, optimizer=opt, scheduler=sched,
                                 user_content={"step": step}, use_xser=True)
    return request.param, base, states


@pytest.fixture
def ckpt(pristine, tmp_path):
    """A fresh copy of ``pristine``: (its root path or URL, the state saved in each tag)."""
    backend, base, states = pristine
    shutil.copytree(base, tmp_path / "copy")
    return root_for(backend, tmp_path / "copy"), states


def _flip(root, rel):
    data = bytearray(storage_of(root).read(rel))
    data[len(data) // 2] ^= 0x10
    overwrite(root, rel, bytes(data))


# damage -> (file it hits, relative to tag 'b'; what the message must also say)
DAMAGE = {
    "flip_tensor": (f"{SHARD}.tensors/tensor_0.pt", "fails its checksum"),
    "flip_optim_tensor": (f"{OSHARD}.tensors/tensor_2.pt", "fails its checksum"),
    "truncate_tensor": (f"{SHARD}.tensors/tensor_1.pt", "truncated"),
    "extend_tensor": (f"{SHARD}.tensors/tensor_1.pt", "overwritten"),
    "delete_tensor": (f"{OSHARD}.tensors/tensor_1.pt", "missing"),
    "delete_ref": (SHARD, "missing"),
    "flip_ref": (OSHARD, "fails its checksum"),
    "truncate_user_content": ("user_content.pt", "truncated"),
    "delete_manifest": ("manifest.json", "missing"),
    "garble_manifest": ("manifest.json", "does not match the size and crc32c recorded in `done`"),
    "alter_manifest": ("manifest.json", "does not match the size and crc32c recorded in `done`"),
}


def _damage(root, tag, kind):
    """Damage ``tag``'s file for ``kind`` behind the storage's back; return the file, relative to the tag."""
    rel, _ = DAMAGE[kind]
    key = f"{tag}/{rel}"
    assert storage_of(root).isfile(key), f"fixture lacks {rel}"
    if kind.startswith(("flip", "alter")):
        _flip(root, key)
    elif kind.startswith("truncate"):
        overwrite(root, key, storage_of(root).read(key)[:-5])
    elif kind.startswith("extend"):
        overwrite(root, key, storage_of(root).read(key) + b"\0" * 5)
    elif kind.startswith("garble"):
        overwrite(root, key, b'{"format": "nxd-ckpt-manifest", "files": {')
    else:
        remove(root, key)
    return rel


@pytest.mark.parametrize("kind", list(DAMAGE))
def test_damage_is_caught_named_and_harmless(ckpt, kind, caplog, capsys):
    import nxd_ckpt
    from nxd_ckpt.cli import main

    root, states = ckpt
    rel = _damage(root, "b", kind)
    full = f"b/{rel}"

    model, opt, sched = _objects(seed_offset=5)
    train_steps(model, opt, 1, seed=9, sched=sched)       # give the optimizer state to protect
    before = _state(model, opt, sched)

    # the explicit tag: raises, names the file, and changes nothing
    with pytest.raises(nxd_ckpt.CorruptCheckpointError) as info:
        nxd_ckpt.load_checkpoint(root, tag="b", model=model, optimizer=opt, scheduler=sched)
    exc = info.value
    msg = str(exc)
    assert full in msg and exc.path == full, msg
    assert DAMAGE[kind][1] in msg, msg
    assert "tag=None" in msg or "verify" in msg, f"the message does not say what to do next: {msg}"
    if kind.startswith("flip"):   # expected and found checksums
        assert exc.expected and exc.found and exc.expected != exc.found
        assert exc.expected in msg and exc.found in msg, msg
    _assert_state(before, model, opt, sched)

    # tag=None: skips 'b' with a warning naming the damage, loads 'a' bit for bit
    with caplog.at_level(logging.WARNING, logger="nxd_ckpt"):
        user = nxd_ckpt.load_checkpoint(root, model=model, optimizer=opt, scheduler=sched)
    assert user == {"step": 1}
    _assert_state(states["a"], model, opt, sched)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("b" in w and full in w for w in warnings), warnings

    # the offline check agrees
    code = main(["verify", f"{root}/b"])
    out = capsys.readouterr().out
    assert code == 1, out
    assert f"{root}/b/{rel}" in out, out


def test_the_older_tag_without_its_manifest_is_damaged_too(ckpt, capsys):
    """`done` records the manifest's size and checksum: losing it is damage whichever tag it hits."""
    import nxd_ckpt
    from nxd_ckpt.cli import main

    root, _ = ckpt
    remove(root, "a/manifest.json")
    _flip(root, f"a/{SHARD}.tensors/tensor_0.pt")
    model, opt, sched = _objects(seed_offset=5)
    before = _state(model, opt, sched)
    with pytest.raises(nxd_ckpt.CorruptCheckpointError, match="manifest.json is missing although `done` records one"):
        nxd_ckpt.load_checkpoint(root, tag="a", model=model, optimizer=opt, scheduler=sched)
    _assert_state(before, model, opt, sched)
    assert main(["verify", f"{root}/a"]) == 1
    assert "missing although `done` records one" in capsys.readouterr().out


def test_intact_checkpoint_loads_bit_exact(ckpt):
    import nxd_ckpt

    root, states = ckpt
    model, opt, sched = _objects(seed_offset=5)
    assert nxd_ckpt.load_checkpoint(root, tag="a", model=model, optimizer=opt, scheduler=sched) == {"step": 1}
    _assert_state(states["a"], model, opt, sched)
    assert nxd_ckpt.load_checkpoint(root, model=model, optimizer=opt, scheduler=sched) == {"step": 2}
    _assert_state(states["b"], model, opt, sched)


def test_every_checkpoint_damaged(ckpt):
    import nxd_ckpt

    root, _ = ckpt
    _damage(root, "a", "flip_tensor")
    _damage(root, "b", "delete_ref")
    model, opt, sched = _objects(seed_offset=5)
    before = _state(model, opt, sched)
    with pytest.raises(nxd_ckpt.CorruptCheckpointError, match="every complete checkpoint"):
        nxd_ckpt.load_checkpoint(root, model=model, optimizer=opt, scheduler=sched)
    _assert_state(before, model, opt, sched)


# ---- checkpoints written by neuronx-distributed (no manifest) -----------------------------------------
def _nxd_tag(root, tag, model, opt, sched, user, use_xser=True):
    """A tag as NxD writes it: with xser, torch-xla's serialization.save (XLA tensors to tensor files, CPU
    ones such as Adam's step inline), else one torch.save per shard; the `checkpoint` and `done` markers,
    no manifest."""
    import torch_xla.utils.serialization as xser_tx

    path = os.path.join(root, tag)
    os.makedirs(os.path.join(path, "model"))
    os.makedirs(os.path.join(path, "optim"))
    open(os.path.join(path, "checkpoint"), "w").write("1")
    for sd, rel in ((model.state_dict(), SHARD), (opt.state_dict(), OSHARD)):
        if use_xser:
            xser_tx.save(sd, os.path.join(path, rel))
        else:
            torch.save(to_cpu_state(sd), os.path.join(path, rel))
    torch.save(sched.state_dict(), os.path.join(path, "scheduler.pt"))
    torch.save(user, os.path.join(path, "user_content.pt"))
    open(os.path.join(path, "done"), "w").write("1")
    return path


def _nxd_steps(root, use_xser=True):
    """Tags nxd_1 and nxd_2 as NxD writes them (nxd_2 the newer), and the state saved in each."""
    model, opt, sched = _objects()
    states = {}
    for step in (1, 2):
        train_steps(model, opt, 1, seed=4, sched=sched, start=step - 1)
        states[step] = _state(model, opt, sched)
        _nxd_tag(root, f"nxd_{step}", model, opt, sched, {"step": step}, use_xser)
        os.utime(os.path.join(root, f"nxd_{step}", "done"), (1000.0 * step, 1000.0 * step))
    return root, states


@pytest.fixture
def nxd_dir(tmp_path):
    return _nxd_steps(str(tmp_path / "nxd"))


def test_nxd_checkpoint_loads(nxd_dir):
    import nxd_ckpt

    root, states = nxd_dir
    assert not os.path.exists(os.path.join(root, "nxd_2", "manifest.json"))
    assert os.path.isdir(os.path.join(root, "nxd_2", SHARD + ".tensors"))
    model, opt, sched = _objects(seed_offset=5)
    assert nxd_ckpt.list_checkpoints(root) == ["nxd_2", "nxd_1"]
    assert nxd_ckpt.load_checkpoint(root, model=model, optimizer=opt, scheduler=sched) == {"step": 2}
    _assert_state(states[2], model, opt, sched)

    # nxd-ckpt starts saving into the same directory: the older NxD tags still load without a manifest
    nxd_ckpt.save_checkpoint(root, "ours_3", model=model, optimizer=opt, scheduler=sched, user_content={"step": 3}, use_xser=True)
    assert nxd_ckpt.load_checkpoint(root, tag="nxd_1", model=model, optimizer=opt, scheduler=sched) == {"step": 1}
    _assert_state(states[1], model, opt, sched)


@pytest.mark.parametrize("what", ["tensor", "ref"])
def test_nxd_checkpoint_missing_file(nxd_dir, what, caplog):
    import nxd_ckpt

    root, states = nxd_dir
    rel = f"{SHARD}.tensors/tensor_1.pt" if what == "tensor" else SHARD
    os.unlink(os.path.join(root, "nxd_2", rel))
    model, opt, sched = _objects(seed_offset=5)
    before = _state(model, opt, sched)
    with pytest.raises(nxd_ckpt.CorruptCheckpointError) as info:
        nxd_ckpt.load_checkpoint(root, tag="nxd_2", model=model, optimizer=opt, scheduler=sched)
    assert f"nxd_2/{rel}" in str(info.value) and "missing" in str(info.value)
    _assert_state(before, model, opt, sched)
    with caplog.at_level(logging.WARNING, logger="nxd_ckpt"):
        assert nxd_ckpt.load_checkpoint(root, model=model, optimizer=opt, scheduler=sched) == {"step": 1}
    _assert_state(states[1], model, opt, sched)
    assert any(f"nxd_2/{rel}" in r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)


def test_nxd_plain_checkpoint_missing_shard(tmp_path, caplog):
    """NxD's default (use_xser=False): one torch.save file per shard. A deleted one is damage, not a
    mismatch: the explicit tag raises CorruptCheckpointError and tag=None falls back."""
    import nxd_ckpt

    root, states = _nxd_steps(str(tmp_path / "nxd"), use_xser=False)
    os.unlink(os.path.join(root, "nxd_2", SHARD))
    model, opt, sched = _objects(seed_offset=5)
    before = _state(model, opt, sched)
    with pytest.raises(nxd_ckpt.CorruptCheckpointError, match=f"nxd_2/{SHARD} is missing"):
        nxd_ckpt.load_checkpoint(root, tag="nxd_2", model=model, optimizer=opt, scheduler=sched)
    _assert_state(before, model, opt, sched)
    with caplog.at_level(logging.WARNING, logger="nxd_ckpt"):
        assert nxd_ckpt.load_checkpoint(root, model=model, optimizer=opt, scheduler=sched) == {"step": 1}
    _assert_state(states[1], model, opt, sched)


# ---- damage seen by one rank: every rank raises the same error, and falls back together ----------------
def _save_two_dp2(rank, world, root):
    import nxd_ckpt
    import parallel_state as ps

    ps.initialize_model_parallel(tensor_model_parallel_size=1)      # DP=2: one shard, two replicas
    model, opt, sched = _objects()
    states = {}
    for step, tag in ((1, "a"), (2, "b")):
        train_steps(model, opt, 1, seed=3, sched=sched, start=step - 1)
        states[tag] = _state(model, opt, sched)
        nxd_ckpt.save_checkpoint(root, tag, model=model, optimizer=opt, scheduler=sched, use_xser=True)
    return states


def _load_damaged_dp2(rank, world, root):
    import nxd_ckpt
    import parallel_state as ps

    ps.initialize_model_parallel(tensor_model_parallel_size=1)
    model, opt, sched = _objects(seed_offset=5)
    before = _state(model, opt, sched)
    try:
        nxd_ckpt.load_checkpoint(root, tag="b", model=model, optimizer=opt, scheduler=sched)
        raised = None
    except nxd_ckpt.CorruptCheckpointError as exc:
        raised = (exc.path, exc.expected, exc.found)
    _assert_state(before, model, opt, sched)
    nxd_ckpt.load_checkpoint(root, model=model, optimizer=opt, scheduler=sched)
    return raised, _state(model, opt, sched)


@pytest.mark.parametrize("backend", BACKENDS)
def test_damage_read_by_one_replica_raises_on_both(tmp_path, backend):
    from harness import run_ranks

    root = root_for(backend, tmp_path)
    states = run_ranks(_save_two_dp2, 2, root, timeout=120)[0]
    _flip(root, f"b/{SHARD}.tensors/tensor_0.pt")   # read by one replica only
    results = run_ranks(_load_damaged_dp2, 2, root, timeout=120)
    raised = [r[0] for r in results]
    assert raised[0] == raised[1] and raised[0][0] == f"b/{SHARD}.tensors/tensor_0.pt"
    assert raised[0][1] and raised[0][2] and raised[0][1] != raised[0][2]     # expected and found crc32c
    for _, state in results:                                                  # tag=None: 'a', bit for bit
        assert_bit_equal(states["a"]["model"], state["model"], "model")
        assert_bit_equal(states["a"]["optim"], state["optim"], "optim")


@pytest.mark.parametrize("backend", BACKENDS)
def test_rank0s_manifest_error_raises_on_every_rank(tmp_path, backend):
    """Only rank 0 reads the manifest (loader.agreed_manifest) and shares it: when it is lost, rank 1, which
    never reads it, raises the same damage (named file), nothing changes on either rank, and tag=None moves on to
    the older tag on both, bit for bit."""
    from harness import run_ranks

    root = root_for(backend, tmp_path)
    states = run_ranks(_save_two_dp2, 2, root, timeout=120)[0]
    remove(root, "b/manifest.json")
    results = run_ranks(_load_damaged_dp2, 2, root, timeout=120)
    raised = [r[0] for r in results]
    assert raised[0] is not None and raised[0] == raised[1], raised
    assert raised[0][0] == "b/manifest.json", raised
    for _, state in results:
        assert_bit_equal(states["a"]["model"], state["model"], "model")
        assert_bit_equal(states["a"]["optim"], state["optim"], "optim")


def test_nxd_dcp_optimizer_with_unreadable_metadata_is_damage(tmp_path):
    """NxD's use_zero1_dcp=True writes optim/ as a torch.distributed.checkpoint (test_zero1_dcp.py loads real
    ones): an unreadable .metadata is named as the damage; the model alone still loads."""
    import nxd_ckpt

    root, _ = _nxd_steps(str(tmp_path / "nxd"))
    model, opt, _ = _objects()
    optim = os.path.join(root, "nxd_2", "optim")
    shutil.rmtree(optim)
    os.makedirs(optim)
    for name in (".metadata", "__0_0.distcp"):
        open(os.path.join(optim, name), "wb").write(b"x")
    with pytest.raises(nxd_ckpt.CorruptCheckpointError,
                       match="optim/.metadata is not a readable torch.distributed.checkpoint metadata file"):
        nxd_ckpt.load_checkpoint(root, tag="nxd_2", model=model, optimizer=opt)
    assert nxd_ckpt.load_checkpoint(root, tag=None, model=model) == {"step": 2}     # the model alone loads


def _load_with_a_late_view_on_rank1(rank, world, root):
    import nxd_ckpt
    import parallel_state as ps
    from nxd_ckpt import loader

    ps.initialize_model_parallel(tensor_model_parallel_size=1)
    if rank == 1:   # as if rank 1 had listed the directory before 'b' was committed
        loader.candidate_tags = lambda storage, tag: ["a"]
    model, opt, sched = _objects(seed_offset=5)
    nxd_ckpt.load_checkpoint(root, model=model, optimizer=opt, scheduler=sched)
    return _state(model, opt, sched)


def test_every_rank_loads_the_tags_rank_0_chose(tmp_path):
    from harness import run_ranks

    root = str(tmp_path / "ckpt")
    states = run_ranks(_save_two_dp2, 2, root, timeout=120)[0]
    for state in run_ranks(_load_with_a_late_view_on_rank1, 2, root, timeout=120):
        assert_bit_equal(states["b"]["model"], state["model"], "model")
        assert_bit_equal(states["b"]["optim"], state["optim"], "optim")


def _load_with_node_local_on_rank1_only(rank, world, root):
    import nxd_ckpt
    import parallel_state as ps

    ps.initialize_model_parallel(tensor_model_parallel_size=1)
    model, opt, sched = _objects(seed_offset=5)
    before = _state(model, opt, sched)
    with pytest.raises(nxd_ckpt.CheckpointArgumentError, match=r"node_local differs between ranks \(\[False, True\]"):
        nxd_ckpt.load_checkpoint(root, model=model, optimizer=opt, node_local=rank == 1)
    _assert_state(before, model, opt, sched)
    return True


def test_node_local_must_agree(tmp_path):
    from harness import run_ranks

    root = str(tmp_path / "ckpt")
    run_ranks(_save_two_dp2, 2, root, timeout=120)
    assert run_ranks(_load_with_node_local_on_rank1_only, 2, root, timeout=120) == [True, True]
