"""Render a rank's traceback the way IPython renders a local one: ``Cell In[3], line 5, in fn``.

A rank runs the kernel's cell code (carried by value), so its frames name the kernel's temporary
cell files (``.../ipykernel_<pid>/<hash>.py``). The kernel's IPython knows which execution count
each of those files is; this module maps them back and shows the source lines around each frame
from the kernel's ``linecache`` (which holds the cells). nbaccel's own frames, in the kernel and
in the rank, are left out.

Used by ``LaunchError._render_traceback_``, which IPython calls instead of its own formatter; it
runs only in a kernel, so IPython is imported lazily.

>>> text = 'Traceback (most recent call last):\\n  File "/x.py", line 1, in f\\n    g()\\nKeyError: 1\\n'
>>> [f.name for f in parse_frames(text)]
['f']
"""

from __future__ import annotations

import dataclasses
import linecache
import os
import re
import sys
import traceback
from collections.abc import Callable, Sequence
from types import FrameType, TracebackType

# A traceback's frame line; faulthandler's stack dumps write it without the comma before "in"
_FRAME = re.compile(r'^\s*File "(?P<file>[^"]+)", line (?P<line>\d+)(?:,? in (?P<name>.+))?$')
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONTEXT = 2  # source lines shown before and after each frame's line
_MAGIC_CALL = (
    "get_ipython().run_cell_magic(",
    "get_ipython().run_line_magic(",
)  # what IPython runs

# ANSI colours, close to IPython's "linux" theme; empty strings where colour is off.
_COLOURS = {
    "rule": "\x1b[31m",
    "ename": "\x1b[31;1m",
    "cell": "\x1b[32m",
    "arrow": "\x1b[32m",
    "lineno": "\x1b[32m",
    "name": "\x1b[36m",
    "reset": "\x1b[0m",
}


@dataclasses.dataclass
class Frame:
    file: str
    line: int
    name: str | None


def parse_frames(text: str) -> list[Frame]:
    """The ``File "...", line N, in fn`` entries of a formatted traceback, in order."""
    frames = []
    for raw in text.splitlines():
        m = _FRAME.match(raw)
        if m:
            frames.append(Frame(m["file"], int(m["line"]), m["name"]))
    return frames


def with_cell_names(text: str, label_for: Callable[[str], str | None] | None = None) -> str:
    """``text`` (a formatted traceback) with each notebook cell's file named as IPython names
    it: ``File "/tmp/ipykernel_1/2.py", line 3, in f`` becomes ``Cell In[7], line 3, in f``,
    so the plain text (``str(error)``, a saved notebook's ``evalue``) says what the rendered
    traceback says. ``label_for``: file name -> label or None (default: the kernel's cells).

    >>> with_cell_names('  File "/tmp/x.py", line 3, in f', {"/tmp/x.py": "Cell In[7]"}.get)
    '  Cell In[7], line 3, in f'
    >>> with_cell_names('  File "<rank cell 2>", line 4 in g', {"<rank cell 2>": "Cell In[9]"}.get)
    '  Cell In[9], line 4, in g'
    """
    label_for = label_for or cell_label
    lines = text.split("\n")
    for i, raw in enumerate(lines):
        m = _FRAME.match(raw)
        label = label_for(m["file"]) if m else None
        if m and label:
            where = raw[: m.start("file") - len('File "')] + f"{label}, line {m['line']}"
            lines[i] = where + (f", in {m['name']}" if m["name"] else "")
    return "\n".join(lines)


def is_nbaccel_file(filename: str) -> bool:
    """Whether ``filename`` belongs to the nbaccel package (its frames are plumbing here)."""
    return os.path.abspath(filename).startswith(_PACKAGE_DIR + os.sep)


def user_stacklevel() -> int:
    """The ``stacklevel`` that attributes a warning to the first frame outside nbaccel (the
    user's cell), counted from the caller of this function, whatever nbaccel's call depth.

    >>> import warnings
    >>> with warnings.catch_warnings(record=True) as seen:
    ...     warnings.simplefilter("always")
    ...     warnings.warn("x", stacklevel=user_stacklevel())
    >>> seen[0].filename == __file__ or not is_nbaccel_file(seen[0].filename)
    True
    """
    frame: FrameType | None = sys._getframe(1)  # the caller, which warns next
    level = 1
    while frame is not None and is_nbaccel_file(frame.f_code.co_filename):
        frame, level = frame.f_back, level + 1
    return level


class Renderer:
    """Formats frames as IPython does; ``colour=False`` gives plain text."""

    def __init__(self, colour: bool = True, label_for=None) -> None:
        self.c = _COLOURS if colour else dict.fromkeys(_COLOURS, "")
        self._cell_label = label_for or cell_label  # file name -> "Cell In[n]" or None

    def frame(self, frame: Frame) -> list[str]:
        c = self.c
        label = self._cell_label(frame.file)
        where = label or f"File {frame.file}"
        head = f"{c['cell']}{where}{c['reset']}, line {frame.line}"
        if frame.name and frame.name != "<module>":
            head += f", in {c['name']}{frame.name}(){c['reset']}"
        lines = [head]
        first = max(1, frame.line - CONTEXT)
        width = len(str(frame.line + CONTEXT))
        for n in range(first, frame.line + CONTEXT + 1):
            src = linecache.getline(frame.file, n)
            if not src and n > frame.line:
                break
            src = src.rstrip("\n")
            if n == frame.line:
                arrow = f"{c['arrow']}---->{c['reset']} "
                lines.append(f"{arrow}{c['lineno']}{n:>{width}}{c['reset']} {src}")
            else:
                lines.append(f"{'':6}{n:>{width}} {src}")
        return lines

    def traceback_text(self, text: str) -> list[str]:
        """Re-render a formatted Python traceback: frames IPython-style, other lines as they are
        (exception lines, "During handling of the above exception" ...), nbaccel frames dropped."""
        out: list[str] = []
        lines = text.rstrip("\n").splitlines()
        i = 0
        while i < len(lines):
            m = _FRAME.match(lines[i])
            if not m:
                line = lines[i]
                if line.startswith("Traceback (most recent call last)"):
                    i += 1
                    continue
                out.append(self._exception_line(line))
                i += 1
                continue
            i += 1
            # The frame's own source and caret lines, indented deeper than "  File".
            while i < len(lines) and lines[i].startswith("    ") and not _FRAME.match(lines[i]):
                i += 1
            frame = Frame(m["file"], int(m["line"]), m["name"])
            if is_nbaccel_file(frame.file):
                continue
            out += self.frame(frame)
            out.append("")
        return out

    def _exception_line(self, line: str) -> str:
        name, sep, rest = line.partition(":")
        if sep and re.fullmatch(r"[\w.]+", name):
            return f"{self.c['ename']}{name}{self.c['reset']}:{rest}"
        return line

    def local_frames(self, tb: TracebackType | None) -> list[str]:
        """The kernel-side frames of ``tb`` that are the user's (not nbaccel's, not IPython's)."""
        out = []
        for fs in traceback.extract_tb(tb):
            if is_nbaccel_file(fs.filename) or "/IPython/" in fs.filename:
                continue
            if (fs.line or "").startswith(_MAGIC_CALL):  # a %%ranks cell: its ranks' frames tell
                continue
            out += self.frame(Frame(fs.filename, fs.lineno or 0, fs.name))
            out.append("")
        return out

    def rule(self, left: str, right: str) -> list[str]:
        c = self.c
        return [
            f"{c['rule']}{'-' * 75}{c['reset']}",
            f"{c['ename']}{left}{c['reset']}{right:>{max(1, 75 - len(left))}}",
        ]


def _cell_numbers() -> dict[str, int] | None:
    """IPython's own record of which compiled file is which cell (``In[n]``), if any."""
    try:
        from IPython import get_ipython
    except ImportError:
        return None
    names = getattr(getattr(get_ipython(), "compile", None), "_filename_map", None)
    return names if isinstance(names, dict) else None


def name_cell(filename: str, number: int) -> None:
    """Have IPython call code compiled as ``filename`` ``Cell In[number]`` (a ``%%ranks``
    cell's code runs on the ranks under a name of its own); nothing outside IPython."""
    names = _cell_numbers()
    if names is not None:
        names[filename] = number


def running_cell() -> int | None:
    """The ``n`` of ``In[n]`` for the notebook cell whose code calls this (None outside one)."""
    import sys

    names = _cell_numbers() or {}
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_filename in names:
            return names[frame.f_code.co_filename]
        frame = frame.f_back
    return None


def cell_label(filename: str) -> str | None:
    """``Cell In[3]`` for a file the kernel compiled from a cell, else ``None``."""
    try:
        from IPython import get_ipython
    except ImportError:
        return None
    shell = get_ipython()
    compiler = getattr(shell, "compile", None)
    try:
        named = compiler.format_code_name(filename) if compiler is not None else None
    except Exception:  # noqa: BLE001 - an older IPython: fall back to the file name
        named = None
    return f"{named[0]} {named[1]}" if named else None


def colour_enabled() -> bool:
    """Colours where IPython draws them (Jupyter, terminal IPython) unless set to "nocolor"."""
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    shell = get_ipython()
    return shell is not None and str(getattr(shell, "colors", "")).lower() != "nocolor"


def render(
    title: str,
    kind: str,
    rank_traceback: str,
    footer: Sequence[str],
    local_tb: TracebackType | None,
    colour: bool | None = None,
    heading: str = "",
) -> list[str]:
    """The lines IPython shows for a launch error: a rule naming the error, the user's kernel
    frames, the rank's frames (IPython-style), then ``footer`` (the summary lines)."""
    r = Renderer(colour_enabled() if colour is None else colour)
    lines = r.rule(kind, "Traceback (most recent call last)")
    lines += r.local_frames(local_tb)
    if rank_traceback.strip():
        if heading:
            lines.append(f"{r.c['rule']}{heading}{r.c['reset']}")
        lines += r.traceback_text(rank_traceback)
        lines.append("")
    lines += [f"{r.c['ename']}{title}{r.c['reset']}", *footer]
    return lines


def render_launch_error(error: BaseException, colour: bool | None = None) -> list[str]:
    """IPython's lines for a ``LaunchError``; a ``RankFailedError`` shows its rank's frames."""
    kind = type(error).__name__
    rank_tb = getattr(error, "remote_traceback", "") or ""
    if hasattr(error, "rank") and hasattr(error, "summary") and hasattr(error, "world_size"):
        title = f"{kind}: rank {error.rank} (of {error.world_size}) {error.summary}"
        others = getattr(error, "other_failures", ())
        footer = ["Also failed afterwards: " + "; ".join(others)] if others else []
        heading = f"in rank {error.rank}:" if rank_tb.strip() else ""
    else:
        title, footer, heading = f"{kind}: {error}", [], ""
    return render(title, kind, rank_tb, footer, error.__traceback__, colour, heading)
