"""The offline tools on every backend: convert-zero1, export, ls, info and verify read and write a POSIX
directory, the in-memory object store (``mem://``, marker commit, no rename) and a shared-directory object
store (``objdir://``, which worker processes can open too), and S3 (a moto server on 127.0.0.1). Each backend's
output is the local run's output, file for file and byte for byte (the manifest aside, which names its
source), and a failed run leaves nothing behind."""
from __future__ import annotations

import json
import os
import uuid

import pytest
import torch

from nxd_ckpt import layout
from nxd_ckpt.cli import main
from nxd_ckpt.storage import LocalStorage, open_storage
from nxd_ckpt.storage.testing import enable_test_schemes
from test_cli_fixtures import assert_bit_equal, download, load_shard, upload, zero1_states, zero1_tag

# Files whose bytes name the run (the source path in the manifest; `done` seals the manifest).
_NAMED = {layout.MANIFEST_FILE, layout.DONE_MARKER}


# mem:// and objdir:// for this module (and the worker processes it forks); left on, as the other modules that
# enable them at import expect (disabling them here would refuse their URLs in the tests that run after).
enable_test_schemes()


def _base(kind: str, tmp_path) -> str:
    """A fresh, empty location of backend ``kind``."""
    if kind == "local":
        return str(tmp_path / "store")
    if kind == "mem":
        return f"mem://b-{uuid.uuid4().hex[:8]}/run"
    return f"objdir://{tmp_path}/objects//run"


BACKENDS = ["local", "mem", "objdir"]


def assert_same_tree(got_url: str, want_dir: str) -> None:
    """The tree at ``got_url`` has exactly ``want_dir``'s files with the same bytes (the manifest and `done`
    aside: they name the source)."""
    got, want = open_storage(got_url), LocalStorage(want_dir)
    assert got.list("") == want.list("")
    for rel in want.list(""):
        if rel not in _NAMED:
            assert got.read(rel) == want.read(rel), rel


def _run(*argv) -> int:
    return main(list(argv))


@pytest.mark.parametrize("kind", BACKENDS)
def test_convert_zero1_on_each_backend_matches_the_local_run(kind, tmp_path, capsys):
    src_local, full = zero1_tag(str(tmp_path / "local"), "step_3", dp=4, tp=2)
    ref_out = str(tmp_path / "local" / "step_3_dp2")
    assert _run("convert-zero1", "--input_dir", src_local, "--output_dir", ref_out, "--convert_to_sharded",
                "--dp_size", "2") == 0
    base = _base(kind, tmp_path)
    upload(src_local, f"{base}/step_3")
    workers = "1" if kind == "mem" else "2"    # mem:// lives in this process: its conversion runs inline
    assert _run("convert-zero1", "--input_dir", f"{base}/step_3", "--output_dir", f"{base}/step_3_dp2",
                "--convert_to_sharded", "--dp_size", "2", "--num_workers", workers) == 0, capsys.readouterr().err
    assert_same_tree(f"{base}/step_3_dp2", ref_out)
    assert open_storage(base).listdir("") == ["step_3", "step_3_dp2"]   # no staging debris, no `newest`
    got = download(f"{base}/step_3_dp2", str(tmp_path / "got"))
    for tp in range(2):
        for r in range(2):
            assert_bit_equal(zero1_states(full[(tp, 0)], 2)[r],
                             load_shard(got, f"optim/{layout.shard_filename(r, tp, 0)}"), f"tp {tp} dp {r}")
    capsys.readouterr()
    assert _run("verify", f"{base}/step_3_dp2", "--json") == 0
    assert json.loads(capsys.readouterr().out)["ok"] is True


@pytest.mark.parametrize("kind", BACKENDS)
def test_convert_zero1_of_an_optim_folder_and_to_full(kind, tmp_path):
    src_local, full = zero1_tag(str(tmp_path / "local"), "t", dp=4)
    base = _base(kind, tmp_path)
    upload(src_local, f"{base}/t")
    assert _run("convert-zero1", "--input_dir", f"{base}/t/optim", "--output_dir", f"{base}/optim_dp2",
                "--convert_to_sharded", "--dp_size", "2") == 0
    names = open_storage(f"{base}/optim_dp2").listdir("")
    assert names == sorted(n for r in range(2) for n in (layout.shard_filename(r, 0, 0),
                                                         layout.shard_filename(r, 0, 0) + ".info.pt",
                                                         layout.shard_filename(r, 0, 0) + ".tensors"))
    assert _run("convert-zero1", "--input_dir", f"{base}/t", "--output_dir", f"{base}/full", "--convert_to_full") == 0
    got = download(f"{base}/full", str(tmp_path / "got"))
    merged = load_shard(got, "optim/full_tp_rank_00_pp_rank_00.pt")
    for i, f in full[(0, 0)].items():
        assert_bit_equal(f["exp_avg"], merged["base_state"][i]["exp_avg"], f"param {i}")


@pytest.mark.parametrize("kind", ["mem", "objdir"])
def test_failed_conversion_on_an_object_store_leaves_nothing(kind, tmp_path, capsys):
    """A damaged input tensor stops the conversion after it wrote part of the new tag: the message names
    the file, and not one key of the new tag remains (no `done`, no `checkpoint`, no debris)."""
    src_local, _ = zero1_tag(str(tmp_path / "local"), "t", dp=2)
    base = _base(kind, tmp_path)
    upload(src_local, f"{base}/t")
    st = open_storage(f"{base}/t")
    rel = layout.tensor_path(f"optim/{layout.shard_filename(1, 0, 0)}", 1)
    data = bytearray(st.read(rel))
    data[-30] ^= 0xFF
    st.write_bytes(rel, bytes(data))
    assert _run("convert-zero1", "--input_dir", f"{base}/t", "--output_dir", f"{base}/out", "--convert_to_sharded",
                "--dp_size", "4") == 1
    assert f"{base}/t/{rel}" in capsys.readouterr().err
    assert open_storage(base).listdir("") == ["t"]


@pytest.mark.parametrize("kind", ["mem", "objdir"])
def test_overwrite_on_an_object_store(kind, tmp_path, capsys):
    src_local, full = zero1_tag(str(tmp_path / "local"), "t", dp=2)
    base = _base(kind, tmp_path)
    upload(src_local, f"{base}/t")
    open_storage(f"{base}/out").write_bytes("old.txt", b"x")
    args = ["convert-zero1", "--input_dir", f"{base}/t", "--output_dir", f"{base}/out", "--convert_to_sharded",
            "--dp_size", "4"]
    assert _run(*args) == 1
    assert "not empty" in capsys.readouterr().err and open_storage(f"{base}/out").isfile("old.txt")
    assert _run(*args, "--overwrite") == 0
    out = open_storage(f"{base}/out")
    assert not out.isfile("old.txt") and out.isfile(layout.DONE_MARKER)
    got = download(f"{base}/out", str(tmp_path / "got"))
    for r in range(4):
        assert_bit_equal(zero1_states(full[(0, 0)], 4)[r], load_shard(got, f"optim/{layout.shard_filename(r, 0, 0)}"))
    assert _run("convert-zero1", "--input_dir", f"{base}/t", "--output_dir", f"{base}/t/optim/x",
                "--convert_to_full") == 1
    assert "inside the input directory" in capsys.readouterr().err


def _tp2_tag(root: str) -> str:
    from test_export import tp_pp_tag

    tag, _expected = tp_pp_tag(root)
    return tag


@pytest.mark.parametrize("kind", BACKENDS)
def test_export_on_each_backend_matches_the_local_run(kind, tmp_path):
    tag = _tp2_tag(tmp_path / "local")
    ref_out = str(tmp_path / "hf_local")
    assert _run("export", tag, "--output", ref_out, "--max-shard-size", "200B") == 0
    assert len(os.listdir(ref_out)) > 2     # several files and the index
    base = _base(kind, tmp_path)
    upload(tag, f"{base}/t")
    assert _run("export", f"{base}/t", "--output", f"{base}/hf", "--max-shard-size", "200B") == 0
    assert_same_tree(f"{base}/hf", ref_out)
    assert open_storage(base).listdir("") == ["hf", "t"]
    # and from the backend to a local directory
    assert _run("export", f"{base}/t", "--output", str(tmp_path / "hf2"), "--max-shard-size", "200B") == 0
    assert_same_tree(str(tmp_path / "hf2"), ref_out)


@pytest.mark.parametrize("kind", ["mem", "objdir"])
def test_ls_info_verify_on_an_object_store_match_local(kind, tmp_path, capsys):
    root = str(tmp_path / "local")
    zero1_tag(root, "a", dp=2)
    zero1_tag(root, "b", dp=4, tp=2)
    base = _base(kind, tmp_path)
    upload(root, base)
    out = {}
    for where in (root, base):
        assert _run("ls", where, "--json") == 0
        rows = json.loads(capsys.readouterr().out)
        assert _run("info", f"{where}/b", "--json") == 0
        info = json.loads(capsys.readouterr().out)
        assert _run("verify", where, "--json") == 0
        ok = json.loads(capsys.readouterr().out)["ok"]
        out[where] = ([{k: r[k] for k in ("tag", "status", "size", "files", "tp", "pp", "dp", "zero1", "xser")}
                       for r in rows], {k: info[k] for k in ("status", "topology", "tensor_count", "total_bytes")}, ok)
    assert out[root] == out[base]
    assert [r["tag"] for r in out[base][0]] == ["b", "a"] and out[base][2] is True


def test_listed_storage_answers_from_one_listing(tmp_path):
    """ListedStorage: every metadata question from the listing, reads from the backend with the size known."""
    from nxd_ckpt.storage.listed import listed

    url = _base("mem", tmp_path)
    st = open_storage(url)
    for rel in ("a/done", "a/model/x.pt", "a/model/x.pt.tensors/tensor_0.pt", "b/checkpoint", "top"):
        st.write_bytes(rel, rel.encode())
    calls = []
    inner_list_stats = st.list_stats
    st.list_stats = lambda prefix="": calls.append(prefix) or inner_list_stats(prefix)
    view = listed(st)
    a = view.child("a")
    assert view.listdir("") == ["a", "b", "top"] and a.listdir("model") == ["x.pt", "x.pt.tensors"]
    assert view.isdir("a/model") and not view.isdir("a/done") and a.isfile("done") and not a.isfile("model")
    assert a.list("model") == ["model/x.pt", "model/x.pt.tensors/tensor_0.pt"] and a.size("model/x.pt") == 12
    assert a.read("model/x.pt") == b"a/model/x.pt" and a.root == f"{url}/a"
    with pytest.raises(FileNotFoundError):
        a.stat("model")      # an object store has no directory times
    with pytest.raises(PermissionError):
        a.write_bytes("new", b"1")
    assert calls == [""]


# --- S3: a real S3-compatible server on 127.0.0.1 ---------------------------------------------------------
from s3_fixtures import moto_endpoint, s3_url  # noqa: E402,F401 - fixtures


def _s3_keys(url: str):
    return open_storage(url).list("")


def _requests(url: str) -> dict:
    """The request counters of the S3 client that every open_storage(url) of this process shares."""
    return open_storage(url).bucket.requests


def test_convert_zero1_s3_to_s3_exact_keys_and_bit_exact(s3_url, tmp_path):
    src_local, full = zero1_tag(str(tmp_path / "local"), "step_3", dp=4, tp=1)
    ref_out = str(tmp_path / "local" / "step_3_dp2")
    assert _run("convert-zero1", "--input_dir", src_local, "--output_dir", ref_out, "--convert_to_sharded",
                "--dp_size", "2") == 0
    upload(src_local, f"{s3_url}/step_3")
    assert _run("convert-zero1", "--input_dir", f"{s3_url}/step_3", "--output_dir", f"{s3_url}/step_3_dp2",
                "--convert_to_sharded", "--dp_size", "2", "--num_workers", "2") == 0
    assert_same_tree(f"{s3_url}/step_3_dp2", ref_out)     # the exact key set, every object's bytes
    assert open_storage(s3_url).listdir("") == ["step_3", "step_3_dp2"]
    got = download(f"{s3_url}/step_3_dp2", str(tmp_path / "got"))
    for r in range(2):
        assert_bit_equal(zero1_states(full[(0, 0)], 2)[r], load_shard(got, f"optim/{layout.shard_filename(r, 0, 0)}"),
                         f"dp {r}")


def test_export_s3_to_s3_and_to_local(s3_url, tmp_path):
    tag = _tp2_tag(tmp_path / "local")
    ref_out = str(tmp_path / "hf_local")
    assert _run("export", tag, "--output", ref_out, "--max-shard-size", "200B") == 0
    upload(tag, f"{s3_url}/t")
    assert _run("export", f"{s3_url}/t", "--output", f"{s3_url}/hf", "--max-shard-size", "200B") == 0
    assert_same_tree(f"{s3_url}/hf", ref_out)
    assert _run("export", f"{s3_url}/t", "--output", str(tmp_path / "hf2")) == 0
    from safetensors.torch import load_file

    got = load_file(str(tmp_path / "hf2" / "model.safetensors"))
    want = {}
    for name in sorted(os.listdir(ref_out)):
        if name.endswith(".safetensors"):
            want.update(load_file(os.path.join(ref_out, name)))
    assert sorted(got) == sorted(want)
    for k in want:
        assert_bit_equal(want[k], got[k], k)


def test_ls_on_s3_lists_once_and_never_heads(s3_url, tmp_path, capsys):
    """`nxd-ckpt ls` on S3: one LIST (the response has every size and time), then only the GETs of each
    tag's manifest and `done`; no HEAD per file (there were one per file before)."""
    root = str(tmp_path / "local")
    zero1_tag(root, "a", dp=2)
    zero1_tag(root, "b", dp=2)
    upload(root, s3_url)
    nfiles = len(LocalStorage(root).list(""))
    requests = _requests(s3_url)
    requests.clear()
    assert _run("ls", s3_url, "--json") == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["tag"], r["status"]) for r in rows] == [("b", "complete"), ("a", "complete")]
    assert requests == {"list_objects_v2": 1, "get_object": 4}, (requests, nfiles)
    requests.clear()
    assert _run("info", f"{s3_url}/b", "--json") == 0
    assert requests.get("list_objects_v2") == 1 and "head_object" not in requests, requests


# --- import and reshard write their tags through the same commit strategies -------------------------------
def _full_state_tag(root: str) -> str:
    from nxd_ckpt.tagwrite import TagSizes, write_tag
    from test_convert_state import full_state

    state, _ = full_state()
    write_tag(state, root, TagSizes(2, 1, 2, True), converted_from={})
    return root


def _import_and_reshard(base: str, tmp_path, verify: bool = True) -> None:
    """import (local HF dir -> ``base``) and reshard (``base`` -> ``base``) give the local runs' files."""
    local = _full_state_tag(str(tmp_path / "a"))
    assert _run("export", local, "--output", str(tmp_path / "hf"), "--max-shard-size", "2KB") == 0
    assert _run("import", str(tmp_path / "hf"), str(tmp_path / "imported"), "--tp", "2", "--preset", "llama") == 0
    assert _run("import", str(tmp_path / "hf"), f"{base}/imported", "--tp", "2", "--preset", "llama") == 0
    assert_same_tree(f"{base}/imported", str(tmp_path / "imported"))
    assert _run("reshard", local, str(tmp_path / "r"), "--tp", "1", "--dp", "3") == 0
    upload(local, f"{base}/a")
    assert _run("reshard", f"{base}/a", f"{base}/r", "--tp", "1", "--dp", "3") == 0
    assert_same_tree(f"{base}/r", str(tmp_path / "r"))
    assert open_storage(base).listdir("") == ["a", "imported", "r"]
    assert not verify or _run("verify", base) == 0


@pytest.mark.parametrize("kind", ["mem", "objdir"])
def test_import_and_reshard_on_an_object_store(kind, tmp_path):
    _import_and_reshard(_base(kind, tmp_path), tmp_path)


def test_import_and_reshard_on_s3(s3_url, tmp_path, capsys):
    _import_and_reshard(s3_url, tmp_path, verify=False)   # every object's bytes are compared already
    # a damaged input: the message names the object, and nothing of the new tag is left
    st = open_storage(f"{s3_url}/a")
    rel = "optim/dp_rank_01_tp_rank_01_pp_rank_00.pt.tensors/tensor_2.pt"
    data = bytearray(st.read(rel))
    data[-20] ^= 0xFF
    st.write_bytes(rel, bytes(data))
    capsys.readouterr()
    assert _run("reshard", f"{s3_url}/a", f"{s3_url}/r2", "--tp", "1") == 1
    assert f"{s3_url}/a/{rel} fails its checksum" in capsys.readouterr().err
    assert open_storage(s3_url).listdir("") == ["a", "imported", "r"]


def test_list_checkpoints_on_s3_is_one_list(s3_url, tmp_path):
    """has_checkpoint / list_checkpoints / newest_checkpoint on S3: one LIST, no HEAD or GET per tag."""
    import nxd_ckpt

    root = str(tmp_path / "local")
    zero1_tag(root, "a", dp=2)
    zero1_tag(root, "b", dp=2)
    upload(root, s3_url)
    open_storage(f"{s3_url}/c").write_bytes(layout.CHECKPOINT_MARKER, b"1")   # an interrupted save
    requests = _requests(s3_url)
    requests.clear()
    assert nxd_ckpt.list_checkpoints(s3_url) == ["b", "a"]
    assert requests == {"list_objects_v2": 1}, requests


@pytest.mark.parametrize("kind", ["mem", "s3"])
def test_import_from_a_hugging_face_directory_on_an_object_store(kind, tmp_path, request):
    """import reads HF_DIR through Storage too (headers by two ranged reads per file, each tensor by one):
    the same tag as from the local directory, file for file."""
    base = request.getfixturevalue("s3_url") if kind == "s3" else _base("mem", tmp_path)
    local = _full_state_tag(str(tmp_path / "a"))
    assert _run("export", local, "--output", str(tmp_path / "hf"), "--max-shard-size", "600B", "--dtype", "bf16") == 0
    assert len(os.listdir(tmp_path / "hf")) > 2
    assert _run("import", str(tmp_path / "hf"), str(tmp_path / "imported"), "--tp", "2", "--preset", "llama") == 0
    upload(str(tmp_path / "hf"), f"{base}/hf")
    assert _run("import", f"{base}/hf", f"{base}/imported", "--tp", "2", "--preset", "llama") == 0
    assert_same_tree(f"{base}/imported", str(tmp_path / "imported"))
