"""The live launch dashboard (core ipywidgets), replaced by a static summary when the launch ends.

Layout: one HTML widget holds the header (launch config, total elapsed) and the per-rank table
(status, bar, n/total, rate, elapsed, ETA, latest metrics, a failed rank's error line); one HTML
widget holds the metric charts (inline SVG); each rank's output has its own collapsible pane.

Why so few widgets: every widget that changes costs one iopub message, and a launch may step
thousands of times a second on many ranks. The dashboard coalesces all changes and pushes at most
every ``MIN_INTERVAL`` seconds, within a budget of ``MESSAGE_RATE`` messages a second for the whole
dashboard (a token bucket), so the rate stays bounded whatever the step rate or rank count.
"""

from __future__ import annotations

import collections
import html
import time
from typing import Any

from nbaccel.core.launch_state import FAILED, LaunchState, RankState
from nbaccel.ui.chart import metrics_charts
from nbaccel.ui.summary import (
    STATUS_COLOURS,
    format_metrics,
    format_rate,
    format_seconds,
    summary_html,
    summary_text,
)

MIN_INTERVAL = 0.15  # seconds between pushes
MESSAGE_RATE = 14.0  # widget messages per second, whole dashboard (display messages aside)
BURST = 4  # messages that may go at once after a quiet spell
CHART_INTERVAL = 1.0  # seconds between chart redraws; SVG is the largest message
PANE_LINES = 300  # output lines kept per rank in its pane


class Dashboard:
    """The widget view of a launch (see :class:`nbaccel.ui.View`).

    Example::

        nbaccel.notebook_launcher(train, num_processes=2, view=Dashboard())
    """

    def __init__(self) -> None:
        self._state: LaunchState | None = None
        self._outputs: dict[int, collections.deque[tuple[str, str]]] = {}
        self._dirty_panes: list[int] = []
        self._tokens = float(BURST)
        self._refilled_at = 0.0
        self._last_push = 0.0
        self._last_chart = 0.0
        self._chart_key: tuple[int, ...] = ()
        self._shown_failed: set[int] = set()
        self._widgets: list[Any] = []
        self._handle: Any = None
        self.messages_sent = 0  # widget updates pushed, for tests and curiosity

    # -- the View protocol ------------------------------------------------------------------

    def start(self, state: LaunchState) -> None:
        import ipywidgets as w
        from IPython.display import display

        self._state = state
        ranks = sorted(state.ranks)
        self._outputs = {r: collections.deque(maxlen=PANE_LINES) for r in ranks}
        self._table = self._make(w.HTML, value=self._table_html())
        self._chart = self._make(w.HTML, value="")
        self._panes: dict[int, Any] = {}
        self._toggles: dict[int, Any] = {}
        pane_rows = []
        for r in ranks:
            pane = self._make(w.HTML, value=self._pane_html(r))
            empty = self._make(w.HTML, value="")
            stack = self._make(w.Stack, children=[empty, pane], selected_index=0)
            toggle = self._make(
                w.ToggleButtons,
                options=[("hide", 0), ("show", 1)],
                value=0,
                description=f"rank {r} output",
                style={"description_width": "initial", "button_width": "4em"},
            )
            # Linked in the browser, so the pane opens while the kernel is busy with the launch.
            self._widgets.append(w.jslink((toggle, "index"), (stack, "selected_index")))
            self._panes[r], self._toggles[r] = pane, toggle
            pane_rows.append(self._make(w.VBox, children=[toggle, stack]))
        self._root = self._make(
            w.VBox,
            children=[self._table, self._chart, *pane_rows],
            layout={"width": "100%"},
        )
        self._root.add_class("nbaccel-dashboard")
        self._handle = display(self._root, display_id=True)
        now = time.monotonic()
        self._refilled_at = self._last_push = now

    def output(self, rank: int, stream: str, lines: list[str]) -> None:
        buffer = self._outputs.setdefault(rank, collections.deque(maxlen=PANE_LINES))
        buffer.extend((stream, line) for line in lines)
        if rank not in self._dirty_panes:
            self._dirty_panes.append(rank)

    def update(self) -> None:
        now = time.monotonic()
        if self._state is None or now - self._last_push < MIN_INTERVAL:
            return
        self._push(now, final=False)

    def finish(self) -> None:
        if self._state is None:
            return
        self._push(time.monotonic(), final=True)
        outputs = {r: [line for _, line in buf] for r, buf in self._outputs.items()}
        bundle = {
            "text/plain": summary_text(self._state, outputs),
            "text/html": summary_html(self._state, outputs, charts=True),
        }
        if self._handle is not None:
            self._handle.update(bundle, raw=True)
        for widget in reversed(self._widgets):  # the views are gone; free the models too
            try:
                widget.close()
            except Exception:  # noqa: BLE001 - closing is tidying up, never worth a failure
                pass

    # -- pushing, within the budget ---------------------------------------------------------

    def _push(self, now: float, final: bool) -> None:
        self._last_push = now
        self._tokens = min(BURST, self._tokens + (now - self._refilled_at) * MESSAGE_RATE)
        self._refilled_at = now
        state = self._state
        assert state is not None
        for rank in state.ranks.values():
            if rank.status == FAILED and rank.rank not in self._shown_failed:
                self._shown_failed.add(rank.rank)
                self._set(self._toggles.get(rank.rank), "index", 1, final)  # show its output
        self._set(self._table, "value", self._table_html(), final)
        while self._dirty_panes and (final or self._tokens >= 1):
            rank = self._dirty_panes.pop(0)
            if rank in self._panes:
                self._set(self._panes[rank], "value", self._pane_html(rank), True)
        chart_key = tuple(len(r.history) for r in state.ranks.values())
        # Only render the SVG when it can go out now.
        chart_due = final or (now - self._last_chart >= CHART_INTERVAL and self._tokens >= 1)
        if (
            chart_key != self._chart_key
            and chart_due
            and self._set(self._chart, "value", self._chart_html(), final)
        ):
            self._chart_key, self._last_chart = chart_key, now

    def _set(self, widget: Any, name: str, value: Any, force: bool) -> bool:
        """Set one trait if it changed and the budget allows (or ``force``); report whether the
        widget now shows ``value``."""
        if widget is None or getattr(widget, name) == value:
            return True
        if not force and self._tokens < 1:
            return False
        setattr(widget, name, value)
        self._tokens -= 1
        self.messages_sent += 1
        return True

    def _make(self, cls: Any, **kwargs: Any) -> Any:
        widget = cls(**kwargs)
        self._widgets.append(widget)
        return widget

    # -- rendering --------------------------------------------------------------------------

    def _header_html(self) -> str:
        state = self._state
        assert state is not None
        info = state.info
        devices = info.device
        if info.device == "cuda":
            from nbaccel.core import hardware

            gpus = hardware.detect().gpus[: info.num_processes]
            names = sorted({g.name for g in gpus})
            devices = f"{len(gpus)}× {', '.join(names)}" if names else "cuda"
        outcome = state.outcome or (
            "running" if any(not r.done for r in state.ranks.values()) else ""
        )
        items = [
            (
                "processes",
                f"{info.num_processes}"
                + (f" of {info.world_size}" if info.world_size != info.num_processes else ""),
            ),
            ("devices", f"{devices} ({info.backend})"),
            ("precision", info.mixed_precision),
            ("strategy", info.strategy),
            ("grad. accumulation", str(info.gradient_accumulation_steps)),
            ("elapsed", format_seconds(state.elapsed)),
        ]
        cells = " · ".join(f"{k} <b>{html.escape(v)}</b>" for k, v in items)
        return (
            f"<div class='nbaccel-header' data-outcome='{html.escape(outcome)}' "
            f"style='margin-bottom:4px'><b>nbaccel</b> {html.escape(outcome)} — {cells}</div>"
        )

    def _table_html(self) -> str:
        state = self._state
        assert state is not None
        head = "".join(
            f"<th style='text-align:left;padding:1px 8px'>{h}</th>"
            for h in ("rank", "status", "progress", "", "rate", "elapsed", "ETA", "metrics")
        )
        rows = "".join(
            self._row_html(r) for r in sorted(state.ranks.values(), key=lambda r: r.rank)
        )
        return (
            f"<div class='nbaccel-live'>{self._header_html()}"
            "<table style='border-collapse:collapse;font-family:monospace;font-size:12px'>"
            f"<tr>{head}</tr>{rows}</table></div>"
        )

    @staticmethod
    def _row_html(rank: RankState) -> str:
        colour = STATUS_COLOURS.get(rank.status, "inherit")
        bar = rank.bar
        n, total = (bar.n, bar.total) if bar else (0, None)
        done = 1.0 if rank.status == "finished" else 0.0
        frac = min(1.0, n / total) if bar and total else done
        fill = STATUS_COLOURS["failed"] if rank.status == FAILED else "#2da44e"
        meter = (
            "<div style='width:160px;height:10px;background:#d0d7de;border-radius:3px'>"
            f"<div style='width:{frac * 100:.1f}%;height:100%;background:{fill};"
            "border-radius:3px'></div></div>"
        )
        count = f"{n}/{total}" if total is not None else (str(n) if bar else "-")
        desc = f"{bar.desc}: " if bar and bar.desc else ""
        eta = format_seconds(bar.eta) if bar and not bar.closed and not rank.done else "-"
        cells = [
            f"rank {rank.rank}",
            f"<span style='color:{colour};font-weight:600'>{rank.status}</span>",
            meter,
            html.escape(desc + count),
            html.escape(format_rate(rank).strip() or "-"),
            format_seconds(rank.elapsed),
            eta,
            html.escape(format_metrics(rank.metrics) or "-"),
        ]
        tds = "".join(f"<td style='padding:1px 8px;white-space:nowrap'>{c}</td>" for c in cells)
        failed = rank.status == FAILED
        style = "background:rgba(207,34,46,0.12)" if failed else ""
        row = (
            f"<tr class='nbaccel-rank' data-rank='{rank.rank}' data-status='{rank.status}' "
            f"data-n='{n}' data-total='{'' if total is None else total}' style='{style}'>{tds}</tr>"
        )
        if failed and rank.error_line:
            row += (
                f"<tr class='nbaccel-error' data-rank='{rank.rank}' style='{style}'>"
                f"<td></td><td colspan='7' style='color:{colour};padding:1px 8px'>"
                f"{html.escape(rank.error_line)}</td></tr>"
            )
        return row

    def _pane_html(self, rank: int) -> str:
        lines = self._outputs.get(rank) or ()
        body = "\n".join(
            f"<span style='color:#cf222e'>{html.escape(text)}</span>"
            if stream == "stderr"
            else html.escape(text)
            for stream, text in lines
        )
        return (
            f"<pre class='nbaccel-pane' data-rank='{rank}' style='max-height:20em;overflow:auto;"
            f"margin:0;font-size:12px'>{body or '(no output yet)'}</pre>"
        )

    def _chart_html(self) -> str:
        state = self._state
        assert state is not None
        return metrics_charts({r.rank: r.history for r in state.ranks.values()})
