"""The size-balanced split of a DP-replicated shard's tensors over its replicas (save and load use it)."""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from nxd_ckpt.plan import assign_to_bins


def test_largest_first_to_the_least_loaded():
    # round-robin would give loads 6 and 4; largest-first gives 5 and 5
    assert assign_to_bins([1, 1, 1, 1, 4, 2], 2) == [[2, 4], [0, 1, 3, 5]]
    assert assign_to_bins([5, 5, 5], 3) == [[0], [1], [2]]            # ties: lowest index, lowest bin
    assert assign_to_bins([], 3) == [[], [], []]
    assert assign_to_bins([7, 3], 4) == [[0], [1], [], []]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=10 ** 9), max_size=60), st.integers(min_value=1, max_value=9))
def test_every_tensor_once_and_loads_within_one_tensor(sizes, bins):
    split = assign_to_bins(sizes, bins)
    assert len(split) == bins
    assert sorted(i for b in split for i in b) == list(range(len(sizes)))
    assert all(b == sorted(b) for b in split)
    loads = [sum(sizes[i] for i in b) for b in split]
    assert max(loads) - min(loads) <= max(sizes, default=0)
    assert assign_to_bins(sizes, bins) == split                       # every replica computes the same


def test_bins_must_be_positive():
    import pytest

    with pytest.raises(ValueError, match="bins must be >= 1"):
        assign_to_bins([1], 0)
