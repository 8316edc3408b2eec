"""nbaccel as a user from a package index meets it: the sdist built from this checkout, the
wheel built from that sdist (as ``python -m build`` does), installed alone in a fresh virtual
environment (its runtime requirements, under constraints.txt's pins: torch's CPU wheel from the
machine's wheel folder where pip finds one), then ``nbaccel demo`` and a kernel of that
environment launching ranks. Nothing of this checkout is on that environment's path."""

from __future__ import annotations

import email
import os
import subprocess
import sys
import tarfile
import textwrap
import venv
import zipfile
from pathlib import Path

import pytest

from tests.kernel_helpers import KernelSession

pytestmark = [
    pytest.mark.slow,  # a venv, an install, a demo and a kernel (~1 min; minutes under load)
    pytest.mark.timeout(900),  # the module's install counts towards its first test
]

REPO = Path(__file__).resolve().parent.parent

BUILD = """
import sys
import setuptools.build_meta as backend
print(getattr(backend, sys.argv[1])(sys.argv[2]))
"""


def _build(step: str, source: Path, out: Path) -> Path:
    """``build_sdist``/``build_wheel`` of setuptools' PEP 517 backend, run in ``source``."""
    done = subprocess.run(
        [sys.executable, "-c", BUILD, step, str(out)],
        cwd=source,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return out / done.stdout.strip().splitlines()[-1]


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> dict[str, Path]:
    """The sdist, the wheel built from it, and the fresh venv it was installed into."""
    work = tmp_path_factory.mktemp("wheel")
    sdist = _build("build_sdist", REPO, work)
    with tarfile.open(sdist) as tar:
        tar.extractall(work / "unpacked", filter="data")
    (unpacked,) = (work / "unpacked").iterdir()
    wheel = _build("build_wheel", unpacked, work)
    env_dir = work / "venv"
    venv.create(env_dir, with_pip=True)
    python = env_dir / "bin" / "python"
    # --no-compile: no .pyc for torch's thousands of modules (a third of the install's time)
    pip = [str(python), "-m", "pip", "install", "--quiet", "--no-compile"]
    done = subprocess.run(
        [*pip, "-c", str(REPO / "constraints.txt"), str(wheel)],
        cwd=work,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return {"sdist": sdist, "wheel": wheel, "venv": env_dir, "python": python}


def test_the_wheel_carries_its_package_data_metadata_and_command(installed):
    with zipfile.ZipFile(installed["wheel"]) as wheel:
        names = wheel.namelist()
        (metadata,) = [n for n in names if n.endswith(".dist-info/METADATA")]
        meta = email.message_from_bytes(wheel.read(metadata))
        (entry_points,) = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
        scripts = wheel.read(entry_points).decode()
    assert "nbaccel/py.typed" in names  # PEP 561: type checkers read nbaccel's annotations
    assert not [n for n in names if n.startswith(("tests/", "benchmarks/", "notebooks/"))]
    assert meta["Name"] == "nbaccel" and meta["Requires-Python"] == ">=3.10"
    assert any(r.startswith("torch") for r in meta.get_all("Requires-Dist"))
    assert "nbaccel = nbaccel.cli.main:main" in scripts
    # What the installed environment reports: its own nbaccel, not this checkout's.
    probe = textwrap.dedent("""
        import importlib.metadata as m, nbaccel, os, sys
        print(os.path.dirname(nbaccel.__file__))
        print(m.version("nbaccel"))
        print(os.path.exists(os.path.join(os.path.dirname(nbaccel.__file__), "py.typed")))
        import torch; print(torch.__version__)
    """)
    lines = subprocess.run(
        [str(installed["python"]), "-c", probe],
        cwd=installed["venv"],
        capture_output=True,
        text=True,
        check=True,
        env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"},
    ).stdout.splitlines()
    assert lines[0].startswith(str(installed["venv"])), lines
    assert lines[1] == meta["Version"] and lines[2] == "True", lines
    if sys.version_info[:2] == (3, 11):  # the machine's CPU wheel, as constraints.txt intends
        assert lines[3] == "2.13.0+cpu", lines


def test_nbaccel_demo_runs_from_the_installed_command(installed):
    done = subprocess.run(
        [str(installed["venv"] / "bin" / "nbaccel"), "demo", "--steps", "20"],
        cwd=installed["venv"],
        capture_output=True,
        text=True,
        timeout=180,
        env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"},
    )
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert any(line.startswith("[rank1] data: ") for line in lines), done.stdout
    assert "result from rank 0: {'world_size': 2, 'steps': 20" in done.stdout


def test_a_kernel_of_the_installed_environment_launches_ranks(installed):
    with KernelSession(python=str(installed["python"]), background_shutdown=True) as kernel:
        cell = kernel.execute(
            "import nbaccel, os\n"
            "def where():\n"
            "    import nbaccel\n"
            "    return os.environ['RANK'], nbaccel.__file__\n"
            "print(nbaccel.__file__)\n"
            "print(nbaccel.notebook_launcher(where, num_processes=2, return_all=True))"
        )
        assert cell.error is None, cell.error_text
        site = str(installed["venv"])
        first, result = cell.stdout.splitlines()[0], cell.stdout.splitlines()[-1]
        assert first.startswith(site), cell.stdout
        assert result.count(site) == 2 and "'0'" in result and "'1'" in result, cell.stdout
