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
    with pytest.raises(ValueError, match=r"strategy='megatron' is not known; choose one of"):
        Accelerator(strategy="megatron")
    with pytest.raises(ValueError, match=r"mixed_precision='fp4'"):
        Accelerator(mixed_precision="fp4")
    with pytest.raises(ValueError, match="gradient_accumulation_steps"):
        Accelerator(gradient_accumulation_steps=0)
    with pytest.raises(ValueError, match="rng_types"):
        Accelerator(rng_types=["dice"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only refusal")
def test_fp8_on_cpu_says_what_to_use():
    with pytest.raises(ValueError, match="needs a CUDA GPU.*use 'bf16' on CPU"):
        Accelerator(mixed_precision="fp8")


def split_loader(batch_size: int) -> tuple[int, list[int]]:
    """In a rank: prepare a split-batches loader of 8 samples; its length and batch sizes."""
    from nbaccel.utils import DataLoaderConfiguration

    acc = Accelerator(dataloader_config=DataLoaderConfiguration(split_batches=True))
    dl = acc.prepare(DataLoader(TensorDataset(torch.arange(8)), batch_size=batch_size))
    return len(dl), [len(batch) for (batch,) in dl]


def test_split_batches_needs_a_batch_size_divisible_by_the_process_count():
    run = nbaccel.notebook_launcher
    # 4 splits over 2 ranks: two steps of 2 samples each per rank.
    assert run(split_loader, args=(4,), num_processes=2, progress=False) == (2, [2, 2])
    with pytest.raises(nbaccel.RankFailedError) as info:
        run(split_loader, args=(3,), num_processes=2, progress=False)
    assert info.value.exc_type == "builtins.ValueError"
    assert "batch_size (3) to be a multiple of the number of processes (2)" in str(info.value)
    # In the kernel (one process) every batch size divides: nothing to split.
    assert split_loader(3) == (3, [3, 3, 2])


def test_save_state_needs_a_folder():
    acc = Accelerator()
    acc.prepare(torch.nn.Linear(2, 1))
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


def test_log_is_a_no_op_outside_a_launch(capfd, monkeypatch):
    from nbaccel.core import events
    from nbaccel.rank import reporting

    sent = []
    monkeypatch.setattr(events, "emit", lambda event, block=True: sent.append(event) or False)
    acc = Accelerator()
    capfd.readouterr()
    assert events.current_rank() is None  # no event channel: this process is not a rank
    for step in range(100):
        assert acc.log({"loss": torch.tensor(0.5), "lr": 0.1}, step=step) is None
    assert sent == []  # nothing sent...
    assert reporting._pending == {} and len(reporting._backlog) == 0  # ...nor held to send later
    assert events.current_rank() is None  # logging did not install a channel either
    assert capfd.readouterr() == ("", "")  # and nothing printed instead
