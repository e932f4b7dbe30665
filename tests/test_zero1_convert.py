"""convert-zero1: bit-exact re-sharding of ZeRO-1 optimizer states, complete output tags, clear errors."""
from __future__ import annotations

import json
import os
import sys

import pytest
import torch

from nxd_ckpt import layout
from nxd_ckpt.cli import convert_zero1_main, main
from nxd_ckpt.testing.zero1_adam import shard_of
from nxd_ckpt.verify import verify_tag
from nxd_ckpt.zero1 import BufferRing, Geometry, stream_pieces
from test_cli_fixtures import (SHAPES, assert_bit_equal, full_zero1_params, load_shard, write_tag, zero1_states,
                               zero1_tag)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _optim(tagdir, dp, tp=0, pp=0):
    return load_shard(tagdir, f"optim/{layout.shard_filename(dp, tp, pp)}")


def _expect_shards(tagdir, full, dp, tp=0, pp=0, masters=True):
    """Every output shard equals shard_of(full) at ``dp``, with step and non-tensors copied."""
    for r in range(dp):
        got = _optim(tagdir, r, tp, pp)
        want = zero1_states(full, dp, masters)[r]
        assert_bit_equal(want, got, f"dp {r}")


def _convert(args, capsys=None):
    code = main(["convert-zero1", *args])
    return code


# --- the row arithmetic -------------------------------------------------------------------------------------
@pytest.mark.parametrize("shape", [(10, 3), (7,), (), (3,), (0, 2), (1, 5), (16,)])
@pytest.mark.parametrize("g_in,g_out", [(4, 2), (2, 4), (4, 3), (1, 5), (8, 1)])
def test_stream_pieces_matches_reference(shape, g_in, g_out):
    full = torch.arange(max(1, torch.Size(shape).numel()), dtype=torch.float32)[: torch.Size(shape).numel()].reshape(shape)
    ins = [shard_of(full, j, g_in) for j in range(g_in)]
    geo = Geometry(shape, g_in, False, g_out, False)
    loaded = []
    got = list(stream_pieces(geo, lambda j: (loaded.append(j) or ins[j], f"in{j}")))
    assert [r for r, _ in got] == list(range(g_out))
    for r, piece in got:
        assert_bit_equal(shard_of(full, r, g_out), piece, f"piece {r}")
    assert len(loaded) == len(set(loaded))  # each input piece read once
    ring = BufferRing(1)  # reused buffers: the consumer copies each piece before asking for the next
    got = [(r, p.clone()) for r, p in stream_pieces(geo, lambda j: (ins[j], f"in{j}"), ring)]
    for r, piece in got:
        assert_bit_equal(shard_of(full, r, g_out), piece, f"piece {r} (ring)")
    # to full and back from full
    (r, f), = list(stream_pieces(Geometry(shape, g_in, False, 1, True), lambda j: (ins[j], "x")))
    assert_bit_equal(full, f)
    back = list(stream_pieces(Geometry(shape, 1, True, g_out, False), lambda j: (full, "x")))
    for r, piece in back:
        assert_bit_equal(shard_of(full, r, g_out), piece)


# --- round trips --------------------------------------------------------------------------------------------
def test_round_trip_dp4_full_dp2_dp4_bit_exact(tmp_path):
    src, full = zero1_tag(str(tmp_path), "step_3", dp=4)
    full = full[(0, 0)]
    orig = [_optim(src, r) for r in range(4)]
    full_dir, dp2, dp4 = (str(tmp_path / n) for n in ("full", "dp2", "dp4"))

    assert _convert(["--input_dir", src, "--output_dir", full_dir, "--convert_to_full"]) == 0
    merged = load_shard(full_dir, "optim/full_tp_rank_00_pp_rank_00.pt")
    for i in SHAPES:
        assert_bit_equal(full[i]["exp_avg"], merged["base_state"][i]["exp_avg"], f"full {i}")
        assert_bit_equal(full[i]["master"], merged["sharded_master_weights"][i], f"master {i}")
        assert merged["base_state"][i]["step"].item() == 7.0
    assert not any(n.startswith("dp_rank") for n in os.listdir(os.path.join(full_dir, "optim")))

    assert _convert(["--input_dir", full_dir, "--output_dir", dp2, "--convert_to_sharded", "--dp_size", "2"]) == 0
    _expect_shards(dp2, full, 2)
    assert _convert(["--input_dir", dp2, "--output_dir", dp4, "--convert_to_sharded", "--dp_size", "4"]) == 0
    for r in range(4):
        assert_bit_equal(orig[r], _optim(dp4, r), f"dp4 rank {r}")
    # the ref files are the same bytes too (same structure, same tids)
    for r in range(4):
        rel = f"optim/{layout.shard_filename(r, 0, 0)}"
        assert open(os.path.join(src, rel), "rb").read() == open(os.path.join(dp4, rel), "rb").read()


def test_sharded_to_sharded_direct_with_tp_groups_and_workers(tmp_path):
    src, full = zero1_tag(str(tmp_path), "s", dp=4, tp=2)
    out = str(tmp_path / "dp3")
    assert convert_zero1_main(["--input_dir", src, "--output_dir", out, "--convert_to_sharded", "--dp_size", "3",
                               "--num_workers", "2"]) == 0
    for tp in range(2):
        _expect_shards(out, full[(tp, 0)], 3, tp=tp)
    assert sorted(os.listdir(os.path.join(out, "optim"))) == sorted(
        n for tp in range(2) for r in range(3) for n in (layout.shard_filename(r, tp, 0),
                                                          layout.shard_filename(r, tp, 0) + ".info.pt",
                                                          layout.shard_filename(r, tp, 0) + ".tensors"))
    man = json.load(open(os.path.join(out, "manifest.json")))
    assert man["topology"]["dp"] == 3 and man["topology"]["tp"] == 2 and man["topology"]["world_size"] == 6
    info = torch.load(os.path.join(out, "optim", layout.shard_filename(2, 1, 0) + ".info.pt"), weights_only=True)
    ref = load_shard(out, f"optim/{layout.shard_filename(2, 1, 0)}")
    assert info[1]["shape"] == ref["base_state"][0]["exp_avg"].shape  # tid 1 = base_state/0/exp_avg


def test_plain_torch_save_input_round_trip(tmp_path):
    src, full = zero1_tag(str(tmp_path), "p", dp=4, use_xser=False, masters=False)
    full = full[(0, 0)]
    out = str(tmp_path / "dp2")
    assert _convert(["--input_dir", src, "--output_dir", out, "--convert_to_sharded", "--dp_size", "2"]) == 0
    assert not any(n.endswith(".tensors") for n in os.listdir(os.path.join(out, "optim")))
    _expect_shards(out, full, 2, masters=False)
    assert verify_tag(out).ok


def test_output_tag_is_complete_and_verifies(tmp_path, capsys):
    src, _ = zero1_tag(str(tmp_path), "step_3", dp=4)
    out = str(tmp_path / "step_3_dp2")
    assert _convert(["--input_dir", src, "--output_dir", out, "--convert_to_sharded", "--dp_size", "2"]) == 0
    names = set(os.listdir(out))
    assert {"checkpoint", "done", "manifest.json", "model", "optim", "scheduler.pt", "user_content.pt"} <= names
    assert not os.path.exists(out + ".nxdtmp")
    man = json.load(open(os.path.join(out, "manifest.json")))
    assert man["topology"]["dp"] == 2 and man["topology"]["world_size"] == 2 and man["zero1"] and man["xser"]
    on_disk = set()
    for root, _d, files in os.walk(out):
        for f in files:
            on_disk.add(os.path.relpath(os.path.join(root, f), out))
    assert set(man["files"]) == on_disk - {"checkpoint", "done", "manifest.json"}
    assert set(man["tensors"]) >= {"model/dp_rank_00_tp_rank_00_pp_rank_00.pt",
                                   "optim/dp_rank_01_tp_rank_00_pp_rank_00.pt"}
    # model/ and the small files are the input's (hard-linked on the same filesystem)
    for rel in ("model/dp_rank_00_tp_rank_00_pp_rank_00.pt.tensors/tensor_0.pt", "scheduler.pt", "user_content.pt"):
        assert open(os.path.join(src, rel), "rb").read() == open(os.path.join(out, rel), "rb").read()
    assert verify_tag(out).ok
    capsys.readouterr()
    assert main(["verify", out]) == 0
    # the input is untouched
    assert verify_tag(src).ok and len(os.listdir(os.path.join(src, "optim"))) == 12


def test_nxd_input_without_manifest(tmp_path):
    src, full = zero1_tag(str(tmp_path), "nxd", dp=2, manifest=False)
    out = str(tmp_path / "dp4")
    assert _convert(["--input_dir", src, "--output_dir", out, "--convert_to_sharded", "--dp_size", "4"]) == 0
    _expect_shards(out, full[(0, 0)], 4)
    man = json.load(open(os.path.join(out, "manifest.json")))
    assert man["topology"]["dp"] == 4 and man["topology"]["tp"] == 1
    assert verify_tag(out).ok


def test_optim_folder_input_like_nxd_converter(tmp_path):
    src, full = zero1_tag(str(tmp_path), "t", dp=4)
    out = str(tmp_path / "optim_dp2")
    assert _convert(["--input_dir", os.path.join(src, "optim"), "--output_dir", out, "--convert_to_sharded",
                     "--dp_size", "2"]) == 0
    got = load_shard(out, layout.shard_filename(1, 0, 0))
    assert_bit_equal(zero1_states(full[(0, 0)], 2)[1], got)


def test_overwrite_replaces_existing_output(tmp_path, capsys):
    src, full = zero1_tag(str(tmp_path), "t", dp=2)
    out = tmp_path / "out"
    out.mkdir()
    (out / "old.txt").write_text("x")
    args = ["--input_dir", src, "--output_dir", str(out), "--convert_to_sharded", "--dp_size", "4"]
    assert _convert(args) == 1
    err = capsys.readouterr().err
    assert "not empty" in err and "--overwrite" in err and (out / "old.txt").exists()
    assert _convert(args + ["--overwrite"]) == 0
    assert not (out / "old.txt").exists()
    _expect_shards(str(out), full[(0, 0)], 4)
    (tmp_path / "empty").mkdir()  # an existing empty directory is fine
    assert _convert(["--input_dir", src, "--output_dir", str(tmp_path / "empty"), "--convert_to_full"]) == 0


# --- bad input ----------------------------------------------------------------------------------------------
def _fails(capsys, args, *needles, code=1):
    assert main(["convert-zero1", *args]) == code
    err = capsys.readouterr().err
    for n in needles:
        assert n in err, err
    return err


def test_missing_optim(tmp_path, capsys):
    src = write_tag(str(tmp_path), "m", model={(0, 0): {"w": torch.ones(2)}})
    err = _fails(capsys, ["--input_dir", src, "--output_dir", str(tmp_path / "o"), "--convert_to_full"], "no optim/")
    assert err.startswith("nxd-ckpt: error:")
    assert not os.path.exists(tmp_path / "o")


def test_mixed_dp_sizes_and_missing_ranks(tmp_path, capsys):
    full = full_zero1_params()
    optim = {(d, 0, 0): s for d, s in enumerate(zero1_states(full, 4))}
    optim.update({(d, 1, 0): s for d, s in enumerate(zero1_states(full, 2))})
    src = write_tag(str(tmp_path), "mixed", optim=optim, zero1=True)
    _fails(capsys, ["--input_dir", src, "--output_dir", str(tmp_path / "o"), "--convert_to_full"],
           "mixed DP sizes", "tp 1 pp 0 has dp ranks 0-1 (missing 2-3)")
    optim = {(d, 0, 0): s for d, s in enumerate(zero1_states(full, 4)) if d != 2}
    src = write_tag(str(tmp_path), "holes", optim=optim, zero1=True)
    _fails(capsys, ["--input_dir", src, "--output_dir", str(tmp_path / "o"), "--convert_to_full"],
           "missing dp ranks", "missing 2")


def test_non_zero1_input(tmp_path, capsys):
    plain = {"state": {0: {"step": torch.tensor(1.0), "exp_avg": torch.ones(3)}}, "param_groups": [{"params": [0]}]}
    src = write_tag(str(tmp_path), "adam", optim={(d, 0, 0): plain for d in range(2)})
    _fails(capsys, ["--input_dir", src, "--output_dir", str(tmp_path / "o"), "--convert_to_sharded", "--dp_size", "4"],
           "not a ZeRO-1 optimizer state", "dp_rank_00_tp_rank_00_pp_rank_00.pt")


def test_output_equals_input_refused_also_via_symlink(tmp_path, capsys):
    src, _ = zero1_tag(str(tmp_path), "t", dp=2)
    before = sorted(os.listdir(os.path.join(src, "optim")))
    _fails(capsys, ["--input_dir", src, "--output_dir", src, "--convert_to_full", "--overwrite"],
           "is the input directory")
    link = tmp_path / "alias"
    link.symlink_to(src)
    _fails(capsys, ["--input_dir", src, "--output_dir", str(link), "--convert_to_full", "--overwrite"],
           "is the input directory")
    _fails(capsys, ["--input_dir", src, "--output_dir", str(tmp_path), "--convert_to_full", "--overwrite"],
           "contains the input directory")
    assert sorted(os.listdir(os.path.join(src, "optim"))) == before and verify_tag(src).ok


@pytest.mark.parametrize("tid", [0, 1], ids=["copied-step-of-dp1", "sharded-state"])
def test_corrupt_tensor_file(tmp_path, capsys, tid):
    src, _ = zero1_tag(str(tmp_path), "t", dp=2)
    import xser

    refs = xser.load_refs(os.path.join(src, "optim", layout.shard_filename(1, 0, 0)))
    assert refs["base_state"][0]["step"].tid == 0, "tensor_0 should be a copied entry (Adam's step)"
    victim = os.path.join(src, "optim", layout.shard_filename(1, 0, 0) + ".tensors", f"tensor_{tid}.pt")
    data = bytearray(open(victim, "rb").read())
    data[len(data) // 2] ^= 0x10
    open(victim, "wb").write(bytes(data))
    _fails(capsys, ["--input_dir", src, "--output_dir", str(tmp_path / "o"), "--convert_to_full"],
           f"tensor_{tid}.pt", "checksum")
    assert not os.path.exists(tmp_path / "o") and not os.path.exists(str(tmp_path / "o") + ".nxdtmp")
    # without a manifest (NxD): a truncated tensor file fails to open, named
    src2, _ = zero1_tag(str(tmp_path / "nxd"), "t", dp=2, manifest=False)
    victim = os.path.join(src2, "optim", layout.shard_filename(0, 0, 0) + ".tensors", "tensor_2.pt")
    open(victim, "r+b").truncate(20)
    _fails(capsys, ["--input_dir", src2, "--output_dir", str(tmp_path / "o2"), "--convert_to_full"], "tensor_2.pt")


def test_usage_errors(tmp_path, capsys):
    src, _ = zero1_tag(str(tmp_path), "t", dp=2)
    out = str(tmp_path / "o")
    _fails(capsys, ["--input_dir", src, "--output_dir", out, "--convert_to_full", "--bogus"],
           "unrecognized arguments: --bogus", code=2)
    _fails(capsys, ["--input_dir", src, "--output_dir", out], "one of the arguments", code=2)
    _fails(capsys, ["--input_dir", src, "--output_dir", out, "--convert_to_sharded"], "--dp_size")
    _fails(capsys, ["--input_dir", src, "--output_dir", out, "--convert_to_sharded", "--dp_size", "0"], "--dp_size")
    _fails(capsys, ["--input_dir", src, "--output_dir", out, "--convert_to_full", "--dp_size", "3"],
           "--convert_to_full merges every DP shard, so --dp_size 3 has no meaning")
    assert convert_zero1_main(["--input_dir", src, "--output_dir", out, "--convert_to_full", "--nope"]) == 2
    assert "nxd_convert_zero_checkpoints: error: unrecognized arguments" in capsys.readouterr().err
    assert not os.path.exists(out)


def test_incomplete_input_refused(tmp_path, capsys):
    full = full_zero1_params()
    src = write_tag(str(tmp_path), "inc", optim={(d, 0, 0): s for d, s in enumerate(zero1_states(full, 2))},
                    zero1=True, done=False)
    _fails(capsys, ["--input_dir", src, "--output_dir", str(tmp_path / "o"), "--convert_to_full"], "'done'")


def test_tools_script_runs(tmp_path, capsys, monkeypatch):
    import runpy

    src, full = zero1_tag(str(tmp_path), "t", dp=2)
    out = str(tmp_path / "o")
    script = os.path.join(ROOT, "tools", "convert_zero1.py")
    monkeypatch.setattr(sys, "argv", [script, "--input_dir", src, "--output_dir", out, "--convert_to_sharded",
                                      "--dp_size", "3", "--json"])
    with pytest.raises(SystemExit) as exc:
        runpy.run_path(script, run_name="__main__")
    assert exc.value.code == 0
    assert json.loads(capsys.readouterr().out)["output_dp"] == 3
    _expect_shards(out, full[(0, 0)], 3)


def test_expert_parallel_optimizer_files_are_refused(tmp_path, capsys):
    """Optimizer files named by ep rank (a plain EP optimizer, or an older nxd-ckpt EP ZeRO-1 save): convert-zero1
    cannot tell DP-sharded from expert-DP-sharded parameters, so it refuses before writing anything. NxD's own
    EP ZeRO-1 layout is refused in tests/test_expert_parallel.py."""
    from nxd_ckpt.storage import LocalStorage
    from test_cli_fixtures import write_shard

    store = LocalStorage(str(tmp_path))
    full = {e: full_zero1_params(seed=e) for e in range(2)}
    for e in range(2):
        for d, sd in enumerate(zero1_states(full[e], 2)):
            write_shard(store, "ep", f"optim/{layout.shard_filename(d, 0, 0, e)}", sd)
    store.write_file("ep/done", lambda f: f.write(b"1"))
    out = str(tmp_path / "ep_dp4")
    assert main(["convert-zero1", "--input_dir", str(tmp_path / "ep"), "--output_dir", out,
                 "--convert_to_sharded", "--dp_size", "4"]) == 1
    err = capsys.readouterr().err
    assert "expert-parallel" in err and "dp_rank_00_ep_rank_00_tp_rank_00_pp_rank_00.pt" in err
    assert not os.path.exists(out)


# --- a real run: saved at DP=4, converted, resumed at DP=2 ---------------------------------------------------
K = 2


def _zero1_run(ps, seed_offset=0):
    from nxd_ckpt.testing import ZeroOneAdam
    from tiny_models import TinyShard

    model = TinyShard(seed_offset=seed_offset)
    opt = ZeroOneAdam(model.parameters(), lr=0.05, dp_group=ps.get_data_parallel_host_group(),
                      dp_rank=ps.get_data_parallel_rank(), dp_size=ps.get_data_parallel_size())
    return model, opt


def _train_dp(ps, model, opt, start):
    from tiny_models import train_steps

    train_steps(model, opt, K, seed=5, dp_rank=ps.get_data_parallel_rank(), start=start)


def _save_at_dp4(rank, world, root):
    import nxd_ckpt
    import parallel_state as ps

    ps.initialize_model_parallel(tensor_model_parallel_size=1)
    model, opt = _zero1_run(ps)
    _train_dp(ps, model, opt, 0)
    nxd_ckpt.save_checkpoint(root, "dp4", model=model, optimizer=opt, user_content={"step": K}, use_xser=True)


def _resharded_by_hand(tagdir, dp_rank, dp_size):
    """The reference: the DP=4 state files merged and re-split in memory with the test's own helpers."""
    from nxd_ckpt.testing.zero1_adam import unshard

    old = [_optim(tagdir, r) for r in range(4)]
    sd = {"state": old[0]["state"], "param_groups": old[0]["param_groups"], "base_state": {},
          "shape_info": old[0]["shape_info"], "sharded_master_weights": {}}
    for i, shape in old[0]["shape_info"].items():
        st = dict(old[0]["base_state"][i])
        for key in ("exp_avg", "exp_avg_sq"):
            st[key] = shard_of(unshard([o["base_state"][i][key] for o in old], shape), dp_rank, dp_size)
        sd["base_state"][i] = st
        sd["sharded_master_weights"][i] = shard_of(
            unshard([o["sharded_master_weights"][i] for o in old], shape), dp_rank, dp_size)
    return sd


def _resume_at_dp2(rank, world, root):
    import nxd_ckpt
    import parallel_state as ps
    from tiny_models import to_cpu_state

    ps.initialize_model_parallel(tensor_model_parallel_size=1)
    dp_rank = ps.get_data_parallel_rank()
    model, opt = _zero1_run(ps, seed_offset=7)          # another init: everything must come from disk
    assert nxd_ckpt.load_checkpoint(root, "dp2", model=model, optimizer=opt) == {"step": K}
    ref_sd = _resharded_by_hand(os.path.join(root, "dp4"), dp_rank, 2)
    assert_bit_equal(ref_sd, to_cpu_state(opt.state_dict()), "converted optimizer state")

    ref_model, ref_opt = _zero1_run(ps, seed_offset=9)
    nxd_ckpt.load_checkpoint(root, "dp4", model=ref_model)  # model shards are DP-replicated: any DP loads them
    ref_opt.load_state_dict(ref_sd)
    _train_dp(ps, model, opt, K)
    _train_dp(ps, ref_model, ref_opt, K)
    assert_bit_equal(to_cpu_state(ref_model.state_dict()), to_cpu_state(model.state_dict()), "model")
    assert_bit_equal(to_cpu_state(ref_opt.state_dict()), to_cpu_state(opt.state_dict()), "optimizer")
    return True


def test_saved_at_dp4_converted_resumes_at_dp2_like_the_reference(tmp_path, capsys):
    from harness import run_ranks

    root = str(tmp_path / "ckpt")
    run_ranks(_save_at_dp4, 4, root, timeout=180)
    assert _convert(["--input_dir", os.path.join(root, "dp4"), "--output_dir", os.path.join(root, "dp2"),
                     "--convert_to_sharded", "--dp_size", "2"]) == 0
    assert run_ranks(_resume_at_dp2, 2, root, timeout=180) == [True, True]
