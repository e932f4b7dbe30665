"""The join/split primitives of nxd_ckpt.partition: TP (dim, stride) and ZeRO-1 (pad, chunk, trim), and
pipeline stage assignment."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nxd_ckpt.partition import (Partition, PartitionError, assign_stages, join_tp, split_tp, split_tp_all,
                                zero1_shard, zero1_shard_all, zero1_unshard)
from tiny_models import assert_bit_equal


def test_strided_split_matches_megatron_block_order():
    full = torch.arange(8 * 3).reshape(8, 3)
    # 2 ranks x stride 2: 4 blocks of 2 rows; rank 0 holds blocks 0 and 2, rank 1 blocks 1 and 3
    r0, r1 = split_tp_all(full, Partition(0, 2), 2)
    assert r0[:, 0].tolist() == [0, 3, 12, 15] and r1[:, 0].tolist() == [6, 9, 18, 21]
    assert_bit_equal(join_tp([r0, r1], Partition(0, 2)), full)


@settings(max_examples=40, deadline=None)
@given(tp=st.sampled_from([1, 2, 4]), stride=st.sampled_from([1, 2, 3]), dim=st.sampled_from([0, 1, -1]),
       rows=st.integers(1, 3), cols=st.integers(1, 3))
def test_tp_split_join_round_trip(tp, stride, dim, rows, cols):
    full = torch.randn(rows * tp * stride, cols * tp * stride)
    part = Partition(dim, stride)
    shards = split_tp_all(full, part, tp)
    assert all(s.shape[dim] == full.shape[dim] // tp for s in shards)
    assert_bit_equal(join_tp(shards, part), full)


def test_tp_split_refuses_sizes_that_do_not_divide():
    with pytest.raises(PartitionError, match=r"6 rows along its partition dim 0.*TP=4"):
        split_tp(torch.zeros(6, 2), Partition(0), 4, 0, "w")
    with pytest.raises(PartitionError, match="out of range"):
        split_tp(torch.zeros(4), Partition(1), 2, 0, "b")


def test_replicated_tensor_is_taken_once():
    t = torch.randn(3)
    assert split_tp(t, None, 4, 3) is t
    assert join_tp([t, t.clone()], None) is t


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(0, 9), group=st.integers(1, 5), tail=st.sampled_from([(), (3,), (2, 2)]))
def test_zero1_round_trip_pads_with_zeros(rows, group, tail):
    full = torch.randn(rows, *tail)
    pieces = zero1_shard_all(full, group)
    per = -(-rows // group) if rows else 0
    assert all(tuple(p.shape) == (per, *tail) for p in pieces)
    padded = torch.cat(pieces) if pieces else full
    assert not padded[rows:].any()
    assert_bit_equal(zero1_unshard(pieces, full.shape), full)


def test_zero1_scalar_is_one_row():
    t = torch.tensor(3.5)
    pieces = zero1_shard_all(t, 2)
    assert [p.tolist() for p in pieces] == [[3.5], [0.0]]
    assert_bit_equal(zero1_unshard(pieces, ()), t)


def test_zero1_unshard_checks_piece_shapes():
    with pytest.raises(PartitionError, match=r"piece 1 is \(1, 2\); a \(5, 2\) tensor over 2 DP ranks"):
        zero1_unshard([torch.zeros(3, 2), torch.zeros(1, 2)], (5, 2), "w")


def test_zero1_shard_is_a_copy():
    full = torch.randn(4, 2)
    piece = zero1_shard(full, 0, 1)
    piece.zero_()
    assert full.abs().sum() > 0


def test_stage_assignment_follows_layers():
    names = ["embed", "pos", "blocks.0.w", "blocks.1.w", "blocks.2.w", "blocks.3.w", "ln_f.weight", "lm_head.weight"]
    assert assign_stages(names, 2) == {"embed": 0, "pos": 0, "blocks.0.w": 0, "blocks.1.w": 0, "blocks.2.w": 1,
                                       "blocks.3.w": 1, "ln_f.weight": 1, "lm_head.weight": 1}
    with pytest.raises(PartitionError, match="4 layers, which do not split into PP=3"):
        assign_stages(names, 3)


@settings(max_examples=30, deadline=None)
@given(tp=st.sampled_from([1, 2, 4]), stride=st.sampled_from([1, 2]), dim=st.sampled_from([0, 1]),
       dp=st.integers(1, 3), replicated=st.booleans())
def test_assembling_in_place_inverts_split(tp, stride, dim, dp, replicated):
    """tp_block_views + copy_into_blocks / assemble_zero1 (ZeRO-1 pieces per TP shard) rebuild the tensor."""
    from nxd_ckpt.partition import assemble_zero1, copy_into_blocks, tp_block_views

    full = torch.randn(2 * tp * stride + (0 if dim else 0), 2 * tp * stride)
    part = None if replicated else Partition(dim, stride)
    for via_zero1 in (False, True):
        out = torch.full_like(full, float("nan"))
        for r in range(tp):
            shard = split_tp(full, part, tp, r).contiguous()
            blocks = tp_block_views(out, part, tp, r)
            if via_zero1 and blocks:
                pieces = zero1_shard_all(shard, dp)
                shard = assemble_zero1(lambda d: pieces[d], dp, shard.shape)
            copy_into_blocks(shard, blocks, part)
        assert_bit_equal(out, full)
