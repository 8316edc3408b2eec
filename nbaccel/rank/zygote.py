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
  IPython (log handlers and patched functions pointing there are reset, see below). It keeps
  every inherited object alive (``gc.freeze``), so no finaliser runs on a closed (or reused)
  descriptor;
- a module whose import was under way at that instant (``nbaccel`` itself: the fork happens
  inside its import) has its import lock held for good, so another thread importing it would
  wait forever: such modules are forgotten and imported afresh;
- GNU OpenMP cannot survive a fork (a child's next multi-threaded matmul hangs). The kernel
  releases its pool right before the fork (``core.openmp``), or does not fork;
- CUDA: the kernel forks only while CUDA's driver is not loaded in it (``is_available()`` loads
  it, too). CUDA initialised later in the kernel is not in the zygote, so ranks can use the GPU.

A rank must still see the world as it is at *its* launch: ``rank.twin`` sets the kernel's
environment, ``sys.path``, working directory and RNG states per launch, as for the ordinary
server. Modules the kernel may change during a session (its own cells, files in its folders,
editable installs, anything but the standard library and torch's own dependencies) are dropped
here and imported afresh by each rank, so an edited and reloaded module is the new one; a kept
module that holds kernel-side objects (``getpass.getpass`` replaced by ipykernel, torch.hub's
notebook progress bar) is imported afresh here. Each kind of process state is reset by
``rank.kernel_state``.
"""

from __future__ import annotations

import atexit
import builtins
import gc
import importlib
import multiprocessing.forkserver
import os
import signal
import sys
import traceback
import types
import warnings
from typing import NoReturn

from nbaccel.core import mp_internals, proctitle
from nbaccel.rank import kernel_state as state

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
# Whose objects make a kept module the kernel's (a kept module holding one is imported anew):
# the kernel's own packages, and tqdm's notebook bars (they draw through the kernel).
KERNEL_SIDE = frozenset(
    {
        "IPython",
        "ipykernel",
        "ipywidgets",
        "comm",
        "zmq",
        "jupyter_client",
        "jupyter_core",
        "traitlets",
        "tornado",
        "debugpy",
        "pydevd",
        "_pydevd_bundle",
        "matplotlib_inline",
    }
)
NOTEBOOK_BARS = ("tqdm.notebook", "tqdm.autonotebook", "tqdm.auto")


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
    gc.freeze()  # nothing inherited is ever collected (see kernel_state.INHERITED)
    state.close_inherited_fds(keep_fds)
    kernel_streams = state.fresh_streams_and_hooks()
    state.fresh_signals()
    state.fresh_builtins()
    state.fresh_sys_state()
    state.fresh_exit_hooks()
    state.fresh_asyncio()
    state.fresh_multiprocessing()
    state.fresh_logging(kernel_streams)
    forget = _modules_to_forget()
    anew = {n: sys.modules[n] for n in _kept_but_the_kernels(forget)}
    _forget_modules(forget | set(anew))
    _forget_warning_filters(forget)
    importlib.invalidate_caches()
    for name, old in sorted(anew.items()):  # parents first
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - better the kernel's copy than none at all
            sys.modules[name] = old
            parent, _, child = name.rpartition(".")
            if parent in sys.modules:
                setattr(sys.modules[parent], child, old)
    state.fresh_torch_modes()
    state.allow_inherited_depth()
    mp_internals.reset_forkserver_lock()


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
    forever; forgotten, it is imported anew.

    Kept although not kept by name: packages that defined torch operators (``torch.library``);
    the operators stay registered here, and importing the package again would register them
    twice (an error).
    """
    importing = set()
    locks = importlib._bootstrap._module_locks  # type: ignore[attr-defined]
    for name, ref in list(locks.items()):
        lock = ref()
        if lock is not None and getattr(lock, "owner", None) is not None:
            importing.add(name)
            del locks[name]
    packages = tuple(f"{name}." for name in importing)
    forget = {n for n in sys.modules if n in importing or n.startswith(packages)}
    candidates = {n for n in sys.modules if not _keep_module(n)} - forget
    kinds = _operator_kinds()
    with_operators = {n.partition(".")[0] for n in candidates if _holds(n, kinds)}
    return forget | {n for n in candidates if n.partition(".")[0] not in with_operators}


def _operator_kinds() -> tuple[type, ...]:
    """The classes of torch's operator definitions a module may hold (``torch.library.Library``,
    ``@torch.library.custom_op``'s ``CustomOpDef``), as far as this torch has them."""
    torch = sys.modules.get("torch")
    custom_ops = getattr(getattr(torch, "_library", None), "custom_ops", None)
    found = (
        getattr(getattr(torch, "library", None), "Library", None),
        getattr(custom_ops, "CustomOpDef", None),
    )
    return tuple(k for k in found if isinstance(k, type))


def _holds(name: str, kinds: tuple[type, ...]) -> bool:
    module = sys.modules.get(name)
    if not kinds or module is None:
        return False
    return any(issubclass(type(v), kinds) for v in list(vars(module).values()))


def _kept_but_the_kernels(forget: set[str]) -> set[str]:
    """Kept modules that hold a function, class or module of the kernel's side (a patched
    ``getpass.getpass``, torch.hub's notebook bar): to be imported afresh."""
    kernel = {
        n for n in forget if n.partition(".")[0] in KERNEL_SIDE or n.startswith(NOTEBOOK_BARS)
    }
    if not kernel:
        return set()
    owned = (types.FunctionType, types.MethodType, types.BuiltinFunctionType)
    anew = set()
    for name, module in list(sys.modules.items()):
        if name in forget or module is None or name in ("sys", "builtins"):
            continue  # (those two are reset in place: kernel_state.fresh_builtins/_sys_state)
        for value in list(vars(module).values()):
            kind = type(value)
            if issubclass(kind, types.ModuleType):  # type(), not isinstance: see below
                origin = value.__name__
            elif kind in owned or issubclass(kind, type):
                origin = getattr(getattr(value, "__func__", value), "__module__", None)
            else:
                continue
            if origin in kernel:
                anew.add(name)
                break
    return anew


def _forget_modules(forget: set[str]) -> None:
    state.INHERITED.append({n: sys.modules[n] for n in forget if n in sys.modules})
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
