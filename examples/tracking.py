"""Accelerate's ``examples/by_feature/tracking.py``, ported by changing the import.

The original fine-tunes BERT on GLUE MRPC and logs to every installed tracker; here the
synthetic MRPC-shaped task of ``checkpointing.py`` stands in for the download. Trackers whose
package is missing are skipped with a warning; TensorBoard writes under ``<project_dir>/``.

    nbaccel launch --num_processes 2 examples/tracking.py --with_tracking --project_dir runs
"""

import argparse
import os
import sys

import torch
from torch.optim import AdamW

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from checkpointing import PairClassifier, get_dataloaders  # noqa: E402

from nbaccel import Accelerator  # noqa: E402  (was: from accelerate import Accelerator)
from nbaccel.utils import set_seed  # noqa: E402  (was: from accelerate.utils import set_seed)


def training_function(config, args):
    # Initialize accelerator; log_with="all" picks every tracker installed here.
    if args.with_tracking:
        accelerator = Accelerator(
            cpu=args.cpu,
            mixed_precision=args.mixed_precision,
            log_with="all",
            project_dir=args.project_dir,
        )
    else:
        accelerator = Accelerator(cpu=args.cpu, mixed_precision=args.mixed_precision)
    lr, num_epochs = config["lr"], int(config["num_epochs"])
    set_seed(int(config["seed"]))
    train_dataloader, eval_dataloader = get_dataloaders(accelerator, int(config["batch_size"]))
    model = PairClassifier()
    optimizer = AdamW(params=model.parameters(), lr=lr)
    model, optimizer, train_dataloader, eval_dataloader = accelerator.prepare(
        model, optimizer, train_dataloader, eval_dataloader
    )
    # New Code #
    # We need to initialize the trackers we use. Overall configurations can also be stored
    if args.with_tracking:
        run = os.path.split(__file__)[-1].split(".")[0]
        accelerator.init_trackers(run, config)

    accuracy = None
    for epoch in range(num_epochs):
        model.train()
        total_loss = 0
        for input_ids, labels in train_dataloader:
            loss, _ = model(input_ids, labels)
            if args.with_tracking:
                total_loss += loss.detach().float()
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()

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
        accelerator.print(f"epoch {epoch}: accuracy {accuracy:.3f}")

        # New Code #
        # To actually log, we call `Accelerator.log`; the values can be a dictionary of numbers.
        if args.with_tracking:
            accelerator.log(
                {
                    "accuracy": accuracy,
                    "train_loss": total_loss.item() / len(train_dataloader),
                    "epoch": epoch,
                },
                step=epoch,
            )

    # New Code #
    # When a run is finished, you should call `accelerator.end_training()` to close all trackers
    if args.with_tracking:
        accelerator.end_training()
    return {"accuracy": accuracy}


def main(argv=None):
    parser = argparse.ArgumentParser(description="Simple example of training script.")
    parser.add_argument(
        "--mixed_precision", type=str, default=None, choices=["no", "fp16", "bf16", "fp8"]
    )
    parser.add_argument("--cpu", action="store_true", help="If passed, will train on the CPU.")
    parser.add_argument(
        "--with_tracking", action="store_true", help="Log to every installed tracker."
    )
    parser.add_argument("--project_dir", type=str, default="logs", help="Where trackers write.")
    parser.add_argument("--num_epochs", type=int, default=3)
    args = parser.parse_args(argv)
    config = {"lr": 2e-3, "num_epochs": args.num_epochs, "seed": 42, "batch_size": 16}
    return training_function(config, args)


if __name__ == "__main__":
    main()
