"""nxd-ckpt ls / info / --help, and one end-to-end run over a checkpoint written by save_checkpoint."""
from __future__ import annotations

import json
import os

import pytest
import torch

from nxd_ckpt.cli import main
from test_cli_fixtures import write_tag, zero1_tag


class Opaque:
    """User content a safe (weights_only) load refuses."""

    def __init__(self, x):
        self.x = x


def _json(capsys, *argv):
    assert main(list(argv)) == 0
    return json.loads(capsys.readouterr().out)


def test_ls_json_shows_status_and_topology(tmp_path, capsys):
    root = str(tmp_path)
    zero1_tag(root, "step_4", dp=4, tp=2)
    write_tag(root, "step_2", model={(0, 0): {"w": torch.ones(3)}}, done=False)
    write_tag(root, "step_1", model={(t, p): {"w": torch.ones(3)} for t in range(2) for p in range(3)},
                    manifest=False)
    bad = write_tag(root, "step_3", model={(0, 0): {"w": torch.ones(300)}})
    os.truncate(os.path.join(bad, "model/dp_rank_00_tp_rank_00_pp_rank_00.pt.tensors/tensor_0.pt"), 10)
    rows = {r["tag"]: r for r in _json(capsys, "ls", root, "--json")}
    assert set(rows) == {"step_1", "step_2", "step_3", "step_4"}
    r = rows["step_4"]
    assert (r["status"], r["tp"], r["pp"], r["dp"], r["zero1"], r["xser"]) == ("complete", 2, 1, 4, True, True)
    assert r["files"] > 0 and r["size"] > 0 and r["written_at"]
    assert rows["step_2"]["status"] == "incomplete"
    assert rows["step_3"]["status"] == "damaged" and "tensor_0.pt" in rows["step_3"]["problem"]
    n = rows["step_1"]
    assert (n["status"], n["format"], n["tp"], n["pp"], n["dp"], n["zero1"]) == (
        "complete", "neuronx-distributed", 2, 3, None, False)
    assert main(["ls", root]) == 0
    text = capsys.readouterr().out
    assert text.splitlines()[0].split()[:3] == ["TAG", "STATUS", "SIZE"] and "damaged" in text


def test_info_json(tmp_path, capsys):
    path, _ = zero1_tag(str(tmp_path), "step_4", dp=2, tp=2)
    d = _json(capsys, "info", path, "--json")
    assert d["topology"]["tp"] == 2 and d["topology"]["dp"] == 2 and d["zero1"] and d["xser"]
    assert len(d["shards"]) == 2 + 4
    # 6 params x (step, exp_avg, exp_avg_sq, master) per optim shard + 2 model tensors per model shard
    assert d["tensor_count"] == 4 * 24 + 2 * 2
    assert d["dtypes"]["float32"]["count"] == d["tensor_count"]
    assert d["scheduler"]["keys"] == ["last_epoch", "base_lrs"] and d["user_content"]["keys"] == ["step"]
    assert "tensors" not in d
    d = _json(capsys, "info", path, "--tensors", "--json")
    names = {(t["shard"], t["key"]) for t in d["tensors"]}
    assert ("model/dp_rank_00_tp_rank_01_pp_rank_00.pt", "w") in names
    assert ("optim/dp_rank_01_tp_rank_00_pp_rank_00.pt", "sharded_master_weights/0") in names
    w = next(t for t in d["tensors"] if t["key"] == "w")
    assert w["shape"] == [4, 4] and w["dtype"] == "float32"


def test_info_nxd_and_untrusted_user_content(tmp_path, capsys):
    path = write_tag(str(tmp_path), "t", model={(0, 0): {"a": torch.ones(2, 3, dtype=torch.bfloat16), "n": 3}},
                     manifest=False, user_content=Opaque(1), scheduler={"last_epoch": 2})
    d = _json(capsys, "info", path, "--json", "--tensors")
    assert d["format"] == "neuronx-distributed" and d["tensor_count"] == 1
    assert d["dtypes"] == {"bfloat16": {"count": 1, "bytes": 12}}
    assert d["tensors"][0]["shape"] == [2, 3]
    assert "not inspectable without --trusted" in d["user_content"]["error"]
    d = _json(capsys, "info", path, "--json", "--trusted")
    assert d["user_content"]["type"] == "Opaque"
    assert main(["info", path]) == 0
    assert "not inspectable without --trusted" in capsys.readouterr().out


def test_info_missing_tag(tmp_path, capsys):
    assert main(["info", str(tmp_path / "nope")]) == 1
    assert capsys.readouterr().err.startswith("nxd-ckpt: error:")
    assert main(["ls", str(tmp_path / "nope")]) == 1


@pytest.mark.parametrize("cmd", ["ls", "info", "verify", "convert-zero1", "export"])
def test_help_has_examples(cmd, capsys):
    assert main([cmd, "--help"]) == 0
    out = capsys.readouterr().out
    assert "example" in out and f"nxd-ckpt {cmd}" in out


def test_top_level_help_and_version(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for cmd in ("ls", "info", "verify", "convert-zero1", "export"):
        assert cmd in out
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.startswith("nxd-ckpt ")
    assert main(["frobnicate"]) == 2


def test_end_to_end_with_save_checkpoint(tmp_path, capsys):
    """save_checkpoint (one process) -> ls/info/verify -> convert-zero1 -> export."""
    import nxd_ckpt
    from safetensors.torch import load_file
    from test_cli_fixtures import full_zero1_params, zero1_states

    root = str(tmp_path / "ck")
    model = torch.nn.Linear(4, 3)
    full = full_zero1_params()
    nxd_ckpt.save_checkpoint(root, "step_1", model=model, optimizer=zero1_states(full, 1)[0],
                             zero1_optimizer=True, user_content={"step": 1}, use_xser=True)
    rows = _json(capsys, "ls", root, "--json")
    assert rows[0]["tag"] == "step_1" and rows[0]["status"] == "complete" and rows[0]["dp"] == 1
    assert main(["verify", root]) == 0
    capsys.readouterr()
    assert main(["convert-zero1", "--input_dir", os.path.join(root, "step_1"), "--output_dir",
                 os.path.join(root, "step_1_dp2"), "--convert_to_sharded", "--dp_size", "2"]) == 0
    assert main(["verify", root]) == 0
    capsys.readouterr()
    out = str(tmp_path / "hf")
    assert main(["export", os.path.join(root, "step_1_dp2"), "--output", out]) == 0
    got = load_file(os.path.join(out, "model.safetensors"))
    for k, v in model.state_dict().items():
        assert torch.equal(got[k], v)


_NO_XLA = """
import sys
sys.modules["torch_xla"] = None          # any `import torch_xla` now raises ImportError
from nxd_ckpt.cli import main
rc = main(sys.argv[1:])
assert "torch_xla" not in [m for m in sys.modules if sys.modules[m] is not None], "torch_xla was imported"
sys.exit(rc)
"""


def test_every_tool_runs_without_torch_xla(tmp_path):
    import subprocess
    import sys

    root = str(tmp_path / "ck")
    tag = zero1_tag(root, "step_1", dp=2, tp=2)[0]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    runs = [["ls", root], ["info", tag, "--tensors"], ["verify", root],
            ["convert-zero1", "--input_dir", tag, "--output_dir", str(tmp_path / "dp1"), "--convert_to_sharded",
             "--dp_size", "1"],
            ["export", tag, "--output", str(tmp_path / "hf"), "--partition", "*=0"]]
    for argv in runs:
        res = subprocess.run([sys.executable, "-c", _NO_XLA, *argv], capture_output=True, text=True, env=env,
                             timeout=300, check=False)
        assert res.returncode == 0, (argv, res.stdout[-2000:], res.stderr[-2000:])
