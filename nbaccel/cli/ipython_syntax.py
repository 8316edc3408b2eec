"""IPython-only syntax in a notebook cell, turned into comments so the cell is a script's Python.

Magics (``%...``, ``%%...``), shell escapes (``!...``, ``x = !...``) and help (``obj?``) have no
meaning outside IPython; ``nbaccel export`` keeps each as a comment that says why it went. Cell
magics whose body is plain Python (``%%time``, ...) keep their body.

Example:

>>> print(clean_cell("!pip install torch\\nx = 1"))
# !pip install torch  # (shell escape, removed by nbaccel export)
x = 1
"""

from __future__ import annotations

import ast
import re

# Cell magics whose body is ordinary Python: keep the body, comment out the magic line.
_PYTHON_CELL_MAGICS = {"time", "timeit", "capture", "prun"}
_ASSIGNED_ESCAPE = re.compile(r"^[\w.,\s\[\]()*]+=\s*[!%]")
_HELP = re.compile(r"^(\?{1,2}[\w.]+|[\w.]+\?{1,2})\s*$")  # `obj?`, `obj??`, `?obj`


def _comment(line: str, why: str) -> str:
    indent = line[: len(line) - len(line.lstrip())]
    return f"{indent}# {line.strip()}  # ({why}, removed by nbaccel export)"


def clean_cell(source: str) -> str:
    """Remove IPython-only syntax from one cell's source (magics and shell escapes)."""
    try:
        ast.parse(source)
        return source  # plain Python already (e.g. a `%` continuing an expression): keep it
    except SyntaxError:
        pass
    lines = source.splitlines()
    first = lines[0].strip() if lines else ""
    if first.startswith("%%"):
        magic = first[2:].split()[0] if first[2:].split() else ""
        if magic in _PYTHON_CELL_MAGICS:
            return "\n".join([_comment(lines[0], "cell magic"), *_clean_lines(lines[1:])])
        return "\n".join(_comment(line, f"%%{magic} cell") for line in lines)
    return "\n".join(_clean_lines(lines))


def _clean_lines(lines: list[str]) -> list[str]:
    out = []
    for line in lines:
        stripped = line.lstrip()
        if stripped.startswith(("%", "!")):
            out.append(_comment(line, "IPython magic" if stripped[0] == "%" else "shell escape"))
        elif _ASSIGNED_ESCAPE.match(stripped) or _HELP.match(stripped):
            out.append(_comment(line, "IPython syntax"))
        else:
            out.append(line)
    return out
