"""Accelerate's ``examples/by_feature/gradient_accumulation.py`` and ``early_stopping.py`` in one,
ported by changing the import.

Gradients accumulate over ``--gradient_accumulation_steps`` batches with
``accelerator.accumulate(model)``; training stops early on every rank when any rank's loss
falls below ``--loss_threshold`` (``set_trigger`` on that rank, ``check_trigger`` on all). The
synthetic MRPC-shaped task of ``checkpointing.py`` stands in for the GLUE download.

    nbaccel launch --num_processes 2 examples/early_stopping.py --gradient_accumulation_steps 2
"""

import argparse
import os
import sys

from torch.optim import AdamW

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from checkpointing import PairClassifier, get_dataloaders  # noqa: E402

from nbaccel import Accelerator  # noqa: E402  (was: from accelerate import Accelerator)
from nbaccel.utils import set_seed  # noqa: E402  (was: from accelerate.utils import set_seed)


class EarlyStoppingCallback:
    "A callback that will stop training when the loss falls below a threshold (as in Accelerate)"

    def __init__(self, threshold):
        self.threshold = threshold

    def check_early_stopping(self, loss):
        return loss < self.threshold


def training_function(config, args):
    accelerator = Accelerator(
        cpu=args.cpu,
        mixed_precision=args.mixed_precision,
        gradient_accumulation_steps=args.gradient_accumulation_steps,
    )
    set_seed(int(config["seed"]))
    train_dataloader, _ = get_dataloaders(accelerator, int(config["batch_size"]))
    model = PairClassifier()
    optimizer = AdamW(params=model.parameters(), lr=config["lr"])
    model, optimizer, train_dataloader = accelerator.prepare(model, optimizer, train_dataloader)
    callback = EarlyStoppingCallback(args.loss_threshold)
    optimizer_steps = micro_steps = 0
    stopped_at = None
    for epoch in range(int(config["num_epochs"])):
        model.train()
        for input_ids, labels in train_dataloader:
            # New code: accumulate gradients; the optimizer really steps every N batches
            with accelerator.accumulate(model):
                loss, _ = model(input_ids, labels)
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
            micro_steps += 1
            optimizer_steps += int(accelerator.sync_gradients)
            # New code: check if we should stop training on any process
            if callback.check_early_stopping(loss.item()):
                accelerator.set_trigger()
            # and on every process, break if any of them asked to
            if accelerator.check_trigger():
                stopped_at = (epoch, micro_steps)
                break
        if stopped_at is not None:
            break
    accelerator.print(
        f"optimizer steps {optimizer_steps}, micro-steps {micro_steps}, stopped {stopped_at}"
    )
    accelerator.end_training()
    return {
        "optimizer_steps": optimizer_steps,
        "micro_steps": micro_steps,
        "stopped_at": stopped_at,
    }


def main(argv=None):
    parser = argparse.ArgumentParser(description="Simple example of training script.")
    parser.add_argument(
        "--mixed_precision", type=str, default=None, choices=["no", "fp16", "bf16", "fp8"]
    )
    parser.add_argument("--cpu", action="store_true", help="If passed, will train on the CPU.")
    parser.add_argument("--gradient_accumulation_steps", type=int, default=1)
    parser.add_argument("--loss_threshold", type=float, default=0.0)
    parser.add_argument("--num_epochs", type=int, default=3)
    args = parser.parse_args(argv)
    config = {"lr": 2e-3, "num_epochs": args.num_epochs, "seed": 42, "batch_size": 16}
    return training_function(config, args)


if __name__ == "__main__":
    main()
