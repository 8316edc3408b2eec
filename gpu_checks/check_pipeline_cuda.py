"""Pipeline checks on GPUs, one per rank over NCCL (run from check_cuda.py, or alone):

    .venv/bin/python gpu_checks/check_pipeline_cuda.py

tests/test_pipeline_parallel.py runs the same cases on CPU ranks (gloo) in CI; here the stages
sit on the GPUs, activations and gradients travel over NCCL, and the global batch is made on
the CPU (``train_step`` sends each rank's rows to its stages' device). Training (GPipe,
interleaved 1F1B; dp 2 x pp 2 with 4 GPUs) and ``prepare_pippy`` are compared with the same model
in one process on the CPU, to 1e-4 (GPU kernels sum in other orders). Needs 2 GPUs (4 for the
data-parallel case).
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

import nbaccel  # noqa: E402

TOLERANCE = 1e-4


def _assert_close(case: dict, layout: tuple[int, int]) -> None:
    assert case["layout"] == layout, case
    assert case["loss"] <= TOLERANCE and case["grad"] <= TOLERANCE, case


def check_pipeline() -> str:
    """Pipeline training and inference with one stage per GPU."""
    from tests.test_pipeline_parallel import on_four_ranks, on_two_ranks

    n = torch.cuda.device_count()
    if n < 2:
        return "skipped: a pipeline needs 2 GPUs (one stage per rank)"
    two = nbaccel.notebook_launcher(on_two_ranks, num_processes=2, progress="text")
    _assert_close(two["gpipe"], (2, 1))
    _assert_close(two["interleaved"], (2, 1))
    assert two["pippy_gathered"] <= TOLERANCE, two["pippy_gathered"]
    detail = f"2 GPUs: GPipe, interleaved, prepare_pippy (worst grad {two['gpipe']['grad']:.1e})"
    if n >= 4:
        four = nbaccel.notebook_launcher(on_four_ranks, num_processes=4, progress="text")
        _assert_close(four["dp2_pp2_1f1b"], (2, 2))
        assert four["pippy"] <= TOLERANCE, four["pippy"]
        detail += "; 4 GPUs: dp 2 x pp 2 1F1B, prepare_pippy"
    return detail


if __name__ == "__main__":
    if not torch.cuda.is_available():
        print("no CUDA device visible; nothing to check")
        sys.exit(1)
    print(check_pipeline())
