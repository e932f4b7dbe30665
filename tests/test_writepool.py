"""The write pool's batches of small files: exact records, bounded batches, and leases given back on failure."""
import os
import threading

import crc32c
import pytest

from nxd_ckpt import writepool
from nxd_ckpt.staging import HostBudget
from nxd_ckpt.storage import local
from nxd_ckpt.storage.local import LocalStorage
from nxd_ckpt.writepool import TaskQueue, WritePool, WriteTask, bytes_task, failing_task


def _leased(budget: HostBudget, relpath: str, data: bytes) -> WriteTask:
    return WriteTask(relpath, lambda f: f.write(data), budget.lease(len(data), timeout=5))


class _RemoteLike(LocalStorage):
    """A POSIX storage that says what a network filesystem says: creations wait on the network."""

    def small_files_one_writer(self) -> bool:
        return False


class _LocalLike(LocalStorage):
    """A POSIX storage that says what a local filesystem says, whatever the test machine's /tmp is."""

    def small_files_one_writer(self) -> bool:
        return True


def test_batches_take_only_what_is_queued_and_respect_caps(monkeypatch):
    monkeypatch.setattr(writepool, "SMALL_BYTES", 60)
    budget = HostBudget(1 << 30)
    q = TaskQueue()
    for i in range(5):
        q.add(_leased(budget, f"s{i}", b"x" * 10))
    q.add(_leased(budget, "big", b"x" * 100))
    q.add(_leased(budget, "big2", b"x" * 100))
    q.add(_leased(budget, "mid0", b"x" * 30))
    q.add(_leased(budget, "mid1", b"x" * 30))
    q.add(_leased(budget, "after", b"x" * 10))
    q.close()
    got = [[t.relpath for t in b] for b in q.batches(max_files=3, max_bytes=50)]
    # At most 3 files, a batch ends once its leases reach max_bytes, a file above SMALL_BYTES goes alone.
    assert got == [["s0", "s1", "s2"], ["s3", "s4"], ["big"], ["big2"], ["mid0", "mid1"], ["after"]]
    assert budget.used == 50 + 200 + 60 + 10      # batching alone releases nothing


class _CountingLock:
    def __init__(self):
        self.lock, self.entered = threading.Lock(), 0

    def __enter__(self):
        self.lock.acquire()
        self.entered += 1

    def __exit__(self, *exc):
        self.lock.release()


@pytest.mark.parametrize("serial_create", [True, False])
def test_write_all_batches_records_every_file_exactly(tmp_path, monkeypatch, serial_create):
    monkeypatch.setattr(local, "SERIAL_CREATE", serial_create)
    payloads = {f"d/t_{i}.pt": os.urandom(100 + i) for i in range(100)}
    budget = HostBudget(1 << 30)
    q = TaskQueue()
    for rel, data in payloads.items():
        q.add(_leased(budget, rel, data))
    q.close()
    storage = _RemoteLike(str(tmp_path))           # every file to the 4 num_workers threads
    storage._create_lock = lock = _CountingLock()
    res = WritePool().write_all(q, storage, "w", workers=4)
    # One at a time once the first file has told the filesystem is local (tmp_path is; the files the 4
    # writers started before that go without), else concurrent.
    if serial_create and storage._anchor.local_fs:
        assert len(payloads) - 4 <= lock.entered <= len(payloads) - 1
    else:
        assert lock.entered == 0
    assert res.error is None
    assert sorted(r.relpath for r in res.records) == sorted(payloads)
    assert len(res.records) == len(payloads)
    for r in res.records:
        data = payloads[r.relpath]
        assert (tmp_path / "w" / r.relpath).read_bytes() == data
        assert (r.size, r.crc32c) == (len(data), crc32c.crc32c(data))
    assert res.nbytes == sum(len(d) for d in payloads.values())
    assert budget.used == 0


@pytest.mark.parametrize("batch_files", [1, writepool.BATCH_FILES])
def test_failure_inside_a_batch_releases_every_lease(tmp_path, monkeypatch, batch_files):
    monkeypatch.setattr(writepool, "BATCH_FILES", batch_files)
    budget = HostBudget(1 << 30)
    q = TaskQueue()
    for i in range(10):
        q.add(_leased(budget, f"a_{i}", b"y" * 64))
    q.add(failing_task(RuntimeError("snapshot broke: tensor 7 is gone")))
    for i in range(10):
        q.add(_leased(budget, f"b_{i}", b"y" * 64))
    q.add(bytes_task("ref.pt", b"ref"))
    q.close()
    res = WritePool().write_all(q, LocalStorage(str(tmp_path)), "w", workers=2)
    assert res.error == "RuntimeError: snapshot broke: tensor 7 is gone"
    assert budget.used == 0


@pytest.mark.parametrize("idle", [True, False])
@pytest.mark.parametrize("nbytes", [0, 2 << 20])      # the small-file thread; the num_workers threads
def test_writer_threads_run_below_the_callers_priority(tmp_path, monkeypatch, nbytes, idle):
    """The training loop keeps the cores it wants: every writer thread is BACKGROUND_NICE nicer than the
    process (Linux niceness is per thread) and, with BACKGROUND_SCHED_IDLE, under SCHED_IDLE; the caller's own
    niceness and policy are unchanged."""
    import threading

    monkeypatch.setattr(writepool, "BACKGROUND_SCHED_IDLE", idle)
    seen, policies = [], []

    def produce(f):
        seen.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
        policies.append(os.sched_getscheduler(threading.get_native_id()))
        f.write(b"z")

    base = os.getpriority(os.PRIO_PROCESS, 0)
    budget = HostBudget(1 << 30)
    q = TaskQueue()
    for i in range(8):
        q.add(WriteTask(f"n_{i}", produce, budget.lease(nbytes, timeout=5)))
    q.close()
    res = WritePool().write_all(q, _LocalLike(str(tmp_path)), "w", workers=4)
    assert res.error is None
    assert seen == [min(19, base + writepool.BACKGROUND_NICE)] * 8
    assert policies == [os.SCHED_IDLE if idle else os.SCHED_OTHER] * 8
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == base
    assert os.sched_getscheduler(threading.get_native_id()) == os.SCHED_OTHER


def test_add_many_queues_in_order_and_wakes_a_waiting_writer(tmp_path):
    """The snapshot queues a chunk's files in one step; a writer already waiting for work gets them, in order,
    interleaved correctly with single adds, and every file is written."""
    import threading

    q = TaskQueue()
    got = []
    reader = threading.Thread(target=lambda: got.extend(t.relpath for t in q))
    reader.start()                       # blocked in get() on the empty queue
    q.add_many([bytes_task(f"a{i}", b"x") for i in range(3)])
    q.add(bytes_task("b", b"y"))
    q.add_many([])
    q.add_many([bytes_task("c0", b"z"), bytes_task("c1", b"z")])
    q.close()
    reader.join(timeout=10)
    assert not reader.is_alive()
    assert got == ["a0", "a1", "a2", "b", "c0", "c1"]


def test_add_many_wakes_every_writer_already_waiting():
    """Writers blocked on the empty queue are all woken by one add_many (nothing else is queued after it, so a
    missing or single wake-up leaves a writer asleep with a task waiting)."""
    import threading
    import time

    q = TaskQueue()
    got = []
    writers = [threading.Thread(target=lambda: got.append(next(iter(q)).relpath), daemon=True) for _ in range(3)]
    for w in writers:
        w.start()
    deadline = time.monotonic() + 30
    while len(q._q.not_empty._waiters) < 3:        # every writer blocked in get()
        assert time.monotonic() < deadline, "the writers never blocked on the empty queue"
        time.sleep(0.01)
    q.add_many([bytes_task(f"a{i}", b"x") for i in range(3)])
    for w in writers:
        w.join(timeout=10)
    assert not any(w.is_alive() for w in writers), got
    assert sorted(got) == ["a0", "a1", "a2"]


def test_background_niceness_counts_from_the_process_not_the_creating_thread(monkeypatch):
    """A writer thread is created by the runner, already niced, and inherits its niceness: the writer's own is
    still the process's + BACKGROUND_NICE (it was the runner's + BACKGROUND_NICE)."""
    import threading

    monkeypatch.setattr(writepool, "BACKGROUND_NICE", 3)
    base = os.getpriority(os.PRIO_PROCESS, os.getpid())
    seen = []

    def runner_like():
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), min(19, base + 1))   # only ever raised
        writepool.lower_thread_priority()
        seen.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))

    t = threading.Thread(target=runner_like)
    t.start()
    t.join(30)
    assert seen == [min(19, base + 3)]


@pytest.mark.parametrize("remote", [False, True])
def test_small_files_on_a_local_filesystem_go_to_one_thread_of_their_own(tmp_path, monkeypatch, remote):
    """On a local filesystem every small file is written by the one small-file thread and every large one by the
    num_workers threads; where creations wait on the network, small files spread over the num_workers threads."""
    monkeypatch.setattr(writepool, "SMALL_BYTES", 1000)
    monkeypatch.setattr(writepool, "BATCH_FILES", 1)      # one file per pool task: the spread is visible
    start = threading.Barrier(2, timeout=10)
    writers = {}

    def produce(rel, data, meet):
        def run(f):
            writers[rel] = threading.current_thread().name
            if meet:
                start.wait()      # two large files in flight at once: two of the num_workers threads
            f.write(data)
        return run

    budget = HostBudget(1 << 30)
    q = TaskQueue()
    for i in range(40):
        data = b"s" * 100 if i % 10 else b"L" * 5000
        q.add(WriteTask(f"f{i}", produce(f"f{i}", data, i in (0, 10)), budget.lease(len(data), timeout=5)))
    q.close()
    storage = (_RemoteLike if remote else _LocalLike)(str(tmp_path))
    res = WritePool().write_all(q, storage, "w", workers=4)
    assert res.error is None and len(res.records) == 40
    small = {writers[f"f{i}"] for i in range(40) if i % 10}
    large = {writers[f"f{i}"] for i in range(0, 40, 10)}
    assert all(name.startswith("nxd_ckpt-write") for name in large) and len(large) >= 2
    if remote:
        assert all(name.startswith("nxd_ckpt-write") for name in small)
    else:
        assert len(small) == 1 and small.pop().startswith("nxd_ckpt-small")
    assert budget.used == 0


def test_small_writer_off_sends_small_files_to_the_num_workers_threads(tmp_path, monkeypatch):
    monkeypatch.setattr(writepool, "SMALL_WRITER", False)
    names = set()
    q = TaskQueue()
    for i in range(8):
        q.add(WriteTask(f"n_{i}", lambda f: (names.add(threading.current_thread().name), f.write(b"z"))))
    q.close()
    assert WritePool().write_all(q, _LocalLike(str(tmp_path)), "w", workers=2).error is None
    assert names and all(n.startswith("nxd_ckpt-write") for n in names)


def test_small_writers_knob_resizes_the_small_file_threads(tmp_path, monkeypatch):
    """``SMALL_WRITERS`` (an A/B lever) takes effect on the next save of a pool that already has its small-file
    thread: two threads then share the small files, every one written."""
    pool = WritePool()
    names = set()
    barrier = threading.Barrier(2, timeout=10)

    def save(n: int, meet: bool) -> None:
        q = TaskQueue()
        for i in range(n):
            # each small file a batch of its own (queued one at a time with the pool already waiting is not
            # guaranteed), so the two meeting files are in flight on two threads at once
            q.add(WriteTask(f"s{i}", lambda f, i=i: (names.add(threading.current_thread().name),
                                                     meet and i < 2 and barrier.wait(), f.write(b"x"))))
        q.close()
        res = pool.write_all(q, _LocalLike(str(tmp_path)), f"w{n}", workers=2)
        assert res.error is None and len(res.records) == n

    save(3, False)
    assert len(names) == 1
    monkeypatch.setattr(writepool, "SMALL_WRITERS", 2)
    monkeypatch.setattr(writepool, "BATCH_FILES", 1)
    names.clear()
    save(4, True)
    assert len(names) == 2 and all(n.startswith("nxd_ckpt-small") for n in names)


# ext4, tmpfs, NFS, Lustre, overlayfs, unknown
@pytest.mark.parametrize("f_type, expected", [(0xEF53, True), (0x01021994, True), (0x6969, False),
                                              (0x0BD00BD0, False), (0x794C7630, False), (None, False)])
def test_small_files_one_writer_is_told_by_the_nearest_existing_folder(tmp_path, monkeypatch, f_type, expected):
    """A save into a folder not yet created asks the filesystem of its nearest existing parent, once."""
    asked = []
    monkeypatch.setattr(local, "_filesystem_type", lambda p: asked.append(p) or f_type)
    storage = LocalStorage(str(tmp_path / "not" / "yet" / "there"))
    assert storage.small_files_one_writer() is expected
    assert storage.small_files_one_writer() is expected
    assert asked == [str(tmp_path)]


def test_filesystem_type_of_a_missing_path_is_unknown(tmp_path):
    assert local._filesystem_type(str(tmp_path / "missing")) is None


@pytest.mark.parametrize("bad_is_small", [False, True])
def test_a_failure_on_either_writer_drops_the_rest_and_releases_every_lease(tmp_path, monkeypatch, bad_is_small):
    """A write that fails on the small-file thread or on a num_workers thread is the save's error, whatever the
    other executor still has queued; every lease comes back."""
    monkeypatch.setattr(writepool, "SMALL_BYTES", 1000)
    budget = HostBudget(1 << 30)

    def boom(f):
        raise OSError(28, "No space left on device")

    q = TaskQueue()
    q.add(WriteTask("bad", boom, budget.lease(100 if bad_is_small else 5000, timeout=5)))
    for i in range(50):
        q.add(_leased(budget, f"s{i}", b"s" * 100))
        if i % 10 == 0:
            q.add(_leased(budget, f"L{i}", b"L" * 5000))
    q.close()
    res = WritePool().write_all(q, _LocalLike(str(tmp_path)), "w", workers=2)
    assert res.error == "OSError: [Errno 28] No space left on device"
    assert budget.used == 0


class _SyncCounting(_LocalLike):
    """A local-like storage whose ``start_sync`` is recorded (and can be held until the test lets it go)."""

    def __init__(self, root, hold=None):
        super().__init__(root)
        self.calls, self.running, self.most, self.hold = 0, 0, 0, hold
        self._lock = threading.Lock()

    def start_sync(self):
        with self._lock:
            self.calls += 1
            self.running += 1
            self.most = max(self.most, self.running)
        if self.hold is not None:
            assert self.hold.wait(20)
        with self._lock:
            self.running -= 1


class _RemoteSyncCounting(_SyncCounting):
    def small_files_one_writer(self) -> bool:
        return False


@pytest.mark.parametrize("remote", [False, True])
def test_an_early_sync_starts_as_small_file_bytes_are_written(tmp_path, monkeypatch, remote):
    """Small files on a local filesystem: a ``start_sync`` each time EARLY_SYNC_BYTES more were written (here at
    most 3 for the 35 files of 100 bytes: fewer when one is still running), none for the large files' 25,000
    bytes, none where small files spread over the writers (a network filesystem); the files are exact."""
    monkeypatch.setattr(writepool, "SMALL_BYTES", 1000)
    monkeypatch.setattr(writepool, "BATCH_FILES", 1)
    monkeypatch.setattr(writepool, "EARLY_SYNC_BYTES", 1000)
    storage = (_RemoteSyncCounting if remote else _SyncCounting)(str(tmp_path))
    budget = HostBudget(1 << 30)
    q = TaskQueue()
    for i in range(35):
        q.add(_leased(budget, f"s{i}", bytes([i]) * 100))
        if i % 7 == 0:
            q.add(_leased(budget, f"L{i}", b"L" * 5000))
    q.close()
    res = WritePool().write_all(q, storage, "w", workers=2)
    assert res.error is None and len(res.records) == 40
    assert all(open(tmp_path / "w" / f"s{i}", "rb").read() == bytes([i]) * 100 for i in range(35))
    _early_syncs_done()
    if remote:
        assert storage.calls == 0
    else:
        assert 1 <= storage.calls <= 3, storage.calls


def test_early_syncs_never_overlap(tmp_path, monkeypatch):
    """While one early sync is still running, more small-file bytes start no second one."""
    monkeypatch.setattr(writepool, "SMALL_BYTES", 1000)
    monkeypatch.setattr(writepool, "BATCH_FILES", 1)
    monkeypatch.setattr(writepool, "EARLY_SYNC_BYTES", 100)
    hold = threading.Event()
    storage = _SyncCounting(str(tmp_path), hold)
    budget = HostBudget(1 << 30)
    q = TaskQueue()
    for i in range(20):
        q.add(_leased(budget, f"s{i}", b"s" * 100))
    q.close()
    try:
        res = WritePool().write_all(q, storage, "w", workers=2)
    finally:
        hold.set()
    _early_syncs_done()
    assert res.error is None and len(res.records) == 20
    assert storage.calls == 1 and storage.most == 1


def _early_syncs_done():
    """Wait for the early-sync threads of the tests' saves (daemon threads that nothing else waits for)."""
    for t in threading.enumerate():
        if t.name == "nxd_ckpt-early-sync":
            t.join(20)
            assert not t.is_alive()
