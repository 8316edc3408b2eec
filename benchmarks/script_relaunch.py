"""Section "script": a plain Python script (no kernel) that imported transformers launches a
function that imports it too, once and then again and again, as a hyperparameter sweep does.

Each contender runs in a fresh ``python`` process of its own: ``from transformers import
Trainer``, the workload, the launcher, then ``1 + repeats`` launches of ``train_hf`` (section 9's
function: ``from transformers import Trainer`` in its body, then the plain-DDP ``train``), each
timed by the script's clock around the launcher call, and to the last rank's first optimizer
step. Repetitions are interleaved; the load average is recorded beside each script.

Accelerate's ranks are forks of the script, so they inherit transformers. nbaccel's come from a
fresh fork server; outside a kernel it imports the packages the launched function refers to
(once, before the first launch's ranks fork) and nothing else of the script's.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from typing import Any

from benchmarks import harness as H
from benchmarks.heavy_import import unavailable_reason
from benchmarks.workload import read_ranks

CONTENDERS = ("nbaccel", "accelerate")
IMPORT = {"nbaccel": "import nbaccel", "accelerate": "from accelerate import notebook_launcher"}
CALL = {
    "nbaccel": "nbaccel.notebook_launcher(train_hf, args=(cfg,), num_processes={world}, "
    "progress=False)",
    "accelerate": "notebook_launcher(train_hf, args=(cfg,), num_processes={world}, "
    "use_port=str(W.free_port()))",
}
SCRIPT = """
import json, sys, time
sys.path.insert(0, {root!r})
from transformers import Trainer
import benchmarks.workload as W
{launcher}

def train_hf(cfg):
    from transformers import Trainer  # noqa: F401 - what a Trainer notebook's function does
    return W.train(cfg)

if __name__ == "__main__":
    times = []
    for out_dir in {out_dirs!r}:
        cfg = {{"mode": "raw", "steps": {steps}, "warmup": 0, "out_dir": out_dir}}
        t0 = time.time()
        {call}
        times.append([t0, time.time()])
    print({mark!r} + json.dumps(times))
"""


def run_script(contender: str, launches: int, steps: int, world: int, scratch: H.Scratch):
    """One script: each launch's (whole call, to the last rank's first step) in seconds."""
    out_dirs = [scratch.new() for _ in range(launches)]
    code = SCRIPT.format(
        root=str(H.ROOT),
        launcher=IMPORT[contender],
        out_dirs=out_dirs,
        steps=steps,
        call=CALL[contender].format(world=world),
        mark=H.MARK,
    )
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=H.ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    marks = [line for line in done.stdout.splitlines() if line.startswith(H.MARK)]
    if done.returncode != 0 or not marks:
        raise RuntimeError(f"the script failed (exit {done.returncode}):\n{done.stderr[-2000:]}")
    out = []
    for (t0, t1), out_dir in zip(json.loads(marks[-1][len(H.MARK) :]), out_dirs):
        ranks = read_ranks(out_dir, world)
        if len(ranks) != world or any(r.get("first_step") is None for r in ranks.values()):
            raise RuntimeError(f"not every rank trained: {ranks}")
        out.append((t1 - t0, max(r["first_step"] for r in ranks.values()) - t0))
    return out


def run(reps: int, smoke: bool, world: int, scratch: H.Scratch) -> dict[str, Any]:
    steps, repeats = (3, 1) if smoke else (10, 4)
    contenders = [c for c in CONTENDERS if unavailable_reason(c) is None]
    kinds = ("first_call", "first_step", "repeat_call", "repeat_step", "load")
    raw: dict[str, dict[str, list]] = {
        c: {**{k: [] for k in kinds}, "errors": []} for c in CONTENDERS
    }
    for rep in range(1 if smoke else reps):
        for c in H.rotated(contenders, rep):
            load = H.load_now()
            try:
                launches = run_script(c, 1 + repeats, steps, world, scratch)
            except Exception as exc:  # noqa: BLE001 - one failed run is reported, not fatal
                raw[c]["errors"].append(f"{type(exc).__name__}: {str(exc)[-400:]}")
                continue
            (first_call, first_step), *again = launches
            raw[c]["first_call"].append(first_call)
            raw[c]["first_step"].append(first_step)
            raw[c]["repeat_call"] += [call for call, _ in again]
            raw[c]["repeat_step"] += [step for _, step in again]
            if load is not None:
                raw[c]["load"].append(load)
    out: dict[str, Any] = {
        "what": "seconds of each launcher call in a plain Python script that imported "
        "transformers, launching a function that imports it too: the first launch, then "
        f"{repeats} more in the same script",
        "contenders": {},
    }
    for c in CONTENDERS:
        if c not in contenders:
            out["contenders"][c] = {"unavailable": unavailable_reason(c)}
            continue
        out["contenders"][c] = {
            **{f"{k}_s": H.summary(raw[c][k]) for k in kinds if k != "load"},
            "load_1min": H.summary(raw[c]["load"], 2),
            "errors": raw[c]["errors"],
        }
    medians = {c: e.get("repeat_call_s", {}).get("median") for c, e in out["contenders"].items()}
    out["repeat_call_nbaccel_vs_accelerate"] = H.ratio(
        medians.get("nbaccel"), medians.get("accelerate")
    )
    return out
