"""The rest of Accelerate's surface, by behaviour: find_executable_batch_size on a simulated
OOM, profile, free_memory, unscale_gradients, autocast and scaler handlers, .bin save_model,
resuming mid-epoch with skip_first_batches, join_uneven_inputs on 2 ranks."""

from __future__ import annotations

import os

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import nbaccel
from nbaccel.utils import AutocastKwargs, GradScalerKwargs, ProfileKwargs


def _find(lib: str):
    import importlib

    return importlib.import_module(f"{lib}.utils").find_executable_batch_size


@pytest.mark.slow  # gc.collect between tries, and importing accelerate
@pytest.mark.parametrize("lib", ["nbaccel", "accelerate"])
def test_find_executable_batch_size_retries_smaller_on_oom_only(lib):
    pytest.importorskip(lib)
    tried = []

    @_find(lib)(starting_batch_size=10)
    def train(batch_size, scale):
        tried.append(batch_size)
        if batch_size > 8:  # what torch raises when an allocation fails
            raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB.")
        return batch_size * scale

    assert train(2) == 16
    assert tried == [10, 9, 8]  # 90% each time, as Accelerate 1.x does

    @_find(lib)(starting_batch_size=4)
    def broken(batch_size):
        raise RuntimeError("shape mismatch")

    with pytest.raises(RuntimeError, match="shape mismatch"):
        broken()  # anything but an OOM propagates at once


@pytest.mark.slow  # the profiler starts up
def test_profile_free_memory_and_handlers(tmp_path):
    acc = nbaccel.Accelerator(cpu=True)
    with acc.profile(ProfileKwargs(activities=["cpu"], output_trace_dir=str(tmp_path))) as prof:
        torch.randn(64, 64) @ torch.randn(64, 64)
    assert any("mm" in e.key for e in prof.key_averages())
    # Accelerate's file name, profile_<rank>.json (PROFILE_PATTERN_NAME), not one of nbaccel's
    assert os.listdir(tmp_path) == ["profile_0.json"]
    model, opt = acc.prepare(torch.nn.Linear(2, 2), torch.optim.SGD([torch.zeros(1)], lr=0.1))
    assert acc.free_memory(model, opt) == [None, None]
    assert acc.prepared().models == () and acc.prepared().optimizers == ()

    bf16 = nbaccel.Accelerator(cpu=True, mixed_precision="bf16")
    layer = torch.nn.Linear(2, 2)
    with bf16.autocast():
        assert layer(torch.ones(1, 2)).dtype == torch.bfloat16
    with bf16.autocast(AutocastKwargs(enabled=False)):
        assert layer(torch.ones(1, 2)).dtype == torch.float32

    fp16 = nbaccel.Accelerator(
        cpu=True, mixed_precision="fp16", kwargs_handlers=[GradScalerKwargs(init_scale=1024)]
    )
    assert fp16.scaler.get_scale() == 1024.0


def test_unscale_gradients_gives_true_gradients_once():
    scaler = GradScalerKwargs(init_scale=1024)  # 65536 would overflow fp16 in this tiny net
    acc = nbaccel.Accelerator(cpu=True, mixed_precision="fp16", kwargs_handlers=[scaler])
    model = torch.nn.Linear(3, 1, bias=False)
    model.weight.data.fill_(0.5)
    model, opt = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    x = torch.ones(2, 3)
    acc.backward(model(x).float().sum())
    assert torch.allclose(model.weight.grad, torch.full((1, 3), 2.0 * 1024))  # still scaled
    acc.unscale_gradients()
    assert torch.allclose(model.weight.grad, torch.full((1, 3), 2.0))
    acc.clip_grad_norm_(model.parameters(), max_norm=100.0)  # no second unscale
    assert torch.allclose(model.weight.grad, torch.full((1, 3), 2.0))
    opt.step()


def test_save_model_bin_and_get_state_dict(tmp_path):
    from nbaccel.utils import load_checkpoint_in_model

    acc = nbaccel.Accelerator(cpu=True)
    model = acc.prepare(torch.nn.Linear(3, 2))
    acc.save_model(model, tmp_path, safe_serialization=False)
    assert os.listdir(tmp_path) == ["pytorch_model.bin"]
    fresh = torch.nn.Linear(3, 2)
    load_checkpoint_in_model(fresh, tmp_path, strict=True)
    assert torch.equal(fresh.weight, model.weight)


def _epoch_batches(resume_at: int | None, folder: str):
    """Accelerate's resume pattern: load_state, then skip_first_batches for the cut epoch."""
    acc = nbaccel.Accelerator(cpu=True)
    g = torch.Generator().manual_seed(11)
    dl = acc.prepare(
        DataLoader(TensorDataset(torch.arange(12)), batch_size=2, shuffle=True, generator=g)
    )
    seen = []
    if resume_at is None:
        for epoch in range(2):
            for i, (x,) in enumerate(dl):
                if epoch == 1 and i == 2:
                    acc.save_state(folder)
                seen.append(x.tolist())
        return seen
    acc.load_state(folder)
    for (x,) in acc.skip_first_batches(dl, resume_at):
        seen.append(x.tolist())
    return seen


def test_resume_mid_epoch_with_a_seeded_generator(tmp_path):
    full = _epoch_batches(None, str(tmp_path / "ckpt"))
    # The save happened before batch 2 of epoch 1 was yielded: position 2 of epoch 1.
    assert _epoch_batches(2, str(tmp_path / "ckpt")) == full[6 + 2 :]


def uneven(lib: str):
    import importlib

    config = importlib.import_module(f"{lib}.utils").DataLoaderConfiguration(even_batches=False)
    acc = importlib.import_module(lib).Accelerator(cpu=True, dataloader_config=config)
    model = acc.prepare(torch.nn.Linear(1, 1))
    dl = acc.prepare(DataLoader(TensorDataset(torch.ones(5, 1)), batch_size=2))
    steps = 0
    with acc.join_uneven_inputs([model]):
        for (x,) in dl:
            model(x).sum().backward()
            steps += 1
    with acc.local_main_process_first():
        order = acc.process_index
    # DDP kwargs with a communication hook: gradients travel as fp16 and are still averaged.
    ddp = importlib.import_module(f"{lib}.utils").DistributedDataParallelKwargs(comm_hook="fp16")
    acc4 = importlib.import_module(lib).Accelerator(cpu=True, kwargs_handlers=[ddp])
    net = acc4.prepare(torch.nn.Linear(1, 1, bias=False))
    # Rank 0's gradient 1 + 2**-12 is not an fp16 number: compressed it becomes 1.0, so the
    # mean is exactly 1.5 (uncompressed it would be 1.5 + 2**-13).
    x = 1.0 + 2**-12 if acc4.process_index == 0 else 2.0
    acc4.backward(net(torch.full((1, 1), x)).sum())
    grad = net.module.weight.grad.item()
    return steps, order, grad


@pytest.mark.slow
def test_join_uneven_inputs_lets_ranks_take_different_step_counts():
    # nbaccel only: Accelerate enables Join for GPU runs alone, so on 2 CPU ranks it hangs.
    out = nbaccel.notebook_launcher(
        uneven, args=("nbaccel",), num_processes=2, progress=False, return_all=True, timeout=120
    )
    assert [steps for steps, _, _ in out] == [2, 1]
    assert [grad for _, _, grad in out] == [1.5, 1.5]
