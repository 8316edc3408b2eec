"""A CV-style notebook loop prints Accelerate's numbers under nbaccel: the same seed gives the
same losses and the same accuracy, from a plain ``gather`` (which sees the padding of the last
step) and from ``gather_for_metrics`` (which drops it), to the last digit.

Dataset sizes that do not divide into steps (38 and 50 samples, batches of 64 and 32) on 2 and
3 real gloo ranks, shuffled: each rank's last batch is filled from the start of the data, as
Accelerate's ``even_batches=True`` does, and the training sees the same repeated samples. One
launch per library and number of ranks runs every size; a last pass dispatches batches
(``dispatch_batches=True``, which Accelerate can only run with a process group).
The sampler-level comparison over a larger grid is ``test_accelerate_sharding.py``.
"""

from __future__ import annotations

import pytest

from tests.side_by_side import run_as

pytest.importorskip("accelerate")
pytestmark = pytest.mark.slow  # real launches, both libraries

CASES = [(38, 64), (50, 32), (38, 32), (50, 64)]


def cv_loop(lib: str, cases: list[tuple[int, int]], dispatch: bool = False) -> dict:
    """simple_cv_example's shape: a small conv net, a shuffled train loader, an eval loader,
    accuracy from ``gather`` and from ``gather_for_metrics``, two epochs per case."""
    import importlib

    import torch
    from torch.utils.data import DataLoader, TensorDataset

    module = importlib.import_module(lib)
    utils = importlib.import_module(f"{lib}.utils")
    out = {}
    for n, batch_size in cases:
        utils.set_seed(42)
        config = utils.DataLoaderConfiguration(dispatch_batches=dispatch or None)
        acc = module.Accelerator(cpu=True, dataloader_config=config)
        data = torch.Generator().manual_seed(n)
        images = torch.randn(2 * n, 3, 8, 8, generator=data)
        labels = torch.randint(0, 4, (2 * n,), generator=data)
        train = DataLoader(
            TensorDataset(images[:n], labels[:n]), batch_size=batch_size, shuffle=True
        )
        evaluation = DataLoader(TensorDataset(images[n:], labels[n:]), batch_size=batch_size)
        model = torch.nn.Sequential(
            torch.nn.Conv2d(3, 4, 3), torch.nn.ReLU(), torch.nn.Dropout(0.2),
            torch.nn.Flatten(), torch.nn.Linear(4 * 6 * 6, 4),
        )  # fmt: skip
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        model, optimizer, train, evaluation = acc.prepare(model, optimizer, train, evaluation)
        losses, accuracy, metric = [], [], []
        for _ in range(2):
            model.train()
            for x, y in train:
                loss = torch.nn.functional.cross_entropy(model(x), y)
                acc.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
                losses.append(loss.item())
            model.eval()
            right = total = right_m = total_m = 0
            for x, y in evaluation:
                with torch.no_grad():
                    predictions = model(x).argmax(dim=-1)
                seen, truth = acc.gather((predictions, y))  # as the notebook: padding included
                right, total = right + (seen == truth).sum().item(), total + truth.numel()
                seen, truth = acc.gather_for_metrics((predictions, y))
                right_m, total_m = right_m + (seen == truth).sum().item(), total_m + truth.numel()
            accuracy.append(100 * right / total)
            metric.append((100 * right_m / total_m, total_m))
        out[f"{n}x{batch_size}"] = {"losses": losses, "accuracy": accuracy, "metric": metric}
    return out


def _run(lib: str, processes: int, **kwargs) -> list[dict]:
    return run_as(lib, cv_loop, processes, **kwargs)


@pytest.mark.parametrize("processes", [2, 3])
def test_a_cv_loop_prints_accelerates_numbers(processes):
    ours = _run("nbaccel", processes, cases=CASES)
    theirs = _run("accelerate", processes, cases=CASES)
    assert ours == theirs  # every rank's losses and accuracies, exact floats
    for n, batch_size in CASES:
        case = ours[0][f"{n}x{batch_size}"]
        # gather_for_metrics saw each evaluation sample once, in every epoch.
        assert [total for _, total in case["metric"]] == [n, n]
    # 38 samples in batches of 64: one full batch per rank per epoch, filled from the start.
    assert len(ours[0]["38x64"]["losses"]) == 2


def test_dispatched_batches_give_accelerates_numbers():
    cases = CASES[:2]
    ours = _run("nbaccel", 2, cases=cases, dispatch=True)
    theirs = _run("accelerate", 2, cases=cases, dispatch=True)
    assert ours == theirs
