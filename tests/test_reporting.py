"""nbaccel.progress/log and the tqdm hook: in real ranks under the launcher, and on their own."""

from __future__ import annotations

import io
import sys

import pytest

import nbaccel
from nbaccel.launch.state import LaunchState
from nbaccel.rank.reporting import ProgressBar, format_bar, log, progress


class RecordingView:
    """A view that keeps the state and every output line, for asserting on after the launch."""

    def __init__(self) -> None:
        self.state: LaunchState | None = None
        self.lines: dict[int, list[str]] = {}

    def start(self, state: LaunchState) -> None:
        self.state = state

    def output(self, rank: int, stream: str, lines: list[str]) -> None:
        self.lines.setdefault(rank, []).extend(lines)

    def update(self) -> None:
        pass

    def finish(self) -> None:
        pass


def launch(fn, *args, env=None):
    view = RecordingView()
    result = nbaccel.notebook_launcher(
        fn, args=args, num_processes=2, view=view, return_all=True, env=env
    )
    return result, view


# -- outside a launch ---------------------------------------------------------------------------


def test_plain_bar_outside_a_launch_iterates_and_draws():
    out = io.StringIO()
    bar = ProgressBar(range(7), desc="plain", file=out)
    assert list(bar) == list(range(7))
    assert bar.n == 7 and bar.closed
    text = out.getvalue()
    assert text.endswith("\n") and "7/7" in text.rsplit("\r", 1)[-1]
    log({"loss": 1.0})  # no launch: a no-op, not an error


def test_context_manager_and_format():
    with progress(total=4, desc="ctx") as bar:
        bar.update(3)
        bar.update()
    assert bar.n == 4 and bar.closed
    assert "4/4" in format_bar(4, 4, "ctx", 2.0, unit_scale=8)
    assert "16.0 samples/s" in format_bar(4, 4, "ctx", 2.0, unit_scale=8)
    assert nbaccel.progress(range(2)).total == 2  # the package attribute stays callable


# -- under the launcher ---------------------------------------------------------------------------


def _loop(steps):
    import time

    import nbaccel
    from nbaccel.core import events

    sent = []
    original = events.emit

    def counting(event, **options):
        sent.append(type(event).__name__)
        return original(event, **options)

    events.emit = counting
    start = time.monotonic()
    for i in nbaccel.progress(range(steps), desc="fit", unit_scale=16):
        if i % 1000 == 0:
            nbaccel.log({"loss": 1.0 / (i + 1)}, step=i)
        if i == 10_500:
            nbaccel.log({"val_acc": 0.5}, step=i)  # logged once: must not be lost
    return sent.count("Progress"), time.monotonic() - start


def test_progress_under_launch_reports_final_state_with_few_events():
    results, view = launch(_loop, 20_000)
    for rank, (progress_events, seconds) in enumerate(results):
        r = view.state.ranks[rank]
        assert r.status == "finished"
        bar = r.bar
        assert (bar.n, bar.total, bar.desc, bar.closed, bar.unit_scale) == (
            20_000,
            20_000,
            "fit",
            True,
            16,
        )
        # ~10 a second plus the first and the final one, however fast the loop.
        assert progress_events <= 10 * seconds + 3, (progress_events, seconds)
        # Metrics are sampled at the same rate: the first, the last, and every name at least once.
        steps = [s for s, values in r.history if "loss" in values]
        assert steps[0] == 0 and steps[-1] == 19_000 and steps == sorted(steps)
        assert set(steps) <= set(range(0, 20_000, 1000))
        assert len(r.history) <= 10 * seconds + 4
        assert r.metrics["val_acc"] == 0.5


def _tqdm_loop(install):

    if install:
        from nbaccel.rank.tqdm_hook import install_worker_hooks

        install_worker_hooks()  # the rank entry point will do this itself
    import tqdm
    import tqdm.auto
    import tqdm.notebook

    for _ in tqdm.tqdm(range(300), desc="plain"):
        pass
    for _ in tqdm.auto.tqdm(range(200), desc="auto"):
        pass
    with tqdm.notebook.tqdm(total=50, desc="nb") as bar:
        for _ in range(50):
            bar.update(1)
    return "IPython" in sys.modules or "ipywidgets" in sys.modules


@pytest.mark.skipif(
    __import__("importlib").util.find_spec("tqdm") is None, reason="tqdm is not installed"
)
def test_tqdm_bars_report_as_rank_progress_without_ipython():
    results, view = launch(_tqdm_loop, True)
    assert results == [False, False], "a rank imported IPython/ipywidgets through tqdm"
    for rank in view.state.ranks.values():
        bars = sorted((b.desc, b.n, b.total, b.closed) for b in rank.bars.values())
        assert bars == [("auto", 200, 200, True), ("nb", 50, 50, True), ("plain", 300, 300, True)]
        # tqdm's own drawing does not end up in the rank's output
        assert not any("it/s" in line for line in view.lines.get(rank.rank, []))


@pytest.mark.skipif(
    __import__("importlib").util.find_spec("tqdm") is None, reason="tqdm is not installed"
)
def test_tqdm_hook_opt_out():
    _, view = launch(_tqdm_loop, True, env={"NBACCEL_TQDM": "0"})
    assert all(not r.bars for r in view.state.ranks.values())
