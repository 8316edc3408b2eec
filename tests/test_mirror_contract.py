"""The mirror's contract, in real kernels: what the kernel imported is imported in the fork
server while the kernel idles (as the person writes the next cell), whatever the number of
modules; checked through the server (a rank forked from it), not by timing."""

from __future__ import annotations

import textwrap
import time

import pytest

from tests.kernel_helpers import KernelSession

pytestmark = pytest.mark.slow  # real kernels

PACKAGES, MODULES = 30, 100  # 3,030 modules: about what `import transformers, datasets` loads
PREFIX = "nbgen_p"


def value(kernel: KernelSession, code: str, timeout: float = 240):
    cell = kernel.execute(textwrap.dedent(code).strip(), timeout=timeout)
    assert cell.error is None, cell.error_text
    return eval(cell.results[-1]["text/plain"])


def user_site_kernel(tmp_path, env=None) -> tuple[KernelSession, object]:
    """A kernel whose user site folder (a site-packages folder: mirrored) is under tmp_path."""
    home = tmp_path / "userbase"
    kernel = KernelSession(
        env={"NBACCEL_VIEW": "text", "PYTHONUSERBASE": str(home), **(env or {})},
        startup="import site, sys, time, importlib\n0",
    ).__enter__()
    user_site = value(kernel, "site.getusersitepackages()")
    folder = home / user_site[len(str(home)) + 1 :]
    folder.mkdir(parents=True)
    value(kernel, f"sys.path.append({user_site!r})\n0")
    return kernel, folder


def _generate(folder) -> list[str]:
    names = []
    for p in range(PACKAGES):
        package = folder / f"{PREFIX}{p:02d}"
        package.mkdir()
        (package / "__init__.py").write_text("VALUE = 0\n")
        names.append(package.name)
        for m in range(MODULES):
            (package / f"m{m:03d}.py").write_text(f"VALUE = {m}\n")
            names.append(f"{package.name}.m{m:03d}")
    return names


def test_a_kernel_that_imported_3000_modules_finds_them_all_in_the_server_after_idling(tmp_path):
    kernel, folder = user_site_kernel(tmp_path)
    with kernel:
        names = _generate(folder)
        half = len(names) // 2
        began = time.monotonic()
        # Half before `import nbaccel` (they go with the server's start), half after (a cell's).
        value(kernel, f"for n in {names[:half]!r}: importlib.import_module(n)\n0")
        value(kernel, "import nbaccel, nbaccel.launch.forkserver as _fs\n0")
        value(kernel, f"for n in {names[half:]!r}: importlib.import_module(n)\n0")
        imports = time.monotonic() - began
        # The kernel idles (the person writes the next cell) for as long as the imports took,
        # and the server's warm-up, many times over; it stops early once everything was answered.
        idle = max(60.0, 10 * imports)
        value(
            kernel,
            f"""
            _until = time.monotonic() + {idle}
            while time.monotonic() < _until and (_fs.SERVER.mirror is None or _fs.SERVER.mirror.pending):
                time.sleep(0.5)
            0
            """,
            timeout=idle + 60,
        )
        # The rank reports what the server had when it forked: the function and its argument
        # name no generated package, so the launch holds for none of them.
        probe = """
        def in_server(reversed_prefix):
            import sys
            prefix = reversed_prefix[::-1]
            return sum(1 for n in sys.modules if n.startswith(prefix))
        0
        """
        value(kernel, probe)
        in_kernel = value(kernel, f"sum(1 for n in sys.modules if n.startswith({PREFIX!r}))")
        assert in_kernel == len(names)
        found = value(
            kernel,
            f"nbaccel.notebook_launcher(in_server, args=({PREFIX[::-1]!r},), num_processes=1)",
        )
        assert found == len(names)
