"""The full-state pipeline without XLA: reshard through TP/PP/DP (strided, replicated and row-parallel tensors)
and back bit-exact; import from Hugging Face safetensors and export back; the errors that say what to pass."""
from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from nxd_ckpt.cli import main
from nxd_ckpt.fullstate import FullState, OptimState, ParamState, TensorSource, read_tag
from nxd_ckpt.partition import Partition
from nxd_ckpt.tagwrite import TagSizes, write_tag
from tiny_models import assert_bit_equal

SHAPES = [("model.embed_tokens.weight", (12, 8), Partition(0)),
          ("model.layers.0.input_layernorm.weight", (8,), None),
          ("model.layers.0.self_attn.q_proj.weight", (8, 8), Partition(0)),
          ("model.layers.0.self_attn.o_proj.weight", (8, 8), Partition(1)),
          ("model.layers.0.mlp.gate_up_proj.weight", (16, 8), Partition(0, 2)),
          ("model.layers.1.input_layernorm.weight", (8,), None),
          ("model.layers.1.mlp.down_proj.weight", (8, 12), Partition(1)),
          ("model.norm.weight", (8,), None),
          ("lm_head.weight", (12, 8), Partition(0))]


def full_state():
    """A small Llama-like state with Adam moments (odd row counts, so ZeRO-1 pads) and a step per parameter."""
    g = torch.Generator().manual_seed(7)
    vals = {n: [torch.randn(s, generator=g) for _ in range(3)] for n, s, _p in SHAPES}

    def src(name, label, t, part):
        return TensorSource(label, tuple(t.shape), t.dtype, part, lambda: t.clone())

    model = [src(n, n, vals[n][0], p) for n, _s, p in SHAPES]
    params = {n: ParamState({"exp_avg": src(n, f"{n} exp_avg", vals[n][1], p),
                             "exp_avg_sq": src(n, f"{n} exp_avg_sq", vals[n][2].abs(), p)}, torch.tensor(4.0))
              for n, _s, p in SHAPES}
    hyper = {"lr": 0.001, "betas": (0.9, 0.999), "eps": 1e-08}
    return FullState(model, OptimState(params, [(hyper, list(params))]), {"last_epoch": 4}, {"step": 4}), vals


def loaded(state: FullState):
    out = {t.name: t.checked() for t in state.model}
    for n, ps in state.optim.params.items():
        out[f"{n}/step"] = ps.step
        out.update({f"{n}/{k}": m.checked() for k, m in ps.moments.items()})
    return out


@pytest.mark.parametrize("sizes", [TagSizes(2, 2, 3, True), TagSizes(4, 1, 1, False), TagSizes(1, 2, 2, True)])
def test_reshard_round_trip_bit_exact(tmp_path, sizes):
    state, vals = full_state()
    write_tag(state, str(tmp_path / "a"), sizes, converted_from={})
    back = read_tag(str(tmp_path / "a"))
    assert [t.name for t in back.model] == [n for n, _s, _p in SHAPES]
    assert {t.name: t.partition for t in back.model} == {n: p for n, _s, p in SHAPES}
    expected = {}
    for n, _s, _p in SHAPES:
        expected.update({n: vals[n][0], f"{n}/step": torch.tensor(4.0), f"{n}/exp_avg": vals[n][1],
                         f"{n}/exp_avg_sq": vals[n][2].abs()})
    assert_bit_equal(loaded(back), expected)
    # through the command: to other sizes and back to the first ones, byte for byte the same files' tensors
    assert main(["reshard", str(tmp_path / "a"), str(tmp_path / "b"), "--tp", "1", "--pp", "1", "--dp", "2"]) == 0
    assert main(["reshard", str(tmp_path / "b"), str(tmp_path / "c"), "--tp", str(sizes.tp), "--pp", str(sizes.pp),
                 "--dp", str(sizes.dp), "--zero1" if sizes.zero1 else "--no-zero1"]) == 0
    import xser

    for sub in ("model", "optim"):
        refs = sorted(n for n in os.listdir(tmp_path / "a" / sub) if n.endswith(".pt") and ".pt." not in n)
        assert refs == sorted(n for n in os.listdir(tmp_path / "c" / sub) if n.endswith(".pt") and ".pt." not in n)
        for n in refs:
            assert_bit_equal(xser.load(str(tmp_path / "c" / sub / n)), xser.load(str(tmp_path / "a" / sub / n)), n)
    assert main(["verify", str(tmp_path / "c")]) == 0


def test_pp_stages_follow_layers(tmp_path):
    state, _ = full_state()
    write_tag(state, str(tmp_path / "t"), TagSizes(1, 2, 1, False), converted_from={})
    stage = {p: set(xser_keys(tmp_path / "t" / "model" / f"dp_rank_00_tp_rank_00_pp_rank_{p:02d}.pt")) for p in (0, 1)}
    assert stage[0] == {"model.embed_tokens.weight", "model.layers.0.input_layernorm.weight",
                        "model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.o_proj.weight",
                        "model.layers.0.mlp.gate_up_proj.weight"}
    assert stage[1] == {"model.layers.1.input_layernorm.weight", "model.layers.1.mlp.down_proj.weight",
                        "model.norm.weight", "lm_head.weight"}


def xser_keys(path):
    import xser

    return xser.load(str(path)).keys()


def write_hf(folder, tensors, shard=False):
    os.makedirs(folder, exist_ok=True)
    if not shard:
        save_file(tensors, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
        return
    names = sorted(tensors)
    half = len(names) // 2
    weight_map = {}
    for i, part in enumerate((names[:half], names[half:])):
        fn = f"model-{i + 1:05d}-of-00002.safetensors"
        save_file({k: tensors[k] for k in part}, os.path.join(folder, fn), metadata={"format": "pt"})
        weight_map.update({k: fn for k in part})
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)


@pytest.mark.parametrize("shard", [False, True])
def test_import_then_export_gives_the_same_tensors(tmp_path, shard):
    _state, vals = full_state()
    tensors = {n: vals[n][0] for n, _s, _p in SHAPES}
    tensors["model.layers.0.input_layernorm.weight"] = tensors["model.layers.0.input_layernorm.weight"].to(torch.bfloat16)
    write_hf(tmp_path / "hf", tensors, shard)
    assert main(["import", str(tmp_path / "hf"), str(tmp_path / "tag"), "--tp", "2", "--pp", "2",
                 "--preset", "llama"]) == 0
    shard0 = torch.load(tmp_path / "tag" / "model" / "dp_rank_00_tp_rank_01_pp_rank_00.pt.info.pt", weights_only=True)
    assert sorted((m["shape"][0], m.get("partition_dim", -1), m.get("partition_stride", -1))
                  for m in shard0.values()) == sorted([(6, 0, 1), (8, -1, -1), (4, 0, 1), (8, 1, 1), (8, 0, 2)])
    assert main(["verify", str(tmp_path / "tag")]) == 0
    assert main(["export", str(tmp_path / "tag"), "--output", str(tmp_path / "out")]) == 0
    got = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert_bit_equal(got, tensors)


def test_errors_say_what_to_pass(tmp_path, capsys):
    _state, vals = full_state()
    write_hf(tmp_path / "hf", {n: vals[n][0] for n, _s, _p in SHAPES})
    assert main(["import", str(tmp_path / "hf"), str(tmp_path / "t"), "--tp", "2"]) == 1
    err = capsys.readouterr().err
    assert "records no partition attributes" in err and "pass --preset llama" in err and "--partition GLOB=DIM" in err
    assert main(["import", str(tmp_path / "hf"), str(tmp_path / "t"), "--tp", "2", "--partition", "*.qkv.weight=0"]) == 1
    assert "--partition '*.qkv.weight=0' matches no tensor" in capsys.readouterr().err
    assert main(["import", str(tmp_path / "hf"), str(tmp_path / "t"), "--tp", "8", "--preset", "llama"]) == 1
    assert "do not split into TP=8" in capsys.readouterr().err
    assert main(["import", str(tmp_path / "hf"), str(tmp_path / "t"), "--pp", "3"]) == 1
    assert "2 layers, which do not split into PP=3" in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "t"), "nothing is written when the input is refused"


def _dcp_save(folder, sd):
    import warnings

    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(sd, checkpoint_id=str(folder), no_dist=True)


def test_from_dcp_errors(tmp_path, capsys):
    model = {"layers.0.w": torch.randn(4, 4), "layers.1.w": torch.randn(4, 4)}
    _dcp_save(tmp_path / "m", {"model": model})
    assert main(["from-dcp", str(tmp_path / "m"), str(tmp_path / "t"), "--zero1", "--dp", "2"]) == 1
    err = capsys.readouterr().err
    assert "holds no optimizer state" in err and "drop --zero1" in err
    assert main(["from-dcp", str(tmp_path / "m"), str(tmp_path / "t"), "--tp", "2"]) == 1
    assert "records no partition attributes" in capsys.readouterr().err
    optim = {"state": {"layers.9.w": {"step": torch.tensor(1.0), "exp_avg": torch.zeros(4, 4)}},
             "param_groups": [{"lr": 0.1, "params": ["layers.9.w"]}]}
    _dcp_save(tmp_path / "bad", {"model": model, "optim": optim})
    assert main(["from-dcp", str(tmp_path / "bad"), str(tmp_path / "t")]) == 1
    assert "names parameter 'layers.9.w', which the model does not have" in capsys.readouterr().err
    assert main(["from-dcp", str(tmp_path / "nothing"), str(tmp_path / "t")]) == 1
    assert "has no .metadata file" in capsys.readouterr().err
    # a plain-PyTorch DCP (no nxd-ckpt metadata) with rules comes in at TP=2
    assert main(["from-dcp", str(tmp_path / "m"), str(tmp_path / "t"), "--tp", "2", "--partition", "*.w=1"]) == 0
    back = read_tag(str(tmp_path / "t"))
    assert_bit_equal({t.name: t.checked() for t in back.model}, model)


def test_adamw_group_has_every_key_adamw_has():
    from nxd_ckpt.dcpio import adamw_group

    real = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=0.5).param_groups[0]
    assert adamw_group({"lr": 0.5, "weight_decay": real["weight_decay"]}) == {k: v for k, v in real.items()
                                                                              if k != "params"}
    assert adamw_group({"lr": 0.5})["weight_decay"] == 0.0, "a plain Adam state has no decoupled weight decay"


def test_buffers_without_optimizer_state_round_trip(tmp_path):
    """A model tensor without optimizer state (a buffer): the tag records which parameter each optimizer index
    is, so reading it back maps the state to the right names."""
    state, vals = full_state()
    del state.optim.params["model.layers.0.input_layernorm.weight"]
    state.optim.groups = [(h, [n for n in names if n in state.optim.params]) for h, names in state.optim.groups]
    write_tag(state, str(tmp_path / "a"), TagSizes(2, 1, 2, True), converted_from={})
    back = read_tag(str(tmp_path / "a"))
    assert set(back.optim.params) == set(state.optim.params)
    for n, ps in back.optim.params.items():
        assert_bit_equal(ps.moments["exp_avg"].checked(), vals[n][1], n)


def test_import_of_save_pretrained_output(tmp_path):
    """A checkpoint LlamaForCausalLM.save_pretrained wrote comes in at TP=2 x PP=2 with the llama preset; the
    tag's full tensors equal the model's state dict bit for bit, with the preset's partition attributes."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16,
                      tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg)
    model.save_pretrained(str(tmp_path / "hf"), safe_serialization=True)
    assert main(["import", str(tmp_path / "hf"), str(tmp_path / "tag"), "--tp", "2", "--pp", "2",
                 "--preset", "llama"]) == 0
    back = read_tag(str(tmp_path / "tag"))
    assert_bit_equal({t.name: t.checked() for t in back.model}, dict(model.state_dict()))
    parts = {t.name: t.partition for t in back.model}
    assert parts["model.layers.1.self_attn.k_proj.weight"] == Partition(0)
    assert parts["model.layers.0.mlp.down_proj.weight"] == Partition(1)
    assert parts["model.norm.weight"] is None and parts["lm_head.weight"] == Partition(0)
    stage1 = xser_keys(tmp_path / "tag" / "model" / "dp_rank_00_tp_rank_01_pp_rank_01.pt")
    assert "lm_head.weight" in stage1 and "model.embed_tokens.weight" not in stage1


@pytest.mark.parametrize("layout_kind", ["plain", "torchtitan"])
def test_to_dcp_and_back_at_tp_pp_dp(tmp_path, layout_kind):
    """to-dcp of a TP=2 x PP=2 x DP=2 ZeRO-1 tag and from-dcp at the same sizes: every file's tensors equal."""
    import xser

    state, _ = full_state()
    write_tag(state, str(tmp_path / "a"), TagSizes(2, 2, 2, True), converted_from={})
    assert main(["to-dcp", str(tmp_path / "a"), str(tmp_path / "d"), "--layout", layout_kind]) == 0
    man = json.loads((tmp_path / "d" / "manifest.json").read_text())
    assert set(man["files"]) == set(os.listdir(tmp_path / "d")) - {"manifest.json", "done"}
    assert main(["from-dcp", str(tmp_path / "d"), str(tmp_path / "b"), "--tp", "2", "--pp", "2", "--dp", "2",
                 "--zero1"]) == 0
    for sub in ("model", "optim"):
        for n in sorted(os.listdir(tmp_path / "a" / sub)):
            if n.endswith(".pt") and ".pt." not in n:
                assert_bit_equal(xser.load(str(tmp_path / "b" / sub / n)), xser.load(str(tmp_path / "a" / sub / n)), n)
    assert torch.load(tmp_path / "b" / "scheduler.pt", weights_only=True) == {"last_epoch": 4}


def test_to_dcp_refusals(tmp_path, capsys):
    state, _ = full_state()
    write_tag(state, str(tmp_path / "a"), TagSizes(1, 1, 1, False), converted_from={})
    os.remove(tmp_path / "a" / "done")
    assert main(["to-dcp", str(tmp_path / "a"), str(tmp_path / "d")]) == 1
    assert "has no 'done' marker" in capsys.readouterr().err
    write_tag(state, str(tmp_path / "b"), TagSizes(1, 1, 1, False), converted_from={})
    man = json.loads((tmp_path / "b" / "manifest.json").read_text())
    assert main(["to-dcp", str(tmp_path / "b"), str(tmp_path / "b" / "inside")]) == 1
    assert "inside the input directory" in capsys.readouterr().err
    assert main(["to-dcp", str(tmp_path / "b"), str(tmp_path / "d"), "--layout", "megatron"]) == 2
    assert not os.path.exists(tmp_path / "d") and man["has_optim"]
    assert main(["to-dcp", str(tmp_path / "b"), str(tmp_path / "d"), "--no-optimizer"]) == 0
    from torch.distributed.checkpoint import FileSystemReader

    keys = set(FileSystemReader(str(tmp_path / "d")).read_metadata().state_dict_metadata)
    assert not [k for k in keys if k.startswith("optim")] and "model.lm_head.weight" in keys


def test_nxd_weight_decay_groups_map_by_group_order(tmp_path):
    """NxD's Llama example builds two param groups (names without 'bias'/'norm' with weight decay, then the
    rest): the optimizer numbers parameters in that order, the tag keeps it, and reading maps it back."""
    import xser

    state, vals = full_state()
    names = [n for n, _s, _p in SHAPES]
    decay = [n for n in names if "norm" not in n]
    state.optim.groups = [({"lr": 0.1, "weight_decay": 0.01}, decay),
                          ({"lr": 0.1, "weight_decay": 0.0}, [n for n in names if n not in decay])]
    write_tag(state, str(tmp_path / "a"), TagSizes(2, 1, 2, True), converted_from={})
    sd = xser.load(str(tmp_path / "a" / "optim" / "dp_rank_00_tp_rank_00_pp_rank_00.pt"))
    assert [g["params"] for g in sd["param_groups"]] == [list(range(len(decay))),
                                                          list(range(len(decay), len(names)))]
    # as a tag written by save_checkpoint would be: no recorded names
    man = json.loads((tmp_path / "a" / "manifest.json").read_text())
    del man["optim_params"]
    from nxd_ckpt import manifest as manifest_mod

    body = json.dumps(man, indent=1).encode()
    (tmp_path / "a" / "manifest.json").write_bytes(body)
    (tmp_path / "a" / "done").write_bytes(manifest_mod.seal(body))
    back = read_tag(str(tmp_path / "a"))
    for n in names:
        assert_bit_equal(back.optim.params[n].moments["exp_avg"].checked(), vals[n][1], n)
    assert [(h["weight_decay"], ns) for h, ns in back.optim.groups] == [(0.01, decay), (0.0, [n for n in names
                                                                                            if n not in decay])]


def test_from_dcp_of_a_torchtitan_checkpoint(tmp_path):
    """A checkpoint in TorchTitan's keys (no nxd-ckpt entry): model at the top level, flat optimizer keys,
    lr_scheduler and train_state, which become the tag's scheduler and user content."""
    w = {"layers.0.w": torch.randn(4, 6), "layers.1.w": torch.randn(4, 6)}
    optim = {}
    for n, t in w.items():
        optim.update({f"state.{n}.step": torch.tensor(3.0), f"state.{n}.exp_avg": t * 2,
                      f"state.{n}.exp_avg_sq": t * t, f"param_groups.{n}.lr": 0.01,
                      f"param_groups.{n}.weight_decay": 0.1})
    _dcp_save(tmp_path / "tt", {**w, "optimizer": optim, "lr_scheduler": {"last_epoch": 3},
                                "train_state": {"step": 3, "ntokens_seen": 96}})
    assert main(["from-dcp", str(tmp_path / "tt"), str(tmp_path / "t"), "--tp", "2", "--partition", "*.w=1",
                 "--dp", "2", "--zero1"]) == 0
    back = read_tag(str(tmp_path / "t"))
    assert_bit_equal({t.name: t.checked() for t in back.model}, w)
    assert_bit_equal(back.optim.params["layers.1.w"].moments["exp_avg"].checked(), w["layers.1.w"] * 2)
    assert back.optim.groups == [({"lr": 0.01, "weight_decay": 0.1}, ["layers.0.w", "layers.1.w"])]
    assert back.scheduler == {"last_epoch": 3} and back.user_content == {"step": 3, "ntokens_seen": 96}


def test_export_import_export_same_bytes(tmp_path):
    """export -> import (at other sizes) -> export: the safetensors files are byte for byte the same."""
    state, _ = full_state()
    write_tag(state, str(tmp_path / "a"), TagSizes(2, 2, 1, False), converted_from={})
    assert main(["export", str(tmp_path / "a"), "--output", str(tmp_path / "hf1"), "--max-shard-size", "2KB"]) == 0
    assert main(["import", str(tmp_path / "hf1"), str(tmp_path / "b"), "--tp", "4", "--preset", "llama"]) == 0
    assert main(["export", str(tmp_path / "b"), "--output", str(tmp_path / "hf2"), "--max-shard-size", "2KB"]) == 0
    files = sorted(os.listdir(tmp_path / "hf1"))
    assert len(files) > 2 and files == sorted(os.listdir(tmp_path / "hf2"))
    for f in files:
        assert (tmp_path / "hf1" / f).read_bytes() == (tmp_path / "hf2" / f).read_bytes(), f


def test_damaged_input_is_refused_and_nothing_published(tmp_path, capsys):
    state, _ = full_state()
    write_tag(state, str(tmp_path / "a"), TagSizes(2, 1, 2, True), converted_from={})
    victim = tmp_path / "a" / "optim" / "dp_rank_01_tp_rank_01_pp_rank_00.pt.tensors" / "tensor_2.pt"
    data = bytearray(victim.read_bytes())
    data[-20] ^= 0xFF
    victim.write_bytes(bytes(data))
    assert main(["to-dcp", str(tmp_path / "a"), str(tmp_path / "d")]) == 1
    err = capsys.readouterr().err
    assert "tensor_2.pt fails its checksum" in err
    assert not os.path.exists(tmp_path / "d") and not os.path.exists(str(tmp_path / "d") + ".nxdtmp")
    assert main(["reshard", str(tmp_path / "a"), str(tmp_path / "r"), "--tp", "1"]) == 1
    assert not os.path.exists(tmp_path / "r") and not os.path.exists(str(tmp_path / "r") + ".nxdtmp")


def test_output_tree_publishes_on_success_and_keeps_the_old_tree_on_failure(tmp_path):
    from nxd_ckpt.outdir import output_tree

    dst = tmp_path / "out"
    dst.mkdir()
    (dst / "old.txt").write_text("old")
    (tmp_path / "out.nxdtmp").mkdir()   # a leftover staging directory of an interrupted run is replaced
    (tmp_path / "out.nxdtmp" / "stale").write_text("x")
    with pytest.raises(KeyboardInterrupt):
        with output_tree(str(dst)) as out:
            stage = out.local_path("")
            assert stage == str(tmp_path / "out.nxdtmp") and os.listdir(stage) == []
            (tmp_path / "out.nxdtmp" / "new.txt").write_text("new")
            raise KeyboardInterrupt
    assert sorted(os.listdir(tmp_path)) == ["out"] and os.listdir(dst) == ["old.txt"]
    with output_tree(str(dst)) as out:
        out.write_bytes("new.txt", b"new")
        assert os.listdir(dst) == ["old.txt"]   # published only when the block ends
    assert sorted(os.listdir(tmp_path)) == ["out"] and os.listdir(dst) == ["new.txt"]


def test_buffer_pool_reuses_only_its_own_buffers_up_to_its_cap():
    """to-dcp's joined tensors reuse the buffers the writer gave back (same byte size, any dtype/shape); a
    tensor the pool did not make, or a view, is never taken; at most ``cap`` buffers wait."""
    from nxd_ckpt.fullstate import BufferPool

    pool = BufferPool(cap=1)
    a = pool.empty((4, 8), torch.float32)
    ptr = a.data_ptr()
    pool.give_back(a)
    b = pool.empty((8, 4), torch.int32)          # same 128 bytes: the same memory
    assert b.data_ptr() == ptr and b.shape == (8, 4) and b.dtype == torch.int32
    c = pool.empty((4, 8), torch.float32)        # nothing free: new memory
    assert c.data_ptr() != ptr
    pool.give_back(torch.zeros(4, 8))             # not the pool's
    pool.give_back(c[1:])                         # a view
    assert pool.empty((4, 8), torch.float32).data_ptr() not in (ptr, c.data_ptr())
    pool.give_back(b)
    pool.give_back(c)                             # over the cap: b's buffer is dropped
    assert pool.empty((4, 8), torch.float32).data_ptr() == c.data_ptr()
    assert pool.empty((4, 8), torch.float32).data_ptr() not in (ptr, c.data_ptr())


def _save_sharded_dcp(rank, world, out):
    """Each rank writes its half of every tensor (DTensor, Shard(0)): a DCP checkpoint whose chunks only
    torch's own loader can assemble."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    full = {"layers.0.w": torch.randn(8, 6), "layers.1.w": torch.randn(4, 6)}
    dcp.save({k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in full.items()}, checkpoint_id=out)
    return full


def test_from_dcp_of_a_sharded_checkpoint_assembles_its_chunks(tmp_path):
    """A DCP checkpoint written by 2 ranks (two chunks per tensor, as FSDP2 writes) comes back whole and bit-exact:
    from-dcp hands such entries to torch's loader over our Storage."""
    from harness import run_ranks

    full = run_ranks(_save_sharded_dcp, 2, str(tmp_path / "dcp"))[0]
    assert len([f for f in os.listdir(tmp_path / "dcp") if f.endswith(".distcp")]) == 2
    assert main(["from-dcp", str(tmp_path / "dcp"), str(tmp_path / "t"), "--tp", "2", "--partition", "*.w=0",
                 "--no-optimizer"]) == 0
    back = read_tag(str(tmp_path / "t"))
    assert_bit_equal({t.name: t.checked() for t in back.model}, full)


def test_row_segments_read_each_piece_once_or_decline():
    from nxd_ckpt.partition import row_segments

    assert row_segments((16, 8), Partition(0, 2), 2, 2) == [(0, 0, 0, 2), (0, 1, 0, 2), (1, 0, 0, 2), (1, 1, 0, 2),
                                                           (0, 2, 0, 2), (0, 3, 0, 2), (1, 2, 0, 2), (1, 3, 0, 2)]
    assert row_segments((16, 8), Partition(0, 2), 2, 3) is None          # piece 1 of each rank spans two blocks
    assert row_segments((7, 8), Partition(1), 2, 3) is None              # row-parallel: rows interleave
    assert row_segments((7, 3), None, 4, 2) == [(0, 0, 0, 2), (0, 1, 0, 2), (0, 2, 0, 2), (0, 3, 0, 1)]
    assert row_segments((8, 3), Partition(0), 2, 4) == [(0, 0, 0, 4), (1, 0, 0, 4)]


@pytest.mark.parametrize("sizes", [TagSizes(2, 1, 3, True), TagSizes(2, 1, 1, False)])
def test_to_dcp_streams_pieces_into_the_bytes_of_the_joined_tensor(tmp_path, monkeypatch, sizes):
    """Tensors whose ZeRO-1 pieces are runs of the full tensor's rows are written piece by piece, row-parallel
    ones slab by slab (a slab of a few rows here, so several per piece); their files are byte for byte those
    of the joined tensor. A stride whose blocks cut a piece is joined."""
    import xser
    from torch.distributed.checkpoint import FileSystemReader

    from nxd_ckpt import fullstate

    monkeypatch.setattr(fullstate, "SLAB_BYTES", 40)      # 2 rows of 8 or 12 fp32: slabs cut pieces
    state, _ = full_state()
    write_tag(state, str(tmp_path / "a"), sizes, converted_from={})
    src = read_tag(str(tmp_path / "a"))
    sources = {t.name: t for t in src.model}
    sources.update({m.name: m for ps in src.optim.params.values() for m in ps.moments.values()})
    joined = {n for n, t in sources.items() if t.pieces is None}
    model = {n for n, _s, _p in SHAPES}         # without ZeRO-1 master weights the model's TP shards are joined
    assert joined == {f"model.layers.0.mlp.gate_up_proj.weight{k}" for k in ("", " exp_avg", " exp_avg_sq")} | (
        set() if sizes.zero1 else model)
    for name, t in sources.items():
        if t.pieces is not None:
            streamed = b"".join(p.contiguous().view(torch.uint8).numpy().tobytes() for p in t.pieces())
            assert streamed == t.checked().contiguous().view(torch.uint8).numpy().tobytes(), name
    from nxd_ckpt import dcpwrite

    streamed_names, joined_names = [], []
    real_write, real_checked = dcpwrite.Streamed.write, fullstate.TensorSource.checked
    monkeypatch.setattr(dcpwrite.Streamed, "write", lambda self, f: streamed_names.append(self.src.name) or
                        real_write(self, f))
    monkeypatch.setattr(fullstate.TensorSource, "checked", lambda self: joined_names.append(self.name) or
                        real_checked(self))
    assert main(["to-dcp", str(tmp_path / "a"), str(tmp_path / "d")]) == 0
    assert sorted(streamed_names) == sorted(set(sources) - joined)      # each streamed once, none joined
    assert set(joined_names) == joined
    meta = FileSystemReader(str(tmp_path / "d")).read_metadata()
    checked = 0
    for index, info in meta.storage_data.items():
        key = index.fqn
        name = key[len("model."):] if key.startswith("model.") else None
        if key.startswith("optim.state.") and key.rsplit(".", 1)[-1] in ("exp_avg", "exp_avg_sq"):
            name = f"{key[len('optim.state.'):].rsplit('.', 1)[0]} {key.rsplit('.', 1)[-1]}"
        if name in sources:
            data = (tmp_path / "d" / info.relative_path).read_bytes()
            assert data == xser.tensor_to_bytes(sources[name].checked()), key
            checked += 1
    assert checked == len(sources) == 27


def test_to_dcp_starts_the_writeback_of_each_file_as_it_is_written(tmp_path, monkeypatch):
    """Every .distcp file is handed to the kernel's writeback once written (the final sync then has little
    left to wait for); the hint works on a local file and declines a missing one."""
    from nxd_ckpt.storage import local

    assert local.start_writeback(__file__) is True
    assert local.start_writeback(str(tmp_path / "missing")) is False
    hinted = []
    real = local.start_writeback
    monkeypatch.setattr(local, "start_writeback", lambda p: hinted.append(p) or real(p))
    state, _ = full_state()
    write_tag(state, str(tmp_path / "a"), TagSizes(2, 1, 2, True), converted_from={})
    assert main(["to-dcp", str(tmp_path / "a"), str(tmp_path / "d")]) == 0
    names = {os.path.basename(p) for p in hinted}
    assert names == {n for n in os.listdir(tmp_path / "d") if n.endswith(".distcp")} and len(hinted) == len(names)
    assert all(os.path.dirname(p) == str(tmp_path / "d.nxdtmp") for p in hinted)


def test_to_dcp_logs_a_failed_writeback_hint_and_still_writes(tmp_path, monkeypatch, caplog):
    """The writeback is a hint: its failure is logged (warning, naming the file) and the output is complete."""
    from nxd_ckpt.storage import local

    def broken(path):
        raise OSError(5, "EIO from the hint")

    monkeypatch.setattr(local, "start_writeback", broken)
    state, _ = full_state()
    write_tag(state, str(tmp_path / "a"), TagSizes(2, 1, 1, False), converted_from={})
    with caplog.at_level("WARNING", logger="nxd_ckpt"):
        assert main(["to-dcp", str(tmp_path / "a"), str(tmp_path / "d")]) == 0
    failed = [r.getMessage() for r in caplog.records if "starting the writeback" in r.getMessage()]
    distcp = [n for n in os.listdir(tmp_path / "d") if n.endswith(".distcp")]
    assert len(failed) == len(distcp) > 0 and all("EIO from the hint" in m for m in failed)
    assert (tmp_path / "d" / ".metadata").is_file() and (tmp_path / "d" / "done").exists()


def test_info_from_the_manifest_equals_each_info_file(tmp_path):
    """A load builds a shard's .info.pt entries from the manifest (reader.shard_info, no file read): for a tag the
    offline tools write (partitioned, strided and replicated tensors of several dtypes, ZeRO-1 optimizer shards)
    they equal what each .info.pt file holds, entry for entry."""
    from nxd_ckpt import layout, manifest, reader
    from nxd_ckpt.storage.local import LocalStorage

    state, _ = full_state()
    dtypes = [torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.bool]
    state.model = [TensorSource(t.name, t.shape, dtypes[i % len(dtypes)], t.partition,
                                lambda t=t, d=dtypes[i % len(dtypes)]: t.checked().to(d))
                   for i, t in enumerate(state.model)]
    write_tag(state, str(tmp_path / "a"), TagSizes(2, 1, 2, True), converted_from={})
    man = manifest.read(str(tmp_path / "a"))
    rd = reader.FileReader(LocalStorage(str(tmp_path / "a")), "", man)
    checked = 0
    for rel in man.tensors:
        from_file = torch.load(tmp_path / "a" / layout.info_path(rel), weights_only=True)
        from_manifest = reader.shard_info(rd, rel, sorted(from_file))
        assert from_manifest == from_file, rel
        assert [list(e) for e in from_manifest.values()] == [list(e) for e in from_file.values()], rel
        checked += 1
    kinds = {(e["dtype"], "partition_stride" in e) for rel in man.tensors for e in reader.shard_info(rd, rel, []).values()}
    assert checked == 6 and {d for d, _ in kinds} >= set(dtypes) and (torch.bfloat16, True) in kinds, kinds
