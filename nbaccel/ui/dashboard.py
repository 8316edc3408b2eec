"""The live launch dashboard (core ipywidgets), replaced by a static summary when the launch ends.

Layout: one HTML widget holds the header (what the ranks run, elapsed), the run line (steps,
epochs, summed rates, overall ETA), a stall notice, the per-rank table (status, straggler mark,
bar, rate, ETA, memory, metrics, a failed rank's error line) and the metric charts (inline SVG),
so the table and the charts always come from the same moment. Each rank's output has its own
pane that follows the tail: its last lines, bounded in size, in blocks of widgets of which an
update sends only those that changed (``ui/panes.py``); every line is in the rank's log file.

Why so few widgets: every widget that changes costs one iopub message, and a launch may step
thousands of times a second on many ranks. The dashboard coalesces all changes and pushes at most
every ``MIN_INTERVAL`` seconds, within a budget of ``MESSAGE_RATE`` messages a second for the whole
dashboard (a token bucket), so the rate stays bounded whatever the step rate or rank count.

Why widgets are kept between launches: each widget is one comm (three with its layout and style
models), and opening and closing the ~59 of a two-rank dashboard cost ~25 ms of every relaunch.
A finished launch's widgets (their place in the cell taken by the static summary) wait as spares
(``SPARES`` sets at most), and the next launch with the same ranks shows them again, reset.

Works with ipywidgets 8 and 7.7 (Colab's): the show/hide switch of the panes needs ipywidgets 8's
``Stack``; with 7.x the panes are always shown.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable
from typing import Any

from nbaccel.launch.state import FAILED, LaunchState
from nbaccel.ui import panes
from nbaccel.ui.chart import metrics_charts
from nbaccel.ui.panes import PaneBuffer
from nbaccel.ui.resources import MemorySampler
from nbaccel.ui.summary import summary_html, summary_text
from nbaccel.ui.table import table_html

MIN_INTERVAL = 0.15  # seconds between pushes
MESSAGE_RATE = 14.0  # widget messages per second, whole dashboard (display messages aside)
BURST = 4  # messages that may go at once after a quiet spell
CHART_INTERVAL = 1.0  # seconds between chart redraws; SVG is the largest part of a message
SPARES = 2  # sets of a finished launch's widgets kept for the next launches (module docstring)


@dataclasses.dataclass
class _Widgets:
    """One dashboard's widgets: shown by one launch at a time, then kept for the next."""

    ranks: tuple[int, ...]  # the ranks with a pane
    root: Any
    table: Any
    panes: dict[int, panes.PaneView]
    toggles: dict[int, Any]  # rank -> its pane's show/hide switch (ipywidgets 8)
    made: list[Any]  # every widget made for it, to close when it is not kept


_spare: list[_Widgets] = []
_spare_lock = threading.Lock()  # background launches start and finish in their own threads


def _take_spare(ranks: tuple[int, ...]) -> _Widgets | None:
    with _spare_lock:
        for i, spare in enumerate(_spare):
            if spare.ranks == ranks:
                return _spare.pop(i)
    return None


def _keep_spare(widgets: _Widgets) -> bool:
    """Keep ``widgets`` for a later launch, unless ``SPARES`` sets are kept already."""
    with _spare_lock:
        if len(_spare) < SPARES:
            _spare.append(widgets)
            return True
    return False


class Dashboard:
    """The widget view of a launch (see :class:`nbaccel.launch.protocols.View`).

    Example::

        nbaccel.notebook_launcher(train, num_processes=2, view=Dashboard())
    """

    def __init__(
        self, panes: bool = True, title: Callable[[LaunchState, float], str] | None = None
    ) -> None:
        """``panes=False``: no output panes (the caller prints the ranks' lines); ``title``:
        the summary's first line (of the state and the time) instead of the launch's headline, and then
        no launch header either."""
        self._with_panes, self._title = panes, title
        self._state: LaunchState | None = None
        self._outputs: dict[int, PaneBuffer] = {}
        self._dirty_panes: list[int] = []
        self._tokens = float(BURST)
        self._refilled_at = 0.0
        self._last_push = 0.0
        self._last_chart = 0.0
        self._chart_key: tuple[int, ...] = ()
        self._chart_svg = ""
        self._chart_metrics: dict[int, dict[str, float]] = {}  # the sample the charts show
        self._shown_failed: set[int] = set()
        self._widgets: list[Any] = []
        self._toggles: dict[int, Any] = {}
        self._set_of: _Widgets | None = None
        self._handle: Any = None
        self._memory = MemorySampler()
        self.messages_sent = 0  # widget updates pushed, for tests and curiosity

    # -- the View protocol ------------------------------------------------------------------

    def start(self, state: LaunchState) -> None:
        from IPython.display import display

        self._state = state
        now = time.monotonic()
        ranks = tuple(sorted(state.ranks)) if self._with_panes else ()
        self._outputs = {r: panes.PaneBuffer() for r in ranks}
        widgets = _take_spare(ranks)
        if widgets is None:
            widgets = self._build(ranks, self._table_html(now))
        else:  # a finished launch's, shown again: reset to this launch's first frame
            widgets.table.value = self._table_html(now)
            for toggle in widgets.toggles.values():
                toggle.value = 0  # shown, whatever was clicked last time
        self._set_of, self._widgets = widgets, widgets.made
        self._table, self._panes, self._toggles = widgets.table, widgets.panes, widgets.toggles
        for r, pane in self._panes.items():
            pane.clear()
            for widget, name, value in pane.changes(self._outputs[r]):
                if getattr(widget, name) != value:
                    setattr(widget, name, value)  # before it is displayed
        self._handle = display(widgets.root, display_id=True)
        self._refilled_at = self._last_push = time.monotonic()

    def _build(self, ranks: tuple[int, ...], table: str) -> _Widgets:
        """The dashboard's widgets, made once and kept across launches (module docstring)."""
        import ipywidgets as w

        self._widgets, self._toggles = [], {}
        self._table = self._make(w.HTML, value=table)
        made_panes: dict[int, panes.PaneView] = {}
        boxes = []
        for r in ranks:
            pane = made_panes[r] = panes.PaneView(r, self._make)
            boxes.append(self._pane_box(w, r, pane.widget))
        pane_grid = self._make(w.HBox, children=boxes, layout={"flex_flow": "row wrap"})
        children = [self._table, pane_grid] if boxes else [self._table]
        root = self._make(w.VBox, children=children, layout={"width": "100%"})
        root.add_class("nbaccel-dashboard")
        return _Widgets(ranks, root, self._table, made_panes, self._toggles, self._widgets)

    def output(self, rank: int, stream: str, lines: list[str]) -> None:
        if self._state is not None and rank in self._state.ranks:
            self._state.ranks[rank].note_activity()
        self._outputs.setdefault(rank, panes.PaneBuffer()).extend(stream, lines)
        self._mark(rank)

    def partial(self, rank: int, stream: str, text: str) -> None:
        buffer = self._outputs.setdefault(rank, panes.PaneBuffer())
        if buffer.set_partial(stream, text):
            self._mark(rank)

    def update(self) -> None:
        now = time.monotonic()
        if self._state is None:
            return
        self._memory.sample(self._state)  # between pushes too: a short rank's only chance
        if now - self._last_push >= MIN_INTERVAL:
            self._push(now, final=False)

    def finish(self) -> None:
        if self._state is None:
            return
        self._memory.sample(self._state, force=True)
        now = time.monotonic()
        self._push(now, final=True)
        outputs = {r: buf.lines() for r, buf in self._outputs.items()}
        dropped = {r: buf.dropped for r, buf in self._outputs.items()}
        title = self._title(self._state, now) if self._title is not None else None
        bundle = {
            "text/plain": summary_text(self._state, now, outputs, title, dropped=dropped),
            "text/html": summary_html(
                self._state, now, outputs, charts=True, title=title, dropped=dropped
            ),
        }
        if self._handle is not None:
            self._handle.update(bundle, raw=True)
        # The views are gone (the summary took their place): keep the models for the next
        # launch, or free them.
        if self._set_of is None or not _keep_spare(self._set_of):
            close_widgets(self._widgets)
        self._widgets, self._set_of = [], None

    # -- pushing, within the budget ---------------------------------------------------------

    def _mark(self, rank: int) -> None:
        if rank not in self._dirty_panes:
            self._dirty_panes.append(rank)

    def _push(self, now: float, final: bool) -> None:
        self._last_push = now
        self._tokens = min(BURST, self._tokens + (now - self._refilled_at) * MESSAGE_RATE)
        self._refilled_at = now
        state = self._state
        assert state is not None
        for rank_state in state.ranks.values():
            if rank_state.status == FAILED and rank_state.rank not in self._shown_failed:
                self._shown_failed.add(rank_state.rank)
                self._set(self._toggles.get(rank_state.rank), "index", 0, final)  # its output
        self._set(self._table, "value", self._table_html(now, final), final)
        while self._dirty_panes and (final or self._tokens >= 1):
            rank = self._dirty_panes.pop(0)
            if rank in self._panes:
                changes = self._panes[rank].changes(self._outputs[rank], state.log_path(rank, "*"))
                for widget, name, value in changes:
                    self._set(widget, name, value, True)

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

    def _pane_box(self, w: Any, rank: int, pane: Any) -> Any:
        """A rank's pane under its label; with ipywidgets 8, a show/hide switch (in the browser,
        so it works while the kernel is busy with the launch)."""
        label = self._make(w.HTML, value=f"<b>rank {rank} output</b>")
        layout = {"width": "calc(50% - 8px)", "min_width": "420px", "margin": "0 8px 4px 0"}
        if not hasattr(w, "Stack"):  # ipywidgets 7.x (Colab): always shown
            return self._make(w.VBox, children=[label, pane], layout=layout)
        empty = self._make(w.HTML, value="")
        stack = self._make(w.Stack, children=[pane, empty], selected_index=0)
        toggle = self._make(
            w.ToggleButtons,
            options=[("show", 0), ("hide", 1)],
            value=0,
            style={"button_width": "5em"},
        )
        self._widgets.append(w.jslink((toggle, "index"), (stack, "selected_index")))
        self._toggles[rank] = toggle
        head = self._make(w.HBox, children=[label, toggle], layout={"align_items": "center"})
        return self._make(w.VBox, children=[head, stack], layout=layout)

    # -- rendering --------------------------------------------------------------------------

    def _table_html(self, now: float, final: bool = False) -> str:
        """Header, run line, stall notice, rank table and charts: one message, one moment."""
        state = self._state
        assert state is not None
        key = tuple(len(r.history) for r in state.ranks.values())
        if key != self._chart_key and (final or now - self._last_chart >= CHART_INTERVAL):
            self._chart_key, self._last_chart = key, now
            self._chart_svg = metrics_charts({r.rank: r.history for r in state.ranks.values()})
            self._chart_metrics = {r.rank: dict(r.metrics) for r in state.ranks.values()}
        return table_html(state, now, self._chart_svg, self._chart_metrics, self._title is None)


def close_widgets(widgets: list[Any]) -> None:
    """Close ``widgets`` and every model they hold: children, and the ``layout`` and ``style``
    models that ipywidgets (7 and 8) creates for each widget, which ``close()`` leaves open,
    so a launch would leave ~26 open comms behind in the kernel.

    Example::

        close_widgets([box])   # box, its children, and their layouts and styles
    """
    seen: set[int] = set()
    pending = list(reversed(widgets))
    while pending:
        widget = pending.pop()
        if widget is None or id(widget) in seen or not hasattr(widget, "close"):
            continue
        seen.add(id(widget))
        for name in ("children", "layout", "style"):
            try:
                held = getattr(widget, name, None)
            except Exception:  # noqa: BLE001 - a trait that cannot be read holds nothing to close
                continue
            if isinstance(held, (list, tuple)):
                pending.extend(held)
            elif held is not None:
                pending.append(held)
        try:
            widget.close()
        except Exception:  # noqa: BLE001 - closing is tidying up, never worth a failure
            pass
