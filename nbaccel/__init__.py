"""nbaccel: launch distributed PyTorch training from a notebook cell.

>>> import nbaccel
>>> def train():
...     return nbaccel.Accelerator().process_index
>>> nbaccel.notebook_launcher(train, num_processes=2)   # doctest: +SKIP
0

Every public name loads on first use (PEP 562), so ``import nbaccel`` stays quick and a rank
that imports it never loads the kernel side (launcher, relay, views, IPython, ipywidgets).
In a notebook kernel ``import nbaccel`` also starts the fork server ranks come from (a fresh
interpreter that imports torch and the modules of the first optimizer step in the background,
and later what the kernel imports), then imports the kernel's side of a launch (launcher, views,
ipywidgets) in a background thread, so the first launch is fast too and shows its view at once.
``NBACCEL_NO_WARMUP=1`` turns that off.
"""

from __future__ import annotations

import importlib
import os
import sys
from typing import Any

__version__ = "0.1.0"

# Public names, imported when first used: name -> module that defines it.
_LAZY = {
    "notebook_launcher": "nbaccel.launchers",
    "debug_launcher": "nbaccel.launchers",
    "Launch": "nbaccel.launch.handle",
    "running": "nbaccel.launch.handle",
    "LaunchOptions": "nbaccel.launch.options",
    "RayCluster": "nbaccel.cluster.ray_cluster",
    "Ranks": "nbaccel.persistent.session",
    "debug": "nbaccel.launch.post_mortem",
    "LaunchConfig": "nbaccel.core.config",
    "ConfigError": "nbaccel.core.config",
    "LaunchError": "nbaccel.core.errors",
    "LaunchTimeoutError": "nbaccel.core.errors",
    "LaunchStoppedError": "nbaccel.core.errors",
    "RankFailedError": "nbaccel.core.errors",
    "Accelerator": "nbaccel.training.accelerator",
    "FullyShardedDataParallelPlugin": "nbaccel.training.fsdp_plugin",
    "DeepSpeedPlugin": "nbaccel.training.deepspeed_plugin",
    "ParallelismConfig": "nbaccel.training.parallelism_config",
    "set_seed": "nbaccel.training.rng",
    # Accelerate's top-level names (more under nbaccel.utils, its accelerate.utils).
    "PartialState": "nbaccel.training.partial_state",
    "AcceleratorState": "nbaccel.training.partial_state",
    "DistributedType": "nbaccel.training.distributed",
    "DataLoaderConfiguration": "nbaccel.training.kwargs_handlers",
    "ProjectConfiguration": "nbaccel.training.kwargs_handlers",
    "DistributedDataParallelKwargs": "nbaccel.training.kwargs_handlers",
    "GradScalerKwargs": "nbaccel.training.kwargs_handlers",
    "InitProcessGroupKwargs": "nbaccel.training.kwargs_handlers",
    "AutocastKwargs": "nbaccel.training.kwargs_handlers",
    "ProfileKwargs": "nbaccel.training.kwargs_handlers",
    "DDPCommunicationHookType": "nbaccel.training.kwargs_handlers",
    "find_executable_batch_size": "nbaccel.training.memory",
    "skip_first_batches": "nbaccel.training.data",
    "synchronize_rng_states": "nbaccel.training.rng",
    "load_checkpoint_in_model": "nbaccel.training.model_files",
    "prepare_pippy": "nbaccel.training.pippy",
    "prepare_pipeline": "nbaccel.training.pipeline_training",
    "PipelineModel": "nbaccel.training.pipeline_training",
    "is_rich_available": "nbaccel.training.availability",
    "utils": "nbaccel.utils",
    "progress": "nbaccel.rank.reporting",
    "log": "nbaccel.rank.reporting",
    "configure": "nbaccel.ui.config_panel",
    "hardware": "nbaccel.core.hardware",
}

__all__ = ["__version__", *_LAZY]


def __getattr__(name: str) -> Any:
    module_name = _LAZY.get(name)
    if module_name is None:
        raise AttributeError(f"module 'nbaccel' has no attribute {name!r}")
    module = importlib.import_module(module_name)
    value = module if module_name.rsplit(".", 1)[-1] == name else getattr(module, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


def _warm_up_in_kernel() -> bool:
    """Start the fork server now if this is an interactive kernel (not a rank, not a script);
    say whether it was started."""
    from nbaccel.core.config import ENV_LAUNCHER

    if os.environ.get("NBACCEL_NO_WARMUP") or os.environ.get(ENV_LAUNCHER):
        return False
    if "ipykernel" not in sys.modules:
        return False  # quick answer for scripts and ranks, without importing the kernel side
    from nbaccel.core.kernel import in_kernel

    if not in_kernel():
        return False
    try:
        from IPython import get_ipython

        from nbaccel.forkserver.server import SERVER

        SERVER.ensure()
        SERVER.follow_kernel(get_ipython())
    except Exception:  # noqa: BLE001 - warming up is an optimisation; the launch will retry
        return False
    return True


# What the first launch cell would otherwise import before it can paint anything (~0.6 s on a
# 2-core machine, mostly ipywidgets): imported in the background after ``import nbaccel``, so
# the import cell stays quick and the launch's view shows at once.
_KERNEL_SIDE = ("nbaccel.launchers", "nbaccel.ui.text", "ipywidgets", "nbaccel.ui.dashboard")


def _import_kernel_side() -> None:
    """Import ``_KERNEL_SIDE``; run in a thread started once ``import nbaccel`` is done."""
    for name in _KERNEL_SIDE:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - the launch imports them again and reports a failure
            return


def load_ipython_extension(ipython: Any) -> None:
    """``%load_ext nbaccel``: the ``%ranks``/``%%ranks`` magics for persistent ranks."""
    from nbaccel.persistent.magics import register

    register(ipython)


def _register_magics_in_ipython() -> None:
    """Make ``%ranks`` available after ``import nbaccel`` in IPython (never inside a rank)."""
    from nbaccel.core.config import ENV_LAUNCHER

    if os.environ.get(ENV_LAUNCHER) or "IPython" not in sys.modules:
        return
    try:
        from IPython import get_ipython

        shell = get_ipython()
        if shell is not None:
            load_ipython_extension(shell)
    except Exception:  # noqa: BLE001 - the magics are a convenience; import must not fail
        pass


_warmed_up = _warm_up_in_kernel()
_register_magics_in_ipython()
if _warmed_up:  # last, so the import itself does not share the interpreter with this thread
    import threading

    threading.Thread(target=_import_kernel_side, name="nbaccel-warm-up", daemon=True).start()
