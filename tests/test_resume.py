"""Resume equivalence: K steps, save, new process group, load, K more == 2K uninterrupted, bit for bit."""
from __future__ import annotations

import socket

import pytest
import torch

from harness import run_ranks
from tiny_models import TinyShard, assert_bit_equal, to_cpu_state, train_steps, xla_device

K = 3


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _build(ps, zero1, seed_offset: int):
    from nxd_ckpt.testing import ZeroOneAdam

    dev = xla_device()
    model = TinyShard(ps.get_tensor_model_parallel_rank(), seed_offset=seed_offset).to(dev)
    if zero1:
        opt = ZeroOneAdam(model.parameters(), lr=0.05, dp_group=ps.get_data_parallel_host_group(),
                          dp_rank=ps.get_data_parallel_rank(), dp_size=ps.get_data_parallel_size(),
                          save_master_weights=zero1 != "no-master")
    else:
        opt = torch.optim.Adam(model.parameters(), lr=0.05)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s)) if not zero1 else None
    return model, opt, sched


def _train(ps, model, opt, sched, steps, start, zero1):
    train_steps(model, opt, steps, seed=11, dp_rank=ps.get_data_parallel_rank(), sched=sched,
                dp_group=None if zero1 else ps.get_data_parallel_host_group(),
                dp_size=ps.get_data_parallel_size(), start=start)


def _resume_rank(rank, world, root, port2, zero1, async_save):
    import torch.distributed as dist

    import nxd_ckpt
    import parallel_state as ps

    ps.initialize_model_parallel(tensor_model_parallel_size=2)
    ref_model, ref_opt, ref_sched = _build(ps, zero1, 0)
    _train(ps, ref_model, ref_opt, ref_sched, 2 * K, 0, zero1)
    reference = (to_cpu_state(ref_model.state_dict()), to_cpu_state(ref_opt.state_dict()))

    model, opt, sched = _build(ps, zero1, 0)
    _train(ps, model, opt, sched, K, 0, zero1)
    nxd_ckpt.save_checkpoint(root, f"step_{K}", model=model, optimizer=opt, scheduler=sched,
                             user_content={"step": K}, async_save=async_save, zero1_optimizer=bool(zero1), use_xser=True)
    nxd_ckpt.finalize_checkpoint()
    del model, opt, sched

    ps.destroy_model_parallel()
    dist.destroy_process_group()
    # a brand-new job: rank 0 hosts a new store (the harness otherwise mimics torchrun's agent store)
    import os

    os.environ.pop("TORCHELASTIC_USE_AGENT_STORE", None)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port2}", rank=rank, world_size=world)
    ps.initialize_model_parallel(tensor_model_parallel_size=2)

    model, opt, sched = _build(ps, zero1, seed_offset=77)   # different init: everything must come from disk
    uc = nxd_ckpt.load_checkpoint(root, model=model, optimizer=opt, scheduler=sched)
    assert uc == {"step": K}
    _train(ps, model, opt, sched, K, uc["step"], zero1)
    assert_bit_equal(reference[0], to_cpu_state(model.state_dict()), "model")
    assert_bit_equal(reference[1], to_cpu_state(opt.state_dict()), "optim")
    return True


@pytest.mark.parametrize("zero1,async_save", [(False, False), (True, True), ("no-master", True)],
                         ids=["adam-sync", "zero1-async", "zero1-without-master-weights"])
def test_resume_equals_uninterrupted(tmp_path, zero1, async_save):
    run_ranks(_resume_rank, 4, str(tmp_path / "ckpt"), _free_port(), zero1, async_save, timeout=240)
