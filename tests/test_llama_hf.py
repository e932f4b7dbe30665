"""The demo model is a Llama: ``nxd-ckpt export`` of its TP=2 checkpoint loads with transformers'
``LlamaForCausalLM.from_pretrained`` (a local config.json beside the weights; nothing from a hub) and gives the
same logits as the demo model itself on the same tokens."""
from __future__ import annotations

import json

import pytest
import torch
from demo_runs import demo_rank, use_scripts
from harness import run_ranks

use_scripts()

transformers = pytest.importorskip("transformers")

# Grouped-query attention (4 heads, 2 KV heads) so the KV projections' split is exercised too.
MODEL = ["--zero1", "--tp", "2", "--layers", "2", "--hidden", "32", "--heads", "4", "--kv-heads", "2", "--ffn", "64",
         "--seq-len", "16", "--vocab", "48", "--steps", "2", "--ckpt-every", "2", "--log-every", "1", "--no-async"]


@pytest.mark.slow
def test_export_of_tp2_demo_checkpoint_loads_in_transformers_with_equal_logits(tmp_path):
    import train_demo
    from transformers import LlamaForCausalLM

    from nxd_ckpt.cli import main

    ckpt, hf, dump = tmp_path / "ckpt", tmp_path / "hf", tmp_path / "logits.pt"
    argv = MODEL + ["--ckpt-dir", str(ckpt), "--dump-logits", str(dump)]
    run_ranks(demo_rank, 2, argv, timeout=150)
    assert main(["export", str(ckpt / "step_2"), "--output", str(hf)]) == 0
    with open(hf / "config.json", "w") as f:
        json.dump(train_demo.llama_config(train_demo.parse_args(argv)), f)

    model = LlamaForCausalLM.from_pretrained(str(hf), local_files_only=True, attn_implementation="eager")
    got = dict(model.state_dict())
    from safetensors.torch import load_file

    exported = load_file(str(hf / "model.safetensors"))
    assert set(exported) == set(got), "every exported tensor is one of LlamaForCausalLM's, and none is missing"
    for k, v in exported.items():
        assert torch.equal(got[k], v), k     # from_pretrained took the bytes as they are

    ref = torch.load(dump, weights_only=True)
    with torch.no_grad():
        logits = model(ref["tokens"]).logits
    torch.testing.assert_close(logits, ref["logits"], rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_import_of_save_pretrained_checkpoint_gives_the_demo_the_same_logits(tmp_path):
    """A LlamaForCausalLM written by save_pretrained, brought in with `nxd-ckpt import --tp 2 --preset llama`, loads
    into the demo at TP=2 (and, resharded on load, at TP=1 x PP=2); its logits equal transformers'."""
    import train_demo
    from transformers import LlamaConfig, LlamaForCausalLM

    from nxd_ckpt.cli import main

    argv = [a for a in MODEL if a != "--zero1"]
    args = train_demo.parse_args(argv + ["--ckpt-dir", str(tmp_path)])
    torch.manual_seed(3)
    hf_model = LlamaForCausalLM(LlamaConfig(**train_demo.llama_config(args))).eval()
    hf_model.save_pretrained(str(tmp_path / "hf"))
    assert main(["import", str(tmp_path / "hf"), str(tmp_path / "imported" / "tag"), "--tp", "2",
                 "--preset", "llama"]) == 0
    for sizes in (["--tp", "2"], ["--tp", "1", "--pp", "2"]):
        dump = tmp_path / f"logits{'_'.join(sizes)}.pt"
        run_ranks(demo_rank, 2, argv + sizes + ["--steps", "0", "--ckpt-every", "0", "--no-resume",
                                                 "--ckpt-dir", str(tmp_path / "unused"),
                                                 "--init-model", str(tmp_path / "imported" / "tag"),
                                                 "--dump-logits", str(dump)], timeout=150)
        ref = torch.load(dump, weights_only=True)
        with torch.no_grad():
            logits = hf_model(ref["tokens"]).logits
        torch.testing.assert_close(ref["logits"], logits, rtol=1e-4, atol=1e-5)
