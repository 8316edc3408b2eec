"""The fork server taken from the kernel: a fork made at ``import nbaccel`` that turns itself
into the server a fresh interpreter would be, but with torch already imported.

The ordinary fork server is a new interpreter that must import torch (about 0.9 s here) and
the modules of the first optimizer step (``torch._dynamo``, about 0.8 s more) before it can
fork a rank, so a launch right after the import cell waits for both. A fork of the kernel has
torch at once. Before it serves, it undoes what the kernel's process has that a fresh server
does not (:func:`become_fresh`), then runs CPython's own fork-server loop
(``multiprocessing.forkserver.main``) with nbaccel's usual preloads, so ranks start, are
contained and die exactly as from the ordinary server.

Why a fork of a multi-threaded kernel is safe here:

- the fork happens in the kernel's main thread, which holds the GIL, so no other thread is
  inside the interpreter, and glibc makes ``malloc`` safe across ``fork``;
- the other kernel threads (ZMQ I/O, heartbeat, iopub, history) do not exist in the child. A
  lock one of them held stays held, so the child never uses what they own. It closes every
  file descriptor it inherited, replaces ``sys.stdout``/``stderr``/hooks, and never calls zmq or
  IPython. It keeps every inherited object alive (``gc.freeze``), so no finaliser runs on a
  closed (or reused) descriptor;
- a module whose import was under way at that instant (``nbaccel`` itself: the fork happens
  inside its import) has its import lock held for good, so another thread importing it would
  wait forever: such modules are forgotten and imported afresh;
- GNU OpenMP cannot survive a fork (a child's next multi-threaded matmul hangs). The kernel
  releases its pool right before the fork (``core.openmp``), or does not fork;
- CUDA: the kernel forks only when CUDA is not initialised. CUDA initialised later in the kernel
  is not in the zygote, so ranks can still use the GPU.

A rank must still see the world as it is at *its* launch: ``rank.twin`` sets the kernel's
environment, ``sys.path``, working directory and RNG states per launch, as for the ordinary
server. Modules the kernel may change during a session (its own cells, files in its folders,
editable installs, anything but the standard library and torch's own dependencies) are dropped
here and imported afresh by each rank, so an edited and reloaded module is the new one.
"""

from __future__ import annotations

import _imp
import atexit
import builtins
import faulthandler
import gc
import importlib
import importlib.machinery
import io
import multiprocessing.forkserver
import os
import signal
import site
import sys
import threading
import traceback
import types
import warnings
import weakref
from typing import Any, NoReturn

from nbaccel.core import mp_internals, proctitle

# Third-party packages torch imports, plus nbaccel's rank-side dependencies: kept, being
# installed code that a session does not change and that has no view of the kernel. Anything
# else a rank needs, it imports itself, as from the ordinary server.
KEPT_PACKAGES = frozenset(
    {
        "torch",
        "torchgen",
        "functorch",
        "numpy",
        "sympy",
        "mpmath",
        "networkx",
        "jinja2",
        "markupsafe",
        "filelock",
        "fsspec",
        "typing_extensions",
        "cloudpickle",
        "psutil",
        "yaml",
        "_yaml",
        # put in place at start-up by site (.pth files), as in every interpreter
        "_distutils_hack",
        "_virtualenv",
        "sitecustomize",
        "usercustomize",
    }
)
# nbaccel's rank side (the kernel side is never loaded in a rank).
KEPT_NBACCEL = frozenset({"core", "rank", "training", "utils"})

# atexit hooks the kept modules register when imported, in registration order: what a fresh
# interpreter that imported them would run at exit (module, attribute). Only modules the
# kernel had imported count; a pybind11 hook of torch's frees C++ state at interpreter
# teardown, which ranks never reach (they leave with os._exit).
_KEPT_EXIT_HOOKS = (
    ("logging", "shutdown"),  # flush and close log handlers
    ("torch.utils.data._utils", "_set_python_exit_flag"),
    ("multiprocessing.util", "_exit_function"),  # finalisers: Queue feeders, pools
    ("torch._subclasses.fake_tensor", "dump_cache_stats"),
    ("weakref", "finalize._exitfunc"),
)

# Everything the zygote inherited and replaced: referenced here so that it is never freed (a
# finaliser could close a descriptor number that is now someone else's).
_INHERITED: list[Any] = []


def serve(listener_fd: int, alive_r: int, preload: list[str], env: dict[str, str]) -> NoReturn:
    """The zygote's whole life: become a fresh server, serve until the kernel is gone, exit.

    Never returns: it must not unwind into the kernel's frames it was forked in.
    """
    code = 1
    try:
        become_fresh(keep_fds=(listener_fd, alive_r))
        for name in preload:  # their import is what sets the server up: it must run here
            sys.modules.pop(name, None)
        proctitle.set_title(f"nbaccel fork server (kernel {os.getppid()})")
        os.environ.update(env)
        multiprocessing.forkserver.main(listener_fd, alive_r, preload)
        code = 0
    except SystemExit as exc:  # the kernel is gone (the "alive" pipe closed)
        code = exc.code if isinstance(exc.code, int) else 0
    except BaseException:  # noqa: BLE001 - report it where the server's stderr goes, then exit
        try:
            traceback.print_exc()
        except BaseException:  # noqa: BLE001
            pass
    finally:
        try:
            atexit._run_exitfuncs()  # the server guard's: stop everything below this server
        finally:
            os._exit(code)


def become_fresh(keep_fds: tuple[int, ...]) -> None:
    """Undo, in this fork of the kernel, what a freshly started interpreter would not have."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Jupyter's interrupt is for the kernel
    try:
        os.setpgid(0, 0)  # and so is its process group (the server guard does this too)
    except OSError:
        pass
    gc.freeze()  # nothing inherited is ever collected (see _INHERITED)
    _close_inherited_fds(keep_fds)
    _fresh_streams_and_hooks()
    _fresh_signals()
    _fresh_builtins()
    _fresh_exit_hooks()
    _fresh_asyncio()
    forget = _modules_to_forget()
    _forget_modules(forget)
    _forget_warning_filters(forget)
    mp_internals.reset_forkserver_lock()
    importlib.invalidate_caches()


def _close_inherited_fds(keep: tuple[int, ...]) -> None:
    low = 3
    for fd in sorted(keep):
        os.closerange(low, fd)
        low = fd + 1
    os.closerange(low, os.sysconf("SC_OPEN_MAX") if hasattr(os, "sysconf") else 65536)


def _fresh_streams_and_hooks() -> None:
    _INHERITED.extend(
        [sys.stdin, sys.stdout, sys.stderr, sys.__stdin__, sys.__stdout__, sys.__stderr__]
    )
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


def _fresh_signals() -> None:
    signal.set_wakeup_fd(-1)
    signal.pthread_sigmask(signal.SIG_SETMASK, [])
    for sig in signal.valid_signals():
        try:
            handler = signal.getsignal(sig)
        except (ValueError, OSError):
            continue
        if callable(handler) and sig != signal.SIGINT:
            signal.signal(sig, signal.SIG_DFL)


def _fresh_builtins() -> None:
    """The interpreter's own builtins: drop what IPython and ipykernel added (``display``,
    ``get_ipython``, a zmq-backed ``input``), restore what they hid (``exit``, ``quit``)."""
    _INHERITED.append(dict(vars(builtins)))
    for name, value in list(vars(builtins).items()):
        dunder = name.startswith("__") and name.endswith("__")
        if name == "__IPYTHON__" or (not dunder and _defined_outside_builtins(value)):
            del vars(builtins)[name]
    # CPython keeps a copy of the builtins module as first initialised; this restores it.
    _imp.create_builtin(
        importlib.machinery.ModuleSpec("builtins", importlib.machinery.BuiltinImporter)
    )
    site.setquit()
    site.setcopyright()
    site.sethelper()


def _defined_outside_builtins(value: Any) -> bool:
    if isinstance(value, (type, types.BuiltinFunctionType, types.ModuleType)):
        return False
    module = getattr(value, "__module__", None) or getattr(type(value), "__module__", None)
    return module not in (None, "builtins", "_sitebuiltins")


def _fresh_asyncio() -> None:
    asyncio = sys.modules.get("asyncio")
    if asyncio is None:
        return
    # The kernel's main thread was inside its event loop: asyncio.run() would refuse to start.
    _INHERITED.append(asyncio.events._get_running_loop())
    asyncio.events._set_running_loop(None)
    _INHERITED.append(asyncio.get_event_loop_policy())
    asyncio.set_event_loop_policy(None)


def _keep_module(name: str) -> bool:
    top, _, rest = name.partition(".")
    if top == "nbaccel":
        return rest == "" or rest.partition(".")[0] in KEPT_NBACCEL
    if name == "__main__":
        return False
    # _cython_*: Cython's shared types; __editable__*: editable installs' finders (site, .pth)
    return (
        top in sys.stdlib_module_names
        or top in KEPT_PACKAGES
        or top.startswith(("_cython_", "__editable__"))
    )


def _modules_to_forget() -> set[str]:
    """Names of the modules a rank must import afresh, with those whose import was under way
    at the fork, in any thread (and their submodules): their import locks are held by a
    thread that is gone or, in this thread, by kernel frames this process never returns to
    (the fork happens inside ``import nbaccel``). Another thread importing one would wait
    forever; forgotten, it is imported anew."""
    importing = set()
    locks = importlib._bootstrap._module_locks  # type: ignore[attr-defined]
    for name, ref in list(locks.items()):
        lock = ref()
        if lock is not None and getattr(lock, "owner", None) is not None:
            importing.add(name)
            del locks[name]
    packages = tuple(f"{name}." for name in importing)
    return {
        n for n in sys.modules if n in importing or n.startswith(packages) or not _keep_module(n)
    }


def _fresh_exit_hooks() -> None:
    """Run at a rank's exit only what a fresh interpreter would run there.

    The kernel's hooks must never run in a rank (IPython's history writer, zmq's context, or
    ``atexit.register(shutil.rmtree, the_kernels_tmpdir)`` from a cell or a library), and atexit
    cannot list them. So all go, and the hooks the kept modules registered when the kernel
    imported them come back, in their order (torch 2.13's ``import torch`` registers these;
    what the server and the ranks import afterwards registers its own as usual). The kernel's
    ``weakref.finalize(..., atexit=True)`` callbacks go too: they clean up after the kernel.
    """
    atexit._clear()
    weakref.finalize._registry.clear()  # type: ignore[attr-defined]
    for module_name, attribute in _KEPT_EXIT_HOOKS:
        module = sys.modules.get(module_name)
        hook = module
        for part in attribute.split("."):
            hook = getattr(hook, part, None)
        if module is not None and callable(hook):
            atexit.register(hook)


def _forget_modules(forget: set[str]) -> None:
    _INHERITED.append({n: sys.modules[n] for n in forget if n in sys.modules})
    for name in forget:
        sys.modules.pop(name, None)
    main = types.ModuleType("__main__")
    main.__builtins__ = builtins  # type: ignore[attr-defined]
    sys.modules["__main__"] = main
    # A kept package's attribute naming a forgotten submodule (nbaccel.launch) goes too.
    for module in list(sys.modules.values()):
        if getattr(module, "__path__", None) is None:
            continue
        for attr, value in list(vars(module).items()):
            # type(), not isinstance: that would ask lazy attributes for __class__ (warnings)
            if issubclass(type(value), types.ModuleType) and value.__name__ in forget:
                delattr(module, attr)


def _forget_warning_filters(forget: set[str]) -> None:
    """Drop warning filters for categories defined in forgotten modules (IPython's own)."""
    warnings.filters[:] = [
        f for f in warnings.filters if getattr(f[2], "__module__", "builtins") not in forget
    ]
    warnings._filters_mutated()  # type: ignore[attr-defined]
