"""Shared helpers for the xser tests (strategies, bit-exact comparison), plus checks of the helpers."""
from __future__ import annotations

import collections
from collections import OrderedDict

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

SETTINGS = settings(max_examples=20, deadline=None, suppress_health_check=list(HealthCheck))

Pair = collections.namedtuple("Pair", "left right")


class Box:
    """A custom object holding data in attributes (traversed through ``__dict__``)."""

    def __init__(self, left, right):
        self.left = left
        self.right = right


REQUIRED_DTYPES = [
    torch.float32, torch.float64, torch.float16, torch.bfloat16,
    torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz,
    torch.bool, torch.complex64, torch.complex128,
    torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
]
OPTIONAL_DTYPES = [getattr(torch, n) for n in ("uint16", "uint32", "uint64", "complex32", "float8_e8m0fnu",
                                               "float4_e2m1fn_x2", "bits8", "bits16") if hasattr(torch, n)]
ALL_DTYPES = REQUIRED_DTYPES + OPTIONAL_DTYPES


def random_tensor(dtype: torch.dtype, shape, seed: int = 0) -> torch.Tensor:
    """A tensor of ``dtype`` with random bit patterns (NaNs and all); bool holds only 0/1."""
    g = torch.Generator().manual_seed(seed)
    numel = 1
    for s in shape:
        numel *= s
    es = torch.empty(0, dtype=torch.uint8).view(dtype).element_size() if dtype != torch.uint8 else 1
    high = 2 if dtype == torch.bool else 256
    raw = torch.randint(0, high, (numel * es,), dtype=torch.uint8, generator=g)
    return raw.view(dtype).reshape(shape)


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bytes of ``t`` as a flat uint8 tensor (works for 0-d tensors and every dtype)."""
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)


def assert_bit_equal(a: torch.Tensor, b: torch.Tensor, where: str = "") -> None:
    assert isinstance(b, torch.Tensor), f"{where}: {type(b)} is not a tensor"
    assert a.dtype == b.dtype and a.shape == b.shape, f"{where}: {a.dtype}{tuple(a.shape)} != {b.dtype}{tuple(b.shape)}"
    assert torch.equal(bits(a), bits(b)), f"{where}: bits differ"


def assert_same(orig, back, seen=None, where="$"):
    """``back`` mirrors ``orig``: same container types and keys, bit-equal tensors, and tensor sharing
    preserved (each original tensor maps to exactly one loaded tensor object, and vice versa)."""
    seen = {} if seen is None else seen
    if isinstance(orig, torch.Tensor):
        assert_bit_equal(orig, back, where)
        if id(orig) in seen:
            assert seen[id(orig)] is back, f"{where}: shared tensor came back as a different object"
        else:
            assert all(v is not back for v in seen.values()), f"{where}: distinct tensors came back shared"
            seen[id(orig)] = back
        return seen
    assert type(back) is type(orig), f"{where}: {type(orig).__name__} came back as {type(back).__name__}"
    if isinstance(orig, dict):
        assert len(orig) == len(back), f"{where}: {len(orig)} keys came back as {len(back)}"
        for (k1, v1), (k2, v2) in zip(orig.items(), back.items()):
            assert_same(k1, k2, seen, f"{where}.key")
            assert_same(v1, v2, seen, f"{where}[{k1!r}]")
    elif isinstance(orig, (set, frozenset)) and any(isinstance(x, torch.Tensor) for x in orig):
        assert len(orig) == len(back), f"{where}: set size differs"
        for x in orig:  # sets of tensors iterate in id order: match elements by their bits
            match = [y for y in back if isinstance(y, torch.Tensor) and y.dtype == x.dtype and y.shape == x.shape
                     and torch.equal(bits(x), bits(y))]
            assert match, f"{where}: set element {x} missing"
            assert_same(x, match[0], seen, f"{where}{{...}}")
    elif isinstance(orig, (list, tuple)):
        assert len(orig) == len(back), f"{where}: length differs"
        for i, (x, y) in enumerate(zip(orig, back)):
            assert_same(x, y, seen, f"{where}[{i}]")
    elif isinstance(orig, Box):
        assert_same(orig.left, back.left, seen, f"{where}.left")
        assert_same(orig.right, back.right, seen, f"{where}.right")
    else:
        assert orig == back, f"{where}: {orig!r} != {back!r}"
    return seen


def tensor_pool(n: int = 4, device=None):
    """Distinct small float tensors (values identify them), optionally on ``device``."""
    pool = [torch.full((2, 3), float(i)) + torch.arange(6.).reshape(2, 3) / 10 for i in range(n)]
    pool.append(torch.tensor(7.5))  # 0-d
    return [t.to(device) for t in pool] if device is not None else pool


def nested(pool, custom: bool = True):
    """Nested data over ``pool`` tensors. ``custom`` adds namedtuples, custom objects and frozensets,
    which a weights-only load refuses (they need ``trusted=True``)."""
    leaves = st.one_of(st.sampled_from(pool), st.integers(-3, 3), st.text("abc", max_size=2), st.none(),
                       st.sampled_from([torch.Size([2, 3]), torch.float16]))
    hashables = st.one_of(st.integers(0, 4), st.text("xy", max_size=2))
    keys = st.text("abcxyz", min_size=1, max_size=3)

    def containers(children):
        options = [
            st.lists(children, max_size=4),
            st.lists(children, max_size=4).map(tuple),
            st.dictionaries(keys, children, max_size=4),
            st.dictionaries(keys, children, max_size=4).map(OrderedDict),
            st.sets(hashables, max_size=3),
        ]
        if custom:
            options += [
                st.tuples(children, children).map(lambda p: Pair(*p)),
                st.tuples(children, children).map(lambda p: Box(*p)),
                st.frozensets(hashables, max_size=3),
            ]
        return st.one_of(options)

    return st.recursive(leaves, containers, max_leaves=12)


def test_bits_distinguishes_nan_payloads():
    a = torch.tensor([float("nan")])
    b = a.view(torch.int32).add(1).view(torch.float32)
    assert not torch.equal(bits(a), bits(b))
    assert torch.equal(bits(torch.tensor(1.5)), bits(torch.tensor([1.5])))


def test_assert_same_catches_lost_sharing():
    t = torch.ones(2)
    try:
        assert_same([t, t], [t, t.clone()])
    except AssertionError as exc:
        assert "shared" in str(exc)
    else:
        raise AssertionError("lost sharing was not detected")
