"""Persistent ranks: start N ranks once, then run cell after cell on all of them.

A :class:`Ranks` session is a normal launch whose training function is a command loop
(``nbaccel.persistent.serve.serve``): the same plan, environment, fork server, containment and
per-rank pipes as ``notebook_launcher``, plus one command socket per rank. Each rank keeps its
own namespace, with ``accelerator = nbaccel.Accelerator()`` (the process group formed: gloo on
CPU, NCCL with one GPU per rank), ``torch`` and ``dist`` (``torch.distributed``) ready.
:class:`Ranks` shows it at work; ``with nbaccel.Ranks(...) as ranks:`` stops them at its end.
"""

from __future__ import annotations

import contextlib
import functools
import os
import pickle
import shutil
import socket
import tempfile
import time
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection
from types import TracebackType
from typing import Any, TypeVar

from nbaccel.core import pickling
from nbaccel.core.containment import sigint_deferred
from nbaccel.core.errors import RankFailedError, UserInterrupt
from nbaccel.core.local_traceback import is_nbaccel_file
from nbaccel.launch.lifecycle import RankLifecycle
from nbaccel.launch.options import UNSET, LaunchOptions
from nbaccel.launch.plan import LaunchPlan
from nbaccel.launch.protocols import STOP_GRACE, View
from nbaccel.launch.relay import Relay, load_payload
from nbaccel.launch.state import Outcome
from nbaccel.persistent.cell import (
    CellError,
    CellTimeoutError,
    RanksBrokenError,
    finish_state,
    reset_state,
    run_command,
)
from nbaccel.persistent.cell_view import CellView
from nbaccel.persistent.messages import Command, Done
from nbaccel.persistent.start import SETUP_CODE, CellTextView, accept_ranks, session_plan
from nbaccel.persistent.status import StatusTable, rank_rows
from nbaccel.ui import wants_widgets
from nbaccel.ui.busy import BusyBeacon

Method = TypeVar("Method", bound=Callable[..., Any])


def lets_go_on_error(method: Method) -> Method:
    """An error leaving ``method`` holds no reference to the session: nbaccel's frames (where
    ``self`` is a local; IPython hides them anyway) are taken out of its traceback and of those
    of the errors chained to it.

    IPython keeps the last error for ``%debug`` (``sys.last_traceback``) until the next one,
    and a session an error holds is never collected: running ``r = nbaccel.Ranks(2)`` again
    after one of its cells failed left the old ranks running, with no handle to stop them.
    """

    @functools.wraps(method)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        __tracebackhide__ = True
        try:
            return method(*args, **kwargs)
        except BaseException as exc:
            del args, kwargs  # this frame stays in the traceback: it must not hold the session
            _drop_nbaccel_frames(exc)
            raise

    return wrapper  # type: ignore[return-value]


def _drop_nbaccel_frames(exc: BaseException) -> None:
    """Take nbaccel's frames out of the tracebacks of ``exc`` and of the errors chained to it
    (the frames of the user's code, a ``__reduce__`` that failed in ``push``, stay)."""
    seen: set[int] = set()
    pending: list[BaseException | None] = [exc]
    while pending:
        error = pending.pop()
        if error is None or id(error) in seen:
            continue
        seen.add(id(error))
        error.__traceback__ = _without_nbaccel_frames(error.__traceback__)
        pending += [error.__cause__, error.__context__]


def _without_nbaccel_frames(tb: TracebackType | None) -> TracebackType | None:
    kept = []
    while tb is not None:
        if not is_nbaccel_file(tb.tb_frame.f_code.co_filename):
            kept.append(tb)
        tb = tb.tb_next
    rebuilt = None
    for entry in reversed(kept):
        rebuilt = TracebackType(rebuilt, entry.tb_frame, entry.tb_lasti, entry.tb_lineno)
    return rebuilt


class Ranks:
    """N ranks that stay alive across cells.

    ``num_processes``, ``mixed_precision``, ``start_method`` and ``env`` mean what they mean
    for ``notebook_launcher``; ``strategy`` ("ddp", "fsdp", ...) goes to each rank's
    Accelerator; ``timeout`` (seconds) is the default limit per cell; ``gpus`` (e.g. ``[0, 1]``)
    maps rank i to the i-th listed GPU; ``progress`` picks the view as for a launch.

    >>> import nbaccel, os
    >>> ranks = nbaccel.Ranks(num_processes=2, progress=False)
    >>> ranks.run("x = torch.ones(2) * (accelerator.process_index + 1)")  # each rank's value
    [None, None]
    >>> ranks.run("dist.all_reduce(x); x")
    [tensor([3., 3.]), tensor([3., 3.])]
    >>> ranks.pull("x")  # the same, tensors on the CPU
    [tensor([3., 3.]), tensor([3., 3.])]
    >>> ranks.push(lr=0.1)  # into each rank's namespace
    >>> ranks.run("lr * 10")
    [1.0, 1.0]
    >>> ranks.call(lambda: os.environ["RANK"])  # a function of the kernel's, on every rank
    ['0', '1']
    >>> ranks.stop()
    """

    def __init__(
        self,
        num_processes: int | None = UNSET,
        mixed_precision: str | None = UNSET,
        strategy: str | None = None,
        timeout: float | None = None,
        *,
        gpus: Sequence[int] | None = None,
        start_method: str = "auto",
        env: dict[str, str | None] | None = None,
        progress: bool | str = True,
        start: bool = True,
    ) -> None:
        if timeout is not None and (not isinstance(timeout, (int, float)) or timeout <= 0):
            raise ValueError(
                f"timeout must be a positive number of seconds or None, got {timeout!r}."
            )
        self.options = LaunchOptions(
            num_processes=num_processes,
            mixed_precision=mixed_precision,
            strategy=strategy,
            start_method=start_method,
            env=env,
            progress=progress,
        )
        self.gpus = list(gpus) if gpus is not None else None
        self.timeout = timeout
        self._names: dict[int, dict[str, str]] = {}  # rank -> its names' types, after each cell
        self.running: tuple[str, float] | None = None  # (first line of the cell, started at)
        self.broken: str | None = None
        self._plan: LaunchPlan | None = None
        self._life: RankLifecycle | None = None  # the ranks' start and teardown
        self._connections: dict[int, Connection] = {}
        self._devices: dict[int, tuple[str, int | None]] = {}
        self._cell = 0
        self._tmpdir: str | None = None
        if start:
            self.start()

    # -- lifecycle --------------------------------------------------------------------------

    @property
    def _relay(self) -> Relay | None:
        """The relay reading the ranks, once they have started."""
        return self._life.relay if self._life is not None else None

    @property
    def started(self) -> bool:
        return self._relay is not None

    @property
    def names(self) -> dict[str, str]:
        """Name -> type name of what the ranks define (as of each rank's last command), for Tab."""
        merged: dict[str, str] = {}
        for names in self._names.values():
            merged.update(names)
        return merged

    @property
    def world_size(self) -> int:
        return len(self._plan.specs) if self._plan else 0

    @property
    def pids(self) -> list[int]:
        return [r.pid for r in self._relay.group.ranks] if self._relay else []

    @lets_go_on_error
    def start(self) -> Ranks:
        """Start the ranks and form the process group; returns once every rank is ready."""
        __tracebackhide__ = True
        if self.started:
            raise RuntimeError(
                f"{self.world_size} ranks are already running (pids {self.pids}); call stop() "
                "(`%ranks stop`) first, or restart() (`%ranks restart`)."
            )
        self.broken, self._names, self._cell = None, {}, 0
        self._tmpdir = tempfile.mkdtemp(prefix="nbaccel-ranks-")
        address = os.path.join(self._tmpdir, "commands")
        server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            server.bind(address)
            server.listen()
            self._plan = session_plan(self.options, self.gpus, address)
            # One process per rank, each serving its own command socket (the cell view
            # replaces this text view from the first cell on).
            self._life = RankLifecycle(self._plan, CellTextView(), xla_threads=False)
            with BusyBeacon():  # it may wait for a warming fork server
                relay = self._life.start()
            self._connections = accept_ranks(server, relay)
            self._set_up()
        except KeyboardInterrupt:
            # Whatever phase it hit (a cell-interrupt message says the ranks live on), the
            # start is abandoned: nothing of it is left.
            self._shutdown(grace=0)
            raise UserInterrupt(
                "%ranks start interrupted; the ranks that had started were stopped"
            ) from None
        except BaseException:
            self._shutdown(grace=0)
            raise
        finally:
            server.close()
            # Every rank has connected (or the start is abandoned): the socket's folder goes
            # now, not at stop(), which a kernel shut down with its ranks running never
            # reaches (each such shutdown left an nbaccel-ranks-* folder behind).
            shutil.rmtree(self._tmpdir, ignore_errors=True)
        return self

    def _set_up(self) -> None:
        """Form the process group and make ``accelerator`` on every rank."""
        __tracebackhide__ = True
        try:
            self._run(Command(cell=0, kind="run", code=SETUP_CODE), None, None)
        except CellError as exc:
            raise RankFailedError(
                exc.rank,
                exc.world_size,
                f"failed while starting (Accelerator(), process group): {exc.summary}",
                exc.remote_traceback,
                exc_type=exc.exc_type,
                original=exc.original,
                other_failures=exc.other_failures,
            ) from None

    def stop(self) -> None:
        """Stop every rank (each leaves its command loop; stragglers get SIGTERM, then SIGKILL)."""
        self.broken = None  # once stopped on purpose, the session is simply not running
        if not self.started:
            return
        for conn in self._connections.values():
            with contextlib.suppress(OSError):
                conn.send_bytes(pickle.dumps(Command(cell=-1, kind="stop")))
        self._shutdown(grace=STOP_GRACE)

    @lets_go_on_error
    def restart(self) -> Ranks:
        """Stop the ranks (if any) and start fresh ones with the same settings."""
        self.stop()
        return self.start()

    def _shutdown(self, grace: float) -> None:
        # Teardown is not cut short by Ctrl-C (that could leave ranks unreaped); it is raised after.
        with sigint_deferred():
            self._tear_down(grace)

    def _tear_down(self, grace: float) -> None:
        if self._life is not None:  # the ranks had ``grace`` s to leave their command loops
            self._life.end(wait=grace, grace=min(grace, 1.0))
        for conn in self._connections.values():
            with contextlib.suppress(OSError):
                conn.close()
        if self._tmpdir:
            shutil.rmtree(self._tmpdir, ignore_errors=True)
        self._life, self._connections, self._tmpdir = None, {}, None

    def __enter__(self) -> Ranks:
        if not self.started:
            self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __del__(self) -> None:
        # Checked first, and no module global used: at interpreter exit the collector runs this
        # after modules were cleared (``contextlib`` is None by then) for sessions long stopped.
        if getattr(self, "_life", None) is None:
            return
        try:
            self._shutdown(grace=0)
        except Exception:  # noqa: BLE001, S110 - a finaliser must not raise; nothing to tell
            pass

    # -- commands ---------------------------------------------------------------------------

    @lets_go_on_error
    def run(
        self,
        code: str,
        ranks: Sequence[int] | None = None,
        timeout: float | None = UNSET,
        *,
        values: bool = True,
        on_reply: Callable[[Done], None] | None = None,
        kernel_cell: tuple[int, str] | None = None,
    ) -> list[Any]:
        """Run ``code`` on every (or the listed) rank; return each rank's final-expression value.

        Values come back on the CPU (models as copies); one that cannot be pickled comes back
        as its ``repr``. With ``values=False`` the values stay on the ranks and their ``repr``
        strings are returned instead (what ``%%ranks`` shows as ``[rankN] Out:``).
        ``kernel_cell``: the notebook cell the code is from, as ``(n of In[n], its text)``, so
        tracebacks name it and show its lines.

        Example::

            ranks.run("accelerator.process_index")     # -> [0, 1]
        """
        __tracebackhide__ = True
        done = self._run(
            Command(
                cell=0,
                kind="run",
                code=code,
                want_value=values,
                kernel_cell=kernel_cell[0] if kernel_cell else None,
                kernel_source=kernel_cell[1] if kernel_cell else None,
            ),
            ranks,
            timeout,
            on_reply,
        )
        if not values:
            return [d.value_repr for d in done]
        return [load_payload(d.rank, d.value) for d in done]

    @lets_go_on_error
    def call(
        self, function: Callable[..., Any], *args: Any, ranks: Sequence[int] | None = None
    ) -> list[Any]:
        """Call ``function(*args)`` on each rank (cloudpickled); return the values in rank order."""
        __tracebackhide__ = True
        command = Command(
            cell=0, kind="call", function=pickling.to_ranks(function), args=pickling.to_ranks(args)
        )
        return [load_payload(d.rank, d.value) for d in self._run(command, ranks, UNSET)]

    @lets_go_on_error
    def pull(self, name: str, ranks: Sequence[int] | None = None) -> list[Any]:
        """Each rank's value of ``name`` (tensors moved to the CPU), in rank order."""
        __tracebackhide__ = True
        done = self._run(Command(cell=0, kind="pull", names=[name]), ranks, UNSET)
        return [load_payload(d.rank, d.value)[0] for d in done]

    @lets_go_on_error
    def push(self, ranks: Sequence[int] | None = None, **values: Any) -> None:
        """Give every (or the listed) rank these names, e.g. ``ranks.push(lr=0.1)``."""
        __tracebackhide__ = True
        payload = {}
        for name, value in values.items():
            try:
                payload[name] = pickling.to_ranks(value)
            except Exception as exc:
                raise TypeError(
                    f"{name!r} ({type(value).__name__}) cannot be sent to the ranks: {exc}. "
                    "Push plain data, tensors or a state_dict, or create it on the ranks in a "
                    "%%ranks cell."
                ) from exc
        self._run(Command(cell=0, kind="push", values=payload), ranks, UNSET)

    @lets_go_on_error
    def debug(self, rank: int) -> None:
        """Open pdb in the notebook on ``rank``'s last failed cell: its real frames and
        locals, alive on the rank (``%debug`` after a ``CellError`` does this)."""
        __tracebackhide__ = True
        self._run(Command(cell=0, kind="debug"), [rank], None)

    def status(self) -> StatusTable:
        """Per rank: pid, device, memory, state (idle, or running which cell for how long)."""
        return StatusTable(rank_rows(self))

    def _run(
        self, command: Command, ranks: Sequence[int] | None, timeout: Any, on_reply=None
    ) -> list[Done]:
        __tracebackhide__ = True
        if self.broken:
            raise RanksBrokenError(self.broken)
        if not self.started:
            raise RuntimeError(
                "the ranks are not running. Run `%ranks start -n 2` (Python: Ranks(2))."
            )
        selected = self._select(ranks)
        self._cell += 1
        command.cell = self._cell
        limit = self.timeout if timeout is UNSET else timeout
        relay = self._relay

        def notify(done: Done) -> None:
            self._note(done)
            if on_reply is not None:
                on_reply(done)

        reset_state(relay.state, selected)
        relay.view = CellTextView() if command.cell == 1 else self._view(selected)
        self.running = (_first_line(command), time.monotonic())
        relay.view.start(relay.state)
        outcome = Outcome.FAILED
        try:
            with BusyBeacon():
                done = run_command(relay, self._connections, command, selected, limit, notify)
            outcome = Outcome.FINISHED
        except CellTimeoutError:
            outcome = Outcome.TIMED_OUT
            raise
        except KeyboardInterrupt:
            outcome = Outcome.INTERRUPTED
            raise
        except RanksBrokenError as exc:
            self.broken = exc.reason
            self._shutdown(grace=0)
            raise
        finally:
            self.running = None
            finish_state(relay.state, outcome)
            relay.view.finish()
        return [done[r] for r in selected]

    def _note(self, done: Done) -> None:
        self._names[done.rank] = done.names
        self._devices[done.rank] = (done.device, done.gpu_memory)

    def _select(self, ranks: Sequence[int] | None) -> list[int]:
        everyone = [s.rank for s in self._plan.specs]
        if ranks is None:
            return everyone
        chosen = sorted({int(r) for r in ranks})
        bad = [r for r in chosen if r not in everyone]
        if bad or not chosen:
            raise ValueError(f"no rank {bad or chosen}: the ranks are {everyone}.")
        return chosen

    def _view(self, ranks: list[int]) -> View:
        """A cell's view: the cell's output like a local cell's (``persistent.cell_view``)."""
        progress = self.options.progress
        return CellView(ranks, widgets=wants_widgets(progress), show_progress=progress is not False)

    def __repr__(self) -> str:
        if not self.started:
            what = f"broken: {self.broken}" if self.broken else "not running"
        else:
            what = self._plan.info.describe()
        return f"<nbaccel.Ranks {what}>"


def _first_line(command: Command) -> str:
    """What ``%ranks status`` says a rank runs: the cell's first line, or the command's kind."""
    lines = (command.code or "").strip().splitlines()
    return lines[0][:60] if lines else command.kind
