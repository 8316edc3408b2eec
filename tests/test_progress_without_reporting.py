"""A loop that reports nothing still has progress, a rate and an ETA: the optimizer's steps, per
epoch of a prepared loader; and ``torch.compile`` compiling is told to the kernel (no stall).
Real ranks under the launcher."""

from __future__ import annotations

import pytest

import nbaccel
from nbaccel.launch.state import LaunchState
from nbaccel.rank.reporting import STEP_BAR_DESC

pytestmark = pytest.mark.slow  # real ranks


class WatchingView:
    """Keeps the state; notes the ranks seen compiling while the launch ran."""

    def __init__(self) -> None:
        self.state: LaunchState | None = None
        self.seen_compiling: set[int] = set()

    def start(self, state: LaunchState) -> None:
        self.state = state

    def output(self, rank: int, stream: str, lines: list[str]) -> None:
        pass

    def update(self) -> None:
        assert self.state is not None
        for r in self.state.ranks.values():
            if r.compiling_since is not None:
                self.seen_compiling.add(r.rank)

    def finish(self) -> None:
        pass


def ported_loop(report: bool):
    """An Accelerate loop as people port it: no progress calls of its own (or, with ``report``,
    its own ``nbaccel.progress`` around the batches)."""
    import torch

    acc = nbaccel.Accelerator()
    model = torch.nn.Linear(4, 1)
    data = torch.utils.data.TensorDataset(torch.randn(32, 4), torch.randn(32, 1))
    loader = torch.utils.data.DataLoader(data, batch_size=2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    model, optimizer, loader = acc.prepare(model, optimizer, loader)
    for _ in range(2):
        batches = nbaccel.progress(loader, desc="batch") if report else loader
        for x, y in batches:
            loss = torch.nn.functional.mse_loss(model(x), y)
            acc.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
    return 0


def test_a_loop_without_progress_calls_counts_its_optimizer_steps_per_epoch():
    view = WatchingView()
    nbaccel.notebook_launcher(ported_loop, args=(False,), num_processes=2, view=view)
    assert view.state is not None
    for rank in view.state.ranks.values():
        bars = list(rank.bars.values())
        assert [b.desc for b in bars] == [STEP_BAR_DESC] * 2, bars  # one per epoch
        assert [(b.n, b.total) for b in bars] == [(8, 8), (8, 8)]  # 32 samples, 2 a batch, 2 ranks
        assert rank.steps == 16 and rank.step_rate(rank.ended_at or 0.0)


def test_a_loop_with_its_own_bars_keeps_them():
    view = WatchingView()
    nbaccel.notebook_launcher(ported_loop, args=(True,), num_processes=2, view=view)
    assert view.state is not None
    for rank in view.state.ranks.values():
        assert {b.desc for b in rank.bars.values()} == {"batch"}, rank.bars
        assert rank.steps == 16


def compiles_slowly():
    import time

    import torch
    import torch._dynamo.callback

    # Make the compile last long enough for the kernel's loop to see it (after nbaccel's hook).
    torch._dynamo.callback.callback_handler.register_start_callback(lambda _: time.sleep(0.6))
    fn = torch.compile(lambda x: torch.sin(x) + 1, backend="eager")
    return float(fn(torch.zeros(3)).sum())


def test_torch_compile_is_reported_while_it_compiles():
    view = WatchingView()
    result = nbaccel.notebook_launcher(compiles_slowly, num_processes=1, view=view)
    assert result == 3.0
    assert view.seen_compiling == {0}
    assert view.state is not None and view.state.ranks[0].compiling_since is None  # ended


class MetricsWatchingView(WatchingView):
    """Notes how many metric samples the kernel had while the rank's "eval" step ran."""

    def __init__(self) -> None:
        super().__init__()
        self.samples_during_eval = 0

    def update(self) -> None:
        assert self.state is not None
        rank = self.state.ranks[0]
        if any(b.desc == "eval" and b.n == 0 for b in rank.bars.values()):  # during its sleep
            self.samples_during_eval = max(self.samples_during_eval, len(rank.history))


def short_epochs_then_a_long_evaluation():
    import time

    from nbaccel.rank import reporting

    for _ in nbaccel.progress(range(3), desc="warm-up"):  # starts the reporting tick
        pass
    tick = reporting._tick[0]
    while reporting._tick[0] == tick:  # a tick has just begun: the epochs below fit in it
        time.sleep(0.001)
    for epoch in range(2):  # two short epochs, each logging once
        for _ in nbaccel.progress(range(3), desc="batch"):
            pass
        nbaccel.log({"epoch": float(epoch)}, step=epoch)
    with nbaccel.progress(total=1, desc="eval") as bar:
        time.sleep(1.0)
        bar.update(1)
    return 0


def test_metrics_logged_once_an_epoch_arrive_with_the_progress_not_an_epoch_later():
    view = MetricsWatchingView()
    nbaccel.notebook_launcher(short_epochs_then_a_long_evaluation, num_processes=1, view=view)
    assert view.samples_during_eval == 2  # the chart had the second epoch while eval ran


def sixty_steps_logged_without_step():
    import time

    for i in range(60):
        nbaccel.log({"loss": 1.0 / (i + 1)})
        time.sleep(0.01)
    return 0


def test_a_loop_logging_without_step_is_charted_to_its_last_step():
    """Values are sent sampled; the kernel numbered the samples that arrived, so a 60-step loop
    that logged without ``step=`` was charted as if it ended at step 30 (or fewer)."""
    view = WatchingView()
    nbaccel.notebook_launcher(sixty_steps_logged_without_step, num_processes=1, view=view)
    history = view.state.ranks[0].history
    assert history[-1] == (59, {"loss": 1.0 / 60}), history
    assert [step for step, _ in history] == sorted({step for step, _ in history}), history
