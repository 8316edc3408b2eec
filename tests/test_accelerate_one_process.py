"""``notebook_launcher(fn, num_processes=1)``: Accelerate calls ``fn`` in the kernel, nbaccel in
a worker process (so the kernel never initializes CUDA and can launch N processes later). What a
user of Accelerate's tutorial pattern (appending to a list of the notebook's) sees with each:
the list fills under Accelerate, stays empty under nbaccel, and the value ``fn`` returns is the
way that works with both."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytest.importorskip("accelerate")
pytestmark = pytest.mark.slow  # a fresh interpreter per library, one launch each

TUTORIAL = """
import importlib, sys
lib = importlib.import_module(sys.argv[1])
results = []

def training_function():
    accelerator = lib.Accelerator(cpu=True)
    results.append(accelerator.process_index)   # the tutorial's pattern
    return "returned"

returned = lib.notebook_launcher(training_function, num_processes=1)
print(repr((results, returned)))
"""


def test_the_tutorials_results_list_under_each_library(tmp_path):
    seen = {}
    for lib in ("accelerate", "nbaccel"):
        run = subprocess.run(
            [sys.executable, "-c", TUTORIAL, lib],
            capture_output=True,
            text=True,
            cwd=tmp_path,
            timeout=300,
        )
        assert run.returncode == 0, run.stderr[-2000:]
        seen[lib] = run.stdout.strip().splitlines()[-1]
    assert seen["accelerate"] == "([0], None)"  # called in the notebook: the list fills
    assert seen["nbaccel"] == "([], 'returned')"  # a worker's list; the return value comes back
