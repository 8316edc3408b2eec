"""Every public name keeps working, and ``import nbaccel`` stays light (inside a rank too)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

import nbaccel

# Names users import from ``nbaccel`` (README, notebooks, Accelerate ports). Removing one
# breaks somebody's notebook: add names here, never drop them without a deprecation.
PUBLIC = [
    "Accelerator",
    "ConfigError",
    "Launch",
    "LaunchConfig",
    "LaunchError",
    "LaunchStoppedError",
    "LaunchTimeoutError",
    "RankFailedError",
    "RayCluster",
    "Ranks",
    "configure",
    "hardware",
    "log",
    "notebook_launcher",
    "progress",
    "set_seed",
    "__version__",
]

KERNEL_SIDE = ("nbaccel.launch", "nbaccel.ui", "IPython", "ipywidgets", "ipykernel")


@pytest.mark.parametrize("name", PUBLIC)
def test_public_name_still_importable(name):
    assert name in dir(nbaccel)
    namespace: dict = {}
    exec(f"from nbaccel import {name}", namespace)
    assert namespace[name] is getattr(nbaccel, name)


@pytest.mark.parametrize("name", sorted(set(nbaccel.__all__) - set(PUBLIC)))
def test_every_newer_public_name_resolves(name):
    assert getattr(nbaccel, name) is not None


def test_unknown_name_says_so():
    with pytest.raises(AttributeError, match="no attribute 'notebook_launcer'"):
        nbaccel.notebook_launcer  # noqa: B018 - the typo is the point


def _loaded_after(code: str) -> list[str]:
    probe = (
        f"{code}\nimport sys, json\n"
        "print(json.dumps(sorted(m for m in sys.modules "
        "if m.startswith(('nbaccel', 'IPython', 'ipywidgets', 'ipykernel', 'torch')))))"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=120
    )
    return json.loads(out.stdout)


def test_import_nbaccel_loads_nothing_heavy():
    loaded = _loaded_after("import nbaccel")
    assert "torch" not in loaded
    assert not [m for m in loaded if m.startswith(KERNEL_SIDE)], loaded


def _modules_in_rank():
    import sys as _sys

    import nbaccel as _nb  # what a training function typically does first

    _nb.Accelerator  # noqa: B018 - load the training side as a real function would
    return sorted(_sys.modules)


@pytest.mark.slow
def test_a_rank_loads_no_kernel_side_module():
    loaded = nbaccel.notebook_launcher(_modules_in_rank, num_processes=1, progress=False)
    leaked = [m for m in loaded if m.startswith(KERNEL_SIDE)]
    assert not leaked, f"a rank loaded kernel-side modules: {leaked}"
    assert "nbaccel.training.accelerator" in loaded  # the probe did load the rank side
