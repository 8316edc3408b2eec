"""The kernel ↔ fork-server contract of the mirror: how the server finds the kernel, what the
kernel's side is (never mirrored into a rank), and the lines both sides write.

Kernel → server, one line each: a module name (import it, after those queued), ``HOLD n
name...`` (import these first, then answer ``{"held": n}`` and import nothing more until
``GO``; ``n`` counts the kernel's holds, so an answer to one it gave up on is not taken for the
next), ``RELOAD name...`` (the kernel reloaded these: reload them, before anything queued), or
``PATH [json list]`` (the kernel's ``sys.path``: CPython's fork server starts with the
interpreter's own). Server → kernel: one JSON object per line, ``{"importing": name}`` as an
import of a module not loaded yet begins (so the kernel knows what is under way, and for how
long), ``{"name", "ok", "error", "cuda", "seconds"}`` as each ends, ``{"held": n}`` once held.

>>> parse_line(b'{"held": 3}')
{'held': 3}
"""

from __future__ import annotations

import json
from typing import Any

ENV_ADDRESS = "NBACCEL_MIRROR_ADDRESS"  # the kernel's Unix socket, which the server connects to
ENV_FILE = "NBACCEL_MIRROR_FILE"  # the names the kernel had when it started the server
# The file the fork server's own output goes to (``forkserver.log``), never into a cell.
ENV_SERVER_LOG = "NBACCEL_SERVER_LOG"
HOLD, GO, PATH, RELOAD = "HOLD", "GO", "PATH", "RELOAD"

# Top-level packages of the kernel's own side: never imported by the mirror.
KERNEL_SIDE = frozenset(
    {
        "IPython",
        "ipykernel",
        "ipykernel_launcher",
        "ipywidgets",
        "ipython_genutils",
        "comm",
        "zmq",
        "jupyter_client",
        "jupyter_core",
        "jupyter_server",
        "traitlets",
        "tornado",
        "debugpy",
        "pydevd",
        "_pydevd_bundle",
        "_pydev_bundle",
        "pydevd_plugins",
        "matplotlib_inline",
        "prompt_toolkit",
        "jedi",
        "parso",
        "nest_asyncio",
        "stack_data",
        "executing",
        "widgetsnbextension",
        "jupyterlab_widgets",
        "colab_kernel_launcher",
        "nbaccel",
        "pytest",
        "_pytest",
    }
)


# debugpy's vendored pydevd puts these on sys.path as top-level names of their own.
KERNEL_SIDE_PREFIXES = ("_pydev", "pydev")


def kernel_side(name: str) -> bool:
    """Whether module ``name`` belongs to the kernel's side (never mirrored).

    >>> kernel_side("ipykernel.kernelapp"), kernel_side("transformers")
    (True, False)
    """
    top = name.partition(".")[0]
    return top in KERNEL_SIDE or top.startswith(KERNEL_SIDE_PREFIXES)


def parse_line(line: bytes) -> dict[str, Any]:
    return json.loads(line)


def encode(answer: dict[str, Any]) -> bytes:
    return (json.dumps(answer) + "\n").encode()
