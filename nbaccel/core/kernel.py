"""Whether this process is a Jupyter kernel: asked by the fork server (what to mirror), by
``import nbaccel`` (whether to warm up) and by the views (which frontend)."""

from __future__ import annotations


def in_kernel() -> bool:
    """Whether this process is a Jupyter kernel: an ipykernel shell runs here (whichever
    frontend, if any, is attached). Having imported ``ipykernel`` is not enough: widget code
    imports it in scripts and test runs too.

    >>> in_kernel()  # a doctest run is no kernel
    False
    """
    import sys

    if "ipykernel" not in sys.modules or "IPython" not in sys.modules:
        return False
    shell = sys.modules["IPython"].get_ipython()
    return shell is not None and type(shell).__name__ == "ZMQInteractiveShell"
