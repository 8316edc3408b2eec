"""``nbaccel export``: notebook -> script, and the script gives the notebook's result."""

from __future__ import annotations

import ast
import re
import textwrap
import warnings

import nbformat
import pytest

from nbaccel.cli.export import ExportError, export_notebook, notebook_to_script
from tests.test_cli_support import processes_mentioning, run_cli

TRAIN = textwrap.dedent(
    """\
    def train(steps, lr=0.1):
        import os
        import torch
        import torch.distributed as dist

        dist.init_process_group("gloo")
        rank, world = dist.get_rank(), dist.get_world_size()
        torch.manual_seed(0)
        x = torch.randn(64, 3)
        y = x @ torch.tensor([1.0, -2.0, 0.5])
        model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(3, 1))
        opt = torch.optim.SGD(model.parameters(), lr=lr)
        for _ in range(steps):
            xb, yb = x[rank::world], y[rank::world]
            loss = torch.nn.functional.mse_loss(model(xb).squeeze(-1), yb)
            opt.zero_grad()
            loss.backward()
            opt.step()
        final = loss.detach().clone()
        dist.all_reduce(final)
        dist.destroy_process_group()
        return final.item() / world
    """
)


def make_notebook(path, launcher_cell, import_cell="import nbaccel", magics=True):
    cells = [nbformat.v4.new_code_cell(import_cell)]
    if magics:
        cells += [
            nbformat.v4.new_code_cell("%env NBACCEL_EXPORT_TEST=1\n!echo from-the-shell"),
        ]
    cells += [
        nbformat.v4.new_markdown_cell("# Training"),
        nbformat.v4.new_code_cell(TRAIN),
        nbformat.v4.new_code_cell("print('notebook only')", metadata={"tags": ["skip-export"]}),
        nbformat.v4.new_code_cell(launcher_cell),
        nbformat.v4.new_code_cell('print(f"final loss {result:.6f}")'),
    ]
    nbformat.write(nbformat.v4.new_notebook(cells=cells), path)
    return path


def test_script_shape(tmp_path):
    nb = make_notebook(
        tmp_path / "nb.ipynb",
        "result = nbaccel.notebook_launcher(train, args=(5,), num_processes=2)",
    )
    nbformat.write(nbformat.read(nb, as_version=4), nb)
    text = notebook_to_script(nb)
    ast.parse(text)  # valid Python
    assert "# %env NBACCEL_EXPORT_TEST=1  # (IPython magic" in text
    assert "# !echo from-the-shell  # (shell escape" in text
    assert "notebook only" not in text
    assert "# Training" not in text  # markdown cells are not code
    assert "return (train)(*(5,), **{})" in text
    assert "return nbaccel.notebook_launcher(train, args=(5,), num_processes=2)" in text
    assert re.search(r'if __name__ == "__main__":\n    result = _nbaccel_main\(\)', text)
    assert text.index("def train") < text.index("_nbaccel_main") < text.index("final loss")


def test_from_import_form_and_other_magics(tmp_path):
    nb = tmp_path / "nb.ipynb"
    cells = [
        nbformat.v4.new_code_cell(
            "from nbaccel import notebook_launcher as nl\n%matplotlib inline"
        ),
        nbformat.v4.new_code_cell("%%bash\necho hi"),
        nbformat.v4.new_code_cell("%%time\nx = 1\nfiles = !ls\nx?"),
        nbformat.v4.new_code_cell("y = (1\n     % 1)  # valid Python stays as it is"),
        nbformat.v4.new_code_cell("def fit(a, b=2):\n    return a + b"),
        nbformat.v4.new_code_cell(
            "from nbaccel import notebook_launcher\nnotebook_launcher(fit, (1,), kwargs={'b': 3})"
        ),
    ]
    nbformat.write(nbformat.v4.new_notebook(cells=cells), nb)
    text = notebook_to_script(nb)
    ast.parse(text)
    assert "# %matplotlib inline" in text and "# %%bash" in text and "# echo hi" in text
    assert "\nx = 1\n" in text and "# files = !ls" in text and "# x?" in text
    assert "y = (1\n     % 1)" in text
    assert "return (fit)(*(1,), **{'b': 3})" in text
    assert "    _nbaccel_main()" in text


def test_refusals(tmp_path):
    no_call = tmp_path / "nocall.ipynb"
    nbformat.write(nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(TRAIN)]), no_call)
    with pytest.raises(ExportError, match="no notebook_launcher"):
        notebook_to_script(no_call)
    text = notebook_to_script(no_call, function="train")
    assert "return (train)(*(), **{})" in text
    assert "nbaccel.notebook_launcher(train, **_nbaccel_flags())" in text
    ast.parse(text)

    twice = make_notebook(
        tmp_path / "twice.ipynb",
        "nbaccel.notebook_launcher(train)\nnbaccel.notebook_launcher(train)",
    )
    with pytest.raises(ExportError, match="more than one place"):
        notebook_to_script(twice)

    broken = tmp_path / "broken.ipynb"
    nbformat.write(
        nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("def f(:\n  pass")]), broken
    )
    with pytest.raises(ExportError, match=r"broken.ipynb, cell 1, line 1: not valid Python"):
        notebook_to_script(broken, function="f")

    other = tmp_path / "other.py"
    other.write_text("# my own script\n")
    with pytest.raises(ExportError, match="pass --force"):
        export_notebook(no_call, other, function="train")
    assert other.read_text() == "# my own script\n"


MINIMAL = "import nbaccel\ndef train(): return 1"


def code_notebook(path, *sources):
    """A notebook of code cells with these sources."""
    cells = [nbformat.v4.new_code_cell(source) for source in sources]
    nbformat.write(nbformat.v4.new_notebook(cells=cells), path)
    return path


@pytest.mark.parametrize(
    "after",
    [
        "!ls checkpoints",
        "%ranks print(1)",
        "%load_ext autoreload",
        "# only a comment",
        "%%ranks\nx = 1",
    ],
)
def test_comment_only_cells_after_the_launch_compile(tmp_path, after):
    # Each of these cells becomes comments only; wrapped in a main guard they once gave an
    # `if __name__ == "__main__":` with no body, a script that did not compile.
    launch = "result = nbaccel.notebook_launcher(train, num_processes=2)\n"
    nb = code_notebook(tmp_path / "min.ipynb", MINIMAL, launch + after, after)
    out = tmp_path / "min.py"
    # In-process (the CLI path is the same function; the refusal test below runs the CLI).
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # %%ranks cells warn; that is tested on its own
        export_notebook(nb, out)
    compile(out.read_text(), str(out), "exec")


def test_ranks_cell_becomes_a_commented_block_with_a_warning(tmp_path):
    nb = code_notebook(
        tmp_path / "r.ipynb",
        MINIMAL,
        "result = nbaccel.notebook_launcher(train, num_processes=2)",
        "%%ranks\nimport torch\nprint(torch.distributed.get_rank())",
    )
    with pytest.warns(UserWarning, match=r"cell 3 is a %%ranks cell.*keeps it as comments"):
        text = notebook_to_script(nb)
    compile(text, "r.py", "exec")
    assert "# %%ranks cell 3: not run by the script" in text
    assert "\n# print(torch.distributed.get_rank())" in text


@pytest.mark.slow  # runs the CLI in a fresh Python (seconds)
def test_script_that_would_not_compile_is_refused_and_not_written(tmp_path):
    # `return` at top level parses (ast) but does not compile: the check must catch it.
    nb = code_notebook(
        tmp_path / "bad.ipynb", MINIMAL, "nbaccel.notebook_launcher(train)", "return 3"
    )
    out = tmp_path / "bad.py"
    result = run_cli("export", str(nb), "-o", str(out), cwd=tmp_path)
    assert result.returncode != 0
    assert "cell 3: the exported script would not compile" in result.stderr
    assert not out.exists()


@pytest.mark.slow  # runs the CLI in a fresh Python (seconds)
def test_cli_export_errors_are_one_line(tmp_path):
    result = run_cli("export", str(tmp_path / "missing.ipynb"), cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.startswith("nbaccel export: error: no such notebook")


@pytest.mark.slow
def test_round_trip_same_final_loss(tmp_path):
    """The notebook run (real kernel) and `nbaccel launch` of its export agree exactly."""
    from tests.kernel_helpers import KernelSession

    nb = make_notebook(
        tmp_path / "quick.ipynb",
        "result = nbaccel.notebook_launcher(train, args=(20,), num_processes=2, progress=False)",
    )
    notebook = nbformat.read(nb, as_version=4)
    with KernelSession(env={"NBACCEL_NO_WARMUP": "1"}, background_shutdown=True) as kernel:
        outputs = []
        for cell in notebook.cells:
            if cell.cell_type == "code":
                ran = kernel.execute(cell.source)
                assert ran.error is None, ran.error_text
                outputs.append(ran.stdout)
        assert not kernel.leftovers()
    notebook_loss = re.search(r"final loss (\S+)", outputs[-1]).group(1)

    exported = run_cli("export", str(nb), "-o", "train.py", cwd=tmp_path)
    assert exported.returncode == 0, exported.stderr
    launched = run_cli("launch", "--num_processes", "2", "train.py", cwd=tmp_path)
    assert launched.returncode == 0, launched.stdout + launched.stderr
    for rank in (0, 1):
        assert f"[rank{rank}] final loss {notebook_loss}" in launched.stdout.splitlines()
    assert not processes_mentioning(str(tmp_path / "train.py"))


@pytest.mark.slow
def test_skip_export_config_becomes_flags_and_plain_python_runs(tmp_path):
    """The config panel's ``cfg`` lives in skip-export cells: the script says so, leaves it
    out, takes --num_processes instead, and runs under plain ``python``."""
    import subprocess
    import sys

    from tests.test_cli_support import cli_env

    cells = [
        nbformat.v4.new_code_cell("import nbaccel"),
        nbformat.v4.new_code_cell(
            "cfg = nbaccel.configure()\ncfg.num_processes = 2",
            metadata={"tags": ["skip-export"]},
        ),
        nbformat.v4.new_code_cell(TRAIN),
        nbformat.v4.new_code_cell(
            "result = nbaccel.notebook_launcher(train, args=(5,), config=cfg)"
        ),
        nbformat.v4.new_code_cell('print(f"final loss {result:.6f}")'),
    ]
    nb = tmp_path / "panel.ipynb"
    nbformat.write(nbformat.v4.new_notebook(cells=cells), nb)
    with pytest.warns(UserWarning, match="uses cfg, which only skip-export cells define"):
        text = notebook_to_script(nb)
    assert "# Not carried over: notebook_launcher(..., config=...) uses cfg" in text
    assert "config=cfg" not in text and "--num_processes" in text
    (tmp_path / "train.py").write_text(text)
    ran = subprocess.run(
        [sys.executable, "train.py", "--num_processes", "2"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=180,
        env=cli_env(NBACCEL_CONFIG_FILE=str(tmp_path / "no-config.yaml")),
    )
    assert ran.returncode == 0, ran.stdout + ran.stderr
    assert "2 processes" in ran.stdout and "final loss" in ran.stdout


@pytest.mark.slow  # exports, then `nbaccel launch` on 2 ranks
def test_a_lambda_launched_in_the_notebook_is_called_by_each_rank(tmp_path):
    # Pasted bare, `lambda: train(3)(*(), **{})` returned a new lambda: nothing trained.
    nb = make_notebook(
        tmp_path / "lam.ipynb",
        "result = nbaccel.notebook_launcher(lambda: train(3), num_processes=2)",
        magics=False,
    )
    assert run_cli("export", str(nb), "-o", "lam.py", cwd=tmp_path).returncode == 0
    launched = run_cli("launch", "--num_processes", "2", "lam.py", cwd=tmp_path)
    assert launched.returncode == 0, launched.stdout + launched.stderr
    assert "[rank0] final loss" in launched.stdout and "[rank1] final loss" in launched.stdout


def test_the_notebook_itself_is_never_the_output_and_a_folder_takes_the_script(tmp_path):
    nb = make_notebook(tmp_path / "keep.ipynb", "result = nbaccel.notebook_launcher(train)")
    before = nb.read_bytes()
    with pytest.raises(ExportError, match="is the notebook itself"):
        export_notebook(nb, nb, force=True)
    assert nb.read_bytes() == before
    (tmp_path / "out").mkdir()
    assert export_notebook(nb, tmp_path / "out") == tmp_path / "out" / "keep.py"


@pytest.mark.slow  # runs the CLI in a fresh Python (seconds)
def test_the_suggested_command_carries_the_notebooks_literal_settings(tmp_path):
    nb = make_notebook(
        tmp_path / "set.ipynb",
        "result = nbaccel.notebook_launcher(train, (3,), 2, mixed_precision='bf16')",
        magics=False,
    )
    done = run_cli("export", str(nb), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    command = "nbaccel launch --num_processes 2 --mixed_precision bf16 set.py"
    assert f"run it with: {command}" in done.stdout
    assert (tmp_path / "set.py").read_text().splitlines()[0].endswith(command)


def test_the_suggested_command_names_the_script_from_where_export_ran(tmp_path):
    (tmp_path / "notebooks").mkdir()
    nb = make_notebook(
        tmp_path / "notebooks" / "a.ipynb", "result = nbaccel.notebook_launcher(train)"
    )
    done = run_cli("export", "notebooks/a.ipynb", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().endswith("run it with: nbaccel launch notebooks/a.py")
    # The script's own header names it from its folder, where the script lies.
    assert (tmp_path / "notebooks" / "a.py").read_text().splitlines()[0].endswith("launch a.py")
    assert nb.exists()


def test_the_cli_says_what_was_not_carried_over_in_one_line(tmp_path):
    cells = [
        nbformat.v4.new_code_cell("import nbaccel"),
        nbformat.v4.new_code_cell("cfg = nbaccel.configure()", metadata={"tags": ["skip-export"]}),
        nbformat.v4.new_code_cell(TRAIN),
        nbformat.v4.new_code_cell("result = nbaccel.notebook_launcher(train, config=cfg)"),
    ]
    nbformat.write(nbformat.v4.new_notebook(cells=cells), tmp_path / "panel.ipynb")
    done = run_cli("export", "panel.ipynb", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    notes = done.stderr.strip().splitlines()
    assert len(notes) == 1 and notes[0].startswith("nbaccel export: notebook_launcher(..."), notes
    assert "ExportWarning" not in done.stderr and "warnings.warn" not in done.stderr
