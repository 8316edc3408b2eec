"""Accelerate's ``examples/by_feature/checkpointing.py``, ported by changing the import.

The original fine-tunes BERT on GLUE MRPC; here a synthetic sentence-pair task of the same shape
(token ids in, 2 classes out) stands in for the download. Checkpoints every N steps or every
epoch with ``save_state``, resumes with ``load_state`` + ``skip_first_batches``.

    nbaccel launch --num_processes 2 examples/checkpointing.py --checkpointing_steps epoch
    nbaccel launch --num_processes 2 examples/checkpointing.py --resume_from_checkpoint out/epoch_0

or in a notebook: ``notebook_launcher(training_function, (config, args), num_processes=2)``.
"""

import argparse
import os

import torch
from torch.optim import AdamW
from torch.utils.data import DataLoader, TensorDataset

from nbaccel import Accelerator  # was: from accelerate import Accelerator
from nbaccel.utils import set_seed  # was: from accelerate.utils import set_seed

VOCAB, SEQ_LEN, TRAIN, EVAL = 100, 16, 128, 40


def get_dataloaders(accelerator, batch_size=16):
    """MRPC-shaped data: input_ids [N, SEQ_LEN], labels 0/1 (label = a token pattern)."""
    g = torch.Generator().manual_seed(1234)
    with accelerator.main_process_first():
        ids = torch.randint(0, VOCAB, (TRAIN + EVAL, SEQ_LEN), generator=g)
        labels = (ids[:, 0] > ids[:, 1]).long()
    train = TensorDataset(ids[:TRAIN], labels[:TRAIN])
    evaluation = TensorDataset(ids[TRAIN:], labels[TRAIN:])
    train_dl = DataLoader(train, shuffle=True, batch_size=batch_size, drop_last=True)
    eval_dl = DataLoader(evaluation, shuffle=False, batch_size=batch_size)
    return train_dl, eval_dl


class PairClassifier(torch.nn.Module):
    """A stand-in for BertForSequenceClassification: embeddings, pooling, a classifier."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, 32)
        self.head = torch.nn.Sequential(
            torch.nn.Linear(32 * 2, 32), torch.nn.ReLU(), torch.nn.Linear(32, 2)
        )

    def forward(self, input_ids, labels=None):
        e = self.embed(input_ids)
        logits = self.head(torch.cat([e[:, 0], e[:, 1]], dim=-1))
        loss = torch.nn.functional.cross_entropy(logits, labels) if labels is not None else None
        return loss, logits


def training_function(config, args):
    accelerator = Accelerator(cpu=args.cpu, mixed_precision=args.mixed_precision)
    checkpointing_steps = args.checkpointing_steps
    if checkpointing_steps is not None and checkpointing_steps.isdigit():
        checkpointing_steps = int(checkpointing_steps)
    lr, num_epochs = config["lr"], int(config["num_epochs"])
    set_seed(int(config["seed"]))
    train_dataloader, eval_dataloader = get_dataloaders(accelerator, int(config["batch_size"]))
    model = PairClassifier()
    optimizer = AdamW(params=model.parameters(), lr=lr)
    lr_scheduler = torch.optim.lr_scheduler.LinearLR(
        optimizer, start_factor=1.0, end_factor=0.1, total_iters=len(train_dataloader) * num_epochs
    )
    model, optimizer, train_dataloader, eval_dataloader, lr_scheduler = accelerator.prepare(
        model, optimizer, train_dataloader, eval_dataloader, lr_scheduler
    )
    overall_step = 0
    starting_epoch = 0
    resume_step = None
    if args.resume_from_checkpoint:
        accelerator.print(f"Resumed from checkpoint: {args.resume_from_checkpoint}")
        accelerator.load_state(args.resume_from_checkpoint)
        path = os.path.basename(args.resume_from_checkpoint)
        training_difference = os.path.splitext(path)[0]
        if "epoch" in training_difference:
            starting_epoch = int(training_difference.replace("epoch_", "")) + 1
            resume_step = None
        else:
            resume_step = int(training_difference.replace("step_", ""))
            starting_epoch = resume_step // len(train_dataloader)
            resume_step -= starting_epoch * len(train_dataloader)
        overall_step = starting_epoch * len(train_dataloader) + (resume_step or 0)

    accuracy = None
    for epoch in range(starting_epoch, num_epochs):
        model.train()
        if args.resume_from_checkpoint and epoch == starting_epoch and resume_step is not None:
            # We need to skip steps until we reach the resumed step
            active_dataloader = accelerator.skip_first_batches(train_dataloader, resume_step)
        else:
            active_dataloader = train_dataloader
        for input_ids, labels in active_dataloader:
            loss, _ = model(input_ids, labels)
            accelerator.backward(loss)
            optimizer.step()
            lr_scheduler.step()
            optimizer.zero_grad()
            overall_step += 1
            if isinstance(checkpointing_steps, int) and overall_step % checkpointing_steps == 0:
                output_dir = os.path.join(args.output_dir, f"step_{overall_step}")
                accelerator.save_state(output_dir)

        model.eval()
        correct = total = 0
        for input_ids, labels in eval_dataloader:
            with torch.no_grad():
                _, logits = model(input_ids)
            predictions, references = accelerator.gather_for_metrics(
                (logits.argmax(dim=-1), labels)
            )
            correct += (predictions == references).sum().item()
            total += references.numel()
        accuracy = correct / total
        accelerator.print(f"epoch {epoch}: accuracy {accuracy:.3f} over {total} samples")
        if checkpointing_steps == "epoch":
            accelerator.save_state(os.path.join(args.output_dir, f"epoch_{epoch}"))
    accelerator.end_training()
    return {
        "accuracy": accuracy,
        "steps": overall_step,
        "weights": accelerator.get_state_dict(model),
    }


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description="Simple example of training script.")
    parser.add_argument(
        "--mixed_precision", type=str, default=None, choices=["no", "fp16", "bf16", "fp8"]
    )
    parser.add_argument("--cpu", action="store_true", help="If passed, will train on the CPU.")
    parser.add_argument("--checkpointing_steps", type=str, default=None)
    parser.add_argument("--output_dir", type=str, default=".")
    parser.add_argument("--resume_from_checkpoint", type=str, default=None)
    parser.add_argument("--num_epochs", type=int, default=3)
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    config = {"lr": 2e-3, "num_epochs": args.num_epochs, "seed": 42, "batch_size": 16}
    return training_function(config, args)


if __name__ == "__main__":
    main()
