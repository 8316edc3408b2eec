"""transformers' Trainer launched from a real kernel, as a Hugging Face notebook has it: the
imports first, a Dataset class and a model subclass defined in cells, TrainingArguments made
inside the function. Under nbaccel the Trainer must see the launch (world size 2, each rank its
own half of every epoch) and train exactly as under Accelerate's own launcher."""

from __future__ import annotations

import json

import pytest

from tests.kernel_helpers import KernelSession

pytest.importorskip("transformers")
pytest.importorskip("accelerate")
pytestmark = pytest.mark.slow  # a real kernel, two 2-rank launches

IMPORTS = """\
import json, os, tempfile
import torch, transformers
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments
import accelerate
import nbaccel
"""

CELL = """\
class Numbers(torch.utils.data.Dataset):
    def __len__(self):
        return 16

    def __getitem__(self, i):
        ids = torch.randint(0, 64, (8,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids, "index": torch.tensor(i)}


def collate(items):
    return {k: torch.stack([item[k] for item in items]) for k in items[0]}


class Indexed(GPT2LMHeadModel):
    # Records which samples this rank trained on.
    def forward(self, index=None, **kwargs):
        self.seen.extend(index.tolist())
        return super().forward(**kwargs)


def train(out_dir):
    transformers.set_seed(0)
    model = Indexed(GPT2Config(n_layer=1, n_head=2, n_embd=32, vocab_size=64, n_positions=16))
    model.seen = []
    args = TrainingArguments(
        output_dir=out_dir, per_device_train_batch_size=2, max_steps=4, logging_steps=1,
        report_to=[], save_strategy="no", disable_tqdm=True, remove_unused_columns=False,
    )
    trainer = Trainer(model=model, args=args, train_dataset=Numbers(), data_collator=collate)
    trainer.train()
    result = {
        "world": args.world_size,
        "seen": model.seen,
        "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
    }
    # Accelerate's launchers return nothing: each rank leaves its result in a file.
    with open(os.path.join(out_dir, f"rank{args.process_index}.json"), "w") as f:
        json.dump(result, f)
    return result
"""


def _json_line(cell) -> object:
    assert cell.error is None, cell.error_text
    return json.loads(cell.stdout.strip().splitlines()[-1])


def test_a_trainer_runs_on_both_ranks_exactly_as_under_accelerate():
    with KernelSession() as kernel:
        for code in (IMPORTS, CELL):
            cell = kernel.execute(code)
            assert cell.error is None, cell.error_text
        ours = _json_line(
            kernel.execute(
                "ours = nbaccel.notebook_launcher(train, args=(tempfile.mkdtemp(),),"
                " num_processes=2, return_all=True)\nprint(json.dumps(ours))",
                timeout=300,
            )
        )
        theirs = _json_line(
            kernel.execute(
                "d = tempfile.mkdtemp()\n"
                "accelerate.debug_launcher(train, args=(d,), num_processes=2)\n"
                "print(json.dumps([json.load(open(f'{d}/rank{r}.json')) for r in range(2)]))",
                timeout=300,
            )
        )
    assert [r["world"] for r in ours] == [2, 2]
    seen = [r["seen"] for r in ours]
    assert not set(seen[0]) & set(seen[1]) and len(seen[0]) == len(seen[1]) == 8  # disjoint
    assert ours == theirs  # the same shards, the same losses, bit for bit
