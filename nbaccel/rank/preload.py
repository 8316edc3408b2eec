"""Imported once by the fork server so every rank starts with torch's heavy modules loaded.

``import torch`` is about 1.5 s here, and the first optimizer step imports ``torch._dynamo`` and
sympy lazily (about 1.5 s more). Loaded in the server, ranks get them for free at fork. Nothing
here runs tensor code: thread pools started in the server would not survive the fork.
"""

import importlib
import signal

# Jupyter's interrupt and shutdown signal the kernel's whole process group, this server
# included; an interrupt that lands while it is still importing would kill it with a
# "Fatal Python error" on stderr. The server ignores SIGINT anyway once it serves, and ranks
# leave interrupts to the kernel.
signal.signal(signal.SIGINT, signal.SIG_IGN)

for _name in (
    "torch",
    "torch.distributed",
    "torch.nn.parallel",
    "torch.optim",
    "torch._dynamo",
    "cloudpickle",
    "nbaccel.rank.entry",
    "nbaccel.rank.reporting",
    "nbaccel.rank.tqdm_hook",
):
    try:
        importlib.import_module(_name)
    except Exception:  # noqa: BLE001 - a missing optional module only makes ranks slower
        pass
