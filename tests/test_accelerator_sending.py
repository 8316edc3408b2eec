"""An Accelerator made in the kernel is refused before any rank starts (else every rank would
silently run as "rank 0 of 1"); copies and pickles inside one process share it, a pickle loaded
in another process is refused."""

from __future__ import annotations

import copy
import io
import pickle
import subprocess
import sys

import pytest
import torch

import nbaccel
from nbaccel.persistent.session import Ranks

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


def test_pickle_and_deepcopy_in_one_process_share_it():
    # Accelerate's test_pickle_accelerator; torch.save of something that holds one.
    accelerator = nbaccel.Accelerator()
    assert pickle.loads(pickle.dumps(accelerator)) is accelerator
    buffer = io.BytesIO()
    torch.save({"acc": accelerator, "step": 3}, buffer)
    buffer.seek(0)
    assert torch.load(buffer, weights_only=False)["acc"] is accelerator
    holder = {"acc": accelerator, "n": [1]}
    copied = copy.deepcopy(holder)
    assert copied["acc"] is accelerator and copied["n"] is not holder["n"]


def test_a_pickle_loaded_in_another_process_is_refused():
    data = pickle.dumps(nbaccel.Accelerator())
    load = "import pickle, sys; pickle.loads(sys.stdin.buffer.read())"
    child = subprocess.run([sys.executable, "-c", load], input=data, capture_output=True)
    assert child.returncode == 1
    message = child.stderr.decode().strip().splitlines()[-1]
    assert message.startswith("TypeError: an Accelerator can only be unpickled in the process")
    assert "pickled in another process (pid " in message
    assert "Create `Accelerator()` in this process (in each rank" in message


def returns_its_accelerator():
    accelerator = nbaccel.Accelerator()
    assert pickle.loads(pickle.dumps(accelerator)) is accelerator  # in the rank: shared
    return accelerator


@pytest.mark.slow
def test_a_rank_returning_its_accelerator_is_told_to_return_plain_values():
    with pytest.raises(Exception, match="Return or gather plain values") as info:
        nbaccel.notebook_launcher(returns_its_accelerator, num_processes=2, progress=False)
    assert "cannot be sent to another process: it holds this rank's process group" in str(
        info.value
    )
