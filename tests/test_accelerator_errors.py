"""Misuse and impossible settings fail early with messages that say what to do (in the kernel,
one process); settings come from the launcher's environment unless the code overrides them."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import nbaccel
from nbaccel import Accelerator


def test_prepare_twice_is_refused():
    acc = Accelerator()
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    prepared_model, prepared_opt = acc.prepare(model, opt)
    with pytest.raises(ValueError, match="already prepared"):
        acc.prepare(model)
    with pytest.raises(ValueError, match=r"argument 1 \(PreparedOptimizer\) was already prepared"):
        acc.prepare(torch.nn.Linear(2, 1), prepared_opt)


def test_backward_before_prepare_is_refused():
    acc = Accelerator()
    loss = torch.nn.Linear(2, 1)(torch.ones(1, 2)).sum()
    with pytest.raises(RuntimeError, match="before any model was prepared"):
        acc.backward(loss)


def test_unknown_strategy_and_precision_are_named():
    with pytest.raises(ValueError, match=r"strategy='deepspeed' is not known; choose one of"):
        Accelerator(strategy="deepspeed")
    with pytest.raises(ValueError, match=r"mixed_precision='fp4'"):
        Accelerator(mixed_precision="fp4")
    with pytest.raises(ValueError, match="gradient_accumulation_steps"):
        Accelerator(gradient_accumulation_steps=0)
    with pytest.raises(ValueError, match="rng_types"):
        Accelerator(rng_types=["dice"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only refusal")
def test_fp8_on_cpu_says_what_to_use():
    with pytest.raises(ValueError, match="needs a CUDA GPU.*use mixed_precision='bf16' on CPU"):
        Accelerator(mixed_precision="fp8")


def test_split_batches_needs_a_divisible_batch_size_and_save_state_needs_a_folder():
    acc = Accelerator(split_batches=True)
    dl = acc.prepare(DataLoader(TensorDataset(torch.arange(8)), batch_size=3))
    assert len(dl) == 3 and dl.batch_size == 3  # one process: nothing to split
    with pytest.raises(ValueError, match="project_dir"):
        acc.save_state()


def settings_seen(override: str | None) -> tuple:
    acc = Accelerator(mixed_precision=override)
    return (acc.mixed_precision, acc.gradient_accumulation_steps, acc.strategy, acc.num_processes)


def test_launcher_settings_reach_the_accelerator_unless_overridden():
    cfg = nbaccel.LaunchConfig(
        num_processes=2, mixed_precision="bf16", strategy="fsdp", gradient_accumulation_steps=3
    )
    run = nbaccel.notebook_launcher
    assert run(settings_seen, args=(None,), config=cfg, progress=False) == ("bf16", 3, "fsdp", 2)
    assert run(settings_seen, args=("fp16",), config=cfg, progress=False) == ("fp16", 3, "fsdp", 2)
    assert settings_seen(None) == ("no", 1, "ddp", 1)  # in the kernel: defaults


def test_log_is_a_no_op_outside_a_launch():
    Accelerator().log({"loss": torch.tensor(0.5)}, step=1)  # must not raise
