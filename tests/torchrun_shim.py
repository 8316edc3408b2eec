"""Run a script as a plain torchrun worker, then end the process without interpreter teardown.

Why: on torch 2.13 (CPU build) a worker under ``torch.distributed.run`` aborts in interpreter
teardown in roughly 1 run of 3 on this 2-core machine ("terminate called without an active
exception", SIGABRT), after the script has finished and written its results. It happens with a
torch-only training loop that never creates a process group, and never when the same script runs
directly under ``python``, so it is not what the tests that use this shim are about (they check
what the script computed under torchrun). nbaccel's own rank entry points end the same way:
atexit hooks, flushed output, ``os._exit``.

Usage: ``python -m torch.distributed.run ... tests/torchrun_shim.py SCRIPT [ARGS...]``
"""

import atexit
import os
import runpy
import sys
import traceback


def main() -> None:
    script = sys.argv[1]
    sys.argv = sys.argv[1:]
    sys.path[0] = os.path.dirname(os.path.abspath(script))  # as `python SCRIPT` would have it
    code = 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:  # noqa: BLE001 - reported like an uncaught exception, exit status 1
        traceback.print_exc()
        code = 1
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":  # not when pytest imports this file for its doctests
    main()
