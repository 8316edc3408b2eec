"""Imported once by the fork server so every rank starts with torch's heavy modules loaded.

``import torch`` is about 1.5 s here, and the first optimizer step imports ``torch._dynamo`` and
sympy lazily (about 1.5 s more). Loaded in the server, ranks get them for free at fork. Nothing
here runs tensor code: thread pools started in the server would not survive the fork.

The imports run with the cyclic garbage collector paused: with torch loaded, each full collection
walks some 200,000 objects while the imports make almost no garbage (``torch._dynamo`` imports in
0.6 s instead of 0.85 s here). What they leave is then frozen (``gc.freeze``): it lives as long as
the server, so the ranks' own collections skip it and leave its memory pages shared.
"""

import gc
import importlib
import os
import signal

# Jupyter's interrupt and shutdown signal the kernel's whole process group, this server
# included; an interrupt that lands while it is still importing would kill it with a
# "Fatal Python error" on stderr. The server ignores SIGINT anyway once it serves, and ranks
# leave interrupts to the kernel.
signal.signal(signal.SIGINT, signal.SIG_IGN)


def _say(name: str) -> None:
    """Write what is imported now into the ready marker (the kernel shows it while it waits)."""
    marker = os.environ.get("NBACCEL_SERVER_READY_FILE")
    if marker:
        try:
            with open(marker, "w", encoding="utf-8") as f:
                f.write(name)
        except OSError:
            pass


_collecting = gc.isenabled()
gc.disable()
try:
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
        _say(_name)
        try:
            importlib.import_module(_name)
        except Exception:  # noqa: BLE001 - a missing optional module only makes ranks slower
            pass
finally:
    gc.freeze()
    if _collecting:
        gc.enable()
