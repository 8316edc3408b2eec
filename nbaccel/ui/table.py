"""The live dashboard's main HTML: header, run line, stall notice, per-rank table and charts.

Pure functions of the launch state (plus the chart SVG), so a test can render them without a
kernel. Cells are left-aligned explicitly: JupyterLab right-aligns table cells by default.
"""

from __future__ import annotations

import html

from nbaccel.launch.state import FAILED, LaunchState, RankState
from nbaccel.ui.formats import format_seconds
from nbaccel.ui.summary import (
    CELL,
    STATUS_COLOURS,
    STRAGGLER_MARK,
    WRAP_CELL,
    WRAPPING,
    compiling_note,
    describe,
    format_count,
    format_memory,
    format_metrics,
    format_rate,
    role,
    run_line,
    stall_text,
    waiting_text,
)

COLUMNS = ("rank", "status", "progress", "", "rate", "ETA", "memory", "elapsed", "metrics")


def header_html(state: LaunchState, now: float) -> str:
    """What runs: processes, devices, the precision/strategy the ranks report, elapsed."""
    info = state.info
    devices = info.device
    if info.device == "cuda":
        from nbaccel.core import hardware

        gpus = hardware.detect().gpus[: info.num_processes]
        names = sorted({g.name for g in gpus})
        devices = f"{len(gpus)}× {', '.join(names)}" if names else "cuda"
    waiting = waiting_text(state, now)
    outcome = state.outcome or (
        "waiting" if waiting else "running" if any(not r.done for r in state.ranks.values()) else ""
    )
    reported = [r.effective for r in state.ranks.values() if r.effective]
    first = reported[0] if reported else {}
    precision = first.get("mixed_precision", info.mixed_precision)
    strategy = first.get("strategy", info.strategy)
    accumulation = first.get("gradient_accumulation_steps", str(info.gradient_accumulation_steps))
    processes = f"{info.num_processes}" + (
        f" of {info.world_size}" if info.world_size != info.num_processes else ""
    )
    items = [
        ("processes", processes),
        ("devices", f"{devices} ({info.backend})"),
        ("precision", precision),
        ("strategy", strategy),
        *(
            [("mesh", first.get("parallelism") or info.parallelism)]
            if first.get("parallelism") or info.parallelism
            else []
        ),
        ("grad. accumulation", accumulation),
        ("elapsed", format_seconds(state.elapsed(now))),
    ]
    if state.attempts > 1:  # a launch with restarts: which one this view is
        items.insert(0, ("attempt", f"{state.attempt} of {state.attempts}"))
    cells = " · ".join(f"{k} <b>{html.escape(str(v))}</b>" for k, v in items)
    if waiting:  # the first seconds of a launch: say what they go to, the clock ticking
        cells += f" · <span class='nbaccel-waiting'>waiting for {html.escape(waiting)}</span>"
    return (
        f"<div class='nbaccel-header' data-outcome='{html.escape(str(outcome))}' "
        f"data-precision='{html.escape(precision)}' title='{html.escape(describe(state))}' "
        f"style='margin-bottom:2px'><b>nbaccel</b> {html.escape(str(outcome))} — {cells}</div>"
    )


def row_html(
    rank: RankState, straggler: bool, now: float, metrics: dict[str, float] | None = None
) -> str:
    """One rank's row; ``metrics`` (default: the latest) lets the row show the values the
    charts were drawn from."""
    colour = STATUS_COLOURS.get(rank.shown_status, "inherit")
    bar = rank.bar
    n, total = (bar.n, bar.total) if bar else (0, None)
    done = 1.0 if rank.shown_status == "finished" else 0.0
    frac = min(1.0, n / total) if bar and total else done
    fill = STATUS_COLOURS["failed"] if rank.shown_status == FAILED else "#2da44e"
    meter = (
        "<div style='width:140px;height:10px;background:#d0d7de;border-radius:3px'>"
        f"<div style='width:{frac * 100:.1f}%;height:100%;background:{fill};"
        "border-radius:3px'></div></div>"
    )
    mark = (
        f" <span class='nbaccel-straggler' title='step rate 20% or more below the median' "
        f"style='color:#9a6700;font-weight:600'>▼&nbsp;{STRAGGLER_MARK}</span>"
        if straggler
        else ""
    )
    place = role(rank)
    cells = [
        f"rank {rank.rank}"
        + (f" <span class='nbaccel-role'>· {html.escape(place)}</span>" if place else ""),
        f"<span style='color:{colour};font-weight:600'>{rank.status_text}</span>"
        f"{html.escape(compiling_note(rank, now))}{mark}",
        html.escape(format_count(rank)),
        meter,
        html.escape(format_rate(rank, now)),
        format_seconds(rank.eta(now)),
        html.escape(format_memory(rank)),
        format_seconds(rank.elapsed(now)),
        html.escape(format_metrics(rank.metrics if metrics is None else metrics) or "-"),
    ]
    tds = "".join(
        f"<td style='{WRAP_CELL if name in WRAPPING else CELL}'>{c}</td>"
        for name, c in zip(COLUMNS, cells)
    )
    failed = rank.shown_status == FAILED
    style = "background:rgba(207,34,46,0.12)" if failed else ""
    row = (
        f"<tr class='nbaccel-rank' data-rank='{rank.rank}' data-status='{rank.shown_status}' "
        f"data-n='{n}' data-total='{'' if total is None else total}' "
        f"data-rate='{html.escape(format_rate(rank, now))}' data-straggler='{int(straggler)}' "
        f"style='{style}'>{tds}</tr>"
    )
    if failed and rank.error_line:
        row += (
            f"<tr class='nbaccel-error' data-rank='{rank.rank}' style='{style}'>"
            f"<td></td><td colspan='{len(COLUMNS) - 1}' style='{CELL};color:{colour}'>"
            f"{html.escape(rank.error_line)}</td></tr>"
        )
    return row


def table_html(
    state: LaunchState,
    now: float,
    charts: str = "",
    metrics: dict[int, dict[str, float]] | None = None,
    header: bool = True,
) -> str:
    """The live HTML; with ``charts``, pass the ``metrics`` they were drawn from (rank ->
    values), so the table and the charts show the same sample. ``header=False`` leaves out
    what the launch runs (a ``%%ranks`` cell's progress needs no launch header)."""
    head = "".join(f"<th style='{CELL}'>{h}</th>" for h in COLUMNS)
    slow = state.stragglers(now)
    ranks = sorted(state.ranks.values(), key=lambda r: r.rank)
    rows = "".join(row_html(r, r.rank in slow, now, (metrics or {}).get(r.rank)) for r in ranks)
    run = ""
    if any(r.bars for r in ranks):
        line = html.escape(run_line(state, now))
        run = f"<div class='nbaccel-run' style='margin:2px 0'>{line}</div>"
    stall = stall_text(state, now)
    if stall:
        stall = (
            "<pre class='nbaccel-stall' style='color:#9a6700;background:rgba(212,167,44,0.12);"
            f"margin:2px 0;padding:2px 4px'>{html.escape(stall)}</pre>"
        )
    return (
        f"<div class='nbaccel-live'>{header_html(state, now) if header else ''}{run}{stall}"
        "<table style='border-collapse:collapse;font-family:monospace;font-size:12px;margin:0'>"
        f"<tr>{head}</tr>{rows}</table>{charts}</div>"
    )
