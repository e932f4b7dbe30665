"""Tensor <-> TensorReference rewriting of nested Python data.

``to_refs`` walks the data depth-first in the same order as torch-xla's ``ToXlaTensorArena`` (dict keys
before values, list/tuple/set elements in iteration order, object attributes in ``__dict__`` order), so the
same data gets the same tids as ``torch_xla.utils.serialization.save``. Unlike torch-xla, container types are
kept (tuples stay tuples, OrderedDict stays OrderedDict, namedtuples stay namedtuples).
"""
from __future__ import annotations

import collections
import contextlib
import copy
import types
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Tuple

import torch

#: Where torch-xla defines the class; ref files name it so that torch-xla's ``load`` can read them.
TORCH_XLA_MODULE = "torch_xla.utils.serialization"
TORCH_XLA_NAME = "TensorReference"


class TensorReference:
    """Placeholder for tensor ``tid`` in a ref file. Pickled as ``torch_xla.utils.serialization.TensorReference``."""

    def __init__(self, tid: int):
        self.tid = tid

    def __repr__(self) -> str:
        return f"TensorReference({self.tid!r})"

    def __eq__(self, other) -> bool:
        return is_ref(other) and other.tid == self.tid

    def __hash__(self) -> int:
        return hash(("TensorReference", self.tid))


def is_ref(obj: Any) -> bool:
    """True for our TensorReference and for torch-xla's (when a caller unpickled with torch-xla's class)."""
    if isinstance(obj, TensorReference):
        return True
    cls = type(obj)
    return cls.__name__ == TORCH_XLA_NAME and cls.__module__ == TORCH_XLA_MODULE and hasattr(obj, "tid")


# Values returned as they are: no tensors can hide inside them.
_ATOMIC = (type(None), bool, int, float, complex, str, bytes, bytearray, range, slice, type(Ellipsis),
           torch.dtype, torch.device, torch.layout, torch.memory_format, torch.Size)
# The exact types among them whose values cannot change after the call.
_IMMUTABLE = frozenset(t for t in _ATOMIC if t not in (bytearray, slice))   # a slice may hold a list
# Objects that have a __dict__ but are code or namespaces, not data: never copied.
_OPAQUE = (type, types.FunctionType, types.MethodType, types.BuiltinFunctionType, types.ModuleType,
           types.CodeType, types.MethodWrapperType, types.WrapperDescriptorType)


class _Rewriter:
    """One depth-first rewrite: ``leaf(x)`` decides what is replaced, ``convert(x)`` gives the replacement.

    Results are memoised by ``id`` of the original, so an object met twice (a tied weight, a shared
    sub-dict, a cycle) is converted once and comes back shared.
    """

    def __init__(self, leaf: Callable[[Any], bool], convert: Callable[[Any], Any]):
        self.leaf = leaf
        self.convert = convert
        self.memo: Dict[int, Any] = {}

    def __call__(self, value: Any) -> Any:
        if isinstance(value, _ATOMIC):
            return value
        key = id(value)
        if key in self.memo:
            return self.memo[key]
        if self.leaf(value):
            result = self.memo[key] = self.convert(value)
            return result
        if isinstance(value, torch.Tensor):
            return value  # a tensor that stays inline (e.g. in a ref file written by a converter)
        if isinstance(value, dict):
            return self._dict(value)
        if isinstance(value, list):
            return self._list(value)
        if isinstance(value, tuple):
            return self._finish(value, self._tuple(value, self._elements(value)))
        if isinstance(value, (set, frozenset)):
            return self._set(value)
        if hasattr(value, "__dict__") and not isinstance(value, _OPAQUE):
            return self._object(value)
        return self._kept(value)

    def _elements(self, value: tuple) -> List[Any]:
        return [self(x) for x in value]

    def _kept(self, value: Any) -> Any:
        """An object returned as it is (no __dict__ to rewrite, or code)."""
        return value

    def _finish(self, value: Any, result: Any) -> Any:
        """Memoise an immutable container built after its children (a cycle may have built it already)."""
        return self.memo.setdefault(id(value), result)

    def _dict(self, value: dict) -> dict:
        result = _empty_like(value, dict)
        self.memo[id(value)] = result
        for k, v in value.items():
            k = self(k)
            result[k] = self(v)
        self._attrs(result)
        return result

    def _list(self, value: list) -> list:
        result = _empty_like(value, list)
        self.memo[id(value)] = result
        for x in value:
            result.append(self(x))
        self._attrs(result)
        return result

    @staticmethod
    def _tuple(value: tuple, items: List[Any]) -> tuple:
        cls = type(value)
        if cls is tuple:
            return tuple(items)
        if hasattr(cls, "_make"):
            return cls._make(items)  # namedtuple
        try:
            return cls(items)
        except Exception:
            return tuple(items)

    def _set(self, value):
        items = [self(x) for x in value]
        if type(value) is set:
            result = set(items)
        elif type(value) is frozenset:
            result = frozenset(items)
        else:
            try:
                result = type(value)(items)
            except Exception:
                result = set(items) if isinstance(value, set) else frozenset(items)
        return self._finish(value, result)

    def _object(self, value: Any) -> Any:
        """A custom object: a shallow copy of the same class with its attributes rewritten."""
        try:
            result = copy.copy(value)
        except Exception:
            result = value
        if result is value or not isinstance(getattr(result, "__dict__", None), dict):
            self.memo[id(value)] = value  # cannot be rebuilt: kept as it is
            return value
        self.memo[id(value)] = result
        self._attrs(result)
        return result

    def _attrs(self, obj: Any) -> None:
        """Rewrite the instance attributes of a (copied) object in place, in ``__dict__`` order."""
        attrs = getattr(obj, "__dict__", None)
        if isinstance(attrs, dict):
            for name in list(attrs):
                attrs[name] = self(attrs[name])


def _empty_like(value, base: type):
    """An empty container of ``value``'s own type (dict/list subclasses kept where possible)."""
    cls = type(value)
    if cls is base:
        return base()
    try:
        result = copy.copy(value)  # keeps e.g. defaultdict's default_factory and instance attributes
        result.clear()              # (such as a state dict's ``_metadata``)
        return result
    except Exception:
        try:
            result = cls()
            result.__dict__.update(getattr(value, "__dict__", {}))
            return result
        except Exception:
            return base()


def to_refs(data: Any) -> Tuple[Any, List[torch.Tensor]]:
    """Copy of ``data`` with every tensor replaced by ``TensorReference(tid)``, and the tensors by tid.

    tids follow depth-first first-encounter order; the same tensor object met twice gets one tid.
    The returned tensors are the original objects (XLA or CPU), not copies.
    """
    refs = traced_refs(data)
    return refs.ref_data, refs.tensors


@dataclass
class TracedRefs:
    """``to_refs`` plus what a checkpoint writer needs from the same walk.

    ``paths``: tid -> '/'-joined dict keys and list/tuple indices of the tensor's first occurrence in the ref data
    reached through dicts, lists and tuples alone (``key_paths``; a tensor met only inside a custom object or a
    set has none). ``self_contained``: ``ref_data`` is made of fresh plain containers, references and immutable
    values alone, so it can be pickled later, on another thread, with the same bytes whatever the caller mutates
    meanwhile (and pickling it cannot fail)."""

    ref_data: Any
    tensors: List[torch.Tensor]
    paths: Dict[int, str]
    self_contained: bool


def traced_refs(data: Any) -> TracedRefs:
    """``to_refs`` (same tids, same copy) that also records key paths and whether the copy is self-contained."""
    walk = _TracingRewriter()
    ref_data = walk(data)
    paths = walk.paths if walk.exact_paths else key_paths(ref_data)
    return TracedRefs(ref_data, walk.tensors, paths, walk.self_contained)


def key_paths(ref_data: Any) -> Dict[int, str]:
    """tid -> '/'-joined key path of each reference in ``ref_data`` (first occurrence through dicts, lists and
    tuples; dict keys as ``str``)."""
    out: Dict[int, str] = {}

    def walk(obj, path):
        if is_ref(obj):
            out.setdefault(obj.tid, "/".join(path))
        elif isinstance(obj, dict):
            for k, v in obj.items():
                walk(v, path + [str(k)])
        elif isinstance(obj, (list, tuple)):
            for i, v in enumerate(obj):
                walk(v, path + [str(i)])

    walk(ref_data, [])
    return out


_PLAIN_CONTAINERS = frozenset((dict, list, collections.OrderedDict, set, frozenset))


class _TracingRewriter(_Rewriter):
    """to_refs' walk. The key path is kept on a stack; inside a custom object, a set, a dict key or a container's
    attributes it is not (``_hidden``), as ``key_paths`` over the ref data would not see it. A container first met
    there and again in plain sight is not walked twice (memo): then the paths are not known exactly
    (``exact_paths``) and ``key_paths`` walks the ref data instead (rare: state dicts never do)."""

    def __init__(self):
        super().__init__(_is_tensor, None)
        self.tensors: List[torch.Tensor] = []
        self.paths: Dict[int, str] = {}
        self.self_contained = True
        self.exact_paths = True
        self._path: List[str] = []
        self._hidden = 0
        self._hidden_first: set = set()

    def __call__(self, value: Any) -> Any:
        if isinstance(value, torch.Tensor):      # the leaf, first: most of a state dict
            ref = self.memo.get(id(value))
            if ref is None:
                ref = self.memo[id(value)] = TensorReference(len(self.tensors))
                self.tensors.append(value)
            if not self._hidden and ref.tid not in self.paths:
                self.paths[ref.tid] = "/".join(self._path)
            return ref
        if isinstance(value, _ATOMIC):
            if type(value) not in _IMMUTABLE:
                self.self_contained = False      # a bytearray, a slice, a subclass that may carry attributes
            return value
        key = id(value)
        if key in self.memo:
            if not self._hidden and key in self._hidden_first:
                self.exact_paths = False
            return self.memo[key]
        if self._hidden:
            self._hidden_first.add(key)
        if type(value) not in _PLAIN_CONTAINERS and isinstance(value, (dict, list, set, frozenset)):
            self.self_contained = False          # a subclass's own state (slots, a default factory) is shared
        return super().__call__(value)

    def _dict(self, value: dict) -> dict:
        result = _empty_like(value, dict)
        self.memo[id(value)] = result
        path = self._path
        for k, v in value.items():
            if type(k) is not str:      # most keys are, and are kept as they are
                self._hidden += 1
                k = self(k)
                self._hidden -= 1
            path.append(k if type(k) is str else str(k))    # the ref data's key, as key_paths names it
            result[k] = self(v)
            path.pop()
        self._attrs(result)
        return result

    def _list(self, value: list) -> list:
        result = _empty_like(value, list)
        self.memo[id(value)] = result
        result.extend(self._elements(value))
        self._attrs(result)
        return result

    def _elements(self, value) -> List[Any]:
        path, out = self._path, []
        for i, x in enumerate(value):
            path.append(str(i))
            out.append(self(x))
            path.pop()
        return out

    @contextlib.contextmanager
    def _out_of_sight(self):
        """Where ``key_paths`` over the ref data would not look: a set, an object, a container's attributes."""
        self._hidden += 1
        try:
            yield
        finally:
            self._hidden -= 1

    def _set(self, value):
        with self._out_of_sight():
            return super()._set(value)

    def _object(self, value: Any) -> Any:
        self.self_contained = False      # its class's pickling may read state the caller can change
        with self._out_of_sight():
            return super()._object(value)

    def _attrs(self, obj: Any) -> None:
        if getattr(obj, "__dict__", None):
            with self._out_of_sight():
                super()._attrs(obj)

    def _kept(self, value: Any) -> Any:
        # A class pickles by name; anything else kept as it is (a NumPy array, a bound method and its object, a
        # lambda, which cannot be pickled at all) is pickled now, from the caller's live object
        if not isinstance(value, type):
            self.self_contained = False
        return value


def _is_tensor(value: Any) -> bool:
    return isinstance(value, torch.Tensor)


def from_refs(ref_data: Any, get_tensor: Callable[[int], torch.Tensor]) -> Any:
    """Inverse of ``to_refs``: each reference replaced by ``get_tensor(tid)``, called once per tid.

    References with the same tid come back as the same tensor object. Tensors already inline in
    ``ref_data`` are passed through unchanged.
    """
    cache: Dict[Any, torch.Tensor] = {}

    def convert(ref) -> torch.Tensor:
        tid = ref.tid
        if tid not in cache:
            cache[tid] = get_tensor(tid)
        return cache[tid]

    return _Rewriter(is_ref, convert)(ref_data)


def collect_tids(ref_data: Any) -> List[int]:
    """The tids referenced in ``ref_data``, in first-encounter order, without duplicates."""
    tids: Dict[Any, None] = {}

    def note(ref):
        tids.setdefault(ref.tid, None)
        return ref

    _Rewriter(is_ref, note)(ref_data)
    return list(tids)
