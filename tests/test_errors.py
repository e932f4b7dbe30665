"""Every argument and state error: the exception type, what its message says, and that nothing changed."""
from __future__ import annotations

import os

import pytest
import torch

from harness import run_ranks
from tiny_models import TinyShard, assert_bit_equal, to_cpu_state, train_steps, xla_device

import nxd_ckpt
from nxd_ckpt.testing import ZeroOneAdam


@pytest.fixture
def saved(tmp_path):
    """A directory with one complete checkpoint 'step_1' of a TinyShard + Adam + scheduler."""
    root = str(tmp_path / "ckpt")
    model = TinyShard()
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1)
    train_steps(model, opt, 1, seed=2)
    nxd_ckpt.save_checkpoint(root, "step_1", model=model, optimizer=opt, scheduler=sched, use_xser=True)
    return root, model, opt


@pytest.mark.parametrize("tag,needle", [("", "empty"), ("   ", "empty"), ("a/b", "'/'"), ("..", "'..'"),
                                        ("x/../y", "'/'"), ("a..b", "'..'"), (None, "must be a str"),
                                        (".", "is '.'"), ("newest", "reserves"), ("t.nxdtmp", "reserves"),
                                        ("t.nxdold", "reserves")])
def test_bad_tags_refused_before_writing(tmp_path, tag, needle):
    root = tmp_path / "ckpt"
    with pytest.raises(nxd_ckpt.CheckpointArgumentError, match=None) as e:
        nxd_ckpt.save_checkpoint(str(root), tag, model=TinyShard(), use_xser=True)
    assert needle in str(e.value)
    assert not root.exists()


@pytest.mark.parametrize("kwargs,needle", [
    ({"num_workers": 0}, "num_workers must be an int from 1 to 64"),
    ({"num_kept_ckpts": 0}, "num_kept_ckpts must be None or -1"),
    ({"use_xser": "yes"}, "use_xser must be True or False"),
    ({"model": 3}, "model must be a torch.nn.Module or a state dict"),
    ({"optimizer": 3}, "optimizer must be a torch optimizer"),
    ({"scheduler": object()}, "scheduler must have state_dict()"),
    ({"zero1_optimizer": True}, "zero1_optimizer=True needs an optimizer"),
])
def test_bad_arguments_refused_before_writing(tmp_path, kwargs, needle):
    root = tmp_path / "ckpt"
    args = {"model": TinyShard()}
    args.update(kwargs)
    with pytest.raises(nxd_ckpt.CheckpointArgumentError) as e:
        nxd_ckpt.save_checkpoint(str(root), "t", **args)
    assert needle in str(e.value)
    assert not root.exists()


def test_checkpoint_dir_that_is_a_file(tmp_path):
    f = tmp_path / "afile"
    f.write_text("x")
    with pytest.raises(nxd_ckpt.CheckpointArgumentError, match="exists and is not a directory"):
        nxd_ckpt.save_checkpoint(str(f), "t", model=TinyShard(), use_xser=True)


def test_no_complete_checkpoint(tmp_path):
    (tmp_path / "ckpt" / "half").mkdir(parents=True)
    (tmp_path / "ckpt" / "half" / "checkpoint").write_text("1")
    with pytest.raises(nxd_ckpt.CheckpointNotFoundError, match="no complete checkpoint"):
        nxd_ckpt.load_checkpoint(str(tmp_path / "ckpt"), model=TinyShard())
    with pytest.raises(nxd_ckpt.CheckpointNotFoundError, match="does not exist"):
        nxd_ckpt.load_checkpoint(str(tmp_path / "nowhere"), model=TinyShard())


def test_tag_not_found_lists_available(saved):
    root, _, _ = saved
    with pytest.raises(nxd_ckpt.CheckpointNotFoundError) as e:
        nxd_ckpt.load_checkpoint(root, tag="step_9", model=TinyShard())
    assert "step_9" in str(e.value) and "['step_1']" in str(e.value)


def test_incomplete_tag_is_named(saved):
    root, _, _ = saved
    os.makedirs(os.path.join(root, "step_2", "model"))
    open(os.path.join(root, "step_2", "checkpoint"), "w").write("1")
    with pytest.raises(nxd_ckpt.IncompleteCheckpointError, match="no 'done' marker"):
        nxd_ckpt.load_checkpoint(root, tag="step_2", model=TinyShard())


def test_bad_tag_on_load(saved):
    root, _, _ = saved
    with pytest.raises(nxd_ckpt.CheckpointArgumentError, match="'/'"):
        nxd_ckpt.load_checkpoint(root, tag="../etc", model=TinyShard())


class Bigger(TinyShard):
    def __init__(self, **kw):
        super().__init__(**kw)
        self.extra = torch.nn.Parameter(torch.zeros(3).to(xla_device()))


def test_strict_key_mismatch_lists_keys_and_changes_nothing(saved):
    root, _, _ = saved
    target = Bigger(seed_offset=9)
    before = to_cpu_state(target.state_dict())
    with pytest.raises(nxd_ckpt.StateMismatchError) as e:
        nxd_ckpt.load_checkpoint(root, model=target)
    assert "missing from checkpoint: ['extra']" in str(e.value) and "unexpected in checkpoint: none" in str(e.value)
    assert_bit_equal(before, to_cpu_state(target.state_dict()))
    nxd_ckpt.load_checkpoint(root, model=target, strict=False)   # the overlap loads
    nxd_ckpt.load_checkpoint(root, model=target, ignore_keys=["model/extra"])


def test_shape_mismatch_is_named_and_changes_nothing(saved):
    root, _, _ = saved
    target = TinyShard(seed_offset=9)
    target.bias = torch.nn.Parameter(torch.zeros(5).to(xla_device()))   # same keys, bias of another size
    before = to_cpu_state(target.state_dict())
    for strict in (True, False):
        with pytest.raises(nxd_ckpt.StateMismatchError) as e:
            nxd_ckpt.load_checkpoint(root, model=target, strict=strict)
        assert "shapes do not match the model for 1 key(s): bias: checkpoint (8,), model (5,)" in str(e.value)
        assert "ignore_keys=['model/<key>']" in str(e.value)
        assert_bit_equal(before, to_cpu_state(target.state_dict()))      # `up` and `down` were not copied
    nxd_ckpt.load_checkpoint(root, model=target, ignore_keys=["model/bias"])
    assert target.bias.shape == (5,)


def test_shape_check_follows_what_load_state_dict_accepts():
    """Only the shapes nn.Module's loading insists on are checked: not lazy parameters, not modules that
    resize their own state on load (fake-quantizers), not the (1,) -> 0-d case torch accepts."""
    from torch.ao.quantization import FakeQuantize

    from nxd_ckpt.loader import check_model

    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4), FakeQuantize())
    sd = dict(model.state_dict())
    sd["2.scale"] = torch.ones(5)                                         # a per-channel qparam, resized on load
    sd["1.num_batches_tracked"] = torch.zeros(1, dtype=torch.long)        # old checkpoints: (1,) into 0-d
    check_model(model, sd, True, [])
    model.load_state_dict(sd)                                             # torch agrees
    check_model(torch.nn.Sequential(torch.nn.LazyLinear(4)), {"0.weight": torch.ones(4, 3), "0.bias": torch.ones(4)},
                True, [])
    for key, bad in (("0.weight", torch.ones(5, 3)), ("1.running_mean", torch.ones(3))):
        with pytest.raises(nxd_ckpt.StateMismatchError) as e:
            check_model(model, dict(sd, **{key: bad}), False, [])
        assert f"{key}: checkpoint {tuple(bad.shape)}" in str(e.value)


def test_a_dict_model_is_checked_under_strict(saved):
    root, model, _ = saved
    target = {"up": torch.zeros(8, 8), "extra": torch.zeros(1)}
    with pytest.raises(nxd_ckpt.StateMismatchError) as e:
        nxd_ckpt.load_checkpoint(root, model=target)
    assert "missing from checkpoint: ['extra']" in str(e.value)
    assert "unexpected in checkpoint: ['bias', 'down', 'steps_seen']" in str(e.value)
    assert sorted(target) == ["extra", "up"] and torch.count_nonzero(target["up"]) == 0
    nxd_ckpt.load_checkpoint(root, model=target, strict=False)            # the overlap loads, extra stays
    assert sorted(target) == ["bias", "down", "extra", "steps_seen", "up"]
    assert torch.equal(target["up"], model.up.detach().cpu())
    with pytest.raises(nxd_ckpt.StateMismatchError, match="up: checkpoint \\(8, 8\\), model \\(2, 2\\)"):
        nxd_ckpt.load_checkpoint(root, model={"up": torch.zeros(2, 2)}, ignore_keys=["model/[bds]*"])
    whole = {}
    nxd_ckpt.load_checkpoint(root, model=whole)                            # an empty dict takes everything
    assert sorted(whole) == ["bias", "down", "steps_seen", "up"]


def test_ignore_keys_glob_and_callable(saved):
    root, model, _ = saved
    target = TinyShard(seed_offset=9)
    keep_bias = target.bias.detach().cpu().clone()
    nxd_ckpt.load_checkpoint(root, model=target, ignore_keys="model/bias")
    assert torch.equal(target.bias.detach().cpu(), keep_bias)
    assert torch.equal(target.up.detach().cpu(), model.up.detach().cpu())

    def edit(state):
        state["model"]["up"] = state["model"]["up"] * 0
        return state

    nxd_ckpt.load_checkpoint(root, model=target, ignore_keys=edit)
    assert torch.count_nonzero(target.up.detach().cpu()) == 0
    opt = torch.optim.Adam(target.parameters(), lr=0.3)
    nxd_ckpt.load_checkpoint(root, model=target, optimizer=opt, ignore_keys=["optim/state"], strict=True)
    assert opt.state_dict()["state"] == {} and opt.param_groups[0]["lr"] == 0.1


def test_optimizer_type_mismatch_both_ways(tmp_path, saved):
    root, _, _ = saved
    model = TinyShard()
    zero = ZeroOneAdam(model.parameters())
    with pytest.raises(nxd_ckpt.StateMismatchError, match="plain .*optimizer state but the optimizer is ZeRO-1"):
        nxd_ckpt.load_checkpoint(root, model=model, optimizer=zero)
    zroot = str(tmp_path / "z")
    nxd_ckpt.save_checkpoint(zroot, "z1", model=model, optimizer=zero, use_xser=True)
    plain = torch.optim.Adam(model.parameters())
    with pytest.raises(nxd_ckpt.StateMismatchError, match="holds ZeRO-1 .* load it into a ZeRO-1 optimizer"):
        nxd_ckpt.load_checkpoint(zroot, model=model, optimizer=plain)
    assert plain.state_dict()["state"] == {}


def test_a_merged_zero1_state_names_the_way_back(tmp_path):
    from nxd_ckpt.cli import main

    root = str(tmp_path / "z")
    model = TinyShard()
    nxd_ckpt.save_checkpoint(root, "z1", model=model, optimizer=ZeroOneAdam(model.parameters()), use_xser=True)
    assert main(["convert-zero1", "--input_dir", os.path.join(root, "z1"), "--output_dir",
                 os.path.join(root, "full"), "--convert_to_full"]) == 0
    zero = ZeroOneAdam(model.parameters())
    with pytest.raises(nxd_ckpt.StateMismatchError) as e:
        nxd_ckpt.load_checkpoint(root, "full", model=model, optimizer=zero)
    assert "merged (full) ZeRO-1 optimizer state" in str(e.value)
    assert "--input_dir <dir>/full --output_dir <dir>/<new_tag> --convert_to_sharded --dp_size <DP>" in str(e.value)


def test_missing_scheduler_file(tmp_path):
    root = str(tmp_path / "c")
    model = TinyShard()
    nxd_ckpt.save_checkpoint(root, "a", model=model, use_xser=True)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    with pytest.raises(nxd_ckpt.StateMismatchError, match="has no scheduler.pt"):
        nxd_ckpt.load_checkpoint(root, model=model, scheduler=torch.optim.lr_scheduler.StepLR(opt, 1))


def test_unsafe_user_content_needs_trusted(tmp_path):
    root = str(tmp_path / "c")

    from tiny_models import Note

    content = {"note": Note("hi")}   # a class outside weights_only's allowlist
    nxd_ckpt.save_checkpoint(root, "a", model=TinyShard(), user_content=content, use_xser=True)
    with pytest.raises(nxd_ckpt.UnsafeCheckpointError) as e:
        nxd_ckpt.load_checkpoint(root, model=TinyShard())
    assert isinstance(e.value, nxd_ckpt.CheckpointError)
    assert "trusted=True" in str(e.value) and "user_content.pt" in str(e.value)
    assert "tiny_models.Note" in str(e.value)
    assert nxd_ckpt.load_checkpoint(root, model=TinyShard(), trusted=True) == content


def test_unpicklable_user_content_refused_before_writing(tmp_path):
    root = tmp_path / "c"
    with pytest.raises(Exception, match="pickle"):
        nxd_ckpt.save_checkpoint(str(root), "a", model=TinyShard(), user_content={"f": lambda: 1}, use_xser=True)
    assert not (root / "a").exists()


# ---- topology mismatch (multi-rank) -------------------------------------------------------------------
def _save_tp2(rank, world, root):
    import parallel_state as ps

    ps.initialize_model_parallel(tensor_model_parallel_size=2)
    model = TinyShard(ps.get_tensor_model_parallel_rank())
    opt = ZeroOneAdam(model.parameters(), dp_group=ps.get_data_parallel_host_group(),
                      dp_rank=ps.get_data_parallel_rank(), dp_size=ps.get_data_parallel_size())
    nxd_ckpt.save_checkpoint(root, "s", model=model, optimizer=opt, use_xser=True)
    return True


def _load_tp4(rank, world, root):
    import parallel_state as ps

    ps.initialize_model_parallel(tensor_model_parallel_size=4)
    model = TinyShard(ps.get_tensor_model_parallel_rank())
    try:
        nxd_ckpt.load_checkpoint(root, model=model, reshard=False)
    except nxd_ckpt.TopologyMismatchError as exc:
        return str(exc)
    return None


def _load_dp2_zero1(rank, world, root):
    import parallel_state as ps

    ps.initialize_model_parallel(tensor_model_parallel_size=2)
    model = TinyShard(ps.get_tensor_model_parallel_rank())
    opt = ZeroOneAdam(model.parameters(), dp_group=ps.get_data_parallel_host_group(),
                      dp_rank=ps.get_data_parallel_rank(), dp_size=ps.get_data_parallel_size())
    try:
        nxd_ckpt.load_checkpoint(root, model=model, optimizer=opt, reshard=False)
    except nxd_ckpt.TopologyMismatchError as exc:
        return str(exc)
    return None


def test_topology_mismatch_names_both_and_the_tool(tmp_path):
    root = str(tmp_path / "ckpt")
    run_ranks(_save_tp2, 8, root, timeout=120)          # TP=2 PP=1 DP=4, ZeRO-1
    msgs = run_ranks(_load_tp4, 8, root, timeout=120)   # TP=4 DP=2
    for m in msgs:
        assert m is not None
        assert "saved at TP=2 PP=1 DP=4" in m and "runs TP=4 PP=1 DP=2" in m and "TP differs" in m
        assert "`nxd-ckpt export <dir>/s --output <hf_dir>`" in m and "reshard=True" in m
    msgs = run_ranks(_load_dp2_zero1, 4, root, timeout=120)   # TP=2 DP=2: model fits, ZeRO-1 state does not
    for m in msgs:
        assert m is not None and "DP differs" in m and "nxd-ckpt convert-zero1" in m and "--dp_size 2" in m
        assert "reshard=True" in m
