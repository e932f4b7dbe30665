"""Expert-parallel checkpoints in nxd-ckpt's own layout from before it took NxD's (0.1.0 up to commit 5310e3a)
still load, convert, verify and list: read only (nxd_ckpt.manifest.legacy_ep_folders).

That layout differs from NxD's in two ways: every shard keeps all its tensors in its own ``.tensors/`` folder
(NxD keeps the non-expert tensors of EP rank > 0 under ``ep_rank_00`` only), and ZeRO-1 optimizer files are
named ``dp_rank_{expert-DP rank}_ep_rank_{EP rank}`` (NxD: by the full DP rank, no ep field).

``build_legacy_ep_tag`` writes what that code wrote for 4 ranks as EP=2 x expert-DP=2, without needing it:
checked against a save of these states by the code at commit 6bca838 when this was written, the same file set,
the same bytes in every ref, ``.info.pt`` and plain file, tensor files that differ only in torch's random
serialization id, and the same manifest (and `done` seal) but for its time and which replica it says wrote a
tensor file (informational).
"""
from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

import xser
from harness import run_ranks
from nxd_ckpt import layout
from nxd_ckpt import manifest as manifest_mod
from nxd_ckpt.storage import LocalStorage
from tiny_models import all_files, assert_bit_equal

HIDDEN = 8
EP, DP = 2, 4
TOPOLOGY = {"world_size": 4, "tp": 1, "pp": 1, "dp": DP, "cp": 1, "ep": EP}


# ---- the states each rank saved (rank r: DP rank r, EP rank r % 2, expert-DP rank r // 2) --------------------
def legacy_model(ep):
    """The old recipe: the expert `up` and, unlike a real run, non-expert weights that differ by EP rank too
    (so reading the wrong EP rank's copy shows)."""
    g = torch.Generator().manual_seed(600 + ep)
    return {"up": torch.randn(HIDDEN, HIDDEN, generator=g), "down": torch.randn(HIDDEN, HIDDEN, generator=g),
            "bias": torch.randn(HIDDEN, generator=g), "steps_seen": torch.tensor(7)}


def legacy_zero1(dp):
    """NxD's EP ZeRO-1 state of DP rank ``dp``: down, bias over DP=4; up (expert) over expert-DP=2."""
    g = torch.Generator().manual_seed(700 + dp)
    adam = lambda *s: {"step": torch.tensor(3.0), "exp_avg": torch.randn(*s, generator=g),  # noqa: E731
                       "exp_avg_sq": torch.rand(*s, generator=g)}
    group = {"lr": 0.01, "betas": (0.9, 0.999), "eps": 1e-8}
    return {"ep_param_id_offset": 1, "ep_param_group_offset": 1, "ep_base_state_offset": 2, "ep_shape_info_offset": 2,
            "param_groups": [dict(group, params=[0, 1]), dict(group, params=[0])], "state": {},
            "base_state": {0: adam(2, HIDDEN), 1: adam(2), 2: adam(4, HIDDEN)},
            "shape_info": {0: torch.Size([HIDDEN, HIDDEN]), 1: torch.Size([HIDDEN]), 2: torch.Size([HIDDEN, HIDDEN])}}


def legacy_adam(ep):
    g = torch.Generator().manual_seed(800 + ep)
    m = lambda *s: {"step": torch.tensor(3.0), "exp_avg": torch.randn(*s, generator=g),  # noqa: E731
                    "exp_avg_sq": torch.rand(*s, generator=g)}
    return {"state": {0: m(HIDDEN, HIDDEN), 1: m(HIDDEN, HIDDEN), 2: m(HIDDEN)},
            "param_groups": [{"lr": 0.01, "betas": (0.9, 0.999), "eps": 1e-8, "params": [0, 1, 2]}]}


# ---- the layout that code wrote ----------------------------------------------------------------------------
def _write(store, tag, rel, state, use_xser, expert_keys, rank, files, tensors):
    """One shard as the old writer wrote it: with xser, ref + .info.pt + every tensor in its own folder."""
    def put(r, produce):
        files[r] = dict(store.write_file(f"{tag}/{r}", produce).to_json(), rank=rank)

    ref, flat = xser.to_refs(state)
    keys = {}

    def walk(obj, path):
        if xser.is_ref(obj):
            keys.setdefault(obj.tid, "/".join(map(str, path)))
        elif isinstance(obj, dict):
            for k, v in obj.items():
                walk(v, path + (k,))
        elif isinstance(obj, (list, tuple)):
            for i, v in enumerate(obj):
                walk(v, path + (i,))

    walk(ref, ())
    meta = {}
    for tid, t in enumerate(flat):
        expert = keys[tid] in expert_keys
        meta[str(tid)] = {"dtype": str(t.dtype).replace("torch.", ""), "shape": list(t.shape), "key": keys[tid]}
        if expert:
            meta[str(tid)]["expert_model_parallel"] = True
    tensors[rel] = meta
    if not use_xser:
        put(rel, lambda f: torch.save(state, f))
        return
    for tid, t in enumerate(flat):
        put(layout.tensor_path(rel, tid), lambda f, t=t: xser.write_tensor(t, f))
    info = {tid: {"dtype": t.dtype, "shape": t.shape, "expert_model_parallel": keys[tid] in expert_keys}
            for tid, t in enumerate(flat)}
    put(layout.info_path(rel), lambda f: torch.save(info, f))
    put(rel, lambda f: xser.dump_refs(ref, f))


def build_legacy_ep_tag(root: str, tag: str, zero1: bool, use_xser: bool = True) -> str:
    store = LocalStorage(root)
    store.makedirs(tag)
    store.write_file(f"{tag}/{layout.CHECKPOINT_MARKER}", lambda f: f.write(b"1"))
    files, tensors = {}, {}
    for rank in range(DP):
        dp, ep, edp = rank, rank % EP, rank // EP
        if edp == 0:   # the first replica of each model shard writes it
            _write(store, tag, f"model/{layout.shard_filename(0, 0, 0, ep)}", legacy_model(ep), use_xser, {"up"},
                   rank, files, tensors)
        if zero1:
            _write(store, tag, f"optim/{layout.shard_filename(edp, 0, 0, ep)}", legacy_zero1(dp), use_xser, set(),
                   rank, files, tensors)
        elif edp == 0:
            _write(store, tag, f"optim/{layout.shard_filename(0, 0, 0, ep)}", legacy_adam(ep), use_xser, set(),
                   rank, files, tensors)
    body = json.dumps({   # the manifest as that code wrote it, and `done` recording its size and CRC32C
        "format": "nxd-ckpt-manifest", "format_version": 1, "library_version": "0.1.0", "tag": tag,
        "created_at": 1795363543.0, "topology": dict(TOPOLOGY), "zero1": zero1, "xser": use_xser, "has_model": True,
        "has_optim": True, "files": dict(sorted(files.items())), "tensors": tensors}, indent=1).encode()
    store.write_file(f"{tag}/{layout.MANIFEST_FILE}", lambda f: f.write(body))
    store.write_file(f"{tag}/{layout.DONE_MARKER}", lambda f: f.write(manifest_mod.seal(body)))
    store.write_file(layout.NEWEST_FILE, lambda f: f.write(tag.encode()))
    return os.path.join(root, tag)


TAGS = {"zero1": (True, True), "adam": (False, True), "zero1_plain": (True, False)}   # tag: (zero1, xser)


def _manifest(tagdir, **changes):
    with open(os.path.join(tagdir, layout.MANIFEST_FILE)) as f:
        return manifest_mod.Manifest.from_json(dict(json.load(f), **changes))


def test_legacy_file_set_and_detection(tmp_path):
    """The old names, every tensor in its own folder; manifest.legacy_ep_folders tells which folders."""
    root = str(tmp_path)
    tagdir = build_legacy_ep_tag(root, "zero1", True)
    optim = sorted(n for n in os.listdir(os.path.join(tagdir, "optim")) if n.endswith("_00.pt"))
    assert optim == [layout.shard_filename(edp, 0, 0, ep) for edp in range(2) for ep in range(2)]
    ep1 = f"model/{layout.shard_filename(0, 0, 0, 1)}.tensors"
    assert sorted(os.listdir(os.path.join(tagdir, ep1))) == [f"tensor_{t}.pt" for t in range(4)]
    assert manifest_mod.legacy_ep_folders(_manifest(tagdir)) == {"model", "optim"}
    adam = build_legacy_ep_tag(root, "adam", False)
    assert manifest_mod.legacy_ep_folders(_manifest(adam)) == {"model", "optim"}
    plain = build_legacy_ep_tag(root, "plain", True, use_xser=False)
    assert manifest_mod.legacy_ep_folders(_manifest(plain)) == {"optim"}   # one pickle per file: only the names differ
    # NxD's layout (non-expert tensors of ep_rank_01 only under ep_rank_00; ZeRO-1 named by DP rank) is not legacy
    with open(os.path.join(tagdir, layout.MANIFEST_FILE)) as f:
        files = json.load(f)["files"]
    files = {k: v for k, v in files.items()
             if not (k.startswith(ep1) and not k.endswith("tensor_0.pt")) and not k.startswith("optim/")}
    files.update({f"optim/{layout.shard_filename(d, 0, 0)}": {"size": 1, "crc32c": "0"} for d in range(4)})
    assert manifest_mod.legacy_ep_folders(_manifest(tagdir, files=files)) == frozenset()
    assert manifest_mod.legacy_ep_folders(_manifest(tagdir, topology=dict(TOPOLOGY, ep=1))) == frozenset()
    assert manifest_mod.legacy_ep_folders(None) == frozenset()


def _load_rank(rank, world, root):
    import nxd_ckpt
    import parallel_state as ps

    ps.initialize_model_parallel(expert_model_parallel_size=EP)
    ep, dp = ps.get_expert_model_parallel_rank(), ps.get_data_parallel_rank()
    assert (dp, ep, ps.get_expert_data_parallel_rank()) == (rank, rank % EP, rank // EP)
    for tag, (zero1, _) in TAGS.items():
        model, optim = {}, {}
        nxd_ckpt.load_checkpoint(root, tag, model=model, optimizer=optim)
        assert_bit_equal(legacy_model(ep), model, f"{tag}/model")
        assert_bit_equal(legacy_zero1(dp) if zero1 else legacy_adam(ep), optim, f"{tag}/optim")
    return True


def test_legacy_ep_checkpoints_load_bit_exact(tmp_path):
    """Each rank gets exactly what it saved, from its own folders: the EP rank 1 copies of non-expert
    tensors, the expert optimizer state of a plain Adam, the ZeRO-1 file of its expert-DP and EP rank."""
    root = str(tmp_path / "ckpt")
    for tag, (zero1, use_xser) in TAGS.items():
        build_legacy_ep_tag(root, tag, zero1, use_xser)
    assert run_ranks(_load_rank, 4, root, timeout=240) == [True] * 4


def _nxd_named_copy(src: str, dst: str) -> None:
    """The same ZeRO-1 files under NxD's names (dp = edp * EP + ep), without a manifest, for comparison."""
    os.makedirs(os.path.join(dst, "optim"))
    for name in os.listdir(os.path.join(src, "optim")):
        s = layout.parse_shard_filename(name)
        if s is None:
            continue
        new = layout.shard_filename(s.dp * EP + s.ep, 0, 0)
        for suffix in ("", layout.INFO_SUFFIX, layout.TENSORS_SUFFIX):
            if os.path.isdir(os.path.join(src, "optim", name + suffix)):
                shutil.copytree(os.path.join(src, "optim", name + suffix), os.path.join(dst, "optim", new + suffix))
            elif os.path.exists(os.path.join(src, "optim", name + suffix)):
                shutil.copy(os.path.join(src, "optim", name + suffix), os.path.join(dst, "optim", new + suffix))
    shutil.copytree(os.path.join(src, "model"), os.path.join(dst, "model"))   # gives the EP size
    for marker in ("checkpoint", "done"):
        with open(os.path.join(dst, marker), "w") as f:
            f.write("1")


@pytest.mark.parametrize("use_xser", [True, False], ids=["xser", "plain"])
def test_convert_zero1_reads_legacy_names(tmp_path, use_xser):
    """convert-zero1 maps the old names to DP ranks: at the same DP size it reproduces each rank's state
    under NxD's name, and to DP=2 it writes what it writes for the same files under NxD's names."""
    from nxd_ckpt.zero1 import convert_zero1

    src = build_legacy_ep_tag(str(tmp_path), "zero1", True, use_xser)
    load = (lambda p: xser.load(p)) if use_xser else (lambda p: torch.load(p, weights_only=True))
    same = str(tmp_path / "dp4")
    convert_zero1(src, same, dp_size=4)
    for dp in range(4):
        assert_bit_equal(legacy_zero1(dp), load(os.path.join(same, "optim", layout.shard_filename(dp, 0, 0))), f"{dp}")
    assert manifest_mod.legacy_ep_folders(_manifest(same)) == ({"model"} if use_xser else frozenset())
    nxd = str(tmp_path / "nxd_named")
    _nxd_named_copy(src, nxd)
    convert_zero1(src, str(tmp_path / "dp2"), dp_size=2)
    convert_zero1(nxd, str(tmp_path / "nxd_dp2"), dp_size=2)
    for dp in range(2):
        name = layout.shard_filename(dp, 0, 0)
        assert_bit_equal(load(os.path.join(tmp_path, "nxd_dp2", "optim", name)),
                         load(os.path.join(tmp_path, "dp2", "optim", name)), f"dp2 {dp}")
    assert not os.path.exists(os.path.join(tmp_path, "dp2", "optim", layout.shard_filename(2, 0, 0)))


def test_offline_tools_read_legacy_tags(tmp_path, capsys):
    from nxd_ckpt.cli import main
    from nxd_ckpt.inspect import describe
    from nxd_ckpt.verify import verify_tag

    root = str(tmp_path)
    for tag, (zero1, use_xser) in TAGS.items():
        tagdir = build_legacy_ep_tag(root, tag, zero1, use_xser)
        assert verify_tag(tagdir).problems == []
        d = describe(tagdir)
        assert (d["topology"]["ep"], d["topology"]["dp"]) == (EP, DP)
    assert main(["ls", root]) == 0
    out = capsys.readouterr().out
    assert all(tag in out for tag in TAGS)
    assert main(["info", os.path.join(root, "zero1")]) == 0
    assert "optim/dp_rank_01_ep_rank_01_tp_rank_00_pp_rank_00.pt" in capsys.readouterr().out


def _converted_rank(rank, world, root):
    import nxd_ckpt
    import parallel_state as ps

    ps.initialize_model_parallel(expert_model_parallel_size=EP)   # 2 ranks: DP=2, EP=2, expert-DP=1
    ep = ps.get_expert_model_parallel_rank()
    model, optim = {}, {}
    nxd_ckpt.load_checkpoint(root, "dp2", model=model, optimizer=optim)
    assert_bit_equal(legacy_model(ep), model, "model")   # model/ still in the old layout, optim/ in NxD's
    return optim


def test_legacy_tag_converted_to_dp2_loads(tmp_path):
    from nxd_ckpt.zero1 import convert_zero1

    root = str(tmp_path)
    convert_zero1(build_legacy_ep_tag(root, "zero1", True), os.path.join(root, "dp2"), dp_size=2)
    optims = run_ranks(_converted_rank, 2, root, timeout=240)
    for dp, optim in enumerate(optims):
        assert_bit_equal(xser.load(os.path.join(root, "dp2", "optim", layout.shard_filename(dp, 0, 0))), optim, f"{dp}")
    assert [tuple(optims[0]["base_state"][i]["exp_avg"].shape) for i in range(3)] == [(4, HIDDEN), (4,), (HIDDEN, HIDDEN)]
