"""Accelerate's FSDP weight-file helpers: ``save_fsdp_model`` writes a prepared FSDP model's
weights as its plugin's ``state_dict_type`` says (one full file, or a folder of per-rank
shards), and ``merge_fsdp_weights`` turns such a folder into one ``model.safetensors`` (or
``pytorch_model.bin``) that loads without FSDP or a process group.

File names follow Accelerate's: ``pytorch_model_fsdp.bin`` (``_<i>`` for model ``i`` > 0) and
the folder ``pytorch_model_fsdp_<i>``; ``save_state`` keeps nbaccel's own checkpoint layout.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

__all__ = ["merge_fsdp_weights", "save_fsdp_model"]


def save_fsdp_model(
    fsdp_plugin: Any,
    accelerator: Any,
    model: torch.nn.Module,
    output_dir: str | os.PathLike[str],
    model_index: int = 0,
    adapter_only: bool = False,
) -> Path:
    """Write ``model``'s weights into ``output_dir`` (call it on every rank: it gathers or
    writes shards collectively); returns the file or folder written.

    Example::

        save_fsdp_model(accelerator.state.fsdp_plugin, accelerator, model, "out")
        # SHARDED_STATE_DICT: out/pytorch_model_fsdp_0/, else out/pytorch_model_fsdp.bin
    """
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    from nbaccel.training.strategies.sharded_files import save_sharded_model
    from nbaccel.training.torch_files import atomic_save

    if adapter_only:
        raise NotImplementedError(
            "save_fsdp_model(adapter_only=True) saves PEFT adapters, which nbaccel does not "
            "know; save the whole model (the default)."
        )
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    if fsdp_plugin.state_dict_type == "SHARDED_STATE_DICT":
        target = out / f"pytorch_model_fsdp_{model_index}"
        save_sharded_model(model, target)
    else:
        state = get_model_state_dict(model, options=fsdp_plugin.state_dict_options())
        suffix = "" if model_index == 0 else f"_{model_index}"
        target = out / f"pytorch_model_fsdp{suffix}.bin"
        if accelerator.is_main_process:
            atomic_save(state, target)
    accelerator.wait_for_everyone()
    return target


def merge_fsdp_weights(
    checkpoint_dir: str | os.PathLike[str],
    output_path: str | os.PathLike[str],
    safe_serialization: bool = True,
    remove_checkpoint_dir: bool = False,
) -> Path | None:
    """Merge a sharded folder (``save_fsdp_model`` with ``SHARDED_STATE_DICT``, or a sharded
    ``save_state`` model folder) into ``output_path/model.safetensors`` (or
    ``pytorch_model.bin`` with ``safe_serialization=False``). The main process writes; every
    rank may call it. Returns the file on the main process.

    Example::

        merge_fsdp_weights("out/pytorch_model_fsdp_0", "merged")   # merged/model.safetensors
    """
    from nbaccel.training.partial_state import PartialState

    state = PartialState()
    written = None
    if state.is_main_process:
        written = _merge(Path(checkpoint_dir), Path(output_path), safe_serialization)
        if remove_checkpoint_dir:
            shutil.rmtree(checkpoint_dir)
    state.wait_for_everyone()
    return written


def _merge(folder: Path, out: Path, safe: bool) -> Path:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from nbaccel.training.model_files import SAFE_WEIGHTS_NAME, WEIGHTS_NAME, save_safetensors
    from nbaccel.training.torch_files import atomic_save

    if not (folder / ".metadata").is_file():
        raise FileNotFoundError(
            f"{folder} is not a sharded checkpoint folder (no .metadata file); pass the folder "
            "save_fsdp_model or save_state wrote with SHARDED_STATE_DICT."
        )
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out) as scratch:
        whole = Path(scratch) / "whole.pt"
        dcp_to_torch_save(folder, whole)
        merged = torch.load(whole, map_location="cpu", weights_only=True)
    if set(merged) == {"model"}:  # both libraries nest the weights under one key
        merged = merged["model"]
    target = out / (SAFE_WEIGHTS_NAME if safe else WEIGHTS_NAME)
    if safe:
        save_safetensors(merged, target)
    else:
        atomic_save(merged, target)
    return target
