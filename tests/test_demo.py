"""The demo scripts end to end: two torchrun "nodes" (scripts/launch_multinode.sh, 2 x 2 ranks, TP=2 x DP=2,
ZeRO-1) sharing one checkpoint directory are SIGKILLed while an async save is in flight; launched again they
resume from the newest complete checkpoint and end bit for bit where an uninterrupted run ends."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest
from demo_runs import SCRIPTS, demo_rank
from harness import run_ranks

LAUNCH = os.path.join(SCRIPTS, "launch_multinode.sh")

STEPS, EVERY, CRASH_AT = 6, 2, 4
# A smaller model than the demo's (1 layer): fewer XLA graphs to compile per rank, so the test stays short.
MODEL = ["--zero1", "--tp", "2", "--layers", "1", "--hidden", "32", "--ffn", "64", "--seq-len", "16",
         "--total-steps", str(STEPS), "--ckpt-every", str(EVERY), "--log-every", "1"]


def _launch(ckpt_dir, out, extra, timeout=150):
    cmd = ["bash", LAUNCH, "--steps", str(STEPS), "--ckpt-dir", str(ckpt_dir), "--out", str(out), "--", *extra]
    env = dict(os.environ, PYTHON=sys.executable, PJRT_DEVICE="CPU")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True, stdin=subprocess.DEVNULL)
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)   # the launcher forwards it to both torchrun agents
        try:
            output, _ = proc.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            output, _ = proc.communicate()
        pytest.fail(f"launch_multinode.sh did not finish within {timeout}s:\n{output[-4000:]}")
    return proc.returncode, output


def _load(path):
    with open(path) as f:
        return json.load(f)


def _complete(ckpt_dir):
    return sorted(t for t in os.listdir(ckpt_dir) if os.path.exists(os.path.join(ckpt_dir, t, "done")))


@pytest.mark.slow
def test_multinode_crash_resume_is_bit_exact(tmp_path):
    ckpt = tmp_path / "ckpt"

    # 1. two nodes, killed right after the async save of step 4 returned, while it is being written
    rc, out_a = _launch(ckpt, tmp_path / "a.json", MODEL + ["--crash-at-step", str(CRASH_AT),
                                                            "--crash-write-delay", "1"])
    assert rc != 0, f"the crash run should have died:\n{out_a[-3000:]}"
    a = _load(tmp_path / "a.json")
    assert a["crashed_at"] == CRASH_AT and a["crash_in_flight"], a
    assert a["world_size"] == 4 and a["dp"] == 2 and a["tp"] == 2
    assert _complete(ckpt) == ["step_2"], f"only step_2 may be complete after the crash: {os.listdir(ckpt)}"

    # 2. launched again: resumes by itself from the newest complete checkpoint and runs to the end
    rc, out_b = _launch(ckpt, tmp_path / "b.json", MODEL + ["--dump-final", str(tmp_path / "resumed")])
    assert rc == 0, out_b[-4000:]
    b = _load(tmp_path / "b.json")
    assert b["resumed_from"] == "step_2" and b["start_step"] == 3, (b["resumed_from"], b["start_step"])
    assert sorted(b["losses"], key=int) == [str(s) for s in range(3, STEPS + 1)]
    for s in ("3", "4"):   # steps run by both launches
        assert a["losses"][s] == b["losses"][s], f"step {s}: {a['losses'][s]!r} vs {b['losses'][s]!r}"
    assert _complete(ckpt) == ["step_2", "step_4", "step_6"], os.listdir(ckpt)
    assert not [n for n in os.listdir(ckpt) if n.endswith(".nxdtmp")], "crash debris left behind"

    # 3. the same training uninterrupted (4 ranks on one "node"), compared bit for bit
    ref_dir = tmp_path / "ref"
    run_ranks(demo_rank, 4, MODEL + ["--steps", str(STEPS), "--ckpt-dir", str(ref_dir),
                                           "--out", str(tmp_path / "ref.json"),
                                           "--dump-final", str(tmp_path / "reference")], timeout=150)
    ref = _load(tmp_path / "ref.json")
    assert {s: ref["losses"][s] for s in b["losses"]} == b["losses"]
    assert ref["rank_checksums"] == b["rank_checksums"], "final model/optimizer state differs from the uninterrupted run"

    import torch
    from tiny_models import assert_bit_equal

    for r in range(4):
        assert_bit_equal(torch.load(f"{tmp_path / 'reference'}.rank{r}.pt", weights_only=True),
                         torch.load(f"{tmp_path / 'resumed'}.rank{r}.pt", weights_only=True), f"rank{r}")


PP_MODEL = ["--zero1", "--tp", "2", "--pp", "2", "--layers", "2", "--hidden", "32", "--ffn", "64", "--seq-len", "16",
            "--total-steps", "4", "--ckpt-every", "2", "--log-every", "1"]


@pytest.mark.slow
def test_pipeline_stages_save_resume_and_export(tmp_path):
    """TP=2 x PP=2 on 4 ranks: each stage writes its own pp_rank file, a resumed run ends bit for bit where
    an uninterrupted one does, and export joins the stages into the full model's keys."""
    ckpt, ref_dir = tmp_path / "ckpt", tmp_path / "ref"
    run_ranks(demo_rank, 4, PP_MODEL + ["--steps", "2", "--ckpt-dir", str(ckpt)], timeout=150)
    model_files = sorted(os.listdir(ckpt / "step_2" / "model"))
    assert [f for f in model_files if f.endswith(".pt") and ".pt." not in f] == [
        f"dp_rank_00_tp_rank_{t:02d}_pp_rank_{p:02d}.pt" for t in range(2) for p in range(2)]
    run_ranks(demo_rank, 4, PP_MODEL + ["--steps", "4", "--ckpt-dir", str(ckpt), "--out",
                                              str(tmp_path / "b.json"), "--dump-final", str(tmp_path / "resumed")],
              timeout=150)
    b = _load(tmp_path / "b.json")
    assert b["resumed_from"] == "step_2" and b["pp"] == 2 and sorted(b["losses"], key=int) == ["3", "4"]
    run_ranks(demo_rank, 4, PP_MODEL + ["--steps", "4", "--ckpt-dir", str(ref_dir), "--out",
                                              str(tmp_path / "ref.json"), "--dump-final", str(tmp_path / "reference")],
              timeout=150)
    ref = _load(tmp_path / "ref.json")
    assert {s: ref["losses"][s] for s in b["losses"]} == b["losses"]
    assert ref["rank_checksums"] == b["rank_checksums"]

    from safetensors.torch import load_file

    from nxd_ckpt.cli import main

    assert main(["export", str(ckpt / "step_4"), "--output", str(tmp_path / "hf")]) == 0
    keys = set(load_file(str(tmp_path / "hf" / "model.safetensors")))
    assert {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight", "model.layers.0.self_attn.q_proj.weight",
            "model.layers.1.mlp.down_proj.weight"} <= keys
    assert not [k for k in keys if k.startswith("model.layers.2")]
