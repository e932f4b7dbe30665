"""S3 against a real S3-compatible server on 127.0.0.1 (moto's server mode; no mocking of boto3), and a
fault-injecting proxy in front of it for retries and timeouts."""
from __future__ import annotations

import base64
import hashlib
import json

import pytest

pytest.importorskip("boto3")

from harness import run_ranks  # noqa: E402
from s3_fixtures import fault_proxy, moto_endpoint, s3_url  # noqa: E402,F401 - fixtures
from test_integrity import _assert_state, _objects, _state  # noqa: E402
from tiny_models import TinyShard, assert_bit_equal, to_cpu_state, train_steps, xla_device  # noqa: E402


def _boto(endpoint):
    import boto3

    return boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")


def _split(url):
    bucket, _, prefix = url[len("s3://"):].partition("/")
    return bucket, prefix


def _keys(client, url):
    bucket, prefix = _split(url)
    pages = client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix + "/")
    return sorted(o["Key"][len(prefix) + 1:] for p in pages for o in p.get("Contents", []))


def test_save_load_retention_in_nxd_key_layout(s3_url, moto_endpoint):
    """NxD's keys (prefix + relative paths, no directory objects), CRC32C stored with every object,
    retention by batched DeleteObjects with `done` first, load bit-exact."""
    import nxd_ckpt

    client = _boto(moto_endpoint)
    model, opt, sched = _objects()
    states = {}
    for step in (1, 2, 3):
        train_steps(model, opt, 1, seed=3, sched=sched, start=step - 1)
        states[step] = _state(model, opt, sched)
        nxd_ckpt.save_checkpoint(s3_url, f"step_{step}", use_xser=True, model=model, optimizer=opt, scheduler=sched,
                                 user_content={"step": step}, num_kept_ckpts=2)
    keys = _keys(client, s3_url)
    assert not any(k.endswith("/") or ".nxdtmp" in k for k in keys), keys
    assert sorted({k.split("/")[0] for k in keys}) == ["newest", "step_2", "step_3"]
    assert nxd_ckpt.list_checkpoints(s3_url) == ["step_3", "step_2"] and nxd_ckpt.has_checkpoint(s3_url)
    man = json.loads(client.get_object(Bucket=_split(s3_url)[0], Key=_split(s3_url)[1] + "/step_3/manifest.json")["Body"].read())
    bucket, prefix = _split(s3_url)
    for rel, entry in list(man["files"].items())[:5]:      # S3 holds our CRC32C as the object's checksum
        head = client.head_object(Bucket=bucket, Key=f"{prefix}/step_3/{rel}", ChecksumMode="ENABLED")
        assert base64.b64decode(head["ChecksumCRC32C"]).hex() == entry["crc32c"], rel
    fresh, fopt, fsched = _objects(seed_offset=5)
    assert nxd_ckpt.load_checkpoint(s3_url, model=fresh, optimizer=fopt, scheduler=fsched) == {"step": 3}
    _assert_state(states[3], fresh, fopt, fsched)


def test_flipped_byte_in_an_object_is_caught(s3_url, moto_endpoint):
    import nxd_ckpt

    from test_object_store import save_two

    client = _boto(moto_endpoint)
    states = save_two(s3_url)
    bucket, prefix = _split(s3_url)
    key = f"{prefix}/b/model/dp_rank_00_tp_rank_00_pp_rank_00.pt.tensors/tensor_0.pt"
    data = bytearray(client.get_object(Bucket=bucket, Key=key)["Body"].read())
    data[len(data) // 2] ^= 0x10
    client.put_object(Bucket=bucket, Key=key, Body=bytes(data))
    fresh, fopt, fsched = _objects(seed_offset=5)
    before = _state(fresh, fopt, fsched)
    with pytest.raises(nxd_ckpt.CorruptCheckpointError, match="fails its checksum"):
        nxd_ckpt.load_checkpoint(s3_url, tag="b", model=fresh, optimizer=fopt, scheduler=fsched)
    _assert_state(before, fresh, fopt, fsched)
    assert nxd_ckpt.load_checkpoint(s3_url, model=fresh, optimizer=fopt, scheduler=fsched) == {"step": 1}
    _assert_state(states["a"], fresh, fopt, fsched)


def test_large_object_goes_multipart_and_reads_back_in_ranges(s3_url, monkeypatch):
    """Parts are uploaded in parallel while the file is produced, growing every PARTS_PER_SIZE parts; reads
    to the end are one ranged GET whose Content-Range names the size, then the other ranges in parallel
    (no HEAD)."""
    import torch

    import nxd_ckpt
    from nxd_ckpt.storage import open_storage, s3

    monkeypatch.setattr(s3, "PART_SIZE", 5 << 20)     # S3's minimum part size
    monkeypatch.setattr(s3, "PARTS_PER_SIZE", 2)      # parts of 5, 5, 10, then the last 4 MiB and change
    monkeypatch.setattr(s3, "RANGE_SIZE", 3 << 20)
    big = {"w": torch.randn(6 << 20)}                  # 24 MiB
    nxd_ckpt.save_checkpoint(s3_url, "big", use_xser=True, model=big)
    storage = open_storage(s3_url)
    counts = dict(storage.bucket.requests)
    assert counts.get("upload_part") == 4 and counts.get("complete_multipart_upload") == 1, counts
    key = storage.key("big/model/dp_rank_00_tp_rank_00_pp_rank_00.pt.tensors/tensor_0.pt")
    parts = [storage.bucket.client.head_object(Bucket=storage.bucket.name, Key=key, PartNumber=n)["ContentLength"]
             for n in (1, 2, 3, 4)]
    assert parts[:3] == [5 << 20, 5 << 20, 10 << 20] and 0 < parts[3] < 10 << 20, parts
    target = {}
    nxd_ckpt.load_checkpoint(s3_url, model=target)
    assert torch.equal(target["w"], big["w"])
    whole = storage.bucket.client.get_object(Bucket=storage.bucket.name, Key=key)["Body"].read()
    storage.bucket.requests.clear()
    assert storage.read(key[len(storage.prefix) + 1:]) == whole
    assert storage.bucket.requests == {"get_object": -(-len(whole) // (3 << 20))} == {"get_object": 9}


def test_part_sizes_double_every_thousand_parts_up_to_s3s_limits():
    from nxd_ckpt.storage import s3

    sizes = [s3.part_size(n) for n in range(1, 10_001)]
    assert sizes[0] == sizes[999] == s3.PART_SIZE and sizes[1000] == 2 * s3.PART_SIZE
    assert max(sizes) == s3.MAX_PART_SIZE == 5 << 30
    assert sum(sizes) >= 5 * 10 ** 12            # S3's largest object fits in 10,000 parts


def test_whole_object_reads_are_one_get_without_head(s3_url, monkeypatch):
    """A read to the end of an object is one GET when it fits in one range, even for an empty object or
    an offset at the end (S3 answers those 416, which is an empty read, not an error); a missing key is
    FileNotFoundError; a larger one is split in ranges."""
    from nxd_ckpt.storage import open_storage, s3

    monkeypatch.setattr(s3, "RANGE_SIZE", 1000)
    storage = open_storage(s3_url)
    data = bytes(range(256)) * 10                        # 2,560 bytes: 3 ranges
    storage.write_bytes("small", data[:700])
    storage.write_bytes("empty", b"")
    storage.write_bytes("large", data)
    requests = storage.bucket.requests
    requests.clear()
    assert storage.read("small") == data[:700] and storage.read("small", 5) == data[5:700]
    assert storage.read("empty") == b"" and storage.read("small", 700) == b""
    assert requests == {"get_object": 4}, requests
    requests.clear()
    assert storage.read("large") == data and storage.read("large", 1500) == data[1500:]
    assert requests == {"get_object": 5}, requests
    with pytest.raises(FileNotFoundError):
        storage.read("missing")


def test_save_with_retention_lists_twice_and_never_heads(s3_url):
    """A save that replaces the previous tag: one LIST to prepare the tag, one listing that answers every
    retention question (which tags exist, complete or not, ours or not) and names the old tag's objects;
    then three DeleteObjects: `done`, the rest, the `checkpoint` marker; no HeadObject (it made 10 HEADs
    and 7 LISTs when each question was a request, 3 LISTs and 4 DeleteObjects before the listing was
    reused)."""
    import torch

    import nxd_ckpt
    from nxd_ckpt.storage import open_storage

    model = {"w": torch.arange(6.0)}
    nxd_ckpt.save_checkpoint(s3_url, "a", model=model, num_kept_ckpts=1)
    bucket = open_storage(s3_url).bucket
    before = dict(bucket.requests)
    nxd_ckpt.save_checkpoint(s3_url, "b", model=model, num_kept_ckpts=1)
    made = {k: v - before.get(k, 0) for k, v in bucket.requests.items() if v != before.get(k, 0)}
    assert made == {"list_objects_v2": 2, "put_object": 5, "delete_objects": 3}, made
    assert nxd_ckpt.list_checkpoints(s3_url) == ["b"]
    assert open_storage(s3_url).list("") == sorted(["newest"] + [f"b/{k}" for k in (
        "checkpoint", "done", "manifest.json", "model/dp_rank_00_tp_rank_00_pp_rank_00.pt")])


def test_multirank_async_save_and_load(s3_url):
    from test_object_store import _tp2_dp2_rank

    assert run_ranks(_tp2_dp2_rank, 2, s3_url, timeout=180) == [True, True]


# --- faults --------------------------------------------------------------------------------------------
def test_slowdown_burst_is_retried(fault_proxy):
    import nxd_ckpt

    proxy, url = fault_proxy
    model = TinyShard()
    proxy.slowdown(6)
    nxd_ckpt.save_checkpoint(url, "s", use_xser=True, model=model, user_content={"ok": 1})
    assert proxy.injected["slowdown"] == 6
    fresh = TinyShard(seed_offset=3)
    assert nxd_ckpt.load_checkpoint(url, model=fresh) == {"ok": 1}
    assert_bit_equal(to_cpu_state(model.state_dict()), to_cpu_state(fresh.state_dict()))


def test_connection_reset_mid_upload_is_retried(fault_proxy):
    import torch

    import nxd_ckpt

    proxy, url = fault_proxy
    state = {f"w{i}": torch.randn(4096) for i in range(3)}      # 16 KiB objects
    proxy.reset_uploads(3)
    nxd_ckpt.save_checkpoint(url, "s", use_xser=True, model=state)
    assert proxy.injected["reset"] == 3
    target = {}
    nxd_ckpt.load_checkpoint(url, model=target)
    assert all(torch.equal(target[k], v) for k, v in state.items())


def test_server_that_stops_answering_fails_every_rank_within_timeout(fault_proxy):
    """A save, then a load, against a server that stops answering: each raises RankFailureError having
    started no S3 request after its deadline (one per save / load); the tag is never marked complete."""
    import nxd_ckpt

    proxy, url = fault_proxy
    nxd_ckpt.save_checkpoint(url, "good", use_xser=True, model=TinyShard())
    proxy.blackhole(True)
    with pytest.raises(nxd_ckpt.RankFailureError, match="did not succeed within 3s"):
        nxd_ckpt.save_checkpoint(url, "stuck", use_xser=True, model=TinyShard(), timeout_s=3)
    last_attempt, deadline = _last_attempt_vs_deadline()
    assert last_attempt is not None and last_attempt < deadline
    # A load's requests share one deadline too.
    with pytest.raises(nxd_ckpt.RankFailureError, match="did not succeed within 3s"):
        nxd_ckpt.load_checkpoint(url, "good", model=TinyShard(), timeout_s=3)
    last_attempt, deadline = _last_attempt_vs_deadline()
    assert last_attempt is not None and last_attempt < deadline
    assert proxy.injected["blackholed"] > 0
    proxy.blackhole(False)
    assert nxd_ckpt.list_checkpoints(url) == ["good"]


def test_a_stuck_manifest_read_fails_the_load_and_never_falls_back(fault_proxy):
    """The newest tag's manifest cannot be fetched in time: that is a failed load (RankFailureError, nothing
    changed), not damage, so tag=None does not quietly load the older tag instead."""
    import nxd_ckpt

    proxy, url = fault_proxy
    nxd_ckpt.save_checkpoint(url, "a", use_xser=True, model=TinyShard(seed_offset=1))
    nxd_ckpt.save_checkpoint(url, "b", use_xser=True, model=TinyShard(seed_offset=2))
    target = TinyShard(seed_offset=3)
    before = to_cpu_state(target.state_dict())
    bucket, prefix = _split(url)
    proxy.blackhole(True, f"GET /{bucket}/{prefix}/b/manifest.json ".encode())   # reads of it; listing works
    with pytest.raises(nxd_ckpt.RankFailureError, match="manifest.json did not succeed within 3s"):
        nxd_ckpt.load_checkpoint(url, model=target, timeout_s=3)
    assert_bit_equal(before, to_cpu_state(target.state_dict()))
    assert proxy.injected["blackholed"] > 0
    proxy.blackhole(False)


def _last_attempt_vs_deadline():
    """(start of the newest S3 attempt, the save-wide deadline) of this process's newest save or load."""
    from nxd_ckpt.storage import _S3_BUCKETS

    views = [b.last_view for b in _S3_BUCKETS.values() if b.last_view is not None]
    view = max(views, key=lambda v: v.deadline)
    return view.last_attempt_at, view.deadline


def _stuck_save_rank(rank, world, url, timeout_s):
    import nxd_ckpt
    import parallel_state as ps

    ps.initialize_model_parallel(tensor_model_parallel_size=1)
    try:
        nxd_ckpt.save_checkpoint(url, "stuck", use_xser=True, model=TinyShard(), timeout_s=timeout_s)
    except nxd_ckpt.RankFailureError as exc:
        return ("RankFailureError", str(exc)) + _last_attempt_vs_deadline()
    return ("saved", "") + _last_attempt_vs_deadline()


def test_server_that_stops_answering_fails_both_ranks(fault_proxy):
    """Two ranks, a server that reads every request and never answers: each rank raises RankFailureError
    (none hangs: run_ranks fails on a rank that does not return), and no `done` is ever written. Rank 0 fails
    on its save-wide S3 deadline and publishes the failure, which rank 1 (waiting for rank 0's staging
    marker) raises before its own wait would time out."""
    import nxd_ckpt
    from s3_fixtures import S3_ENV

    proxy, url = fault_proxy
    proxy.blackhole(True)
    out = run_ranks(_stuck_save_rank, 2, url, 3, timeout=120,
                    env={**S3_ENV, "AWS_ENDPOINT_URL_S3": proxy.endpoint})
    assert [o[0] for o in out] == ["RankFailureError"] * 2, out
    # Rank 0's cause is its S3 request to the stuck server (normally "did not succeed within 3s"; one loaded CI
    # run reported another S3Error text, kept in full here should it recur), and rank 1 raises rank 0's cause.
    messages = "\n".join(o[1] for o in out)
    assert all("S3Error: S3 " in o[1] and url.split("/")[2] in o[1] for o in out), messages
    assert "rank 0 could not create its staging directory" in out[1][1], messages
    assert all("Fix the bucket access" in o[1] for o in out), messages
    # Rank 0's S3 layer retried until the save-wide deadline and started no request after it.
    last_attempt, deadline = out[0][2], out[0][3]
    assert last_attempt is not None and last_attempt < deadline, out
    assert proxy.injected["blackholed"] > 0
    proxy.blackhole(False)
    assert nxd_ckpt.list_checkpoints(url) == []
    from nxd_ckpt.storage import open_storage

    assert not open_storage(url).isfile("stuck/done")


STUCK_LOAD_TIMEOUT_S = 8


def _stuck_load_rank(rank, world, url, tag, timeout_s):
    import nxd_ckpt
    import parallel_state as ps

    ps.initialize_model_parallel(tensor_model_parallel_size=1)
    try:
        nxd_ckpt.load_checkpoint(url, tag, model=TinyShard(seed_offset=2), timeout_s=timeout_s)
    except nxd_ckpt.RankFailureError as exc:
        return ("RankFailureError", str(exc)) + _last_attempt_vs_deadline()
    return ("loaded", "") + _last_attempt_vs_deadline()


@pytest.mark.parametrize("tag,only", [(None, b"list-type=2"), ("good", b"tensor_0.pt")],
                         ids=["rank-0-listing", "one-reader"])
def test_server_that_stops_answering_fails_a_two_rank_load_on_both_ranks(fault_proxy, tag, only):
    """Two ranks load (DP=2: each tensor file is read by one replica and broadcast) from a server that stops
    answering LIST requests (only rank 0 lists the directory), or only the one file rank 0 reads (rank 1 has
    its files and waits for rank 0). Each rank raises RankFailureError carrying rank 0's S3 cause (none hangs:
    run_ranks fails on a rank that does not return; rank 1 neither times out on its own nor raises a bare
    CheckpointError), and no rank's S3 layer starts a request after its load's deadline."""
    import nxd_ckpt
    from s3_fixtures import S3_ENV

    proxy, url = fault_proxy
    nxd_ckpt.save_checkpoint(url, "good", use_xser=True, model=TinyShard())
    proxy.blackhole(True, only)
    # 8 s cover the whole load: at load average 15+ a 3 s deadline could expire on rank 0 before it reached the
    # blackholed request, and the test then saw an earlier request's timeout instead of the one it is about.
    out = run_ranks(_stuck_load_rank, 2, url, tag, STUCK_LOAD_TIMEOUT_S, timeout=120,
                    env={**S3_ENV, "AWS_ENDPOINT_URL_S3": proxy.endpoint})
    messages = "\n".join(o[1] for o in out)
    assert [o[0] for o in out] == ["RankFailureError"] * 2, out
    assert all("S3 " in o[1] and url.split("/")[2] in o[1] for o in out), messages
    assert all("Nothing was changed on this rank" in o[1] for o in out), messages
    # Only rank 0's requests hang: rank 1 raises rank 0's cause. (Reading its own files, rank 1 may also reach
    # its own deadline first on a loaded machine: the deadline covers the whole load. It then raises that S3 cause.)
    what = "tensor_0.pt" if only == b"tensor_0.pt" else "list_objects_v2"
    assert what in out[0][1], messages
    assert ("rank 0 could not read the checkpoint" in out[1][1] and what in out[1][1]) or (
        only == b"tensor_0.pt" and f"did not succeed within {STUCK_LOAD_TIMEOUT_S}s" in out[1][1]), messages
    last_attempt, deadline = out[0][2], out[0][3]
    assert last_attempt is not None and last_attempt < deadline, out
    for last_attempt, deadline in (o[2:] for o in out[1:]):
        assert last_attempt is None or last_attempt < deadline, out
    assert proxy.injected["blackholed"] > 0
    proxy.blackhole(False)
    assert nxd_ckpt.list_checkpoints(url) == ["good"]


def test_nxd_ckpt_verify_reads_s3_and_catches_a_flipped_byte(s3_url, moto_endpoint, capsys):
    """`nxd-ckpt verify s3://...` re-reads every object through the object-store Storage: intact tags
    pass, one flipped byte is named with the checksum mismatch and the exit code is 1."""
    from nxd_ckpt.cli import main

    from test_object_store import save_two

    save_two(s3_url)
    assert main(["verify", s3_url, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] and [t["tag"] for t in report["tags"]] == ["b", "a"]
    assert all(t["files_checked"] > 5 and t["bytes_checked"] > 0 for t in report["tags"])
    client = _boto(moto_endpoint)
    bucket, prefix = _split(s3_url)
    rel = "model/dp_rank_00_tp_rank_00_pp_rank_00.pt.tensors/tensor_0.pt"
    data = bytearray(client.get_object(Bucket=bucket, Key=f"{prefix}/b/{rel}")["Body"].read())
    data[len(data) // 2] ^= 0x10
    client.put_object(Bucket=bucket, Key=f"{prefix}/b/{rel}", Body=bytes(data))
    assert main(["verify", f"{s3_url}/b"]) == 1
    out = capsys.readouterr().out
    assert out.startswith("DAMAGED    b ") and f"{s3_url}/b/{rel}: fails its checksum" in out, out
    assert main(["verify", f"{s3_url}/a"]) == 0


def test_nxd_ckpt_ls_and_info_read_s3(s3_url, capsys):
    """`ls` and `info` describe tags on S3 from the same Storage as verify: the same rows as the manifest."""
    from nxd_ckpt.cli import main
    from nxd_ckpt.storage import open_storage
    from nxd_ckpt import manifest as manifest_mod

    from test_object_store import save_two

    save_two(s3_url)
    assert main(["ls", s3_url, "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    man = manifest_mod.read(open_storage(s3_url), "b")
    assert [(r["tag"], r["status"], r["format"]) for r in rows] == [("b", "complete", "nxd-ckpt"),
                                                                    ("a", "complete", "nxd-ckpt")]
    assert rows[0]["size"] == sum(e.size for e in man.files.values()) and rows[0]["files"] == len(man.files)
    assert main(["info", f"{s3_url}/b", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["path"] == f"{s3_url}/b" and info["status"] == "complete" and not info["errors"]
    assert info["tensor_count"] == sum(len(t) for t in man.tensors.values()) > 0
    assert info["user_content"]["keys"] == ["step"]


@pytest.mark.parametrize("scheme,signed", [("https", False), ("http", True)])
def test_bodies_are_not_sha256_signed_over_https(scheme, signed, monkeypatch):
    """Over TLS an upload's body is covered by its signed CRC32C header (no SHA-256 of every byte); over
    plain http the payload stays signed. Checked on the request as signed, just before it would be sent."""
    from nxd_ckpt.storage.s3 import _b64_crc, make_client

    import crc32c

    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    seen = []

    class Stop(Exception):
        pass

    def text(v):
        return v.decode() if isinstance(v, bytes) else v

    def capture(request, **_):
        seen.append((text(request.headers["X-Amz-Content-SHA256"]), text(request.headers["x-amz-checksum-crc32c"])))
        raise Stop

    client = make_client(f"{scheme}://127.0.0.1:9", 5.0)
    client.meta.events.register("before-send.s3.*", capture)
    body = b"x" * 1000
    crc = _b64_crc(crc32c.crc32c(body))
    for op, extra in (("put_object", {}), ("upload_part", {"UploadId": "u", "PartNumber": 1})):
        with pytest.raises(Stop):
            getattr(client, op)(Bucket="b", Key="k", Body=body, ChecksumAlgorithm="CRC32C", ChecksumCRC32C=crc, **extra)
    want = hashlib.sha256(body).hexdigest() if signed else "UNSIGNED-PAYLOAD"
    assert seen == [(want, crc)] * 2, seen


def test_read_into_fills_a_buffer_from_parallel_ranged_gets(s3_url, monkeypatch):
    """``read_into`` on S3: the first ranged GET names the size, the other ranges go straight into their slices
    of the caller's buffer; short at the object's end, 0 past it or for an empty object, FileNotFoundError when
    the key is missing."""
    from nxd_ckpt.storage import open_storage, s3

    monkeypatch.setattr(s3, "RANGE_SIZE", 1000)
    storage = open_storage(s3_url)
    data = bytes(range(256)) * 10                        # 2,560 bytes: 3 ranges
    storage.write_bytes("large", data)
    storage.write_bytes("empty", b"")
    requests = storage.bucket.requests
    requests.clear()
    buf = bytearray(3000)
    assert storage.read_into("large", memoryview(buf)) == len(data) and bytes(buf[:len(data)]) == data
    assert requests == {"get_object": 3}, requests
    # The first range's Content-Range names the size: no range past the object's end is requested.
    wide = bytearray(5000)
    assert storage.read_into("large", memoryview(wide)) == len(data) and bytes(wide[:len(data)]) == data
    assert requests == {"get_object": 3 + 3}, requests
    part = bytearray(500)
    assert storage.read_into("large", memoryview(part), 1500) == 500 and bytes(part) == data[1500:2000]
    assert storage.read_into("large", memoryview(part), 2400) == 160 and bytes(part[:160]) == data[2400:]
    assert storage.read_into("large", memoryview(part), 2560) == 0
    assert storage.read_into("empty", memoryview(part)) == 0
    with pytest.raises(FileNotFoundError):
        storage.read_into("missing", memoryview(part))


def test_plain_shard_load_requests(s3_url, monkeypatch):
    """Loading a named tag with a plain (non-xser) shard: one HEAD (the tag's `done`) and no LIST at all (the
    saved layout comes from the manifest), `manifest.json` and `done` read, and the shard read in parallel
    ranges into one buffer whose views are the loaded tensors; bit-exact."""
    import torch

    import nxd_ckpt
    from nxd_ckpt.storage import open_storage, s3

    monkeypatch.setattr(s3, "RANGE_SIZE", 1 << 20)
    model = {f"w{i}": torch.randn(1 << 18) for i in range(3)}          # 3 MiB: 4 ranges
    nxd_ckpt.save_checkpoint(s3_url, "plain", use_xser=False, model=model)
    storage = open_storage(s3_url)
    storage.bucket.requests.clear()
    target = {}
    nxd_ckpt.load_checkpoint(s3_url, tag="plain", model=target)
    assert sorted(target) == sorted(model) and all(torch.equal(target[k], model[k]) for k in model)
    assert storage.bucket.requests == {"head_object": 1, "get_object": 2 + 4}, \
        storage.bucket.requests


def _counted_load_rank(rank, world, url):
    """Load the tag ``url`` holds (DP=2) while recording this rank's S3 requests as (operation, key name)."""
    import nxd_ckpt
    import parallel_state as ps
    from nxd_ckpt.storage import s3

    ps.initialize_model_parallel(tensor_model_parallel_size=1)
    seen = []
    call = s3.S3Bucket.call

    def counting(self, op, key, fn=None, **kw):
        seen.append((op, key.rsplit("/", 1)[-1]))
        return call(self, op, key, fn, **kw)

    s3.S3Bucket.call = counting
    model = TinyShard(seed_offset=2)
    nxd_ckpt.load_checkpoint(url, "good", model=model)
    return seen, to_cpu_state(model.state_dict())


def test_two_rank_load_reads_manifest_and_done_once(s3_url):
    """A 2-rank load of a named tag (DP=2): rank 0 alone reads `done` (a HEAD, then one GET) and
    `manifest.json` (one GET) and shares the manifest, so the load makes one GET of each in all, not one
    per rank; rank 1 reads only its share of the shard's files. Both load the saved state bit-exactly."""
    import nxd_ckpt

    saved = TinyShard()
    nxd_ckpt.save_checkpoint(s3_url, "good", use_xser=True, model=saved)
    out = run_ranks(_counted_load_rank, 2, s3_url, timeout=180)
    for _, state in out:
        assert_bit_equal(to_cpu_state(saved.state_dict()), state, "model")
    (zero, _), (one, _) = out
    markers = [r for r in zero + one if r[1] in ("done", "manifest.json")]
    assert sorted(markers) == [("get_object", "done"), ("get_object", "manifest.json"),
                               ("head_object", "done")], markers
    assert all(r[1] not in ("done", "manifest.json") for r in one), one
    assert all(op == "get_object" for op, _ in one), one


def test_isdir_lists_one_key(s3_url):
    """``isdir`` asks S3 for one key (MaxKeys=1), not a page of 1,000 keys with their sizes and times."""
    from nxd_ckpt.storage import open_storage, s3

    storage = open_storage(s3_url)
    for i in range(3):
        storage.write_bytes(f"t/model/f{i}", b"x")
    asked = []
    call = s3.S3Bucket.call

    def recording(self, op, key, fn=None, **kw):
        asked.append((op, kw.get("MaxKeys")))
        return call(self, op, key, fn, **kw)

    s3.S3Bucket.call = recording
    try:
        assert storage.isdir("t") and storage.isdir("t/model") and not storage.isdir("t/model/f0")
        assert not storage.isdir("none")
        assert sorted(storage.list("t")) == [f"t/model/f{i}" for i in range(3)]
    finally:
        s3.S3Bucket.call = call
    assert asked == [("list_objects_v2", 1)] * 4 + [("list_objects_v2", 1000)], asked


def _plain_replica_load_rank(rank, world, url):
    """Load the plain shard of tag ``plain`` (DP=2: one replica reads it and broadcasts its bytes), recording
    which read of the S3 bucket this rank made of it."""
    import torch

    import nxd_ckpt
    import parallel_state as ps
    from nxd_ckpt.storage import s3

    ps.initialize_model_parallel(tensor_model_parallel_size=1)
    s3.RANGE_SIZE = 1 << 20
    reads = []
    for name in ("get", "get_into"):
        def wrap(self, key, *a, _orig=getattr(s3.S3Bucket, name), _name=name, **kw):
            reads.append((_name, key.rsplit("/", 1)[-1]))
            return _orig(self, key, *a, **kw)
        setattr(s3.S3Bucket, name, wrap)
    target = {}
    nxd_ckpt.load_checkpoint(url, "plain", model=target)
    return [r for r in reads if r[1].endswith(".pt")], {k: v.clone() for k, v in target.items()}


def test_a_replicated_plain_shard_is_read_into_one_buffer(s3_url):
    """DP=2 and a plain (non-xser) shard of 3 MiB: one replica reads it from S3 with parallel ranged GETs
    straight into one host buffer (``get_into``, not ranges joined into ``bytes``), unpickles it in place and
    broadcasts that buffer; the other replica reads nothing of it. Both load it bit-exactly."""
    import torch

    import nxd_ckpt

    model = {f"w{i}": torch.randn(1 << 18) for i in range(3)}
    nxd_ckpt.save_checkpoint(s3_url, "plain", use_xser=False, model=model)
    out = run_ranks(_plain_replica_load_rank, 2, s3_url, timeout=180)
    for _, loaded in out:
        assert sorted(loaded) == sorted(model) and all(torch.equal(loaded[k], model[k]) for k in model)
    reads = sorted(r for rank_reads, _ in out for r in rank_reads)
    assert reads == [("get_into", "dp_rank_00_tp_rank_00_pp_rank_00.pt")], out


class _Mixed(__import__("torch").nn.Module):
    """Parameters and buffers of several dtypes and sizes, one buffer a view sharing a parameter's storage."""

    def __init__(self, seed: int):
        import torch

        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.big = torch.nn.ParameterList(torch.randn(1 << 16, generator=g) for _ in range(8))  # 8 x 256 KiB
        self.mid = torch.nn.Parameter(torch.randn(300, 700, generator=g).to(torch.bfloat16))
        self.small = torch.nn.Parameter(torch.randn(7, generator=g))
        self.register_buffer("steps", torch.randint(0, 1 << 40, (5000,), generator=g))
        self.register_buffer("tail", torch.randn(1 << 17, generator=g).to(torch.float16))


def _pipelined_load(url, monkeypatch, seed=0):
    """Save ``_Mixed`` as a plain shard to ``url``; return the saved CPU state, a fresh model on the XLA device and
    the event log of a load (each range told to the pipe as ``("landed", end)``, each transfer as ``"h2d"``)."""
    import nxd_ckpt
    from nxd_ckpt import plainpipe, reader

    model = _Mixed(seed)
    nxd_ckpt.save_checkpoint(url, "plain", use_xser=False, model=model)
    events = []
    orig_landed, orig_h2d = plainpipe.RecordPipe.landed, reader._to_device
    monkeypatch.setattr(plainpipe.RecordPipe, "landed",
                        lambda self, a, b: (events.append(("landed", b)), orig_landed(self, a, b))[1])
    monkeypatch.setattr(reader, "_to_device", lambda batch, targets: (events.append("h2d") if batch else None,
                                                                      orig_h2d(batch, targets))[1])
    monkeypatch.setattr(reader, "PLACE_BATCH_BYTES", 1)     # every landed record's tensors sent at once
    monkeypatch.setattr(reader, "PIPELINE_PLAIN_SHARDS", True)
    fresh = _Mixed(seed + 1).to(xla_device())
    return to_cpu_state(model.state_dict()), fresh, events


def test_plain_shard_is_checked_and_sent_to_the_device_as_ranges_land(s3_url, monkeypatch):
    """A plain shard on S3 whose manifest holds its records' CRC32C: the tensors are built from each range's
    checked records and sent to the XLA device while the other ranges download; bit-exact (bf16, int64, fp16,
    a view sharing a parameter's storage), with the same requests as reading it whole (the shard's ranged GETs,
    no GET more)."""
    import nxd_ckpt
    from nxd_ckpt.storage import open_storage, s3

    monkeypatch.setattr(s3, "RANGE_SIZE", 1 << 20)
    saved, fresh, events = _pipelined_load(s3_url, monkeypatch)
    storage = open_storage(s3_url)
    size = storage.size("plain/model/dp_rank_00_tp_rank_00_pp_rank_00.pt")
    storage.bucket.requests.clear()
    nxd_ckpt.load_checkpoint(s3_url, tag="plain", model=fresh)
    assert_bit_equal(to_cpu_state(fresh.state_dict()), saved)
    assert all(t.device.type == "xla" for t in fresh.state_dict().values())
    ranges = -(-(size + 1) // (1 << 20))
    assert storage.bucket.requests == {"head_object": 1, "get_object": 2 + ranges}, storage.bucket.requests
    assert [e for e in events if e != "h2d"] and len([e for e in events if e != "h2d"]) == ranges, events
    assert events.count("h2d") >= 2, events


def _in_order_get_into(self, key, view, offset=0, on_range=None, step=256 << 10):
    """MemoryBucket.get_into filling ``view`` in ``step`` pieces, in order, each told as it lands: a download
    whose ranges arrive one after another."""
    data = self.get(key, offset, len(view))
    for a in range(0, len(data), step):
        b = min(a + step, len(data))
        view[a:b] = data[a:b]
        if on_range is not None:
            on_range(a, b)
    return len(data)


def test_plain_shard_pipeline_sends_early_and_a_late_flipped_byte_applies_nothing(monkeypatch):
    """Ranges landing in order: the first tensors go to the device before the last range has landed; a flipped
    byte in the shard's last storage record raises CorruptCheckpointError naming the file, after some tensors
    were already sent, and the model is unchanged."""
    import nxd_ckpt
    from nxd_ckpt.manifest import Manifest
    from nxd_ckpt.storage import objects, open_storage
    from nxd_ckpt.storage.testing import enable_test_schemes

    enable_test_schemes()
    url = "mem://pipe/ck"
    monkeypatch.setattr(objects.MemoryBucket, "get_into", _in_order_get_into)
    saved, fresh, events = _pipelined_load(url, monkeypatch, seed=3)
    nxd_ckpt.load_checkpoint(url, tag="plain", model=fresh)
    assert_bit_equal(to_cpu_state(fresh.state_dict()), saved)
    landed = [i for i, e in enumerate(events) if e != "h2d"]
    assert events.index("h2d") < landed[-1], events

    storage = open_storage(url)
    rel = "plain/model/dp_rank_00_tp_rank_00_pp_rank_00.pt"
    manifest = Manifest.from_json(json.loads(storage.read("plain/manifest.json")))
    last = manifest.files["model/dp_rank_00_tp_rank_00_pp_rank_00.pt"].ranges[-2]      # [-1]: the directory
    data = bytearray(storage.read(rel))
    data[last.end - 3] ^= 0x01
    storage.bucket.corrupt(storage.key(rel), bytes(data))
    before = to_cpu_state(fresh.state_dict())
    events.clear()
    with pytest.raises(nxd_ckpt.CorruptCheckpointError, match="dp_rank_00_tp_rank_00_pp_rank_00.pt") as err:
        nxd_ckpt.load_checkpoint(url, tag="plain", model=fresh)
    assert err.value.path.endswith("model/dp_rank_00_tp_rank_00_pp_rank_00.pt"), err.value.path
    assert "h2d" in events, events
    assert_bit_equal(to_cpu_state(fresh.state_dict()), before)
