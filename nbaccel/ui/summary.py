"""The facts every view shows, as text: the run line, each rank's row, the final summary.

The text view, the live dashboard and the final static summary (plain text and HTML) all format
the launch state through these functions, so they always say the same thing. The summary stays
after the live widgets are gone, so a saved notebook, nbconvert or GitHub still shows what
happened.
"""

from __future__ import annotations

import html

from nbaccel.launch.state import LaunchState, RankState
from nbaccel.ui.formats import format_bytes, format_seconds, format_si

TEXT_TAIL = 20  # output lines per rank in the plain-text summary
SHOWN_LINES = 10  # a rank's last output lines shown in the HTML summary; earlier ones fold
STRAGGLER_MARK = "straggler"

STATUS_COLOURS = {
    "finished": "#1a7f37",
    "failed": "#cf222e",
    "stopped": "#9a6700",
    "running": "#0969da",
    "starting": "#57606a",
}


def format_metrics(metrics: dict[str, float], limit: int = 4) -> str:
    items = list(metrics.items())[:limit]
    return " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in items)


def format_count(rank: RankState) -> str:
    """The rank's current bar: ``epoch 3: 12/23`` (``-`` before any bar)."""
    bar = rank.bar
    if bar is None:
        return "-"
    total = f"/{bar.total}" if bar.total is not None else ""
    desc = f"{bar.desc}: " if bar.desc else ""
    return f"{desc}{bar.n}{total}"


def format_rate(rank: RankState, now: float) -> str:
    """``12.3 it/s`` (and samples/s where the bars know their batch size), or ``-``."""
    rate = rank.step_rate(now)
    if rate is None:
        return "-"
    samples = rank.sample_rate(now)
    return f"{rate:.3g} it/s" + (f", {format_si(samples)} samples/s" if samples else "")


def format_memory(rank: RankState) -> str:
    """``RSS 410 MiB`` and ``GPU 3.1 GiB`` where known."""
    parts = []
    if rank.rss is not None:
        parts.append(f"RSS {format_bytes(rank.rss)}")
    if rank.gpu_memory is not None:
        parts.append(f"GPU {format_bytes(rank.gpu_memory)}")
    return ", ".join(parts) or "-"


def compiling_note(rank: RankState, now: float) -> str:
    """`` (compiling 12.0 s)`` while ``torch.compile`` compiles in the rank, else ""."""
    if rank.compiling_since is None or rank.done:
        return ""
    return f" (compiling {format_seconds(max(0.0, now - rank.compiling_since))})"


def format_progress(rank: RankState, now: float) -> str:
    """Bar and rate in one: ``train: 120/500 41.2 it/s``."""
    rate = format_rate(rank, now)
    return format_count(rank) + ("" if rate == "-" else f" {rate}")


def run_line(state: LaunchState, now: float) -> str:
    """The whole run in one line: steps done/total, epoch, summed rates, overall ETA.

    ``run: step 300/1,000 · epoch 3/10 · 82.5 it/s · 660 samples/s (all ranks) · ETA 8.5 s``
    """
    facts = state.run_line(now)
    total = facts["total"]
    parts = [f"step {facts['steps']:,}" + (f"/{total:,}" if total is not None else "")]
    if facts["epoch"] is not None:
        n, epochs = facts["epoch"]
        parts.append(f"epoch {n}" + (f"/{epochs}" if epochs else ""))
    rates = []
    if facts["steps_per_s"]:
        rates.append(f"{facts['steps_per_s']:.3g} it/s")
    if facts["samples_per_s"]:
        rates.append(f"{format_si(facts['samples_per_s'])} samples/s")
    if rates:
        parts.append(", ".join(rates) + " (all ranks)")
    if facts["eta"] is not None and state.outcome is None:
        label = "ETA" if facts["eta_is_run"] else "ETA (this epoch; run length unknown)"
        parts.append(f"{label} {format_seconds(facts['eta'])}")
    return "run: " + " · ".join(parts)


def waiting_text(state: LaunchState, now: float) -> str:
    """What the launch waits for before its ranks run, with how long it has waited so far
    ("" once it waits for nothing).

    >>> from nbaccel.launch.state import LaunchState
    >>> state = LaunchState(None, {}, waiting_for="fork server: importing torch._dynamo")
    >>> state.waiting_since = 100.0
    >>> waiting_text(state, now=101.4)
    'fork server: importing torch._dynamo (1.4 s)'
    """
    if state.waiting_for is None:
        return ""
    return f"{state.waiting_for} ({format_seconds(state.waited(now))})"


def stall_text(state: LaunchState, now: float) -> str:
    """``no rank has advanced for 42 s`` plus where each rank waits, or "" while all is well;
    a rank paused in the debugger is said instead (the launch does not stall meanwhile)."""
    paused = [
        f"rank {r.rank} paused in {r.paused}"
        for r in sorted(state.ranks.values(), key=lambda r: r.rank)
        if r.paused
    ]
    if paused:
        return "\n".join(paused)
    quiet = state.stalled_for(now)
    if quiet is None:
        return ""
    lines = [f"stalled? no rank has advanced for {format_seconds(quiet)}"]
    for rank in sorted(state.ranks.values(), key=lambda r: r.rank):
        if rank.done:
            continue
        where = waiting_in(rank.diag)
        lines.append(f"  rank {rank.rank}: {where or 'no stack yet'}")
    return "\n".join(lines)


def stall_summary(state: LaunchState) -> str:
    """For the final summary: the longest stall and where the ranks last waited."""
    text = f"stalled for up to {format_seconds(state.longest_stall)} during the run"
    where = [f"rank {r.rank} {w}" for r in state.ranks.values() if (w := waiting_in(r.diag))]
    return text + (f" ({'; '.join(where)})" if where else "")


COLLECTIVES = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "reduce_scatter",
    "broadcast",
    "barrier",
    "all_to_all",
    "reduce",
    "gather",
    "scatter",
    "send",
    "recv",
    "wait",
)


def waiting_in(diag: str) -> str:
    """From a rank's latest faulthandler stack dump: the collective it waits in (or the
    innermost frame of its main thread), e.g. ``all_reduce (train.py:12)``."""
    dump = diag.rsplit("Current thread", 1)
    if len(dump) < 2:
        dump = diag.rsplit("Thread 0x", 1)
    if len(dump) < 2:
        return ""
    frames = [line.strip() for line in dump[1].splitlines() if line.strip().startswith("File ")]
    # faulthandler lists the innermost frame first: ``File "x.py", line 12 in all_reduce``.
    for frame in frames:
        name = frame.rsplit(" in ", 1)[-1]
        if name in COLLECTIVES:
            return f"waiting in {name} ({_short(frame)})"
    return f"in {_short(frames[0])}" if frames else ""


def _short(frame: str) -> str:
    try:
        path = frame.split('"')[1]
        line = frame.split("line ")[1].split()[0]
        name = frame.rsplit(" in ", 1)[-1]
    except IndexError:
        return frame
    from nbaccel.core.local_traceback import cell_label

    where = cell_label(path)  # "Cell In[3]" for code from a notebook cell
    return f"{name}, {where}, line {line}" if where else f"{name}, {path.rsplit('/', 1)[-1]}:{line}"


def effective_settings(state: LaunchState) -> str:
    """What the ranks' Accelerators run, where it differs between ranks or from the launch."""
    seen = {tuple(sorted(r.effective.items())) for r in state.ranks.values() if r.effective}
    if not seen:
        return ""
    texts: list[str] = []
    for settings in sorted(seen):
        d = dict(settings)
        text = (
            f"mixed_precision={d.get('mixed_precision')}, strategy={d.get('strategy')}, "
            f"device={d.get('device')}"
        )
        texts += [text] if text not in texts else []  # ranks differ in their mesh place only
    return "ranks run: " + " | ".join(texts)


def describe(state: LaunchState) -> str:
    """The launch's settings, with the precision/strategy the ranks report where they did."""
    text = state.info.describe()
    effective = [r.effective for r in state.ranks.values() if r.effective]
    if effective:
        first = effective[0]
        for key in ("mixed_precision", "strategy"):
            launch_value = getattr(state.info, key)
            if first.get(key) and first[key] != launch_value:
                text = text.replace(f"{key}={launch_value}", f"{key}={first[key]} (set in code)")
    return text


def banner(state: LaunchState) -> str:
    """The opening line's settings: the launch's, said to be defaults the function may change
    (an ``Accelerator(mixed_precision=..., fsdp_plugin=...)`` sets its own).

    Example: ``2 processes on cpu (gloo), mixed_precision=no, strategy=ddp (unless set in
    code), forkserver, 127.0.0.1:29500``
    """
    info = state.info
    text = info.describe().replace(
        f"strategy={info.strategy},", f"strategy={info.strategy} (unless set in code),", 1
    )
    return f"{text}, {state.attempt_text()}" if state.attempts > 1 else text


def settings_changed(state: LaunchState) -> str:
    """What the ranks run that differs from the launch's settings ("" if nothing or not known
    yet), e.g. ``"strategy=fsdp, mixed_precision=bf16"``."""
    effective = [r.effective for r in state.ranks.values() if r.effective]
    if not effective:
        return ""
    first = effective[0]
    changed = [
        f"{key}={first[key]}"
        for key in ("strategy", "mixed_precision")
        if first.get(key) and first[key] != str(getattr(state.info, key))
    ]
    if first.get("parallelism") and first["parallelism"] != state.info.parallelism:
        changed.append(first["parallelism"])  # "dp_shard 2 × tp 2", set in the function
    return ", ".join(changed)


def role(rank: RankState) -> str:
    """A rank's place in the N-D mesh ("dp_shard 1, tp 0"), "" without one."""
    return rank.effective.get("coordinates", "") if rank.effective else ""


def _rows(state: LaunchState, now: float) -> tuple[list[str], list[list[str]]]:
    """Header and rows; the progress, memory and metrics columns only where some rank has them."""
    ranks = sorted(state.ranks.values(), key=lambda r: r.rank)
    slow = state.stragglers(now)
    with_progress = any(r.bars for r in ranks)
    with_memory = any(r.rss is not None or r.gpu_memory is not None for r in ranks)
    with_metrics = any(r.metrics for r in ranks)
    with_role = any(role(r) for r in ranks)
    header = ["rank"] + ["role"] * with_role + ["status"] + ["progress", "rate"] * with_progress
    header += ["memory"] * with_memory + ["elapsed"] + ["metrics"] * with_metrics
    rows = []
    for rank in ranks:
        status = rank.status_text + compiling_note(rank, now)
        status += f" ({STRAGGLER_MARK})" if rank.rank in slow else ""
        status += f": {rank.error_line}" if rank.error_line else ""
        row = [str(rank.rank)] + [role(rank) or "-"] * with_role + [status]
        row += [format_count(rank), format_rate(rank, now)] * with_progress
        row += [format_memory(rank)] * with_memory + [format_seconds(rank.elapsed(now))]
        row += [format_metrics(rank.metrics) or "-"] * with_metrics
        rows.append(row)
    return header, rows


def logs_line(state: LaunchState) -> str:
    """Where every rank's full output is, for the summary ("" when nothing was printed)."""
    if state.log_folder is None:
        return f"rank output not kept: {state.log_problem}" if state.log_problem else ""
    problem = f" (incomplete: {state.log_problem})" if state.log_problem else ""
    return f"full output of every rank: {state.log_folder}/rank*.log{problem}"


def headline(state: LaunchState, now: float) -> str:
    outcome = state.outcome or "running"
    took = format_seconds(state.elapsed(now))
    return f"nbaccel: {describe(state)} — {outcome}; launch took {took} (start to last exit)"


def summary_text(
    state: LaunchState,
    now: float,
    outputs: dict[int, list[str]] | None = None,
    title: str | None = None,
    dropped: dict[int, int] | None = None,
) -> str:
    """The table as aligned text; with ``outputs`` (rank -> lines), each rank's last lines too.
    ``title`` replaces the launch's headline; ``dropped`` (rank -> count): lines printed before
    ``outputs`` that were not kept."""
    header, body = _rows(state, now)
    rows = [header, *body]
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    lines = [headline(state, now) if title is None else title]
    if any(r.bars for r in state.ranks.values()):
        lines.append("  " + run_line(state, now))
    lines += ["  " + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    if state.longest_stall:
        lines.append(f"  {stall_summary(state)}")
    if logs_line(state) and title is None:  # a cell's lines are in the cell
        lines.append(f"  {logs_line(state)}")
    for rank, tail in sorted((outputs or {}).items()):
        if tail:
            lost = (dropped or {}).get(rank, 0)
            if len(tail) + lost > TEXT_TAIL:
                printed = plural(len(tail) + lost, "line")
                lines.append(
                    f"-- rank {rank}: the last {TEXT_TAIL} of {printed}{_all_in(state, rank, lost)} --"
                )
            lines += [f"{state.info.label(rank)}{line}" for line in tail[-TEXT_TAIL:]]
    return "\n".join(lines)


CELL = "padding:2px 10px;text-align:left;white-space:nowrap;vertical-align:top"
# Columns that wrap between their words (a status and its straggler mark, a step rate and its
# sample rate, one metric per line) so the table fits a narrow window instead of being cut off.
WRAP_CELL = CELL.replace("white-space:nowrap", "white-space:normal")
WRAPPING = ("status", "rate", "metrics")


def plural(n: int, word: str) -> str:
    """``1 line``, ``2 lines``, ``1,000 lines``.

    >>> plural(1, "line"), plural(1000, "line")
    ('1 line', '1,000 lines')
    """
    return f"{n:,} {word}" + ("" if n == 1 else "s")


PRE = "margin:0;padding:0 4px;white-space:pre-wrap;overflow-wrap:anywhere"


def _all_in(state: LaunchState, rank: int, dropped: int) -> str:
    """Where the lines the summary lost are ("" when it lost none)."""
    if not dropped:
        return ""
    log = state.log_path(rank, "*")
    where = f"; every line is in {log}" if log else ""
    return f" (the first {dropped:,} are not kept here{where})"


def output_html(rank: int, lines: list[str], label: str, not_kept: str = "") -> str:
    """A finished rank's output as the cell keeps it: its last ``SHOWN_LINES`` lines in view,
    labelled as the text view labels them (``[rank0] …``), the earlier ones folded above them
    (a ``<details>`` that opens in place, so a saved notebook keeps every line it kept).
    ``not_kept``: a note of what was printed before ``lines`` and not kept (``_all_in``)."""
    labelled = [html.escape(f"{label}{line}") for line in lines]
    earlier, shown = labelled[:-SHOWN_LINES], labelled[-SHOWN_LINES:]
    fold = ""
    if earlier:
        fold = (
            f"<details><summary style='cursor:pointer;color:#57606a'>rank {rank}: show the "
            f"{plural(len(earlier), 'earlier line')}{html.escape(not_kept)}</summary>"
            f"<pre style='{PRE};max-height:30em;overflow:auto'>{chr(10).join(earlier)}</pre>"
            "</details>"
        )
    return (
        f"<div class='nbaccel-output' data-rank='{rank}' data-lines='{len(lines)}'>{fold}"
        f"<pre style='{PRE}'>{chr(10).join(shown)}</pre></div>"
    )


def summary_html(
    state: LaunchState,
    now: float,
    outputs: dict[int, list[str]] | None = None,
    charts: bool = False,
    title: str | None = None,
    dropped: dict[int, int] | None = None,
) -> str:
    """The table as static HTML; optionally the metric charts (SVG) and each rank's output
    (:func:`output_html`; ``dropped`` as for :func:`summary_text`), so a saved notebook keeps
    what the live dashboard showed. ``title`` replaces the launch's headline (a ``%%ranks``
    cell's status), and then the log folder goes unsaid: the cell shows its lines itself."""
    header, rows = _rows(state, now)
    head = "".join(f"<th style='{CELL}'>{h}</th>" for h in header)
    body = []
    for cells, rank in zip(rows, sorted(state.ranks.values(), key=lambda r: r.rank)):
        colour = STATUS_COLOURS.get(rank.shown_status, "inherit")
        tds = "".join(
            f"<td style='{WRAP_CELL if h in WRAPPING else CELL};"
            f"{'color:' + colour if i == 1 else ''}'>{html.escape(c)}</td>"
            for i, (h, c) in enumerate(zip(header, cells))
        )
        body.append(
            f"<tr class='nbaccel-rank' data-rank='{rank.rank}' data-status='{rank.shown_status}'>{tds}</tr>"
        )
    extra = ""
    if any(r.bars for r in state.ranks.values()):
        extra = f"<div class='nbaccel-run'>{html.escape(run_line(state, now))}</div>"
    if state.longest_stall:
        extra += f"<div class='nbaccel-stall'>{html.escape(stall_summary(state))}</div>"
    if logs_line(state) and title is None:
        extra += f"<div class='nbaccel-logs'><code>{html.escape(logs_line(state))}</code></div>"
    table = (
        "<table style='border-collapse:collapse;font-family:monospace;margin:0'>"
        f"<tr>{head}</tr>{''.join(body)}</table>"
    )
    after = ""
    if charts:
        from nbaccel.ui.chart import metrics_charts

        after += metrics_charts({r.rank: r.history for r in state.ranks.values()}, images=True)
    after += "".join(
        output_html(
            rank, tail, state.info.label(rank), _all_in(state, rank, (dropped or {}).get(rank, 0))
        )
        for rank, tail in sorted((outputs or {}).items())
        if tail
    )
    return (
        f"<div class='nbaccel-summary'><div style='font-weight:600'>"
        f"{html.escape(headline(state, now) if title is None else title)}</div>{extra}{table}{after}</div>"
    )
