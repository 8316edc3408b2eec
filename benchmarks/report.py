"""Turn the results dictionary into the markdown tables that ``latest.md`` and the README quote."""

from __future__ import annotations

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
            notes.append(f"- {name}: {len(errs)} failed run(s); first: `{errs[0][:200]}`")
    return notes


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
    ]
    s = results.get("launch")
    if s:
        out += [
            "",
            "## 1. Launch cell start → every rank's first optimizer step (s, lower is better)",
        ]
        rows = []
        for name, e in s["contenders"].items():
            if "unavailable" in e:
                rows.append(_unavailable(name, e, 5))
                continue
            rows.append(
                [
                    name,
                    _median(e, "first_launch_s"),
                    _median(e, "repeat_launch_s"),
                    _num(e.get("first_launch_vs_nbaccel"), "{:.2f}×"),
                    _num(e.get("repeat_launch_vs_nbaccel"), "{:.2f}×"),
                ]
            )
        out += _table(
            [
                "launcher",
                "first launch in a fresh kernel",
                "repeated launch",
                "first ÷ nbaccel",
                "repeated ÷ nbaccel",
            ],
            rows,
        )
        out += _errors(s)
    s = results.get("steps")
    if s:
        out += ["", f"## 2. Training steps per second ({s['steps']} steps, higher is better)"]
        rows = []
        for name, e in s["contenders"].items():
            if "unavailable" in e:
                rows.append(_unavailable(name, e, 4))
                continue
            rows.append(
                [
                    e["description"],
                    _median(e, "steps_per_s", "{:.1f}"),
                    _num(e.get("vs_raw"), "{:.3f}"),
                    _num(e.get("vs_raw_paired"), "{:.3f}"),
                ]
            )
        out += _table(["loop", "steps/s", "÷ raw (medians)", "÷ raw (paired runs)"], rows)
        out += [f"Target (dashboard within 3% of raw DDP) met: {s.get('target_met')}"]
        out += _errors(s)
    s = results.get("iopub")
    if s:
        out += ["", f"## 3. iopub traffic to the notebook during a {s['steps']}-step loop"]
        rows = []
        for name, e in s["contenders"].items():
            if "unavailable" in e:
                rows.append(_unavailable(name, e, 5))
                continue
            kb = (e.get("bytes_per_s") or {}).get("median")
            rows.append(
                [
                    name,
                    _median(e, "msgs_per_s", "{:.1f}"),
                    _num(None if kb is None else kb / 1024, "{:.1f}"),
                    _median(e, "messages_per_run", "{:.0f}"),
                    ", ".join(f"{k}: {v}" for k, v in e.get("by_type_last_run", {}).items()),
                ]
            )
        out += _table(["view", "messages/s", "KiB/s", "messages per run", "types (last run)"], rows)
        out += _errors(s)
    s = results.get("failure")
    if s:
        out += ["", "## 4a. A rank raises → the cell raises (s, lower is better)"]
        rows = []
        for name, e in s["contenders"].items():
            if "unavailable" in e:
                rows.append(_unavailable(name, e, 4))
                continue
            named = e.get("names_rank_error")
            rows.append(
                [
                    name,
                    _median(e, "seconds"),
                    e.get("exception", "–"),
                    "–" if named is None else ("yes" if named else "no"),
                ]
            )
        out += _table(
            ["launcher", "seconds", "exception in the cell", "shows the rank's error"], rows
        )
        out += _errors(s)
    s = results.get("rss")
    if s:
        out += ["", f"## 4b. Kernel RSS over {s['launches']} launches"]
        rows = []
        for name, e in s["contenders"].items():
            if "unavailable" in e:
                rows.append(_unavailable(name, e, 4))
                continue
            rows.append(
                [
                    name,
                    _num(e.get("rss_after_first_mib"), "{:.1f}"),
                    _num(e.get("growth_mib"), "{:+.1f}"),
                    _num(e.get("growth_per_launch_kib"), "{:+.0f}"),
                ]
            )
        out += _table(
            ["launcher", "RSS after launch 1 (MiB)", "growth (MiB)", "per launch (KiB)"], rows
        )
        out += _errors(s)
    s = results.get("gpu")
    if s is not None:
        out += ["", "## 5. GPU mixed precision (one GPU)"]
        if "skipped" in s:
            out += [f"Skipped: {s['skipped']}"]
        else:
            rows = []
            for name, e in s["contenders"].items():
                if "unavailable" in e:
                    rows.append(_unavailable(name, e, 3))
                    continue
                rows.append([name, _median(e, "step_s", "{:.5f}"), _num(e.get("vs_autocast_bf16"))])
            out += [f"{s['device']}, {s['model']}"]
            out += _table(["precision", "s/step", "÷ plain autocast bf16"], rows)
    return "\n".join(out) + "\n"
