"""Tensors and arrays in arguments and results go through shared memory, with fork's semantics.

Unit tests pack and load in one process (what plan and a rank do); launch tests check the real
path: 2 ranks get one copy-on-write block (a rank writing its argument changes neither the kernel's
tensor nor the other rank's), results come back through /dev/shm, and nothing is left in /dev/shm
or open in the kernel afterwards — also when a rank fails or is killed holding a result.
"""

from __future__ import annotations

import glob
import os
import pickle
import signal

import numpy as np
import pytest
import torch

import nbaccel
from nbaccel.core import shared_tensors as S
from nbaccel.core.errors import RankFailedError

BIG = S.MIN_BYTES // 4 + 1000  # float32 elements: just over the threshold


def _mine() -> list[str]:
    return glob.glob(os.path.join(S.shm_dir(), f"nbaccel-{os.getpid()}-*"))


def _block_fds() -> list[str]:
    found = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            if "nbaccel-args" in os.readlink(f"/proc/self/fd/{fd}"):
                found.append(fd)
        except OSError:
            pass
    return found


def test_round_trip_keeps_types_views_and_parameters():
    t = torch.arange(BIG * 2, dtype=torch.float32)
    packer = S.Packer()
    values = {
        "t": t,
        "view": t[5:50:3],
        "bf16": torch.randn(BIG * 2).to(torch.bfloat16),
        "mask": torch.rand(BIG * 4) > 0.5,
        "cplx": torch.randn(BIG, dtype=torch.complex64),
        "transposed": torch.randn(512, 600).t(),
        "param": torch.nn.Parameter(torch.randn(BIG)),
        "grad": torch.randn(BIG, requires_grad=True),
        "small": torch.ones(3),
        "c": np.arange(BIG, dtype=np.int64).reshape(-1, 8),
        "f": np.asfortranarray(np.random.rand(300, 400)),
        "strided": np.random.rand(600, 400)[:, ::2],
        "record": np.zeros(BIG, dtype=[("a", "f4"), ("b", "i2")]),
        "objects": np.array([object()] * 10),
    }
    payload = packer.dumps(values)
    transfer = packer.seal()
    try:
        assert len(payload) < 20_000, "large values were pickled instead of shared"
        out = pickle.loads(payload)
    finally:
        S.release(transfer)
    for key, value in values.items():
        got = out[key]
        assert type(got) is type(value), key
        if isinstance(value, torch.Tensor):
            assert got.dtype == value.dtype and got.shape == value.shape, key
            assert got.stride() == value.stride() and torch.equal(got.detach(), value.detach())
            assert got.requires_grad == value.requires_grad, key
        elif value.dtype.hasobject:
            assert got.shape == value.shape
        else:
            assert got.dtype == value.dtype and (got == value).all(), key
    assert out["f"].flags.f_contiguous
    out["t"][5] = -1.0  # a view and its base share one storage after the trip too
    assert out["view"][0] == -1.0 and t[5] == 5.0


def test_loads_are_copy_on_write_and_small_values_are_not_shared():
    t = torch.zeros(BIG)
    packer = S.Packer()
    payload = packer.dumps(t)
    assert packer.dumps(torch.zeros(10)) and packer.dumps(np.zeros(10))
    transfer = packer.seal()
    try:
        assert transfer.size == -(-BIG * 4 // 64) * 64  # the small ones stayed in their pickles
        first, second = pickle.loads(payload), pickle.loads(payload)
    finally:
        S.release(transfer)
    first += 1
    assert second.sum() == 0 and t.sum() == 0 and first.sum() == BIG
    assert not S._fds and _block_fds()  # the kernel let go; the loaded values still map it
    del first, second
    assert not _block_fds()  # ...until they are gone


def test_nothing_shared_means_no_block():
    packer = S.Packer()
    packer.dumps({"lr": 0.1, "t": torch.ones(4)})
    transfer = packer.seal()
    assert transfer.fd is None and not _block_fds()


def test_stale_result_files_of_dead_kernels_are_swept():
    import subprocess
    import sys

    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
    )
    pid = int(dead.stdout)
    stale = os.path.join(S.shm_dir(), f"nbaccel-{pid}-abc-r0-{pid}")
    live = os.path.join(S.shm_dir(), f"nbaccel-{os.getpid()}-abc-r0-1")
    for path in (stale, live):
        open(path, "wb").close()
    try:
        assert stale in S.sweep_stale()
        assert not os.path.exists(stale) and os.path.exists(live)
    finally:
        for path in (stale, live):
            if os.path.exists(path):
                os.unlink(path)


# -- under the launcher ------------------------------------------------------------------------


def _write_and_compare(t, a, scale=1.0):
    import torch.distributed as dist

    import nbaccel

    acc = nbaccel.Accelerator()
    rank = acc.process_index
    seen = float(t.sum()), float(a.sum())
    if rank == 0:
        t.add_(1.0)  # in place: only this rank's pages change
        a[:] = 7
    dist.barrier()
    after = float(t.sum()), float(a.sum())
    return seen, after, torch.full((BIG * 4,), float(rank) * scale), a[:10].copy()


@pytest.mark.slow
def test_two_ranks_share_one_block_copy_on_write_and_results_come_back():
    t = torch.zeros(BIG * 4)
    a = np.ones(BIG, dtype=np.float32)
    from nbaccel.launch.options import LaunchOptions
    from nbaccel.launch.plan import resolve_plan

    out = nbaccel.notebook_launcher(
        _write_and_compare,
        args=(t, a),
        kwargs={"scale": 2.0},
        num_processes=2,
        return_all=True,
        progress=False,
    )
    (seen0, after0, r0, head0), (seen1, after1, r1, head1) = out
    assert seen0 == seen1 == (0.0, float(BIG))
    assert after0 == (float(BIG * 4), 7.0 * BIG) and after1 == (0.0, float(BIG))
    assert t.sum() == 0 and a.sum() == BIG  # the kernel's own values never change
    assert r0.sum() == 0 and r1.eq(2.0).all() and (head0 == 7).all() and (head1 == 1).all()
    assert not _mine() and not _block_fds() and not S._fds

    plan = resolve_plan(_write_and_compare, (t, a), {}, LaunchOptions(num_processes=2))
    try:  # each rank's job carries a reference, not the 1 MB of data
        assert all(len(b) < 2000 for spec in plan.specs for b in spec.args)
        assert plan.specs[0].transfer is plan.specs[1].transfer
    finally:
        S.release(plan.specs[0].transfer)


def _result_then_fail():
    import time

    import torch

    import nbaccel

    if nbaccel.Accelerator().process_index == 1:
        time.sleep(0.5)  # rank 0 has sent its result by now
        raise ValueError("rank 1 fails after rank 0 returned")
    return torch.ones(BIG * 4)


def _killed_after_writing(big):
    import os

    import torch

    import nbaccel
    from nbaccel.core import shared_tensors

    rank = nbaccel.Accelerator().process_index
    (token,) = shared_tensors._fds  # this launch's (the block of ``big`` came with it)
    transfer = shared_tensors.Transfer(token, None, 0)
    assert shared_tensors.dumps_result(torch.ones(BIG), transfer, rank)
    if rank == 1:  # dies after writing its result file, before sending the result
        os.kill(os.getpid(), signal.SIGKILL)
    return float(big.sum())


@pytest.mark.slow
def test_results_never_loaded_leave_nothing_in_dev_shm():
    with pytest.raises(RankFailedError):
        nbaccel.notebook_launcher(_result_then_fail, num_processes=2, progress=False)
    assert not _mine() and not S._fds


@pytest.mark.slow
def test_a_rank_killed_after_writing_its_result_leaves_nothing_in_dev_shm():
    with pytest.raises(RankFailedError, match="rank 1"):
        nbaccel.notebook_launcher(
            _killed_after_writing, args=(torch.ones(BIG),), num_processes=2, progress=False
        )
    assert not _mine(), _mine()
    assert not _block_fds() and not S._fds


def _sum_and_echo(t, a):
    return float(t.sum()), float(a.sum()), t * 2


@pytest.mark.slow
@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_other_start_methods_carry_the_block_too(method):
    t, a = torch.ones(BIG * 4), np.ones(BIG)
    out = nbaccel.notebook_launcher(
        _sum_and_echo,
        args=(t, a),
        num_processes=2,
        start_method=method,
        progress=False,
        return_all=True,
    )
    for total, array_total, doubled in out:
        assert (total, array_total) == (float(BIG * 4), float(BIG)) and doubled.eq(2).all()
    assert not _mine() and not _block_fds() and not S._fds


def _train_steps(model, data):
    import torch

    import nbaccel

    acc = nbaccel.Accelerator()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = acc.prepare(model, optimizer)
    for _ in range(3):
        loss = model(data[:8]).pow(2).mean()
        acc.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
    return {k: v.detach().clone() for k, v in acc.unwrap_model(model).state_dict().items()}


@pytest.mark.slow
def test_a_model_argument_trains_exactly_as_when_pickled(monkeypatch):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.Linear(512, 1))
    data = torch.randn(1024, 512)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    shared = nbaccel.notebook_launcher(
        _train_steps, args=(model, data), num_processes=2, progress=False
    )
    monkeypatch.setattr(S, "MIN_BYTES", 1 << 62)  # everything pickled, as before
    pickled = nbaccel.notebook_launcher(
        _train_steps, args=(model, data), num_processes=2, progress=False
    )
    assert shared.keys() == pickled.keys()
    assert all(torch.equal(shared[k], pickled[k]) for k in shared)
    assert not torch.equal(shared["0.weight"], before["0.weight"])  # it did train...
    assert all(torch.equal(model.state_dict()[k], before[k]) for k in before)  # ...its copy


def _a_big_result(i):
    import torch

    return torch.full((BIG,), float(i))


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.slow
@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts /proc/self/fd")
def test_kept_results_hold_no_file_descriptor_over_100_launches():
    # Each kept result once held its mapping's duplicated descriptor: a long sweep whose results
    # were kept reached the 1,024 limit.
    kept = [nbaccel.notebook_launcher(_a_big_result, args=(0,), num_processes=1, progress=False)]
    before = _open_fds()
    for i in range(1, 101):
        kept.append(
            nbaccel.notebook_launcher(_a_big_result, args=(i,), num_processes=1, progress=False)
        )
    assert _open_fds() - before < 5  # (not one per kept result)
    assert [float(t[0]) for t in kept] == [float(i) for i in range(101)]
    assert not _mine()
