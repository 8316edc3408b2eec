"""Section "restart_run_all": a notebook's "Restart & Run All", kernel start → launch cell done.

Two notebooks, each run top to bottom in a fresh kernel as Jupyter's "Restart & Run All" does,
once with nbaccel and once with Accelerate (only the launcher's import and call differ):

- ``hf``, a Hugging Face-style notebook: ``import transformers``, ``import datasets``,
  ``import torch`` (in that order, as such notebooks have them); the launcher; a tiny BERT built
  from a ``BertConfig`` (nothing downloaded) and a ``torch.utils.data.Dataset`` of random token
  ids; a training function (gloo process group, ``DistributedDataParallel``, AdamW, a few real
  optimizer steps); the launch cell.
- ``torch``, the same notebook without transformers or datasets: a small MLP on random features.

The clock is the benchmark process's ``time.time()``: from just before the kernel is started
to the moment the launch cell's reply says it is done (what the person waits for). Each rank
writes its first step's time, so a run whose ranks did not train is an error, not a number.
Repetitions are interleaved (A B, B A, ...); the load average is recorded beside each run.
"""

from __future__ import annotations

import importlib.util
import time
from typing import Any

from benchmarks import harness as H
from benchmarks.workload import free_port, read_ranks

CONTENDERS = ("nbaccel", "accelerate")
NOTEBOOKS = ("hf", "torch")

IMPORT_CELL = {
    "hf": (
        "import transformers\n"
        "import datasets\n"
        "import torch\n"
        "from torch.utils.data import DataLoader, Dataset\n"
        "from transformers import BertConfig, BertForSequenceClassification\n"
    ),
    "torch": (
        "import torch\nfrom torch import nn\nfrom torch.utils.data import DataLoader, Dataset\n"
    ),
}
LAUNCHER_IMPORT = {
    "nbaccel": "import nbaccel",
    "accelerate": "from accelerate import notebook_launcher",
}
# The model, its loss on a batch, and the data: what differs between the two notebooks.
DATA_CELL = {
    "hf": (
        "config = BertConfig(vocab_size=1000, hidden_size=32, num_hidden_layers=2,\n"
        "                    num_attention_heads=2, intermediate_size=64,\n"
        "                    max_position_embeddings=64, num_labels=2)\n"
        "\n"
        "def make_model():\n"
        "    return BertForSequenceClassification(config)\n"
        "\n"
        "def compute_loss(model, batch):\n"
        "    return model(**batch).loss\n"
        "\n"
        "class RandomText(Dataset):\n"
        "    def __init__(self, n=512, length=32):\n"
        "        g = torch.Generator().manual_seed(0)\n"
        "        self.ids = torch.randint(0, config.vocab_size, (n, length), generator=g)\n"
        "        self.labels = torch.randint(0, 2, (n,), generator=g)\n"
        "    def __len__(self):\n"
        "        return len(self.labels)\n"
        "    def __getitem__(self, i):\n"
        "        return {'input_ids': self.ids[i], 'labels': self.labels[i]}\n"
        "\n"
        "train_dataset = RandomText()\n"
    ),
    "torch": (
        "def make_model():\n"
        "    return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10))\n"
        "\n"
        "def compute_loss(model, batch):\n"
        "    return nn.functional.cross_entropy(model(batch['x']), batch['y'])\n"
        "\n"
        "class RandomFeatures(Dataset):\n"
        "    def __init__(self, n=512):\n"
        "        g = torch.Generator().manual_seed(0)\n"
        "        self.x = torch.randn(n, 64, generator=g)\n"
        "        self.y = torch.randint(0, 10, (n,), generator=g)\n"
        "    def __len__(self):\n"
        "        return len(self.y)\n"
        "    def __getitem__(self, i):\n"
        "        return {'x': self.x[i], 'y': self.y[i]}\n"
        "\n"
        "train_dataset = RandomFeatures()\n"
    ),
}
# The same in both notebooks. Threads are pinned as benchmarks.workload pins them, so that only
# the launchers differ; the record proves the ranks trained. No destroy_process_group() at the
# end: with it, the function's return freed DDP's reducer, which held the last reference to the
# gloo group, whose destructor joined gloo's thread while holding the GIL that thread waited for
# (torch 2.13; an Accelerate rank of the hf notebook hung so, forever, in 3 of 5 runs). The
# ranks end with the group alive, as benchmarks.workload's do under fork-based launchers.
FUNCTION_CELL = (
    "def training_function(out_dir, steps):\n"
    "    import json, os, time\n"
    "    import torch.distributed as dist\n"
    "    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ['WORLD_SIZE'])))\n"
    "    dist.init_process_group('gloo')\n"
    "    torch.manual_seed(0)\n"
    "    model = torch.nn.parallel.DistributedDataParallel(make_model())\n"
    "    sampler = torch.utils.data.distributed.DistributedSampler(train_dataset, seed=0)\n"
    "    loader = DataLoader(train_dataset, batch_size=16, sampler=sampler)\n"
    "    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)\n"
    "    first_step = None\n"
    "    for _, batch in zip(range(steps), loader):\n"
    "        loss = compute_loss(model, batch)\n"
    "        loss.backward()\n"
    "        optimizer.step()\n"
    "        optimizer.zero_grad()\n"
    "        first_step = first_step or time.time()\n"
    "    with open(os.path.join(out_dir, f'rank{dist.get_rank()}.json'), 'w') as f:\n"
    "        json.dump({'first_step': first_step, 'loss': loss.item()}, f)\n"
)
LAUNCH_CELL = {
    "nbaccel": "nbaccel.notebook_launcher(training_function, args=({args}), num_processes={world})",
    "accelerate": (
        "notebook_launcher(training_function, args=({args}), num_processes={world}, "
        "use_port='{port}')"
    ),
}


def unavailable_reason(contender: str, notebook: str) -> str | None:
    if notebook == "hf":
        for package in ("transformers", "datasets"):
            if importlib.util.find_spec(package) is None:
                return f"{package} is not installed (the dev extra pins it)"
    return H.unavailable_reason(contender)


def cells(notebook: str, contender: str, out_dir: str, steps: int, world: int) -> list[str]:
    """The notebook's cells, top to bottom, for ``contender``."""
    launch = LAUNCH_CELL[contender].format(
        args=f"{out_dir!r}, {steps}", world=world, port=free_port()
    )
    return [
        IMPORT_CELL[notebook],
        LAUNCHER_IMPORT[contender],
        DATA_CELL[notebook],
        FUNCTION_CELL,
        launch,
    ]


def run_all(
    notebook: str, contender: str, steps: int, world: int, scratch: H.Scratch
) -> dict[str, float]:
    """Restart & Run All once: seconds from the kernel's start to the end of each cell."""
    out_dir = scratch.new()
    ends = []
    with H.restarted_kernel() as (session, started):
        for code in cells(notebook, contender, out_dir, steps, world):
            cell = session.execute(code, timeout=600)
            if cell.error is not None:
                raise RuntimeError(f"cell failed:\n{code[:200]}\n{cell.error_text[-3000:]}")
            ends.append(time.time() - started)
    ranks = read_ranks(out_dir, world)
    if len(ranks) != world or any(r.get("first_step") is None for r in ranks.values()):
        raise RuntimeError(f"not every rank trained: {ranks}")
    return {
        "total": ends[-1],
        "imports": ends[1],  # kernel start, the notebook's imports and the launcher's
        "launch_cell": ends[-1] - ends[-2],
        "first_step": max(r["first_step"] for r in ranks.values()) - started,
    }


def run(reps: int, smoke: bool, world: int, scratch: H.Scratch) -> dict[str, Any]:
    steps = 1 if smoke else 3
    keys = ("total", "imports", "launch_cell", "first_step")
    runnable = {
        (nb, c) for nb in NOTEBOOKS for c in CONTENDERS if unavailable_reason(c, nb) is None
    }
    raw: dict[tuple[str, str], dict[str, list]] = {
        pair: {**{k: [] for k in keys}, "load": [], "rep": [], "errors": []} for pair in runnable
    }
    for rep in range(reps):
        for nb in NOTEBOOKS:
            for c in H.rotated(CONTENDERS, rep):
                if (nb, c) not in runnable:
                    continue
                load = H.load_now()
                try:
                    times = run_all(nb, c, steps, world, scratch)
                except Exception as exc:  # noqa: BLE001 - one failed run is reported, not fatal
                    raw[nb, c]["errors"].append(f"{type(exc).__name__}: {str(exc)[-400:]}")
                    continue
                for k in keys:
                    raw[nb, c][k].append(times[k])
                raw[nb, c]["load"].append(load)
                raw[nb, c]["rep"].append(rep)
    out: dict[str, Any] = {
        "what": "seconds from the kernel's start to the end of each notebook's launch cell, "
        "every cell run top to bottom in a fresh kernel (Restart & Run All)",
        "steps": steps,
        "contenders": {},  # "<notebook>/<launcher>"
        "total_nbaccel_vs_accelerate": {},  # notebook -> ratio of medians
        "total_nbaccel_vs_accelerate_paired": {},  # notebook -> median of per-repetition ratios
    }
    for nb in NOTEBOOKS:
        for c in CONTENDERS:
            if (nb, c) not in runnable:
                out["contenders"][f"{nb}/{c}"] = {"unavailable": unavailable_reason(c, nb)}
                continue
            r = raw[nb, c]
            out["contenders"][f"{nb}/{c}"] = {
                **{f"{k}_s": H.summary(r[k]) for k in keys},
                "load_1min": H.summary([x for x in r["load"] if x is not None], 2),
                "errors": r["errors"],
            }
        if {(nb, c) for c in CONTENDERS} <= runnable:
            # pairs: the two contenders' runs of one repetition (both succeeded), side by side
            a, b = (
                {r: t for r, t in zip(raw[nb, c]["rep"], raw[nb, c]["total"])} for c in CONTENDERS
            )
            both = sorted(set(a) & set(b))
            out["total_nbaccel_vs_accelerate"][nb] = H.ratio(
                out["contenders"][f"{nb}/nbaccel"]["total_s"]["median"],
                out["contenders"][f"{nb}/accelerate"]["total_s"]["median"],
            )
            out["total_nbaccel_vs_accelerate_paired"][nb] = H.paired_ratio(
                [a[r] for r in both], [b[r] for r in both]
            )
    return out
