"""The Accelerator's saving methods: unwrap and save models (safetensors, sharded), and
checkpoint whole runs with Accelerate's project layout, iteration counter and pre-hooks.

Mixed into :class:`nbaccel.Accelerator`; the file formats live in ``model_files`` and
``checkpoint``.
"""

from __future__ import annotations

import os
import re
import shutil
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.utils.hooks import RemovableHandle

from nbaccel.training import checkpoint, model_files, xla
from nbaccel.training.accelerator.parts import AcceleratorParts


class Saving(AcceleratorParts):
    """Mixed into :class:`nbaccel.Accelerator`."""

    # -- where things go ------------------------------------------------------------------

    @property
    def project_dir(self) -> str | None:
        """``ProjectConfiguration.project_dir`` (also ``Accelerator(project_dir=...)``)."""
        return self.project_configuration.project_dir

    @property
    def logging_dir(self) -> str | None:
        """Where trackers write (defaults to ``project_dir``)."""
        return self.project_configuration.logging_dir

    @property
    def save_iteration(self) -> int:
        """The number the next automatically named checkpoint gets."""
        return self.project_configuration.iteration

    @property
    def should_save_model(self) -> bool:
        """Whether this process writes model files (the main process; all ranks under FSDP's
        sharded checkpoints are handled inside save_state)."""
        return self.is_main_process

    # -- models ---------------------------------------------------------------------------

    def unwrap_model(
        self,
        model: torch.nn.Module,
        keep_fp32_wrapper: bool = True,
        keep_torch_compile: bool = True,
    ) -> Any:
        """The user's module without DDP or torch.compile (FSDP modules are returned as they are).

        Example::

            return accelerator.unwrap_model(model)   # a plain nn.Module for the kernel
        """
        compiled = getattr(model, "_orig_mod", None)
        inner = compiled if compiled is not None else model
        if not keep_fp32_wrapper:
            self._precision.remove_autocast_forward(inner)
        inner = self._strategy.unwrap(inner)
        if not keep_fp32_wrapper:
            self._precision.remove_autocast_forward(inner)
        if compiled is not None and keep_torch_compile and inner is compiled:
            return model
        return inner

    def get_state_dict(self, model: torch.nn.Module, unwrap: bool = True) -> dict[str, Any]:
        """The model's full state dict (FSDP shards are gathered; call it on every rank).
        ``unwrap=False`` keeps the wrappers' names (``module.`` of DDP, ``_orig_mod.`` of
        ``torch.compile``) as Accelerate does; FSDP and DeepSpeed give the model's own names.

        Example::

            state = accelerator.get_state_dict(model)
            accelerator.save(state, "model.pt")
        """
        if not unwrap:
            return self._strategy.model_state_dict(model, unwrap=False)
        return self._strategy.model_state_dict(getattr(model, "_orig_mod", model))

    def save(self, obj: Any, f: str | os.PathLike[str], safe_serialization: bool = False) -> None:
        """``torch.save`` (or safetensors) on the main process only, atomically.

        Example::

            accelerator.save(accelerator.get_state_dict(model), "checkpoints/model.pt")
        """
        if self.device.type == "xla":  # xm.save's way: tensors to the CPU, the main one writes
            obj = xla.to_cpu(obj)
        if self.is_main_process:
            model_files.write(obj, f, safe_serialization)

    def save_model(
        self,
        model: torch.nn.Module,
        save_directory: str | os.PathLike[str],
        max_shard_size: int | str = "10GB",
        safe_serialization: bool = True,
    ) -> None:
        """Write the model's weights like Accelerate: ``model.safetensors`` (or
        ``pytorch_model.bin``), split in shards of at most ``max_shard_size`` with an index.
        Call it on every rank (FSDP gathers); the main process writes.

        Example::

            accelerator.save_model(model, "out/", max_shard_size="200MB")
            load_checkpoint_in_model(fresh_model, "out/")
        """
        state = self.get_state_dict(model)
        if self.is_main_process:
            model_files.save_model_files(state, save_directory, max_shard_size, safe_serialization)
        self.wait_for_everyone()

    # -- whole-run checkpoints ------------------------------------------------------------

    def register_save_state_pre_hook(self, hook: Callable[..., None]) -> RemovableHandle:
        """Call ``hook(models, weights, output_dir)`` in save_state, before the model files are
        written (every rank), as Accelerate does: ``models`` are the prepared models without
        their DDP wrappers, ``weights`` their state dicts, and ``output_dir`` the folder being
        filled (a staging folder swapped in whole at the end, so what the hook writes there is
        part of the checkpoint). A state the hook pops from ``weights`` is not written.

        Example::

            def save_hook(models, weights, output_dir):
                if accelerator.is_main_process:
                    models[0].save_pretrained(os.path.join(output_dir, "unet"))
                    weights.pop()   # the hook saved it: no model_0.pt
            handle = accelerator.register_save_state_pre_hook(save_hook)
        """
        handle = RemovableHandle(self._save_model_state_pre_hook)
        self._save_model_state_pre_hook[handle.id] = hook
        return handle

    def register_load_state_pre_hook(self, hook: Callable[..., None]) -> RemovableHandle:
        """Call ``hook(models, input_dir)`` in load_state, before the model files are read
        (every rank), as Accelerate does: a model the hook pops from ``models`` (the prepared
        models without their DDP wrappers, in a list of the hook's own) it has loaded itself.

        Example::

            def load_hook(models, input_dir):
                unet = models.pop()   # loaded here, so load_state skips it
                unet.load_state_dict(UNet2DModel.from_pretrained(input_dir, subfolder="unet").state_dict())
            handle = accelerator.register_load_state_pre_hook(load_hook)
        """
        handle = RemovableHandle(self._load_model_state_pre_hook)
        self._load_model_state_pre_hook[handle.id] = hook
        return handle

    def save_state(
        self,
        output_dir: str | os.PathLike[str] | None = None,
        safe_serialization: bool = True,
        **save_model_func_kwargs: Any,
    ) -> str:
        """Save model, optimizer, scheduler, scaler, dataloader position and every rank's RNG
        states. Call it on every rank. Without ``output_dir``, uses the project: with
        ``automatic_checkpoint_naming``, ``<project_dir>/checkpoints/checkpoint_<i>`` (keeping
        the newest ``total_limit``), else ``<project_dir>/checkpoint``.

        Example::

            accelerator.save_state()   # ProjectConfiguration(..., automatic_checkpoint_naming=True)
        """
        config = self.project_configuration
        if config.automatic_checkpoint_naming:
            target = self._next_checkpoint_dir()
        else:
            target = self._checkpoint_dir(output_dir)
        hooks = list(self._save_model_state_pre_hook.values())
        path = checkpoint.save_state(self, target, hooks, safe_serialization)
        if config.automatic_checkpoint_naming:
            config.iteration += 1
        return str(path)

    def load_state(
        self,
        input_dir: str | os.PathLike[str] | None = None,
        load_kwargs: dict | None = None,
        **load_model_func_kwargs: Any,
    ) -> str:
        """Restore a :meth:`save_state` folder into the prepared objects (every rank). Without
        ``input_dir`` under automatic naming, the newest ``checkpoints/checkpoint_<i>``.

        Example::

            accelerator.load_state("checkpoints/step5")   # then continue the loop
        """
        if input_dir is None and self.project_configuration.automatic_checkpoint_naming:
            found = _numbered(self._checkpoints_root())
            if not found:
                raise FileNotFoundError(
                    f"no checkpoint_<i> folder in {self.project_dir}/checkpoints; "
                    "accelerator.resume() loads one only where there is one."
                )
            target = found[-1][1]
        else:
            target = self._checkpoint_dir(input_dir)
        # The save counter (save_iteration) stays as it is, as in Accelerate: a run resumed in a
        # new process sets project_configuration.iteration itself before it saves again.
        path = checkpoint.load_state(self, target, list(self._load_model_state_pre_hook.values()))
        return str(path)

    def resume(self) -> str | None:
        """Load the project's newest checkpoint if there is one, and go on numbering after it:
        the one line that makes a training function resume, whether its ranks were restarted
        (``max_restarts``), the cell was run again after a failure or a stop, or the kernel is
        new. Call it on every rank after ``prepare`` (and ``register_for_checkpointing``).
        Returns the folder loaded, or ``None`` when there is none yet (a first run).

        With ``automatic_checkpoint_naming`` it loads the highest ``checkpoints/checkpoint_<i>``
        (a save killed midway left only a hidden ``.checkpoint_<i>.partial``, never read) and
        sets ``project_configuration.iteration`` to ``i + 1``, so the next ``save_state()``
        writes ``checkpoint_<i+1>``; otherwise it loads ``<project_dir>/checkpoint``. nbaccel's
        addition: Accelerate's ``load_state()`` leaves the counter for the script to set.

        Example::

            accelerator = Accelerator(project_config=ProjectConfiguration(
                "run", automatic_checkpoint_naming=True))
            model, optimizer = accelerator.prepare(model, optimizer)
            accelerator.register_for_checkpointing(counter)
            accelerator.resume()   # None on the first run; then the loop, save_state() ...
        """
        config = self.project_configuration
        if config.automatic_checkpoint_naming:
            found = _numbered(self._checkpoints_root())
            if not found:
                return None
            number, target = found[-1]
        else:
            target = self._checkpoint_dir(None)
            if not target.is_dir():
                return None
        path = self.load_state(target)
        if config.automatic_checkpoint_naming:
            config.iteration = max(config.iteration, number + 1)
        return path

    def _checkpoint_dir(self, directory: Any) -> Path:
        if directory is not None:
            return Path(directory)
        if self.project_dir is None:
            raise ValueError(
                "save_state()/load_state() need a folder: pass one, or create the Accelerator "
                "with project_dir=... (or project_config=ProjectConfiguration(...))."
            )
        return Path(self.project_dir) / "checkpoint"

    def _checkpoints_root(self) -> Path:
        if self.project_dir is None:
            raise ValueError(
                "automatic_checkpoint_naming needs ProjectConfiguration(project_dir=...)."
            )
        return Path(self.project_dir) / "checkpoints"

    def _next_checkpoint_dir(self) -> Path:
        root = self._checkpoints_root()
        target = root / f"checkpoint_{self.save_iteration}"
        if target.exists():
            raise ValueError(
                f"checkpoint folder {target} already exists; set "
                "accelerator.project_configuration.iteration to the next free number, or "
                "resume with accelerator.resume(), which loads the newest checkpoint and "
                "numbers the next one after it."
            )
        limit = self.project_configuration.total_limit
        if self.is_main_process and limit is not None:
            existing = _numbered(root)
            doomed = existing[: max(0, len(existing) + 1 - limit)]
            if doomed:
                warnings.warn(
                    f"deleting {len(doomed)} checkpoint(s) in {root} to keep total_limit={limit}.",
                    stacklevel=3,
                )
            for _, folder in doomed:
                shutil.rmtree(folder)
        return target


def _numbered(root: Path) -> list[tuple[int, Path]]:
    """``checkpoint_<i>`` folders under ``root``, oldest (lowest i) first."""
    if not root.is_dir():
        return []
    found = []
    for folder in root.iterdir():
        match = re.fullmatch(r"checkpoint_(\d+)", folder.name)
        if match and folder.is_dir():
            found.append((int(match.group(1)), folder))
    return sorted(found)
