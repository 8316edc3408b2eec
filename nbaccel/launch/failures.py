"""How a failure is put into words, the same in a notebook and under ``nbaccel launch``: how a
rank ended, which rank caused a failure first, a crash report without the frames every rank has.

>>> describe_exit(-11)
'was killed by signal SIGSEGV (segmentation fault)'
>>> describe_exit(3)
'exited with code 3'
>>> describe_raise("builtins.ValueError", "bad lr")
'raised ValueError: bad lr'

Name the rank that caused a failure first, not the rank that noticed it. When one rank leaves a
collective early (it returned, called ``sys.exit(0)``, crashed), the others fail in the backend
with "Connection closed by peer", a reset or a timeout, and that failure often reaches the
kernel first. :func:`order` puts a real failure before such connection
errors, and :func:`cause` says which rank had already ended when only connection errors remain.

>>> is_connection_error("torch.distributed.DistBackendError", "[pair.cc:534] Connection closed by peer")
True
>>> is_connection_error("builtins.ValueError", "bad lr")
False
>>> cut("x" * 200, 20)
'xxxxxxxxxxxxxxxxxxx…'
"""

from __future__ import annotations

import re
import signal

_CONNECTION = re.compile(
    r"connection (closed|reset|refused)|broken pipe|econnreset|epipe|nccl|timed out|timeout"
    r"|socket closed",
    re.IGNORECASE,
)
_BACKEND_TYPES = ("DistBackendError", "DistNetworkError", "DistStoreError")

ERROR_LINE_WIDTH = 100  # characters of a failure kept for a summary-table cell


def is_connection_error(exc_type: str | None, message: str) -> bool:
    """Whether a rank's failure is the backend noticing that another rank went away."""
    if exc_type and exc_type.rsplit(".", 1)[-1] in _BACKEND_TYPES:
        return True
    return bool(exc_type) and bool(_CONNECTION.search(message or ""))


def cut(text: str, width: int = ERROR_LINE_WIDTH) -> str:
    """The first line of ``text``, cut to ``width`` characters (ending in "…" when cut)."""
    line = text.strip().splitlines()[0] if text.strip() else text
    return line if len(line) <= width else line[: width - 1] + "…"


def without_plumbing(crash_report: str, entry_file: str | None = None) -> str:
    """A rank's crash report (faulthandler's stacks) without the frames every rank has below
    the user's code: multiprocessing's, and everything older than the process's start
    (``BaseProcess._bootstrap``, or on a cluster the frame of ``entry_file``, the file its rank
    processes start in: ``Cluster.rank_entry_file``): the fork server's loop and, where the
    server is a fork of the kernel, the kernel's own frames it was forked in; on a cluster
    node, ``python -m``'s.

    >>> report = ['  File "/x.py", line 3 in train', '  File "/py/multiprocessing/process.py"',
    ...           '  File "/py/multiprocessing/process.py", line 314 in _bootstrap',
    ...           '  File "/py/IPython/core/interactiveshell.py", line 3823 in run_code']
    >>> without_plumbing(chr(10).join(report))
    '  File "/x.py", line 3 in train'
    """
    lines, started = [], False
    for line in crash_report.splitlines():
        frame = line.strip().startswith("File ")
        if not frame:
            started = False  # the next thread's stack begins
        elif (
            started
            or (entry_file is not None and entry_file in line)
            or (_PROCESS_START in line and line.rstrip().endswith(" in _bootstrap"))
        ):
            started = True
            continue
        elif "/multiprocessing/" in line or line.strip().startswith('File "<string>"'):
            continue
        lines.append(line)
    return "\n".join(lines)


_PROCESS_START = "/multiprocessing/process.py"


def order(failures: list[tuple[int, object]]) -> list[tuple[int, object]]:
    """Failures in the order to report them: real failures first, connection errors after."""
    return sorted(failures, key=lambda f: _is_connection(f[1]))  # stable: arrival order kept


def _is_connection(error: object) -> bool:
    exc_type = getattr(error, "exc_type", None)
    original = getattr(error, "original", None)
    message = str(original) if original is not None else getattr(error, "summary", "")
    return is_connection_error(exc_type, message)


def cause(failed_rank: int, error: object, ended: dict[int, str]) -> str | None:
    """ "rank 1 exited (code 0) while rank 0 was still in a collective", or ``None``.

    ``ended`` maps ranks that ended without failing to how they ended ("returned",
    "exited (code 0)").
    """
    if not _is_connection(error):
        return None
    others = sorted(k for k in ended if k != failed_rank)
    if not others:
        return None
    first = others[0]
    return f"rank {first} {ended[first]} while rank {failed_rank} was still in a collective"


def describe_exit(exitcode: int | None) -> str:
    """Say in words how a process ended, e.g. "was killed by signal SIGSEGV"."""
    if exitcode is None:
        return "is still running"
    if exitcode < 0:
        try:
            sig = signal.Signals(-exitcode)
        except ValueError:
            return f"was killed by signal {-exitcode}"
        text = signal.strsignal(sig) or ""
        return f"was killed by signal {sig.name}" + (f" ({text.lower()})" if text else "")
    return f"exited with code {exitcode}"


def describe_raise(exc_type: str, message: str) -> str:
    """Say which exception a rank raised: ``exc_type`` is qualified (``"builtins.KeyError"``)."""
    name = exc_type.removeprefix("builtins.")
    return f"raised {name}: {message}" if message else f"raised {name}"
