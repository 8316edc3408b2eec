"""IPython magics for persistent ranks: ``%ranks`` (start, stop, status, ...) and ``%%ranks``.

Registered by ``%load_ext nbaccel`` and when ``nbaccel`` is imported in IPython. This module
imports only IPython at load time; the rank machinery loads with the first ``%ranks start``.

Example (notebook cells)::

    %ranks start -n 2
    %%ranks
    x = torch.ones(2) * accelerator.process_index
    x                               # [rank0] Out: tensor([0., 0.])  [rank1] Out: ...
    %ranks pull x                   # the kernel's x: [tensor([0., 0.]), tensor([1., 1.])]
    %ranks auto on                  # every cell runs on the ranks; %%local cells in the kernel
"""

from __future__ import annotations

import argparse
import ast
import atexit
import contextlib
import shlex
from collections.abc import Iterator
from typing import Any

from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_cell_magic, magics_class

USAGE = """\
%ranks start -n N [--mixed_precision bf16] [--strategy ddp] [--timeout S] [--gpus 0,1]
%%ranks [--rank 0,1] [--timeout S]     run the cell on every (or the listed) rank
%ranks pull NAME ...                   NAME = [each rank's value] in the kernel
%ranks push NAME ...                   every rank gets the kernel's NAME
%ranks status | stop | restart | auto on|off"""


def _words(line: str) -> list[str]:
    """A magic's arguments as the shell would split them: a trailing ``# comment`` is dropped
    (IPython hands line magics the whole rest of the line, comment included).

    >>> _words("start -n 2  # gloo on CPU")
    ['start', '-n', '2']
    """
    return shlex.split(line, comments=True)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # argparse would exit the kernel's process
        raise UsageError(f"{self.prog}: {message}\n\n{USAGE}")


def _ints(text: str) -> list[int]:
    try:
        return [int(p) for p in text.replace(" ", "").split(",") if p]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected numbers like 0,1, got {text!r}") from None


def _seconds(text: str) -> float:
    value = float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive number of seconds, got {text!r}")
    return value


_START = _Parser(prog="%ranks start", add_help=False)
_START.add_argument("-n", "--num_processes", "--num-processes", type=int, default=None)
_START.add_argument("--mixed_precision", "--mixed-precision", default=None)
_START.add_argument("--strategy", default=None)
_START.add_argument("--timeout", type=_seconds, default=None)
_START.add_argument("--gpus", type=_ints, default=None)
_CELL = _Parser(prog="%%ranks", add_help=False)
_CELL.add_argument("--rank", "--ranks", type=_ints, default=None)
_CELL.add_argument("--timeout", type=_seconds, default=None)
AUTO_FLAG = "--auto-mode"  # what auto mode's transformer adds: the cell has no %%ranks line
_CELL.add_argument(AUTO_FLAG, action="store_true", help=argparse.SUPPRESS)


@magics_class
class RanksMagics(Magics):
    """``%ranks``/``%%ranks``; one session of persistent ranks per kernel."""

    def __init__(self, shell: Any) -> None:
        super().__init__(shell)
        self.session: Any = None  # nbaccel.persistent.session.Ranks
        self.auto = False
        self._start_args: dict[str, Any] = {}

    def debug_cell_error(self, error: BaseException | None) -> bool:
        """``%debug`` after a ``%%ranks`` cell failed: pdb on the failing rank's real frames
        (the ranks are alive); whether ``error`` was such a failure of the running session."""
        from nbaccel.persistent.cell import CellError

        if not isinstance(error, CellError) or self.session is None or not self.session.started:
            return False
        self.session.debug(error.rank)
        return True

    @line_cell_magic
    def ranks(self, line: str, cell: str | None = None) -> Any:
        __tracebackhide__ = True
        from nbaccel.core.errors import LaunchError

        try:
            if cell is not None:
                return self._run_cell(line, cell)
            return self._line(line)
        except (LaunchError, KeyboardInterrupt) as exc:
            # The message says everything (rank, traceback, what to do); the kernel-side
            # frames of the session machinery would only bury it.
            raise exc.with_traceback(None) from None

    def _line(self, line: str) -> Any:
        __tracebackhide__ = True
        words = _words(line)
        if not words:
            raise UsageError(USAGE)
        command, rest = words[0], words[1:]
        handler = getattr(self, f"_cmd_{command}", None)
        if handler is None:
            raise UsageError(f"unknown %ranks command {command!r}.\n\n{USAGE}")
        return handler(rest)

    # -- subcommands ------------------------------------------------------------------------

    def _cmd_start(self, words: list[str]) -> None:
        __tracebackhide__ = True
        from nbaccel.launch.plan import UNSET
        from nbaccel.persistent.session import Ranks

        if self.session is not None and self.session.started:
            s = self.session
            raise UsageError(
                f"{s.world_size} ranks are already running (pids {s.pids}). Run `%ranks stop` "
                "first, or `%ranks restart` to start them again with the same settings."
            )
        a = _START.parse_args(words)
        self._start_args = dict(
            num_processes=a.num_processes if a.num_processes is not None else UNSET,
            mixed_precision=a.mixed_precision if a.mixed_precision is not None else UNSET,
            strategy=a.strategy,
            timeout=a.timeout,
            gpus=a.gpus,
        )
        how_many = f"{a.num_processes} ranks" if a.num_processes is not None else "the ranks"
        with _starting(f"nbaccel: starting {how_many}… "):
            try:
                self.session = Ranks(**self._start_args)
            except ValueError as exc:  # a ConfigError: a bad -n, --strategy, --mixed_precision
                raise UsageError(f"%ranks start: {exc}\n\n{USAGE.splitlines()[0]}") from None
        s = self.session
        counted = "" if a.num_processes is not None else f"{s.world_size} ranks "
        print(f"{counted}ready ({s._plan.info.describe()})")

    def _cmd_restart(self, words: list[str]) -> None:
        __tracebackhide__ = True
        if self.session is None:
            raise UsageError("no ranks to restart; run `%ranks start -n 2` first.")
        with _starting(f"nbaccel: restarting {self.session.world_size} ranks… "):
            self.session.stop()
            self.session.start()
        print("ready")

    def _cmd_stop(self, words: list[str]) -> None:
        session = self.session
        if session is not None and session.started:
            n = session.world_size
            session.stop()
            print(f"nbaccel: {n} ranks stopped")
        elif session is not None and session.broken:  # stopped already, by what broke them
            print(
                f"nbaccel: no ranks to stop: they were stopped when they broke ({session.broken});"
                " `%ranks start` starts fresh ones"
            )
            session.stop()  # the session is now simply not running
        else:
            print("nbaccel: no ranks to stop (none are running)")
        self.auto = False

    def _cmd_status(self, words: list[str]) -> Any:
        from nbaccel.persistent.status import StatusTable, rank_rows

        return StatusTable(rank_rows(self.session))  # before a start as after a stop

    def _cmd_pull(self, words: list[str]) -> None:
        __tracebackhide__ = True
        if not words:
            raise UsageError("%ranks pull NAME ...: which names?")
        for name in words:
            self.shell.user_ns[name] = self._session().pull(name)

    def _cmd_push(self, words: list[str]) -> None:
        __tracebackhide__ = True
        missing = [n for n in words if n not in self.shell.user_ns]
        if not words or missing:
            raise UsageError(f"%ranks push NAME ...: {missing or 'which names?'} not defined here.")
        session = self._session()
        try:
            session.push(**{n: self.shell.user_ns[n] for n in words})
        except TypeError as exc:  # the value cannot be pickled: nothing was sent
            raise UsageError(f"%ranks push: {exc}") from None

    def _cmd_auto(self, words: list[str]) -> None:
        if words not in (["on"], ["off"]):
            raise UsageError("%ranks auto on|off")
        self.auto = words == ["on"]
        where = "on the ranks (start a cell with %%local to run it here)" if self.auto else "here"
        print(f"nbaccel: cells now run {where}")

    # -- cells ------------------------------------------------------------------------------

    def _run_cell(self, line: str, cell: str) -> None:
        __tracebackhide__ = True
        from nbaccel.core.local_traceback import running_cell
        from nbaccel.launch.plan import UNSET

        a = _CELL.parse_args(_words(line))
        timeout = a.timeout if a.timeout is not None else UNSET
        session = self._session()
        _refuse_kernel_syntax(cell)
        if session.started:
            try:
                session._select(a.rank)
            except ValueError as exc:
                raise UsageError(f"%%ranks --rank: {exc}") from None
        # A blank first line stands for the %%ranks line: tracebacks then count lines as the
        # notebook shows them, in the cell IPython names (Cell In[n]).
        number = running_cell()
        shown = cell if a.auto_mode else f"%%ranks {line}".rstrip() + "\n" + cell
        reprs = session.run(
            ("" if a.auto_mode else "\n") + cell,
            ranks=a.rank,
            timeout=timeout,
            values=False,
            kernel_cell=None if number is None else (number, shown),
        )
        ranks = a.rank if a.rank is not None else range(len(reprs))
        for rank, text in zip(sorted(set(ranks)), reprs, strict=True):
            if text is not None:
                print(f"[rank{rank}] Out: {text}")

    def _session(self) -> Any:
        if self.session is None:
            raise UsageError("no ranks are running; start them with `%ranks start -n 2`.")
        if not self.session.started and not self.session.broken:  # broken: its own message
            raise UsageError(
                "the ranks are not running (they were stopped); start them again with "
                "`%ranks restart` (same settings) or `%ranks start -n 2`."
            )
        return self.session

    def _stop_at_exit(self) -> None:
        if self.session is not None:
            self.session.stop()

    # -- auto mode and completion -----------------------------------------------------------

    def transform(self, lines: list[str]) -> list[str]:
        """Input transformer: in auto mode, run cells on the ranks unless they start %%local."""
        first = next((ln.strip() for ln in lines if ln.strip()), "")
        if first.startswith("%%local"):
            index = next(i for i, ln in enumerate(lines) if ln.strip())
            return lines[:index] + lines[index + 1 :]
        if not self.auto or not first or first.startswith(("%ranks", "%%ranks")):
            return lines
        return [f"%%ranks {AUTO_FLAG}\n", *lines]

    def complete(self, context: Any) -> dict[str, Any]:
        """Tab completion of the names defined on the ranks, with their types (IPython's
        matcher API v2; the kernel keeps each rank's name -> type summary after each cell)."""
        from IPython.core.completer import SimpleCompletion

        text = context.token
        names = self.session.names if self.session is not None and "." not in text else {}
        found = [
            SimpleCompletion(n, type=t) for n, t in sorted(names.items()) if n.startswith(text)
        ]
        return {"completions": found, "suppress": False}

    complete.matcher_api_version = 2  # what IPython's completion_matcher decorator would set


def register(shell: Any) -> RanksMagics:
    """Add the magics, the auto-mode transformer and the completer to ``shell`` (once)."""
    existing = getattr(shell, "_nbaccel_ranks_magics", None)
    if existing is not None:
        return existing
    magics = RanksMagics(shell)
    shell.register_magics(magics)
    shell.input_transformers_cleanup.append(magics.transform)
    shell.Completer.custom_matchers.append(magics.complete)
    shell._nbaccel_ranks_magics = magics
    from nbaccel.launch import post_mortem

    post_mortem.wrap_debug_magic(shell)  # %debug after a failed launch: the rank's frames
    post_mortem.LIVE.append(magics.debug_cell_error)  # ... after a %%ranks cell: alive ones
    atexit.register(magics._stop_at_exit)
    return magics


@contextlib.contextmanager
def _starting(text: str) -> Iterator[None]:
    """Say at once what takes seconds (the cell is not blank meanwhile); the caller ends the
    line when it is done, and an error starts on a line of its own."""
    print(text, end="", flush=True)
    try:
        yield
    except BaseException:
        print(flush=True)
        raise


def _refuse_kernel_syntax(cell: str) -> None:
    """Ranks run plain Python: a magic or shell escape line (which IPython only understands in
    the kernel) would be a bare SyntaxError on every rank; say what to do instead."""
    try:
        ast.parse(cell)
    except SyntaxError as exc:
        lines = cell.splitlines()
        line = lines[exc.lineno - 1].strip() if exc.lineno and exc.lineno <= len(lines) else ""
        if line.startswith(("%", "!")):
            raise UsageError(
                f"%%ranks line {exc.lineno}, {line!r}: ranks run plain Python, not IPython's "
                "magics and shell escapes. Run it in a cell of its own (it runs in the kernel), "
                "or call it from Python on the ranks (e.g. subprocess.run([...]))."
            ) from None
