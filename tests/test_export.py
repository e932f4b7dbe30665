"""export: TP shards merged by their partition attributes, PP stages joined, safetensors bit-exact."""
from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file

from nxd_ckpt.cli import main
from nxd_ckpt.export import merge_tp, parse_size, safetensors_header
from test_cli_fixtures import assert_bit_equal, write_tag

TP = 2
COL = {"tensor_model_parallel": True, "partition_dim": 0, "partition_stride": 1}
ROW = {"tensor_model_parallel": True, "partition_dim": 1, "partition_stride": 1}
STRIDED = {"tensor_model_parallel": True, "partition_dim": 0, "partition_stride": 2}


def full_model():
    g = torch.Generator().manual_seed(3)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    stage0 = {
        "embed.weight": r(10, 6),                         # replicated
        "layers.0.qkv.weight": r(12, 6),                  # column parallel
        "layers.0.qkv.bias": r(12),                       # column parallel
        "layers.0.o.weight": r(6, 12),                    # row parallel
        "layers.0.o.bias": r(6),                          # replicated
        "layers.0.gate_up.weight": r(16, 6),              # column parallel, stride 2
        "layers.0.steps": torch.tensor(5, dtype=torch.int64),
    }
    stage1 = {
        "layers.1.qkv.weight": r(12, 6),
        "layers.1.o.weight": r(6, 12).to(torch.bfloat16),
        "norm.weight": r(6),
        "embed.weight": stage0["embed.weight"].clone(),   # tied embedding, also on the last stage
    }
    attrs = {"layers.0.qkv.weight": COL, "layers.0.qkv.bias": COL, "layers.0.o.weight": ROW,
             "layers.0.gate_up.weight": STRIDED, "layers.1.qkv.weight": COL, "layers.1.o.weight": ROW}
    return [stage0, stage1], attrs


def shard(full, attr, rank, tp=TP):
    if not attr:
        return full.clone()
    dim, stride = attr["partition_dim"], attr["partition_stride"]
    blocks = torch.chunk(full, tp * stride, dim=dim)
    return torch.cat([blocks[rank + k * tp] for k in range(stride)], dim=dim).clone()


def tp_pp_tag(root, tag="step_5", *, manifest=True, info_partition=True, stages=None, attrs=None, use_xser=True):
    if stages is None:
        stages, attrs = full_model()
    model = {(t, p): {k: shard(v, attrs.get(k), t) for k, v in sd.items()} for p, sd in enumerate(stages)
             for t in range(TP)}
    path = write_tag(str(root), tag, model=model, attrs=attrs, manifest=manifest, info_partition=info_partition,
                     use_xser=use_xser,
                     topology={"world_size": 4, "tp": 2, "pp": 2, "dp": 1, "cp": 1, "ep": 1})
    expected = {}
    for sd in stages:
        expected.update(sd)
    return path, expected


def test_merge_tp_inverts_megatron_split():
    full = torch.arange(48.).reshape(8, 6)
    for dim, stride, tp in ((0, 1, 2), (1, 1, 3), (0, 2, 2), (0, 4, 2), (1, 2, 3)):
        attr = {"partition_dim": dim, "partition_stride": stride}
        assert torch.equal(merge_tp([shard(full, attr, r, tp) for r in range(tp)], dim, stride), full)


def test_export_tp2_pp2_bit_exact(tmp_path, capsys):
    tag, expected = tp_pp_tag(tmp_path / "ck")
    out = tmp_path / "hf"
    assert main(["export", tag, "--output", str(out)]) == 0
    assert sorted(os.listdir(out)) == ["model.safetensors"]
    got = load_file(str(out / "model.safetensors"))
    assert sorted(got) == sorted(expected)
    for k in expected:
        assert_bit_equal(expected[k], got[k], k)
    assert f"exported {len(expected)} tensors" in capsys.readouterr().out


def test_export_plain_torch_save_shards(tmp_path):
    tag, expected = tp_pp_tag(tmp_path / "ck", use_xser=False)
    out = tmp_path / "hf"
    assert main(["export", tag, "--output", str(out)]) == 0
    got = load_file(str(out / "model.safetensors"))
    assert sorted(got) == sorted(expected)
    for k in expected:
        assert_bit_equal(expected[k], got[k], k)


def test_max_shard_size_writes_index_covering_every_tensor(tmp_path, capsys):
    tag, expected = tp_pp_tag(tmp_path / "ck")
    out = tmp_path / "hf"
    assert main(["export", tag, "--output", str(out), "--max-shard-size", "300B", "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    index = json.load(open(out / "model.safetensors.index.json"))
    files = sorted(set(index["weight_map"].values()))
    n = len(files)
    assert n > 3 and files == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    assert sorted(index["weight_map"]) == sorted(expected)
    assert index["metadata"]["total_size"] == sum(v.numel() * v.element_size() for v in expected.values())
    assert res["total_size"] == index["metadata"]["total_size"]
    for f in files:
        part = load_file(str(out / f))
        for k, v in part.items():
            assert index["weight_map"][k] == f
            assert_bit_equal(expected[k], v, k)
        assert os.path.getsize(out / f) <= 300 + 1024 or len(part) == 1


def test_dtype_bf16_casts_floats_only(tmp_path):
    tag, expected = tp_pp_tag(tmp_path / "ck")
    out = tmp_path / "hf"
    assert main(["export", tag, "--output", str(out), "--dtype", "bf16"]) == 0
    got = load_file(str(out / "model.safetensors"))
    assert got["layers.0.steps"].dtype == torch.int64 and got["layers.0.steps"].item() == 5
    for k, v in expected.items():
        if v.is_floating_point():
            assert_bit_equal(v.to(torch.bfloat16), got[k], k)


def test_nxd_checkpoint_without_partition_info_needs_partition_flag(tmp_path, capsys):
    tag, expected = tp_pp_tag(tmp_path / "ck", manifest=False, info_partition=False)
    out = tmp_path / "hf"
    assert main(["export", tag, "--output", str(out)]) == 1
    err = capsys.readouterr().err
    assert "nxd-ckpt: error:" in err and "--partition" in err and "layers.0." in err
    assert not out.exists()
    flags = ["--partition", "*.qkv.*=0", "--partition", "*.o.weight=1", "--partition", "*.gate_up.weight=0:2"]
    assert main(["export", tag, "--output", str(out), *flags]) == 0
    got = load_file(str(out / "model.safetensors"))
    assert sorted(got) == sorted(expected)
    for k in expected:
        assert_bit_equal(expected[k], got[k], k)


def test_pp_duplicate_keys_must_agree(tmp_path, capsys):
    stages, attrs = full_model()
    stages[1]["embed.weight"] = stages[1]["embed.weight"] + 1
    tag, _ = tp_pp_tag(tmp_path / "ck", stages=stages, attrs=attrs)
    assert main(["export", tag, "--output", str(tmp_path / "hf")]) == 1
    err = capsys.readouterr().err
    assert "'embed.weight'" in err and "pipeline stages 0 and 1" in err


def test_existing_output_and_bad_flags(tmp_path, capsys):
    tag, _ = tp_pp_tag(tmp_path / "ck")
    out = tmp_path / "hf"
    out.mkdir()
    (out / "x").write_text("keep")
    assert main(["export", tag, "--output", str(out)]) == 1
    assert "--overwrite" in capsys.readouterr().err and (out / "x").exists()
    assert main(["export", tag, "--output", str(out), "--overwrite"]) == 0
    assert sorted(os.listdir(out)) == ["model.safetensors"]
    assert main(["export", tag, "--output", str(tmp_path / "h2"), "--max-shard-size", "lots"]) == 1
    assert "--max-shard-size" in capsys.readouterr().err
    assert main(["export", tag, "--output", str(tmp_path / "h2"), "--partition", "nodim"]) == 1
    assert "NAME_GLOB=DIM" in capsys.readouterr().err
    assert main(["export", tag, "--output", str(tmp_path / "h2"), "--dtype", "int4"]) == 2
    assert main(["export", tag, "--output", os.path.join(tag, "model")]) == 1
    assert "is inside the input directory" in capsys.readouterr().err


def test_parse_size_and_header_alignment():
    assert parse_size("5GB") == 5 * 10 ** 9 and parse_size("2GiB") == 2 * 2 ** 30 and parse_size("1000") == 1000
    with pytest.raises(ValueError):
        parse_size("-3MB")
    from nxd_ckpt.export import OutTensor

    h = safetensors_header([OutTensor("a", shape=(3,), dtype=torch.float16)])
    assert (len(h) - 8) % 8 == 0


# --- a checkpoint written by save_checkpoint on 2 TP ranks (partition attributes from the parameters) -------
def _save_tp2(rank, world, root):
    import nxd_ckpt
    import parallel_state as ps
    from tiny_models import TinyShard, to_cpu_state

    ps.initialize_model_parallel(tensor_model_parallel_size=2)
    model = TinyShard(ps.get_tensor_model_parallel_rank())   # up: column parallel, down: row parallel
    with torch.no_grad():                                      # bias is replicated: the same on both ranks
        model.bias.copy_(torch.linspace(-1, 1, 8).to(model.bias.device))
    nxd_ckpt.save_checkpoint(root, "t", model=model, use_xser=True)
    return to_cpu_state(model.state_dict())


def test_export_of_a_real_tp2_save(tmp_path):
    from harness import run_ranks

    root = str(tmp_path / "ckpt")
    shards = run_ranks(_save_tp2, 2, root, timeout=120)
    out = str(tmp_path / "hf")
    assert main(["export", os.path.join(root, "t"), "--output", out]) == 0
    got = load_file(os.path.join(out, "model.safetensors"))
    want = {"up": torch.cat([s["up"] for s in shards], 0), "down": torch.cat([s["down"] for s in shards], 1),
            "bias": shards[0]["bias"], "steps_seen": shards[0]["steps_seen"]}   # replicated: TP rank 0's copy
    assert_bit_equal(want, dict(sorted(got.items(), key=lambda kv: list(want).index(kv[0]))))
