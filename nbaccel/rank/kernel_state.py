"""Reset, in a fork of a notebook kernel, each kind of process state the kernel holds that a
freshly started interpreter does not. ``rank.zygote.become_fresh`` runs them in order.

Whatever is replaced is kept referenced in :data:`INHERITED` (and ``gc.freeze()``d) and never
closed or freed: a finaliser of an inherited object could close a descriptor number that now
belongs to someone else, or talk to the kernel's sockets.
"""

from __future__ import annotations

import _imp
import asyncio
import atexit
import builtins
import faulthandler
import importlib.machinery
import io
import logging
import multiprocessing.process
import multiprocessing.util
import os
import signal
import site
import sys
import threading
import types
import weakref
from multiprocessing import resource_tracker
from typing import Any

INHERITED: list[Any] = []

# atexit hooks the kept modules register when imported, in registration order: what a fresh
# interpreter that imported them would run at exit (module, attribute). Only modules the
# kernel had imported count; a pybind11 hook of torch's frees C++ state at interpreter
# teardown, which ranks never reach (they leave with os._exit).
KEPT_EXIT_HOOKS = (
    ("logging", "shutdown"),  # flush and close log handlers
    ("torch.utils.data._utils", "_set_python_exit_flag"),
    ("multiprocessing.util", "_exit_function"),  # finalisers: Queue feeders, pools
    ("torch._subclasses.fake_tensor", "dump_cache_stats"),
    ("weakref", "finalize._exitfunc"),
)


def close_inherited_fds(keep: tuple[int, ...]) -> None:
    """Close every descriptor but 0-2 and ``keep`` (the kernel's zmq sockets, history db...)."""
    try:
        fds = [int(name) for name in os.listdir("/proc/self/fd")]
    except OSError:  # no /proc: every number up to the limit (slow where it is huge)
        fds = list(range(3, os.sysconf("SC_OPEN_MAX")))
    for fd in fds:
        if fd > 2 and fd not in keep:
            try:
                os.close(fd)
            except OSError:
                pass  # the one listdir itself had open


def fresh_streams_and_hooks() -> list[Any]:
    """New ``sys.stdin/stdout/stderr`` on fds 0-2 and the interpreter's own hooks; returns the
    kernel's streams (ipykernel's, backed by zmq)."""
    old = [sys.stdin, sys.stdout, sys.stderr, sys.__stdin__, sys.__stdout__, sys.__stderr__]
    INHERITED.extend(old)
    # fd 0 is owned as in a fresh interpreter: the server's start closes it for /dev/null.
    sys.stdin = sys.__stdin__ = open(0)  # noqa: SIM115 - lives with the process
    sys.stdout = sys.__stdout__ = open(1, "w", closefd=False)  # noqa: SIM115
    sys.stderr = sys.__stderr__ = io.TextIOWrapper(
        open(2, "wb", closefd=False),  # noqa: SIM115
        errors="backslashreplace",
        line_buffering=True,
    )
    sys.displayhook = sys.__displayhook__
    sys.excepthook = sys.__excepthook__
    sys.breakpointhook = sys.__breakpointhook__
    sys.unraisablehook = sys.__unraisablehook__
    threading.excepthook = threading.__excepthook__
    sys.settrace(None)
    sys.setprofile(None)
    threading.settrace(None)  # type: ignore[arg-type]
    threading.setprofile(None)  # type: ignore[arg-type]
    for name in ("ps1", "ps2"):
        if hasattr(sys, name):
            delattr(sys, name)
    faulthandler.disable()
    return old


def fresh_signals() -> None:
    """Default handlers (SIGINT ignored, as in the fork server), no wakeup fd, nothing blocked."""
    signal.set_wakeup_fd(-1)
    signal.pthread_sigmask(signal.SIG_SETMASK, [])
    for sig in signal.valid_signals():
        try:
            handler = signal.getsignal(sig)
        except (ValueError, OSError):
            continue
        if callable(handler) and sig != signal.SIGINT:
            signal.signal(sig, signal.SIG_DFL)


def fresh_builtins() -> None:
    """The interpreter's own builtins: drop what IPython and ipykernel added (``display``,
    ``get_ipython``, a zmq-backed ``input``), restore what they hid (``exit``, ``quit``)."""
    INHERITED.append(dict(vars(builtins)))
    for name, value in list(vars(builtins).items()):
        dunder = name.startswith("__") and name.endswith("__")
        if name == "__IPYTHON__" or (not dunder and _defined_outside_builtins(value)):
            del vars(builtins)[name]
    # CPython keeps a copy of the builtins module as first initialised; this restores it.
    _imp.create_builtin(
        importlib.machinery.ModuleSpec("builtins", importlib.machinery.BuiltinImporter)
    )
    builtins.open = io.open  # set by the interpreter's start-up, not in that copy
    site.setquit()
    site.setcopyright()
    site.sethelper()


def _defined_outside_builtins(value: Any) -> bool:
    if isinstance(value, (type, types.BuiltinFunctionType, types.ModuleType)):
        return False
    module = getattr(value, "__module__", None) or getattr(type(value), "__module__", None)
    return module not in (None, "builtins", "_sitebuiltins")


def fresh_sys_state() -> None:
    """Forget the kernel's last exception (``sys.last_type``... of a failed cell): it holds
    IPython's classes and frames, which a fresh interpreter would not have."""
    for name in ("last_type", "last_value", "last_traceback", "last_exc"):
        sys.__dict__.pop(name, None)


def fresh_exit_hooks() -> None:
    """Run at a rank's exit only what a fresh interpreter would run there.

    The kernel's hooks must never run in a rank (IPython's history writer, zmq's context, or
    ``atexit.register(shutil.rmtree, the_kernels_tmpdir)`` from a cell or a library), and atexit
    cannot list them. So all go, and the hooks the kept modules registered when the kernel
    imported them come back, in their order (:data:`KEPT_EXIT_HOOKS`; what the server and the
    ranks import afterwards registers its own as usual). The kernel's
    ``weakref.finalize(..., atexit=True)`` callbacks go too: they clean up after the kernel.
    """
    atexit._clear()
    weakref.finalize._registry.clear()  # type: ignore[attr-defined]
    for module_name, attribute in KEPT_EXIT_HOOKS:
        module = sys.modules.get(module_name)
        hook = module
        for part in attribute.split("."):
            hook = getattr(hook, part, None)
        if module is not None and callable(hook):
            atexit.register(hook)


def fresh_asyncio() -> None:
    """No event loop: the kernel's main thread was inside its own, and ``asyncio.run()`` in a
    rank would refuse to start."""
    INHERITED.append(asyncio.events._get_running_loop())
    asyncio.events._set_running_loop(None)
    INHERITED.append(asyncio.get_event_loop_policy())
    asyncio.set_event_loop_policy(None)


def fresh_multiprocessing() -> None:
    """Forget the kernel's multiprocessing children, finalisers and resource tracker: at exit
    multiprocessing would otherwise SIGTERM the kernel's own children (``_exit_function``)."""
    INHERITED.append(
        (set(multiprocessing.process._children), dict(multiprocessing.util._finalizer_registry))
    )  # type: ignore[attr-defined]
    multiprocessing.process._children.clear()  # type: ignore[attr-defined]
    multiprocessing.util._finalizer_registry.clear()  # type: ignore[attr-defined]
    tracker = resource_tracker._resource_tracker
    tracker._fd = None  # closed with the rest; each rank gets the kernel's tracker anew
    tracker._pid = None


def fresh_logging(kernel_streams: list[Any]) -> None:
    """Log handlers that wrote to the kernel's streams (torch's, ``logging.basicConfig``'s)
    write to this process's stderr/stdout instead; every other inherited handler (a file
    whose descriptor is closed) is taken off its logger and out of logging's exit flush."""
    replacement = {id(s): sys.stderr for s in kernel_streams}
    replacement[id(kernel_streams[1])] = replacement[id(kernel_streams[4])] = sys.stdout
    loggers = [logging.getLogger(), *logging.Logger.manager.loggerDict.values()]
    kept: set[int] = set()
    for logger in loggers:
        for handler in list(getattr(logger, "handlers", ())):
            stream = getattr(handler, "stream", None)
            if isinstance(handler, logging.StreamHandler) and id(stream) in replacement:
                handler.stream = replacement[id(stream)]  # not setStream: it flushes the old
                kept.add(id(handler))
            else:
                INHERITED.append(handler)
                logger.removeHandler(handler)
    logging._handlerList[:] = [  # type: ignore[attr-defined]
        ref
        for ref in logging._handlerList  # type: ignore[attr-defined]
        if id(ref()) in kept
    ]


def fresh_torch_modes() -> None:
    """torch's global modes as ``import torch`` leaves them (a kernel's ``set_grad_enabled(False)``
    or ``set_default_dtype(float64)`` before ``import nbaccel`` would reach every rank).

    Each is reset only where the kernel changed it: ``use_deterministic_algorithms`` imports
    ``torch._dynamo`` (0.7 s), which the preload then imports faster (collector paused)."""
    torch = sys.modules.get("torch")
    if torch is None:
        return
    resets = (  # (is it as import torch leaves it?, put it back)
        (torch.is_grad_enabled, lambda: torch.set_grad_enabled(True)),
        (
            lambda: torch.get_default_dtype() == torch.float32,
            lambda: torch.set_default_dtype(torch.float32),
        ),
        (
            lambda: torch.get_default_device() == torch.device("cpu"),
            lambda: torch.set_default_device(None),
        ),
        (
            lambda: not torch.is_anomaly_enabled(),
            lambda: torch.autograd.set_detect_anomaly(False),
        ),
        (
            lambda: not torch.are_deterministic_algorithms_enabled(),
            lambda: torch.use_deterministic_algorithms(False),
        ),
        (
            lambda: torch.get_float32_matmul_precision() == "highest",
            lambda: torch.set_float32_matmul_precision("highest"),
        ),
    )
    for is_default, reset in resets:
        try:
            if not is_default():
                reset()
        except (AttributeError, RuntimeError, TypeError):
            pass  # an older torch without that setting


def allow_inherited_depth() -> None:
    """The kernel's frames stay below this process's own (it never returns into them): raise
    the recursion limit by their number, so user code may recurse as deep as elsewhere."""
    depth, frame = 0, sys._getframe()
    while frame is not None:
        depth, frame = depth + 1, frame.f_back
    sys.setrecursionlimit(sys.getrecursionlimit() + depth)
