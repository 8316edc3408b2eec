"""An Accelerator made in the kernel is refused before any rank starts (else every rank would
silently run as "rank 0 of 1"); copies inside one process share it."""

from __future__ import annotations

import copy
import pickle

import pytest

import nbaccel
from nbaccel.launch.session import Ranks

FIX = r"create `Accelerator\(\)` inside the training function"


def test_launch_with_a_kernel_accelerator_refuses_before_any_rank_starts(tmp_path):
    accelerator = nbaccel.Accelerator()
    marker = tmp_path / "ran"

    def f():  # a closure, pickled by value as a notebook function is
        marker.write_text("ran")
        return accelerator.process_index

    with pytest.raises(TypeError) as info:
        nbaccel.notebook_launcher(f, num_processes=2, return_all=True)
    message = str(info.value)
    assert "f cannot start: an Accelerator created in the kernel cannot be sent" in message
    assert "inside the training function" in message
    assert not marker.exists()


def test_kernel_accelerator_as_an_argument_is_refused(tmp_path):
    with pytest.raises(TypeError, match=r"args\[0\] \(Accelerator\): an Accelerator .*" + FIX):
        nbaccel.notebook_launcher(print, args=(nbaccel.Accelerator(),), num_processes=2)


def test_push_refuses_a_kernel_accelerator():
    ranks = Ranks(2, start=False)
    with pytest.raises(TypeError, match=FIX):
        ranks.push(accelerator=nbaccel.Accelerator())


def test_pickle_refused_deepcopy_shares():
    accelerator = nbaccel.Accelerator()
    with pytest.raises(TypeError, match=FIX):
        pickle.dumps(accelerator)
    holder = {"acc": accelerator, "n": [1]}
    copied = copy.deepcopy(holder)
    assert copied["acc"] is accelerator and copied["n"] is not holder["n"]
