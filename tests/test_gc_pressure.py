"""A save keeps few GC-tracked objects alive (issue 13): each one that outlives a young collection brings the next
full collection of the whole training process's heap closer, and at 5,000 tensor files the save's objects set one
off in nearly every save (0.2-0.3 s of CPU each for the benchmark's 430,000 objects). What is checked here: the
committed manifest is the JSON the typed records would give, built without them; the per-tensor meta dicts are
untracked from the second save of the same shapes on; a pooled host copy is one tensor object."""
from __future__ import annotations

import gc
import json

import torch

from nxd_ckpt import manifest as manifest_mod
from nxd_ckpt.capture import tensor_meta
from nxd_ckpt.staging import HostBufferPool

TOPO = {"world_size": 2, "tp": 1, "pp": 1, "dp": 2, "cp": 1, "ep": 1, "layout": None}
FLAGS = {"zero1": True, "xser": True, "has_model": True, "has_optim": True, "model_from_master_weights": False,
         "zero1_dcp": False}


def test_draft_holds_what_the_typed_manifest_would_write():
    ranges = [[50, 50, "00000001"], [0, 50, "00000002"]]
    files = {"optim/b.pt": ({"size": 100, "crc32c": "0000abce", "ranges": ranges}, 1),
             "model/a.pt": ({"size": 10, "crc32c": "0000abcd"}, 0)}
    tensors = {"model/a.pt": {"0": {"dtype": "float32", "shape": (2, 3), "key": "w", "expert_model_parallel": True,
                                    "partition_dim": 0}}}
    draft = manifest_mod.draft("t", TOPO, FLAGS, {k: dict(r, rank=n) for k, (r, n) in files.items()}, tensors,
                               {"dcp_ranges": {"x": 1}})
    typed = manifest_mod.build("t", TOPO, FLAGS, {k: dict(r, rank=n) for k, (r, n) in files.items()}, tensors)
    typed.extra["dcp_ranges"] = {"x": 1}
    got, want = json.loads(draft.body()), typed.to_json()
    assert got["library_version"] == want["library_version"] == manifest_mod.__version__
    assert got.pop("created_at") > 0 and want.pop("created_at") > 0
    assert got == want
    assert list(got["files"]) == ["model/a.pt", "optim/b.pt"]
    assert got["files"]["optim/b.pt"]["ranges"] == [[0, 50, "00000002"], [50, 50, "00000001"]]   # sorted, checked
    # and a reader parses it into the same typed records
    assert manifest_mod.Manifest.from_json(json.loads(draft.body())).files == typed.files


def test_meta_dicts_are_untracked_from_the_second_save_of_the_same_shapes():
    tensors = [torch.zeros(3, 4), torch.zeros(5, dtype=torch.bfloat16), torch.tensor(1.0)]
    tensor_meta(tensors, {0: "a", 1: "b", 2: "c"}, {})
    gc.collect()                                           # untracks the cached shape tuples
    meta = tensor_meta(tensors, {0: "a", 1: "b", 2: "c"}, {"b": {"partition_dim": 0}})
    assert [m["shape"] for m in meta.values()] == [(3, 4), (5,), ()]
    assert all(type(m["shape"]) is tuple for m in meta.values())
    assert not any(gc.is_tracked(m) for m in meta.values())


def test_a_pooled_host_copy_is_one_tensor_over_the_pooled_buffer():
    pool = HostBufferPool(1 << 20, keep=True)
    src = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    first = pool.empty_like(src)
    first.copy_(src)
    ptr = first.untyped_storage().data_ptr()
    pool.give_back([first])
    del first
    again = pool.empty_like(src)
    assert again._base is None and again.is_contiguous()
    assert again.untyped_storage().data_ptr() == ptr and again.untyped_storage().nbytes() == 48
    assert again.shape == (3, 4) and again.dtype == torch.float32
    assert torch.equal(again, src)                         # the reused bytes, seen through the new tensor


def test_a_buffer_taken_again_for_the_same_shape_comes_back_as_the_same_tensor():
    pool = HostBufferPool(1 << 20, keep=True)
    src = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    first = pool.empty_like(src)
    pool.give_back([first])
    assert pool.empty_like(src) is first                   # no new tensor object per file per save
    pool.give_back([first])
    other = pool.empty_like(torch.empty(2, 6, dtype=torch.int32))     # same 48 bytes, another shape and dtype
    assert other is not first and other.shape == (2, 6) and other.dtype == torch.int32
    assert other.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()
    pool.give_back([other])
    assert pool.empty_like(torch.empty(2, 6, dtype=torch.int32)) is other
    pool.give_back([other])
    pool.release()                                         # the buffer leaves the pool, and its tensor with it
    fresh = pool.empty_like(torch.empty(2, 6, dtype=torch.int32))
    assert fresh is not other and pool.allocated == 2
