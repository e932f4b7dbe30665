"""to_refs / from_refs: tid order, sharing, container types, in memory (no files)."""
from __future__ import annotations

import collections
import copy
import io
from collections import OrderedDict

import pytest
import torch
from hypothesis import given

import xser
from test_xser_support import SETTINGS, Box, Pair, assert_same, nested, tensor_pool

POOL = tensor_pool()


def _roundtrip(data):
    ref_data, tensors = xser.to_refs(data)
    calls = []

    def get(tid):
        calls.append(tid)
        return tensors[tid]

    return ref_data, tensors, xser.from_refs(ref_data, get), calls


@SETTINGS
@given(nested(POOL))
def test_roundtrip_in_memory_keeps_types_and_sharing(data):
    ref_data, tensors, back, calls = _roundtrip(data)
    assert len({id(t) for t in tensors}) == len(tensors), "a tensor object got two tids"
    assert sorted(calls) == list(range(len(tensors))), "get_tensor not called exactly once per tid"
    assert_same(data, back)
    # to_refs itself keeps the structure: every tensor became a TensorReference
    assert_same(data, xser.from_refs(ref_data, lambda tid: tensors[tid]))


@SETTINGS
@given(nested(POOL))
def test_ref_data_holds_no_tensors(data):
    ref_data, tensors = xser.to_refs(data)
    found = []

    def walk(obj):
        if isinstance(obj, torch.Tensor):
            found.append(obj)
        elif isinstance(obj, dict):
            for k, v in obj.items():
                walk(k)
                walk(v)
        elif isinstance(obj, (list, tuple, set, frozenset)):
            for x in obj:
                walk(x)
        elif isinstance(obj, Box):
            walk(obj.left)
            walk(obj.right)

    walk(ref_data)
    assert found == []
    assert xser.collect_tids(ref_data) == list(range(len(tensors)))


def test_tid_order_is_depth_first_keys_before_values():
    a, b, c, d, k = (torch.tensor([float(i)]) for i in range(5))
    data = {"z": [a, (b, a)], k: c, "y": Box(d, {"q": b})}
    ref_data, tensors = xser.to_refs(data)
    assert [t.item() for t in tensors] == [0.0, 1.0, 4.0, 2.0, 3.0]
    assert ref_data["z"][0] == xser.TensorReference(0) and ref_data["z"][1][1] is ref_data["z"][0]
    key = next(k2 for k2 in ref_data if isinstance(k2, xser.TensorReference))
    assert key.tid == 2 and ref_data[key].tid == 3
    assert isinstance(ref_data["y"], Box) and ref_data["y"].right["q"].tid == 1


def test_tied_weights_share_one_tid_and_come_back_shared():
    w = torch.randn(4, 4)
    data = {"embed.weight": w, "lm_head.weight": w, "bias": torch.zeros(4)}
    ref_data, tensors, back, calls = _roundtrip(data)
    assert len(tensors) == 2 and ref_data["embed.weight"].tid == ref_data["lm_head.weight"].tid == 0
    assert back["embed.weight"] is back["lm_head.weight"]
    assert calls == [0, 1]


def test_same_tid_in_distinct_reference_objects_gives_one_tensor():
    refs = {"a": xser.TensorReference(0), "b": [xser.TensorReference(0)], "c": xser.TensorReference(1)}
    calls = []
    back = xser.from_refs(refs, lambda tid: calls.append(tid) or torch.tensor([tid]))
    assert back["a"] is back["b"][0] and calls == [0, 1]


def test_container_types_are_kept():
    t = torch.ones(1)
    dd = collections.defaultdict(list, {"x": t})
    data = OrderedDict(
        dd=dd, nt=Pair(t, 1), tup=(t,), s={1, 2}, fs=frozenset({"a"}), size=torch.Size([3, 4]),
        box=Box(t, [t]), param=torch.nn.Parameter(torch.zeros(2)))
    ref_data, tensors = xser.to_refs(data)
    assert type(ref_data) is OrderedDict
    assert type(ref_data["dd"]) is collections.defaultdict and ref_data["dd"].default_factory is list
    assert type(ref_data["nt"]) is Pair and ref_data["nt"].right == 1
    assert type(ref_data["tup"]) is tuple and type(ref_data["size"]) is torch.Size
    assert ref_data["s"] == {1, 2} and ref_data["fs"] == frozenset({"a"})
    assert type(ref_data["box"]) is Box and ref_data["box"].right[0] is ref_data["box"].left
    assert ref_data["param"] == xser.TensorReference(1) and tensors[1] is data["param"]
    assert len(tensors) == 2


def test_inputs_are_not_modified():
    t = torch.ones(2)
    box = Box(t, {"k": [t]})
    data = {"box": box, "l": [t]}
    snapshot = copy.copy(data)
    xser.to_refs(data)
    assert data == snapshot and box.left is t and box.right["k"][0] is t and data["l"][0] is t


def test_cycles_terminate_and_are_kept():
    t = torch.ones(1)
    lst = [t]
    lst.append(lst)
    d = {"t": t}
    d["self"] = d
    ref_data, tensors = xser.to_refs({"l": lst, "d": d, "tup": (lst,)})
    assert len(tensors) == 1
    assert ref_data["l"][1] is ref_data["l"] and ref_data["d"]["self"] is ref_data["d"]
    assert ref_data["tup"][0] is ref_data["l"]
    back = xser.from_refs(ref_data, lambda tid: tensors[tid])
    assert back["l"][1] is back["l"] and back["l"][0] is t


def test_objects_that_cannot_be_rebuilt_are_kept_as_is():
    class NoCopy:
        def __init__(self):
            self.x = 1

        def __reduce_ex__(self, protocol):
            raise TypeError("no copies")

    odd = NoCopy()
    data = {"odd": odd, "fn": test_cycles_terminate_and_are_kept, "mod": torch, "cls": Box, "t": torch.ones(1)}
    ref_data, tensors = xser.to_refs(data)
    assert ref_data["odd"] is odd and ref_data["fn"] is data["fn"] and ref_data["mod"] is torch
    assert ref_data["cls"] is Box and len(tensors) == 1


def test_inline_tensors_pass_through_from_refs():
    inline = torch.arange(3)
    refs = {"inline": inline, "ref": xser.TensorReference(0)}
    back = xser.from_refs(refs, lambda tid: torch.zeros(1))
    assert back["inline"] is inline and torch.equal(back["ref"], torch.zeros(1))


def test_reference_pickles_under_torch_xla_name():
    ref_data, _ = xser.to_refs({"a": torch.ones(1)})
    buf = io.BytesIO()
    xser.dump_refs(ref_data, buf)
    import zipfile

    with zipfile.ZipFile(io.BytesIO(buf.getvalue())) as zf:
        pkl = zf.read(next(n for n in zf.namelist() if n.endswith("data.pkl")))
    assert b"ctorch_xla.utils.serialization\nTensorReference\n" in pkl
    assert b"xser" not in pkl
    back = xser.load_refs(io.BytesIO(buf.getvalue()))
    assert type(back["a"]) is xser.TensorReference and back["a"].tid == 0


@pytest.mark.parametrize("trusted", [False, True])
def test_load_refs_maps_class_to_ours(trusted):
    buf = io.BytesIO()
    xser.dump_refs([xser.TensorReference(3), xser.TensorReference(3)], buf)
    buf.seek(0)
    back = xser.load_refs(buf, trusted=trusted)
    assert [type(r) for r in back] == [xser.TensorReference] * 2 and back[0].tid == 3


def _generic_to_refs(data):
    """to_refs as the generic rewriter does it (no tracing): the reference traced_refs must equal."""
    tensors = []

    def convert(t):
        tensors.append(t)
        return xser.TensorReference(len(tensors) - 1)

    return xser.refs._Rewriter(lambda x: isinstance(x, torch.Tensor), convert)(data), tensors


def _pickled(ref_data) -> bytes:
    buf = io.BytesIO()
    xser.dump_refs(ref_data, buf)
    return buf.getvalue()


@SETTINGS
@given(nested(POOL))
def test_traced_refs_gives_the_generic_walks_tids_and_pickle(data):
    traced = xser.traced_refs(data)
    ref_data, tensors = _generic_to_refs(data)
    assert [id(t) for t in traced.tensors] == [id(t) for t in tensors]
    assert _pickled(traced.ref_data) == _pickled(ref_data)


@SETTINGS
@given(nested(POOL))
def test_traced_paths_are_the_key_paths_of_the_ref_data(data):
    traced = xser.traced_refs(data)
    assert traced.paths == xser.key_paths(traced.ref_data)


@SETTINGS
@given(nested(POOL, custom=False))
def test_plain_data_is_self_contained(data):
    assert xser.traced_refs(data).self_contained


def test_a_container_met_inside_an_object_first_keeps_its_plain_path():
    t = torch.zeros(1)
    shared = {"w": t}
    traced = xser.traced_refs([Box(shared, 1), {"plain": shared}])
    assert traced.paths == {0: "1/plain/w"} == xser.key_paths(traced.ref_data)


def test_traced_paths_of_a_state_dict():
    a, b = torch.zeros(2), torch.ones(3)
    sd = OrderedDict([("w", a), ("tied", a)])
    sd._metadata = {"": {"version": 1}}
    osd = {"state": {0: {"exp_avg": b, "step": torch.tensor(1.0)}}, "param_groups": [{"lr": 0.1, "params": [0]}]}
    traced = xser.traced_refs({"model": sd, "optim": osd, "seq": (a, [b])})
    assert traced.paths == {0: "model/w", 1: "optim/state/0/exp_avg", 2: "optim/state/0/step"}
    assert traced.self_contained


@pytest.mark.parametrize("leaf", [bytearray(b"ab"), Box(1, 2), memoryview(b"ab"), {}.get, slice([1], None),
                                  collections.defaultdict(list), lambda: 1],
                         ids=["bytearray", "object", "view", "bound method", "slice of a list", "dict subclass",
                              "lambda"])
def test_traced_refs_is_not_self_contained_with_a_mutable_leaf(leaf):
    traced = xser.traced_refs({"w": torch.zeros(1), "x": [leaf]})
    assert not traced.self_contained
    assert traced.paths == {0: "w"}


def test_a_tensor_inside_an_object_has_no_path():
    t = torch.zeros(1)
    traced = xser.traced_refs({"box": Box(t, 1)})
    assert traced.tensors == [t] and traced.paths == {}
