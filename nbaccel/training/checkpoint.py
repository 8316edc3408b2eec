"""Checkpoints: atomic single-file saves, and whole-run ``save_state``/``load_state``.

A file is written next to its target and renamed over it, so a crash mid-write never leaves a
truncated file where a good one was. ``save_state`` fills a staging folder and swaps it in, so
the previous checkpoint stays whole until the new one is complete; ``load_state`` falls back to
it when a crash hit between the two renames. Everything is read with ``weights_only=True``.

The files inside are Accelerate's (``model.safetensors``, ``optimizer.bin``, ``scheduler.bin``,
``scaler.pt``, ``random_states_<rank>.pkl``, ``custom_checkpoint_<i>.pkl``, a ``_<i>`` before
the suffix for the second object on), with the same contents, so a folder moves between the two
libraries either way. nbaccel adds ``dataloader_<i>.pt``, where each loader is in its epoch
(Accelerate keeps no such file; it ignores it, and a folder without it starts the loaders
where they are, as Accelerate does). Sharded (FSDP) and engine (DeepSpeed) checkpoints are
folders ``model_<i>``/``optimizer_<i>``. Folders in nbaccel's earlier layout (``model_0.pt``,
``random_states_0.pt``, ...) still load.

The Accelerator's save/load-state pre-hooks run here, inside that swap, on Accelerate's terms:
a save hook gets ``(models, weights, folder)`` with the user's modules (no DDP or torch.compile
wrapper), the state dicts about to be written as ``model.safetensors`` and the staging folder, so what
it writes there is part of the checkpoint; what it pops from ``weights`` is not written. A load
hook gets ``(models, folder)``; what it pops from ``models`` nbaccel does not load. Both lists
are the hooks' own copies: the prepared models stay as they were.

>>> model_file(0, safe=True), model_file(1, safe=False), numbered("scheduler", 0, ".bin")
('model.safetensors', 'pytorch_model_1.bin', 'scheduler.bin')
"""

from __future__ import annotations

import os
import re
import shutil
import warnings
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from nbaccel.core.disk_space import OutOfSpaceError, is_out_of_space, swap_failed
from nbaccel.training import model_files, ops
from nbaccel.training.file_reading import torch_load, torch_load_with_numpy
from nbaccel.training.registry import PreparedObjects
from nbaccel.training.rng import (
    capture_rng_state,
    restore_rng_state,
    restore_rng_states_file,
    rng_states_file,
)
from nbaccel.training.strategies.base import Strategy, state_file
from nbaccel.training.torch_files import atomic_save

if TYPE_CHECKING:  # the Accelerator, as its saving mixin hands itself over
    from nbaccel.training.accelerator.parts import AcceleratorParts


# -- the files of a checkpoint folder: Accelerate's names --------------------------------


def numbered(stem: str, index: int, suffix: str) -> str:
    """Accelerate's name for the ``index``-th object of a kind: ``optimizer.bin``,
    ``optimizer_1.bin``, ...

    >>> numbered("optimizer", 0, ".bin"), numbered("model", 2, ".safetensors")
    ('optimizer.bin', 'model_2.safetensors')
    """
    return f"{stem}{'' if index == 0 else f'_{index}'}{suffix}"


def model_file(index: int, safe: bool) -> str:
    """A model's full weights: safetensors, or ``torch.save`` without ``safe_serialization``."""
    return (
        numbered("model", index, ".safetensors")
        if safe
        else numbered("pytorch_model", index, ".bin")
    )


SCALER_FILE = "scaler.pt"
_LEGACY_EXTRA = "accelerator.pt"  # nbaccel's earlier layout: scaler and accumulation step


def _custom_file(index: int) -> str:
    return f"custom_checkpoint_{index}.pkl"


def _rng_file(rank: int) -> str:
    return f"random_states_{rank}.pkl"


def _loader_file(index: int) -> str:
    return f"dataloader_{index}.pt"  # nbaccel's own: where the loader is in its epoch


def _found(folder: Path, *names: str) -> Path | None:
    """The first of ``names`` (the current name, then nbaccel's earlier ones) in ``folder``."""
    return next((folder / n for n in names if (folder / n).exists()), None)


def _siblings(directory: Path) -> tuple[Path, Path]:
    return (
        directory.with_name(f".{directory.name}.partial"),
        directory.with_name(f".{directory.name}.old"),
    )


Hook = Callable[..., None]


def save_state(
    acc: AcceleratorParts,
    directory: str | os.PathLike[str],
    hooks: Iterable[Hook] = (),
    safe_serialization: bool = True,
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
        step = acc.gradient_state.micro_step  # Accelerate's `step`, kept with the generators
        atomic_save(rng_states_file(step), staging / _rng_file(acc.process_index))
        ops.barrier()
        try:
            _write_all(acc, staging, main, list(hooks), safe_serialization)
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
    folders = ops.gather_object([os.path.abspath(final)])
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


def _write_all(
    acc: AcceleratorParts, staging: Path, main: bool, hooks: list[Hook], safe: bool
) -> None:
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
            _write_model(state, staging, i, safe)
    for i, (opt, owner) in enumerate(zip(prepared.optimizers, prepared.optimizer_models)):
        # Each optimizer through its own model: under FSDP its state is gathered via that model.
        state = strategy.save_optimizer(owner, opt.optimizer, staging / f"optimizer_{i}")
        if state is not None and main:
            atomic_save(state, staging / numbered("optimizer", i, ".bin"))
    if main:
        for i, sched in enumerate(prepared.schedulers):
            atomic_save(sched.state_dict(), staging / numbered("scheduler", i, ".bin"))
        for i, loader in enumerate(prepared.dataloaders):
            atomic_save(loader.state_dict(), staging / _loader_file(i))
        for i, obj in enumerate(prepared.custom_objects):
            atomic_save(obj.state_dict(), staging / _custom_file(i))
        if acc.scaler is not None:
            atomic_save(acc.scaler.state_dict(), staging / SCALER_FILE)


def _write_model(state: dict[str, Any], folder: Path, index: int, safe: bool) -> None:
    """One model's full weights under Accelerate's name; a tensor with two names (tied
    weights) is stored once, as Accelerate stores it."""
    tensors, aliases = model_files.split_tied(state)
    if safe:
        model_files.save_safetensors(tensors, folder / model_file(index, safe=True), aliases)
    else:
        atomic_save(state, folder / model_file(index, safe=False))


class CheckpointNotFoundError(FileNotFoundError, ValueError):
    """No checkpoint folder where ``load_state`` looks. A ``ValueError`` too, which is what
    Accelerate raises there, so ported ``except ValueError`` blocks still catch it."""


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
        raise CheckpointNotFoundError(
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
        target = path / f"optimizer_{i}"
        if target.is_dir() or strategy.collective_checkpoint:
            strategy.load_optimizer(model, opt.optimizer, target)
        else:
            file = _required(path, numbered("optimizer", i, ".bin"), f"optimizer_{i}.pt")
            strategy.load_optimizer_state_dict(model, opt.optimizer, torch_load(file))
    for i, sched in enumerate(prepared.schedulers):
        file = _required(path, numbered("scheduler", i, ".bin"), f"scheduler_{i}.pt")
        sched.load_state_dict(torch_load(file))
    for i, loader in enumerate(prepared.dataloaders):
        position = _found(path, _loader_file(i))
        if position is not None:  # else (Accelerate's folder) the loader goes on where it is
            loader.load_state_dict(torch_load(position))
    for i, obj in enumerate(prepared.custom_objects):
        file = _required(path, _custom_file(i), f"custom_{i}.pt")
        obj.load_state_dict(torch_load(file, trusted_fallback=True))
    legacy = _found(path, _LEGACY_EXTRA)
    extra = torch_load(legacy) if legacy is not None else {}
    scaler = _found(path, SCALER_FILE)
    if acc.scaler is not None and scaler is not None:
        acc.scaler.load_state_dict(torch_load(scaler))
    elif acc.scaler is not None and extra.get("precision"):
        acc.scaler.load_state_dict(extra["precision"])
    rank = acc.process_index
    rng_file = _found(path, _rng_file(rank), f"random_states_{rank}.pt")
    step = extra.get("micro_step")
    if rng_file is not None and rng_file.suffix == ".pkl":
        step = restore_rng_states_file(torch_load_with_numpy(rng_file))
    elif rng_file is not None:
        restore_rng_state(torch_load(rng_file))
    else:  # saved by fewer processes: continue as Accelerate does, this rank's RNG as it is
        warnings.warn(
            f"{path / _rng_file(rank)} is missing (the checkpoint was saved by fewer processes "
            f"than this run's {acc.num_processes}): rank {rank}'s random states are not "
            "restored; everything else is.",
            stacklevel=3,
        )
    if step is not None:
        acc.gradient_state.micro_step = int(step)
    ops.barrier()
    return path


def _required(folder: Path, *names: str) -> Path:
    """The file of ``names`` that ``folder`` holds, or an error that says which is missing."""
    file = _found(folder, *names)
    if file is None:
        raise FileNotFoundError(
            f"{folder / names[0]} is missing: the checkpoint holds fewer objects of this kind "
            "than were prepared (or registered); prepare the same objects, in the same order, "
            "as at save_state()."
        )
    return file


def _load_models(
    path: Path,
    models: list[torch.nn.Module],
    prepared: tuple[torch.nn.Module, ...],
    strategy: Strategy,
) -> None:
    """Load the ``i``-th saved model of ``path`` into ``models[i]``, once the count matches."""
    expected = _saved_models(path)
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
        target = path / f"model_{i}"
        if target.is_dir() or strategy.collective_checkpoint:
            strategy.load_model(model, target)  # a sharded folder, an engine's checkpoint
            continue
        file = _found(path, model_file(i, True), model_file(i, False), state_file(target).name)
        assert file is not None  # counted above
        state = model_files.load_state_dict_files(file)
        # A tied tensor is stored once, under one of its names (Accelerate's files too).
        model_files._fill_tied(strategy.unwrap(model), state)
        strategy.load_model_state_dict(model, state)


_MODEL_NAME = re.compile(
    r"^(?:model|pytorch_model)(?:_(\d+))?(?:\.safetensors|\.bin)$|^model_(\d+)(?:\.pt)?$"
)


def _saved_models(path: Path) -> int:
    """How many models ``path`` holds (weight files, sharded or engine folders)."""
    indices = set()
    for entry in path.iterdir():
        match = _MODEL_NAME.match(entry.name)
        if match:
            indices.add(int(match.group(1) or match.group(2) or 0))
    return len(indices)
