"""Worker-side progress bars and metric logging: events under a launch, plain output elsewhere.

``progress()`` wraps an iterable (or is used as a context manager with ``.update(n)``, like tqdm);
under ``notebook_launcher`` it sends ``events.Progress`` to the kernel, at most ~10 times a second
per bar and always once more on close. ``log()`` sends ``events.Metrics``, sampled at the same
rate (the latest value of each name). Neither ever blocks the
training loop on a slow kernel: an intermediate update is skipped, and logged metrics are held back,
while the event pipe is full. ``nbaccel.rank.tqdm_hook`` makes tqdm bars in a rank report the same
way, without code changes (``NBACCEL_TQDM=0`` turns that off).

Both are called in the innermost loop, so their hot paths do no clock reads and no tensor work: under
a launch a daemon thread advances a tick every ``EMIT_INTERVAL`` (as tqdm's own monitor thread
does) and a bar or ``log()`` compares one integer to see whether a report is due; a logged tensor is
held as it is and read (``.item()``, a device sync on a GPU) only when it is sent.

This module runs in the ranks: it never imports IPython, ipywidgets or the views.
"""

from __future__ import annotations

import collections
import itertools
import math
import os
import sys
import threading
import time
from collections.abc import Iterable, Iterator
from typing import Any

from nbaccel.core import events
from nbaccel.rank import settings_report

EMIT_INTERVAL = 0.1  # seconds between progress events of one bar (the final state always goes)
TEXT_INTERVAL = 0.1  # seconds between redraws of the plain-text bar outside a launch
LINE_INTERVAL = 2.0  # seconds between progress lines where the output is not a terminal
_MAX_BACKLOG = 10_000  # logged metrics held while the kernel is behind; the oldest go first

_bar_ids = itertools.count()
_backlog: collections.deque[events.Metrics] = collections.deque(maxlen=_MAX_BACKLOG)
_pending: dict[str, tuple[int | None, Any]] = {}  # name -> latest (step, value) not yet sent
_metrics_seen_tick = -1  # the tick at which metrics were last sent
# log() calls so far in this rank: the step of a call without step= (W&B counts so). Values
# are sent sampled, so the kernel cannot count the calls itself: a 60-step loop's chart ended
# at step 30 when it numbered what arrived.
_log_calls = [0]

# Advanced by the ticker thread every EMIT_INTERVAL (a list so hot loops read it without a global
# lookup); started by the first bar or log() under a launch, again in a forked child.
_tick = [0]
_ticker_pid: int | None = None
_ticker_lock = threading.Lock()


def _ensure_ticker() -> None:
    """Start this process's tick thread once (a forked child starts its own)."""
    global _ticker_pid
    if _ticker_pid == os.getpid():
        return
    with _ticker_lock:
        if _ticker_pid != os.getpid():
            _ticker_pid = os.getpid()
            thread = threading.Thread(target=_run_ticker, name="nbaccel-tick", daemon=True)
            thread.start()


def _run_ticker() -> None:
    # Only sleeps and bumps an int: it holds no lock a fork could inherit mid-operation.
    while True:
        time.sleep(EMIT_INTERVAL)
        _tick[0] += 1


def _after_fork_in_child() -> None:
    """A forked child (e.g. a DataLoader worker) has no tick thread: make every bar and log()
    due once, so their next report starts one."""
    global _ticker_lock
    _ticker_lock = threading.Lock()
    _tick[0] += 1


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


class ProgressBar:
    """A tqdm-like bar; see :func:`progress`. ``n`` counts steps, ``total`` may be ``None``."""

    def __init__(
        self,
        iterable: Iterable[Any] | None = None,
        total: int | None = None,
        desc: str | None = None,
        unit_scale: float | None = None,
        *,
        disable: bool = False,
        file: Any = None,
    ) -> None:
        if total is None and iterable is not None:
            try:
                total = len(iterable)  # type: ignore[arg-type]
            except (TypeError, AttributeError):
                total = None
        if not _stepping_only and not disable:
            _step_aside()  # the function shows its own progress: the optimizer's count goes
        self.iterable = iterable
        self.total = total
        self.desc = desc
        self.unit_scale = unit_scale
        self.n = 0
        self.closed = disable
        self.bar_id = next(_bar_ids)
        self.rank = events.current_rank()
        self._file = file
        self._start = time.monotonic()
        # Outside a launch: the next time (monotonic) at which the text bar is redrawn. Under a
        # launch: the tick of the last report; the hot path compares only the tick.
        self._next_at = 0.0
        self._seen = -1
        self._width = 0
        if not disable:
            self._report(force=True)
            if self.rank is not None:
                settings_report.report_accelerate()  # a Trainer's bar starts after its Accelerator

    # -- tqdm's surface ---------------------------------------------------------------------

    def __iter__(self) -> Iterator[Any]:
        if self.iterable is None:
            raise TypeError("progress() was given no iterable; use it with .update(n) instead.")
        if self.closed:
            yield from self.iterable
            return
        n = self.n
        try:
            if self.rank is None:
                clock = time.monotonic
                for item in self.iterable:
                    yield item
                    n += 1
                    if clock() >= self._next_at:
                        self.n = n
                        self._report()
            else:
                tick, seen = _tick, self._seen
                for item in self.iterable:
                    yield item
                    n += 1
                    if tick[0] != seen:
                        self.n = n
                        self._report()
                        seen = self._seen
        finally:
            self.n = n
            self.close()

    def __len__(self) -> int:
        if self.total is None:
            raise TypeError("this progress bar has no total")
        return self.total

    def __enter__(self) -> ProgressBar:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def update(self, n: int = 1) -> None:
        """Count ``n`` more steps (reported at a bounded rate)."""
        self.n += n
        if not self.closed and self.due():
            self._report()

    def due(self) -> bool:
        """Whether a report is due now; wrappers that count steps themselves (the tqdm hook)
        check this before :meth:`report`."""
        if self.rank is not None:
            return _tick[0] != self._seen
        return time.monotonic() >= self._next_at

    def report(self) -> None:
        """Send the current state to the kernel now."""
        if not self.closed:
            self._report()

    def set_description(self, desc: str | None = None) -> None:
        self.desc = desc

    def reset(self, total: int | None = None) -> None:
        self.n, self._start = 0, time.monotonic()
        if total is not None:
            self.total = total
        self._next_at, self._seen = 0.0, -1

    def close(self) -> None:
        """Report the final state (always sent) and stop reporting."""
        if self.closed:
            return
        self.closed = True
        self._report(force=True, closed=True)

    # -- reporting --------------------------------------------------------------------------

    @property
    def elapsed(self) -> float:
        return time.monotonic() - self._start

    def _report(self, force: bool = False, closed: bool = False) -> None:
        now = time.monotonic()
        if self.rank is None:
            interactive = self._draw_text(now, closed)
            self._next_at = now + (TEXT_INTERVAL if interactive else LINE_INTERVAL)
            return
        event = events.Progress(
            rank=self.rank,
            bar_id=self.bar_id,
            n=self.n,
            total=self.total,
            desc=self.desc,
            elapsed=now - self._start,
            closed=closed,
            unit_scale=self.unit_scale,
        )
        if closed:
            flush()  # metrics logged before the bar ended arrive before it does
        elif _pending:  # logged since the last send (e.g. once per epoch): with this progress,
            _ship(self.rank, block=False)  # not with the next log() call an epoch later
        events.emit(event, block=force)
        self._seen = _tick[0]
        _ensure_ticker()

    def _draw_text(self, now: float, closed: bool) -> bool:
        """Outside a launch: on a terminal, one line redrawn in place like tqdm's plain bar;
        into a pipe or file (logs, ``nbaccel launch``'s per-rank labels) whole lines, a few
        seconds apart, since carriage returns would garble them. Reports which it drew."""
        stream = self._file or sys.stderr
        text = format_bar(self.n, self.total, self.desc, now - self._start, self.unit_scale)
        try:
            interactive = stream.isatty()
        except (AttributeError, ValueError):
            interactive = False
        try:
            if interactive:
                pad = " " * max(0, self._width - len(text))
                self._width = len(text)
                stream.write("\r" + text + pad + ("\n" if closed else ""))
            else:
                stream.write(text + "\n")
            stream.flush()
        except (OSError, ValueError):
            pass
        return interactive


def format_bar(
    n: int, total: int | None, desc: str | None, elapsed: float, unit_scale: float | None = None
) -> str:
    """``desc: 40%|████      | 4/10 [00:01<00:02, 3.1 it/s]`` (shorter without a total)."""
    rate = n / elapsed if elapsed > 0 and n else None
    head = f"{desc}: " if desc else ""
    speed = f"{rate:.1f} it/s" if rate else "? it/s"
    if rate and unit_scale:
        speed += f", {rate * unit_scale:.1f} samples/s"
    if total:
        frac = min(1.0, n / total)
        filled = int(frac * 20)
        eta = _clock((total - n) / rate) if rate else "?"
        return (
            f"{head}{frac:4.0%}|{'█' * filled}{' ' * (20 - filled)}| {n}/{total} "
            f"[{_clock(elapsed)}<{eta}, {speed}]"
        )
    return f"{head}{n} [{_clock(elapsed)}, {speed}]"


def _clock(seconds: float) -> str:
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes:02d}:{secs:02d}"


def progress(
    iterable: Iterable[Any] | None = None,
    total: int | None = None,
    desc: str | None = None,
    unit_scale: float | None = None,
) -> ProgressBar:
    """A progress bar for a loop: this rank's row in the launch dashboard, plain text elsewhere.

    ``total`` defaults to ``len(iterable)``; ``unit_scale`` is the number of samples per step
    (e.g. the batch size), so the dashboard can show samples/s too.

    In a rank: ``for batch in nbaccel.progress(loader, desc="epoch 1", unit_scale=32): ...``.
    Outside a launch (here) it draws a plain bar on stderr:

    >>> sum(progress(range(4), desc="epoch 1"))
    6
    >>> with progress(total=1000) as bar:
    ...     bar.update(10)
    >>> bar.n, bar.closed
    (10, True)
    """
    return ProgressBar(iterable, total=total, desc=desc, unit_scale=unit_scale)


def _as_float(name: str, value: Any) -> float:
    if hasattr(value, "item"):  # tensors and numpy scalars, without importing either
        value = value.item()
    try:
        return float(value)
    except (TypeError, ValueError):
        raise TypeError(
            f"log() needs numbers; {name}={value!r} ({type(value).__name__}) is not one."
        ) from None


# What log() knows about a value's type after seeing one: _NUMBER (always converts, e.g. float,
# int, numpy.float32: held as given) or _TENSOR (has .numel(): one element checked per call).
# Other types go through _admit on every call (0-d arrays, and non-numbers, which raise there).
_NUMBER, _TENSOR = 1, 2
_kinds: dict[type, int] = {float: _NUMBER, int: _NUMBER, bool: _NUMBER}


def _admit(name: Any, value: Any) -> Any:
    """The slow path of log() for a value of a type not seen yet: check it, learn its type."""
    kind = type(value)
    if hasattr(value, "detach") and hasattr(value, "numel"):
        _kinds[kind] = _TENSOR
        if value.numel() != 1:
            raise TypeError(f"log() needs numbers; {name} is a tensor of {value.numel()} elements.")
        return value
    number = _as_float(str(name), value)
    scalar = getattr(value, "ndim", 0) == 0 and kind.__name__ != "ndarray"
    if scalar and (isinstance(value, (int, float)) or kind.__module__ == "numpy"):
        _kinds[kind] = _NUMBER  # numpy scalars, int/float subclasses: always convert
    return number


def log(values: dict[str, Any], step: int | None = None) -> None:
    """Record metrics for this rank (shown in the dashboard's chart); a no-op outside a launch.

    Values may be numbers or one-element tensors. Cheap enough to call every step (well under a
    microsecond): the latest value of each name is sent at most ``EMIT_INTERVAL`` apart (a
    faithful sample of the curve), a tensor is read only when it is sent (not on every call, which
    would wait for the GPU), and sending never waits for a busy kernel. NaN values are dropped.

    In a training loop: ``nbaccel.log({"loss": loss, "lr": scheduler.get_last_lr()[0]},
    step=step)``; without ``step=`` a call's step is how many calls came before it on this rank. What a background launch recorded, as ``launch.metrics()`` returns it:

    >>> import nbaccel
    >>> def train():
    ...     for step in range(3):
    ...         nbaccel.log({"loss": 1 / (step + 1)}, step=step)
    >>> launch = nbaccel.notebook_launcher(
    ...     train, num_processes=1, block=False, progress=False
    ... )  # doctest: +ELLIPSIS
    nbaccel: launching 1 process...
    >>> launch.result(timeout=120)
    >>> launch.metrics()[-1]
    {'step': 2, 'loss': 0.3333333333333333}
    """
    if events._channel is None:
        return
    if type(values) is not dict and not isinstance(values, dict):
        raise TypeError(f"log() takes a dict of name -> number, got {type(values).__name__}.")
    kinds, pending = _kinds, _pending
    if step is None:
        step = _log_calls[0]
    _log_calls[0] += 1
    for name, value in values.items():
        kind = kinds.get(type(value))
        if kind is _TENSOR:
            if value.numel() != 1:
                raise TypeError(
                    f"log() needs numbers; {name} is a tensor of {value.numel()} elements."
                )
        elif kind is None:
            value = _admit(name, value)
        pending[name if type(name) is str else str(name)] = (step, value)
    global _metrics_seen_tick
    if _tick[0] != _metrics_seen_tick:
        _ensure_ticker()
        _metrics_seen_tick = _tick[0]
        _ship(events._channel.rank, block=False)


def _ship(rank: int, block: bool) -> None:
    """Turn the pending values into events (one per step) and send what the pipe takes."""
    by_step: dict[int | None, dict[str, float]] = {}
    for name, (step, value) in _pending.items():
        number = _as_float(name, value)
        if not math.isnan(number):
            by_step.setdefault(step, {})[name] = number
    _pending.clear()
    for step, numbers in by_step.items():
        _backlog.append(events.Metrics(rank=rank, step=step, values=numbers))
    _drain(block=block)


def _drain(block: bool) -> None:
    while _backlog:
        if not events.emit(_backlog[0], block=block):
            return
        _backlog.popleft()


def flush() -> None:
    """Send metrics still held back (waiting for the kernel if it must), and the optimizer's
    step count's last state. The rank's entry point calls this before it reports its result."""
    global _step_bar
    rank = events.current_rank()
    if rank is not None:
        _ship(rank, block=True)
    bar, _step_bar = _step_bar, None  # a later ``%%ranks`` cell counts again
    if isinstance(bar, ProgressBar):
        bar.close()


# -- progress for loops that report none: the optimizer's steps ---------------------------------

# A loop ported as it is (no ``nbaccel.progress``, no tqdm) still steps an optimizer: torch's
# global step hook counts those steps as the rank's progress, so the rank's row has a count and a
# rate. The first bar the function opens itself takes over (``_step_aside``) for the rest of the
# function: its own bars say more (totals, epochs).
STEP_BAR_DESC = "optimizer steps"
_STEPPED_ASIDE = object()
_step_bar: Any = None  # None, the ProgressBar counting steps, or _STEPPED_ASIDE
_stepping_only = False  # set while the step bar itself is being made
_step_optimizer: int | None = None  # id() of the optimizer that is counted (the first to step)
_epoch_steps: int | None = None  # optimizer steps in the epoch a prepared loader started


def loader_started(batches: int | None, accumulation_steps: int = 1) -> None:
    """A prepared loader starts an epoch of ``batches``: the optimizer's step count (where it is
    the rank's progress) starts again, with ``batches / accumulation_steps`` as its total."""
    global _step_bar, _epoch_steps
    if _step_bar is _STEPPED_ASIDE or events._channel is None:
        return
    bar, _step_bar = _step_bar, None
    if isinstance(bar, ProgressBar):
        bar.close()  # the previous epoch's
    _epoch_steps = None if batches is None else -(-batches // max(1, accumulation_steps))


def _step_aside() -> None:
    global _step_bar
    bar, _step_bar = _step_bar, _STEPPED_ASIDE
    if isinstance(bar, ProgressBar):
        bar.close()


def _count_optimizer_step(optimizer: Any, args: Any = None, kwargs: Any = None) -> None:
    """torch's optimizer step post hook: one step of the rank's training (of the first optimizer
    that steps, so a GAN's two optimizers are not counted twice)."""
    global _step_bar, _stepping_only, _step_optimizer
    bar = _step_bar
    if bar is None:
        if events._channel is None:
            return
        _step_optimizer = id(optimizer)
        _stepping_only = True
        try:
            bar = _step_bar = ProgressBar(total=_epoch_steps, desc=STEP_BAR_DESC)
        finally:
            _stepping_only = False
    elif bar is _STEPPED_ASIDE or id(optimizer) != _step_optimizer:
        return
    bar.update(1)


def count_optimizer_steps(optimizer_module: Any) -> None:
    """Count the rank's optimizer steps as its progress (``torch.optim.optimizer`` given)."""
    optimizer_module.register_optimizer_step_post_hook(_count_optimizer_step)


# -- torch.compile: a long step that is no stall -------------------------------------------------


def _compile_started(*_: Any) -> None:
    rank = events.current_rank()
    if rank is not None:
        events.emit(events.Compiling(rank=rank, active=True))


def _compile_ended(*_: Any) -> None:
    rank = events.current_rank()
    if rank is not None:
        events.emit(events.Compiling(rank=rank, active=False))


def report_compiles(callback_module: Any) -> None:
    """Tell the kernel when ``torch.compile`` compiles in this rank (``torch._dynamo.callback``
    given), so a long first step is not shown as a stall."""
    handler = callback_module.callback_handler
    if _compile_started not in handler.start_callbacks:
        handler.register_start_callback(_compile_started)
        handler.register_end_callback(_compile_ended)
