"""Hugging Face objects made in the kernel carry the kernel's process state ("process 0 of 1"):
sent to the ranks as they are, each rank would train alone on all the data, silently. A
``TrainingArguments`` sets its devices up again in each rank; an Accelerate state or
Accelerator made in the kernel is refused before any rank starts, saying what to do."""

from __future__ import annotations

import pytest

import nbaccel

transformers = pytest.importorskip("transformers")
accelerate_state = pytest.importorskip("accelerate.state")
pytestmark = pytest.mark.slow  # real 2-rank launches


def test_training_arguments_made_in_the_kernel_see_the_ranks_world(tmp_path):
    args = transformers.TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[])
    assert args.world_size == 1  # set up here, in the "kernel"

    def where(training_args):
        return training_args.world_size, training_args.process_index

    out = nbaccel.notebook_launcher(
        where, args=(args,), num_processes=2, progress=False, return_all=True, timeout=180
    )
    assert out == [(2, 0), (2, 1)]
    assert args.world_size == 1  # the kernel's own copy is left as it was


@pytest.mark.parametrize("made", ["PartialState", "Accelerator"])
def test_an_accelerate_state_made_in_the_kernel_is_refused_before_anything_starts(made):
    import accelerate

    state = accelerate.Accelerator(cpu=True) if made == "Accelerator" else accelerate.PartialState()

    def train():
        return state.process_index

    with pytest.raises(TypeError, match=rf"Accelerate {made}\(\) made in the kernel") as caught:
        nbaccel.notebook_launcher(train, num_processes=2, progress=False)
    assert f"Create {made}() inside the training function" in str(caught.value)
