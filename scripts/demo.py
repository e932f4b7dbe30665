#!/usr/bin/env python
"""`make demo`: crash a training job while an async checkpoint is being written, resume it, and show that
nothing was lost.

Phases (each prints one line with its timing; every command's full output is kept in demo_out/logs/):
  1. reference: train_demo.py (4 ranks: TP=2 x DP=2, ZeRO-1 Adam) for 30 steps without interruption, saving
     synchronously every 5 steps (the synchronous save times are the baseline for the async stalls);
  2. crash: the same run with async saves, every rank SIGKILLed right after the save of step 20 returned,
     while that save is still being written;
  3. resume: the same command again; it finds the newest complete checkpoint (step 15) and runs to the end;
  4. tools: `nxd-ckpt ls` and `nxd-ckpt verify` on the checkpoint directory; `nxd-ckpt convert-zero1` of the
     newest checkpoint to DP=1, and a 2-rank (TP=2, DP=1) job that resumes from it for a few steps;
  5. verdict: run 3's final parameters and optimizer state equal run 1's bit for bit (exit 1 if not), and a
     table of the saves: stall, commit time, bytes, throughput, next to the synchronous save time;
  6. demo_out/report.png and demo_out/summary.json.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "demo_out")
LOGS = os.path.join(OUT, "logs")
TRAIN = os.path.join(ROOT, "scripts", "train_demo.py")

STEPS, EVERY, CRASH_AT, DP1_EXTRA = 30, 5, 20, 4
TRAIN_ARGS = ["--zero1", "--tp", "2", "--steps", str(STEPS), "--ckpt-every", str(EVERY), "--log-every", "5"]
RUN_TIMEOUT_S = 240

T0 = time.monotonic()


def log(msg: str) -> None:
    print(f"[demo {time.monotonic() - T0:6.1f}s] {msg}", flush=True)


def fail(msg: str) -> None:
    log(f"FAILED: {msg}")
    sys.exit(1)


def env() -> dict:
    e = dict(os.environ)
    e.setdefault("PJRT_DEVICE", "CPU")
    e.setdefault("OMP_NUM_THREADS", "1")
    e["PYTHONPATH"] = ROOT + (os.pathsep + e["PYTHONPATH"] if e.get("PYTHONPATH") else "")
    e["PYTHONUNBUFFERED"] = "1"
    return e


HEARTBEAT_S = 10.0


def last_line(path: str, limit: int = 100) -> str:
    """The last non-empty line a child has written so far (shortened), for the heartbeat."""
    with open(path, "rb") as f:
        f.seek(max(0, os.path.getsize(path) - 4096))
        lines = [ln for ln in f.read().decode(errors="replace").splitlines()
                 if ln.strip() and not ln.startswith("[Gloo]")]   # gloo's connection chatter says nothing
    text = lines[-1].strip() if lines else "(none yet)"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def run(name: str, cmd, expect_ok: bool = True, timeout: float = RUN_TIMEOUT_S):
    """Run a command, its output to demo_out/logs/<name>.log; return (returncode, seconds, output)."""
    path = os.path.join(LOGS, f"{name}.log")
    t = time.monotonic()
    with open(path, "w") as f:
        f.write("$ " + " ".join(cmd) + "\n")
        f.flush()
        log(f"{name}: started (output in {os.path.relpath(path, ROOT)})")
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env(), cwd=ROOT,
                                start_new_session=True, stdin=subprocess.DEVNULL)
        rc = None
        while rc is None:
            try:
                rc = proc.wait(timeout=min(HEARTBEAT_S, max(0.1, t + timeout - time.monotonic())))
            except subprocess.TimeoutExpired:
                if time.monotonic() - t >= timeout:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
                    fail(f"{name} did not finish within {timeout:.0f}s; see {os.path.relpath(path, ROOT)}")
                log(f"{name}: running for {time.monotonic() - t:.0f}s; last output: {last_line(path)}")
    secs = time.monotonic() - t
    with open(path) as f:
        text = f.read()
    if expect_ok and rc != 0:
        tail = "\n".join(text.rstrip().splitlines()[-25:])
        fail(f"{name} exited with {rc}; last lines of {os.path.relpath(path, ROOT)}:\n{tail}")
    return rc, secs, text


def torchrun(nproc: int, args):
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1",
            "--nproc-per-node", str(nproc), "--max-restarts", "0", TRAIN, *map(str, args)]


def cli(*args):
    return [sys.executable, "-m", "nxd_ckpt.cli", *map(str, args)]


def load_json(path):
    with open(path) as f:
        return json.load(f)


def indent(text: str, prefix: str = "      ") -> str:
    return "\n".join(prefix + line for line in text.rstrip().splitlines())


def compare_runs(out_dir: str, ranks: int, ref: dict, res: dict):
    """(bit exact?, differences, same losses?) of the resumed run ``res`` against the reference ``ref``:
    every rank's final state dump (final_ref / final_resume .rank<r>.pt) and the reports' checksums and
    losses of the steps the resumed run trained."""
    import torch

    diffs = []
    for r in range(ranks):
        a = torch.load(os.path.join(out_dir, f"final_ref.rank{r}.pt"), weights_only=True)
        b = torch.load(os.path.join(out_dir, f"final_resume.rank{r}.pt"), weights_only=True)
        d = bit_diff(a, b, f"rank{r}")
        if d:
            diffs.append(d)
    same_losses = all(ref["losses"].get(s) == loss for s, loss in res["losses"].items())
    return not diffs and ref["final_checksum"] == res["final_checksum"], diffs, same_losses


def bit_diff(a, b, path="state"):
    """None when a and b are equal bit for bit (tensors: dtype, shape, bytes), else where they differ."""
    import torch

    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return f"{path}: tensor vs {type(b).__name__}"
        if a.dtype != b.dtype or a.shape != b.shape:
            return f"{path}: {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}"
        if not torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)):
            return f"{path}: bytes differ (max abs diff {(a.double() - b.double()).abs().max().item():.3g})"
        return None
    if isinstance(a, dict) and isinstance(b, dict):
        if set(a) != set(b):
            return f"{path}: keys differ"
        for k in a:
            d = bit_diff(a[k], b[k], f"{path}/{k}")
            if d:
                return d
        return None
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return f"{path}: lengths {len(a)} vs {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            d = bit_diff(x, y, f"{path}/{i}")
            if d:
                return d
        return None
    return None if a == b else f"{path}: {a!r} vs {b!r}"


def main() -> int:
    os.environ.setdefault("PJRT_DEVICE", "CPU")
    for sub in ("ckpt_ref", "ckpt", "ckpt_dp1", "logs"):
        shutil.rmtree(os.path.join(OUT, sub), ignore_errors=True)
    for name in os.listdir(OUT) if os.path.isdir(OUT) else []:
        if name.startswith(("final_", "run")):
            os.unlink(os.path.join(OUT, name))
    os.makedirs(LOGS, exist_ok=True)
    ckpt_ref, ckpt, ckpt_dp1 = (os.path.join(OUT, d) for d in ("ckpt_ref", "ckpt", "ckpt_dp1"))
    j = {k: os.path.join(OUT, f"{k}.json") for k in ("run1_reference", "run2_crash", "run3_resume", "run4_dp1")}
    phases = {}
    log(f"nxd-ckpt demo: a 2-layer Llama, 4 ranks (TP=2 x DP=2), ZeRO-1 Adam, {STEPS} steps, "
        f"checkpoint every {EVERY} steps; outputs in {os.path.relpath(OUT, ROOT)}/")

    # 1. reference --------------------------------------------------------------------------------------------
    _, secs, _ = run("run1_reference", torchrun(4, TRAIN_ARGS + [
        "--no-async", "--ckpt-dir", ckpt_ref, "--out", j["run1_reference"],
        "--dump-final", os.path.join(OUT, "final_ref")]))
    ref = load_json(j["run1_reference"])
    phases["1_reference"] = secs
    log(f"phase 1 reference run: steps 1..{STEPS} uninterrupted, synchronous saves, final loss "
        f"{ref['losses'][str(STEPS)]:.4f}  ({secs:.1f}s)")

    # 2. crash ------------------------------------------------------------------------------------------------
    rc, secs, _ = run("run2_crash", torchrun(4, TRAIN_ARGS + [
        "--ckpt-dir", ckpt, "--out", j["run2_crash"], "--crash-at-step", CRASH_AT]), expect_ok=False)
    phases["2_crash"] = secs
    if rc == 0:
        fail("the crash run exited 0; it should have been SIGKILLed")
    crash = load_json(j["run2_crash"])
    if crash.get("crashed_at") != CRASH_AT:
        fail(f"the crash run did not reach its crash point (report: crashed_at={crash.get('crashed_at')})")
    on_disk = sorted(os.listdir(ckpt))
    complete_after_crash = [t for t in on_disk if os.path.exists(os.path.join(ckpt, t, "done"))]
    if f"step_{CRASH_AT}" in complete_after_crash:
        fail(f"step_{CRASH_AT} is complete after the crash: the save was not in flight when the ranks died")
    _, _, ls_crash = run("ls_after_crash", cli("ls", ckpt))
    log(f"phase 2 crash run: SIGKILL on all 4 ranks right after save_checkpoint(step_{CRASH_AT}, async) returned "
        f"(in flight on rank 0: {crash.get('crash_in_flight')}); torchrun exit {rc}; on disk: "
        f"{', '.join(on_disk)}  ({secs:.1f}s)")
    print(indent(ls_crash.split("\n", 1)[1]), flush=True)

    # 3. resume -----------------------------------------------------------------------------------------------
    _, secs, _ = run("run3_resume", torchrun(4, TRAIN_ARGS + [
        "--ckpt-dir", ckpt, "--out", j["run3_resume"], "--dump-final", os.path.join(OUT, "final_resume")]))
    res = load_json(j["run3_resume"])
    phases["3_resume"] = secs
    expected_from = f"step_{(CRASH_AT - 1) // EVERY * EVERY}"
    if res["resumed_from"] != expected_from:
        fail(f"the restart resumed from {res['resumed_from']!r}, expected the newest complete {expected_from!r}")
    log(f"phase 3 restart: resumed by itself from {res['resumed_from']} (newest complete), ran steps "
        f"{res['start_step']}..{STEPS}, final loss {res['losses'][str(STEPS)]:.4f}  ({secs:.1f}s)")

    # 4. tools ------------------------------------------------------------------------------------------------
    t = time.monotonic()
    _, _, ls_out = run("ls", cli("ls", ckpt))
    vrc, _, verify_out = run("verify", cli("verify", ckpt), expect_ok=False)
    if vrc != 0:
        fail(f"nxd-ckpt verify reported damage:\n{verify_out}")
    newest = f"step_{STEPS}"
    dp1_tag = os.path.join(ckpt_dp1, newest)
    _, csecs, conv_out = run("convert_zero1", cli("convert-zero1", "--input_dir", os.path.join(ckpt, newest),
                                                  "--output_dir", dp1_tag, "--convert_to_sharded", "--dp_size", 1))
    phases["4_tools"] = time.monotonic() - t
    log(f"phase 4 tools: nxd-ckpt ls / verify on {os.path.relpath(ckpt, ROOT)} (exit {vrc}); convert-zero1 "
        f"{newest} DP=2 -> DP=1 into {os.path.relpath(dp1_tag, ROOT)} ({csecs:.1f}s)  ({phases['4_tools']:.1f}s)")
    print(indent("$ nxd-ckpt ls " + os.path.relpath(ckpt, ROOT) + "\n" + ls_out.split("\n", 1)[1]), flush=True)
    print(indent("$ nxd-ckpt verify " + os.path.relpath(ckpt, ROOT) + "\n" + verify_out.split("\n", 1)[1]), flush=True)

    dp1_steps = STEPS + DP1_EXTRA
    _, secs, _ = run("run4_dp1", torchrun(2, ["--zero1", "--tp", "2", "--steps", dp1_steps, "--ckpt-every", EVERY,
                                               "--log-every", 1, "--ckpt-dir", ckpt_dp1, "--out", j["run4_dp1"]]))
    dp1 = load_json(j["run4_dp1"])
    phases["4_dp1_resume"] = secs
    if dp1["resumed_from"] != newest or dp1["dp"] != 1:
        fail(f"the DP=1 job did not resume from the converted {newest} (resumed_from={dp1['resumed_from']})")
    dp1_losses = ", ".join(f"{dp1['losses'][str(s)]:.4f}" for s in range(STEPS + 1, dp1_steps + 1))
    log(f"phase 4 DP=1 job (2 ranks, TP=2): resumed from the converted {newest}, steps {STEPS + 1}..{dp1_steps} "
        f"loss {dp1_losses} (DP=2 run ended at {res['losses'][str(STEPS)]:.4f})  ({secs:.1f}s)")

    # 5. verdict ----------------------------------------------------------------------------------------------
    t = time.monotonic()
    bit_exact, diffs, same_losses = compare_runs(OUT, 4, ref, res)
    phases["5_verdict"] = time.monotonic() - t
    log(f"phase 5 verdict: compared the final model + optimizer state of 4 ranks, run 3 vs run 1  "
        f"({phases['5_verdict']:.1f}s)")

    sync_by_step = {s["step"]: s for s in ref["saves"]}
    rows = []
    for source, report in (("run 2", crash), ("run 3", res)):
        for s in report["saves"]:
            if not s.get("ok", True) or s["step"] is None:
                continue
            sync = sync_by_step.get(s["step"])
            rows.append({
                "step": s["step"], "tag": s["tag"], "run": source,
                "stall_ms": 1000 * s["stall_s"], "commit_ms": 1000 * s["commit_s"], "bytes": s["bytes"],
                "files": s["files"], "mb_per_s": s["bytes"] / s["commit_s"] / 1e6 if s["commit_s"] > 0 else 0.0,
                # a synchronous save blocks from the call to the commit
                "sync_save_ms": 1000 * sync["commit_s"] if sync else None,
            })
    rows.sort(key=lambda r: r["step"])
    print(f"\n  VERDICT: run 3 (crashed at step {CRASH_AT}, resumed from {res['resumed_from']}) equals run 1 "
          f"(uninterrupted) bit for bit: {'yes' if bit_exact else 'no'}", flush=True)
    print(f"    final parameters + optimizer state of all 4 ranks: {'identical' if not diffs else diffs[0]}; "
          f"sha256 {res['final_checksum'][:16]} vs {ref['final_checksum'][:16]}; "
          f"losses of steps {res['start_step']}..{STEPS} identical: {'yes' if same_losses else 'no'}", flush=True)
    print("\n  saves (async, all 4 ranks: stall = max over ranks of the time save_checkpoint blocked training;"
          "\n  commit = call to `done`; bytes = all ranks; sync = the same save done synchronously in run 1)", flush=True)
    print(f"    {'tag':<9} {'run':<6} {'stall ms':>9} {'commit ms':>10} {'MB':>6} {'files':>6} {'MB/s':>7} "
          f"{'sync save ms':>13}", flush=True)
    for r in rows:
        sync = f"{r['sync_save_ms']:.0f}" if r["sync_save_ms"] is not None else "-"
        print(f"    {r['tag']:<9} {r['run']:<6} {r['stall_ms']:9.1f} {r['commit_ms']:10.0f} {r['bytes'] / 1e6:6.2f} "
              f"{r['files']:6d} {r['mb_per_s']:7.2f} {sync:>13}", flush=True)
    print(f"    (step_{CRASH_AT}'s first save was in flight when run 2 was killed; it never became complete, and run 3 "
          f"saved step_{CRASH_AT} again)", flush=True)
    if rows:
        med = statistics.median(r["stall_ms"] for r in rows)
        syncs = [r["sync_save_ms"] for r in rows if r["sync_save_ms"] is not None]
        if syncs:
            print(f"    median stall {med:.1f} ms vs median synchronous save {statistics.median(syncs):.0f} ms",
                  flush=True)
    print(flush=True)

    # 6. report -----------------------------------------------------------------------------------------------
    t = time.monotonic()
    png = os.path.join(OUT, "report.png")
    plot(ref, crash, res, dp1, rows, png)
    summary = {
        "bit_exact": bit_exact,
        "differences": diffs,
        "losses_identical": same_losses,
        "config": {"world_size": 4, "tp": 2, "dp": 2, "zero1": True, "steps": STEPS, "ckpt_every": EVERY,
                   "crash_at_step": CRASH_AT},
        "crash": {"step": CRASH_AT, "torchrun_exit": rc, "in_flight_on_rank0": crash.get("crash_in_flight"),
                  "on_disk_after_crash": on_disk},
        "resume": {"resumed_from": res["resumed_from"], "first_step": res["start_step"]},
        "final_checksum": {"run1_reference": ref["final_checksum"], "run3_resume": res["final_checksum"]},
        "losses": {"run1_reference": ref["losses"], "run2_crash": crash["losses"], "run3_resume": res["losses"],
                   "run4_dp1": dp1["losses"]},
        "saves": rows,
        "sync_saves": [{"step": s["step"], "tag": s["tag"], "save_ms": 1000 * s["commit_s"], "bytes": s["bytes"]}
                       for s in ref["saves"]],
        "dp1_resume": {"from": newest, "steps": [STEPS + 1, dp1_steps], "losses": dp1["losses"]},
        "cli": {"ls": ls_out.split("\n", 1)[1], "verify": verify_out.split("\n", 1)[1], "verify_exit": vrc,
                "convert_zero1": conv_out.split("\n", 1)[1]},
        "phase_seconds": phases,
    }
    phases["6_report"] = time.monotonic() - t
    summary["total_seconds"] = time.monotonic() - T0
    with open(os.path.join(OUT, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    log(f"phase 6 report: {os.path.relpath(png, ROOT)}, {os.path.relpath(os.path.join(OUT, 'summary.json'), ROOT)}"
        f"  ({phases['6_report']:.1f}s)")
    log(f"done in {time.monotonic() - T0:.0f}s: bit-exact resume {'yes' if bit_exact else 'NO'}")
    return 0 if bit_exact else 1


def plot(ref, crash, res, dp1, rows, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def series(report):
        steps = sorted(int(s) for s in report["losses"])
        return steps, [report["losses"][str(s)] for s in steps]

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.8))
    x, y = series(ref)
    ax1.plot(x, y, color="0.6", lw=4, label="run 1: uninterrupted (reference)")
    x, y = series(crash)
    ax1.plot(x, y, color="tab:orange", lw=1.5, marker=".", label=f"run 2: SIGKILLed at step {CRASH_AT}")
    x, y = series(res)
    ax1.plot(x, y, color="tab:blue", lw=1.5, marker=".", ls="--", label=f"run 3: resumed from {res['resumed_from']}")
    x, y = series(dp1)
    ax1.plot(x, y, color="tab:green", lw=1.5, marker=".", label="DP=1 job from converted checkpoint")
    for i, s in enumerate(ref["save_steps"]):
        if s != CRASH_AT:
            ax1.axvline(s, color="tab:blue", alpha=0.25, lw=1, label="checkpoints (complete)" if i == 0 else None)
    ax1.axvline(CRASH_AT, color="tab:red", lw=1.5, ls=":", label=f"crash (save step_{CRASH_AT} in flight, lost)")
    resumed_at = res["start_step"] - 1
    ax1.plot([resumed_at], [ref["losses"][str(resumed_at)]], "o", color="tab:blue", ms=9, mfc="none", mew=2,
             label=f"restart resumes from {res['resumed_from']}")
    ax1.plot([CRASH_AT], [crash["losses"][str(CRASH_AT)]], "x", color="tab:red", ms=12, mew=3)
    ax1.set_xlabel("step")
    ax1.set_ylabel("training loss")
    ax1.set_title("Loss: crash + resume retraces the reference exactly")
    ax1.legend(fontsize=8)

    if rows:
        labels = [r["tag"] for r in rows]
        xs = list(range(len(rows)))
        w = 0.27
        ax2.bar([i - w for i in xs], [r["sync_save_ms"] or 0 for r in rows], w, color="0.55", label="synchronous save (run 1)")
        ax2.bar(xs, [r["commit_ms"] for r in rows], w, color="tab:cyan", label="async: call to commit (background)")
        ax2.bar([i + w for i in xs], [r["stall_ms"] for r in rows], w, color="tab:blue", label="async: training stall")
        for i, r in enumerate(rows):
            ax2.text(i + w, r["stall_ms"], f"{r['stall_ms']:.0f}", ha="center", va="bottom", fontsize=7)
        ax2.set_xticks(xs)
        ax2.set_xticklabels(labels, fontsize=8)
        ax2.set_ylabel("milliseconds")
        ax2.set_title(f"Per save: training stall vs synchronous save ({rows[0]['bytes'] / 1e6:.1f} MB, 4 ranks)")
        ax2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
