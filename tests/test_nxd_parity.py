"""NxD 2.29 parity of the entry points: signatures, top-level exports, tags without markers, s3:// URLs."""
from __future__ import annotations

import inspect
import logging
import os

import pytest
import torch

import nxd_ckpt
from nxd_ckpt import layout
from nxd_ckpt.cli import main as cli_main

from test_cli_fixtures import assert_bit_equal, small_model, write_tag

# NxD 2.29's parameters, as written in neuronx_distributed/trainer/checkpoint.py: (name, default); EMPTY: none.
EMPTY = inspect.Parameter.empty
NXD_SIGNATURES = {
    "save_checkpoint": [
        ("checkpoint_dir_str", EMPTY), ("tag", EMPTY), ("model", None), ("optimizer", None), ("scheduler", None),
        ("user_content", None), ("num_workers", 8), ("use_xser", False), ("num_kept_ckpts", None),
        ("async_save", False), ("zero1_optimizer", False), ("use_zero1_dcp", False),
        ("avoid_saving_lower_precision_weights", False),
    ],
    "load_checkpoint": [
        ("path", EMPTY), ("tag", None), ("model", None), ("optimizer", None), ("scheduler", None),
        ("num_workers", 8), ("strict", True), ("use_zero1_dcp", False),
    ],
    "finalize_checkpoint": [],
    "has_checkpoint": [("checkpoint_dir_str", EMPTY)],
}
# Ours after NxD's, keyword-only.
EXTRAS = {
    "save_checkpoint": {"host_memory_budget", "device_snapshot", "keep_host_buffers", "reuse_retired_files",
                        "timeout_s"},
    "load_checkpoint": {"ignore_keys", "trusted", "node_local", "reshard", "timeout_s"},
    "finalize_checkpoint": {"timeout_s"},
    "has_checkpoint": set(),
}


@pytest.mark.parametrize("name", sorted(NXD_SIGNATURES))
def test_signature_is_nxds_then_keyword_only_extras(name):
    params = list(inspect.signature(getattr(nxd_ckpt, name)).parameters.values())
    positional = [p for p in params if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD]
    assert [(p.name, p.default) for p in positional] == NXD_SIGNATURES[name]
    rest = params[len(positional):]
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in rest), [(p.name, p.kind) for p in rest]
    assert {p.name for p in rest} == EXTRAS[name]


def test_top_level_exports_nxds_names():
    # neuronx_distributed/__init__.py exports these four from trainer/checkpoint.py
    for name in ("save_checkpoint", "load_checkpoint", "finalize_checkpoint", "has_checkpoint"):
        assert name in nxd_ckpt.__all__ and callable(getattr(nxd_ckpt, name))


def test_nxd_positional_load_call(tmp_path):
    """NxD's own positional call (path, tag, model, optimizer, scheduler, num_workers, strict, use_zero1_dcp)."""
    root = str(tmp_path)
    state = small_model()
    nxd_ckpt.save_checkpoint(root, "t", state)
    target = {}
    assert nxd_ckpt.load_checkpoint(root, "t", target, None, None, 8, True, False) is None
    assert_bit_equal(target, state)


def test_default_is_plain_torch_save_as_nxd(tmp_path):
    root = str(tmp_path)
    nxd_ckpt.save_checkpoint(root, "t", model=small_model())
    model_dir = tmp_path / "t" / "model"
    assert sorted(os.listdir(model_dir)) == ["dp_rank_00_tp_rank_00_pp_rank_00.pt"]
    loaded = torch.load(model_dir / "dp_rank_00_tp_rank_00_pp_rank_00.pt", weights_only=True)
    assert_bit_equal(loaded, small_model())


# --- tags without markers -------------------------------------------------------------------------------------
def _hf_converted(root, tag, use_xser):
    """What NxD's checkpoint converter writes for pretrained weights: model/ shards only, no markers."""
    path = write_tag(root, tag, model={(0, 0): small_model()}, use_xser=use_xser, manifest=False, done=False,
                     newest=False)
    os.remove(os.path.join(path, layout.CHECKPOINT_MARKER))
    return path


@pytest.mark.parametrize("use_xser", [True, False], ids=["xser", "plain"])
def test_tag_without_markers_loads_with_explicit_tag(tmp_path, caplog, use_xser):
    root = str(tmp_path)
    _hf_converted(root, "pretrained", use_xser)
    target = {}
    with caplog.at_level(logging.INFO, logger="nxd_ckpt"):
        nxd_ckpt.load_checkpoint(root, "pretrained", model=target)
    assert_bit_equal(target, small_model())
    assert any("has no 'done' marker" in r.getMessage() and "pretrained" in r.getMessage() for r in caplog.records)
    # not a complete checkpoint: tag=None and has_checkpoint do not take it
    assert not nxd_ckpt.has_checkpoint(root)
    with pytest.raises(nxd_ckpt.CheckpointNotFoundError):
        nxd_ckpt.load_checkpoint(root, model={})


def test_converter_zero1_output_loads(tmp_path):
    """NxD's ZeRO-1 converter writes optim/ (and copies nothing else) with no markers."""
    from test_cli_fixtures import full_zero1_params, zero1_states

    root = str(tmp_path)
    states = zero1_states(full_zero1_params(), dp=1)
    path = write_tag(root, "conv", optim={(0, 0, 0): states[0]}, zero1=True, manifest=False, done=False,
                     newest=False)
    os.remove(os.path.join(path, layout.CHECKPOINT_MARKER))
    target = {}
    nxd_ckpt.load_checkpoint(root, "conv", optimizer=target)
    assert_bit_equal(target, states[0])


def test_interrupted_save_is_refused_with_the_reason(tmp_path):
    root = str(tmp_path)
    write_tag(root, "half", model={(0, 0): small_model()}, manifest=False, done=False, newest=False)
    with pytest.raises(nxd_ckpt.IncompleteCheckpointError, match="'checkpoint' marker but no 'done'.*interrupted"):
        nxd_ckpt.load_checkpoint(root, "half", model={})


def test_empty_directory_is_not_a_checkpoint(tmp_path):
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "notes.txt").write_text("x")
    with pytest.raises(nxd_ckpt.CheckpointNotFoundError, match="holds no checkpoint"):
        nxd_ckpt.load_checkpoint(str(tmp_path), "junk", model={})


# --- s3:// URLs ----------------------------------------------------------------------------------------------
URL = "s3://bucket/run1/ckpt"
OTHER_URL = "gs://bucket/run1/ckpt"
OTHER_MESSAGE = r"gs:// URL, which nxd-ckpt does not serve"


@pytest.mark.parametrize("call", [
    lambda: nxd_ckpt.has_checkpoint(OTHER_URL),
    lambda: nxd_ckpt.list_checkpoints(OTHER_URL),
    lambda: nxd_ckpt.newest_checkpoint(OTHER_URL),
    lambda: nxd_ckpt.load_checkpoint(OTHER_URL),
    lambda: nxd_ckpt.load_checkpoint(OTHER_URL, "step_1", model={}),
    lambda: nxd_ckpt.save_checkpoint(OTHER_URL, "step_1", model={"w": torch.ones(2)}),
], ids=["has", "list", "newest", "load", "load_tag", "save"])
def test_every_entry_point_refuses_other_urls_with_one_error(call):
    """s3:// works (tests/test_s3.py); any other scheme is refused before anything happens."""
    with pytest.raises(nxd_ckpt.CheckpointArgumentError, match=OTHER_MESSAGE):
        call()


# --- use_zero1_dcp argument rules ----------------------------------------------------------------------------
def test_use_zero1_dcp_rules(tmp_path):
    from test_cli_fixtures import full_zero1_params, zero1_states

    root = str(tmp_path)
    zero1 = zero1_states(full_zero1_params(), dp=1, masters=False)[0]
    with pytest.raises(nxd_ckpt.CheckpointArgumentError, match="needs async_save=True"):
        nxd_ckpt.save_checkpoint(root, "t", optimizer=zero1, zero1_optimizer=True, use_zero1_dcp=True)
    with pytest.raises(nxd_ckpt.CheckpointArgumentError, match="by parameter name: pass the nn.Module"):
        nxd_ckpt.save_checkpoint(root, "t", optimizer=zero1, zero1_optimizer=True, use_zero1_dcp=True,
                                 async_save=True)
    assert os.listdir(root) == []
    # a plain optimizer: the flag has no effect, as in NxD
    nxd_ckpt.save_checkpoint(root, "p", optimizer={"state": {}, "param_groups": []}, use_zero1_dcp=True)
    assert nxd_ckpt.list_checkpoints(root) == ["p"]
