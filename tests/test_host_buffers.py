"""The snapshot's host buffer pool (staging.HostBufferPool): reused across saves, bit-exact under later
mutation, within the host memory budget, released on request. Never timed."""
from __future__ import annotations

import threading

import pytest
import torch

from backends import ckpt_root  # noqa: F401 - a fixture
from tiny_models import TinyShard, assert_bit_equal, sync, to_cpu_state, xla_device


@pytest.fixture
def engine():
    """The process's engine with an empty pool, emptied again afterwards (the engine is per process)."""
    import nxd_ckpt
    from nxd_ckpt.engine import get_engine

    nxd_ckpt.finalize_checkpoint()
    nxd_ckpt.release_host_buffers()
    yield get_engine()
    nxd_ckpt.finalize_checkpoint()
    nxd_ckpt.release_host_buffers()


def _saved(root, tag):
    import nxd_ckpt

    got = {}
    nxd_ckpt.load_checkpoint(root, tag, model=got, strict=False)
    return got


def _mixed_state(dev):
    """Every kind of tensor the snapshot handles: fp32/bf16 matrices, a 0-d int, a bool vector, an empty
    tensor, a slice and a transpose of an XLA tensor (views), a float8 tensor (no DLPack equivalent: the
    batched transfer), a result still pending in the lazy graph, and a CPU tensor."""
    g = torch.Generator().manual_seed(5)
    base = torch.randn(6, 4, generator=g).to(dev)
    sync()
    return {
        "w": torch.randn(32, 16, generator=g).to(dev),
        "w_bf16": torch.randn(16, 8, generator=g).to(torch.bfloat16).to(dev),
        "step": torch.tensor(7, dtype=torch.int64).to(dev),
        "mask": torch.tensor([True, False, True]).to(dev),
        "empty": torch.empty(0, 3).to(dev),
        "rows": base[1:3],
        "cols": base.t(),
        "f8": torch.randn(8, generator=g).to(torch.float8_e4m3fn).to(dev),
        "pending": base * 3.0 + 1.0,
        "cpu_step": torch.tensor(11.0),
        "cpu_view": torch.arange(12.0).reshape(3, 4)[:, 1:3],
        "cpu_conj": torch.tensor([1 + 2j, 3 - 1j]).conj(),
    }


def test_every_kind_of_tensor_is_saved_bit_exact_and_reused_by_the_next_save(ckpt_root, engine):
    import nxd_ckpt

    state = _mixed_state(xla_device())
    expect = to_cpu_state(state)
    nxd_ckpt.save_checkpoint(ckpt_root, "a", model=state, async_save=True, use_xser=True)
    nxd_ckpt.finalize_checkpoint()
    pool = engine.buffers
    first_alloc, held = pool.allocated, pool.held_bytes
    # every non-empty tensor sits in a kept buffer, except the float8 one (torch-xla's own transfer) and the
    # conjugate view (torch's clone resolves the conjugation)
    assert held == sum(t.numel() * t.element_size() for k, t in expect.items() if k not in ("f8", "cpu_conj"))
    nxd_ckpt.save_checkpoint(ckpt_root, "b", model=state, async_save=True, use_xser=True)
    nxd_ckpt.finalize_checkpoint()
    assert pool.allocated == first_alloc, "the second save of the same shapes allocated new host buffers"
    assert pool.held_bytes == held
    assert_bit_equal(expect, _saved(ckpt_root, "a"))
    assert_bit_equal(expect, _saved(ckpt_root, "b"))


def test_reused_buffers_never_change_an_earlier_snapshot(ckpt_root, engine):
    """Save, mutate the parameters in place, save again into the same (reused) buffers while the first save's
    writes are held back: each checkpoint has exactly the values of its own call."""
    import nxd_ckpt
    from nxd_ckpt.storage import set_write_hook

    dev = xla_device()
    model = TinyShard(hidden=32).to(dev)
    nxd_ckpt.save_checkpoint(ckpt_root, "warm", model=model, async_save=True, use_xser=True)
    nxd_ckpt.finalize_checkpoint()              # the pool now holds buffers of these shapes
    gate = threading.Event()
    set_write_hook(lambda rel: gate.wait(60))
    try:
        before = to_cpu_state(model.state_dict())
        nxd_ckpt.save_checkpoint(ckpt_root, "a", model=model, async_save=True, use_xser=True)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(100.0)
        sync()
        after = to_cpu_state(model.state_dict())
        gate.set()
        nxd_ckpt.save_checkpoint(ckpt_root, "b", model=model, async_save=True, use_xser=True)
        nxd_ckpt.finalize_checkpoint()
    finally:
        set_write_hook(None)
    assert engine.buffers.reused > 0
    assert_bit_equal(before, {k: v for k, v in _saved(ckpt_root, "a").items()})
    assert_bit_equal(after, {k: v for k, v in _saved(ckpt_root, "b").items()})


def test_a_small_budget_bounds_the_pool_and_chunks_reuse_each_others_buffers(ckpt_root, engine):
    import nxd_ckpt

    dev = xla_device()
    g = torch.Generator().manual_seed(3)
    state = {f"m{i}": torch.randn(64, 64, generator=g).to(dev) for i in range(6)}   # 16 KiB each
    expect = to_cpu_state(state)
    budget = 40 << 10                            # two tensors at a time
    nxd_ckpt.save_checkpoint(ckpt_root, "warm", model={"x": state["m0"]}, host_memory_budget=budget)
    pool = engine.buffers
    alloc, reused = pool.allocated, pool.reused
    nxd_ckpt.save_checkpoint(ckpt_root, "a", model=state, host_memory_budget=budget, use_xser=True)
    assert 0 < pool.held_bytes <= budget
    assert pool.allocated - alloc <= 1 and pool.reused - reused >= 5, (pool.allocated - alloc, pool.reused - reused)
    assert_bit_equal(expect, _saved(ckpt_root, "a"))


def test_keep_host_buffers_false_and_release_free_the_pool(ckpt_root, engine):
    import nxd_ckpt

    model = TinyShard(hidden=32).to(xla_device())
    nxd_ckpt.save_checkpoint(ckpt_root, "a", model=model, use_xser=True)
    held = engine.buffers.held_bytes
    assert held == sum(t.numel() * t.element_size() for t in model.state_dict().values())
    assert nxd_ckpt.release_host_buffers() == held
    assert engine.buffers.held_bytes == 0
    nxd_ckpt.save_checkpoint(ckpt_root, "b", model=model, use_xser=True)
    assert engine.buffers.held_bytes == held
    nxd_ckpt.save_checkpoint(ckpt_root, "c", model=model, use_xser=True, keep_host_buffers=False)
    assert engine.buffers.held_bytes == 0
    assert_bit_equal(to_cpu_state(model.state_dict()), _saved(ckpt_root, "c"))
    with pytest.raises(nxd_ckpt.CheckpointArgumentError, match="keep_host_buffers must be True or False"):
        nxd_ckpt.save_checkpoint(ckpt_root, "d", model=model, keep_host_buffers="no")


def test_release_during_a_save_frees_its_buffers_when_written():
    from nxd_ckpt.staging import HostBufferPool

    pool = HostBufferPool(1 << 20)
    lent = pool.empty_like(torch.empty(100, dtype=torch.float32))
    kept = pool.empty_like(torch.empty(10, dtype=torch.float32))
    pool.give_back([kept])
    assert pool.release() == 40                 # only the free buffer now
    assert pool.held_bytes == 400
    pool.give_back([lent])                       # lent before the release: freed, not kept
    assert pool.held_bytes == 0


def test_pool_capacity_drops_free_buffers_and_lends_oversize_unpooled():
    from nxd_ckpt.staging import HostBufferPool

    pool = HostBufferPool(1000)
    a = pool.empty_like(torch.empty(100, dtype=torch.float32))         # 400 bytes
    b = pool.empty_like(torch.empty(50, dtype=torch.float64))          # 400 bytes
    assert a.dtype == torch.float32 and a.shape == (100,) and a.untyped_storage().nbytes() == 400
    pool.give_back([a, b])
    assert pool.held_bytes == 800
    c = pool.empty_like(torch.empty(2, 100, dtype=torch.int32))        # the same 800... no: 800 bytes, new size
    assert c.shape == (2, 100) and pool.held_bytes == 800               # both free 400s dropped to make room
    big = pool.empty_like(torch.empty(300, dtype=torch.float32))       # 1200 > capacity: lent unpooled
    assert pool.held_bytes == 800
    pool.give_back([c, big])
    assert pool.held_bytes == 800
    d = pool.empty_like(torch.empty(200, dtype=torch.float32))         # exact size 800: reused
    assert d.untyped_storage().data_ptr() == c.untyped_storage().data_ptr() and pool.reused == 1
    pool.set_capacity(100)
    pool.give_back([d])                          # over the new capacity: freed
    assert pool.held_bytes == 0


_SPMD_SNAPSHOT = """
import numpy as np, torch, torch_xla, torch_xla.runtime as xr
import torch_xla.distributed.spmd as xs
from nxd_ckpt import staging
xr.use_spmd()
t = torch.arange(8.0).to(torch_xla.device())
xs.mark_sharding(t, xs.Mesh(np.array([0]), (1,), ("x",)), ("x",))
pool = staging.HostBufferPool(1 << 20)
(host,) = staging.copy_to_host([t], pool)
assert torch.equal(host, torch.arange(8.0)) and pool.held_bytes == 0, (host, pool.held_bytes)
print("SNAPSHOT-OK")
"""


def test_an_spmd_sharded_tensor_takes_the_batched_transfer():
    """torch-xla's DLPack export aborts the process on data it cannot export as one buffer: a sharded tensor
    must never be exported (its own process: SPMD mode is process-wide)."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, PJRT_DEVICE="CPU")
    done = subprocess.run([sys.executable, "-c", _SPMD_SNAPSHOT], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0 and "SNAPSHOT-OK" in done.stdout, done.stderr[-2000:]


def test_a_failed_batched_transfer_gives_back_the_buffers_already_copied_into(monkeypatch):
    """XLA tensors copied through DLPack into pool buffers, then the batched transfer of the rest (float8 has no
    DLPack equivalent) fails: the pool gets every buffer back, none stays lent."""
    from nxd_ckpt import staging

    dev = xla_device()
    tensors = [torch.randn(1 << 18).to(dev), torch.randn(64).to(torch.float8_e4m3fn).to(dev)]
    sync()

    def refused(ts):
        raise RuntimeError("device lost")

    monkeypatch.setattr(staging, "_xla_to_cpu", refused)
    pool = staging.HostBufferPool(1 << 30)
    with pytest.raises(RuntimeError, match="device lost"):
        staging.copy_to_host(tensors, pool)
    assert pool.allocated == 1 and not pool._lent


def test_buffers_given_back_during_a_hold_are_not_taken_until_it_ends():
    """A snapshot chunk does not take the buffers its own written files gave back while it was copying (the pool
    then holds the same buffers save after save); they are free after the hold, and release() during the hold
    drops them when it ends."""
    from nxd_ckpt.staging import HostBufferPool

    pool = HostBufferPool(1 << 20)
    like = torch.empty(256)                          # 1 KiB
    with pool.holding_returns():
        a = pool.empty_like(like)
        pool.give_back([a])
        b = pool.empty_like(like)                   # a is still kept aside: a new buffer
        assert b.data_ptr() != a.data_ptr() and pool.allocated == 2 and pool.reused == 0
        pool.give_back([b])
    assert pool.held_bytes == 2048
    c, d = pool.empty_like(like), pool.empty_like(like)
    assert {c.data_ptr(), d.data_ptr()} == {a.data_ptr(), b.data_ptr()} and pool.reused == 2
    with pool.holding_returns():
        pool.give_back([c])
        assert pool.release() == 0                   # nothing free now; c and d are dropped when they come back
    pool.give_back([d])
    assert pool.held_bytes == 0
