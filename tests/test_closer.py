"""The thread that starts the writeback of an async save's small files and closes them (storage/closer.py)."""
import errno
import os
import sys
import threading

import pytest
import torch

import nxd_ckpt
from nxd_ckpt import writepool
from nxd_ckpt.storage import LocalStorage, local
from nxd_ckpt.storage.closer import Closer


def _fd_open(fd: int) -> bool:
    try:
        os.fstat(fd)
        return True
    except OSError:
        return False


def _open_under(folder) -> list:
    """Files (not folders) under ``folder`` this process holds open."""
    out = []
    for name in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:             # the listing's own descriptor, closed by now
            continue
        if target.startswith(str(folder)) and os.path.isfile(target):
            out.append(target)
    return out


def test_handed_files_are_started_in_order_and_closed_by_drain(tmp_path):
    """Files go to the thread in groups; the drain sends the last, partial group (43 = 5 x 8 + 3)."""
    seen = []
    closer = Closer(lambda fd: seen.append((os.readlink(f"/proc/self/fd/{fd}"), threading.current_thread().name)))
    fds = [os.open(tmp_path / f"f{i}", os.O_WRONLY | os.O_CREAT, 0o644) for i in range(43)]
    for fd in fds:
        closer.hand(fd)
    closer.drain()
    assert seen == [(str(tmp_path / f"f{i}"), "nxd_ckpt-closer") for i in range(43)]
    assert not any(_fd_open(fd) for fd in fds)
    closer.drain()                      # nothing handed since: returns at once


def test_a_close_error_is_raised_once_by_the_next_drain(tmp_path):
    """The start hint's errors are ignored (as the writer's own call's were); a failed close is kept and raised
    by the drain before the batch's sync, once."""
    def close_first(fd):
        os.close(fd)
        raise OSError(errno.EIO, "hint refused")    # ignored

    closer = Closer(close_first)
    closer.hand(os.open(tmp_path / "f", os.O_WRONLY | os.O_CREAT, 0o644))
    with pytest.raises(OSError) as err:
        closer.drain()
    assert err.value.errno == errno.EBADF
    closer.drain()


def test_a_stuck_thread_times_out_both_waits_and_the_caller_keeps_its_descriptor(tmp_path):
    release, busy = threading.Event(), threading.Event()

    def stuck(fd):
        busy.set()
        release.wait(30)

    closer = Closer(stuck, depth=1, wait_s=0.2, group=1)
    fds = [os.open(tmp_path / name, os.O_WRONLY | os.O_CREAT, 0o644) for name in "abc"]
    closer.hand(fds[0])
    assert busy.wait(10)                # the thread holds the first file
    closer.hand(fds[1])                 # waits in the queue: the depth
    with pytest.raises(TimeoutError, match="did not take another file within 0 s .*the disk is not taking writes"):
        closer.hand(fds[2])
    assert _fd_open(fds[2])
    os.close(fds[2])
    with pytest.raises(TimeoutError, match="did not close the files handed to it"):
        closer.drain()
    release.set()
    closer.drain()
    assert not _fd_open(fds[0]) and not _fd_open(fds[1])


@pytest.mark.skipif(not hasattr(os, "fork"), reason="fork only")
def test_a_forked_child_gets_a_thread_of_its_own(tmp_path):
    """The child has no threads: it starts a closer thread of its own, and a file its parent had handed over
    and not yet sent (a group not full) stays the parent's to close."""
    closer = Closer(lambda fd: None)
    closer.hand(os.open(tmp_path / "warm", os.O_WRONLY | os.O_CREAT, 0o644))
    closer.drain()                      # the parent's thread exists
    held = os.open(tmp_path / "held", os.O_WRONLY | os.O_CREAT, 0o644)
    closer.hand(held)                   # held in a group of 1 of 8
    pid = os.fork()
    if pid == 0:
        try:
            closer.drain()              # nothing handed in the child: returns at once
            fd = os.open(tmp_path / "child", os.O_WRONLY | os.O_CREAT, 0o644)
            closer.hand(fd)
            closer.drain()
            os._exit(0 if not _fd_open(fd) and _fd_open(held) else 1)
        except BaseException:  # noqa: BLE001
            os._exit(2)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert _fd_open(held)
    closer.drain()
    assert not _fd_open(held)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="sync_file_range and SCHED_IDLE are Linux's")
@pytest.mark.parametrize("close_behind", [True, False])
def test_an_async_saves_small_files_are_started_and_closed_on_the_closer(tmp_path, monkeypatch, close_behind):
    """During an async save on a disk of this host each small tensor file's writeback is started, and the file
    closed, on the closer thread, which runs at the small-file writer's background priority (the writers are
    kept between saves, and an A/B helper may have reniced them); CLOSE_BEHIND off: on its writer.
    Either way every file is closed when the save is done, and the tensors load back."""
    seen = []
    real = local._start_writeback_fd

    def spy(fd):
        tid = threading.get_native_id()
        seen.append((os.readlink(f"/proc/self/fd/{fd}"), threading.current_thread().name,
                     os.sched_getscheduler(tid), os.getpriority(os.PRIO_PROCESS, tid)))
        return real(fd)

    monkeypatch.setattr(local, "_start_writeback_fd", spy)
    monkeypatch.setattr(local, "_filesystem_type", lambda p: 0xEF53)
    monkeypatch.setattr(local, "CLOSE_BEHIND", close_behind)
    monkeypatch.setattr(local, "CLOSER", Closer(lambda fd: local._start_writeback_fd(fd)))
    model = {"w": torch.arange(6.0), "b": torch.ones(3)}
    nxd_ckpt.save_checkpoint(str(tmp_path), "t", model=model, async_save=True, use_xser=True)
    nxd_ckpt.finalize_checkpoint()
    tensor_files = sorted((os.path.basename(p), name.startswith("nxd_ckpt-closer")) for p, name, _, _ in seen
                          if ".tensors/" in p)
    assert tensor_files == [("tensor_0.pt", close_behind), ("tensor_1.pt", close_behind)]
    writers = {(os.sched_getscheduler(t.native_id), os.getpriority(os.PRIO_PROCESS, t.native_id))
               for t in threading.enumerate() if t.name.startswith("nxd_ckpt-small")}
    assert len(writers) == 1 and {(policy, n) for _, _, policy, n in seen} == writers    # the writer's priority
    policy, nice = writers.pop()
    assert policy == (os.SCHED_IDLE if writepool.BACKGROUND_SCHED_IDLE else os.SCHED_OTHER)
    assert nice > os.getpriority(os.PRIO_PROCESS, 0) or nice == 19
    assert _open_under(tmp_path) == []
    got = {}
    nxd_ckpt.load_checkpoint(str(tmp_path), "t", model=got, strict=False)
    assert torch.equal(got["w"], model["w"]) and torch.equal(got["b"], model["b"])


def test_a_close_error_fails_the_batch_sync_before_it_syncs(tmp_path, monkeypatch):
    """What a close met reaches the save through ``sync_files``, before the batch is synced and committed."""
    def close_first(fd):
        os.close(fd)

    synced = []
    monkeypatch.setattr(local, "_filesystem_type", lambda p: 0xEF53)
    monkeypatch.setattr(local, "CLOSER", Closer(close_first))
    monkeypatch.setattr(local, "_syncfs", lambda fd: synced.append(fd))
    s = LocalStorage(str(tmp_path))
    s.beside_training = True
    s.write_file("stage/small", lambda f: f.write(b"x" * 100), durable=False, atomic=False)
    with pytest.raises(OSError) as err:
        s.sync_files(["stage/small"])
    assert err.value.errno == errno.EBADF and synced == []
    assert (tmp_path / "stage" / "small").read_bytes() == b"x" * 100


def test_a_failed_save_leaves_no_file_open_behind_it(tmp_path, monkeypatch):
    """A save that fails after some small files went to the closer (a partial group, which only a drain sends)
    closes them too, and its sync anchor's folder: nothing of the failed save stays open, its space held, until
    the next save. The error is the write's."""
    from nxd_ckpt.storage import set_write_hook

    def fail_fifth(rel):
        if rel.endswith("tensor_4.pt"):
            raise OSError(errno.ENOSPC, "no space left (injected)")

    monkeypatch.setattr(local, "_filesystem_type", lambda p: 0xEF53)
    monkeypatch.setattr(local, "CLOSER", Closer(lambda fd: None))
    model = {f"p{i}": torch.full((64,), float(i)) for i in range(6)}
    set_write_hook(fail_fifth)
    try:
        nxd_ckpt.save_checkpoint(str(tmp_path), "t", model=model, async_save=True, use_xser=True)
        with pytest.raises(Exception, match="injected"):
            nxd_ckpt.finalize_checkpoint()
    finally:
        set_write_hook(None)
    held = []
    for name in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue
        if target.startswith(str(tmp_path)):
            held.append(target)
    assert held == []


def test_abandoning_a_batch_waits_for_a_stuck_closer_only_so_long_and_never_raises(tmp_path, monkeypatch):
    """A failed save reports its own error after ABANDON_WAIT_S even when the closer is stuck on the disk; the
    files are closed when the closer gets to them, and the sync anchor's folder at once."""
    release = threading.Event()
    closer = Closer(lambda fd: release.wait(30))
    monkeypatch.setattr(local, "CLOSER", closer)
    monkeypatch.setattr(local, "ABANDON_WAIT_S", 0.2)
    monkeypatch.setattr(local, "_filesystem_type", lambda p: 0xEF53)
    s = LocalStorage(str(tmp_path))
    s.beside_training = True
    s.write_file("stage/a", lambda f: f.write(b"x" * 100), durable=False, atomic=False)
    s.abandon_batch()                                   # returns (the test would hang 30 s otherwise)
    assert not release.is_set() and _open_under(tmp_path) == [str(tmp_path / "stage" / "a")]
    assert not any(os.readlink(f"/proc/self/fd/{n}") == str(tmp_path / "stage")
                   for n in os.listdir("/proc/self/fd") if os.path.exists(f"/proc/self/fd/{n}"))
    release.set()
    closer.drain()
    assert _open_under(tmp_path) == []
