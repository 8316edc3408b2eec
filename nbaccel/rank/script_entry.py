"""What each rank runs under ``nbaccel launch``: the user's script, plus a failure report.

torch.distributed.run starts ``python -u -m nbaccel.rank.script_entry SCRIPT ARGS...`` on every rank
(``-m MODULE ARGS...`` for modules). This runs SCRIPT as ``__main__`` exactly as ``python SCRIPT``
would (argv, ``sys.path[0]``), and if it raises, writes the exception to torch elastic's error
file (``TORCHELASTIC_ERROR_FILE``, the format ``ProcessFailure`` reads) so the launcher can show
the rank's own traceback instead of a bare exit code.

The traceback is trimmed to start at the user's code; the launcher prints it once in its final
summary. Run outside a launcher (no error file), the traceback goes to stderr as usual.

Containment (Linux, :mod:`nbaccel.rank.script_guard`): the worker process elastic starts is a
guard and the script runs in its child, so nothing the script starts outlives the rank, and
the rank dies with the launcher even when the launcher is SIGKILLed.
"""

from __future__ import annotations

import builtins
import json
import os
import runpy
import sys
import time

from nbaccel.core.atomic import atomic_write
from nbaccel.core.config import ENV_LAUNCHER
from nbaccel.rank import debugger, exit, script_guard, torch_fixes, tqdm_hook

USAGE = "usage: python -m nbaccel.rank.script_entry SCRIPT [ARGS...] | -m MODULE [ARGS...]"

# Frames of these files come before the user's code and say nothing useful to a reader.
# (runpy's frames are named "<frozen runpy>" in Python 3.11+.)
_PLUMBING = (os.path.abspath(__file__), os.path.abspath(runpy.__file__), "<frozen runpy>")


def _is_plumbing(filename: str) -> bool:
    return filename in _PLUMBING or os.path.abspath(filename) in _PLUMBING


def user_traceback(exc: BaseException) -> str:
    """The formatted exception, starting at the first frame that is not launcher plumbing."""
    return exit.user_traceback(exc, _is_plumbing)


def write_error_file(path: str, exc: BaseException) -> None:
    """Record ``exc`` where torch elastic's agent looks for a rank's failure.

    The ``message``/``extraInfo`` layout is what ``ProcessFailure`` parses; the ``nbaccel`` entry
    keeps the type, message and a sub-second time apart so the summary can be exact.
    """
    kind = type(exc)
    now = time.time()
    data = {
        "message": {
            "message": f"{kind.__name__}: {exc}",
            "extraInfo": {
                "py_callstack": user_traceback(exc),
                "timestamp": str(int(now)),
                "nbaccel": {
                    "exc_type": f"{kind.__module__}.{kind.__qualname__}",
                    "exc_message": str(exc),
                    "time": now,
                },
            },
        }
    }
    # Written whole and renamed, so the agent never reads half a file.
    with atomic_write(path, "w", encoding="utf-8") as f:
        json.dump(data, f)


def _run(argv: list[str]) -> None:
    if argv and argv[0] == "-m":
        if len(argv) < 2:
            raise SystemExit(USAGE)
        sys.argv = argv[1:]  # sys.path[0] is already the working directory, as `python -m` has
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        return
    script = argv[0]
    sys.argv = list(argv)
    # `python script.py` puts the script's folder first on sys.path; do the same.
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    runpy.run_path(script, run_name="__main__")


def main(argv: list[str] | None = None) -> int:
    """Run the script given in ``argv`` and return the process exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv:
        print(USAGE, file=sys.stderr)
        return 2
    # This module is not the user's __main__: drop its own folder entry from sys.path.
    if sys.path and sys.path[0] in ("", os.getcwd()) and argv[0] != "-m":
        sys.path.pop(0)
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    torch_fixes.keep_destroyed_process_groups_alive()
    # tqdm bars redraw with carriage returns, which garble per-rank labelled log lines; as
    # nbaccel bars they print whole lines a few seconds apart instead (NBACCEL_TQDM=0: off).
    tqdm_hook.install_worker_hooks()
    debugger.install(fallback_input=builtins.input)  # breakpoint(): pdb on the launcher's terminal
    raised = None
    try:
        _run(argv)
    except BaseException as exc:  # noqa: BLE001 - every failure is reported to the launcher
        raised = exc
    code, failure = exit.outcome(raised)
    if failure is None:
        return code
    if isinstance(failure, SystemExit):
        if isinstance(failure.code, int):
            return code
        print(failure.code, file=sys.stderr)  # sys.exit("message") prints it, as Python does
    elif not error_file or os.environ.get(ENV_LAUNCHER) != "cli":
        # Plain torchrun shows no summary of its own worth reading: print it here.
        sys.stderr.write(user_traceback(failure))
    if error_file:
        write_error_file(error_file, failure)
    return code


if __name__ == "__main__":
    # End without interpreter teardown, where torch's process-group destructors can deadlock
    # (see torch_fixes); the script's atexit hooks still run. On Linux the script runs below a
    # guard process that stops everything it leaves, even when the launcher is SIGKILLed.
    script_guard.run_guarded(lambda: exit.leave(main()))
