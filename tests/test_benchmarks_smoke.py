"""The benchmark runner still runs end to end: ``python -m benchmarks --smoke`` into a temp folder.

One repetition with tiny step counts; only the shape of the results is checked (every section,
every contender with numbers or an explicit "unavailable" reason), never the speed.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from benchmarks.__main__ import SECTIONS as RUNNER_SECTIONS

pytestmark = pytest.mark.slow  # the whole benchmark runner, end to end

ROOT = Path(__file__).resolve().parent.parent
# The runner's own list; the GPU section is checked on its own (skipped where no GPU is).
SECTIONS = tuple(s for s in RUNNER_SECTIONS if s != "gpu")


def _has_number(entry: dict, keys: tuple[str, ...]) -> bool:
    for key in keys:
        value = entry.get(key)
        if isinstance(value, dict) and isinstance(value.get("median"), (int, float)):
            return True
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return True
    return False


NUMBER_KEYS = {
    "launch": ("first_launch_s",),
    "steps": ("steps_per_s",),
    "iopub": ("msgs_per_s", "bytes_per_s"),
    "failure": ("seconds",),
    "rss": ("growth_mib",),
    "reporting": ("us_per_call",),
    "transfer": ("argument_s", "result_s"),
    "scaling": ("first_launch_s",),
    "heavy": ("first_launch_s",),
    "restart_run_all": ("total_s",),
    "script": ("repeat_call_s",),
    "parallelism": ("samples_per_s",),
}


def test_smoke_run_writes_every_section(tmp_path):
    proc = subprocess.Popen(
        [sys.executable, "-m", "benchmarks", "--smoke", "--out", str(tmp_path)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        output, _ = proc.communicate(timeout=400)
    finally:
        if proc.poll() is None:  # never leave the runner (and its kernels) behind
            for child in psutil.Process(proc.pid).children(recursive=True):
                child.kill()
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, output[-5000:]

    results = json.loads((tmp_path / "latest.json").read_text())
    assert results["smoke"] is True
    assert results["machine"]["cores"] and results["machine"]["torch"]
    for section in SECTIONS:
        contenders = results[section]["contenders"]
        assert contenders, section
        for name, entry in contenders.items():
            if "unavailable" in entry:
                assert entry["unavailable"], f"{section}/{name}: unavailable without a reason"
                continue
            assert not entry.get("errors"), f"{section}/{name}: {entry['errors']}"
            assert _has_number(entry, NUMBER_KEYS[section]), f"{section}/{name}: {entry}"
    gpu = results["gpu"]
    assert gpu.get("skipped") or gpu.get("contenders")
    table = (tmp_path / "latest.md").read_text()
    assert "## 1." in table and "## 4b." in table and "## 8." in table and "## 9." in table
    assert "## 10." in table
    assert "## 1." in output  # the table is printed too
