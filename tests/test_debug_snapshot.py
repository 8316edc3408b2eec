"""A failed rank's frames copied (``core.snapshot``) and made into real frames again in the kernel
(``launch.post_mortem.rebuild``): what ``%debug`` walks."""

from __future__ import annotations

import threading
import traceback

import torch

from nbaccel.core import snapshot
from nbaccel.launch import post_mortem


def inner(batch, factor):
    weights = torch.ones(3, requires_grad=True) * factor
    return batch["labels"] * weights


def outer():
    seen = [1, "batch"]
    lock = threading.Lock()
    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(4)])  # 16 MiB
    return inner({"inputs": seen}, 2), lock, model


def failure() -> BaseException:
    try:
        outer()
    except KeyError as exc:
        return exc
    raise AssertionError("outer() did not raise")


def test_the_frames_come_back_as_real_frames_with_their_locals_lines_and_names():
    exc = failure()
    records = snapshot.load(snapshot.take(exc))
    tb = post_mortem.rebuild(records, KeyError("labels"))
    frames = traceback.extract_tb(tb)
    assert [f.name for f in frames] == ["failure", "outer", "inner"]
    assert frames[-1].line == 'return batch["labels"] * weights'  # the real source line
    assert frames[1].lineno == outer.__code__.co_firstlineno + 4
    while tb.tb_next is not None:
        tb = tb.tb_next
    inner_locals = tb.tb_frame.f_locals
    assert inner_locals["batch"] == {"inputs": [1, "batch"]}
    assert torch.equal(inner_locals["weights"], torch.full((3,), 2.0))
    assert not inner_locals["weights"].requires_grad
    assert set(inner_locals) == {"batch", "factor", "weights"}  # nothing of nbaccel's added


def test_values_too_big_or_unpicklable_are_described_not_copied():
    records = snapshot.load(snapshot.take(failure()))
    outer_values = next(r for r in records if r.function == "outer").values
    lock, model = outer_values["lock"], outer_values["model"]
    assert isinstance(lock, snapshot.Unsent) and "cannot be pickled" in lock.why
    assert isinstance(model, snapshot.Unsent) and model.why == "over 8.0 MiB"
    assert "Sequential" in repr(model)


def test_post_mortem_0_sends_nothing(monkeypatch):
    monkeypatch.setenv(snapshot.ENV_SWITCH, "0")
    assert snapshot.take(failure()) is None
