"""Shared test fixtures: every test is checked for processes it left behind."""

from __future__ import annotations

import os
import signal
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

# Tests press Ctrl-C (SIGINT) in this process and in the kernels, scripts and xdist workers it
# starts. A shell without job control starts a background job (`bash scripts/test.sh &`) with
# SIGINT ignored, an exec keeps it ignored, and Python then never installs its handler: Ctrl-C
# would do nothing in them. Give them what a terminal gives.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


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


# pytest-xdist (``scripts/test.sh`` runs the suite on two workers, ``--dist loadfile``) hands
# out whole files. Files that touch something machine-wide run on one worker, one after the
# other, as one unit: the network tests add namespaces, veth links and addresses (Ray and the
# rendezvous tests read the machine's interfaces; a Ray node's startup retry kills by folder),
# and each browser test runs JupyterLab and Chromium with waits sized for one at a time.
RUN_TOGETHER = {
    "tests/test_multihost.py": "network",
    "tests/test_ray_cluster.py": "network",
    "tests/test_rendezvous_exposure.py": "network",
    "tests/test_browser.py": "browser",
    "tests/test_browser_background.py": "browser",
    "tests/test_browser_debug.py": "browser",
    "tests/test_browser_ranks.py": "browser",
    "tests/test_browser_notebook7.py": "browser",
}
# The longest units (from a serial run's durations, longest first) are handed out first, so the
# run does not end with one worker on a long file while the other idles. Only the order of the
# work depends on it: a stale entry costs balance, never a test.
LONGEST_FIRST = (
    "network",
    "browser",
    "tests/test_forkserver_mirror.py",
    "tests/test_benchmarks_smoke.py",
    "tests/test_cli_launch.py",
    "tests/test_accelerate_suite.py",
    "tests/test_fault_matrix.py",
    "tests/test_mirror_contract.py",
    "tests/test_deepspeed_training.py",
    "tests/test_ranks_magics.py",
    "tests/test_parallelism.py",
)


def work_unit(nodeid: str) -> str:
    """The unit of work a test belongs to under ``--dist loadfile``: its file, or its group.

    >>> work_unit("tests/test_ray_cluster.py::test_x"), work_unit("tests/test_units.py::test_y")
    ('network', 'tests/test_units.py')
    """
    path = nodeid.split("::", 1)[0]
    return RUN_TOGETHER.get(path, path)


def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object | None:
    """``--dist loadfile`` with the groups of :data:`RUN_TOGETHER` as single units."""
    if config.getoption("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ByFileAndGroup(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return work_unit(nodeid)

    config.option.loadscopereorder = False  # the order the workers collected: longest first
    return ByFileAndGroup(config, log)


@pytest.hookimpl(tryfirst=True)  # before ``-m`` deselects by marker
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark the notebooks that ``--nbval-lax`` collects from notebooks/ as slow (each runs in a
    real kernel), then run every fast test before the slow ones so a quick failure shows up
    first (on xdist's workers, the longest units first instead). The sort is stable: tests
    keep their order within each group, and so do a notebook's cells, which share one kernel."""
    for item in items:
        if item.path.suffix == ".ipynb":
            item.add_marker(pytest.mark.slow)
    items.sort(key=lambda item: item.get_closest_marker("slow") is not None)
    if os.environ.get("PYTEST_XDIST_WORKER"):
        rank = {unit: i for i, unit in enumerate(LONGEST_FIRST)}
        items.sort(key=lambda item: rank.get(work_unit(item.nodeid), len(rank)))
