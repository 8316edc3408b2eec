"""Notebooks people run with Accelerate's ``notebook_launcher``, run in one real kernel under
Accelerate and with only the import swapped to nbaccel: each cell prints the same.

- The kernel's quieting (``warnings.filterwarnings``, ``transformers.logging.set_verbosity_error``,
  a logger's level, ``datasets.disable_progress_bar``) holds in every rank, as in Accelerate's
  forked ranks. nbaccel's ranks fork from its fork server, which imported those packages afresh:
  they printed every warning the notebook had silenced, on every rank.
- huggingface/notebooks' ``simple_nlp_example.ipynb``, offline: a tiny BERT saved to a local
  folder and loaded with ``from_pretrained`` as the notebook does, an MRPC-shaped ``DatasetDict``,
  the model built in the kernel (and run on a batch there) and passed to the launcher, ``tqdm.auto``
  and Transformers' info logging in the ranks, the kernel's ``metric`` object. Its code is the
  authors' but for the offline stand-ins, ``torch.optim.AdamW`` (Transformers' is gone), a larger
  learning rate and one added print of the loss, so the comparison sees more than the accuracy.

Accelerate's ranks are told they run on CPU (``ACCELERATE_USE_CPU``), as on a GPU machine they
would form one process group: without it Accelerate on a CPU machine runs two separate
single-process trainings.
"""

from __future__ import annotations

import re

import pytest

from tests.kernel_helpers import KernelSession
from tests.test_cli_support import free_port

pytest.importorskip("accelerate")
pytest.importorskip("transformers")
pytest.importorskip("datasets")
pytestmark = pytest.mark.slow  # one kernel, four 2-rank launches

IMPORTS = """\
import logging, warnings
import torch
from torch.utils.data import DataLoader

import accelerate, nbaccel
from datasets import load_dataset
from transformers import (
    AutoModelForSequenceClassification,
    AutoTokenizer,
    get_linear_schedule_with_warmup,
    set_seed,
)
from torch.optim import AdamW

from tqdm.auto import tqdm

import datasets
import transformers
"""


def _launch(
    kernel: KernelSession, lib: str, function: str, args: str = "()", imports: str = ""
) -> str:
    """Launch ``function`` with ``lib``'s notebook_launcher (its Accelerator, gather_object and
    ``imports`` with ``LIB`` for the library, the cell's globals); the lines its ranks printed
    on stdout and stderr, sorted, without the launchers' own lines and nbaccel's labels."""
    port = f", use_port='{free_port()}'" if lib == "accelerate" else ""
    # Accelerate's forked ranks end in torch's gloo destructor deadlock now and then (an example
    # that calls end_training(): the group is destroyed, the DDP reducer freed with the function's
    # locals drops its last reference, ~ProcessGroupGloo joins a thread that waits for the GIL;
    # native stack seen here, 1 run in ~5 under load). nbaccel's ranks keep destroyed groups
    # alive for that reason (rank/torch_fixes.py); the forks get the same from the kernel here.
    keep_groups = (
        "import torch.distributed\ntorch.distributed.destroy_process_group = lambda group=None: None\n"
        if lib == "accelerate"
        else ""
    )
    code = (
        f"{keep_groups}"
        f"from {lib} import Accelerator, notebook_launcher\nfrom {lib}.utils import gather_object\n"
        f"{imports.replace('LIB', lib)}\n"
        f"notebook_launcher({function}, {args}, num_processes=2{port})"
    )
    try:
        cell = kernel.execute(code, timeout=120)
    except TimeoutError:
        kernel.interrupt()  # so the module's other tests and its teardown get the kernel back
        kernel.drain_iopub(5)
        raise AssertionError(f"{lib}'s launch did not finish in 120 s") from None
    assert cell.error is None, cell.error_text
    lines = (cell.stdout + cell.stderr).splitlines()
    ours = [re.sub(r"^\[rank\d\] ", "", line) for line in lines if not _launcher_line(line)]
    # Where a print's parts are separated, not what they say: Accelerate's forked ranks write
    # through the kernel's stream from a fork, which can move print's separate writes (seen in
    # CI: 'epoch 0:{...} ' for 'epoch 0: {...}', every number the same).
    return "\n".join(sorted(" ".join(re.sub(r"(?<=:) ", "", line).split()) for line in ours))


def _launcher_line(line: str) -> bool:
    """A line the launcher printed, not the ranks: Accelerate's opening line and its
    OMP_NUM_THREADS warning (nbaccel sets the threads without one), nbaccel's lines."""
    return (
        line.startswith(("Launching training on", "nbaccel", "  "))
        or "OMP_NUM_THREADS/MKL_NUM_THREADS unset" in line
        or line.strip() == "warnings.warn("
    )


@pytest.fixture(scope="module")
def kernel():
    env = {"ACCELERATE_USE_CPU": "true", "NBACCEL_VIEW": "text"}
    with KernelSession(env=env, background_shutdown=True, startup=IMPORTS + DATA) as k:
        yield k
        assert k.leftovers() == []


QUIET = """\
warnings.filterwarnings("ignore", category=UserWarning)
transformers.logging.set_verbosity_error()
logging.getLogger("my_project").setLevel(logging.ERROR)
datasets.disable_progress_bar()

def noisy():
    accelerator = Accelerator()
    rank = accelerator.process_index
    warnings.warn(f"rank {rank}: a UserWarning the notebook silenced")
    transformers.logging.get_logger("transformers.trainer").warning(f"rank {rank}: a warning")
    logging.getLogger("my_project").warning(f"rank {rank}: my project's warning")
    # One rank prints: Accelerate's forked ranks share the kernel's stream, their lines mix.
    seen = gather_object([
        f"rank {rank}: verbosity {transformers.logging.get_verbosity()}, "
        f"datasets bars {datasets.is_progress_bar_enabled()}, "
        f"my_project at {logging.getLogger('my_project').getEffectiveLevel()}"
    ])
    accelerator.print("\\n".join(seen))
"""


def test_the_kernels_quieting_holds_in_every_rank_as_under_accelerate(kernel):
    assert kernel.execute(QUIET).error is None
    theirs = _launch(kernel, "accelerate", "noisy")
    ours = _launch(kernel, "nbaccel", "noisy")
    assert ours == theirs
    assert "silenced" not in ours and "a warning" not in ours and "project's warning" not in ours
    assert ours.count("verbosity 40, datasets bars False, my_project at 40") == 2


DATA = """\
import os, random as _random, tempfile
from datasets import ClassLabel, Dataset, DatasetDict, Features, Value
from transformers import BertConfig, BertForMaskedLM, BertTokenizerFast

_words = ("the a witness brother accused his evidence deliberately distorting called referring "
          "him as only of to shares rose cents company said on in by was stock market").split()
model_checkpoint = tempfile.mkdtemp(prefix="tiny-bert-")
with open(os.path.join(model_checkpoint, "vocab.txt"), "w") as f:
    f.write("\\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", ".", *_words]) + "\\n")
BertTokenizerFast(vocab_file=os.path.join(model_checkpoint, "vocab.txt")).save_pretrained(
    model_checkpoint)
torch.manual_seed(0)
BertForMaskedLM(BertConfig(vocab_size=48, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                           intermediate_size=32, max_position_embeddings=64)
                ).save_pretrained(model_checkpoint)

def _split(n, seed):
    rng = _random.Random(seed)
    sentence = lambda: " ".join(rng.choices(_words, k=rng.randint(4, 12))) + " ."
    return {"sentence1": [sentence() for _ in range(n)], "sentence2": [sentence() for _ in range(n)],
            "label": [rng.randint(0, 1) for _ in range(n)], "idx": list(range(n))}

_features = Features({"sentence1": Value("string"), "sentence2": Value("string"),
                      "label": ClassLabel(names=["not_equivalent", "equivalent"]),
                      "idx": Value("int32")})
raw_datasets = DatasetDict({name: Dataset.from_dict(_split(n, seed), features=_features)
                            for name, n, seed in [("train", 48, 1), ("validation", 36, 2)]})

class _GlueMrpc:  # load_metric("glue", "mrpc") / evaluate.load("glue", "mrpc") offline
    def __init__(self):
        self.seen = []

    def add_batch(self, predictions, references):
        self.seen.append((predictions, references))

    def compute(self, predictions=None, references=None):
        if predictions is None:
            predictions = torch.cat([p for p, _ in self.seen])
            references = torch.cat([r for _, r in self.seen])
            self.seen = []
        p, r = torch.as_tensor(predictions), torch.as_tensor(references)
        f1 = 2 * ((p == 1) & (r == 1)).sum().item() / max((p == 1).sum().item() + (r == 1).sum().item(), 1)
        return {"accuracy": (p == r).float().mean().item(), "f1": f1}

tokenizer = AutoTokenizer.from_pretrained(model_checkpoint)

def tokenize_function(examples):
    outputs = tokenizer(examples["sentence1"], examples["sentence2"], truncation=True, padding="max_length", max_length=32)
    return outputs

tokenized_datasets = raw_datasets.map(tokenize_function, batched=True, remove_columns=["idx", "sentence1", "sentence2"])
tokenized_datasets = tokenized_datasets.rename_column("label", "labels")
tokenized_datasets.set_format("torch")
"""

NLP_SETUP = """\
model = AutoModelForSequenceClassification.from_pretrained(model_checkpoint, num_labels=2)

def create_dataloaders(train_batch_size=8, eval_batch_size=32):
    train_dataloader = DataLoader(
        tokenized_datasets["train"], shuffle=True, batch_size=train_batch_size
    )
    eval_dataloader = DataLoader(
        tokenized_datasets["validation"], shuffle=False, batch_size=eval_batch_size
    )
    return train_dataloader, eval_dataloader

train_dataloader, eval_dataloader = create_dataloaders()
for batch in train_dataloader:
    outputs = model(**batch)  # the notebook's look at one batch, in the kernel
    break
metric = _GlueMrpc()
hyperparameters = {"learning_rate": 5e-2, "num_epochs": 2, "train_batch_size": 8,
                   "eval_batch_size": 8, "seed": 42}

def training_function(model):
    # Initialize accelerator
    accelerator = Accelerator()

    # To have only one message (and not 8) per logs of Transformers or Datasets, we set the logging verbosity
    # to INFO for the main process only.
    if accelerator.is_main_process:
        datasets.utils.logging.set_verbosity_warning()
        transformers.utils.logging.set_verbosity_info()
    else:
        datasets.utils.logging.set_verbosity_error()
        transformers.utils.logging.set_verbosity_error()

    train_dataloader, eval_dataloader = create_dataloaders(
        train_batch_size=hyperparameters["train_batch_size"], eval_batch_size=hyperparameters["eval_batch_size"]
    )
    # The seed need to be set before we instantiate the model, as it will determine the random head.
    set_seed(hyperparameters["seed"])

    # Instantiate optimizer
    optimizer = AdamW(params=model.parameters(), lr=hyperparameters["learning_rate"])

    model, optimizer, train_dataloader, eval_dataloader = accelerator.prepare(
        model, optimizer, train_dataloader, eval_dataloader
    )

    num_epochs = hyperparameters["num_epochs"]
    lr_scheduler = get_linear_schedule_with_warmup(
        optimizer=optimizer,
        num_warmup_steps=100,
        num_training_steps=len(train_dataloader) * num_epochs,
    )

    progress_bar = tqdm(range(num_epochs * len(train_dataloader)), disable=not accelerator.is_main_process)
    for epoch in range(num_epochs):
        model.train()
        for step, batch in enumerate(train_dataloader):
            outputs = model(**batch)
            loss = outputs.loss
            accelerator.backward(loss)

            optimizer.step()
            lr_scheduler.step()
            optimizer.zero_grad()
            progress_bar.update(1)

        model.eval()
        all_predictions = []
        all_labels = []

        for step, batch in enumerate(eval_dataloader):
            with torch.no_grad():
                outputs = model(**batch)
            predictions = outputs.logits.argmax(dim=-1)
            all_predictions.append(accelerator.gather(predictions))
            all_labels.append(accelerator.gather(batch["labels"]))

        all_predictions = torch.cat(all_predictions)[:len(tokenized_datasets["validation"])]
        all_labels = torch.cat(all_labels)[:len(tokenized_datasets["validation"])]

        eval_metric = metric.compute(predictions=all_predictions, references=all_labels)

        # Use accelerator.print to print only on the main process.
        accelerator.print(f"epoch {epoch}:", eval_metric)
        accelerator.print(f"last loss {loss.item()!r}")  # added: the numbers, to the last digit
"""


def test_the_nlp_notebook_prints_accelerates_numbers(kernel):
    setup = kernel.execute(NLP_SETUP)
    assert setup.error is None, setup.error_text
    theirs = _launch(kernel, "accelerate", "training_function", "(model,)")
    ours = _launch(kernel, "nbaccel", "training_function", "(model,)")
    assert ours == theirs
    assert ours.count("epoch ") == 2 and ours.count("last loss ") == 2


# Accelerate's examples/by_feature/local_sgd.py pasted into a cell, its get_dataloaders offline
# (the tiny checkpoint and the MRPC-shaped data above) and evaluate's metric the stand-in.
LOCAL_SGD = """\
import argparse

EVAL_BATCH_SIZE = 32

def get_dataloaders(accelerator, batch_size=16):
    def collate_fn(examples):
        return tokenizer.pad(examples, padding="longest", return_tensors="pt")

    tokenized = raw_datasets.map(tokenize_function, batched=True, remove_columns=["idx", "sentence1", "sentence2"])
    tokenized = tokenized.rename_column("label", "labels")
    train_dataloader = DataLoader(
        tokenized["train"], shuffle=True, collate_fn=collate_fn, batch_size=batch_size
    )
    eval_dataloader = DataLoader(
        tokenized["validation"], shuffle=False, collate_fn=collate_fn, batch_size=EVAL_BATCH_SIZE
    )
    return train_dataloader, eval_dataloader

def training_function(config, args):
    gradient_accumulation_steps = int(args.gradient_accumulation_steps)
    local_sgd_steps = int(args.local_sgd_steps)
    accelerator = Accelerator(
        cpu=args.cpu, mixed_precision=args.mixed_precision, gradient_accumulation_steps=gradient_accumulation_steps
    )
    lr = config["lr"]
    num_epochs = int(config["num_epochs"])
    seed = int(config["seed"])
    batch_size = int(config["batch_size"])

    metric = _GlueMrpc()

    set_seed(seed)
    train_dataloader, eval_dataloader = get_dataloaders(accelerator, batch_size)
    model = AutoModelForSequenceClassification.from_pretrained(model_checkpoint, return_dict=True)
    model = model.to(accelerator.device)
    optimizer = AdamW(params=model.parameters(), lr=lr)
    lr_scheduler = get_linear_schedule_with_warmup(
        optimizer=optimizer,
        num_warmup_steps=100,
        num_training_steps=(len(train_dataloader) * num_epochs),
    )
    model, optimizer, train_dataloader, eval_dataloader, lr_scheduler = accelerator.prepare(
        model, optimizer, train_dataloader, eval_dataloader, lr_scheduler
    )

    for epoch in range(num_epochs):
        model.train()
        with LocalSGD(
            accelerator=accelerator, model=model, local_sgd_steps=local_sgd_steps, enabled=local_sgd_steps is not None
        ) as local_sgd:
            for step, batch in enumerate(train_dataloader):
                batch.to(accelerator.device)
                with accelerator.accumulate(model):
                    output = model(**batch)
                    loss = output.loss
                    accelerator.backward(loss)
                    optimizer.step()
                    lr_scheduler.step()
                    optimizer.zero_grad()
                    local_sgd.step()

        model.eval()
        for step, batch in enumerate(eval_dataloader):
            batch.to(accelerator.device)
            with torch.no_grad():
                outputs = model(**batch)
            predictions = outputs.logits.argmax(dim=-1)
            predictions, references = accelerator.gather_for_metrics((predictions, batch["labels"]))
            metric.add_batch(
                predictions=predictions,
                references=references,
            )

        eval_metric = metric.compute()
        accelerator.print(f"epoch {epoch}:", eval_metric)
        # added: each rank's weights after the epoch's last average, to the last digit
        weights = sum(p.double().sum() for p in model.parameters()).item()
        accelerator.print(gather_object([f"weights {weights!r}"]))
    accelerator.end_training()

config = {"lr": 2e-2, "num_epochs": 2, "seed": 42, "batch_size": 8}
args = argparse.Namespace(cpu=False, mixed_precision=None, gradient_accumulation_steps=1, local_sgd_steps=2)
"""


def test_accelerates_local_sgd_example_runs_with_the_import_swapped(kernel):
    # nbaccel had no nbaccel.local_sgd: the example's import failed.
    setup = kernel.execute(LOCAL_SGD)
    assert setup.error is None, setup.error_text
    imports = "from LIB.local_sgd import LocalSGD"
    run = ("training_function", "(config, args)")
    theirs = _launch(kernel, "accelerate", *run, imports=imports)
    ours = _launch(kernel, "nbaccel", *run, imports=imports)
    assert ours == theirs
    weights = re.findall(r"\['weights (.*)', 'weights (.*)'\]", ours)
    assert len(weights) == 2 and all(a == b for a, b in weights)  # averaged: ranks agree
