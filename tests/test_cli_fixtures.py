"""Builders of small checkpoints on disk for the offline-tool tests (imported by test_cli_*, test_zero1_convert,
test_export), plus sanity tests of the builders themselves.

Files are written the way a save writes them: xser ref + ``.info.pt`` + one file per tensor (or one torch.save
file without xser), each through LocalStorage so the manifest gets the real sizes and CRC32Cs.
"""
from __future__ import annotations

import json
import os
from typing import Dict, Optional, Tuple

import torch

import xser
from nxd_ckpt import layout
from nxd_ckpt import manifest as manifest_mod
from nxd_ckpt.storage import LocalStorage, open_storage
from nxd_ckpt.testing.zero1_adam import shard_of


def upload(local_dir: str, url: str) -> str:
    """Copy a local tree to a path or URL (any backend), key for key; returns ``url``."""
    src, dst = LocalStorage(local_dir), open_storage(url)
    for rel in src.list(""):
        dst.write_bytes(rel, src.read(rel))
    return url


def download(url: str, local_dir: str) -> str:
    """Copy the tree at a path or URL to a local directory; returns ``local_dir``."""
    src, dst = open_storage(url), LocalStorage(local_dir)
    for rel in src.list(""):
        dst.write_bytes(rel, src.read(rel))
    return local_dir


def _paths(ref_data, path=()):
    """{tid: '/'-joined key path} of each TensorReference (first occurrence)."""
    out = {}

    def walk(obj, p):
        if xser.is_ref(obj):
            out.setdefault(obj.tid, "/".join(map(str, p)))
        elif isinstance(obj, dict):
            for k, v in obj.items():
                walk(v, p + (k,))
        elif isinstance(obj, (list, tuple)):
            for i, v in enumerate(obj):
                walk(v, p + (i,))

    walk(ref_data, path)
    return out


def write_shard(store: LocalStorage, tag: str, rel: str, state, use_xser: bool = True,
                attrs: Optional[Dict[str, dict]] = None, info_partition: bool = True):
    """Write one shard; return ({relpath: file entry}, {tid: manifest tensor meta})."""
    attrs = attrs or {}
    files = {}
    meta = {}
    if use_xser:
        ref, tensors = xser.to_refs(state)
        paths = _paths(ref)
        info = {}
        for tid, t in enumerate(tensors):
            r = layout.tensor_path(rel, tid)
            rec = store.write_file(f"{tag}/{r}", lambda f, t=t: xser.write_tensor(t, f))
            files[r] = rec.to_json()
            key = paths.get(tid, "")
            extra = attrs.get(key, {})
            info[tid] = {"dtype": t.dtype, "shape": t.shape, "expert_model_parallel": False}
            if info_partition:
                info[tid].update({k: v for k, v in extra.items() if k != "expert_model_parallel"})
            meta[str(tid)] = {"dtype": str(t.dtype).replace("torch.", ""), "shape": list(t.shape), "key": key, **extra}
        rec = store.write_file(f"{tag}/{layout.info_path(rel)}", lambda f: torch.save(info, f))
        files[layout.info_path(rel)] = rec.to_json()
        rec = store.write_file(f"{tag}/{rel}", lambda f: xser.dump_refs(ref, f))
        files[rel] = rec.to_json()
    else:
        rec = store.write_file(f"{tag}/{rel}", lambda f: torch.save(state, f))
        files[rel] = rec.to_json()
        _ref, tensors = xser.to_refs(state)
        paths = _paths(_ref)
        for tid, t in enumerate(tensors):
            key = paths.get(tid, "")
            meta[str(tid)] = {"dtype": str(t.dtype).replace("torch.", ""), "shape": list(t.shape), "key": key,
                              **attrs.get(key, {})}
    return files, meta


def write_tag(root: str, tag: str, *, model: Optional[Dict[Tuple[int, int], dict]] = None,
              optim: Optional[Dict[Tuple[int, int, int], dict]] = None, attrs: Optional[Dict[str, dict]] = None,
              use_xser: bool = True, manifest: bool = True, done: bool = True, topology: Optional[dict] = None,
              zero1: bool = False, scheduler=None, user_content=None, info_partition: bool = True,
              newest: Optional[bool] = None) -> str:
    """A tag directory ``root/tag``. model: {(tp, pp): state dict}; optim: {(dp, tp, pp): state}."""
    store = LocalStorage(root)
    store.makedirs(tag)
    store.write_file(f"{tag}/{layout.CHECKPOINT_MARKER}", lambda f: f.write(b"1"))
    files: Dict[str, dict] = {}
    tensors: Dict[str, dict] = {}
    for (tp, pp), sd in sorted((model or {}).items()):
        rel = f"model/{layout.shard_filename(0, tp, pp)}"
        f, m = write_shard(store, tag, rel, sd, use_xser, attrs, info_partition)
        files.update(f)
        tensors[rel] = m
    for (dp, tp, pp), sd in sorted((optim or {}).items()):
        rel = f"optim/{layout.shard_filename(dp, tp, pp)}"
        f, m = write_shard(store, tag, rel, sd, use_xser)
        files.update(f)
        tensors[rel] = m
    for name, obj in ((layout.SCHEDULER_FILE, scheduler), (layout.USER_CONTENT_FILE, user_content)):
        if obj is not None:
            rec = store.write_file(f"{tag}/{name}", lambda f, obj=obj: torch.save(obj, f))
            files[name] = rec.to_json()
    for e in files.values():
        e["rank"] = 0
    if manifest:
        keys = list(model or {}) + [k[1:] for k in (optim or {})]
        tp = 1 + max((k[0] for k in keys), default=0)
        pp = 1 + max((k[1] for k in keys), default=0)
        dp = 1 + max((k[0] for k in (optim or {})), default=0) if zero1 else 1
        topo = topology or {"world_size": tp * pp * dp, "tp": tp, "pp": pp, "dp": dp, "cp": 1, "ep": 1}
        flags = {"zero1": zero1, "xser": use_xser, "has_model": bool(model), "has_optim": bool(optim)}
        body = manifest_mod.build(tag, topo, flags, files, tensors).body()
        store.write_file(f"{tag}/{layout.MANIFEST_FILE}", lambda f: f.write(body))
    if done:
        store.write_file(f"{tag}/{layout.DONE_MARKER}", lambda f: f.write(b"1"))
    if newest if newest is not None else manifest:
        store.write_file(layout.NEWEST_FILE, lambda f: f.write(tag.encode()))
    return os.path.join(root, tag)


# --- ZeRO-1 states ------------------------------------------------------------------------------------------
SHAPES = {0: (10, 3), 1: (7,), 2: (), 3: (8, 2), 4: (3,), 5: (1, 5)}


def full_zero1_params(shapes=None, seed: int = 0):
    """{i: {"exp_avg", "exp_avg_sq", "master"}} full tensors per parameter."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for i, shape in (shapes or SHAPES).items():
        out[i] = {k: torch.randn(shape, generator=g) for k in ("exp_avg", "exp_avg_sq", "master")}
        out[i]["exp_avg_sq"] = out[i]["exp_avg_sq"].abs()
    return out


def zero1_states(full, dp: int, masters: bool = True, step: float = 7.0):
    """The ZeRO-1 state dict of each DP rank (DESIGN 2.4) for the full tensors ``full``."""
    states = []
    for r in range(dp):
        sd = {
            "state": {},
            "param_groups": [{"lr": 0.01, "betas": (0.9, 0.999), "eps": 1e-8, "params": sorted(full)}],
            "base_state": {i: {"step": torch.tensor(step),
                               "exp_avg": shard_of(v["exp_avg"], r, dp),
                               "exp_avg_sq": shard_of(v["exp_avg_sq"], r, dp)} for i, v in full.items()},
            "shape_info": {i: torch.Size(v["exp_avg"].shape) for i, v in full.items()},
        }
        if masters:
            sd["sharded_master_weights"] = {i: shard_of(v["master"], r, dp) for i, v in full.items()}
        states.append(sd)
    return states


def small_model(tp: int = 0, pp: int = 0):
    g = torch.Generator().manual_seed(100 + tp + 10 * pp)
    return {"w": torch.randn(4, 4, generator=g), "b": torch.randn(4, generator=g)}


def zero1_tag(root: str, tag: str, dp: int = 4, tp: int = 1, pp: int = 1, use_xser: bool = True,
              manifest: bool = True, full=None, masters: bool = True):
    """A complete tag with model/ (per tp, pp), ZeRO-1 optim/ at ``dp`` and the small files."""
    full = full if full is not None else {(t, p): full_zero1_params(seed=t + 10 * p) for t in range(tp) for p in range(pp)}
    optim = {}
    for (t, p), f in full.items():
        for d, sd in enumerate(zero1_states(f, dp, masters)):
            optim[(d, t, p)] = sd
    model = {(t, p): small_model(t, p) for t in range(tp) for p in range(pp)}
    path = write_tag(root, tag, model=model, optim=optim, use_xser=use_xser, manifest=manifest, zero1=True,
                     scheduler={"last_epoch": 3, "base_lrs": [0.01]}, user_content={"step": 3})
    return path, full


def load_shard(tagdir: str, rel: str):
    """A whole shard (xser or plain), trusted=False."""
    path = os.path.join(tagdir, rel)
    if os.path.isdir(path + ".tensors"):
        return xser.load(path)
    return torch.load(path, map_location="cpu", weights_only=True)


def assert_bit_equal(a, b, where="") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), where
        assert a.dtype == b.dtype and a.shape == b.shape, f"{where}: {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}"
        assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and list(a.keys()) == list(b.keys()), f"{where}: {list(a)} vs {list(b)}"
        for k in a:
            assert_bit_equal(a[k], b[k], f"{where}/{k}")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_bit_equal(x, y, f"{where}/{i}")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


# --- sanity of the builders ---------------------------------------------------------------------------------
def test_builders_write_loadable_zero1_tag(tmp_path):
    path, full = zero1_tag(str(tmp_path), "t", dp=4)
    sd = load_shard(path, "optim/dp_rank_03_tp_rank_00_pp_rank_00.pt")
    assert_bit_equal(sd["base_state"][0]["exp_avg"], shard_of(full[(0, 0)][0]["exp_avg"], 3, 4))
    man = json.load(open(os.path.join(path, "manifest.json")))
    assert man["zero1"] and man["topology"]["dp"] == 4
    assert os.path.isfile(os.path.join(path, "done"))
