"""GPU check for context parallelism, to run by hand on a machine with 2+ CUDA GPUs (not
collected by pytest; CPU ranks refuse ``cp_size > 1`` before any rank starts).

    .venv/bin/python gpu_checks/check_context_parallel.py

Checks, in under a minute: ``Accelerator(parallelism_config=ParallelismConfig(cp_size=2))`` on
2 GPUs builds a ``cp`` mesh, FSDP2 shards over ``dp_shard_cp``, and a step of the tests' small
transformer block inside ``accelerator.maybe_context_parallel(buffers=[x, y],
buffer_seq_dims=[1, 1])`` (each rank holding half of every sequence) gives the loss and the
weights of the same step on one GPU with whole sequences (≤ 1e-4, bf16-free float32). Prints
one line per check and exits non-zero if any failed.
"""

from __future__ import annotations

import sys
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

import nbaccel  # noqa: E402
from tests.test_parallelism import Block  # noqa: E402

SEQ, WIDTH = 64, 16


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, SEQ, WIDTH, generator=g)
    return x, x.roll(1, dims=1).tanh()


def _context_parallel_step() -> dict[str, torch.Tensor]:
    import torch.distributed as dist

    from nbaccel import Accelerator, ParallelismConfig

    accelerator = Accelerator(parallelism_config=ParallelismConfig(cp_size=2))
    torch.manual_seed(0)
    model = Block()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    x, y = (t.to(accelerator.device) for t in _data())
    with accelerator.maybe_context_parallel(buffers=[x, y], buffer_seq_dims=[1, 1]):
        loss = torch.nn.functional.mse_loss(model(x), y)
        accelerator.backward(loss)
        optimizer.step()
        dist.all_reduce(loss, op=dist.ReduceOp.AVG)
    weights = {k: v.cpu() for k, v in accelerator.get_state_dict(model).items()}
    return {"loss": loss.detach().cpu(), **weights}


def _one_gpu_step() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = Block().cuda()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = (t.cuda() for t in _data())
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    optimizer.step()
    return {"loss": loss.detach().cpu(), **{k: v.cpu() for k, v in model.state_dict().items()}}


def main() -> int:
    if torch.cuda.device_count() < 2:
        print("SKIP context parallelism: needs 2 CUDA GPUs")
        return 0
    try:
        got = nbaccel.notebook_launcher(_context_parallel_step, num_processes=2)
        want = _one_gpu_step()
        for key, value in want.items():
            torch.testing.assert_close(got[key], value, atol=1e-4, rtol=0, msg=key)
        print("OK   context parallelism (cp 2): one GPU's loss and weights")
        return 0
    except Exception:  # noqa: BLE001 - a check script reports and goes on
        traceback.print_exc()
        print("FAIL context parallelism (cp 2)")
        return 1


if __name__ == "__main__":
    sys.exit(main())
