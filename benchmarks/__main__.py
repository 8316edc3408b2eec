"""``python -m benchmarks``: run the sections, write ``results/latest.{json,md}``, print the table.

Options: ``--reps N`` interleaved repetitions (default 5), ``--smoke`` (one repetition, tiny
step counts, the sections sharing their kernels: checks the wiring, the numbers mean nothing),
``--only launch,steps,...``, ``--world N`` ranks (default 2), ``--out DIR`` (default
``benchmarks/results``). With ``--only``, the sections not run are kept from the results file
already there (each section says when it was measured).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

SECTIONS = (
    "launch",
    "steps",
    "iopub",
    "failure",
    "rss",
    "gpu",
    "reporting",
    "transfer",
    "scaling",
    "heavy",
    "restart_run_all",
    "script",
    "parallelism",
)
DEFAULT_OUT = Path(__file__).resolve().parent / "results"


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=5, help="interleaved repetitions (default 5)")
    p.add_argument("--smoke", action="store_true", help="1 repetition, tiny step counts")
    p.add_argument("--only", default=",".join(SECTIONS), help="comma-separated sections")
    p.add_argument("--world", type=int, default=2, help="ranks per launch (default 2)")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="results folder")
    args = p.parse_args(argv)
    args.only = [s.strip() for s in args.only.split(",") if s.strip()]
    unknown = set(args.only) - set(SECTIONS)
    if unknown:
        p.error(f"unknown section(s) {sorted(unknown)}; choose from {', '.join(SECTIONS)}")
    if args.smoke:
        args.reps = 1
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    # The kernels import the workload and tests.kernel_helpers from the repository root.
    root = str(Path(__file__).resolve().parent.parent)
    if root not in sys.path:
        sys.path.insert(0, root)
    from benchmarks import (
        failure_rss,
        gpu,
        harness,
        heavy_import,
        iopub,
        launch_time,
        parallelism,
        report,
        reporting_cost,
        restart_run_all,
        scaling,
        script_relaunch,
        step_rate,
        transfer,
    )

    results: dict[str, Any] = {
        "machine": harness.machine_info(),
        "world_size": args.world,
        "reps": args.reps,
        "smoke": args.smoke,
        "sections_run": args.only,
        "calls": harness.CALLS,
    }
    scratch = harness.Scratch()
    started = time.monotonic()
    # A smoke run's sections share their kernels (see harness.shared_kernels).
    sharing = harness.shared_kernels() if args.smoke else contextlib.nullcontext()
    try:
        with sharing:
            for name in args.only:
                t0 = time.monotonic()
                print(f"[benchmarks] {name} ...", file=sys.stderr, flush=True)
                if name == "launch":
                    results[name] = launch_time.run(args.reps, args.smoke, args.world, scratch)
                elif name == "steps":
                    results[name] = step_rate.run(args.reps, args.smoke, args.world, scratch)
                elif name == "iopub":
                    results[name] = iopub.run(args.reps, args.smoke, args.world, scratch)
                elif name == "failure":
                    results[name] = failure_rss.run_failure(
                        args.reps, args.smoke, args.world, scratch
                    )
                elif name == "rss":
                    results[name] = failure_rss.run_rss(args.smoke, args.world, scratch)
                elif name == "gpu":
                    results[name] = gpu.run(args.reps, args.smoke)
                elif name == "reporting":
                    results[name] = reporting_cost.run(args.reps, args.smoke)
                elif name == "transfer":
                    results[name] = transfer.run(args.reps, args.smoke, args.world)
                elif name == "scaling":
                    results[name] = scaling.run(args.reps, args.smoke, scratch)
                elif name == "heavy":
                    results[name] = heavy_import.run(args.reps, args.smoke, args.world, scratch)
                elif name == "restart_run_all":
                    results[name] = restart_run_all.run(args.reps, args.smoke, args.world, scratch)
                elif name == "script":
                    results[name] = script_relaunch.run(args.reps, args.smoke, args.world, scratch)
                elif name == "parallelism":
                    results[name] = parallelism.run(args.reps, args.smoke)
                results[name]["section_seconds"] = round(time.monotonic() - t0, 1)
                results[name]["measured"] = {
                    "reps": args.reps,
                    **{
                        k: results["machine"][k]
                        for k in ("date", "git_commit", "load_average_at_start")
                    },
                }
    finally:
        scratch.close()
    results["total_seconds"] = round(time.monotonic() - started, 1)
    args.out.mkdir(parents=True, exist_ok=True)
    results = _kept_from_before(results, args.out / "latest.json")
    (args.out / "latest.json").write_text(json.dumps(results, indent=2) + "\n")
    table = report.render(results)
    (args.out / "latest.md").write_text(table)
    print(table)
    print(f"[benchmarks] wrote {args.out / 'latest.json'} and latest.md", file=sys.stderr)
    return 0


def _kept_from_before(results: dict[str, Any], path: Path) -> dict[str, Any]:
    """The earlier file's results with the sections just run replaced (a run of a few sections
    must not drop the others); a smoke run or a missing file keeps nothing."""
    if results["smoke"] or set(results["sections_run"]) >= set(SECTIONS) or not path.exists():
        return results
    try:
        earlier = json.loads(path.read_text())
    except ValueError:
        return results
    if earlier.get("smoke"):
        return results
    merged = {**earlier, **{n: results[n] for n in results["sections_run"] if n in results}}
    merged["sections_run"] = sorted(
        set(earlier.get("sections_run", [])) | set(results["sections_run"])
    )
    return merged


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
