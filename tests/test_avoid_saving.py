"""avoid_saving_lower_precision_weights=True as neuronx-distributed does it: with ZeRO-1 master weights the
model's tensor files are not written, and loading restores the parameters from the master weights."""
from __future__ import annotations

import json
import logging
import os

import pytest
import torch

import nxd_ckpt
from harness import run_ranks
from nxd_ckpt.cli import main as cli_main
from test_cli_fixtures import upload, write_tag, zero1_states
from tiny_models import TinyShard, all_files, assert_bit_equal, to_cpu_state, train_steps


def _rank(rank, world, root, tp):
    import parallel_state as ps

    from nxd_ckpt.testing import ZeroOneAdam

    ps.initialize_model_parallel(tensor_model_parallel_size=tp)
    dp_rank, dp_size = ps.get_data_parallel_rank(), ps.get_data_parallel_size()
    tp_rank = ps.get_tensor_model_parallel_rank()

    def build(offset):
        model = TinyShard(tp_rank=tp_rank, hidden=6, seed_offset=offset).to(torch.bfloat16)
        return model, ZeroOneAdam(model.parameters(), dp_group=ps.get_data_parallel_host_group(),
                                  dp_rank=dp_rank, dp_size=dp_size)

    model, opt = build(0)
    train_steps(model, opt, 2, seed=5, dp_rank=dp_rank)
    nxd_ckpt.save_checkpoint(root, "s", model=model, optimizer=opt, use_xser=True,
                             avoid_saving_lower_precision_weights=True)
    want_model, want_opt = to_cpu_state(model.state_dict()), to_cpu_state(opt.state_dict())
    fresh, fresh_opt = build(7)
    nxd_ckpt.load_checkpoint(root, "s", model=fresh, optimizer=fresh_opt)
    assert_bit_equal(want_model, to_cpu_state(fresh.state_dict()), "model+optimizer")
    assert_bit_equal(want_opt, to_cpu_state(fresh_opt.state_dict()), "optimizer")
    alone, _ = build(9)          # the model alone: restored from the master weights by the loader
    nxd_ckpt.load_checkpoint(root, "s", model=alone)
    assert_bit_equal(want_model, to_cpu_state(alone.state_dict()), "model alone")
    empty = {}
    nxd_ckpt.load_checkpoint(root, "s", model=empty)
    assert_bit_equal(want_model, to_cpu_state(empty), "dict")
    return want_model


def test_tp2_dp2_round_trip_and_exact_files(tmp_path):
    root = str(tmp_path / "ck")
    models = run_ranks(_rank, 4, root, 2, timeout=240)
    want = {"newest", "s/checkpoint", "s/done", "s/manifest.json"}
    for t in range(2):
        base = f"s/model/dp_rank_00_tp_rank_{t:02d}_pp_rank_00.pt"
        # up, down, bias come from the master weights; steps_seen (a buffer, tid 3) has none
        want |= {base, base + ".info.pt", base + ".tensors/tensor_3.pt"}
        for d in range(2):
            o = f"s/optim/dp_rank_{d:02d}_tp_rank_{t:02d}_pp_rank_00.pt"
            want |= {o, o + ".info.pt"} | {f"{o}.tensors/tensor_{i}.pt" for i in range(12)}
    assert all_files(root) == want
    man = json.load(open(os.path.join(root, "s", "manifest.json")))
    assert man["model_from_master_weights"] is True
    meta = man["tensors"]["model/dp_rank_00_tp_rank_00_pp_rank_00.pt"]
    assert {meta[t]["key"]: meta[t].get("zero1_index") for t in meta} == {
        "up": 0, "down": 1, "bias": 2, "steps_seen": None}
    # the tools: verify passes, ls/info say where the weights are, export builds them from the master weights
    assert cli_main(["verify", root]) == 0
    assert cli_main(["ls", root, "--json"]) == 0
    out = tmp_path / "hf"
    # (TinyShard's bias differs per TP rank without partition attributes: say how to join it)
    assert cli_main(["export", os.path.join(root, "s"), "--output", str(out), "--partition", "bias=0"]) == 0
    from safetensors.torch import load_file

    got = load_file(str(out / "model.safetensors"))
    assert_bit_equal(torch.cat([models[0]["up"], models[1]["up"]], 0), got["up"], "export up")
    assert_bit_equal(torch.cat([models[0]["down"], models[1]["down"]], 1), got["down"], "export down")
    assert_bit_equal(torch.cat([models[0]["bias"], models[1]["bias"]]), got["bias"], "export bias")


def _nxd_avoid_tag(root, dp=2):
    """What NxD writes with avoid_saving_lower_precision_weights=True (no manifest): model ref + info, no
    tensor files; ZeRO-1 optimizer shards with sharded_master_weights."""
    g = torch.Generator().manual_seed(3)
    full = {0: {"master": torch.randn(5, 3, generator=g)}, 1: {"master": torch.randn(3, generator=g)}}
    for v in full.values():
        v["exp_avg"] = torch.randn(v["master"].shape, generator=g)
        v["exp_avg_sq"] = torch.randn(v["master"].shape, generator=g).abs()
    model = {"w": full[0]["master"].to(torch.bfloat16), "b": full[1]["master"].to(torch.bfloat16)}
    states = zero1_states(full, dp)
    path = write_tag(root, "nxd", model={(0, 0): model}, optim={(d, 0, 0): s for d, s in enumerate(states)},
                     zero1=True, manifest=False, newest=False)
    tensors = os.path.join(path, "model", "dp_rank_00_tp_rank_00_pp_rank_00.pt.tensors")
    for name in os.listdir(tensors):
        os.remove(os.path.join(tensors, name))
    return path, model


def test_nxd_avoid_saving_checkpoint_loads_the_model_from_master_weights(tmp_path):
    path, model = _nxd_avoid_tag(str(tmp_path))
    target = {"w": torch.zeros(5, 3, dtype=torch.bfloat16), "b": torch.zeros(3, dtype=torch.bfloat16)}
    nxd_ckpt.load_checkpoint(str(tmp_path), "nxd", model=target)   # saved at DP=2, loaded by one process
    assert_bit_equal(model, target, "model")
    assert cli_main(["verify", path]) == 0
    out = tmp_path / "hf"
    assert cli_main(["export", path, "--output", str(out)]) == 0
    from safetensors.torch import load_file

    assert_bit_equal(model, load_file(str(out / "model.safetensors")), "export")


def test_nxd_avoid_saving_checkpoint_on_an_object_store_loads_from_master_weights(tmp_path):
    """No manifest on an object store either: the layout is recognized through Storage listings alone."""
    from nxd_ckpt.storage.testing import enable_test_schemes

    enable_test_schemes()
    _nxd_avoid_tag(str(tmp_path / "local"))
    url = upload(str(tmp_path / "local"), f"objdir://{tmp_path}/bucket//ckpt")
    target = {"w": torch.zeros(5, 3, dtype=torch.bfloat16), "b": torch.zeros(3, dtype=torch.bfloat16)}
    nxd_ckpt.load_checkpoint(url, "nxd", model=target)
    _, model = _nxd_avoid_tag(str(tmp_path / "again"))      # the same seed: the same weights
    assert_bit_equal(model, target, "model")


def test_nxd_avoid_saving_without_masters_is_damage(tmp_path):
    path, _ = _nxd_avoid_tag(str(tmp_path), dp=1)
    opt = os.path.join(path, "optim", "dp_rank_00_tp_rank_00_pp_rank_00.pt")
    ref = torch.load(opt, weights_only=False)
    del ref["sharded_master_weights"]
    torch.save(ref, opt)
    with pytest.raises(nxd_ckpt.CorruptCheckpointError, match="has no 'sharded_master_weights'"):
        nxd_ckpt.load_checkpoint(str(tmp_path), "nxd", model={})


def test_without_master_weights_the_model_is_saved_in_full(tmp_path, caplog):
    from nxd_ckpt.testing import ZeroOneAdam

    model = TinyShard(device="cpu")
    opt = ZeroOneAdam(model.parameters(), save_master_weights=False)
    with caplog.at_level(logging.INFO, logger="nxd_ckpt"):
        nxd_ckpt.save_checkpoint(str(tmp_path), "s", model=model, optimizer=opt, use_xser=True,
                                 avoid_saving_lower_precision_weights=True)
    assert any("holds no ZeRO-1 master weights" in r.getMessage() for r in caplog.records)
    names = os.listdir(tmp_path / "s" / "model" / "dp_rank_00_tp_rank_00_pp_rank_00.pt.tensors")
    assert sorted(names) == [f"tensor_{i}.pt" for i in range(4)]
    assert json.load(open(tmp_path / "s" / "manifest.json"))["model_from_master_weights"] is False


def test_with_use_zero1_dcp_is_refused_as_nxd(tmp_path):
    with pytest.raises(nxd_ckpt.CheckpointArgumentError, match="cannot be combined"):
        nxd_ckpt.save_checkpoint(str(tmp_path), "s", model={"w": torch.ones(2)}, optimizer={}, async_save=True,
                                 use_zero1_dcp=True, avoid_saving_lower_precision_weights=True)
    assert not os.listdir(tmp_path)


def test_single_process_round_trip_and_tools_say_where_the_weights_are(tmp_path, capsys):
    from nxd_ckpt.testing import ZeroOneAdam

    model = TinyShard(device="cpu")
    opt = ZeroOneAdam(model.parameters())
    train_steps(model, opt, 1, seed=2)
    nxd_ckpt.save_checkpoint(str(tmp_path), "s", model=model, optimizer=opt, use_xser=True,
                             avoid_saving_lower_precision_weights=True)
    tensors = tmp_path / "s" / "model" / "dp_rank_00_tp_rank_00_pp_rank_00.pt.tensors"
    assert sorted(os.listdir(tensors)) == ["tensor_3.pt"]          # the buffer only
    fresh = TinyShard(device="cpu", seed_offset=4)
    nxd_ckpt.load_checkpoint(str(tmp_path), "s", model=fresh)
    assert_bit_equal(to_cpu_state(model.state_dict()), to_cpu_state(fresh.state_dict()), "model")
    capsys.readouterr()
    assert cli_main(["info", str(tmp_path / "s")]) == 0
    assert "weights kept only as ZeRO-1 master weights" in capsys.readouterr().out
    assert cli_main(["ls", str(tmp_path)]) == 0
    assert "s: model weights kept only as ZeRO-1 master weights" in capsys.readouterr().out


def test_convert_zero1_keeps_the_model_in_the_master_weights(tmp_path):
    """convert-zero1 of an avoid_saving checkpoint: the converted tag still says where the model's weights are."""
    from nxd_ckpt.testing import ZeroOneAdam

    model = TinyShard(device="cpu")
    opt = ZeroOneAdam(model.parameters())
    train_steps(model, opt, 1, seed=2)
    nxd_ckpt.save_checkpoint(str(tmp_path), "s", model=model, optimizer=opt, use_xser=True,
                             avoid_saving_lower_precision_weights=True)
    assert cli_main(["convert-zero1", "--input_dir", str(tmp_path / "s"), "--output_dir", str(tmp_path / "s2"),
                     "--convert_to_sharded", "--dp_size", "2"]) == 0
    assert json.load(open(tmp_path / "s2" / "manifest.json"))["model_from_master_weights"] is True
    fresh = TinyShard(device="cpu", seed_offset=4)
    nxd_ckpt.load_checkpoint(str(tmp_path), "s2", model=fresh)     # the model from the DP=2 master weights
    assert_bit_equal(to_cpu_state(model.state_dict()), to_cpu_state(fresh.state_dict()), "model")
    assert cli_main(["verify", str(tmp_path / "s2")]) == 0


def test_keys_by_order_knows_nxds_weight_decay_split_and_refuses_to_guess():
    from nxd_ckpt import masters

    keys_shapes = [("a.weight", (4, 2)), ("a.bias", (4,)), ("b.weight", (3, 2)), ("b.bias", (3,))]
    split = {0: (4, 2), 1: (3, 2), 2: (4,), 3: (3,)}   # NxD's groups: weights, then biases/norms
    want = {"a.weight": 0, "b.weight": 1, "a.bias": 2, "b.bias": 3}
    assert masters.keys_by_order(keys_shapes, split, [2, 2]) == want
    assert masters.keys_by_order(keys_shapes, split) == want          # group sizes unknown: the one order that fits
    assert masters.keys_by_order(keys_shapes, split, [4]) is None      # one group: the model order does not fit
    model_order = {i: s for i, (_, s) in enumerate(keys_shapes)}
    assert masters.keys_by_order(keys_shapes, model_order) == {k: i for i, (k, _) in enumerate(keys_shapes)}
    same = [("w1", (2, 2)), ("norm1", (2, 2)), ("w2", (2, 2))]
    both_fit = {i: (2, 2) for i in range(3)}
    assert masters.keys_by_order(same, both_fit) is None               # two different orders fit: a guess
    assert masters.keys_by_order(same, both_fit, [3]) == {"w1": 0, "norm1": 1, "w2": 2}
    assert masters.keys_by_order(same, both_fit, [2, 1]) == {"w1": 0, "w2": 1, "norm1": 2}
