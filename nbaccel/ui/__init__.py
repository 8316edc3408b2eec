"""Views: how a launch is shown in the kernel. Only the kernel side imports this package.

A view gets the launch state and each rank's output lines; it decides how often to redraw.
``choose_view`` picks the widget dashboard where a widget frontend is attached and plain text
everywhere else (nbclient/nbval, terminal IPython, scripts).

May import: ``nbaccel.core`` and ``nbaccel.launch`` (the launch's model, ``launch.state``, and
the :class:`~nbaccel.launch.protocols.View` protocol its views implement). Kernel side only:
never imported inside a rank.
"""

from __future__ import annotations

from nbaccel.core.kernel import in_kernel
from nbaccel.launch.protocols import View


def wants_widgets(progress: bool | str = True) -> bool:
    """The one rule for widgets or text, for a launch's view and a ``%ranks`` cell's:
    ``progress`` "widgets", or True where a widget frontend is attached.

    >>> wants_widgets("text"), wants_widgets(False), wants_widgets("widgets")
    (False, False, True)
    """
    return progress == "widgets" or (progress is True and widget_frontend())


def choose_view(progress: bool | str = True) -> View:
    """``progress``: True (pick by frontend), False (output lines only), "text" or "widgets".
    A launch's own view (``notebook_launcher(view=...)``) is any object with
    :class:`View`'s methods."""
    from nbaccel.ui.text import TextView

    if progress is False:
        return TextView(show_progress=False)
    if wants_widgets(progress):
        try:
            from nbaccel.ui.dashboard import Dashboard
        except ImportError:
            return TextView()
        return Dashboard()
    return TextView()


def frontend() -> str:
    """Which frontend runs this kernel, as far as the kernel can tell: "colab", "kaggle",
    "vscode", "jupyter" (JupyterLab/Notebook via Jupyter Server), "terminal" (IPython without a
    widget frontend, nbclient/nbval) or "script" (no IPython).

    Kaggle notebooks run under Jupyter as well; Colab and VS Code leave their own marks.
    """
    import os
    import sys

    if "ipykernel" not in sys.modules or not _ipython_shell():
        return "script"
    if not in_kernel():
        return "terminal"
    if "google.colab" in sys.modules or os.environ.get("COLAB_RELEASE_TAG"):
        return "colab"
    if os.environ.get("KAGGLE_KERNEL_RUN_TYPE"):
        return "kaggle"
    if os.environ.get("VSCODE_PID") or os.environ.get("VSCODE_CWD"):
        return "vscode"
    if os.environ.get("JPY_SESSION_NAME"):
        return "jupyter"
    return "terminal"


def _ipython_shell() -> bool:
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    return get_ipython() is not None


def widget_frontend() -> bool:
    """Whether a frontend that renders widgets is attached to this kernel.

    A kernel cannot ask its frontend, so this goes by who started it (see :func:`frontend`):
    JupyterLab/Notebook 7, Colab, Kaggle and VS Code render widgets; kernels run by nbclient/nbval
    or a terminal get text. ``NBACCEL_VIEW=text|widgets`` overrides the guess.
    """
    import os

    forced = os.environ.get("NBACCEL_VIEW")
    if forced:
        return forced == "widgets"
    return frontend() in ("colab", "kaggle", "vscode", "jupyter")
