"""The multi-rank runner itself: results in rank order, every failure reported, nothing hangs."""
from __future__ import annotations

import os
import re
import time

import harness
import pytest
from harness import run_ranks, run_torchrun


def _echo(rank, world, tag, *, scale=1):
    import torch
    import torch.distributed as dist
    import torch_xla

    dev = torch_xla.device()
    x = (torch.arange(3, device=dev) + rank) * scale
    total = torch.tensor([rank])
    dist.all_reduce(total)
    env = {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                                          "MASTER_PORT", "PJRT_DEVICE", "HARNESS_TEST_VAR")}
    return {"rank": rank, "world": world, "tag": tag, "x": x.cpu().tolist(), "device": str(x.device),
            "sum": int(total.item()), "dist_rank": dist.get_rank(), "env": env, "pid": os.getpid()}


def test_returns_values_in_rank_order_with_torchrun_env():
    out = run_ranks(_echo, 4, "hi", scale=10, env={"HARNESS_TEST_VAR": "yes"}, timeout=60)
    assert [o["rank"] for o in out] == [0, 1, 2, 3]
    assert len({o["pid"] for o in out}) == 4
    for r, o in enumerate(out):
        assert o["world"] == 4 and o["tag"] == "hi" and o["dist_rank"] == r
        assert o["x"] == [10 * r, 10 * r + 10, 10 * r + 20]
        assert o["device"].startswith("xla")
        assert o["sum"] == 6
        env = o["env"]
        assert (env["RANK"], env["LOCAL_RANK"], env["WORLD_SIZE"], env["LOCAL_WORLD_SIZE"]) == (str(r), str(r), "4", "4")
        assert env["MASTER_ADDR"] == "127.0.0.1" and int(env["MASTER_PORT"]) > 0
        assert env["PJRT_DEVICE"] == "CPU" and env["HARNESS_TEST_VAR"] == "yes"


def _raise_on_some(rank, world):
    import torch.distributed as dist

    if rank == 1:
        raise ValueError("marker-one: rank 1 is broken")
    if rank == 2:
        _nested_failure()
    dist.barrier()  # the healthy ranks then fail too: their peers are gone
    return rank


def _nested_failure():
    raise KeyError("marker-two")


def test_every_failing_rank_traceback_is_in_the_message():
    with pytest.raises(AssertionError) as info:
        run_ranks(_raise_on_some, 4, timeout=60)
    msg = str(info.value)
    assert "rank 1 raised" in msg and "rank 2 raised" in msg
    assert "ValueError: marker-one: rank 1 is broken" in msg
    assert "KeyError: 'marker-two'" in msg
    assert "_nested_failure" in msg  # the full traceback, not just the last line
    assert "Traceback (most recent call last)" in msg
    assert msg.index("rank 1 raised") < msg.index("rank 2 raised")


def _hang_on_one(rank, world, pidfile):
    if rank == 1:
        with open(pidfile, "w") as f:
            f.write(str(os.getpid()))
        _stuck_here()
    return rank


def _stuck_here():
    while True:
        time.sleep(0.1)


def _pid_alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_hanging_rank_is_reported_and_killed_within_the_timeout(tmp_path):
    pidfile = str(tmp_path / "pid")
    harness._warm_up(harness._context())  # the forkserver's one-time start is not part of the timeout
    with pytest.raises(AssertionError) as info:
        run_ranks(_hang_on_one, 3, pidfile, timeout=4)
    msg = str(info.value)
    assert "did not finish within the timeout of 4s" in msg and "[1]" in msg
    assert "rank 1 did not finish" in msg
    assert "raised" not in msg and "rank 0 did not" not in msg and "rank 2 did not" not in msg
    assert "_stuck_here" in msg, "the hung rank's stack dump should be in the message"
    with open(pidfile) as f:
        pid = int(f.read())
    assert not _pid_alive(pid)


def _fail_then_wait(rank, world):
    if rank == 0:
        raise RuntimeError("first failure")
    _stuck_here()


def test_after_a_failure_the_other_ranks_are_killed_early(monkeypatch):
    monkeypatch.setattr(harness, "FAILURE_GRACE_S", 1.0)
    with pytest.raises(AssertionError) as info:
        run_ranks(_fail_then_wait, 3, timeout=60)
    msg = str(info.value)
    assert "first to fail: rank 0" in msg and "RuntimeError: first failure" in msg
    assert "did not finish within 1s after another rank failed (killed): [1, 2]" in msg


def _die(rank, world):
    if rank == 1:
        print("about to exit hard", flush=True)
        os._exit(7)
    return rank


def test_a_rank_that_dies_is_reported_with_its_exit_code_and_output():
    with pytest.raises(AssertionError) as info:
        run_ranks(_die, 2, timeout=60)
    msg = str(info.value)
    assert "rank 1 exited (exit code 7) without returning" in msg
    assert "about to exit hard" in msg


def _unpicklable(rank, world):
    return lambda: rank


def test_unpicklable_return_value_is_an_error():
    with pytest.raises(AssertionError, match="could not be pickled"):
        run_ranks(_unpicklable, 1, timeout=60)


_SCRIPT = """
import os, sys, torch, torch.distributed as dist
dist.init_process_group("gloo")
t = torch.tensor([dist.get_rank() + 1])
dist.all_reduce(t)
# one bracketed record per rank: two ranks share the pipe, so lines may interleave
os.write(1, f"<rank={dist.get_rank()} local={os.environ['LOCAL_RANK']} world={dist.get_world_size()} sum={t.item()}"
            f" arg={sys.argv[1]}>\\n".encode())
dist.destroy_process_group()
"""

_HANG_SCRIPT = """
import os, time
# one write per rank: print's pieces of two ranks interleaved on the shared pipe ("startedstarted  01")
os.write(1, f"<started {os.environ['RANK']}>\\n".encode())
time.sleep(1000)
"""


def test_run_torchrun_runs_a_script(tmp_path):
    script = tmp_path / "s.py"
    script.write_text(_SCRIPT)
    res = run_torchrun([str(script), "abc"], nproc=2, timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    lines = sorted(re.findall(r"<(rank=[^>]*)>", res.stdout))
    assert lines == ["rank=0 local=0 world=2 sum=3 arg=abc", "rank=1 local=1 world=2 sum=3 arg=abc"]


@pytest.mark.slow
def test_run_torchrun_kills_everything_on_timeout(tmp_path):
    import subprocess

    script = tmp_path / "hang_script.py"
    script.write_text(_HANG_SCRIPT)
    with pytest.raises(subprocess.TimeoutExpired) as info:
        run_torchrun([str(script)], nproc=2, timeout=12)
    assert "<started 0>" in (info.value.output or ""), "the workers should have started before the timeout"
    out = subprocess.run(["pgrep", "-f", str(script)], check=False, capture_output=True, text=True)
    assert out.stdout.strip() == "", f"left-over processes: {out.stdout}"


@pytest.mark.slow
def test_run_torchrun_simulates_several_nodes(tmp_path):
    script = tmp_path / "s.py"
    script.write_text(_SCRIPT)
    res = run_torchrun([str(script), "n"], nproc=1, timeout=120, nnodes=2)
    assert res.returncode == 0, res.stderr[-3000:]
    lines = sorted(re.findall(r"<(rank=[^>]*)>", res.stdout))
    assert lines == ["rank=0 local=0 world=2 sum=3 arg=n", "rank=1 local=0 world=2 sum=3 arg=n"]
    assert "===== node 1 =====" in res.stdout
