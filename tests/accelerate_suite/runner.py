"""Run a case (see ``cases``) with nbaccel or with Accelerate itself, and say what happened.

Rank cases launch ``run_in_rank`` on 2 CPU ranks with ``nbaccel.notebook_launcher``, for both
libraries (Accelerate's ranks get ``ACCELERATE_USE_CPU=true``, its own 2-CPU mode). Kernel cases
(``test_notebook.py``: the script itself calls ``notebook_launcher``) run in a fresh Python
process with ``ACCELERATE_NUM_PROCESSES=2``, as Accelerate's CI runs that script.

``python -m tests.accelerate_suite [nbaccel|accelerate|both] [CASE_ID ...]`` runs every case (or
the cases named), one launch each, and prints the Markdown table kept in
``docs/accelerate_suite.md`` (only the rows and totals of the cases run).
"""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
import time
from typing import Any

from tests.accelerate_suite.cases import CASES, Case
from tests.accelerate_suite.redirect import load_script

LAUNCH_TIMEOUT = 60.0  # a rank case; the slowest here take ~10 s on 2 busy cores
KERNEL_TIMEOUT = 180.0  # a test_notebook case: Accelerate's fault-tolerance case relaunches 3 x
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _resolve(token: Any, module: Any) -> Any:
    if token == "accelerator":
        return module.Accelerator()
    if token == "datasets.Dataset":
        from datasets import Dataset

        return Dataset
    return token


def cpu_reference_ddp() -> None:
    """Let a script's own reference ``DistributedDataParallel(..., device_ids=[rank])`` run on
    CPU, where torch refuses ``device_ids`` for CPU modules (``test_ddp_comm_hook`` is written
    for GPUs). Only in this rank process, which runs one case and ends."""
    import torch

    original = torch.nn.parallel.DistributedDataParallel

    class CpuDDP(original):
        def __init__(self, module: Any, *args: Any, **kwargs: Any) -> None:
            if all(p.device.type == "cpu" for p in module.parameters()):
                kwargs.pop("device_ids", None)
                kwargs.pop("output_device", None)
            super().__init__(module, *args, **kwargs)

    torch.nn.parallel.DistributedDataParallel = CpuDDP


def run_case(lib: str, case: Case) -> None:
    """Run ``case`` in this process (a rank, or the kernel for kernel cases); raises on failure."""
    if case.cpu_ddp:
        cpu_reference_ddp()
    module = load_script(case.script, lib)
    if case.args is not None:
        module.Accelerator()  # as main() starts: later calls may read the shared state
        getattr(module, case.function)(*(_resolve(a, module) for a in case.args))
        return
    entry = module.main
    if case.function != "main":
        ran = _silence_others(module, case)
        entry()
        if not ran:
            raise AssertionError(f"main() never called {case.function} (call {case.occurrence})")
    else:
        entry()


def _silence_others(module: Any, case: Case) -> list[bool]:
    """Make the script's other test functions no-ops; return a flag set once ``case`` ran."""
    ran: list[bool] = []
    names = {c.function for c in CASES if c.script == case.script and c.args is None}
    for name in names:
        original = getattr(module, name)
        calls = [0]

        def wrapper(*args: Any, _f=original, _n=name, _c=calls, **kwargs: Any) -> Any:
            index = _c[0]
            _c[0] += 1
            if _n == case.function and index == case.occurrence:
                ran.append(True)
                return _f(*args, **kwargs)
            return None

        setattr(module, name, wrapper)
    return ran


def not_applicable(case: Case) -> str:
    """Why ``case`` is not run here ("" when it is)."""
    if case.na:
        return case.na
    if case.needs and importlib.util.find_spec(case.needs) is None:
        return f"needs {case.needs}, which is not installed"
    return ""


def _environment(lib: str) -> dict[str, str]:
    env = {"ACCELERATE_USE_CPU": "true"} if lib == "accelerate" else {}
    return env


def launch(lib: str, case: Case) -> str:
    """Run ``case`` with ``lib`` the way the suite does; ``"pass"`` or ``"fail: <why>"``."""
    if case.where == "kernel":
        return _in_fresh_process(lib, case)
    import nbaccel

    try:
        nbaccel.notebook_launcher(
            run_case,
            args=(lib, case),
            num_processes=2,
            progress=False,
            timeout=LAUNCH_TIMEOUT,
            env=_environment(lib),
            # The fork server imports Accelerate's fixtures once, not every rank of every case.
            preload=("accelerate.test_utils",),
        )
    except Exception as exc:  # noqa: BLE001 - the outcome is the report
        return "fail: " + _first_line(exc)
    return "pass"


def _first_line(exc: BaseException) -> str:
    original = getattr(exc, "original", None) or exc
    text = f"{type(original).__name__}: {original}".strip()
    return text.splitlines()[0][:200] if text else type(exc).__name__


def _in_fresh_process(lib: str, case: Case) -> str:
    env = {**os.environ, "ACCELERATE_NUM_PROCESSES": "2", **_environment(lib)}
    code = (
        "import sys; from tests.accelerate_suite.runner import run_case, CASES; "
        f"run_case({lib!r}, next(c for c in CASES if c.id == {case.id!r}))"
    )
    # Its own session, so a timeout stops the ranks the script's launcher started too.
    child = subprocess.Popen(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        _, stderr = child.communicate(timeout=KERNEL_TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(child.pid, signal.SIGKILL)
        child.communicate()
        return f"fail: no result within {KERNEL_TIMEOUT:.0f} s"
    if child.returncode == 0:
        return "pass"
    lines = [line for line in stderr.splitlines() if line.strip()]
    return "fail: " + (lines[-1][:200] if lines else f"exit code {child.returncode}")


def table(libs: list[str], only: list[str] | None = None) -> str:
    """Run every case (those whose ids are in ``only``) with each of ``libs``; the Markdown
    table and the totals."""
    unknown = set(only or ()) - {c.id for c in CASES}
    if unknown:
        raise SystemExit(f"no such case: {', '.join(sorted(unknown))}")
    rows, totals = [], {lib: {"pass": 0, "fail": 0, "n/a": 0} for lib in libs}
    note = {c.id: c.differs for c in CASES}
    for case in [c for c in CASES if not only or c.id in only]:
        why = not_applicable(case)
        cells = []
        for lib in libs:
            started = time.monotonic()
            outcome = "n/a" if why else launch(lib, case)
            kind = outcome.split(":")[0]
            totals[lib][kind] += 1
            cells.append(outcome.replace("|", "/"))
            print(
                f"{case.id} {lib}: {outcome} ({time.monotonic() - started:.1f} s)", file=sys.stderr
            )
        reason = why or (f"nbaccel differs: {note[case.id]}" if note[case.id] else "")
        rows.append(f"| `{case.id}` | " + " | ".join(cells) + f" | {reason} |")
    head = "| case | " + " | ".join(libs) + " | not applicable / deliberate difference |\n"
    head += "|---" * (len(libs) + 2) + "|\n"
    sums = "; ".join(
        f"{lib}: {t['pass']} pass, {t['fail']} fail, {t['n/a']} not applicable"
        for lib, t in totals.items()
    )
    return head + "\n".join(rows) + f"\n\nTotals — {sums}.\n"
