"""A persistent rank's command loop: run the kernel's cells in this rank's own namespace.

:func:`serve` is the "training function" of a normal notebook rank (``rank.entry.run_rank`` runs
it), so output pipes, containment and the exit protocol are those of a launch. It connects to the
kernel's command socket, then runs each :class:`~nbaccel.persistent.messages.Command` and
answers with one ``Done``. SIGINT raises ``KeyboardInterrupt`` inside the cell's code only, once
per cell; between cells the rank ignores it. A watcher thread reports when the cell's code has
been waiting inside a torch.distributed call for a while (``Blocked``), so the kernel can tell a
collective that other ranks will never join from a slow cell. Never imports IPython.
"""

from __future__ import annotations

import ast
import bdb
import builtins
import copy
import linecache
import os
import pickle
import signal
import sys
import threading
import time
from multiprocessing.connection import Client
from typing import Any

from nbaccel.core import pickling
from nbaccel.persistent.messages import Blocked, Command, Done, Hello, cell_filename
from nbaccel.rank import debugger, entry, exit

BLOCKED_AFTER = 0.3  # seconds inside one torch.distributed call before the kernel is told
WATCH_INTERVAL = 0.1


class _Cell:
    """Whether cell code runs now; shared by the loop, the SIGINT handler and the watcher."""

    def __init__(self) -> None:
        self.number: int | None = None
        self.interrupted = False


def _on_sigint(cell: _Cell) -> Any:
    def handler(signum: int, frame: Any) -> None:
        # Only cell code is interrupted, and only once per cell: Jupyter's stop button reaches
        # the ranks directly (same process group) and through the kernel, which sends it again.
        if cell.number is not None and not cell.interrupted:
            cell.interrupted = True
            raise KeyboardInterrupt

    return handler


def serve(address: str) -> None:
    """Connect to the kernel at ``address`` (a Unix socket) and run its commands until "stop".

    Example (what ``nbaccel.Ranks`` ships as the rank's function)::

        notebook_launcher(serve, args=(address,), num_processes=2)
    """
    conn = Client(address, family="AF_UNIX")
    rank = int(os.environ.get("RANK", "0"))
    lock = threading.Lock()

    def send(message: Any) -> None:
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        with lock:
            conn.send_bytes(data)

    cell = _Cell()
    namespace = _main_namespace()
    signal.signal(signal.SIGINT, _on_sigint(cell))
    threading.Thread(
        target=_watch_collectives, args=(cell, rank, send), name="nbaccel-watch", daemon=True
    ).start()
    send(Hello(rank=rank, pid=os.getpid()))
    while True:
        try:
            command: Command = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            return  # the kernel has gone; the rank ends like a finished launch
        if command.kind == "stop":
            return
        done = _execute(command, namespace, cell, rank)
        exit.flush_output()  # output before the answer, so the kernel shows it in this cell
        try:
            send(done)
        except (BrokenPipeError, OSError):
            return


def _main_namespace() -> dict[str, Any]:
    """The namespace cells run in: ``__main__``'s, as in the kernel, so the functions the kernel
    pushes (their globals are ``__main__``'s, see ``pickling``) see the names cells assign, and
    a cell's function pickled again in the rank (``datasets``' ``map(num_proc=)``) is found in
    ``__main__``. The fork server's own ``-c`` line (it has no ``__file__``) leaves no names."""
    namespace = vars(sys.modules["__main__"])
    if "__file__" not in namespace:
        for name in [k for k in namespace if not k.startswith("__")]:
            del namespace[name]
    namespace.setdefault("__builtins__", builtins)
    return namespace


# The last failed cell's exception, its frames alive for a post-mortem ("debug" command) until
# the next command that is not one: a failed cell's locals (a GPU's activations) are not kept
# for longer than the notebook needs them.
_LAST_FAILURE: list[BaseException] = []


def _execute(command: Command, namespace: dict[str, Any], cell: _Cell, rank: int) -> Done:
    done = Done(rank=rank, cell=command.cell)
    if command.kind != "debug":
        _LAST_FAILURE.clear()
    cell.interrupted = False
    cell.number = command.cell
    try:
        try:
            value = _dispatch(command, namespace, done)
        finally:
            cell.number = None
        if command.kind == "run" and value is not None:
            namespace["_"] = value
            done.value_repr = _safe_repr(value)
        if value is not None and (command.kind != "run" or command.want_value):
            done.value = _pickle_value(value, command.kind)
    except BaseException as exc:  # noqa: BLE001 - every failure goes to the kernel
        # pdb quits (BdbQuit) when the interrupt reaches a rank at its prompt
        done.interrupted = isinstance(exc, (KeyboardInterrupt, bdb.BdbQuit)) and cell.interrupted
        if done.interrupted:
            _drop_handler_frame(exc)
        elif command.kind != "debug":
            _LAST_FAILURE[:] = [exc]
        done.failure = exit.failure_event(exc, rank, _is_plumbing)
    done.names = _summary(namespace)
    done.device, done.gpu_memory = _device()
    return done


def _drop_handler_frame(exc: BaseException) -> None:
    """The kernel's interrupt is raised in this module's SIGINT handler: the traceback shown
    for it ends in the user's line, not in nbaccel's handler frame."""
    tb, last = exc.__traceback__, None
    while tb is not None and tb.tb_next is not None:
        last, tb = tb, tb.tb_next
    if last is not None and tb is not None and _is_plumbing(tb.tb_frame.f_code.co_filename):
        last.tb_next = None


def _pickle_value(value: Any, kind: str) -> bytes:
    """The value for the kernel, on the CPU, without touching the rank's own objects.

    A model is copied before it is moved (``.cpu()`` moves a module in place, which would take
    the rank's model off its GPU). A "run" value that cannot be pickled comes back as its repr:
    the cell itself worked; only "call" and "pull", which ask for the value, fail on it.
    """
    if _has_module(value):
        value = copy.deepcopy(value)
    try:
        return pickling.dumps(entry._to_cpu(value))
    except Exception:
        if kind != "run":
            raise
        return pickling.dumps(_safe_repr(value))


def _has_module(value: Any) -> bool:
    torch = sys.modules.get("torch")
    if torch is None:
        return False
    if isinstance(value, torch.nn.Module):
        return True
    if isinstance(value, dict):
        return any(_has_module(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(_has_module(v) for v in value)
    return False


def _dispatch(command: Command, namespace: dict[str, Any], done: Done) -> Any:
    if command.kind == "run":
        return run_code(command.code or "", namespace, cell_filename(command.cell))
    if command.kind == "call":
        function = pickling.loads(command.function)
        args = pickling.loads(command.args) if command.args else ()
        return function(*args)
    if command.kind == "push":
        for name, data in (command.values or {}).items():
            namespace[name] = pickling.loads(data)
        return None
    if command.kind == "debug":
        if not _LAST_FAILURE:
            raise LookupError(
                "this rank has no failed cell to debug: %debug opens the frames of the last "
                "cell that failed here, until the next cell runs"
            )
        debugger.post_mortem(_LAST_FAILURE[0])
        return None
    if command.kind == "pull":
        missing = [n for n in command.names or [] if n not in namespace]
        if missing:
            raise NameError(f"name {missing[0]!r} is not defined on this rank")
        return [namespace[n] for n in command.names or []]
    raise ValueError(f"unknown command {command.kind!r}")


def run_code(code: str, namespace: dict[str, Any], filename: str) -> Any:
    """Run ``code`` in ``namespace`` as a notebook cell: return its final expression's value.

    >>> ns = {}
    >>> run_code("x = 2\\nx * 21", ns, "<cell>")
    42
    """
    tree = ast.parse(code, filename, "exec")
    # The source is kept so that tracebacks show the cell's lines, as IPython does.
    lines = code.splitlines(keepends=True)
    linecache.cache[filename] = (len(code), None, lines, filename)
    last = tree.body[-1] if tree.body and isinstance(tree.body[-1], ast.Expr) else None
    if last is not None:
        tree.body.pop()
    exec(compile(tree, filename, "exec"), namespace)
    if last is None:
        return None
    return eval(compile(ast.Expression(last.value), filename, "eval"), namespace)


def _is_plumbing(filename: str) -> bool:
    return filename in (__file__, entry.__file__)


def _safe_repr(value: Any, limit: int = 2000) -> str:
    try:
        text = repr(value)
    except Exception as exc:  # noqa: BLE001 - a broken __repr__ must not fail the cell
        text = f"<{type(value).__name__} object; repr failed: {exc}>"
    return text if len(text) <= limit else text[:limit] + " ..."


def _summary(namespace: dict[str, Any]) -> dict[str, str]:
    """Name -> type name of the user's names, for Tab completion in the kernel."""
    return {
        k: type(v).__name__
        for k, v in namespace.items()
        if not k.startswith("_") and k not in ("In", "Out")
    }


def _device() -> tuple[str, int | None]:
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():
        return "cpu", None
    index = torch.cuda.current_device()
    return f"cuda:{index}", int(torch.cuda.memory_allocated(index))


def _watch_collectives(cell: _Cell, rank: int, send: Any) -> None:
    """Tell the kernel when cell code waits inside one torch.distributed call, and when not."""
    main = threading.main_thread().ident
    reported: tuple[int, str] | None = None
    seen: tuple[int, str] | None = None
    since = 0.0
    while True:
        time.sleep(WATCH_INTERVAL)
        number = cell.number
        frame = sys._current_frames().get(main) if number is not None else None
        op, where = _collective(frame) if frame is not None else (None, "")
        now_key = (number, op) if op is not None and number is not None else None
        if now_key != seen:
            seen, since = now_key, time.monotonic()
        try:
            if (
                now_key is not None
                and now_key != reported
                and time.monotonic() - since > BLOCKED_AFTER
            ):
                send(Blocked(rank=rank, cell=now_key[0], op=now_key[1], where=where))
                reported = now_key
            elif reported is not None and now_key != reported:
                send(Blocked(rank=rank, cell=reported[0], op=None))
                reported = None
        except (BrokenPipeError, OSError):
            return


def _collective(frame: Any) -> tuple[str | None, str]:
    """The torch.distributed function the stack is in (innermost), and the cell line calling it."""
    op, where = None, ""
    while frame is not None:
        code = frame.f_code
        filename = code.co_filename.replace("\\", "/")
        if op is None and "/torch/distributed/" in filename and not code.co_name.startswith("_"):
            if code.co_name != "wrapper":
                op = code.co_name
        elif op is not None and filename.startswith("<rank cell"):
            where = f"line {frame.f_lineno} of the cell"
            break
        frame = frame.f_back
    return op, where
