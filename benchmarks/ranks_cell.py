"""How interactive are persistent ranks? A ``%%ranks`` cell doing an all_reduce, timed.

``python -m benchmarks.ranks_cell [--reps 20] [--world 2]`` starts a real ipykernel (as the other
sections do), starts the ranks once with ``%ranks start``, then runs ``reps`` times the cell::

    %%ranks
    dist.all_reduce(t)
    t.sum().item()

and reports the median wall time from the client's ``execute_request`` to the kernel's ``idle``
(everything a notebook user waits for, ``[rankN] Out:`` lines included), next to the median of
``Ranks.run`` for the same code called in the kernel (the session alone, no Jupyter messaging).
Target: a median of at most 50 ms on 2 CPU ranks. Standalone (not a section of
``python -m benchmarks``); it prints one table row and the numbers as JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

CELL = "%%ranks\ndist.all_reduce(t)\nt.sum().item()"
TARGET_S = 0.050


def measure(reps: int, world: int) -> dict[str, object]:
    root = str(Path(__file__).resolve().parent.parent)
    if root not in sys.path:
        sys.path.insert(0, root)
    from tests.kernel_helpers import KernelSession

    with KernelSession(startup="import nbaccel") as kernel:
        cell = kernel.execute(f"%ranks start -n {world}")
        assert cell.error is None, cell.error_text
        setup = kernel.execute("%%ranks\nt = torch.ones(4)\ndist.all_reduce(t)")  # warm gloo
        assert setup.error is None, setup.error_text
        cell_s = []
        for _ in range(reps):
            started = time.perf_counter()
            cell = kernel.execute(CELL)
            cell_s.append(time.perf_counter() - started)
            assert cell.error is None and "[rank0] Out:" in cell.stdout, cell.error_text
        api = kernel.execute(
            "import time as _t\n_s = get_ipython()._nbaccel_ranks_magics.session\n_d = []\n"
            f"for _ in range({reps}):\n    _a = _t.perf_counter()\n"
            "    _s.run('dist.all_reduce(t)\\nt.sum().item()', values=False)\n"
            "    _d.append(_t.perf_counter() - _a)\nprint(sorted(_d)[len(_d) // 2])"
        )
        assert api.error is None, api.error_text
        kernel.execute("%ranks stop")
    median = statistics.median(cell_s)
    return {
        "world_size": world,
        "reps": reps,
        "cell_median_s": median,
        "cell_p90_s": sorted(cell_s)[int(0.9 * (len(cell_s) - 1))],
        "api_median_s": float(api.stdout.strip()),
        "target_s": TARGET_S,
        "target_met": median <= TARGET_S,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.ranks_cell", description=__doc__)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--world", type=int, default=2)
    args = p.parse_args(argv)
    r = measure(args.reps, args.world)
    print("| %%ranks all_reduce cell | median (ms) | p90 (ms) | Ranks.run alone (ms) | target |")
    print("|---|---|---|---|---|")
    print(
        f"| {r['world_size']} CPU ranks, n={r['reps']} | {r['cell_median_s'] * 1e3:.1f} | "
        f"{r['cell_p90_s'] * 1e3:.1f} | {r['api_median_s'] * 1e3:.1f} | "
        f"<= {TARGET_S * 1e3:.0f} ms: {'met' if r['target_met'] else 'NOT met'} |"
    )
    print(json.dumps(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
