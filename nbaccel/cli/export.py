"""``nbaccel export``: turn a notebook into a script that runs under ``nbaccel launch``.

Code cells are written in order (``# %%`` markers keep them apart, as VS Code and jupytext read
them); cells tagged ``skip-export`` are dropped; IPython magics (``%...``, ``%%...``) and shell
escapes (``!...``, ``x = !...``) become comments. The ``notebook_launcher(fn, ...)`` statement,
found with ``ast`` in either ``nbaccel.notebook_launcher`` or ``from nbaccel import
notebook_launcher`` form, becomes a main guard.

What the main guard does (the decision): under ``nbaccel launch`` or ``torchrun`` (``RANK`` and
``WORLD_SIZE`` set) the process is already one rank, so it calls ``fn(*args, **kwargs)``
directly; launching from inside a rank would start ranks of ranks. Under plain
``python train.py`` it keeps the notebook's ``notebook_launcher`` call, so the script behaves
as the notebook did (same processes, rank 0's result); ``--num_processes`` and
``--mixed_precision`` flags stand in for a ``config=`` that only skip-export cells define (export
warns about every such value it cannot carry over). Code after the call sits under
``if __name__ == "__main__":`` so ranks that import the script do not run it. A variable the notebook assigned the
result to is assigned in both cases; under torchrun each rank gets its own return value, and
code after the call runs on every rank, as in any torchrun script.

Example::

    >>> export_notebook("train.ipynb", "train.py")     # doctest: +SKIP
    PosixPath('train.py')
"""

from __future__ import annotations

import ast
import builtins
import os
import re
import shlex
import textwrap
import warnings
from pathlib import Path
from typing import TypeGuard

from nbaccel.cli.ipython_syntax import clean_cell
from nbaccel.core.atomic import atomic_write

SKIP_TAG = "skip-export"
HEADER = "# Exported from {name} by `nbaccel export`; run it with: nbaccel launch {script}\n"
_MARKER = "by `nbaccel export`"


class ExportWarning(UserWarning):
    """Something the notebook relies on that the script cannot carry over; said, not fatal."""


class ExportError(Exception):
    """The notebook cannot be exported as asked; the message says why and what to do."""


def _is_launcher_call(node: object) -> TypeGuard[ast.Call]:
    if not isinstance(node, ast.Call):
        return False
    func = node.func
    name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
    return name == "notebook_launcher"


def _launcher_calls(tree: ast.Module) -> tuple[list[ast.stmt], list[int]]:
    """Top-level statements that are (or assign) a launcher call; lines of nested ones."""
    top: list[ast.stmt] = []
    nested: list[int] = []
    for stmt in tree.body:
        value = getattr(stmt, "value", None)
        if isinstance(stmt, (ast.Expr, ast.Assign, ast.AnnAssign)) and _is_launcher_call(value):
            top.append(stmt)
            continue
        nested += [n.lineno for n in ast.walk(stmt) if _is_launcher_call(n)]
    return top, nested


def _call_in(stmt: ast.stmt) -> ast.Call:
    """The launcher call a statement found by :func:`_launcher_calls` is or assigns."""
    value = getattr(stmt, "value", None)
    if not _is_launcher_call(value):
        raise TypeError(f"line {stmt.lineno} does not call notebook_launcher")
    return value


def _call_parts(call: ast.Call, source: str) -> tuple[str, str, str]:
    """The function, args and kwargs expressions of a ``notebook_launcher`` call, as source."""

    def seg(node: ast.AST) -> str:
        return ast.get_source_segment(source, node) or ast.unparse(node)

    keywords = {k.arg: k.value for k in call.keywords if k.arg}
    fn = call.args[0] if call.args else keywords.get("function")
    if fn is None:
        raise ExportError("the notebook_launcher call names no function to run.")
    args = call.args[1] if len(call.args) > 1 else keywords.get("args")
    kwargs = keywords.get("kwargs")
    return seg(fn), seg(args) if args is not None else "()", seg(kwargs) if kwargs else "{}"


def main_guard(
    function: str, args: str, kwargs: str, launch_call: str, target: str, flags: bool = True
) -> str:
    """The code that replaces the launcher statement (see the module docstring).

    Under plain ``python`` the script takes ``--num_processes`` and ``--mixed_precision`` (the
    settings a notebook's config panel would have given), passed on to ``notebook_launcher``
    where given; without them the saved default config applies, as for ``nbaccel launch``.
    """
    assign = f"{target} = " if target else ""
    if flags:
        call = launch_call.rstrip()
        assert call.endswith(")")
        call = call[:-1].rstrip().rstrip(",")
        call += (", " if not call.endswith("(") else "") + "**_nbaccel_flags())"
        plain = f"return {call}"
    else:
        plain = f"return {launch_call}"
    helper = textwrap.dedent(
        """        def _nbaccel_flags():
            # Launch settings for plain `python script.py`; the saved default config otherwise.
            import argparse

            parser = argparse.ArgumentParser()
            parser.add_argument("--num_processes", type=int)
            parser.add_argument("--mixed_precision", choices=["no", "fp16", "bf16", "fp8"])
            given = parser.parse_known_args()[0]
            return {k: v for k, v in vars(given).items() if v is not None}


        """
    )
    return (helper if flags else "") + textwrap.dedent(
        f"""        def _nbaccel_main():
            import os

            if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
                # Started by `nbaccel launch` or torchrun: this process is one rank.
                return ({function})(*{args}, **{kwargs})
            # Plain `python script.py`: start the ranks as the notebook did.
            {plain}


        if __name__ == "__main__":
            {assign}_nbaccel_main()"""
    )


def defined_names(trees: list[ast.Module]) -> set[str]:
    """Names the exported cells bind at top level (assignments, defs, imports, loops...)."""
    names = set(dir(builtins))
    for tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                names.update((a.asname or a.name).split(".")[0] for a in node.names)
            elif isinstance(node, ast.arg):
                names.add(node.arg)
    return names


def _free_names(node: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}


def _read(notebook: Path):
    import nbformat

    try:
        return nbformat.read(notebook, as_version=4)
    except FileNotFoundError:
        raise ExportError(f"no such notebook: {notebook}") from None
    except Exception as exc:  # nbformat raises several kinds for a damaged file
        raise ExportError(f"{notebook} is not a readable notebook: {exc}") from None


def launch_flags(call: ast.Call) -> str:
    """``nbaccel launch`` flags for the settings the notebook's call gives as literals
    (``num_processes=2``, ``mixed_precision="bf16"``), so the suggested command runs as the
    notebook did; settings given otherwise come from the config file.

    >>> launch_flags(ast.parse("notebook_launcher(f, (), 2, mixed_precision='bf16')").body[0].value)
    '--num_processes 2 --mixed_precision bf16 '
    """
    given = {k.arg: k.value for k in call.keywords if k.arg}
    for position, name in ((2, "num_processes"), (3, "mixed_precision")):
        if len(call.args) > position:
            given.setdefault(name, call.args[position])
    out = []
    for name in ("num_processes", "mixed_precision"):
        node = given.get(name)
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float, str)):
            out.append(f"--{name} {node.value} ")
    return "".join(out)


def run_command(script: str | os.PathLike[str]) -> str:
    """The command an exported script's header suggests (``nbaccel launch ... x.py``), with the
    script named as it is reached from the current folder: the header names it from its own
    folder, so ``nbaccel export notebooks/a.ipynb`` must suggest ``notebooks/a.py``."""
    path = Path(script)
    head = path.read_text(encoding="utf-8").split("\n", 1)[0]
    command = head.partition("run it with: ")[2] or f"nbaccel launch {path.name}"
    try:
        shown = os.path.relpath(path)
    except ValueError:  # another drive (Windows)
        shown = str(path.resolve())
    if shown.startswith(".." + os.sep):
        shown = str(path.resolve())
    if command.endswith(path.name):
        command = command[: -len(path.name)] + shlex.quote(shown)
    return command


def notebook_to_script(notebook: str | os.PathLike[str], function: str | None = None) -> str:
    """The script text for ``notebook`` (see the module docstring); raises :class:`ExportError`.

    Example::

        >>> print(notebook_to_script("train.ipynb"))    # doctest: +SKIP
    """
    path = Path(notebook)
    nb = _read(path)
    cells: list[tuple[int, str, ast.Module]] = []
    notes: list[str] = []
    for index, cell in enumerate(nb.cells, start=1):
        if cell.cell_type != "code" or SKIP_TAG in cell.get("metadata", {}).get("tags", []):
            continue
        source = clean_cell(cell.source)
        if cell.source.lstrip().startswith("%%ranks"):
            # A %%ranks cell runs on the live ranks of a notebook launch; a script has no live
            # ranks after the launch returns, so the cell stays as a commented block.
            source = f"# %%ranks cell {index}: not run by the script (no live ranks)\n{source}"
            notes.append(
                f"cell {index} is a %%ranks cell; it runs on the live ranks of a notebook "
                "launch only, so the script keeps it as comments. Move its code into the "
                "launched function to run it in the script."
            )
        try:
            tree = ast.parse(source)
        except SyntaxError as exc:
            raise ExportError(
                f"{path}, cell {index}, line {exc.lineno}: not valid Python after removing "
                f"IPython syntax ({exc.msg}). Fix the cell or tag it '{SKIP_TAG}'."
            ) from None
        cells.append((index, source, tree))

    found = []
    for index, _source, tree in cells:
        top, nested = _launcher_calls(tree)
        if nested:
            raise ExportError(
                f"{path}, cell {index}, line {nested[0]}: notebook_launcher is called inside "
                "a block; export only rewrites a call on its own line. Move it out of the block."
            )
        found += [(index, stmt) for stmt in top]
    if len(found) > 1:
        where = ", ".join(str(i) for i, _ in found)
        raise ExportError(
            f"{path} calls notebook_launcher in more than one place (cells {where}); tag the "
            f"cells that should not be in the script '{SKIP_TAG}'."
        )
    if not found and not function:
        raise ExportError(
            f"{path} has no notebook_launcher(...) call, so the script would not know what to "
            "run. Add one, or name the training function: nbaccel export NOTEBOOK --function train"
        )

    script_name = path.with_suffix(".py").name
    flags = launch_flags(_call_in(found[0][1])) if found else ""
    parts = [HEADER.format(name=path.name, script=flags + script_name)]
    known = defined_names([tree for _, _, tree in cells])
    launched = False
    for index, source, _tree in cells:
        launch = next((stmt for i, stmt in found if i == index), None)
        if launch is not None:
            source, launched = _rewrite(source, launch, function, known, notes), True
        elif launched and source.strip():
            source = main_only(source)
        parts.append(f"\n# %% [cell {index}]\n{source.rstrip()}\n")
    _check_compiles(path, parts)
    for note in notes:
        warnings.warn(f"nbaccel export: {note}", ExportWarning, stacklevel=2)
        parts.insert(1, f"# Not carried over: {note}\n")
    if not found and function is not None:  # one of the two, checked above
        launch_call = f"nbaccel.notebook_launcher({function})"
        guard = main_guard(function, "()", "{}", launch_call, "")
        parts.append(f"\n# %% [added by nbaccel export]\nimport nbaccel\n\n\n{guard}\n")
    return "".join(parts)


def _rewrite(
    source: str, stmt: ast.stmt, function: str | None, known: set[str], notes: list[str]
) -> str:
    call = _call_in(stmt)
    # A keyword whose value the script never defines (set in a skip-export cell, like the
    # config panel's ``cfg``) cannot be carried over: leave it out and say so.
    dropped = []
    for kw in list(call.keywords):
        missing = sorted(_free_names(kw.value) - known) if kw.arg else []
        if missing:
            call.keywords.remove(kw)
            dropped.append(kw.arg)
            what = (
                "the saved default config (nbaccel config) and the script's --num_processes/"
                "--mixed_precision flags apply instead"
                if kw.arg == "config"
                else f"the script calls notebook_launcher without {kw.arg}="
            )
            notes.append(
                f"notebook_launcher(..., {kw.arg}=...) uses {', '.join(missing)}, which only "
                f"skip-export cells define; {what}."
            )
    fn, args, kwargs = _call_parts(call, source)
    if function and function != fn:
        raise ExportError(
            f"the notebook launches {fn}, not {function}; drop --function, or tag the "
            f"launcher cell '{SKIP_TAG}' to run {function} instead."
        )
    positional = [*call.args, *(k.value for k in call.keywords if k.arg in ("args", "kwargs"))]
    missing = sorted(set().union(*(_free_names(n) for n in positional)) - known)
    if missing:
        notes.append(
            f"the launched call uses {', '.join(missing)}, which only skip-export cells define; "
            "the script stops with a NameError there. Move the definition to an exported cell."
        )
    if isinstance(stmt, ast.Assign):
        target = " = ".join(
            ast.get_source_segment(source, t) or ast.unparse(t) for t in stmt.targets
        )
    elif isinstance(stmt, ast.AnnAssign):
        target = ast.get_source_segment(source, stmt.target) or ast.unparse(stmt.target)
    else:
        target = ""
    launch_call = ast.unparse(call) if dropped else ast.get_source_segment(source, call)
    given = {k.arg for k in call.keywords}
    flags = not {"num_processes", "mixed_precision", "config"} & given
    guard = main_guard(fn, args, kwargs, launch_call or ast.unparse(call), target, flags)
    lines = source.splitlines()
    before, after = lines[: stmt.lineno - 1], lines[stmt.end_lineno :]
    rest = "\n".join(after)
    return "\n".join([*before, guard, *([main_only(rest)] if rest.strip() else [])])


def _check_compiles(path: Path, parts: list[str]) -> None:
    """Refuse to write a script that would not compile, naming the notebook cell at fault."""
    text = "".join(parts)
    try:
        compile(text, str(path.with_suffix(".py")), "exec")
    except SyntaxError as exc:
        line, cell = exc.lineno or 0, "?"
        for part in parts:  # find the `# %% [cell N]` part that holds the failing line
            line -= part.count("\n")
            if line <= 0:
                found = re.search(r"# %% \[cell (\d+)\]", part)
                cell = found.group(1) if found else "?"
                break
        raise ExportError(
            f"{path}, cell {cell}: the exported script would not compile ({exc.msg}); nothing "
            f"was written. Fix the cell or tag it '{SKIP_TAG}', and report this as an nbaccel "
            "export bug."
        ) from None


def main_only(source: str) -> str:
    """Code after the launch, run only by the launching process. Under torchrun (and
    ``start_method="spawn"``) every rank runs the script's top level too, where the launch's
    result does not exist; the fork server's ranks do not run it (``forkserver.launching_script``).
    Source with no statements (only comments, e.g. a commented-out magic) is left as it is:
    an ``if`` with an empty body would not compile."""
    if not ast.parse(source).body:
        return source
    return 'if __name__ == "__main__":\n' + textwrap.indent(source, "    ")


def export_notebook(
    notebook: str | os.PathLike[str],
    output: str | os.PathLike[str] | None = None,
    function: str | None = None,
    force: bool = False,
) -> Path:
    """Write the script for ``notebook`` to ``output`` (default: the notebook's name, ``.py``).

    A file that ``nbaccel export`` did not write is only replaced with ``force=True``. The write
    is atomic, and nothing is written when the notebook cannot be exported.

    Example::

        >>> export_notebook("01_quickstart.ipynb", "train.py")   # doctest: +SKIP
    """
    text = notebook_to_script(notebook, function)
    target = Path(output) if output else Path(notebook).with_suffix(".py")
    if target.is_dir():  # an existing folder: the script goes inside it
        target = target / Path(notebook).with_suffix(".py").name
    if target.exists() and target.resolve() == Path(notebook).resolve():
        raise ExportError(
            f"-o {output} is the notebook itself; the script would replace it. Choose another "
            f"name, e.g. -o {Path(notebook).with_suffix('.py').name}."
        )
    if target.exists() and not force:
        head = target.read_text(encoding="utf-8", errors="replace")[:300]
        if _MARKER not in head:
            raise ExportError(
                f"{target} exists and was not written by nbaccel export; pass --force to "
                "replace it, or choose another name with -o."
            )
    if output:  # the header names the script actually written
        text = text.replace(Path(notebook).with_suffix(".py").name + "\n", target.name + "\n", 1)
    with atomic_write(target, "w", encoding="utf-8") as f:
        f.write(text)
    return target
