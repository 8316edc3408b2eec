"""Fault injection: whatever goes wrong, and whenever, nothing a launch caused keeps running.

The full product is {stop pressed, kernel SIGKILL, launching script SIGTERM, rank SIGKILL, rank
segfault, timeout} x {server warming, ranks starting, running, returning} x {a subprocess, a
non-daemon multiprocessing child, DataLoader workers}, in a real kernel and in a plain script.
:data:`CASES` samples it so that every fault, every phase, every kind of descendant and both
places occur (each fault but the timeout in two or three phases; timeouts in a plain process
are also in test_containment.py), in about a minute on 2 busy cores (12 cases, 67 s measured).

Every case asserts by pid, system-wide: each rank, each descendant (pid and start time recorded
by the rank or the descendant itself) and, when the launching process dies, the fork server are
gone 5 s after the launch ended, wherever they were re-parented; no process anywhere carries the
case's argv marker; the error is the right one; and the kernel (or script) launches again.

The data side (full disk, full /dev/shm, killed save, corrupt file) is in
test_fault_matrix_data.py, in a kernel of its own.

Descendants ignore SIGTERM (so stopping them needs SIGKILL). In the "returning" phase the fault
is triggered by the descendants themselves when the rank, its result sent, stops them.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from pathlib import Path

import psutil
import pytest

from tests.kernel_helpers import KernelSession

pytestmark = pytest.mark.slow

# A descendant of the "subprocess" kind: a Python process that refuses SIGTERM.
SUBPROCESS = """import os, pathlib, signal, sys, time
d, fault, rank, rank_pid = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
def on_term(*_):
    pathlib.Path(d, "sigterm").touch()
    if rank == 1 and fault in ("rank_sigkill", "rank_segfault"):
        os.kill(rank_pid, signal.SIGKILL if fault == "rank_sigkill" else signal.SIGSEGV)
signal.signal(signal.SIGTERM, on_term)
pathlib.Path(d, f"ready-{os.getpid()}").touch()
while True:
    time.sleep(0.05)
"""

# What a notebook would define in its cells; run in the kernel and in the script alike.
WORKLOAD = textwrap.dedent('''
    import ctypes, functools, multiprocessing, os, pathlib, signal, subprocess, sys, time
    import psutil, torch
    import nbaccel
    from torch.utils.data import DataLoader, Dataset

    def _record(d, name, pid):
        created = psutil.Process(pid).create_time()
        pathlib.Path(d, f"{name}-{pid}.pid").write_text(repr(created))

    def _mark(d, name):
        pathlib.Path(d, name).touch()

    def _on_sigterm(d, fault, rank, rank_pid, *_):
        """A descendant asked to stop: say so, refuse, and (returning phase) hit the rank."""
        _mark(d, "sigterm")
        if rank == 1 and fault == "rank_sigkill":
            os.kill(rank_pid, signal.SIGKILL)
        elif rank == 1 and fault == "rank_segfault":
            os.kill(rank_pid, signal.SIGSEGV)

    def _mp_child(d, fault, rank, rank_pid):
        signal.signal(signal.SIGTERM, functools.partial(_on_sigterm, d, fault, rank, rank_pid))
        _record(d, f"mp{rank}", os.getpid())
        while True:
            time.sleep(0.05)

    def _dl_init(d, fault, rank, rank_pid, worker_id):
        signal.signal(signal.SIGTERM, functools.partial(_on_sigterm, d, fault, rank, rank_pid))
        _record(d, f"dl{rank}", os.getpid())

    class Sq(Dataset):
        def __len__(self):
            return 1000
        def __getitem__(self, i):
            return torch.tensor([i * i])

    SUBPROCESS = None  # set below: its lines start at column 0

    def _start_descendants(d, kind, fault, rank, marker):
        me = os.getpid()
        expected = 2 if kind == "dataloader" else 1
        if kind == "subprocess":
            p = subprocess.Popen([sys.executable, "-c", SUBPROCESS, d, fault, str(rank), str(me), marker])
            _record(d, f"sub{rank}", p.pid)
            while not pathlib.Path(d, f"ready-{p.pid}").exists():
                time.sleep(0.01)
        elif kind == "mp":
            multiprocessing.Process(target=_mp_child, args=(d, fault, rank, me)).start()
        else:
            init = functools.partial(_dl_init, d, fault, rank, me)
            loader = DataLoader(Sq(), num_workers=2, collate_fn=lambda b: torch.stack(b),
                                worker_init_fn=init)
            _start_descendants.keep = iter(loader)
            next(_start_descendants.keep)
        prefix = {"subprocess": "sub", "mp": "mp", "dataloader": "dl"}[kind] + f"{rank}-"
        while len([f for f in os.listdir(d) if f.startswith(prefix)]) < expected:
            time.sleep(0.01)

    def _hit_or_block(d, phase, fault, rank, collective=None):
        _mark(d, f"{phase}-{rank}")
        if rank == 1 and fault == "rank_sigkill":
            os.kill(os.getpid(), signal.SIGKILL)
        if rank == 1 and fault == "rank_segfault":
            ctypes.string_at(0)
        while True:
            if collective is not None:
                collective()
            time.sleep(0.05)

    def work(d, phase, fault, kind, marker):
        import torch.distributed as dist
        rank = int(os.environ["RANK"])
        _record(d, "rank", os.getpid())
        pathlib.Path(d, f"server-{os.getppid()}.srv").touch()
        _start_descendants(d, kind, fault, rank, marker)
        if phase == "starting":
            _hit_or_block(d, phase, fault, rank)
        dist.init_process_group("gloo")
        dist.barrier()
        if phase == "running":
            t = torch.zeros(1)
            _hit_or_block(d, phase, fault, rank, lambda: dist.all_reduce(t))
        return rank

    def seven():
        return 7

    def launch(d, phase, fault, kind, marker, timeout=None, preload=()):
        _mark(d, "called")
        return nbaccel.notebook_launcher(work, args=(d, phase, fault, kind, marker),
                                         num_processes=2, timeout=timeout, preload=preload)
''').replace(
    "SUBPROCESS = None  # set below: its lines start at column 0", f"SUBPROCESS = {SUBPROCESS!r}"
)

SCRIPT = WORKLOAD + textwrap.dedent("""
    if __name__ == "__main__":
        d, phase, fault, kind, marker, timeout = sys.argv[1:7]
        try:
            launch(d, phase, fault, kind, marker, timeout=float(timeout) or None)
            print("RESULT ok", flush=True)
        except BaseException as exc:
            import traceback
            text = "".join(traceback.format_exception(exc))
            print("RESULT", type(exc).__name__, flush=True)
            print(text, flush=True)
        print("NEXT", nbaccel.notebook_launcher(seven, num_processes=2), flush=True)
""")

# (fault, phase, kind, where): every fault, phase, kind and place at least once.
CASES = [
    ("stop", "warming", "subprocess", "kernel"),
    ("stop", "running", "dataloader", "kernel"),
    ("stop", "returning", "mp", "script"),
    ("kernel_sigkill", "returning", "dataloader", "kernel"),
    ("kernel_sigkill", "starting", "subprocess", "kernel"),
    ("script_sigterm", "warming", "subprocess", "script"),
    ("script_sigterm", "running", "dataloader", "script"),
    ("rank_sigkill", "starting", "dataloader", "kernel"),
    ("rank_sigkill", "returning", "subprocess", "kernel"),
    ("rank_segfault", "running", "subprocess", "script"),
    ("rank_segfault", "returning", "mp", "kernel"),
    ("timeout", "starting", "mp", "kernel"),
]
TIMEOUT = 5.0  # the launch's timeout= in the timeout cases

# The headline names the rank that was hit, before rank 0's connection error it caused.
EXPECTED_TEXT = {
    "stop": "launch interrupted",
    "rank_sigkill": "rank 1 (of 2) was killed by signal SIGKILL",
    "rank_segfault": "rank 1 (of 2) was killed by signal SIGSEGV",
    "timeout": "the launch did not finish within timeout=",
}
EXPECTED_ERROR = {
    "stop": "KeyboardInterrupt",
    "rank_sigkill": "RankFailedError",
    "rank_segfault": "RankFailedError",
    "timeout": "LaunchTimeoutError",
}


def trigger_reached(d: Path, phase: str, launcher: int | None = None) -> bool:
    """Whether the launch is where the fault should hit now ("warming": ``launcher`` has a
    fork server that is still importing)."""
    if phase == "warming":
        called = d / "called"
        if not called.exists():
            return False
        for child in psutil.Process(launcher).children():
            try:
                # Not serving yet: the new one (one replaced for this launch serves to the end).
                if is_fork_server(child) and not serving(child):
                    return True
            except psutil.Error:  # a child that came and went (exec, a helper)
                pass
        return False
    if phase == "returning":
        return (d / "sigterm").exists()
    return all((d / f"{phase}-{rank}").exists() for rank in (0, 1))


def wait_for(condition, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "the launch never reached the phase"
        time.sleep(0.02)


def still_running(d: Path, marker: str, pattern: str = "*.pid") -> list[tuple[int, str]]:
    """Recorded processes (same pid and start time) or marked ones that run, anywhere."""
    left = []
    for f in d.glob(pattern):
        pid = int(f.stem.rsplit("-", 1)[1])
        try:
            p = psutil.Process(pid)
            same = f.suffix == ".srv" or abs(p.create_time() - float(f.read_text())) < 0.01
            if same and p.status() != psutil.STATUS_ZOMBIE:
                left.append((pid, f"{f.name}: {' '.join(p.cmdline())[:100]}"))
        except (psutil.NoSuchProcess, ValueError):
            pass
    for p in psutil.process_iter(["cmdline"]):
        if marker in (p.info["cmdline"] or []) and p.pid != os.getpid():
            left.append((p.pid, "marked"))
    return left


def assert_nothing_left(d: Path, marker: str, with_server: bool = False) -> None:
    deadline = time.monotonic() + 5
    patterns = ["*.pid", "*.srv"] if with_server else ["*.pid"]
    while True:
        left = [x for pattern in patterns for x in still_running(d, marker, pattern)]
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    for pid, _ in left:  # a failure must not leak them into later tests
        try:
            psutil.Process(pid).kill()
        except psutil.Error:
            pass
    assert left == [], f"still running 5 s after the launch ended: {left}"


def is_fork_server(process: psutil.Process) -> bool:
    """A fresh-interpreter fork server (its command line) or a fork of the kernel (its title)."""
    command = " ".join(process.cmdline())
    return "multiprocessing.forkserver" in command or command.startswith("nbaccel fork server")


def serving(process: psutil.Process) -> bool:
    """Whether ``process`` is a fork server that has finished importing: its loop catches
    SIGCHLD (Linux: the SigCgt mask in /proc), which nothing does while it imports."""
    try:
        if not is_fork_server(process):
            return False
        status = Path(f"/proc/{process.pid}/status").read_text()
    except (psutil.Error, OSError):
        return False
    caught = int(next(x for x in status.splitlines() if x.startswith("SigCgt:")).split()[1], 16)
    return bool(caught & (1 << (signal.SIGCHLD - 1)))


def record_server(d: Path, parent: int) -> None:
    """Note the fork server of ``parent`` (it must be gone too once its launcher died); during
    "warming" it may take a moment to appear."""
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        for child in psutil.Process(parent).children():
            if is_fork_server(child):
                (d / f"server-{child.pid}.srv").touch()
                return
        time.sleep(0.02)
    raise AssertionError("the launching process has no fork server")


def fire_when(d: Path, phase: str, action, launcher: int | None = None) -> threading.Thread:
    def run():
        wait_for(lambda: trigger_reached(d, phase, launcher))
        if phase == "warming":
            time.sleep(0.3)  # past starting the server: the launch waits for it to import
        action()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


@pytest.fixture(scope="module")
def kernel():
    with KernelSession(
        env={"NBACCEL_VIEW": "text"}, startup=WORKLOAD, background_shutdown=True
    ) as k:
        yield k


def case_id(case: tuple[str, str, str, str]) -> str:
    return "-".join(case)


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_fault(case, tmp_path, request):
    fault, phase, kind, where = case
    marker = f"nbaccel-fault-{uuid.uuid4().hex}"
    if where == "script":
        run_in_script(fault, phase, kind, tmp_path, marker)
    elif fault == "kernel_sigkill":
        run_and_kill_kernel(phase, kind, tmp_path, marker)
    else:
        run_in_kernel(request.getfixturevalue("kernel"), fault, phase, kind, tmp_path, marker)


def run_in_kernel(kernel, fault, phase, kind, d: Path, marker: str) -> None:
    # A server started afresh for this launch is still importing when the launch begins.
    preload = ("nbaccel_fault_warm_" + uuid.uuid4().hex[:8],) if phase == "warming" else ()
    if preload:
        (d / f"{preload[0]}.py").write_text("")
        kernel.execute(f"sys.path.insert(0, {str(d)!r})")
    if fault == "stop":
        fire_when(d, phase, kernel.interrupt, kernel.pid)
    timeout = TIMEOUT if fault == "timeout" else None
    cell = kernel.execute(
        f"launch({str(d)!r}, {phase!r}, {fault!r}, {kind!r}, {marker!r}, "
        f"timeout={timeout!r}, preload={preload!r})"
    )
    assert cell.error is not None, "the launch should have failed"
    if phase == "warming":  # Stop did not wait for the server to finish importing
        assert not any(serving(p) for p in psutil.Process(kernel.pid).children()), cell.error_text
    assert cell.error["ename"] == EXPECTED_ERROR[fault], cell.error_text
    assert cell.error["evalue"].startswith(EXPECTED_TEXT[fault]), cell.error_text
    assert "multiprocessing/" not in cell.error_text, cell.error_text  # nor in crash reports
    assert_phase_reached(d, fault, phase)
    assert_nothing_left(d, marker)
    assert kernel.leftovers() == []
    again = kernel.execute("nbaccel.notebook_launcher(seven, num_processes=2)")
    assert again.error is None, again.error_text
    assert again.results[-1]["text/plain"] == "7"


def run_and_kill_kernel(phase, kind, d: Path, marker: str) -> None:
    with KernelSession(env={"NBACCEL_VIEW": "text"}, startup=WORKLOAD) as kernel:
        assert os.getpgid(kernel.pid) == kernel.pid  # Jupyter gives a kernel its own group
        kernel.client.execute(
            f"launch({str(d)!r}, {phase!r}, 'kernel_sigkill', {kind!r}, {marker!r})"
        )
        wait_for(lambda: trigger_reached(d, phase))
        record_server(d, kernel.pid)
        os.killpg(kernel.pid, signal.SIGKILL)  # the kernel and its group, as a restart does
        kernel.manager.provisioner.process.wait()
        assert_nothing_left(d, marker, with_server=True)


def run_in_script(fault, phase, kind, d: Path, marker: str) -> None:
    script = d / "launch.py"
    script.write_text(SCRIPT)
    timeout = TIMEOUT if fault == "timeout" else 0
    env = {**os.environ, "PYTHONPATH": os.getcwd(), "PYTHONUNBUFFERED": "1"}
    driver = subprocess.Popen(
        [sys.executable, str(script), str(d), phase, fault, kind, marker, str(timeout)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        start_new_session=True,  # like a script started from a terminal: its own group
    )
    try:
        if fault == "stop":
            fire_when(d, phase, lambda: os.kill(driver.pid, signal.SIGINT), driver.pid).join(120)
        elif fault == "script_sigterm":

            def terminate() -> None:
                record_server(d, driver.pid)
                os.killpg(driver.pid, signal.SIGTERM)

            fire_when(d, phase, terminate, driver.pid).join(120)
        out, _ = driver.communicate(timeout=120)
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.wait()
    if fault == "script_sigterm":
        assert driver.returncode == -signal.SIGTERM, out
        assert_nothing_left(d, marker, with_server=True)
        return
    assert f"RESULT {EXPECTED_ERROR[fault]}" in out, out
    assert f"{EXPECTED_ERROR[fault]}: {EXPECTED_TEXT[fault]}" in out, out
    assert "multiprocessing/" not in out.split("RESULT", 1)[1].split("NEXT")[0], out
    assert "NEXT 7" in out, out
    assert_phase_reached(d, fault, phase)
    assert_nothing_left(d, marker, with_server=True)


def assert_phase_reached(d: Path, fault: str, phase: str) -> None:
    """The fault hit where it was meant to: no rank had started during "warming"; otherwise the
    phase's marker exists, of the rank that hit itself (rank 1: rank 0 may be stopped before it
    gets there) or of rank 0."""
    if phase == "warming":
        assert not list(d.glob("rank-*.pid")), "a rank started before the stop took effect"
    else:
        hit = 1 if fault.startswith("rank_") else 0
        assert trigger_reached(d, phase) or (d / f"{phase}-{hit}").exists()
