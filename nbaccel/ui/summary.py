"""The final per-rank table of a launch, as plain text and as static HTML.

Both views end with it, so a saved notebook, nbconvert or GitHub's renderer still shows what
happened after the live widgets are gone.
"""

from __future__ import annotations

import html

from nbaccel.core.launch_state import LaunchState, RankState


def format_seconds(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


def format_metrics(metrics: dict[str, float], limit: int = 4) -> str:
    items = list(metrics.items())[:limit]
    return " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in items)


def format_progress(rank: RankState) -> str:
    bar = rank.bar
    if bar is None:
        return "-"
    total = f"/{bar.total}" if bar.total is not None else ""
    desc = f"{bar.desc}: " if bar.desc else ""
    return f"{desc}{bar.n}{total}{format_rate(rank)}"


def format_rate(rank: RankState) -> str:
    """`` 12.3 it/s`` (and samples/s where the bar knows its batch size), or ""."""
    bar = rank.bar
    if bar is None or not bar.rate:
        return ""
    samples = f", {bar.rate * bar.unit_scale:.1f} samples/s" if bar.unit_scale else ""
    return f" {bar.rate:.1f} it/s{samples}"


def _table(state: LaunchState) -> tuple[list[str], list[list[str]]]:
    """Header and rows; the progress and metrics columns only where some rank has them."""
    ranks = sorted(state.ranks.values(), key=lambda r: r.rank)
    with_progress = any(r.bars for r in ranks)
    with_metrics = any(r.metrics for r in ranks)
    header = ["rank", "status"] + ["progress"] * with_progress + ["elapsed"]
    header += ["metrics"] * with_metrics
    rows = []
    for rank in ranks:
        status = rank.status + (f" ({rank.error_line})" if rank.error_line else "")
        row = [str(rank.rank), status]
        row += [format_progress(rank)] * with_progress + [format_seconds(rank.elapsed)]
        row += [format_metrics(rank.metrics) or "-"] * with_metrics
        rows.append(row)
    return header, rows


def headline(state: LaunchState) -> str:
    outcome = state.outcome or "running"
    return f"nbaccel: {state.info.describe()} — {outcome} after {format_seconds(state.elapsed)}"


def summary_text(state: LaunchState, outputs: dict[int, list[str]] | None = None) -> str:
    """The table as aligned text; with ``outputs`` (rank -> lines), each rank's last lines too."""
    header, body = _table(state)
    rows = [header, *body]
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    lines = [headline(state)]
    lines += ["  " + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    for rank, tail in sorted((outputs or {}).items()):
        if tail:
            lines.append(f"-- rank {rank} output (last {min(len(tail), TEXT_TAIL)} lines) --")
            lines += [f"[rank{rank}] {line}" for line in tail[-TEXT_TAIL:]]
    return "\n".join(lines)


TEXT_TAIL = 20  # output lines per rank in the plain-text summary


STATUS_COLOURS = {
    "finished": "#1a7f37",
    "failed": "#cf222e",
    "stopped": "#9a6700",
    "running": "#0969da",
    "starting": "#57606a",
}


def summary_html(
    state: LaunchState, outputs: dict[int, list[str]] | None = None, charts: bool = False
) -> str:
    """The table as static HTML; optionally the metric charts (SVG) and each rank's output in a
    collapsed ``<details>``, so a saved notebook keeps what the live dashboard showed."""
    header, rows = _table(state)
    head = "".join(f"<th style='text-align:left;padding:2px 10px'>{h}</th>" for h in header)
    body = []
    for cells, rank in zip(rows, sorted(state.ranks.values(), key=lambda r: r.rank)):
        colour = STATUS_COLOURS.get(rank.status, "inherit")
        tds = "".join(
            f"<td style='padding:2px 10px;{'color:' + colour if i == 1 else ''}'>{html.escape(c)}</td>"
            for i, c in enumerate(cells)
        )
        body.append(
            f"<tr class='nbaccel-rank' data-rank='{rank.rank}' data-status='{rank.status}'>{tds}</tr>"
        )
    extra = ""
    if charts:
        from nbaccel.ui.chart import metrics_charts

        extra += metrics_charts({r.rank: r.history for r in state.ranks.values()})
    for rank, tail in sorted((outputs or {}).items()):
        if tail:
            extra += (
                f"<details class='nbaccel-output' data-rank='{rank}'><summary>rank {rank} output "
                f"({len(tail)} lines)</summary><pre style='max-height:20em;overflow:auto'>"
                f"{html.escape(chr(10).join(tail))}</pre></details>"
            )
    return (
        f"<div class='nbaccel-summary'><div style='font-weight:600'>{html.escape(headline(state))}</div>"
        f"<table style='border-collapse:collapse;font-family:monospace'><tr>{head}</tr>{''.join(body)}</table>"
        f"{extra}</div>"
    )
