"""Exceptions the kernel raises when a launch goes wrong, each naming the rank and the cause."""

from __future__ import annotations

import pickle

from nbaccel.core.child_failed import fill_failures, rank_failed_class


class UsageError(Exception):
    """A command-line flag or file cannot work; nothing was started. The message says why."""


class UserInterrupt(KeyboardInterrupt):
    """Stop, Ctrl-C or pdb's ``q`` ended a launch or a ``%%ranks`` cell; the message says what
    was stopped and what lives on. A ``KeyboardInterrupt`` as the notebook names it (``ename``),
    shown as that one line: the frames under it (``Launch._attempt``, the magic, the cell's
    ``get_ipython().run_cell_magic(...)``) are nbaccel's, not the user's.

    >>> UserInterrupt("launch interrupted; all 2 ranks were stopped")._render_traceback_()
    ['KeyboardInterrupt: launch interrupted; all 2 ranks were stopped']
    >>> isinstance(UserInterrupt(), KeyboardInterrupt), type(UserInterrupt()).__name__
    (True, 'KeyboardInterrupt')
    """

    def _render_traceback_(self) -> list[str]:
        """What IPython shows instead of a traceback."""
        return [f"KeyboardInterrupt: {self}"]


# What a notebook's error names (ipykernel's ename, IPython's header): what was pressed.
UserInterrupt.__name__ = UserInterrupt.__qualname__ = "KeyboardInterrupt"


class LaunchError(RuntimeError):
    """Base class for a launch that did not finish normally.

    >>> issubclass(RankFailedError, LaunchError), issubclass(LaunchTimeoutError, TimeoutError)
    (True, True)
    """

    def _render_traceback_(self) -> list[str]:
        """What IPython shows: rank frames as ``Cell In[n]`` with source, no nbaccel frames."""
        from nbaccel.core.local_traceback import render_launch_error

        return render_launch_error(self)


class RankFailedError(LaunchError):
    """A rank raised, exited with an error code, or was killed by a signal.

    Attributes:
        rank: the global rank that failed first.
        exc_type: the qualified name of the rank's exception type (``"builtins.ValueError"``),
            or ``None`` when the rank died without raising (signal or exit code).
        original: the rank's exception object re-created in the kernel, when it unpickles.
        remote_traceback: the rank's formatted traceback (or crash report) as text.
        exitcode: the process exit code (negative: killed by that signal).
        other_failures: short descriptions of ranks that failed after the first one.
        cause: what another rank did first when this failure is only its consequence, e.g.
            "rank 1 exited (code 0) while rank 0 was still in a collective"; it leads the
            message.

    Where torch elastic's errors module is loaded (code that says ``except ChildFailedError``,
    as written for Accelerate), the error is a ``ChildFailedError`` too (``core.child_failed``).

    >>> import os, nbaccel
    >>> def train():
    ...     if os.environ["RANK"] == "1":
    ...         raise ValueError("bad batch")
    >>> try:  # doctest: +ELLIPSIS
    ...     nbaccel.notebook_launcher(train, num_processes=2, progress=False)
    ... except RankFailedError as error:
    ...     print(error.rank, error.exc_type, repr(error.original))
    nbaccel: launching 2 processes...
    1 builtins.ValueError ValueError('bad batch')
    """

    def __new__(cls, *args: object, **kwargs: object) -> RankFailedError:
        return super().__new__(rank_failed_class(cls) if cls is RankFailedError else cls, *args)

    def __init__(
        self,
        rank: int,
        world_size: int,
        summary: str,
        remote_traceback: str = "",
        exc_type: str | None = None,
        original: BaseException | None = None,
        exitcode: int | None = None,
        other_failures: tuple[str, ...] = (),
        cause: str | None = None,
    ) -> None:
        self.cause = cause
        self.rank = rank
        self.world_size = world_size
        self.summary = summary
        self.remote_traceback = remote_traceback
        self.exc_type = exc_type
        self.original = original
        self.exitcode = exitcode
        self.other_failures = other_failures
        super().__init__(self._message())
        fill_failures(self)

    def _message(self) -> str:
        text = f"rank {self.rank} (of {self.world_size}) {self.summary}"
        if self.cause:
            text = f"{self.cause}; rank {self.rank} (of {self.world_size}) then {self.summary}"
        if self.remote_traceback:
            from nbaccel.core.local_traceback import with_cell_names

            body = with_cell_names(self.remote_traceback.rstrip("\n"))
            text += (
                f"\n\n--- rank {self.rank} traceback ---\n{body}\n--- end of rank {self.rank} ---"
            )
        if self.other_failures:
            text += "\nAlso failed afterwards: " + "; ".join(self.other_failures)
        return text

    def __reduce__(self):
        return (
            _rebuild_rank_failed,
            (
                self.rank,
                self.world_size,
                self.summary,
                self.remote_traceback,
                self.exc_type,
                self.exitcode,
                self.other_failures,
                self.cause,
            ),
        )


def _rebuild_rank_failed(rank, world_size, summary, tb, exc_type, exitcode, others, cause=None):
    return RankFailedError(rank, world_size, summary, tb, exc_type, None, exitcode, others, cause)


class LaunchTimeoutError(LaunchError, TimeoutError):
    """The launch ran past ``timeout=``; the message lists the ranks still running and their stacks.

    >>> import nbaccel, time
    >>> def wait_forever():
    ...     while True:
    ...         time.sleep(0.01)
    >>> try:  # doctest: +ELLIPSIS
    ...     nbaccel.notebook_launcher(wait_forever, num_processes=2, timeout=1.5, progress=False)
    ... except LaunchTimeoutError as error:
    ...     print(error.running, "in wait_forever" in error.stacks[1])
    nbaccel: launching 2 processes...
    [0, 1] True
    """

    def __init__(self, timeout: float, running: list[int], stacks: dict[int, str]) -> None:
        self.timeout = timeout
        self.running = running
        self.stacks = stacks
        ranks = ", ".join(map(str, running))
        text = (
            f"the launch did not finish within timeout={timeout:g} s; still running: rank {ranks}."
        )
        for rank in running:
            stack = stacks.get(rank, "").strip() or "(no stack received)"
            text += f"\n\n--- rank {rank} stack at timeout ---\n{stack}"
        super().__init__(text)

    def __reduce__(self):
        return (LaunchTimeoutError, (self.timeout, self.running, self.stacks))


class LaunchStoppedError(LaunchError):
    """A background launch was stopped with ``Launch.stop()``; its ranks were stopped and reaped.

    >>> import nbaccel, time
    >>> launch = nbaccel.notebook_launcher(
    ...     time.sleep, args=(60,), num_processes=2, block=False, progress=False
    ... )  # doctest: +ELLIPSIS
    nbaccel: launching 2 processes...
    >>> launch.stop()
    >>> try:
    ...     launch.result()
    ... except LaunchStoppedError as error:
    ...     print(error.world_size, launch.status)
    2 interrupted
    """

    def __init__(self, world_size: int, elapsed: float) -> None:
        self.world_size, self.elapsed = world_size, elapsed
        super().__init__(
            f"the launch was stopped with stop() after {elapsed:.1f} s; all {world_size} ranks "
            "were stopped and nothing they started is running. Start it again to run it."
        )

    def _render_traceback_(self) -> list[str]:
        return [f"LaunchStoppedError: {self}"]

    def __reduce__(self):
        return (LaunchStoppedError, (self.world_size, self.elapsed))


def load_exception(data: bytes | None) -> BaseException | None:
    """Unpickle a rank's exception, or ``None`` if that is not possible in the kernel."""
    if data is None:
        return None
    try:
        exc = pickle.loads(data)
    except Exception:
        return None
    return exc if isinstance(exc, BaseException) else None
