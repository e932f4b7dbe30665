"""The way off XLA (issue 15): a demo run trained at TP=2 x DP=2 with ZeRO-1 on XLA, converted with `to-dcp`,
resumes in plain PyTorch (2 gloo ranks, FSDP2, torch.optim.AdamW) with every parameter and Adam moment equal
bit for bit and the next losses equal within float tolerance; `from-dcp` gives the original tag back."""
from __future__ import annotations

import json
import os

import pytest
import torch

import xser
from demo_runs import run_demo, use_scripts
from harness import run_ranks
from tiny_models import assert_bit_equal

SAVE_AT, STEPS = 3, 5
MODEL = ["--layers", "1", "--hidden", "32", "--ffn", "64", "--seq-len", "16", "--total-steps", str(STEPS)]
DEMO = ["--zero1", "--tp", "2", *MODEL, "--steps", str(STEPS), "--ckpt-every", str(SAVE_AT), "--log-every", "1"]


@pytest.fixture(scope="module")
def xla_run(tmp_path_factory):
    """The demo at TP=2 x DP=2 with ZeRO-1 on XLA: saves step 3 (converted below) and trains on to step 5."""
    root = tmp_path_factory.mktemp("xla")
    report = run_demo(DEMO + ["--ckpt-dir", str(root / "ckpt")], root / "run.json")
    return root / "ckpt" / f"step_{SAVE_AT}", report


def full_reference(tag):
    """The XLA run's full state at the save, joined here by hand from the tag's files (independently of
    nxd_ckpt's converters): {name: param}, {name: {exp_avg, exp_avg_sq, step}}."""
    model, parts = {}, {}
    shards = [xser.load(str(tag / "model" / f"dp_rank_00_tp_rank_{t:02d}_pp_rank_00.pt")) for t in range(2)]
    info = torch.load(str(tag / "model" / "dp_rank_00_tp_rank_00_pp_rank_00.pt.info.pt"), weights_only=True)
    names = list(shards[0])
    for tid, name in enumerate(names):
        dim = info[tid].get("partition_dim") if info[tid].get("tensor_model_parallel") else None
        parts[name] = dim
        model[name] = shards[0][name] if dim is None else torch.cat([s[name] for s in shards], dim=dim)
    optim = {}
    files = {(t, d): xser.load(str(tag / "optim" / f"dp_rank_{d:02d}_tp_rank_{t:02d}_pp_rank_00.pt"))
             for t in range(2) for d in range(2)}
    for i, name in enumerate(names):
        entry = {"step": files[(0, 0)]["base_state"][i]["step"]}
        for k in ("exp_avg", "exp_avg_sq"):
            local = []
            for t in range(2):
                rows = files[(t, 0)]["shape_info"][i][0]
                local.append(torch.cat([files[(t, d)]["base_state"][i][k] for d in range(2)])[:rows])
            entry[k] = local[0] if parts[name] is None else torch.cat(local, dim=parts[name])
        optim[name] = entry
    return model, optim


def _native_rank(rank, world, dcp_dir, argv):
    """2 gloo ranks: FSDP2-sharded NativeLM + AdamW loaded from the DCP checkpoint; the full state after
    loading and the losses of the next steps (rank 0)."""
    use_scripts()
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_optimizer_state_dict)

    import native_demo

    torch.manual_seed(0)
    args = native_demo.parse_args(["--dcp", dcp_dir, *argv])
    model, optim, sched = native_demo.build(args)
    uc = native_demo.load_dcp(dcp_dir, model, optim, sched)
    full = StateDictOptions(full_state_dict=True, cpu_offload=True)
    from tiny_models import to_cpu_state

    # copies: the state dicts may share tensors (Adam's step) with the optimizer, which the steps below change
    msd = to_cpu_state(get_model_state_dict(model, options=full))
    osd = to_cpu_state(get_optimizer_state_dict(model, optim, options=full))
    lrs = [g["lr"] for g in optim.param_groups]
    wd = [g["weight_decay"] for g in optim.param_groups]
    sched_sd = dict(sched.state_dict())
    losses = native_demo.train(model, optim, sched, args, int(uc["step"]), int(uc["data_pos"]))
    # the native job saves as native jobs do (sharded DCP, one chunk per rank), for from-dcp below
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(model, optim)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=dcp_dir + "_native")
    after = {"model": to_cpu_state(get_model_state_dict(model, options=full)),
             "optim": to_cpu_state(get_optimizer_state_dict(model, optim, options=full)).get("state")}
    if rank != 0:
        return None
    return {"model": msd, "optim": osd["state"], "losses": losses, "uc": uc, "lrs": lrs, "wd": wd,
            "sched": sched_sd, "after": after}


@pytest.mark.slow
def test_xla_run_resumes_in_native_pytorch_and_comes_back(xla_run, tmp_path):
    from nxd_ckpt.cli import main

    tag, report = xla_run
    out = tmp_path / "dcp"
    assert main(["to-dcp", str(tag), str(out)]) == 0
    files = set(os.listdir(out))
    distcp = {f for f in files if f.endswith(".distcp")}
    assert files - distcp == {".metadata", "done", "manifest.json"} and distcp
    assert set(json.loads((out / "manifest.json").read_text())["files"]) == files - {"done", "manifest.json"}

    got = run_ranks(_native_rank, 2, str(out), MODEL + ["--steps", str(STEPS)], timeout=180)[0]
    ref_model, ref_optim = full_reference(tag)
    assert_bit_equal(got["model"], ref_model, "model")
    assert set(got["optim"]) == set(ref_optim)
    for name, st in ref_optim.items():
        assert_bit_equal(got["optim"][name], st, f"optim/{name}")
    assert got["uc"]["step"] == SAVE_AT and got["sched"]["last_step"] == SAVE_AT
    assert got["wd"] == [0.0], "the source was Adam without weight decay: AdamW must get weight_decay 0"
    for s in range(SAVE_AT + 1, STEPS + 1):
        assert got["losses"][s] == pytest.approx(report["losses"][str(s)], rel=1e-4, abs=1e-5), s

    # from-dcp at the original sizes gives the original tag back, bit for bit
    back = tmp_path / "back"
    assert main(["from-dcp", str(out), str(back), "--tp", "2", "--dp", "2", "--zero1"]) == 0
    for sub in ("model", "optim"):
        refs = sorted(n for n in os.listdir(tag / sub) if n.endswith(".pt") and ".pt." not in n)
        assert refs == sorted(n for n in os.listdir(back / sub) if n.endswith(".pt") and ".pt." not in n)
        for n in refs:
            assert_bit_equal(xser.load(str(back / sub / n)), xser.load(str(tag / sub / n)), f"{sub}/{n}")
    for n in ("scheduler.pt", "user_content.pt"):
        assert torch.load(back / n, weights_only=True) == torch.load(tag / n, weights_only=True)
    assert main(["verify", str(back)]) == 0

    # and the native job's own sharded DCP save comes in with Llama's partition rules, equal to its full state
    from nxd_ckpt.fullstate import read_tag

    assert main(["from-dcp", str(out) + "_native", str(tmp_path / "native_tag"), "--tp", "2", "--dp", "2",
                 "--zero1", "--preset", "llama"]) == 0
    native = read_tag(str(tmp_path / "native_tag"))
    assert_bit_equal({t.name: t.checked() for t in native.model}, got["after"]["model"], "native model")
    for name, ps in native.optim.params.items():
        assert_bit_equal({"step": ps.step, **{k: m.checked() for k, m in ps.moments.items()}},
                         got["after"]["optim"][name], f"native optim/{name}")


@pytest.mark.slow
def test_torchtitan_layout_keys(xla_run, tmp_path):
    """--layout torchtitan: model FQNs at the top level, TorchTitan's flat optimizer keys
    (state.FQN.NAME, param_groups.FQN.KEY), lr_scheduler and train_state; from-dcp reads it back."""
    from torch.distributed.checkpoint import FileSystemReader

    from nxd_ckpt.cli import main
    from nxd_ckpt.dcpio import adamw_group

    tag, _ = xla_run
    out = tmp_path / "tt"
    assert main(["to-dcp", str(tag), str(out), "--layout", "torchtitan"]) == 0
    keys = set(FileSystemReader(str(out)).read_metadata().state_dict_metadata)
    ref_model, _ = full_reference(tag)
    want = set(ref_model) | {"lr_scheduler.last_epoch", "train_state.step", "train_state.ntokens_seen", "nxd_ckpt"}
    for name in ref_model:
        want |= {f"optimizer.state.{name}.{k}" for k in ("step", "exp_avg", "exp_avg_sq")}
        want |= {f"optimizer.param_groups.{name}.{k}" for k in adamw_group({})}
    assert keys == want, sorted(keys ^ want)[:10]
    back = tmp_path / "back"
    assert main(["from-dcp", str(out), str(back), "--tp", "2", "--dp", "2", "--zero1"]) == 0
    for n in ("dp_rank_01_tp_rank_01_pp_rank_00.pt",):
        assert_bit_equal(xser.load(str(back / "optim" / n)), xser.load(str(tag / "optim" / n)), n)


def _pad_chunk(full, rank, size):
    """ZeRO-1 piece ``rank`` of ``full`` (DESIGN 2.4), written out here independently of nxd_ckpt."""
    flat = full.reshape(full.shape[0] if full.dim() else 1, *full.shape[1:])
    per = -(-flat.shape[0] // size)
    padded = torch.cat([flat, flat.new_zeros((per * size - flat.shape[0], *flat.shape[1:]))])
    return padded[rank * per:(rank + 1) * per]


@pytest.mark.slow
def test_reshard_offline_then_load_checkpoint_at_new_sizes(xla_run, tmp_path):
    """`reshard` TP=2 x DP=2 -> TP=1 x DP=4: the demo resumes from it with load_checkpoint at the new sizes, and
    every parameter, Adam moment and master-weight piece equals the XLA run's full state split at DP=4."""
    from nxd_ckpt.cli import main

    tag, _ = xla_run
    ckpt = tmp_path / "ckpt"
    assert main(["reshard", str(tag), str(ckpt / f"step_{SAVE_AT}"), "--tp", "1", "--dp", "4"]) == 0
    man = json.loads((ckpt / f"step_{SAVE_AT}" / "manifest.json").read_text())
    assert (man["topology"]["tp"], man["topology"]["dp"], man["zero1"]) == (1, 4, True)
    run = run_demo(["--zero1", "--tp", "1", *MODEL, "--steps", str(SAVE_AT), "--ckpt-every", "0",
                    "--ckpt-dir", str(ckpt), "--dump-final", str(tmp_path / "loaded")], tmp_path / "r.json")
    assert run["resumed_from"] == f"step_{SAVE_AT}"
    ref_model, ref_optim = full_reference(tag)
    names = list(ref_model)
    for r in range(4):
        got = torch.load(f"{tmp_path / 'loaded'}.rank{r}.pt", weights_only=True)
        assert_bit_equal(got["model"], ref_model, f"rank{r}/model")
        for i, name in enumerate(names):
            st = got["optim"]["base_state"][i]
            assert_bit_equal(st["step"], ref_optim[name]["step"], f"rank{r}/{name}/step")
            for k in ("exp_avg", "exp_avg_sq"):
                assert_bit_equal(st[k], _pad_chunk(ref_optim[name][k], r, 4), f"rank{r}/{name}/{k}")
            assert_bit_equal(got["optim"]["sharded_master_weights"][i], _pad_chunk(ref_model[name], r, 4),
                             f"rank{r}/{name}/master")
