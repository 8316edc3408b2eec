"""FSDP checks that only a CUDA machine can make (run from check_cuda.py, or alone):

    .venv/bin/python gpu_checks/check_fsdp_cuda.py

On CPU the tests in tests/test_fsdp_training.py cover the logic, but there "CPU offload" cannot
move anything (compute is on the CPU too) and pinned memory is off. Here, with 2 GPUs (one rank
each, NCCL): offloaded parameters and optimizer state sit on the CPU between steps while compute
runs on the GPU, and training follows the non-offloaded losses; activation checkpointing gives
the same gradients; a bf16 policy computes in bf16; rank 0 alone loads (the other rank builds on
the meta device), also with offload; a sharded checkpoint resumes. Needs at least 2 GPUs.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

import nbaccel  # noqa: E402


def _offload_and_rank0_loading() -> dict:
    from tests.test_fsdp_training import Plugin, _build, _full, _step

    rank = int(os.environ["RANK"])
    plugin = Plugin(
        auto_wrap_policy="transformer_based_wrap", cpu_offload=True, cpu_ram_efficient_loading=True
    )
    acc, model, opt = _build(plugin, seed=0, meta=rank == 1)
    loaded = _full(acc, model)
    losses = [_step(acc, model, opt, s) for s in range(3)]
    devices = {p.device.type for p in model.parameters()}
    devices |= {t.device.type for st in opt.state.values() for t in st.values() if t.dim()}
    return {"loaded": loaded, "losses": losses, "devices": sorted(devices)}


def check_fsdp() -> str:
    """FSDP2 over NCCL: CPU offload, checkpointing, bf16 policy, rank-0 loading, sharded resume."""
    import tempfile

    from tests.test_fsdp_training import _weights, numerics, resume

    n = torch.cuda.device_count()
    if n < 2:
        return "skipped: FSDP shards across ranks; this needs 2 GPUs (one per rank)"
    r = nbaccel.notebook_launcher(numerics, num_processes=2, progress="text")
    assert r["offload_True"]["devices"] == ["cpu"], r["offload_True"]
    assert r["offload_False"]["devices"] == ["cuda"], r["offload_False"]
    torch.testing.assert_close(r["offload_True"]["losses"], r["offload_False"]["losses"])
    assert (r["ac_False_calls"], r["ac_True_calls"]) == (2, 4)
    for k, v in r["ac_False_grads"].items():
        torch.testing.assert_close(r["ac_True_grads"][k], v, atol=1e-6, rtol=0)
    assert r["bf16_output"] == "torch.bfloat16" and r["bf16_master"] == ["torch.float32"]

    loading = nbaccel.notebook_launcher(
        _offload_and_rank0_loading, num_processes=2, progress="text", return_all=True
    )
    for rank in loading:
        assert rank["devices"] == ["cpu"], rank["devices"]
        for k, v in _weights(0).items():
            torch.testing.assert_close(rank["loaded"][k], v, atol=0, rtol=0)
    assert loading[0]["losses"] == loading[1]["losses"]

    with tempfile.TemporaryDirectory() as tmp:
        run = nbaccel.notebook_launcher(
            resume, args=("SHARDED_STATE_DICT", f"{tmp}/ckpt"), num_processes=2, progress="text"
        )
    for k, v in run["saved"].items():
        torch.testing.assert_close(run["loaded"][k], v, atol=0, rtol=0)
    torch.testing.assert_close(run["resumed"], run["after"], atol=1e-6, rtol=0)
    return (
        f"offload: params+state on cpu, losses {r['offload_True']['losses'][-1]:.4f} as without; "
        "checkpointing grads equal; bf16 policy; rank-0 loading with offload; sharded resume"
    )


if __name__ == "__main__":
    if not torch.cuda.is_available():
        print("no CUDA device visible; nothing to check")
        sys.exit(1)
    print(check_fsdp())
