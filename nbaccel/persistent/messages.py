"""The command channel of persistent ranks (``%ranks``): what the kernel asks, what ranks answer.

A persistent-rank session keeps the ranks of a normal launch alive and talks to each over one
Unix socket of its own: the kernel sends a :class:`Command`, the rank runs it in its namespace and
answers with one :class:`Done`; while a command runs, a rank may also say it is :class:`Blocked`
in a torch.distributed call (how the kernel tells a half-done collective from a slow cell).
Output, progress and crash reports still travel on the rank's usual pipes (see ``events``).

>>> Command(cell=1, kind="run", code="x = 1").kind
'run'
"""

from __future__ import annotations

import dataclasses
from typing import Any

# Command kinds: "run" (code), "call" (function + args), "push" (values), "pull" (names),
# "stop" (leave the command loop; the rank then exits through the shared exit protocol),
# "debug" (a post-mortem of the rank's last failed cell, on its real frames: ``rank.debugger``).
KINDS = ("run", "call", "push", "pull", "stop", "debug")


def cell_filename(cell: int) -> str:
    """The file name a command's code runs under on the ranks (and in the kernel's linecache,
    so tracebacks show its lines on both sides)."""
    return f"<rank cell {cell}>"


@dataclasses.dataclass
class Hello:
    """The first message of a rank on its command socket."""

    rank: int
    pid: int


@dataclasses.dataclass
class Command:
    cell: int  # the kernel's number for this command; replies carry it back
    kind: str
    code: str | None = None  # "run": the cell's source
    function: bytes | None = None  # "call": cloudpickled callable
    args: bytes | None = None  # "call": cloudpickled tuple of arguments
    values: dict[str, bytes] | None = None  # "push": name -> cloudpickled value
    names: list[str] | None = None  # "pull": the names to send back
    want_value: bool = False  # "run": send the final expression's value back, pickled
    # "run" from %%ranks, for the kernel's tracebacks: the notebook cell's n of In[n], and its
    # text as the notebook shows it (with the %%ranks line: ``code`` has a blank line there)
    kernel_cell: int | None = None
    kernel_source: str | None = None


@dataclasses.dataclass
class Done:
    """A rank finished a command (any outcome)."""

    rank: int
    cell: int
    value: bytes | None = None  # pickled result ("call", "pull", "run" with want_value)
    value_repr: str | None = None  # "run": repr of the final expression's value, if not None
    failure: Any = None  # an events.Failure when the command raised
    interrupted: bool = False  # the command ended with the kernel's KeyboardInterrupt
    names: dict[str, str] = dataclasses.field(default_factory=dict)  # namespace: name -> type
    device: str = "cpu"
    gpu_memory: int | None = None  # bytes allocated by torch on this rank's GPU


@dataclasses.dataclass
class Blocked:
    """The rank's cell code is waiting inside a torch.distributed call (``op`` None: not any more)."""

    rank: int
    cell: int
    op: str | None
    where: str = ""  # "line 3 of the cell", for the error message
