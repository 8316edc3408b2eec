"""Nothing lost when a rank dies: a launch restarted after SIGKILLs resumes from its checkpoints
and ends on the very weights of an uninterrupted run.

The training function is written as an Accelerate user writes it (automatic checkpoint naming,
a step counter registered for checkpointing, ``save_state()`` every few steps), plus nbaccel's
one line, ``accelerator.resume()``. Its ranks read which attempt they are in from
``TORCHELASTIC_RESTART_COUNT``, as torch elastic's workers do, and kill themselves (SIGKILL, as
the OOM killer does) at planned steps of planned attempts, one of them inside ``save_state``.
Each rank records its pid and start time, and every one recorded is checked gone, system-wide.
"""

from __future__ import annotations

import json
import re
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from tests.kernel_helpers import KernelSession, text_view_kernel
from tests.test_cli_support import run_cli

# One module: the kernel's cell and the script run the same function.
TRAINING = textwrap.dedent('''
    import os, pathlib, signal, time
    import torch

    class StepCounter:
        """The step a run is at; saved by save_state. A planned kill can strike inside it."""

        def __init__(self, kill_in_save):
            self.step, self.kill_in_save = 0, kill_in_save

        def state_dict(self):
            restart = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
            if [restart, self.step] == self.kill_in_save:
                os.kill(os.getpid(), signal.SIGKILL)  # midway through save_state
            return {"step": self.step}

        def load_state_dict(self, state):
            self.step = state["step"]

    def train(project, kills, kill_in_save, steps=24):
        """``kills``: {restart: [rank, step]}; ``kill_in_save``: [restart, step] (rank 0)."""
        from nbaccel import Accelerator
        from nbaccel.utils import ProjectConfiguration, set_seed

        restart = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
        pids = pathlib.Path(project, "pids")
        pids.mkdir(parents=True, exist_ok=True)
        me = os.getpid()
        (pids / f"{me}").write_text(repr(psutil_start(me)))
        config = ProjectConfiguration(project, automatic_checkpoint_naming=True)
        accelerator = Accelerator(cpu=True, project_config=config)
        set_seed(0, device_specific=True)  # each rank its own data, restored on resume
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
        set_seed(0, device_specific=True)
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
        model, optimizer = accelerator.prepare(model, optimizer)
        counter = StepCounter(kill_in_save)
        accelerator.register_for_checkpointing(counter)
        resumed = accelerator.resume()  # the one line: None on a first run
        kill = kills.get(str(restart))
        while counter.step < steps:
            x = torch.randn(16, 6)
            loss = (model(x) - x.sum(1, keepdim=True).sin()).pow(2).mean()
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            counter.step += 1
            if counter.step % 5 == 0:
                accelerator.save_state()
            if kill == [accelerator.process_index, counter.step]:
                os.kill(os.getpid(), signal.SIGKILL)
        weights = accelerator.unwrap_model(model).state_dict()
        return {
            "weights": {k: v.tolist() for k, v in weights.items()},
            "restart": restart,
            "max_restarts": os.environ.get("TORCHELASTIC_MAX_RESTARTS"),
            "resumed": resumed and os.path.basename(resumed),
            "checkpoints": sorted(os.listdir(os.path.join(project, "checkpoints"))),
        }

    def psutil_start(pid):
        import psutil
        return psutil.Process(pid).create_time()
''')

# Attempt 0: rank 1 dies at step 7 (checkpoint_0, step 5, is saved). Attempt 1 resumes from
# checkpoint_0 and dies inside its save at step 10 (a partial checkpoint_1). Attempt 2 resumes
# from checkpoint_0 again, saves checkpoint_1, dies at 13. Attempt 3 resumes from checkpoint_1,
# saves checkpoint_2 and 3, dies at 22. Attempt 4 resumes from checkpoint_3 and finishes.
CHECKPOINTS = ["checkpoint_0", "checkpoint_1", "checkpoint_2", "checkpoint_3"]
KILLS = {"0": [1, 7], "2": [1, 13], "3": [0, 22]}
KILL_IN_SAVE = [1, 10]
RESTARTS = 4
FINAL = {
    "restart": 4,
    "max_restarts": "4",
    "resumed": "checkpoint_3",
    "checkpoints": CHECKPOINTS,
}


def assert_no_rank_left(project: Path) -> None:
    """Every rank any attempt started (pid and start time it recorded) is gone, system-wide."""
    deadline = time.monotonic() + 5
    while True:
        left = []
        for record in (project / "pids").iterdir():
            try:
                process = psutil.Process(int(record.name))
                same = abs(process.create_time() - float(record.read_text())) < 0.01
                if same and process.status() != psutil.STATUS_ZOMBIE:
                    left.append((process.pid, process.cmdline()))
            except psutil.NoSuchProcess:
                pass
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert not left, f"ranks still running after the launch: {left}"


@pytest.fixture(scope="module")
def kernel():
    yield from text_view_kernel(startup=f"import nbaccel, json\n{TRAINING}")


def launch_cell(project: Path, kills: dict, kill_in_save: list, restarts: int) -> str:
    return (
        f"out = nbaccel.notebook_launcher(train, args=({str(project)!r}, {kills!r}, "
        f"{kill_in_save!r}), num_processes=2, max_restarts={restarts})\n"
        "print('RESULT', json.dumps(out))"
    )


def result_of(text: str) -> dict:
    line = next(line for line in text.splitlines() if line.startswith("RESULT "))
    return json.loads(line[len("RESULT ") :])


@pytest.mark.slow
def test_ranks_killed_at_four_steps_resume_to_the_uninterrupted_weights(
    kernel: KernelSession, tmp_path: Path
) -> None:
    plain = kernel.execute(launch_cell(tmp_path / "plain", {}, [], 0), timeout=180)
    assert plain.error is None, plain.error_text
    killed = kernel.execute(
        launch_cell(tmp_path / "killed", KILLS, KILL_IN_SAVE, RESTARTS), timeout=300
    )
    assert killed.error is None, killed.error_text + killed.stderr
    ours, theirs = result_of(killed.stdout), result_of(plain.stdout)
    assert ours.pop("weights") == theirs.pop("weights")  # bit for bit: floats as JSON
    assert ours == FINAL
    assert theirs["restart"] == 0 and theirs["resumed"] is None
    # Each attempt's view says which it is; each restart says why, and which of how many.
    for attempt in range(1, RESTARTS + 2):
        assert f"attempt {attempt} of {RESTARTS + 1}" in killed.stdout
    for restart in range(1, RESTARTS + 1):  # (the kill inside save_state: either rank first)
        assert re.search(
            rf"rank \d failed \(it exited\); restarting all 2 ranks \(restart {restart} of 4\)",
            killed.stderr,
        )
    assert_no_rank_left(tmp_path / "killed")


SCRIPT = """
import json, sys
{training}
if __name__ == "__main__":
    out = train(sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3]))
    if os.environ["RANK"] == "0":
        pathlib.Path(sys.argv[1], "result.json").write_text(json.dumps(out))
"""


@pytest.mark.slow
def test_nbaccel_launch_restarts_resume_the_same_way(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT.format(training=TRAINING))
    project = tmp_path / "run"
    # One kill, inside save_state (a script's start costs seconds); torch elastic sets the
    # restart count itself.
    kills, kill_in_save = {}, [0, 10]
    done = run_cli(
        "launch", "--num_processes", "2", "--max_restarts", "1", str(script), str(project),
        json.dumps(kills), json.dumps(kill_in_save), cwd=tmp_path, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    # The worker's guard passes the SIGKILL on as the rank's end (it tried to set SIGKILL's
    # handler, an OSError, before)
    assert "OSError" not in done.stdout + done.stderr, done.stdout
    out = json.loads((project / "result.json").read_text())
    assert (out["restart"], out["max_restarts"], out["resumed"]) == (1, "1", "checkpoint_0")
    assert out["checkpoints"] == CHECKPOINTS
    assert_no_rank_left(project)


def test_resume_loads_the_newest_whole_checkpoint_and_numbers_the_next_after_it(tmp_path):
    import torch

    from nbaccel import Accelerator
    from nbaccel.utils import ProjectConfiguration

    def accelerator() -> tuple[Accelerator, torch.nn.Module]:
        config = ProjectConfiguration(str(tmp_path), automatic_checkpoint_naming=True)
        acc = Accelerator(cpu=True, project_config=config)
        return acc, acc.prepare(torch.nn.Linear(2, 1))

    first, model = accelerator()
    assert first.resume() is None  # a first run: nothing to load, nothing raised
    for value in (1.0, 2.0):
        torch.nn.init.constant_(model.weight, value)
        first.save_state()
    # A save killed midway leaves its staging folder only: never a checkpoint to resume from.
    (tmp_path / "checkpoints" / ".checkpoint_2.partial").mkdir()
    second, model = accelerator()
    assert second.resume() == str(tmp_path / "checkpoints" / "checkpoint_1")
    assert model.weight.eq(2.0).all()
    assert second.save_iteration == 2
    assert second.save_state().endswith("checkpoint_2")
    # Accelerate's load_state leaves the counter to the script (side by side elsewhere), and
    # its refusal to overwrite points at resume().
    third, _ = accelerator()
    third.load_state()
    with pytest.raises(ValueError, match=r"checkpoint_0 already exists.*accelerator\.resume\(\)"):
        third.save_state()
