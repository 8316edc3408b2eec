"""Views: how a launch is shown in the kernel. Only the kernel side imports this package.

A view gets the launch state and each rank's output lines; it decides how often to redraw.
``choose_view`` picks the widget dashboard where a widget frontend is attached and plain text
everywhere else (nbclient/nbval, terminal IPython, scripts).

May import: ``nbaccel.core``. Kernel side only: never imported inside a rank.
"""

from __future__ import annotations

from typing import Protocol

from nbaccel.core.launch_state import LaunchState


class View(Protocol):
    def start(self, state: LaunchState) -> None: ...

    def output(self, rank: int, stream: str, lines: list[str]) -> None:
        """Complete lines a rank wrote to ``stream`` ("stdout" or "stderr")."""

    def update(self) -> None:
        """The state changed (progress, metrics, status); redraw if it is time to."""

    def finish(self) -> None:
        """The launch is over (any outcome): show the final summary."""


def choose_view(progress: bool | str = True) -> View:
    """``progress``: True (pick by frontend), False (output lines only), "text" or "widgets"."""
    from nbaccel.ui.text import TextView

    if progress is False:
        return TextView(show_progress=False)
    if progress == "text":
        return TextView()
    if progress == "widgets" or (progress is True and widget_frontend()):
        try:
            from nbaccel.ui.dashboard import Dashboard
        except ImportError:
            return TextView()
        return Dashboard()
    return TextView()


def widget_frontend() -> bool:
    """Whether a frontend that renders widgets is attached to this kernel.

    A kernel cannot ask its frontend, so this goes by who started it: Jupyter Server (JupyterLab,
    Notebook 7) names the session in ``JPY_SESSION_NAME``; VS Code and Colab leave their own
    marks. Kernels run by nbclient/nbval or a terminal get text. ``NBACCEL_VIEW=text|widgets``
    overrides the guess.
    """
    import os
    import sys

    forced = os.environ.get("NBACCEL_VIEW")
    if forced:
        return forced == "widgets"
    if "ipykernel" not in sys.modules:
        return False
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    shell = get_ipython()
    if shell is None or type(shell).__name__ != "ZMQInteractiveShell":
        return False
    return bool(
        os.environ.get("JPY_SESSION_NAME")
        or os.environ.get("VSCODE_PID")
        or "google.colab" in sys.modules
    )
