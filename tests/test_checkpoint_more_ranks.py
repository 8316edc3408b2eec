"""A checkpoint saved by fewer processes loads into more, as with Accelerate: the ranks without
a saved RNG state warn (naming the missing file) and keep their own; the rest is restored."""

from __future__ import annotations

import warnings

import pytest

import nbaccel
from tests.test_accelerator_checkpoint import build

pytestmark = pytest.mark.slow  # a real 2-rank launch


def load_into_two(ckpt: str) -> tuple[float, list[str]]:
    acc, model = build(0.0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        acc.load_state(ckpt)
    weight = acc.unwrap_model(model).weight.sum().item()
    return weight, [str(w.message) for w in caught]


def test_load_state_with_more_processes_warns_and_continues(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    acc, _ = build(1.0)  # one process, in this kernel-like test process
    acc.save_state(ckpt)
    (w0, warned0), (w1, warned1) = nbaccel.notebook_launcher(
        load_into_two, args=(ckpt,), num_processes=2, return_all=True, progress=False
    )
    assert w0 == w1 == pytest.approx(3.0)  # the weights came back on every rank
    assert not any("random_states" in m for m in warned0)
    assert any("random_states_1.pkl is missing" in m and "not restored" in m for m in warned1)
