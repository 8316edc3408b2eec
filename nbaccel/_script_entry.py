"""What each rank runs under ``nbaccel launch``: the user's script, plus a failure report.

torch.distributed.run starts ``python -u -m nbaccel._script_entry SCRIPT ARGS...`` on every rank
(``-m MODULE ARGS...`` for modules). This runs SCRIPT as ``__main__`` exactly as ``python SCRIPT``
would (argv, ``sys.path[0]``), and if it raises, writes the exception to torch elastic's error
file (``TORCHELASTIC_ERROR_FILE``, the format ``ProcessFailure`` reads) so the launcher can show
the rank's own traceback instead of a bare exit code.

The traceback is trimmed to start at the user's code; the launcher prints it once in its final
summary. Run outside a launcher (no error file), the traceback goes to stderr as usual.
"""

from __future__ import annotations

import atexit
import json
import os
import runpy
import sys
import time
import traceback

from nbaccel import _torch_fixes, _tqdm_hook
from nbaccel.config import ENV_LAUNCHER

USAGE = "usage: python -m nbaccel._script_entry SCRIPT [ARGS...] | -m MODULE [ARGS...]"

# Frames of these files come before the user's code and say nothing useful to a reader.
# (runpy's frames are named "<frozen runpy>" in Python 3.11+.)
_PLUMBING = (os.path.abspath(__file__), os.path.abspath(runpy.__file__), "<frozen runpy>")


def _is_plumbing(filename: str) -> bool:
    return filename in _PLUMBING or os.path.abspath(filename) in _PLUMBING


def user_traceback(exc: BaseException) -> str:
    """The formatted exception, starting at the first frame that is not launcher plumbing."""
    tb = exc.__traceback__
    while tb is not None and _is_plumbing(tb.tb_frame.f_code.co_filename):
        tb = tb.tb_next
    return "".join(traceback.format_exception(type(exc), exc, tb))


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
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(data, f)
    os.replace(tmp, path)


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
    _torch_fixes.keep_destroyed_process_groups_alive()
    # tqdm bars redraw with carriage returns, which garble per-rank labelled log lines; as
    # nbaccel bars they print whole lines a few seconds apart instead (NBACCEL_TQDM=0: off).
    _tqdm_hook.install_worker_hooks()
    try:
        _run(argv)
    except SystemExit as exc:
        if exc.code in (None, 0):
            return 0
        if isinstance(exc.code, int):
            return exc.code
        print(exc.code, file=sys.stderr)  # sys.exit("message") prints it, as Python does
        if error_file:
            write_error_file(error_file, exc)
        return 1
    except BaseException as exc:  # noqa: BLE001 - every failure is reported to the launcher
        if error_file:
            write_error_file(error_file, exc)
        if not error_file or os.environ.get(ENV_LAUNCHER) != "cli":
            # Plain torchrun shows no summary of its own worth reading: print it here.
            sys.stderr.write(user_traceback(exc))
        return 1
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
    return 0


if __name__ == "__main__":
    _status = main()
    # End without interpreter teardown, where torch's process-group destructors can deadlock
    # (see nbaccel/_torch_fixes.py); the script's atexit hooks still run.
    atexit._run_exitfuncs()
    for _stream in (sys.stdout, sys.stderr):
        try:
            _stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(_status)
