"""scripts/bench.py runs end to end at a tiny size and writes every key of its JSON (no timing assertions)."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

LIMITS = ("d2h_batched_s", "d2h_batched_cpu_s_per_gb", "h2d_s", "disk_write_gbps", "disk_read_gbps",
          "disk_write_parallel_gbps", "disk_read_parallel_gbps", "d2h_chunked_cpu_s_per_gb", "h2d_cpu_s_per_gb",
          "files_write_s", "files_write_cpu_s_per_gb", "files_read_s", "files_read_cpu_s_per_gb")
METHODS = {
    "nxd_ckpt_async": ("stall_s", "commit_s", "load_s", "host_rss_peak_mb", "cpu_s_per_gb", "stall_cpu_s_per_gb",
                       "load_cpu_s_per_gb"),
    "nxd_ckpt_async_device_snapshot": ("stall_s", "commit_s", "cpu_s_per_gb"),
    "nxd_ckpt_sync": ("stall_s", "commit_s", "load_s", "cpu_s_per_gb"),
    "torch_xla_xser": ("stall_s", "load_s", "cpu_s_per_gb", "load_cpu_s_per_gb"),
    "torch_save": ("stall_s", "load_s", "cpu_s_per_gb", "load_cpu_s_per_gb"),
    "dcp_async": ("stall_s", "commit_s", "cpu_s_per_gb"),
}
TARGETS = {"cpu_s_per_gb", "async_stall_vs_d2h", "commit_throughput", "load_vs_limits", "load_vs_xser",
           "train_step_slowdown", "device_snapshot_stall", "rss_peak", "rss_no_growth", "extra_cpu_vs_file_floor",
           "extra_commit_vs_file_floor", "extra_load_vs_file_floor", "extra_load_cpu_vs_file_floor"}


def _sane(value, name, allow_zero=False):
    assert isinstance(value, (int, float)) and not isinstance(value, bool), f"{name} is {value!r}"
    assert math.isfinite(value), f"{name} is {value!r}"
    assert value > 0 or (allow_zero and value == 0), f"{name} is {value!r}"


@pytest.mark.timeout(900)
def test_bench_tiny_run_writes_complete_json(tmp_path):
    out = tmp_path / "bench.json"
    cmd = [sys.executable, os.path.join(ROOT, "scripts", "bench.py"), "--size-gb", "0.01", "--tensors", "20",
           "--dir", str(tmp_path / "data"), "--repeat", "1", "--rss-saves", "3", "--train-steps", "3",
           "--train-dim", "128", "--settle-timeout", "0", "--out", str(out)]
    env = dict(os.environ, PJRT_DEVICE="CPU")
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=850)
    assert proc.returncode == 0, f"bench.py failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    assert "targets:" in proc.stdout

    r = json.loads(out.read_text())
    assert isinstance(r["bytes"], int) and r["bytes"] > 0
    settled = r["config"]["settle_removals"]
    assert len(settled["create_us"]) == 1 and settled["path"] == str(tmp_path / "data" / "_create_probes")
    assert not os.path.exists(settled["path"])          # removed with the run's folders
    for k in LIMITS:
        _sane(r["limits"][k], f"limits.{k}")
    assert set(METHODS) <= set(r["methods"])
    for m, keys in METHODS.items():
        for k in keys:
            # an RSS increase can be 0 when a tiny save fits in memory the process already holds
            _sane(r["methods"][m][k], f"methods.{m}.{k}", allow_zero=k == "host_rss_peak_mb")
    _sane(r["train_step_slowdown"], "train_step_slowdown")
    for m in ("nxd_ckpt_async", "nxd_ckpt_sync", "nxd_ckpt_async_device_snapshot"):
        # full garbage collections during the save (median over rounds): counted, usually none in a tiny run
        _sane(r["methods"][m]["full_collections"], f"methods.{m}.full_collections", allow_zero=True)
    # the per-file floor writes the file set of nxd_ckpt's own save: a file per tensor plus its metadata files
    assert r["limits"]["files_source"] == "nxd_ckpt's first save" and r["limits"]["files_n"] > 20
    assert r["limits"]["files_bytes"] > r["bytes"]
    # the host's CPU of that write, counted in scheduler ticks: a tiny run can fall under one
    _sane(r["limits"]["files_write_host_cpu_s_per_gb"], "limits.files_write_host_cpu_s_per_gb", allow_zero=True)
    g = r["rss_growth"]
    assert g["saves"] == 3 and g["rss_first_mb"] > 0 and g["rss_last_mb"] > 0
    assert g["live_before_mb"] > 0 and g["live_after_mb"] > 0
    # the third of the saves in a row is the first to take a retired tag's files over (num_kept_ckpts=2)
    assert g["steady_saves"] == 1
    _sane(g["steady_cpu_s_per_gb"], "steady_cpu_s_per_gb", allow_zero=True)
    _sane(g["steady_commit_s"], "steady_commit_s")
    assert {"extra_steady_cpu_s_per_gb", "extra_steady_commit_throughput"} <= set(r["targets"])
    assert TARGETS <= set(r["targets"]), sorted(r["targets"])
    for name, t in r["targets"].items():
        assert isinstance(t["met"], bool), name
    # the files of every method are cleaned up; only the probe-free data folder remains
    leftovers = [d for d in os.listdir(tmp_path / "data") if os.listdir(tmp_path / "data" / d)]
    assert leftovers == [], leftovers


@pytest.mark.timeout(600)
def test_bench_bf16_params_with_fp32_optimizer_state(tmp_path):
    """The bf16-parameters + fp32-Adam shape: every tensor (model and optimizer) saved, loaded and checked."""
    out = tmp_path / "bench.json"
    cmd = [sys.executable, os.path.join(ROOT, "scripts", "bench.py"), "--state", "bf16-adam", "--size-gb", "0.005",
           "--tensors", "8", "--dir", str(tmp_path / "data"), "--repeat", "1", "--rss-saves", "0", "--skip-rss",
           "--skip-train", "--methods", "nxd_ckpt_async,torch_save", "--settle-timeout", "0", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, env=dict(os.environ, PJRT_DEVICE="CPU"), capture_output=True, text=True,
                          timeout=550)
    assert proc.returncode == 0, f"bench.py failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    r = json.loads(out.read_text())
    assert r["config"]["state"] == "bf16-adam" and r["config"]["tensors"] == 8 * 3 + 8   # params, 2 moments, steps
    for m in ("nxd_ckpt_async", "torch_save"):
        _sane(r["methods"][m]["cpu_s_per_gb"], f"{m}.cpu_s_per_gb")
        _sane(r["methods"][m]["load_s"], f"{m}.load_s")


@pytest.mark.slow
def test_bench_reshard_tiny_run_writes_complete_json(tmp_path, fmt="plain"):
    """scripts/bench_reshard.py: save at TP=2, load at TP=2 and resharded at TP=1 x PP=2, at a tiny size, as plain
    shards (the xser run differs only by use_xser): also resharded from a manifest without per-record sums, which
    streams each file first, so more bytes are read."""
    out = tmp_path / "reshard.json"
    cmd = [sys.executable, os.path.join(ROOT, "scripts", "bench_reshard.py"), "--hidden", "64", "--layers", "2",
           "--vocab", "128", "--repeat", "1", "--dir", str(tmp_path / "data"), "--out", str(out), "--format", fmt]
    env = dict(os.environ, PJRT_DEVICE="CPU", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with open(out) as f:
        r = json.load(f)
    for case in ("same", "reshard"):
        c = r["cases"][case]
        for k in ("load_s_median", "new_shard_mb", "largest_source_tensor_mb"):
            _sane(c[k], f"{case}.{k}")
        _sane(c["rss_peak_above_mb_max"], f"{case}.rss_peak_above_mb_max", allow_zero=True)
    assert r["cases"]["same"]["new_shard_mb"] == pytest.approx(r["cases"]["reshard"]["new_shard_mb"], rel=0.01)
    _sane(r["reshard_over_same"], "reshard_over_same")
    if fmt == "plain":
        assert r["cases"]["reshard_streamed"]["read_mb_per_rank_max"] > r["cases"]["reshard"]["read_mb_per_rank_max"]
    else:
        assert "reshard_streamed" not in r["cases"]


def _bench_module():
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    try:
        import bench
    finally:
        sys.path.pop(0)
    return bench


def test_limit_files_writes_and_reads_back_exactly_that_file_set(tmp_path, monkeypatch):
    """The per-file floor creates one file of each size (empty ones too), syncs once, reads each back in full
    into fresh host tensors, and removes its folder."""
    bench = _bench_module()
    sizes = [0, 1, 4096, 70_000, (16 << 20) + 3]
    cache = bench.Cache.__new__(bench.Cache)
    cache.mode = "posix_fadvise_dontneed"
    written, read = {}, []
    real_open, real_readv = os.open, os.readv

    def spy_open(path, flags, *a, **kw):
        fd = real_open(path, flags, *a, **kw)
        if os.path.basename(path).startswith("f") and flags & os.O_CREAT:
            written[path] = fd
        return fd

    def spy_readv(fd, bufs):
        n = real_readv(fd, bufs)
        read.append(n)
        return n

    monkeypatch.setattr(bench.os, "open", spy_open)
    monkeypatch.setattr(bench.os, "readv", spy_readv)
    folder = tmp_path / "floor"
    out = bench.limit_files(str(folder), sizes, cache, threads=3)
    assert sorted(os.path.basename(p) for p in written) == [f"f{i}" for i in range(len(sizes))]
    assert sum(read) == sum(sizes)
    for k in ("write_s", "write_cpu_s", "write_host_cpu_s", "read_s", "read_cpu_s"):
        assert math.isfinite(out[k]) and out[k] >= 0, (k, out)
    assert out["write_s"] > 0 and out["read_s"] > 0
    assert not folder.exists()


def test_file_floor_sentence_states_the_floor_and_the_ratios():
    bench = _bench_module()
    lim = {"files_n": 305, "files_source": "nxd_ckpt's first save", "files_write_s": 0.5, "files_read_s": 0.4,
           "files_write_cpu_s_per_gb": 0.3, "files_read_cpu_s_per_gb": 0.2, "d2h_chunked_cpu_s_per_gb": 0.2,
           "h2d_s": 0.1, "h2d_cpu_s_per_gb": 0.05}
    r = {"bytes": 10 ** 9, "limits": lim, "config": {"num_workers": 8},
         "methods": {"nxd_ckpt_async": {"cpu_s_per_gb": 0.75, "stall_cpu_s_per_gb": 0.15, "commit_s": 1.0,
                                        "load_s": 1.0, "load_cpu_s_per_gb": 0.5}}}
    assert bench.file_floor_text(r) == (
        "Per-file floor for the same 305 files (nxd_ckpt's first save): 8 threads os.open/write/close + one syncfs "
        "0.500 s (2.00 GB/s, 0.30 CPU-s/GB), read back with os.open/readv/close 0.400 s (0.20 CPU-s/GB); "
        "`nxd_ckpt_async` spends 0.60 CPU-s/GB after the call, 2.00x the floor's write CPU, commit "
        "2.00x its write time, load 2.00x its read + host-to-device time and 2.00x their CPU.")
    targets = {}
    bench._file_floor_targets(lambda name, v, bound, ok, text: targets.__setitem__(name, (v, bound, ok)),
                              r["methods"]["nxd_ckpt_async"], lim, r["bytes"], 8)
    assert targets["extra_cpu_vs_file_floor"] == (pytest.approx(0.6), 0.3, False)
    assert targets["extra_commit_vs_file_floor"] == (1.0, pytest.approx(0.85 * 2.0), False)
    assert targets["extra_load_vs_file_floor"] == (1.0, pytest.approx(1.2 * 0.5), False)
    assert targets["extra_load_cpu_vs_file_floor"] == (0.5, pytest.approx(0.25), False)
    assert bench.file_floor_text({"bytes": 1, "limits": {}, "config": {"num_workers": 8}, "methods": {}}) == ""
    # with the host's CPU of the floor's write (writeback threads included) and of the save
    lim["files_write_host_cpu_s_per_gb"] = 0.5
    r["methods"]["nxd_ckpt_async"]["host_cpu_s_per_gb"] = 1.0
    assert bench.file_floor_text(r) == (
        "Per-file floor for the same 305 files (nxd_ckpt's first save): 8 threads os.open/write/close + one syncfs "
        "0.500 s (2.00 GB/s, 0.30 CPU-s/GB of the process, 0.50 of the host), read back with os.open/readv/close "
        "0.400 s (0.20 CPU-s/GB); `nxd_ckpt_async` spends 0.60 CPU-s/GB after the call, 2.00x the floor's write "
        "CPU, commit 2.00x its write time, load 2.00x its read + host-to-device time and 2.00x their CPU; the "
        "host's CPU for the whole save (the snapshot's copy included) 2.00x the floor's write.")


def test_markdown_of_an_s3_run_prints_its_table(tmp_path, capsys):
    """``bench.py --markdown`` of an S3 run's JSON (no limits, targets as [name, value, bound]) prints the S3
    table, the targets and the request counts, instead of failing on the POSIX run's keys."""
    bench = _bench_module()
    r = {"bytes": 250_000_000, "dir": "s3://b/ck", "rounds": [{"loadavg_1min": 1.5}, {"loadavg_1min": 2.0}],
         "median": {"save_s": 1.5, "load_s": 1.25, "peer_upload_s": 2.0, "peer_download_s": 4.0},
         "save_gbps": 0.1667, "load_gbps": 0.2, "peer_upload_gbps": 0.125, "peer_download_gbps": 0.0625,
         "requests_per_save": {"put_object": 4}, "requests_per_load": {"head_object": 1, "get_object": 10},
         "targets": [["save >= 0.9 x upload", 0.1667, 0.1125], ["load >= save", 0.2, 0.25]]}
    path = tmp_path / "s3.json"
    path.write_text(json.dumps(r))
    assert bench.main(["--markdown", str(path)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "**0.250 GB to `s3://b/ck`**, 2 round(s) after a warm-up (medians), 1-minute load average 1.5 to 2.0"
    assert "| median s | 1.50 | 1.25 | 2.00 | 4.00 |" in out and "| GB/s | 0.167 | 0.200 | 0.125 | 0.062 |" in out
    assert "| save >= 0.9 x upload | 0.167 | 0.113 | yes |" in out and "| load >= save | 0.200 | 0.250 | **no** |" in out
    assert out[-1] == "S3 requests per load: 1 head_object, 10 get_object."


@pytest.mark.timeout(300)
def test_ab_commit_tiny_run_alternates_the_lever_and_writes_its_json(tmp_path):
    """scripts/ab_commit.py: both variants of a lever run (warm-up + alternating rounds) and the JSON holds the
    knob values, the filesystem and every median; its save directory is removed."""
    out = tmp_path / "ab.json"
    cmd = [sys.executable, os.path.join(ROOT, "scripts", "ab_commit.py"), "--lever", "workers", "--before", "2",
           "--after", "1", "--size-gb", "0.002", "--tensors", "8", "--rounds", "2", "--dir", str(tmp_path / "d"),
           "--settle-timeout", "0", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, env=dict(os.environ, PJRT_DEVICE="CPU"), capture_output=True, text=True,
                          timeout=280)
    assert proc.returncode == 0, f"ab_commit.py failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    r = json.loads(out.read_text())
    assert r["lever"] == "workers" and r["values"] == {"before": 2, "after": 1} and r["rounds"] == 2
    assert r["filesystem"] not in ("", "unknown")
    for v in ("before", "after"):
        assert len(r["commit_s_rounds"][v]) == 2
        for k in ("stall_s", "write_done_s", "commit_s", "commit_gbps", "cpu_s_per_gb"):
            _sane(r["median"][v][k], f"median.{v}.{k}")
        # /proc/stat counts in clock ticks (10 ms): a 2 MB save can fall within one, so 0 is a true reading here
        _sane(r["median"][v]["host_cpu_s_per_gb"], f"median.{v}.host_cpu_s_per_gb", allow_zero=True)
        _sane(r["median"][v]["full_collections"], f"median.{v}.full_collections", allow_zero=True)
    assert not os.path.exists(tmp_path / "d")


def test_settle_removals_probes_until_creation_is_cheap_or_the_timeout(tmp_path, monkeypatch):
    """bench.settle_removals: one probe (of every folder) when creation is already cheap; when it never gets
    cheap, a probe per wait until the timeout, each in folders of its own that are kept (removing them would
    restart the wait); when it turns cheap after a wait, until the removal window after the start has passed."""
    bench = _bench_module()
    monkeypatch.setattr(bench, "REMOVALS_FILE", str(tmp_path / "removals.json"))
    naps, nap = [], time.sleep
    monkeypatch.setattr(bench.time, "sleep", lambda s: naps.append(s) or nap(0.02))
    monkeypatch.setattr(bench, "SETTLED_CREATE_US", 1e9)
    r = bench.settle_removals(str(tmp_path / "a"), timeout_s=60, probe_files=8, probe_folders=3)
    assert r["settled"] and len(r["create_us"]) == 1 and naps == []
    assert [sorted(os.listdir(os.path.join(r["path"], d))) for d in os.listdir(r["path"])] == \
        [sorted(str(i) for i in range(8))] * 3
    monkeypatch.setattr(bench, "SETTLED_CREATE_US", -1.0)
    r = bench.settle_removals(str(tmp_path / "b"), timeout_s=0.1, probe_files=4, probe_folders=2)
    assert not r["settled"] and len(r["create_us"]) == len(naps) + 1 >= 3 and set(naps) == {10}
    assert len(os.listdir(r["path"])) == 2 * len(r["create_us"])
    # dear, then cheap: settled, and then the rest of the removal window, counted from the start, waited out
    costs, naps[:], clock = iter([500.0, 500.0, 5.0, 5.0]), [], [1000.0]
    monkeypatch.setattr(bench.time, "sleep", lambda s: naps.append(s) or clock.__setitem__(0, clock[0] + s))
    monkeypatch.setattr(bench.time, "perf_counter", lambda: clock[0])
    monkeypatch.setattr(bench, "SETTLED_CREATE_US", 40.0)
    monkeypatch.setattr(bench, "_create_cost_us", lambda probe, files: next(costs))
    r = bench.settle_removals(str(tmp_path / "c"), timeout_s=60, probe_folders=2)
    assert r["settled"] and r["create_us"] == [500.0, 5.0] and naps == [10, bench.REMOVAL_WINDOW_S - 10]


def test_settle_removals_first_waits_out_the_window_of_the_last_removal_the_scripts_noted(tmp_path, monkeypatch):
    """bench.remove_tree notes when it removed files on a filesystem; the next settle_removals there sleeps until
    REMOVAL_WINDOW_S after it, whatever its probes find (they miss removals in other block groups); a removal
    noted longer ago, or nothing removed (a missing path), costs no wait."""
    bench = _bench_module()
    monkeypatch.setattr(bench, "REMOVALS_FILE", str(tmp_path / "removals.json"))
    naps = []
    monkeypatch.setattr(bench.time, "sleep", naps.append)
    monkeypatch.setattr(bench, "SETTLED_CREATE_US", 1e9)
    bench.remove_tree(str(tmp_path / "never_made"))
    assert not os.path.exists(tmp_path / "removals.json")
    (tmp_path / "old" / "sub").mkdir(parents=True)
    (tmp_path / "old" / "sub" / "f").write_bytes(b"x")
    bench.remove_tree(str(tmp_path / "old"))
    assert not os.path.exists(tmp_path / "old")
    r = bench.settle_removals(str(tmp_path / "a"), timeout_s=60, probe_files=2, probe_folders=1)
    assert len(naps) == 1 and bench.REMOVAL_WINDOW_S - 30 < naps[0] <= bench.REMOVAL_WINDOW_S
    assert r["settled"] and r["noted_removal_wait_s"] == round(naps[0], 1)
    noted = json.loads((tmp_path / "removals.json").read_text())
    noted[str(os.stat(tmp_path).st_dev)] -= bench.REMOVAL_WINDOW_S
    (tmp_path / "removals.json").write_text(json.dumps(noted))
    naps.clear()
    r = bench.settle_removals(str(tmp_path / "b"), timeout_s=60, probe_files=2, probe_folders=1)
    assert naps == [] and r["noted_removal_wait_s"] == 0.0


def test_training_time_lost_per_save_is_the_steps_during_it_times_their_extra_time():
    bench = _bench_module()
    runs = [{"steps_during_save": 10, "step_s_during_save": 0.05, "step_s_without": 0.04},
            {"steps_during_save": 40, "step_s_during_save": 0.06, "step_s_without": 0.04},
            {"steps_during_save": 5, "step_s_during_save": 0.04, "step_s_without": 0.04}]
    r = {"train_step_slowdown": 1.25, "train_step": {"ratio": 1.25, "runs": runs}}
    assert bench.train_time_lost(r) == pytest.approx(0.1)          # median of 0.1, 0.8 and 0.0
    assert bench._slowdown_text(r) == ("1.25x (training time lost per save 0.10 s: the save ran through "
                                       "10 / 40 / 5 training steps)")
    assert bench.train_time_lost({"train_step": None}) == 0.0
    assert bench._slowdown_text({"train_step_slowdown": float("nan")}) == "not measured (--skip-train)"


@pytest.mark.timeout(300)
def test_ab_train_tiny_run_alternates_what_runs_before_the_training_loop(tmp_path):
    """scripts/ab_train.py: a warm-up of each variant, then rounds in alternating order; each result holds the
    slowdown and the save's own CPU and page faults; released buffers are faulted in again by the next save."""
    out = tmp_path / "ab.json"
    cmd = [sys.executable, os.path.join(ROOT, "scripts", "ab_train.py"), "--size-gb", "0.02", "--tensors", "128",
           "--rounds", "2", "--variants", "kept,released", "--train-steps", "3", "--train-dim", "64",
           "--dir", str(tmp_path / "d"), "--settle-timeout", "0", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, env=dict(os.environ, PJRT_DEVICE="CPU"), capture_output=True, text=True,
                          timeout=280)
    assert proc.returncode == 0, f"ab_train.py failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    r = json.loads(out.read_text())
    assert [(rnd, v) for rnd, v, _, _ in r["order"]] == [(0, "kept"), (0, "released"), (1, "kept"),
                                                         (1, "released"), (2, "released"), (2, "kept")]
    for v in ("kept", "released"):
        for k in ("ratio", "step_s_without", "save_stall_s"):
            _sane(r["median"][v][k], f"median.{v}.{k}")
        # an estimate (window CPU minus the steps' CPU at their rate without a save): may dip below 0 when tiny
        assert math.isfinite(r["median"][v]["save_cpu_s"])
    # 20 MB of fresh buffers after release_host_buffers(), none with the buffers kept. The tensors are under 1 MiB:
    # larger buffers are cut from huge-page slabs (staging.HostBufferPool), which fault 2 MiB at a time.
    assert r["median"]["released"]["save_stall_page_faults_mb"] > 10 > r["median"]["kept"]["save_stall_page_faults_mb"]
    assert not any(os.listdir(tmp_path / "d"))


def test_ab_save_dir_keeps_earlier_rounds_only_with_keep_tags(tmp_path):
    """A/B scripts: by default every save goes into --dir emptied first; with --keep-tags each round of each
    variant gets a new folder and the earlier ones stay (no mass deletion right before a save)."""
    bench = _bench_module()
    root = tmp_path / "ab"
    args = bench.ab_parser("", dir=str(root), rounds=1).parse_args([])
    assert args.keep_tags is False
    first = bench.ab_save_dir(args, "before", 0)
    (root / "old_file").write_text("x")
    assert bench.ab_save_dir(args, "after", 0) == str(root) == first and os.listdir(root) == []
    kept = bench.ab_parser("", dir=str(root), rounds=1).parse_args(["--keep-tags"])
    a, b = bench.ab_save_dir(kept, "before", 1), bench.ab_save_dir(kept, "after", 1)
    assert a != b and sorted(os.listdir(root)) == ["after_1", "before_1"]
    assert os.listdir(a) == [] and os.listdir(b) == []


def test_bench_keep_tags_gives_every_save_a_folder_removed_only_at_the_end(tmp_path):
    """bench.py: by default a method's previous save is removed right before its next one; with --keep-tags
    every save (and limit file set) gets a new folder, nothing is removed until cleanup() at the end."""
    import argparse

    bench = _bench_module()
    b = bench.Bench.__new__(bench.Bench)        # the folder bookkeeping only: no model state
    b.dir, b.counter, b.created, b.cache = str(tmp_path), 0, set(), bench.Cache()
    b.args = argparse.Namespace(keep_tags=True)
    first = b.fresh("nxd")
    (tmp_path / os.path.basename(first) / "f").write_text("x")
    b.discard(first)
    second = b.fresh("nxd")
    assert first != second and os.path.exists(os.path.join(first, "f")) and os.listdir(second) == []
    b.cleanup()
    assert os.listdir(tmp_path) == []
    b.args.keep_tags = False
    first = b.fresh("nxd")
    (tmp_path / "nxd" / "f").write_text("x")
    assert b.fresh("nxd") == first and os.listdir(first) == []
    b.discard(first)
    assert not os.path.exists(first)


def test_renice_background_renices_existing_and_future_background_threads(monkeypatch, request):
    """The A/B scripts' ``nice`` lever: nxd_ckpt's threads that exist are reniced, and BACKGROUND_NICE is set for
    the threads started later; other threads keep their niceness."""
    import threading

    from nxd_ckpt import writepool

    bench = _bench_module()
    monkeypatch.setattr(writepool, "BACKGROUND_NICE", writepool.BACKGROUND_NICE)
    # the library's own background threads, kept between saves, get their niceness back for later tests
    request.addfinalizer(lambda nice=writepool.BACKGROUND_NICE: bench.renice_background(nice))
    base = os.getpriority(os.PRIO_PROCESS, 0)
    seen, go = {}, threading.Event()

    def park():
        go.wait(30)
        seen[threading.current_thread().name] = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    threads = [threading.Thread(target=park, name=n) for n in ("nxd_ckpt-write_0", "other")]
    for t in threads:
        t.start()
    bench.renice_background(3)
    go.set()
    for t in threads:
        t.join(30)
    assert writepool.BACKGROUND_NICE == 3
    assert seen == {"nxd_ckpt-write_0": min(19, base + 3), "other": base}


def test_sched_background_sets_existing_and_future_background_threads(monkeypatch):
    """The A/B scripts' ``schedidle`` lever and ``no_sched_idle`` variant: nxd_ckpt's threads that exist get the
    policy, their niceness kept, and BACKGROUND_SCHED_IDLE is set for the threads started later; other threads
    keep theirs."""
    import threading

    from nxd_ckpt import writepool

    bench = _bench_module()
    monkeypatch.setattr(writepool, "BACKGROUND_SCHED_IDLE", writepool.BACKGROUND_SCHED_IDLE)
    seen, go, ready = {}, threading.Event(), threading.Barrier(3, timeout=30)

    def park():
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, 19)
        ready.wait()
        go.wait(30)
        seen[threading.current_thread().name] = (os.sched_getscheduler(tid), os.getpriority(os.PRIO_PROCESS, tid))

    threads = [threading.Thread(target=park, name=n) for n in ("nxd_ckpt-small_0", "other")]
    for t in threads:
        t.start()
    ready.wait()
    bench.sched_background(True)
    go.set()
    for t in threads:
        t.join(30)
    assert writepool.BACKGROUND_SCHED_IDLE is True
    assert seen == {"nxd_ckpt-small_0": (os.SCHED_IDLE, 19), "other": (os.SCHED_OTHER, 19)}


@pytest.mark.timeout(300)
def test_ab_saves_tiny_run_counts_back_to_back_saves(tmp_path):
    """scripts/ab_saves.py: saves in a row from the given checkout, the first not counted, its JSON line complete;
    a wrong argument is refused before anything is saved."""
    cmd = [sys.executable, os.path.join(ROOT, "scripts", "ab_saves.py"), "--code", ROOT, "--size-gb", "0.002",
           "--tensors", "8", "--saves", "3", "--dir", str(tmp_path / "d")]
    proc = subprocess.run(cmd, cwd=ROOT, env=dict(os.environ, PJRT_DEVICE="CPU"), capture_output=True, text=True,
                          timeout=280)
    assert proc.returncode == 0, f"ab_saves.py failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    assert r["code"] == os.path.abspath(ROOT) and r["saves"] == 2 and len(r["cpus"]) == 2
    for k in ("cpu", "commit", "stall"):
        _sane(r[k], k)
    assert isinstance(r["full_gcs"], int) and r["full_gcs"] >= 0
    assert len(os.listdir(tmp_path / "d")) == 1 and len(os.listdir(next((tmp_path / "d").iterdir()))) == 3
    bad = subprocess.run(cmd[:-2] + ["--saves", "1"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--saves must be more than --skip" in bad.stderr


@pytest.mark.timeout(300)
def test_ab_reuse_tiny_run_interleaves_both_variants(tmp_path):
    """scripts/ab_reuse.py: both variants save into their own folder of one process; the reusing folder ends with
    a retired tag kept for reuse, the deleting one without; a JSON line each with medians of the steady saves."""
    cmd = [sys.executable, os.path.join(ROOT, "scripts", "ab_reuse.py"), "--size-gb", "0.002", "--tensors", "8",
           "--saves", "4", "--dir", str(tmp_path / "d")]
    proc = subprocess.run(cmd, cwd=ROOT, env=dict(os.environ, PJRT_DEVICE="CPU"), capture_output=True, text=True,
                          timeout=280)
    assert proc.returncode == 0, f"ab_reuse.py failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    lines = [json.loads(x) for x in proc.stdout.strip().splitlines()[-2:]]
    assert [r["reuse_retired_files"] for r in lines] == [True, False]
    for r in lines:
        assert r["saves"] == 1 and len(r["cpu_s_per_gb_each"]) == 4
        _sane(r["cpu_s_per_gb"], "cpu_s_per_gb", allow_zero=True)     # 2 MB: may be under one clock tick
        for k in ("finalized_s", "commit_s"):
            _sane(r[k], k)
    run = next((tmp_path / "d").iterdir())
    assert sorted(os.listdir(run / "reuse")) == [".nxd_ckpt_reuse", "newest", "t2", "t3"]
    assert sorted(os.listdir(run / "delete")) == ["newest", "t2", "t3"]
    bad = subprocess.run(cmd[:-4] + ["--saves", "3"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--saves must be more than 3" in bad.stderr
