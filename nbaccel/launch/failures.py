"""How a rank's end is put into words, the same in a notebook and under ``nbaccel launch``.

>>> describe_exit(-11)
'was killed by signal SIGSEGV (segmentation fault)'
>>> describe_exit(3)
'exited with code 3'
>>> describe_raise("builtins.ValueError", "bad lr")
'raised ValueError: bad lr'
"""

from __future__ import annotations

import signal


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
