"""to-dcp and from-dcp on S3 (a moto server on 127.0.0.1): tags and DCP checkpoints read and written under
s3:// prefixes give the same tensors as on local disk; a failed conversion leaves nothing; a non-empty
output prefix is replaced only with --overwrite."""
from __future__ import annotations

import json

import pytest

pytest.importorskip("boto3")

from nxd_ckpt.cli import main  # noqa: E402
from nxd_ckpt.dcpio import read_dcp  # noqa: E402
from nxd_ckpt.fullstate import read_tag  # noqa: E402
from nxd_ckpt.storage import open_storage  # noqa: E402
from nxd_ckpt.tagwrite import TagSizes, write_tag  # noqa: E402
from s3_fixtures import moto_endpoint, s3_url  # noqa: E402,F401 - fixtures
from test_convert_state import full_state, loaded  # noqa: E402
from tiny_models import assert_bit_equal  # noqa: E402

SIZES = TagSizes(2, 2, 2, True)


def _keys(url):
    return sorted(open_storage(url).list(""))


def test_to_dcp_from_s3_to_s3(s3_url, tmp_path):
    """A TP=2 x PP=2 x DP=2 ZeRO-1 tag on S3 converted to DCP on S3: the same entries and tensors as the
    local conversion, every object in the manifest, and the output verifies."""
    state, _ = full_state()
    write_tag(state, str(tmp_path / "a"), SIZES, converted_from={})
    write_tag(state, f"{s3_url}/a", SIZES, converted_from={})
    assert main(["to-dcp", str(tmp_path / "a"), str(tmp_path / "d")]) == 0
    assert main(["to-dcp", f"{s3_url}/a", f"{s3_url}/d"]) == 0
    keys = _keys(f"{s3_url}/d")
    man = json.loads(open_storage(f"{s3_url}/d").read_bytes("manifest.json"))
    assert set(man["files"]) == set(keys) - {"manifest.json", "done"} and ".metadata" in keys
    assert keys == sorted(p.name for p in (tmp_path / "d").iterdir())
    assert_bit_equal(loaded(read_dcp(f"{s3_url}/d")), loaded(read_dcp(str(tmp_path / "d"))))
    assert main(["verify", f"{s3_url}/d"]) == 0


def test_from_dcp_from_s3_to_s3(s3_url, tmp_path):
    """A DCP checkpoint on S3 brought back as a tag on S3 at TP=2 x PP=2 x DP=2 ZeRO-1: the tag's full state
    equals the original's bit for bit."""
    state, _ = full_state()
    write_tag(state, str(tmp_path / "a"), SIZES, converted_from={})
    assert main(["to-dcp", str(tmp_path / "a"), f"{s3_url}/d"]) == 0
    assert main(["from-dcp", f"{s3_url}/d", f"{s3_url}/b", "--tp", "2", "--pp", "2", "--dp", "2", "--zero1"]) == 0
    assert "done" in _keys(f"{s3_url}/b")
    assert_bit_equal(loaded(read_tag(f"{s3_url}/b")), loaded(read_tag(str(tmp_path / "a"))))


def test_s3_output_refusals_and_cleanup(s3_url, tmp_path, capsys):
    """An output inside the input, or a non-empty prefix without --overwrite, is refused before anything is
    written; a conversion that fails on a damaged input leaves no object under the output prefix."""
    state, _ = full_state()
    write_tag(state, f"{s3_url}/a", SIZES, converted_from={})
    assert main(["to-dcp", f"{s3_url}/a", f"{s3_url}/a/inside"]) == 1
    assert "inside the input directory" in capsys.readouterr().err
    assert main(["to-dcp", f"{s3_url}/a", f"{s3_url}/d", "--no-optimizer"]) == 0
    before = _keys(f"{s3_url}/d")
    assert main(["to-dcp", f"{s3_url}/a", f"{s3_url}/d"]) == 1
    assert "exists and is not empty" in capsys.readouterr().err and _keys(f"{s3_url}/d") == before
    assert main(["to-dcp", f"{s3_url}/a", f"{s3_url}/d", "--overwrite"]) == 0
    assert len(_keys(f"{s3_url}/d")) > len(before)
    src = open_storage(f"{s3_url}/a")
    victim = next(k for k in src.list("optim") if k.count("/") == 2 and k.endswith(".pt"))
    src.write_bytes(victim, b"garbage")
    assert main(["to-dcp", f"{s3_url}/a", f"{s3_url}/e"]) == 1
    assert victim in capsys.readouterr().err
    assert _keys(f"{s3_url}/e") == []
