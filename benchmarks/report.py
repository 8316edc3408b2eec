"""Turn the results dictionary into the markdown tables that ``latest.md`` and the README quote."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def _num(value: Any, fmt: str = "{:.3f}") -> str:
    if value is None:
        return "–"
    return fmt.format(value)


def _median(entry: dict[str, Any], key: str, fmt: str = "{:.3f}") -> str:
    stats = entry.get(key) or {}
    if not stats.get("n"):
        return "–"
    return _num(stats["median"], fmt) + (f" (n={stats['n']})" if stats["n"] > 1 else "")


def _load(entry: dict[str, Any], key: str) -> str:
    """The 1-minute load averages recorded beside a figure's runs: median (min-max)."""
    stats = entry.get(key) or {}
    if not stats.get("n"):
        return "–"
    return f"{stats['median']:.1f} ({stats['min']:.1f}–{stats['max']:.1f})"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    return lines + ["| " + " | ".join(row) + " |" for row in rows]


def _unavailable(name: str, entry: dict[str, Any], width: int) -> list[str]:
    return [name, f"unavailable: {entry['unavailable']}", *["" for _ in range(width - 2)]]


def _errors(section: dict[str, Any]) -> list[str]:
    notes = []
    for name, entry in section.get("contenders", {}).items():
        errs = entry.get("errors") if isinstance(entry, dict) else None
        if errs:
            first = " ".join(errs[0][:300].split())  # one line, inside the list item
            notes.append(f"- {name}: {len(errs)} failed run(s); first: `{first}`")
    return notes


def _section(
    section: dict[str, Any],
    title: str,
    header: list[str],
    row: Callable[[str, dict[str, Any]], list[str]],
    before: list[str] = (),
    after: list[str] = (),
) -> list[str]:
    """One results section as markdown: title, table (unavailable contenders say why), notes."""
    rows = [
        _unavailable(name, e, len(header)) if "unavailable" in e else row(name, e)
        for name, e in section["contenders"].items()
    ]
    return ["", title, *before, *_table(header, rows), *after, *_errors(section)]


def _launch_row(name: str, e: dict[str, Any]) -> list[str]:
    return [
        name,
        _median(e, "first_launch_s"),
        _median(e, "repeat_launch_s"),
        _median(e, "cell_repeat_s"),
        _num(e.get("first_launch_vs_nbaccel"), "{:.2f}×"),
        _num(e.get("repeat_launch_vs_nbaccel"), "{:.2f}×"),
        _load(e, "load_first_1min"),
        _load(e, "load_repeat_1min"),
    ]


def _steps_row(name: str, e: dict[str, Any]) -> list[str]:
    return [
        e["description"],
        _median(e, "steps_per_s", "{:.1f}"),
        _num(e.get("vs_raw"), "{:.3f}"),
        _num(e.get("vs_raw_paired"), "{:.3f}"),
        _median(e, "kernel_cpu_per_s", "{:.3f}"),
    ]


def _iopub_row(name: str, e: dict[str, Any]) -> list[str]:
    kb = (e.get("bytes_per_s") or {}).get("median")
    return [
        name,
        _median(e, "msgs_per_s", "{:.1f}"),
        _num(None if kb is None else kb / 1024, "{:.1f}"),
        _median(e, "messages_per_run", "{:.0f}"),
        ", ".join(f"{k}: {v}" for k, v in e.get("by_type_last_run", {}).items()),
    ]


def _failure_row(name: str, e: dict[str, Any]) -> list[str]:
    named = e.get("names_rank_error")
    return [
        name,
        _median(e, "seconds"),
        e.get("exception", "–"),
        "–" if named is None else ("yes" if named else "no"),
    ]


def _rss_row(name: str, e: dict[str, Any]) -> list[str]:
    return [
        name,
        _num(e.get("rss_after_first_mib"), "{:.1f}"),
        _num(e.get("growth_mib"), "{:+.1f}"),
        _num(e.get("growth_per_launch_kib"), "{:+.0f}"),
    ]


def _gpu_row(name: str, e: dict[str, Any]) -> list[str]:
    return [name, _median(e, "step_s", "{:.5f}"), _num(e.get("vs_autocast_bf16"))]


def _later_runs(results: dict[str, Any]) -> dict[str, tuple[list[str], Any]]:
    """Runs of ``--only`` sections merged into an earlier file: date → (sections, load)."""
    runs: dict[str, tuple[list[str], Any]] = {}
    for name, section in results.items():
        later = section.get("measured") if isinstance(section, dict) else None
        if later and later["date"] != results["machine"]["date"]:
            runs.setdefault(later["date"], ([], later.get("load_average_at_start")))[0].append(name)
    return runs


def render(results: dict[str, Any]) -> str:
    m = results["machine"]
    out = [
        "# nbaccel benchmarks",
        "",
        f"Measured {m['date']} on {m['cpu']} ({m['cores']} cores), Python {m['python']}, "
        f"torch {m['torch']}, accelerate {m['versions'].get('accelerate', 'not installed')}, "
        f"{results['world_size']} CPU ranks, {results['reps']} interleaved repetition(s)"
        + (" — SMOKE RUN, numbers meaningless" if results.get("smoke") else "")
        + f". Load average at start: {m.get('load_average_at_start')}. Medians; "
        "`python -m benchmarks` regenerates this file.",
        *[
            f"Sections re-measured later ({', '.join(names)}): {date}, load average at start "
            f"{load}."
            for date, (names, load) in _later_runs(results).items()
        ],
    ]
    if s := results.get("launch"):
        out += _section(
            s,
            "## 1. Launch cell start → every rank's first optimizer step (s, lower is better)",
            [
                "launcher",
                "first launch in a fresh kernel",
                "repeated launch",
                "repeated launch, whole call",
                "first ÷ nbaccel",
                "repeated ÷ nbaccel",
                "load, first",
                "load, repeated",
            ],
            _launch_row,
            after=[
                f"First launch ÷ Accelerate's: nbaccel {_num(s.get('nbaccel_first_vs_accelerate'))}"
                f", the floor (no launcher) {_num(s.get('floor_vs_accelerate'))}: no launcher's "
                "first launch right after the import cell beats the kernel's own first step.",
            ],
        )
    if s := results.get("steps"):
        out += _section(
            s,
            f"## 2. Training steps per second ({s['steps']} steps, higher is better)",
            [
                "loop",
                "steps/s",
                "÷ raw (medians)",
                "÷ raw (paired runs)",
                "kernel CPU s per launch s",
            ],
            _steps_row,
            after=[f"Target (dashboard within 3% of raw DDP) met: {s.get('target_met')}"],
        )
    if s := results.get("iopub"):
        out += _section(
            s,
            f"## 3. iopub traffic to the notebook during a {s['steps']}-step loop",
            ["view", "messages/s", "KiB/s", "messages per run", "types (last run)"],
            _iopub_row,
        )
    if s := results.get("failure"):
        out += _section(
            s,
            "## 4a. A rank raises → the cell raises (s, lower is better)",
            ["launcher", "seconds", "exception in the cell", "shows the rank's error"],
            _failure_row,
        )
    if s := results.get("rss"):
        out += _section(
            s,
            f"## 4b. Kernel RSS over {s['launches']} launches",
            ["launcher", "RSS after launch 1 (MiB)", "growth (MiB)", "per launch (KiB)"],
            _rss_row,
        )
    s = results.get("gpu")
    if s is not None:
        title = "## 5. GPU mixed precision (one GPU)"
        if "skipped" in s:
            out += ["", title, f"Skipped: {s['skipped']}"]
        else:
            out += _section(
                s,
                title,
                ["precision", "s/step", "÷ plain autocast bf16"],
                _gpu_row,
                before=[f"{s['device']}, {s['model']}"],
            )
    out += render_issue15(results)
    out += _render_heavy(results.get("heavy"))
    out += _render_restart_run_all(results.get("restart_run_all"))
    out += _render_script(results.get("script"))
    out += _render_parallelism(results.get("parallelism"))
    return "\n".join(out) + "\n"


def _parallelism_row(name: str, e: dict[str, Any]) -> list[str]:
    return [
        name,
        _median(e, "samples_per_s", "{:.1f}"),
        _median(e, "param_optimizer_mib_max_rank", "{:.2f}"),
        _median(e, "peak_rss_mib", "{:.0f}"),
        _load(e, "load"),
    ]


def _render_parallelism(s: dict[str, Any] | None) -> list[str]:
    if not s:
        return []
    return _section(
        s,
        "## 12. N-D parallelism on 4 CPU ranks: one small transformer split four ways",
        [
            "layout",
            "samples/s (slowest rank)",
            "parameters + optimizer state per rank (MiB)",
            "peak RSS per rank (MiB)",
            "load",
        ],
        _parallelism_row,
        before=[s["what"] + "."],
        after=[
            f"Parameters + optimizer state at dp_shard 2 × tp 2 ÷ dp 4's: "
            f"{_num(s.get('tp2_vs_dp_memory'))} (target ≤ 0.6: {s.get('target_met')})."
        ],
    )


def _heavy_row(name: str, e: dict[str, Any]) -> list[str]:
    return [
        name,
        _median(e, "first_launch_s"),
        _median(e, "first_cell_s"),
        _load(e, "first_load_1min"),
        _median(e, "repeat_launch_s"),
        _median(e, "repeat_cell_s"),
        _load(e, "repeat_load_1min"),
        _median(e, "import_cell_s"),
    ]


def _render_heavy(s: dict[str, Any] | None) -> list[str]:
    if not s:
        return []
    idle = s.get("idle_before_relaunch_s", 0)
    return _section(
        s,
        "## 9. A kernel that imported a heavy package: `from transformers import Trainer` before "
        "the launcher, and in the launched function (s, lower is better)",
        [
            "launcher",
            "first launch right after the import cell: to first step",
            "whole call",
            "load",
            f"warm relaunch (after {idle:g} s idle): to first step",
            "whole call",
            "load",
            "import cell (s)",
        ],
        _heavy_row,
        after=[
            "nbaccel ÷ Accelerate (medians): first launch "
            f"{_num(s.get('first_launch_nbaccel_vs_accelerate'))} to first step, "
            f"{_num(s.get('first_cell_nbaccel_vs_accelerate'))} whole call; warm relaunch "
            f"{_num(s.get('repeat_launch_nbaccel_vs_accelerate'))} to first step, "
            f"{_num(s.get('repeat_cell_nbaccel_vs_accelerate'))} whole call (target: warm "
            "relaunch ≤ 0.5). The function's own time, first rank in to last rank out, is "
            f"{_num(s.get('repeat_floor_vs_accelerate'))} of Accelerate's warm whole call: a "
            "launcher that cost nothing would reach that ratio, no lower. Load: 1-minute load "
            "average at each launch, median (min–max)."
        ],
    )


def _restart_row(name: str, e: dict[str, Any]) -> list[str]:
    return [
        name,
        _median(e, "total_s"),
        _median(e, "imports_s"),
        _median(e, "launch_cell_s"),
        _median(e, "first_step_s"),
        _load(e, "load_1min"),
    ]


def _render_restart_run_all(s: dict[str, Any] | None) -> list[str]:
    if not s:
        return []
    ratios = s.get("total_nbaccel_vs_accelerate", {})
    paired = s.get("total_nbaccel_vs_accelerate_paired", {})
    return _section(
        s,
        "## 10. Restart & Run All: kernel start → end of the launch cell (s, lower is better)",
        [
            "notebook/launcher",
            "kernel start → launch cell done",
            "→ imports done",
            "launch cell",
            "→ last rank's first step",
            "load",
        ],
        _restart_row,
        before=[
            "`hf`: `import transformers, datasets, torch`, the launcher, a tiny BERT from a "
            "config and a torch Dataset, a DDP training function "
            f"({s.get('steps')} AdamW steps), the launch; `torch`: the same without "
            "transformers and datasets (a small MLP). Every cell in a fresh kernel."
        ],
        after=[
            "nbaccel ÷ Accelerate, kernel start → launch cell done: "
            + "; ".join(
                f"{nb} {_num(ratios.get(nb))} (paired runs {_num(paired.get(nb))})" for nb in ratios
            )
            + " (target ≤ 0.8). Load: 1-minute load average at each run's start, median "
            "(min–max)."
        ],
    )


def _reporting_row(name: str, e: dict[str, Any]) -> list[str]:
    return [f"`{e['description']}`", _median(e, "us_per_call", "{:.3f}")]


def _transfer_row(name: str, e: dict[str, Any]) -> list[str]:
    return [
        name,
        _median(e, "argument_s"),
        _median(e, "argument_extra_s"),
        _median(e, "result_s"),
        _median(e, "result_extra_s"),
    ]


def _scaling_row(ranks: list[int], pauses: list[float]) -> Callable[[str, dict], list[str]]:
    def row(name: str, e: dict[str, Any]) -> list[str]:
        by_ranks = [_median(e["by_ranks"], str(n)) for n in ranks]
        by_pause = [_median(e["fresh_kernel_by_pause"], f"{p:g}") for p in pauses]
        return [name, *by_ranks, *by_pause, _median(e, "import_cell_s")]

    return row


def render_issue15(results: dict[str, Any]) -> list[str]:
    """Sections 6-8: reporting cost, tensor transfer, scaling with ranks and import pause."""
    out: list[str] = []
    if s := results.get("reporting"):
        out += _section(
            s,
            "## 6. Reporting cost inside a rank (µs per call, empty loop subtracted)",
            ["call", "µs per call/iteration"],
            _reporting_row,
            after=[
                f"progress ÷ tqdm (hooked, paired runs): "
                f"{_num(s.get('progress_vs_tqdm_hooked_paired'))}; progress ÷ plain tqdm: "
                f"{_num(s.get('progress_vs_tqdm_plain'))}. Targets: log() ≤ 1 µs, progress ≤ "
                "tqdm. Sub-microsecond numbers on a shared machine wobble by tens of percent."
            ],
        )
    if s := results.get("transfer"):
        out += _section(
            s,
            f"## 7. Tensor argument/result transfer, {s['world_size']} ranks (s, lower is better)",
            ["size", "argument → ranks", "extra over 4 B", "result → kernel", "extra over 4 B"],
            _transfer_row,
            after=[f"- {e}" for e in s.get("errors_all", [])],
        )
    if s := results.get("scaling"):
        ranks, pauses = s["ranks"], s["pauses_s"]
        out += _section(
            s,
            "## 8. Launch → every rank's first step by rank count (warm kernel), and the first "
            "launch in a fresh kernel by pause after the import cell (s, lower is better)",
            [
                "launcher",
                *[f"{n} rank(s)" for n in ranks],
                *[f"fresh, {p:g} s pause" for p in pauses],
                "import cell (s)",
            ],
            _scaling_row(ranks, pauses),
        )
    return out


def _script_row(name: str, e: dict[str, Any]) -> list[str]:
    return [
        name,
        _median(e, "first_step_s"),
        _median(e, "first_call_s"),
        _median(e, "repeat_step_s"),
        _median(e, "repeat_call_s"),
        _load(e, "load_1min"),
    ]


def _render_script(s: dict[str, Any] | None) -> list[str]:
    if not s:
        return []
    return _section(
        s,
        "## 11. A script (no kernel) that imported transformers, launching a function that "
        "imports it, again and again (s, lower is better)",
        [
            "launcher",
            "first launch: to first step",
            "whole call",
            "each later launch: to first step",
            "whole call",
            "load",
        ],
        _script_row,
        after=[
            "nbaccel ÷ Accelerate, a later launch's whole call (medians): "
            f"{_num(s.get('repeat_call_nbaccel_vs_accelerate'))}. Load: 1-minute load average "
            "at each script's start, median (min–max)."
        ],
    )
