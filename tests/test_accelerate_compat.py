"""Accelerate's names and behaviours that its own test scripts rely on (issue 24), checked
quickly in one process; ``tests/test_accelerate_suite.py`` runs the scripts on 2 ranks."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

import nbaccel
from nbaccel.data_loader import (
    DataLoaderDispatcher,
    DataLoaderShard,
    SeedableRandomSampler,
    prepare_data_loader,
    skip_first_batches,
)
from nbaccel.state import AcceleratorState, DistributedType, GradientState, PartialState
from nbaccel.utils import (
    DistributedOperationException,
    GradientAccumulationPlugin,
    copy_tensor_to_devices,
    is_hpu_available,
    is_pytest_available,
)


class _Stream(IterableDataset):
    def __iter__(self):
        yield from range(6)


def test_prepared_loaders_are_accelerates_classes():
    acc = nbaccel.Accelerator()
    shard = acc.prepare(DataLoader(range(8), batch_size=2))
    stream = acc.prepare(DataLoader(_Stream(), batch_size=2))
    assert isinstance(shard, DataLoaderShard) and isinstance(stream, DataLoaderDispatcher)
    dispatched = nbaccel.Accelerator(dispatch_batches=True).prepare(DataLoader(range(4)))
    assert isinstance(dispatched, DataLoaderDispatcher)
    assert [b.tolist() for b in skip_first_batches(shard, 3)] == [[6, 7]]


def test_prepare_data_loader_without_an_accelerator():
    dl = prepare_data_loader(DataLoader(range(6), batch_size=2), put_on_device=True)
    assert isinstance(dl, DataLoaderShard)
    assert [b.tolist() for b in dl] == [[0, 1], [2, 3], [4, 5]]
    assert dl.batch_sampler.batch_sampler.batch_size == 2  # the loader's own BatchSampler
    seeded = prepare_data_loader(DataLoader(range(6), shuffle=True), use_seedable_sampler=True)
    assert isinstance(seeded.batch_sampler.batch_sampler.sampler, SeedableRandomSampler)


def test_seedable_sampler_orders_by_seed_and_epoch():
    sampler = SeedableRandomSampler(data_source=range(10), data_seed=5)
    first, second = list(sampler), list(sampler)
    assert first != second and sorted(first) == list(range(10))
    sampler.set_epoch(0)
    assert list(sampler) == first
    assert list(SeedableRandomSampler(data_source=range(10), data_seed=6)) != first


def test_gradient_state_knows_the_active_loader():
    acc = nbaccel.Accelerator()
    outer, inner = acc.prepare(DataLoader(range(4), batch_size=2), DataLoader(range(2)))
    seen = []
    for _ in outer:
        seen.append(acc.gradient_state.active_dataloader is outer)
        for _ in inner:
            seen.append(acc.gradient_state.active_dataloader is inner)
        seen.append(acc.gradient_state.active_dataloader is outer)
    assert all(seen) and len(seen) == 8
    assert acc.gradient_state.active_dataloader is None
    assert not acc.gradient_state.in_dataloader
    GradientState._reset_state()  # what ported test code calls; nothing process-wide to reset


def test_a_loader_can_be_prepared_again():
    loader = DataLoader(TensorDataset(torch.arange(4)), batch_size=2)
    first = nbaccel.Accelerator().prepare(loader)
    second_acc = nbaccel.Accelerator()
    second = second_acc.prepare(loader)
    again = second_acc.prepare(second)
    assert first is not second and again is not second
    assert [x.tolist() for (x,) in again] == [[0, 1], [2, 3]]
    assert [x.tolist() for (x,) in first] == [[0, 1], [2, 3]]


def test_sync_each_batch_still_steps_every_num_steps():
    plugin = GradientAccumulationPlugin(num_steps=2, sync_each_batch=True)
    acc = nbaccel.Accelerator(gradient_accumulation_plugin=plugin)
    model = acc.prepare(torch.nn.Linear(1, 1))
    flags = []
    for _ in range(4):
        with acc.accumulate(model):
            flags.append(acc.sync_gradients)
    assert flags == [False, True, False, True]
    assert acc.gradient_state.sync_each_batch


def test_distributed_type_can_be_set_until_the_next_accelerator():
    acc = nbaccel.Accelerator()
    acc.state.distributed_type = DistributedType.FSDP
    assert AcceleratorState().distributed_type is DistributedType.FSDP
    assert acc.distributed_type is DistributedType.FSDP
    AcceleratorState._reset_state()
    assert acc.state.distributed_type is DistributedType.NO
    acc.state.distributed_type = "MULTI_GPU"
    nbaccel.Accelerator()
    assert PartialState().distributed_type is DistributedType.NO


def test_debug_mode_follows_the_environment_and_can_be_set(monkeypatch):
    state = PartialState()
    monkeypatch.setenv("ACCELERATE_DEBUG_MODE", "1")
    assert state.debug
    state.debug = False
    try:
        assert not PartialState().debug
    finally:
        state.debug = True  # back to what the environment says for the rest of the process
        monkeypatch.delenv("ACCELERATE_DEBUG_MODE")
        from nbaccel.training import ops

        ops._debug.clear()
    assert not state.debug
    assert issubclass(DistributedOperationException, Exception)


def test_availability_and_copy_on_one_process():
    assert is_hpu_available() is False
    assert is_pytest_available() is True
    t = torch.tensor([1, 2])
    assert copy_tensor_to_devices(t) is t
    with pytest.raises(ValueError, match="main process passed None"):
        copy_tensor_to_devices(None)


@pytest.mark.slow  # importing datasets takes over a second
def test_split_between_processes_keeps_a_datasets_dataset():
    datasets = pytest.importorskip("datasets")
    data = datasets.Dataset.from_list([{"k": v} for v in range(3)])
    with PartialState().split_between_processes(data) as mine:
        assert isinstance(mine, datasets.Dataset)
        assert mine["k"] == [0, 1, 2]


def fsdp_files(tmp: str) -> dict:
    """save_fsdp_model (full and sharded) and merge_fsdp_weights on 2 FSDP ranks."""
    import safetensors.torch

    from nbaccel.utils import FullyShardedDataParallelPlugin, merge_fsdp_weights, save_fsdp_model
    from tests.test_fsdp_training import Net

    out = {}
    for kind in ("FULL_STATE_DICT", "SHARDED_STATE_DICT"):
        torch.manual_seed(0)
        plugin = FullyShardedDataParallelPlugin(
            auto_wrap_policy="transformer_based_wrap", state_dict_type=kind
        )
        model = Net()
        plugin.set_auto_wrap_policy(model)
        out["resolved"] = callable(plugin.auto_wrap_policy)
        acc = nbaccel.Accelerator(fsdp_plugin=plugin)
        model = acc.prepare(model)
        full = {k: v.clone() for k, v in acc.get_state_dict(model).items()}
        written = save_fsdp_model(plugin, acc, model, f"{tmp}/{kind}")
        if kind == "FULL_STATE_DICT":
            saved = torch.load(written, weights_only=True)
        else:
            merged = merge_fsdp_weights(written, f"{tmp}/merged")
            saved = safetensors.torch.load_file(merged) if acc.is_main_process else full
        out[kind] = (written.name, all(torch.equal(full[k], saved[k]) for k in full))
    return out


@pytest.mark.slow
def test_fsdp_weight_files_as_accelerate_names_them(tmp_path):
    out = nbaccel.notebook_launcher(fsdp_files, args=(str(tmp_path),), num_processes=2)
    assert out["resolved"]
    assert out["FULL_STATE_DICT"] == ("pytorch_model_fsdp.bin", True)
    assert out["SHARDED_STATE_DICT"] == ("pytorch_model_fsdp_0", True)
    assert (tmp_path / "merged" / "model.safetensors").is_file()


def copies_and_checks() -> dict:
    """copy_tensor_to_devices and the debug-mode shape checks on 2 CPU ranks."""
    from nbaccel.utils import gather, pad_across_processes

    state = PartialState(cpu=True)
    rank = state.process_index
    out = {"copied": copy_tensor_to_devices(torch.arange(3) if rank == 0 else None).tolist()}
    state.debug = True
    try:
        gather(torch.zeros(2 + rank))
    except DistributedOperationException as exc:
        out["gather"] = str(exc)
    # pad_across_processes may differ in the padded dimension only.
    out["padded"] = tuple(pad_across_processes(torch.zeros(1 + rank, 3)).shape)
    try:
        pad_across_processes(torch.zeros(1, 3 + rank))
    except DistributedOperationException as exc:
        out["pad"] = str(exc)
    state.debug = False
    return out


@pytest.mark.slow
def test_copy_and_debug_checks_on_two_ranks():
    out = nbaccel.notebook_launcher(copies_and_checks, num_processes=2, progress=False)
    assert out["copied"] == [0, 1, 2]
    assert "gather" in out["gather"] and "rank 0: [(2,)]" in out["gather"]
    assert "rank 1: [(3,)]" in out["gather"]
    assert out["padded"] == (2, 3)
    assert "only the padded dimension may differ" in out["pad"]
