"""Shared machinery of the benchmark sections: kernels, the contenders' launch cells, statistics.

Every contender is launched from a cell of a real ipykernel driven through jupyter_client
(``tests.kernel_helpers.KernelSession``), calling its launcher the way its documentation shows,
on the same ``benchmarks.workload.train``. Each launch gets a fresh output folder where the ranks
write their records; the cell prints one ``@@BENCH`` line with the kernel's wall-clock time just
before and just after the launcher call.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import platform
import shutil
import statistics
import subprocess
import tempfile
import textwrap
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from benchmarks.workload import read_ranks
from tests.kernel_helpers import Cell, KernelSession

ROOT = Path(__file__).resolve().parent.parent
MARK = "@@BENCH "

# How each contender is imported (in the kernel's first cell, outside any timing) and called.
IMPORTS = {
    "nbaccel": "import nbaccel",
    "accelerate": "from accelerate import notebook_launcher as accelerate_launcher",
    "mp_fork": "import torch.multiprocessing as mp",
    "mp_spawn": "import torch.multiprocessing as mp",
    "torchrun": "import subprocess",
    "no_launcher": "",
}
LAUNCH = {
    "nbaccel": "nbaccel.notebook_launcher(W.train, args=(_cfg,), num_processes={world}{kw})",
    "accelerate": (
        "accelerate_launcher(W.train, args=(_cfg,), num_processes={world}, "
        "use_port=str(W.free_port()){kw})"
    ),
    "mp_fork": (
        "_cfg.update(world_size={world}, port=W.free_port())\n"
        "mp.start_processes(W.train_indexed, args=(_cfg,), nprocs={world}, start_method='fork')"
    ),
    "mp_spawn": (
        "_cfg.update(world_size={world}, port=W.free_port())\n"
        "mp.start_processes(W.train_indexed, args=(_cfg,), nprocs={world}, start_method='spawn')"
    ),
    "torchrun": (
        "subprocess.run([sys.executable, '-m', 'torch.distributed.run', "
        "'--nproc-per-node={world}', '--master-addr=127.0.0.1', "
        "f'--master-port={{W.free_port()}}', '-m', 'benchmarks.workload', json.dumps(_cfg)], "
        "check=True)"
    ),
    # The floor: the kernel imports what the first step imports, the fastest way known here (the
    # collector paused, as nbaccel's fork server does), then runs the same function itself.
    "no_launcher": (
        "import gc\ngc.freeze()\ngc.disable()\nimport torch.distributed, torch._dynamo\n"
        "gc.enable()\n_cfg.update(world_size=1, port=W.free_port())\nW.train_indexed(0, _cfg)"
    ),
}
# Human-readable call, for the results table and README.
CALLS = {
    "nbaccel": "nbaccel.notebook_launcher(train, args, num_processes=2)",
    "accelerate": "accelerate.notebook_launcher(train, args, num_processes=2, use_port=<free>)",
    "mp_fork": "torch.multiprocessing.start_processes(train, nprocs=2, start_method='fork')",
    "mp_spawn": "torch.multiprocessing.start_processes(train, nprocs=2, start_method='spawn')",
    "torchrun": "subprocess.run(['python', '-m', 'torch.distributed.run', '--nproc-per-node=2', "
    "'--master-port=<free>', '-m', 'benchmarks.workload', cfg])",
    "no_launcher": "train_indexed(0, cfg) in the kernel itself, world size 1 (no launcher: the "
    "floor)",
}
STARTUP = "import json, os, sys, time\nimport torch\nimport benchmarks.workload as W\n"


def unavailable_reason(contender: str) -> str | None:
    """Why a contender cannot run here (a missing optional package), or None."""
    needs = {"accelerate": "accelerate", "accelerate_tqdm": "accelerate"}
    package = needs.get(contender)
    if package and importlib.util.find_spec(package) is None:
        return f"{package} is not installed (pip install -c constraints.txt accelerate tqdm)"
    if contender.startswith("nbaccel_") or contender == "nbaccel_acc":
        try:
            from nbaccel import Accelerator  # noqa: F401
        except Exception as exc:  # noqa: BLE001 - any import failure makes it unavailable
            return f"nbaccel.Accelerator is not importable: {type(exc).__name__}: {exc}"
    return None


# A smoke run checks the wiring, not what a fresh kernel costs (its numbers mean nothing): there
# the sections share one kernel per environment instead of starting ~11 (seconds each on two
# cores). Every section's cells and every contender's launch still run, in that one kernel.
_shared: dict[str, Any] | None = None  # environment (as JSON) -> its kernel, while sharing
_shared_stack = contextlib.ExitStack()  # what stops them


@contextlib.contextmanager
def shared_kernels() -> Iterator[None]:
    """Within this, :func:`kernel` hands out one kernel per environment, stopped at the end."""
    global _shared
    _shared = {}
    try:
        with _shared_stack:
            yield
    finally:
        _shared = None


@contextlib.contextmanager
def kernel(imports: Sequence[str] = (), env: dict[str, str] | None = None) -> Iterator[Any]:
    """A fresh kernel that has imported torch, the workload and the given contenders (within
    :func:`shared_kernels`, the environment's one kernel, which imports them now)."""
    extra = "\n".join(dict.fromkeys(IMPORTS[c] for c in imports if IMPORTS[c]))
    if _shared is None:
        with _started_kernel(STARTUP + extra, env) as session:
            yield session
        return
    session = _shared_kernel(env)
    if extra:
        cell = session.execute(extra)
        if cell.error is not None:
            raise RuntimeError(f"importing the contenders failed:\n{cell.error_text[-2000:]}")
    yield session


@contextlib.contextmanager
def restarted_kernel(env: dict[str, str] | None = None) -> Iterator[tuple[Any, float]]:
    """A kernel as "Restart & Run All" finds it (started now, nothing run in it) and the
    ``time.time()`` just before it was started (within :func:`shared_kernels`, the environment's
    one kernel, which has run earlier cells, and now)."""
    if _shared is not None:
        yield _shared_kernel(env), time.time()
        return
    started = time.time()
    with _started_kernel(None, env) as session:
        yield session, started


def _shared_kernel(env: dict[str, str] | None) -> Any:
    key = json.dumps(env or {}, sort_keys=True)
    assert _shared is not None
    if key not in _shared:
        _shared[key] = _shared_stack.enter_context(_started_kernel(STARTUP, env))
    return _shared[key]


@contextlib.contextmanager
def _started_kernel(startup: str | None, env: dict[str, str] | None) -> Iterator[Any]:
    kernel_env = {"PYTHONPATH": str(ROOT), **(env or {})}
    with KernelSession(env=kernel_env, startup=startup) as session:
        try:
            yield session
        finally:
            # Accelerate's launcher leaves torch elastic's SIGTERM handler installed in the
            # kernel, which turns the shutdown's SIGTERM into a traceback on stderr.
            with contextlib.suppress(Exception):
                session.execute(
                    "import signal; signal.signal(signal.SIGTERM, signal.SIG_DFL)", timeout=30
                )


class QuietView:
    """A launch view that shows nothing, for launches made by the benchmark process itself."""

    def start(self, state: Any) -> None:
        pass

    def output(self, rank: int, stream: str, lines: list[str]) -> None:
        pass

    def update(self) -> None:
        pass

    def finish(self) -> None:
        pass


class Scratch:
    """Output folders for launches, all below one temporary directory removed at the end."""

    def __init__(self) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="nbaccel-bench-"))
        self._count = 0

    def new(self) -> str:
        self._count += 1
        path = self.root / f"launch{self._count}"
        path.mkdir()
        return str(path)

    def close(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)


def launch_cell(contender: str, cfg: dict[str, Any], world: int, kw: str = "") -> str:
    """The cell that launches ``contender``: times the launcher call with the kernel's clock."""
    return call_cell(LAUNCH[contender].format(world=world, kw=kw), cfg)


def call_cell(call: str, cfg: dict[str, Any]) -> str:
    """The cell that runs ``call`` (a launcher call) with ``_cfg = cfg``, timed by the kernel."""
    # process_time: CPU seconds of every kernel thread (relay, views, zmq) during the call
    return (
        f"_cfg = json.loads({json.dumps(cfg)!r})\n"
        "_t0, _c0 = time.time(), time.process_time()\n"
        "try:\n"
        f"{textwrap.indent(call, '    ')}\n"
        "finally:\n"
        f"    print({MARK!r} + json.dumps({{'t0': _t0, 't1': time.time(), "
        "'cpu': time.process_time() - _c0}), flush=True)\n"
    )


def run_launch(
    session: Any,
    contender: str,
    cfg: dict[str, Any],
    world: int,
    scratch: Scratch,
    kw: str = "",
    expect_error: bool = False,
    on_message: Any = None,
    timeout: float = 600,
) -> dict[str, Any]:
    """Launch once; return the kernel's timings, each rank's record and the cell itself."""
    call = LAUNCH[contender].format(world=world, kw=kw)
    return run_call(session, call, cfg, world, scratch, expect_error, on_message, timeout)


def run_call(
    session: Any,
    call: str,
    cfg: dict[str, Any],
    world: int,
    scratch: Scratch,
    expect_error: bool = False,
    on_message: Any = None,
    timeout: float = 600,
) -> dict[str, Any]:
    """Run one launcher ``call`` (``_cfg`` is ``cfg`` with a fresh ``out_dir``); return the
    kernel's timings, each rank's record and the cell itself."""
    cfg = {**cfg, "out_dir": scratch.new()}
    sent = time.time()
    cell = session.execute(call_cell(call, cfg), timeout, on_message)
    done = time.time()
    if cell.error is not None and not expect_error:
        raise RuntimeError(f"launch failed ({call[:60]}...):\n{cell.error_text[-3000:]}")
    marks = [line for line in cell.stdout.splitlines() if line.startswith(MARK)]
    times = json.loads(marks[-1][len(MARK) :]) if marks else {}
    return {
        "sent": sent,
        "done": done,
        "t0": times.get("t0"),
        "t1": times.get("t1"),
        "kernel_cpu_s": times.get("cpu"),
        "ranks": read_ranks(cfg["out_dir"], world),
        "cell": cell,
    }


def timed_cell(session: Any, code: str) -> float:
    """Run ``code`` in a cell; its seconds by the kernel's clock (what the person waits for)."""
    cell = session.execute(
        f"_t0 = time.time()\n{code}\nprint({MARK!r} + json.dumps({{'s': time.time() - _t0}}))\n"
    )
    if cell.error is not None:
        raise RuntimeError(f"cell failed:\n{cell.error_text[-2000:]}")
    marks = [line for line in cell.stdout.splitlines() if line.startswith(MARK)]
    return json.loads(marks[-1][len(MARK) :])["s"]


def load_now() -> float | None:
    """The machine's 1-minute load average now, recorded beside each measurement: on a shared
    machine a figure means little without it."""
    return round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None


def kernel_cpu_share(run: dict[str, Any]) -> float | None:
    """Kernel CPU seconds per second of the launcher call: what the launch costs the kernel
    (its relay and view), taken from the cores the ranks share with it."""
    cpu, t0, t1 = run.get("kernel_cpu_s"), run.get("t0"), run.get("t1")
    if cpu is None or t0 is None or t1 is None or t1 <= t0:
        return None
    return cpu / (t1 - t0)


def first_step_latency(run: dict[str, Any], world: int) -> float:
    """Seconds from the kernel's clock just before the launcher call to the last rank's first
    optimizer step."""
    ranks = run["ranks"]
    if len(ranks) != world or any(r.get("first_step") is None for r in ranks.values()):
        raise RuntimeError(f"not every rank reported its first step: {ranks}")
    return max(r["first_step"] for r in ranks.values()) - run["t0"]


def function_span(run: dict[str, Any], world: int) -> float:
    """Seconds from the first rank entering the function to the last one leaving it: the
    function's own time, which no launcher can take off a launch (what is left of the whole
    call is the launcher's)."""
    ranks = run["ranks"]
    if len(ranks) != world or any(r.get("left") is None for r in ranks.values()):
        raise RuntimeError(f"not every rank reported entering and leaving: {ranks}")
    return max(r["left"] for r in ranks.values()) - min(r["entered"] for r in ranks.values())


def message_bytes(msg: dict[str, Any]) -> int:
    """Size of an iopub message as JSON (header, parent header, metadata, content)."""
    parts = {k: msg.get(k) for k in ("header", "parent_header", "metadata", "content")}
    return len(json.dumps(parts, default=str).encode())


def rotated(items: Sequence[str], rep: int) -> list[str]:
    """Interleaving order for repetition ``rep``: A B C, then B C A, ... so no contender always
    runs first (right after a kernel start, or right after a heavy neighbour)."""
    k = rep % len(items) if items else 0
    return list(items[k:]) + list(items[:k])


def summary(values: Sequence[float], digits: int = 4) -> dict[str, Any]:
    vals = [float(v) for v in values]
    if not vals:
        return {"n": 0, "median": None}
    return {
        "n": len(vals),
        "median": round(statistics.median(vals), digits),
        "min": round(min(vals), digits),
        "max": round(max(vals), digits),
        "values": [round(v, digits) for v in vals],
    }


def ratio(a: float | None, b: float | None, digits: int = 3) -> float | None:
    if a is None or b in (None, 0):
        return None
    return round(a / b, digits)


def paired_ratio(a: Sequence[float], b: Sequence[float], digits: int = 3) -> float | None:
    """Median of per-repetition ratios a[i]/b[i]: runs next to each other share the machine's
    load, so this is steadier than a ratio of medians on a busy machine."""
    pairs = [x / y for x, y in zip(a, b) if y]
    if not pairs or len(a) != len(b):
        return None
    return round(statistics.median(pairs), digits)


def machine_info() -> dict[str, Any]:
    import torch

    cpu = platform.processor() or ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    versions = {}
    for name in ("accelerate", "tqdm", "ipykernel", "jupyter_client", "ipywidgets"):
        with contextlib.suppress(Exception):
            from importlib.metadata import version

            versions[name] = version(name)
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
        ).stdout.strip()
    except OSError:
        commit = ""
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.cuda.is_available(),
        "platform": platform.platform(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "git_commit": commit,
        "versions": versions,
        "load_average_at_start": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
    }


__all__ = ["Cell", "KernelSession", "kernel", "run_launch", "summary", "ratio", "rotated"]
