"""Checkpoints: atomic single-file saves, and whole-run ``save_state``/``load_state``.

A file is written next to its target and renamed over it, so a crash mid-write never leaves a
truncated file where a good one was. ``save_state`` fills a staging folder and swaps it in, so
the previous checkpoint stays whole until the new one is complete; ``load_state`` falls back to
it when a crash hit between the two renames. Everything is read with ``weights_only=True``.

The Accelerator's save/load-state pre-hooks run here, inside that swap, on Accelerate's terms:
a save hook gets ``(models, weights, folder)`` with the user's modules (no DDP or torch.compile
wrapper), the state dicts about to be written as ``model_<i>.pt`` and the staging folder, so what
it writes there is part of the checkpoint; what it pops from ``weights`` is not written. A load
hook gets ``(models, folder)``; what it pops from ``models`` nbaccel does not load. Both lists
are the hooks' own copies: the prepared models stay as they were.

>>> import torch, tempfile, os
>>> path = os.path.join(tempfile.mkdtemp(), "w.pt")
>>> atomic_save({"w": torch.ones(2)}, path)
>>> torch.load(path, weights_only=True)["w"]
tensor([1., 1.])
"""

from __future__ import annotations

import os
import shutil
import warnings
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from nbaccel.core.atomic import atomic_write
from nbaccel.core.disk_space import OutOfSpaceError, is_out_of_space, swap_failed
from nbaccel.training import ops
from nbaccel.training.file_reading import torch_load
from nbaccel.training.random import capture_rng_state, restore_rng_state
from nbaccel.training.registry import PreparedObjects
from nbaccel.training.strategies.base import Strategy, state_file

if TYPE_CHECKING:  # the Accelerator, as its saving mixin hands itself over
    from nbaccel.training.accelerator_parts import AcceleratorParts


def atomic_save(obj: Any, path: str | os.PathLike[str]) -> None:
    """``torch.save`` to a temporary file in the same folder, fsync, then rename over ``path``.

    Example::

        atomic_save(model.state_dict(), "ckpt/model.pt")
    """
    with atomic_write(path, "wb", size_hint=tensor_bytes(obj)) as f:
        torch.save(obj, f)


def tensor_bytes(obj: Any) -> int:
    """Bytes of the tensor storages in ``obj`` (nested dicts, lists, tuples), each counted once:
    about what ``torch.save`` writes."""
    storages: dict[Any, int] = {}
    stack = [obj]
    while stack:
        item = stack.pop()
        if isinstance(item, torch.Tensor):
            try:
                storage = item.untyped_storage()
            except (RuntimeError, NotImplementedError):  # sparse, nested: not one storage
                continue
            key = (item.device, storage.data_ptr()) if storage.data_ptr() else id(storage)
            storages[key] = storage.nbytes()
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
    return sum(storages.values())


def _siblings(directory: Path) -> tuple[Path, Path]:
    return (
        directory.with_name(f".{directory.name}.partial"),
        directory.with_name(f".{directory.name}.old"),
    )


Hook = Callable[..., None]


def save_state(
    acc: AcceleratorParts, directory: str | os.PathLike[str], hooks: Iterable[Hook] = ()
) -> Path:
    """Write everything a resumed run needs into ``directory`` (collective: call on every rank),
    calling each of ``hooks`` as ``hook(models, weights, staging_folder)`` before the model files.
    The random states saved are the ones the run goes on with, whatever the hooks drew. A failed
    save (a hook's too) removes its partial files (a killed one: the next save does) and leaves
    the previous checkpoint as it was; a full disk says how much room it needs."""
    final = Path(directory)
    staging, old = _siblings(final)
    main = _writes_folder(acc, final)
    if main:
        shutil.rmtree(staging, ignore_errors=True)  # left by an earlier crash
        staging.mkdir(parents=True)
    ops.barrier()
    try:
        # Each rank's own file first: past this barrier, a failure of the main process's big
        # writes, which removes the staging folder, cannot pull it from under another rank.
        rng = capture_rng_state()
        atomic_save(rng, staging / f"random_states_{acc.process_index}.pt")
        ops.barrier()
        try:
            _write_all(acc, staging, main, list(hooks))
        finally:
            # A hook may draw random numbers (diffusers' EMAModel.save_pretrained builds a
            # model): the run goes on from the states saved, exactly as a resumed one will.
            restore_rng_state(rng)
    except BaseException as exc:
        staged = _tree_bytes(staging) if main else 0
        if main:
            shutil.rmtree(staging, ignore_errors=True)
        if is_out_of_space(exc):  # also from DeepSpeed's or torch.distributed.checkpoint's writes
            this_file = exc.needed if isinstance(exc, OutOfSpaceError) else None
            needed = max(_tree_bytes(final), staged + (this_file or 0))
            raise swap_failed("save_state", final, needed) from exc
        raise
    ops.barrier()
    if main:
        # Swap: the old checkpoint is only removed once the new one is complete and in place.
        shutil.rmtree(old, ignore_errors=True)
        if final.exists():
            os.replace(final, old)
        os.replace(staging, final)
        shutil.rmtree(old, ignore_errors=True)
    ops.barrier()
    return final


def _writes_folder(acc: AcceleratorParts, final: Path) -> bool:
    """Whether this rank writes the files of ``final`` that all its ranks share (models,
    optimizers, loaders): the main process; where ranks pass different folders (each its own
    temporary folder, as Accelerate's tests do), the first rank of each, so every folder is a
    whole checkpoint, swapped in as one. Collective: every rank asks, and every rank refuses
    alike where a rank holds only part of the state."""
    folders = ops.gather_object(os.path.abspath(final))
    if len(set(folders)) == 1:
        return acc.is_main_process
    strategy = acc.prepared().strategy
    if not strategy.full_state_on_every_rank:
        shown = ", ".join(f"rank {rank}: {folder}" for rank, folder in enumerate(folders[:4]))
        more = ", ..." if len(folders) > 4 else ""
        raise ValueError(
            f"save_state: the ranks passed different folders ({shown}{more}); with strategy={strategy.name!r} each rank holds only part of the state, so "
            "every rank must pass the same folder, one they can all reach."
        )
    return folders.index(folders[acc.process_index]) == acc.process_index


def _tree_bytes(folder: Path) -> int:
    """Bytes of the files under ``folder`` (0 when it is not there)."""
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())


def _hook_models(acc: AcceleratorParts, prepared: PreparedObjects) -> list[torch.nn.Module]:
    """The models as Accelerate's hooks see them (the user's modules without DDP or
    torch.compile; what the strategy says otherwise), in a list of the hooks' own."""

    def unwrap(model: torch.nn.Module) -> torch.nn.Module:
        return acc.unwrap_model(model, keep_torch_compile=False)

    return prepared.strategy.models_for_hooks(prepared.models, unwrap)


def _write_all(acc: AcceleratorParts, staging: Path, main: bool, hooks: list[Hook]) -> None:
    prepared = acc.prepared()
    strategy = prepared.strategy
    weights: list[dict[str, Any]] = []
    for i, model in enumerate(prepared.models):
        # Every rank: FSDP gathers here; a collective checkpoint writes each rank's part.
        state = strategy.save_model(model, staging / f"model_{i}")
        if state is not None:
            weights.append(state)
    models = _hook_models(acc, prepared) if hooks else []
    for hook in hooks:  # on every rank, as in Accelerate; a popped state is the hook's to save
        hook(models, weights, str(staging))
    if main:
        for i, state in enumerate(weights):
            atomic_save(state, state_file(staging / f"model_{i}"))
    for i, (opt, owner) in enumerate(zip(prepared.optimizers, prepared.optimizer_models)):
        # Each optimizer through its own model: under FSDP its state is gathered via that model.
        target = staging / f"optimizer_{i}"
        state = strategy.save_optimizer(owner, opt.optimizer, target)
        if state is not None and main:
            atomic_save(state, state_file(target))
    if main:
        for i, sched in enumerate(prepared.schedulers):
            atomic_save(sched.state_dict(), staging / f"scheduler_{i}.pt")
        for i, loader in enumerate(prepared.dataloaders):
            atomic_save(loader.state_dict(), staging / f"dataloader_{i}.pt")
        for i, obj in enumerate(prepared.custom_objects):
            atomic_save(obj.state_dict(), staging / f"custom_{i}.pt")
        scaler = acc.scaler.state_dict() if acc.scaler is not None else {}
        atomic_save(
            {"precision": scaler, "micro_step": acc.gradient_state.micro_step},
            staging / "accelerator.pt",
        )


def load_state(
    acc: AcceleratorParts, directory: str | os.PathLike[str], hooks: Iterable[Hook] = ()
) -> Path:
    """Restore what :func:`save_state` wrote, including this rank's RNG states (every rank),
    after calling each of ``hooks`` as ``hook(models, folder)``: the models a hook pops from
    ``models`` it has loaded itself, and are not loaded here."""
    path = Path(directory)
    _, old = _siblings(path)
    if not path.is_dir() and old.is_dir():
        path = old  # a save was interrupted between its two renames; this one is complete
    if not path.is_dir():
        raise FileNotFoundError(
            f"no checkpoint folder at {path}; pass the folder given to save_state()."
        )
    prepared = acc.prepared()
    strategy = prepared.strategy
    collective = strategy.collective_checkpoint  # models loaded before the hooks, as saved
    if collective:
        _load_models(path, list(prepared.models), prepared.models, strategy)
    given = [] if collective else _hook_models(acc, prepared)
    models = list(given)
    for hook in hooks:  # on every rank, as in Accelerate
        hook(models, str(path))
    if not collective:
        # What the hooks left, mapped back to the prepared (wrapped) models they stand for.
        prepared_of = {id(mine): theirs for mine, theirs in zip(given, prepared.models)}
        left = [prepared_of.get(id(model), model) for model in models]
        _load_models(path, left, prepared.models, strategy)
    for i, (opt, model) in enumerate(zip(prepared.optimizers, prepared.optimizer_models)):
        strategy.load_optimizer(model, opt.optimizer, path / f"optimizer_{i}")
    for i, sched in enumerate(prepared.schedulers):
        sched.load_state_dict(torch_load(path / f"scheduler_{i}.pt"))
    for i, loader in enumerate(prepared.dataloaders):
        loader.load_state_dict(torch_load(path / f"dataloader_{i}.pt"))
    for i, obj in enumerate(prepared.custom_objects):
        obj.load_state_dict(torch_load(path / f"custom_{i}.pt", trusted_fallback=True))
    extra = torch_load(path / "accelerator.pt")
    if acc.scaler is not None and extra["precision"]:
        acc.scaler.load_state_dict(extra["precision"])
    acc.gradient_state.micro_step = int(extra["micro_step"])
    rng_file = path / f"random_states_{acc.process_index}.pt"
    if rng_file.exists():
        restore_rng_state(torch_load(rng_file))
    else:  # saved by fewer processes: continue as Accelerate does, this rank's RNG as it is
        warnings.warn(
            f"{rng_file} is missing (the checkpoint was saved by fewer processes than this "
            f"run's {acc.num_processes}): rank {acc.process_index}'s random states are not "
            "restored; everything else is.",
            stacklevel=3,
        )
    ops.barrier()
    return path


def _load_models(
    path: Path,
    models: list[torch.nn.Module],
    prepared: tuple[torch.nn.Module, ...],
    strategy: Strategy,
) -> None:
    """Load ``model_<i>`` of ``path`` into ``models[i]``, once the count matches."""
    expected = len({p.name.removesuffix(".pt") for p in path.glob("model_*")})
    if expected != len(models):
        taken = len(prepared) - len(models)
        by_hooks = f" ({taken} taken by load_state pre-hooks)" if taken > 0 else ""
        raise ValueError(
            f"the checkpoint at {path} holds {expected} model file(s) but {len(models)} model(s) "
            f"of the {len(prepared)} prepared are left to load{by_hooks}; prepare the same "
            "objects, in the same order, and pop from the hooks' lists what the hooks save "
            "and load themselves, as at save_state()."
        )
    for i, model in enumerate(models):
        strategy.load_model(model, path / f"model_{i}")
