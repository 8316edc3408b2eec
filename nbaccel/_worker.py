"""What one rank does, from the moment its process exists until it exits.

It wires the process up (output pipes at the fd level, environment, signals, crash reports,
death with the kernel), runs the user's function, and reports the result or the failure as an
event. It never imports IPython or the views.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import dataclasses
import faulthandler
import functools
import io
import multiprocessing
import multiprocessing.util
import os
import pickle
import signal
import sys
import threading
import traceback
from typing import Any

import cloudpickle

from nbaccel import _pickling, _torch_fixes, _tqdm_hook, events, hardware, reporting

STACK_DUMP_SIGNAL = signal.SIGUSR1


@dataclasses.dataclass
class RankSpec:
    """Everything a rank needs to know about itself; plain data, cheap to pickle."""

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    node_rank: int
    env: dict[str, str]
    function: bytes
    args: list[bytes]
    kwargs: dict[str, bytes]
    send_result: bool
    sources: dict[str, tuple] = dataclasses.field(default_factory=dict)


@functools.cache
def _libc() -> Any:
    # find_library runs ldconfig; a rank asks three times while it starts, so ask once.
    name = ctypes.util.find_library("c")
    return ctypes.CDLL(name, use_errno=True) if name else None


def _die_with_parent() -> None:
    """Make sure the rank dies when whoever launched it dies, so no orphan keeps training.

    On Linux the kernel (via PR_SET_PDEATHSIG) kills us when our parent exits; everywhere, a
    thread watches the launcher's end of a pipe that only closes when the launcher is gone.
    """
    _forget_fork_server()
    if sys.platform.startswith("linux"):
        libc = _libc()
        if libc is not None and libc.prctl(1, signal.SIGKILL) == 0:  # PR_SET_PDEATHSIG
            return
    parent = multiprocessing.parent_process()
    sentinel = getattr(parent, "sentinel", None)
    if sentinel is None:
        return

    def watch() -> None:
        from multiprocessing.connection import wait

        wait([sentinel])
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="nbaccel-parent-watch", daemon=True).start()


def _forget_fork_server() -> None:
    """Drop the fork server's "alive" pipe that multiprocessing hands every forked child.

    The server only exits (taking its children with it, via PR_SET_PDEATHSIG) once every holder
    of that pipe has closed it; a rank holding it would keep the server, and so itself, alive
    after the kernel died. A rank that starts processes of its own gets a fresh server.
    """
    import multiprocessing.forkserver as fs

    server = fs._forkserver
    fd = getattr(server, "_forkserver_alive_fd", None)
    if fd is not None:
        try:
            os.close(fd)
        except OSError:
            pass
        server._forkserver_alive_fd = None
        server._forkserver_address = None
        server._forkserver_pid = None


def _redirect_output(out_fd: int, err_fd: int) -> None:
    """Point fds 1 and 2 at the kernel's pipes, with line-buffered Python streams on top."""
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    os.dup2(out_fd, 1)
    os.dup2(err_fd, 2)
    sys.stdin = open(0, closefd=False)  # noqa: SIM115 - lives as long as the process
    sys.stdout = io.TextIOWrapper(
        open(1, "wb", buffering=0, closefd=False),
        encoding="utf-8",  # noqa: SIM115
        errors="backslashreplace",
        line_buffering=True,
    )
    sys.stderr = io.TextIOWrapper(
        open(2, "wb", buffering=0, closefd=False),
        encoding="utf-8",  # noqa: SIM115
        errors="backslashreplace",
        line_buffering=True,
    )
    sys.__stdout__, sys.__stderr__ = sys.stdout, sys.stderr
    # C libraries buffer stdout fully when it is a pipe; make it line-buffered so their
    # output reaches the cell as it happens (glibc only; elsewhere it arrives at exit).
    libc = _libc()
    if libc is not None and sys.platform.startswith("linux"):
        try:
            c_stdout = ctypes.c_void_p.in_dll(libc, "stdout")
            libc.setvbuf(c_stdout, None, 1, 0)  # _IOLBF
        except (ValueError, AttributeError):
            pass


def _flush_all() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    libc = _libc()
    if libc is not None:
        libc.fflush(None)


def _set_thread_count(spec: RankSpec) -> None:
    """Share the CPU between local ranks instead of each starting one thread per core."""
    if "OMP_NUM_THREADS" not in os.environ:
        os.environ["OMP_NUM_THREADS"] = str(hardware.threads_per_rank(spec.local_world_size))
    try:
        import torch

        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    except (ImportError, ValueError, RuntimeError):
        pass


def _to_cpu(value: Any) -> Any:
    """Move tensors (and models) in a return value to the CPU, so the kernel can load them."""
    torch = sys.modules.get("torch")
    if torch is None:
        return value
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, torch.nn.parallel.DistributedDataParallel):
        value = value.module
    if isinstance(value, torch.nn.Module):
        return value.cpu()
    if isinstance(value, dict):
        return (
            type(value)((k, _to_cpu(v)) for k, v in value.items()) if type(value) is dict else value
        )
    if isinstance(value, (list, tuple)) and type(value) in (list, tuple):
        return type(value)(_to_cpu(v) for v in value)
    return value


def _user_traceback(exc: BaseException) -> str:
    """The traceback without this module's frames, so it starts at the user's function."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename == __file__:
        tb = tb.tb_next
    return "".join(traceback.format_exception(type(exc), exc, tb))


def _report_failure(exc: BaseException, rank: int) -> None:
    try:
        pickled = _pickling.dumps(exc)
        pickle.loads(pickled)  # only send what the kernel will be able to load
    except Exception:
        pickled = None
    kind = type(exc)
    events.emit(
        events.Failure(
            rank=rank,
            exc_type=f"{kind.__module__}.{kind.__qualname__}",
            message=str(exc),
            traceback=_user_traceback(exc),
            exception=pickled,
        )
    )


def _install_progress_hooks() -> None:
    """Let tqdm bars in the user's code report as this rank's progress (opt out: NBACCEL_TQDM=0)."""
    try:
        _tqdm_hook.install_worker_hooks()
    except Exception as exc:  # noqa: BLE001 - never let reporting break training
        print(f"nbaccel: progress hooks not installed: {exc}", file=sys.stderr)


def run_rank(spec: RankSpec, out_w: Any, err_w: Any, diag_w: Any, events_w: Any) -> None:
    """Entry point of a rank process (the target of its ``multiprocessing.Process``)."""
    # The kernel handles Ctrl-C/interrupt for everyone and stops ranks itself; N tracebacks
    # from N ranks would only bury the one that matters.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _die_with_parent()
    _redirect_output(out_w.fileno(), err_w.fileno())
    diag = open(diag_w.fileno(), "w", closefd=False)  # noqa: SIM115 - kept for faulthandler
    faulthandler.enable(file=diag, all_threads=True)
    faulthandler.register(STACK_DUMP_SIGNAL, file=diag, all_threads=True, chain=False)

    os.environ.clear()
    os.environ.update(spec.env)
    _set_thread_count(spec)
    _pickling.install_sources(spec.sources)
    events.install_channel(events_w, spec.rank)
    _install_progress_hooks()
    _torch_fixes.keep_destroyed_process_groups_alive()
    events.emit(events.Started(rank=spec.rank, pid=os.getpid()))

    payload, failure, code = None, None, 0
    try:
        function = cloudpickle.loads(spec.function)
        args = [cloudpickle.loads(a) for a in spec.args]
        kwargs = {k: cloudpickle.loads(v) for k, v in spec.kwargs.items()}
        value = function(*args, **kwargs)
        payload = _pickling.dumps(_to_cpu(value)) if spec.send_result else None
    except SystemExit as exc:
        if exc.code not in (None, 0):
            failure, code = exc, exc.code if isinstance(exc.code, int) else 1
    except BaseException as exc:  # noqa: BLE001 - every failure goes to the kernel
        failure, code = exc, 1
    reporting.flush()  # metrics held back while the kernel was busy go before the verdict
    if failure is not None:
        _report_failure(failure, spec.rank)
    else:
        # The process group is left to die with the process (see _torch_fixes).
        events.emit(events.Result(rank=spec.rank, payload=payload))
    _flush_all()
    diag.flush()
    # Leave without interpreter teardown, as multiprocessing's fork children do: torch's
    # process-group destructors can deadlock there (see _torch_fixes), and everything has been
    # reported. multiprocessing's own exit hook still stops this rank's child processes.
    exit_hook = getattr(multiprocessing.util, "_exit_function", None)
    if exit_hook is not None:
        exit_hook()
    os._exit(code)
