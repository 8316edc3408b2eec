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


@pytest.fixture(scope="module")
def kernel():
    """One kernel for the module, set up as the notebook's first cells."""
    with KernelSession(background_shutdown=True) as k:
        for code in (IMPORTS, CELL):
            cell = k.execute(code)
            assert cell.error is None, cell.error_text
        yield k


def test_a_trainer_runs_on_both_ranks_exactly_as_under_accelerate(kernel):
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


PIPELINE = """\
def pipeline():
    import datasets

    accelerator = nbaccel.Accelerator()
    ds = datasets.Dataset.from_dict({"x": list(range(32))})
    ds = ds.map(lambda row: {"y": row["x"] * 2}, num_proc=2)
    loader = torch.utils.data.DataLoader(
        ds.with_format("torch"), batch_size=4, num_workers=2,
        collate_fn=lambda rows: torch.stack([r["y"] for r in rows]),
    )
    loader = accelerator.prepare(loader)
    return sorted(torch.cat([accelerator.gather(batch) for batch in loader]).tolist())

print(json.dumps(nbaccel.notebook_launcher(pipeline, num_processes=2)))
"""


def test_a_datasets_pipeline_with_num_proc_and_loader_workers(kernel):
    # map(num_proc=2) forks a pool inside each rank; the loader's workers run a lambda.
    assert _json_line(kernel.execute(PIPELINE, timeout=300)) == [2 * i for i in range(32)]


LORA = """\
def lora(out_dir):
    from peft import LoraConfig, get_peft_model

    accelerator = nbaccel.Accelerator()
    transformers.set_seed(0)
    base = GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=32, vocab_size=64, n_positions=16))
    model = get_peft_model(base, LoraConfig(r=4, target_modules=["c_attn"]))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loader = torch.utils.data.DataLoader(Numbers(), batch_size=2, collate_fn=collate)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    for batch in loader:
        batch.pop("index")
        accelerator.backward(model(**batch).loss)
        optimizer.step()
        optimizer.zero_grad()
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        accelerator.unwrap_model(model).save_pretrained(out_dir)
    with torch.no_grad():  # eval(): no dropout, so the kernel's reload can match it exactly
        trained = accelerator.unwrap_model(model).eval()
        return trained(input_ids=Numbers()[0]["input_ids"][None]).logits

from peft import PeftModel

lora_dir = tempfile.mkdtemp()
trained = nbaccel.notebook_launcher(lora, args=(lora_dir,), num_processes=2)
transformers.set_seed(0)
base = GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=32, vocab_size=64, n_positions=16))
reloaded = PeftModel.from_pretrained(base, lora_dir).eval()
with torch.no_grad():
    again = reloaded(input_ids=Numbers()[0]["input_ids"][None]).logits
print(json.dumps([torch.equal(trained, again), sorted(os.listdir(lora_dir))]))
"""


def test_a_lora_adapter_trained_on_the_ranks_reloads_in_the_kernel(kernel):
    pytest.importorskip("peft")
    same, files = _json_line(kernel.execute(LORA, timeout=300))
    assert "adapter_model.safetensors" in files and "adapter_config.json" in files
    assert same  # the adapter saved by rank 0 gives the trained model's logits, bit for bit


BF16 = """\
def bf16(out_dir):
    args = TrainingArguments(
        output_dir=out_dir, per_device_train_batch_size=2, max_steps=1, report_to=[],
        save_strategy="no", remove_unused_columns=False, bf16=True, use_cpu=True,
    )
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=32, vocab_size=64, n_positions=16))
    batch = lambda items: {k: v for k, v in collate(items).items() if k != "index"}
    Trainer(model=model, args=args, train_dataset=Numbers(), data_collator=batch).train()
    return args.world_size

print(nbaccel.notebook_launcher(bf16, args=(tempfile.mkdtemp(),), num_processes=2))
"""


def test_the_summary_says_what_the_trainers_accelerator_ran(kernel):
    # The Trainer's own Accelerate Accelerator runs bf16 while the launch said "no": the
    # ranks report it, as nbaccel's Accelerator does (the summary said mixed_precision=no).
    cell = kernel.execute(BF16, timeout=300)
    assert cell.error is None, cell.error_text
    shown = cell.stdout + "".join(r.get("text/plain", "") for r in cell.results)
    assert "the ranks run mixed_precision=bf16 (set in code)" in shown, shown
    assert "mixed_precision=bf16 (set in code), strategy=ddp" in shown, shown
    assert cell.stdout.strip().splitlines()[-1] == "2"
