"""The README as a newcomer uses it: every code block runs pasted as written.

The Python blocks run in order, one cell each, in a fresh real ipykernel (the first launch after
the import cell is a newcomer's first launch); a ``text`` block right after one holds lines that
cell must show. Shell commands run where that is safe and quick; the others (installing,
creating the virtual environment, running the whole suite) are listed in ``SHELL_SKIPPED`` with
the reason, and a command in neither list fails the quick test, so none is left out silently.
The quick tests also keep the README short and inside the repository, and compile every Python
example in ``docs/``.
"""

from __future__ import annotations

import ast
import dataclasses
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))

# Shell commands the README shows that this test does not run, and why.
SHELL_SKIPPED = {
    "python3 -m venv .venv": "creates the virtual environment this test runs in",
    ".venv/bin/pip install -c constraints.txt -e .": "installs the package this test runs from",
    "bash scripts/test.sh": "runs the whole suite, this test included",
}
# Shell commands the README shows that the slow test runs, with the venv's own bin/ for .venv/bin/.
SHELL_RUN = {".venv/bin/nbaccel demo"}
# The sections a newcomer needs, in this order, before anything else and near the top.
FIRST_SCREEN = ["Try it from a clone", "Notebooks", "Where to go next"]
FIRST_SCREEN_LINES = 80


@dataclasses.dataclass
class Block:
    """One fenced code block: its language (``""`` when none), text and first line number."""

    lang: str
    code: str
    line: int


def code_blocks(path: Path) -> list[Block]:
    """The fenced blocks of a Markdown file, indented ones (in list items) dedented."""
    blocks, fence, lang, body, start = [], None, "", [], 0
    for number, line in enumerate(path.read_text().splitlines(), 1):
        match = re.match(r"^(\s*)```(\w*)\s*$", line)
        if fence is None and match:
            fence, lang, body, start = match.group(1), match.group(2), [], number
        elif fence is not None and line.strip() == "```":
            blocks.append(Block(lang, "\n".join(body), start))
            fence = None
        elif fence is not None:
            body.append(line[len(fence) :] if line.startswith(fence) else line.lstrip())
    assert fence is None, f"{path.name}: the block opened at line {start} is never closed"
    return blocks


def shell_commands(block: Block) -> list[str]:
    """The commands of a shell block: one a line, ``&&`` chains split, comments dropped."""
    commands = []
    for line in block.code.splitlines():
        line = line.split(" #", 1)[0].strip()
        commands += [part.strip() for part in line.split("&&") if part.strip()]
    return commands


def markdown_links(path: Path) -> list[str]:
    return re.findall(r"\]\(([^)\s]+)\)", path.read_text())


def ipython_to_python(code: str) -> str:
    """What IPython makes of a cell (``%ranks`` lines become calls), so it can be compiled."""
    from IPython.core.inputtransformer2 import TransformerManager

    return TransformerManager().transform_cell(code)


# ---- quick checks ---------------------------------------------------------------------------


def test_every_block_is_python_shell_or_shown_output():
    for block in code_blocks(README):
        assert block.lang in ("python", "bash", "text"), (
            f"README.md line {block.line}: a ```{block.lang} block; say whether it is python, "
            "bash (then list its commands in tests/test_readme.py) or text (output)"
        )


def test_every_shell_command_is_either_run_or_skipped_with_a_reason():
    commands = [c for b in code_blocks(README) if b.lang == "bash" for c in shell_commands(b)]
    unlisted = [c for c in commands if c not in SHELL_SKIPPED and c not in SHELL_RUN]
    assert not unlisted, (
        f"README shell commands neither run nor skipped by tests/test_readme.py: {unlisted}; add "
        "each to SHELL_RUN (safe and quick) or SHELL_SKIPPED (with the reason)"
    )
    stale = (set(SHELL_SKIPPED) | SHELL_RUN) - set(commands)
    assert not stale, f"tests/test_readme.py lists commands the README no longer has: {stale}"


def test_a_newcomer_finds_the_essentials_on_the_first_screen():
    lines = README.read_text().splitlines()
    headings = [(n, line[3:]) for n, line in enumerate(lines, 1) if line.startswith("## ")]
    first = [h for _, h in headings[: len(FIRST_SCREEN)]]
    assert all(h.startswith(w) for h, w in zip(first, FIRST_SCREEN, strict=True)), headings
    last = headings[len(FIRST_SCREEN) - 1][0]
    assert last <= FIRST_SCREEN_LINES, f"'Where to go next' starts at line {last}"


def test_the_readme_names_no_file_outside_the_repository():
    # A newcomer's clone holds only the repository: `../shared/...` is not there.
    outside = re.findall(r"[`(]\.\./[^`)\s]*", README.read_text())
    assert not outside, f"README.md names files outside the repository: {outside}"


@pytest.mark.parametrize("path", [README, *DOCS], ids=lambda p: p.name)
def test_a_block_that_starts_ranks_can_be_pasted_alone(path):
    # nbaccel's line magics exist only after `import nbaccel`: a `%ranks start` block pasted
    # into a fresh kernel without it fails with "Line magic function `%ranks` not found".
    for block in code_blocks(path):
        lines = [line.strip() for line in block.code.splitlines()]
        if block.lang != "python" or not any(line.startswith("%ranks start") for line in lines):
            continue
        first_magic = next(n for n, line in enumerate(lines) if line.startswith("%ranks"))
        imported = any(
            re.match(r"(import nbaccel\b|from nbaccel\b)", line) for line in lines[:first_magic]
        )
        assert imported, f"{path.name}, the block at line {block.line}: add `import nbaccel`"


@pytest.mark.parametrize("path", [README, *DOCS], ids=lambda p: p.name)
def test_links_stay_inside_the_repository_and_resolve(path):
    for target in markdown_links(path):
        assert "://" not in target, f"{path.name} links outside the repository: {target}"
        file = (path.parent / target.split("#", 1)[0]).resolve()
        assert file.is_relative_to(ROOT), f"{path.name} links outside the repository: {target}"
        assert file.exists(), f"{path.name} links to {target}, which does not exist"


@pytest.mark.parametrize("path", [README, *DOCS], ids=lambda p: p.name)
def test_install_lines_work_from_a_clone(path):
    # nbaccel is not on a package index: `pip install nbaccel[...]` finds nothing.
    wrong = re.findall(r"pip install [^`\n]*?'?nbaccel\[[^`\n]*", path.read_text())
    assert not wrong, f"{path.name}: {wrong}; install from the clone: pip install -e '.[extra]'"


@pytest.mark.parametrize("path", [README, *DOCS], ids=lambda p: p.name)
def test_python_examples_compile(path):
    for block in code_blocks(path):
        if block.lang == "python":
            try:
                # a notebook cell may await at its top level (IPython runs it in its loop)
                compile(
                    ipython_to_python(block.code),
                    f"{path.name}:{block.line}",
                    "exec",
                    flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT,
                )
            except SyntaxError as exc:
                pytest.fail(f"{path.name}, the block at line {block.line}: {exc}")


# ---- the blocks themselves ----------------------------------------------------------------


def _shown(cell) -> str:
    """What a cell shows as text: its streams and the plain text of every result or display."""
    parts = [cell.stdout, cell.stderr]
    for msg in cell.of_type("execute_result", "display_data", "update_display_data"):
        parts.append(msg["content"]["data"].get("text/plain", ""))
    return "\n".join(parts)


@pytest.mark.slow
def test_every_python_block_runs_pasted_as_written_in_a_fresh_kernel():
    from tests.kernel_helpers import KernelSession

    blocks = code_blocks(README)
    assert any(b.lang == "python" for b in blocks)
    with KernelSession(background_shutdown=True) as kernel:
        try:
            for block, after in zip(blocks, [*blocks[1:], None]):
                if block.lang != "python":
                    continue
                cell = kernel.execute(block.code, timeout=240)
                assert cell.error is None, f"README.md line {block.line}:\n{cell.error_text}"
                if after is not None and after.lang == "text":
                    shown = _shown(cell)
                    for line in after.code.splitlines():
                        assert line in shown, (
                            f"README.md line {after.line} promises {line!r}; the cell showed:\n"
                            f"{shown}"
                        )
        finally:
            kernel.execute(
                "_m = getattr(get_ipython(), '_nbaccel_ranks_magics', None)\n"
                "if _m and _m.session and _m.session.started:\n"
                "    get_ipython().run_line_magic('ranks', 'stop')"
            )
        assert kernel.leftovers() == []


@pytest.mark.slow
@pytest.mark.parametrize("command", sorted(SHELL_RUN))
def test_shell_commands_run(command):
    argv = shlex.split(command)
    if argv[0].startswith(".venv/bin/"):  # the venv the README makes is the one running this
        argv[0] = str(Path(sys.executable).parent / argv[0].removeprefix(".venv/bin/"))
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, f"{command} exited {done.returncode}:\n{done.stdout}{done.stderr}"
