"""Keep the frontend showing the kernel busy while a blocking launch (or ``%%ranks`` cell) runs.

JupyterLab asks the kernel things on the control channel while a cell runs (its debugger's
``debug_request``, the widget manager's ``create_subshell_request``). ipykernel answers them on
its control thread and publishes ``busy`` then ``idle`` for each, and JupyterLab shows the last
status it saw: Idle, for most of a launch whose cell is still ``[*]`` (measured: 59 of 62
samples during a 15 s launch). :class:`BusyBeacon` publishes the running cell's ``busy`` again
once a second (what ipykernel itself published when the cell started) for as long as the
launch holds the cell, the wait for a warming fork server included.
"""

from __future__ import annotations

import threading
from typing import Any

INTERVAL = 1.0  # seconds between two busy statuses


class BusyBeacon:
    """While the block runs, re-publish the running cell's busy status from a small thread;
    nothing outside a kernel's main thread (a background launch must not make the kernel
    look busy). The thread is joined before the block ends, so the cell's own final idle is
    always the last status.

    Example::

        with BusyBeacon():
            launch.run()
    """

    def __init__(self, interval: float = INTERVAL) -> None:
        self.interval = interval
        self._done = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> BusyBeacon:
        if threading.current_thread() is not threading.main_thread():
            return self
        kernel = _kernel()
        parent = kernel.get_parent("shell") if kernel is not None else None
        if parent:
            self._thread = threading.Thread(
                target=self._beat, args=(kernel, parent), name="nbaccel-busy", daemon=True
            )
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        if self._thread is not None:
            self._thread.join()

    def _beat(self, kernel: Any, parent: dict[str, Any]) -> None:
        while not self._done.wait(self.interval):
            kernel._publish_status("busy", "shell", parent=parent)


def _kernel() -> Any:
    """The ipykernel kernel of this process, or ``None`` (no kernel, or one too old)."""
    from nbaccel.core.kernel import in_kernel

    if not in_kernel():
        return None
    import sys

    kernel = getattr(sys.modules["IPython"].get_ipython(), "kernel", None)
    needed = ("_publish_status", "get_parent")
    return kernel if all(hasattr(kernel, n) for n in needed) else None
