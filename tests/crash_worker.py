"""Fault injection for nxd-ckpt: rank functions that crash, hang or fill the disk during a save, and a
runner for them.

Used two ways:

- by the tests, through :func:`run_ranks_tolerant` (the forkserver ranks of ``harness.py``, but a rank
  that is SIGKILLed or SIGSTOPped is an expected outcome, not a failure), and
- as a script under torchrun, to crash a real job by hand::

      torchrun --standalone --nproc-per-node 2 tests/crash_worker.py crash --root /tmp/ck --side /tmp/side \
          --phase write --victims all --num-kept 2
      torchrun --standalone --nproc-per-node 2 tests/crash_worker.py restart --root /tmp/ck --side /tmp/side \
          --expect-step 1 --num-kept 2

  (torchrun's agent stops every worker as soon as one dies, so what the survivors of a single-rank crash
  do is only observable under run_ranks_tolerant, which lets them finish.)

The training state saved at every step a checkpoint is taken is dumped by each rank to a side file
(``<side>/rank<R>_step<S>.pt``), so a later job can check a restore bit for bit.
"""
from __future__ import annotations

import multiprocessing.connection as mp_connection
import os
import pickle
import signal
import sys
import shutil
import tempfile
import time
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence

_HERE = os.path.dirname(os.path.abspath(__file__))
for _p in (os.path.dirname(_HERE), _HERE):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import torch  # noqa: E402

from nxd_ckpt.storage.testing import enable_test_schemes  # noqa: E402

enable_test_schemes()   # objdir:// / mem:// in this process and in every rank process that imports this module

STEPS = 1            # training steps between checkpoints
SEED = 5
FIRST, SECOND = f"step_{STEPS}", f"step_{2 * STEPS}"
RESUMED = "resumed"


# ------------------------------------------------------------------------------------------------------
# runner: like harness.run_ranks, but deaths and stops are outcomes
# ------------------------------------------------------------------------------------------------------
@dataclass
class Outcome:
    status: str          # "ok" (returned), "error" (raised), "died" (exited without returning), "stopped"
    #                      (a straggler found stopped by a signal), "running" (a straggler found not stopped)
    value: Any = None    # return value, traceback text, or exit description
    output: str = ""     # tail of the rank's stdout/stderr

    def __repr__(self) -> str:
        return f"Outcome({self.status}, {self.value!r:.300})"


def run_ranks_tolerant(fn, world_size: int, *args, timeout: float = 120, stragglers: Sequence[int] = (),
                       **kwargs) -> List[Outcome]:
    """Run ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` forkserver processes (gloo group,
    own XLA CPU device, as harness.run_ranks) and return every rank's Outcome in rank order.

    A rank that dies is reported as ``died``. Ranks listed in ``stragglers`` (e.g. one that SIGSTOPs
    itself) are SIGKILLed as soon as every other rank has finished, and reported as ``stopped``. Any
    other rank still running after ``timeout`` is an AssertionError (the test would otherwise hang).
    """
    import torch.distributed as dist
    from datetime import timedelta

    import harness

    ctx = harness._context()
    harness._warm_up(ctx)
    deadline = time.monotonic() + timeout
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=max(timeout, 1)))
    logdir = tempfile.mkdtemp(prefix="crash_ranks_")
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(store.port), WORLD_SIZE=str(world_size),
               LOCAL_WORLD_SIZE=str(world_size), PJRT_DEVICE="CPU", TORCHELASTIC_USE_AGENT_STORE="True")
    procs, conns, logs = [], {}, []
    out: Dict[int, Outcome] = {}
    try:
        for rank in range(world_size):
            log_path = os.path.join(logdir, f"rank{rank}.log")
            logs.append(log_path)
            reader, writer = ctx.Pipe(duplex=False)
            p = ctx.Process(target=harness._rank_main,
                            args=(fn, rank, world_size, args, kwargs, dict(env, RANK=str(rank), LOCAL_RANK=str(rank)),
                                  list(sys.path), writer, log_path, timeout),
                            name=f"rank{rank}")
            p.start()
            writer.close()
            procs.append(p)
            conns[rank] = reader
        while conns:
            if all(r in stragglers for r in conns):
                break
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            for conn in mp_connection.wait(list(conns.values()), timeout=remaining):
                rank = next(r for r, c in conns.items() if c is conn)
                try:
                    status, value = pickle.loads(conn.recv_bytes())
                except (EOFError, OSError):
                    procs[rank].join(timeout=5)
                    status, value = "died", harness._signal_name(procs[rank].exitcode)
                conn.close()
                del conns[rank]
                out[rank] = Outcome(status, value)
        late = [r for r in conns if r not in stragglers]
        for r in list(conns):
            state = _process_state(procs[r].pid)
            harness._kill_tree(procs[r])
            procs[r].join(timeout=5)
            status = ("stopped" if state == "T" else "running") if r in stragglers else "timeout"
            out[r] = Outcome(status, f"{harness._signal_name(procs[r].exitcode)} (was in state {state})")
        for p in procs:
            p.join(timeout=max(1.0, deadline - time.monotonic()))
        for r, o in out.items():
            o.output = harness._tail(logs[r], 40)
        if late:
            raise AssertionError(f"ranks {late} did not finish within {timeout}s:\n" +
                                 "\n".join(f"--- rank {r} ---\n{out[r].output}" for r in late))
        return [out[r] for r in range(world_size)]
    finally:
        for p in procs:
            if p.exitcode is None:
                harness._kill_tree(p)
                p.join(timeout=5)
        for c in conns.values():
            c.close()
        del store
        shutil.rmtree(logdir, ignore_errors=True)


def _process_state(pid: int) -> str:
    """The kernel's one-letter state of ``pid`` (T: stopped by a signal), "?" when unknown."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "?"


def describe(outcomes: List[Outcome]) -> str:
    return "\n".join(f"rank {r}: {o.status}: {o.value!r:.2000}\n{o.output}" for r, o in enumerate(outcomes))


# ------------------------------------------------------------------------------------------------------
# training state
# ------------------------------------------------------------------------------------------------------
def build(seed_offset: int = 0, hidden: int = 8):
    """A TP shard (TP = world size, set up by the caller), Adam and a LambdaLR scheduler."""
    import parallel_state as ps
    from tiny_models import TinyShard

    model = TinyShard(ps.get_tensor_model_parallel_rank(), hidden=hidden, seed_offset=seed_offset)
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    return model, opt, sched


def train(model, opt, sched, start: int, steps: int = STEPS) -> None:
    from tiny_models import train_steps

    train_steps(model, opt, steps, seed=SEED, sched=sched, start=start)


def state_of(model, opt, sched) -> dict:
    from tiny_models import to_cpu_state

    return {"model": to_cpu_state(model.state_dict()), "optim": to_cpu_state(opt.state_dict()),
            "sched": dict(sched.state_dict())}


def dump(side: str, rank: int, step: int, state: dict) -> None:
    os.makedirs(side, exist_ok=True)
    torch.save(state, os.path.join(side, f"rank{rank}_step{step}.pt"))


def expected(side: str, rank: int, step: int) -> dict:
    return torch.load(os.path.join(side, f"rank{rank}_step{step}.pt"), weights_only=False)


def _init_tp(world: int) -> None:
    import parallel_state as ps

    ps.initialize_model_parallel(tensor_model_parallel_size=world)


# ------------------------------------------------------------------------------------------------------
# fault injection
# ------------------------------------------------------------------------------------------------------
def die() -> None:
    """SIGKILL this process now: no cleanup, no atexit, no flush, like a node failure."""
    os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(60)  # not reached


PHASES = ("snapshot", "write", "commit", "newest", "retention")


def arm(phase: str, rank: int, victim: bool, everyone: bool, second: str = SECOND) -> None:
    """Make this rank SIGKILL itself at ``phase`` of the next save (of tag ``second``).

    snapshot   during the device-to-host copy (on the training thread)
    write      when it starts its second tensor file
    commit     rank 0: after the manifest, before `done`; others (when everyone dies): after reporting
    newest     rank 0: after the rename into place, before the `newest` pointer is replaced
    retention  rank 0: inside retention, after removing `done` of the first tag it deletes
    """
    import nxd_ckpt.coord
    import nxd_ckpt.commit
    import nxd_ckpt.engine
    import nxd_ckpt.staging
    from nxd_ckpt.storage import set_write_hook

    if not victim:
        return
    if phase == "snapshot":
        def killing_copy(tensors, pool=None):
            die()

        nxd_ckpt.staging.copy_to_host = killing_copy
        if hasattr(nxd_ckpt.engine, "copy_to_host"):
            nxd_ckpt.engine.copy_to_host = killing_copy
        return
    if phase == "write":
        seen = []

        def hook(rel):
            if ".tensors/" in rel:
                seen.append(rel)
                if len(seen) == 2:
                    die()

        set_write_hook(hook)
        return
    if rank != 0:
        if everyone:   # rank-0-only phases: the other ranks die once their files are reported
            original = nxd_ckpt.coord.Coordinator.report

            def report_then_die(self, name, value):
                original(self, name, value)
                if name == "written":
                    die()

            nxd_ckpt.coord.Coordinator.report = report_then_die
        return
    if phase == "commit":
        # `done` in the staging directory (rename commit) or at its final key (marker commit)
        set_write_hook(lambda rel: die() if rel in (f"{second}.nxdtmp/done", f"{second}/done") else None)
    elif phase == "newest":
        set_write_hook(lambda rel: die() if rel == "newest" else None)
    elif phase == "retention":
        # the real delete_tag runs (done, manifest, rename to .nxdold) and dies while removing the files, or
        # while moving them into the reuse folder (nxd_ckpt.reuse) with one of them gone
        from nxd_ckpt.layout import REUSE_DIR
        from nxd_ckpt.storage.local import LocalStorage

        original_remove_tree, original_rename = LocalStorage.remove_tree, LocalStorage.rename

        def remove_one_then_die(storage, relpath):
            path = storage.path(relpath)
            if relpath.endswith(".nxdold") and os.path.isdir(path):
                victim = next(os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs)
                os.unlink(victim)
                die()

        def remove_some_then_die(self, relpath):
            remove_one_then_die(self, relpath)
            original_remove_tree(self, relpath)

        def retire_some_then_die(self, src, dst):
            if dst.startswith(REUSE_DIR + "/"):
                remove_one_then_die(self, src)
            original_rename(self, src, dst)

        LocalStorage.remove_tree = remove_some_then_die
        LocalStorage.rename = retire_some_then_die

        from nxd_ckpt.storage.objects import ObjectStorage

        original_delete = ObjectStorage.delete_many

        def delete_one_then_die(self, relpaths):
            relpaths = list(relpaths)
            if len(relpaths) > 1:        # the bulk delete of a tag's objects, the manifest first (after `done`)
                original_delete(self, relpaths[:1])
                die()
            original_delete(self, relpaths)

        ObjectStorage.delete_many = delete_one_then_die
    else:
        raise ValueError(f"unknown phase {phase!r}")


# ------------------------------------------------------------------------------------------------------
# rank functions
# ------------------------------------------------------------------------------------------------------
def crash_run(rank: int, world: int, root: str, side: str, phase: str, victims: Sequence[int],
              timeout_s: float, num_kept: Optional[int]) -> dict:
    """Save FIRST (complete), train, start an async save of SECOND that ``victims`` die in at ``phase``.
    Survivors return what finalize_checkpoint raised."""
    import nxd_ckpt

    _init_tp(world)
    model, opt, sched = build()
    train(model, opt, sched, 0)
    dump(side, rank, STEPS, state_of(model, opt, sched))
    nxd_ckpt.save_checkpoint(root, FIRST, model=model, optimizer=opt, scheduler=sched,
                             user_content={"step": STEPS}, num_kept_ckpts=num_kept, use_xser=True)
    train(model, opt, sched, STEPS)
    dump(side, rank, 2 * STEPS, state_of(model, opt, sched))
    arm(phase, rank, rank in victims, len(victims) == world)
    try:
        nxd_ckpt.save_checkpoint(root, SECOND, model=model, optimizer=opt, scheduler=sched,
                                 user_content={"step": 2 * STEPS}, num_kept_ckpts=num_kept, async_save=True,
                                 timeout_s=timeout_s, use_xser=True)
        nxd_ckpt.finalize_checkpoint()
    except nxd_ckpt.RankFailureError as exc:
        return {"raised": type(exc).__name__, "causes": {int(k): v for k, v in exc.causes.items()},
                "message": str(exc)}
    except Exception as exc:  # noqa: BLE001 - reported to the test as what it is
        return {"raised": type(exc).__name__, "causes": {}, "message": str(exc)}
    return {"raised": None}


def restart_run(rank: int, world: int, root: str, side: str, expect_step: int, num_kept: Optional[int]) -> dict:
    """A new job: load the newest complete checkpoint into freshly built objects, check it bit for bit,
    and save it again as RESUMED (which must clean up the crash's debris)."""
    import nxd_ckpt
    from tiny_models import assert_bit_equal

    _init_tp(world)
    model, opt, sched = build(seed_offset=77)          # everything must come from disk
    user = nxd_ckpt.load_checkpoint(root, model=model, optimizer=opt, scheduler=sched)
    assert user == {"step": expect_step}, user
    want = expected(side, rank, expect_step)
    got = state_of(model, opt, sched)
    assert_bit_equal(want["model"], got["model"], "model")
    assert_bit_equal(want["optim"], got["optim"], "optim")
    assert got["sched"] == want["sched"], (got["sched"], want["sched"])
    nxd_ckpt.save_checkpoint(root, RESUMED, model=model, optimizer=opt, scheduler=sched,
                             user_content={"step": expect_step}, num_kept_ckpts=num_kept, use_xser=True)
    return {"loaded": expect_step}


def hung_run(rank: int, world: int, root: str, stopped: int, timeout_s: float, slow_root_s: float = 0.0) -> dict:
    """Replicated state over DP (every rank writes a share of the tensor files); rank ``stopped``
    SIGSTOPs itself on its first tensor file of the second save. Rank 0 takes ``slow_root_s`` longer than
    the others to write its files (it has the most to write), so the others start waiting for its verdict
    before it starts waiting for their reports. The survivors report what they raised."""
    import nxd_ckpt
    from nxd_ckpt.storage import set_write_hook
    from tiny_models import xla_device

    state = {f"w{i}": torch.full((8,), float(i)).to(xla_device()) for i in range(2 * world)}
    nxd_ckpt.save_checkpoint(root, "good", model=state, use_xser=True)
    if rank == stopped:
        def stop(rel: str) -> None:
            if ".tensors/" in rel:
                print(f"rank {rank}: SIGSTOP before writing {rel}", flush=True)   # in the log the test shows
                os.kill(os.getpid(), signal.SIGSTOP)
        set_write_hook(stop)
    elif rank == 0 and slow_root_s:
        set_write_hook(lambda rel: time.sleep(slow_root_s) if ".tensors/" in rel else None)
    try:
        nxd_ckpt.save_checkpoint(root, "hung", model=state, timeout_s=timeout_s, use_xser=True)
    except nxd_ckpt.RankFailureError as exc:
        return {"raised": type(exc).__name__, "causes": {int(k): v for k, v in exc.causes.items()},
                "message": str(exc)}
    return {"raised": None}


# ------------------------------------------------------------------------------------------------------
# torchrun entry point (by hand)
# ------------------------------------------------------------------------------------------------------
def main(argv=None) -> int:
    import argparse

    import torch.distributed as dist

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mode", choices=["crash", "restart"])
    ap.add_argument("--root", required=True)
    ap.add_argument("--side", required=True)
    ap.add_argument("--phase", choices=PHASES, default="write")
    ap.add_argument("--victims", default="1", help="comma-separated ranks that die, or 'all'")
    ap.add_argument("--timeout-s", type=float, default=10.0)
    ap.add_argument("--num-kept", type=int, default=None)
    ap.add_argument("--expect-step", type=int, default=STEPS)
    a = ap.parse_args(argv)
    os.environ.setdefault("PJRT_DEVICE", "CPU")
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if a.mode == "crash":
        victims = list(range(world)) if a.victims == "all" else [int(v) for v in a.victims.split(",")]
        print(f"rank {rank}:", crash_run(rank, world, a.root, a.side, a.phase, victims, a.timeout_s, a.num_kept))
    else:
        print(f"rank {rank}:", restart_run(rank, world, a.root, a.side, a.expect_step, a.num_kept))
    return 0


if __name__ == "__main__":
    sys.exit(main())
