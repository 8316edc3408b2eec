"""Shared test fixtures: every test is checked for processes it left behind."""

from __future__ import annotations

import os
import threading

import psutil
import pytest

# Long-lived processes that fixtures start on purpose (e.g. a Jupyter kernel shared by a test
# module); they and their own helpers are exempt from the leftover check. Kernel tests check the
# kernel's own children themselves.
LONG_LIVED: set[int] = set()
# Shutdowns of shared kernels still under way (``KernelSession(background_shutdown=True)``);
# the session waits for them before it ends, so no kernel outlives the run.
CLOSING_KERNELS: list[threading.Thread] = []

os.environ.setdefault("NBACCEL_NO_WARMUP", "1")  # tests start the fork server when they need it


def leftover_processes(
    root: psutil.Process | None = None, exempt: set[int] = frozenset()
) -> list[psutil.Process]:
    """Descendants of ``root`` (default: this process) that are neither nbaccel's helpers
    (fork server, resource tracker) nor exempt, nor below an exempt process."""
    from nbaccel.forkserver.server import SERVER

    root = root or psutil.Process()
    allowed = set(exempt) | LONG_LIVED
    if root.pid == os.getpid():
        allowed |= SERVER.helper_pids()
    left = []
    for child in root.children(recursive=False):
        if child.pid in allowed:
            continue
        try:
            if child.status() == psutil.STATUS_ZOMBIE:
                continue
        except psutil.NoSuchProcess:
            continue
        left.append(child)
    # Ranks are children of the fork server, so look below the helpers too.
    for helper in (psutil.Process(p) for p in allowed if psutil.pid_exists(p)):
        if helper.pid in LONG_LIVED:
            continue
        try:
            left += [
                c for c in helper.children(recursive=True) if c.status() != psutil.STATUS_ZOMBIE
            ]
        except psutil.NoSuchProcess:
            pass
    return left


@pytest.fixture(autouse=True)
def no_leftover_processes():
    yield
    left = leftover_processes()
    for p in left:  # clean up so one failure does not cascade into every later test
        try:
            p.kill()
        except psutil.Error:
            pass
    assert not left, (
        f"processes left running after the test: {[(p.pid, p.cmdline()) for p in left]}"
    )


def pytest_sessionfinish(session: pytest.Session) -> None:
    for closing in CLOSING_KERNELS:
        closing.join()
    CLOSING_KERNELS.clear()


@pytest.hookimpl(tryfirst=True)  # before ``-m`` deselects by marker
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark the notebooks that ``--nbval-lax`` collects from notebooks/ as slow (each runs in a
    real kernel), then run every fast test before the slow ones so a quick failure shows up
    first. The sort is stable: tests keep their order within each group, and so do a
    notebook's cells, which share one kernel."""
    for item in items:
        if item.path.suffix == ".ipynb":
            item.add_marker(pytest.mark.slow)
    items.sort(key=lambda item: item.get_closest_marker("slow") is not None)
