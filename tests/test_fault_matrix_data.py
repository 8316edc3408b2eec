"""The fault matrix's data side (see test_fault_matrix.py): in a real kernel, ranks saving onto
a full disk, returning a tensor into a full /dev/shm, killed while writing a checkpoint, and
loading a damaged one.

Every case asserts what the matrix asserts (the right error, nothing left running by pid, the
kernel launches again) and that no data was lost: the previous checkpoint loads, no partial
files stay, and the error names the path and what to do. A small tmpfs stands for the full disk
and, through ``NBACCEL_SHM_DIR``, for /dev/shm (the machine's own are never touched).
"""

from __future__ import annotations

import os
import re
import uuid
from contextlib import nullcontext
from pathlib import Path

import pytest

from tests.disk_helpers import hidden_leftovers, small_tmpfs
from tests.kernel_helpers import KernelSession
from tests.test_fault_matrix import WORKLOAD, assert_nothing_left

pytestmark = pytest.mark.slow

# Cells of the notebook: a rank saves or loads a checkpoint of a 1.2 MB model.
DATA_WORKLOAD = (
    WORKLOAD
    + '''
class Bomb:
    """Pickling this kills the rank, as an OOM kill mid-write would."""
    def __reduce__(self):
        os.kill(os.getpid(), signal.SIGKILL)

class Holder:
    def state_dict(self):
        return {"big": torch.zeros(10_000), "bomb": Bomb()}
    def load_state_dict(self, state):
        pass

def data_work(d, ckpt, how, value=0.0):
    _record(d, "rank", os.getpid())
    acc = nbaccel.Accelerator()
    model = torch.nn.Linear(300_000, 1, bias=False)
    torch.nn.init.constant_(model.weight, value)
    model, opt = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    if how == "load":
        acc.load_state(ckpt)
        return acc.unwrap_model(model).weight.unique().tolist()
    if how == "kill":
        acc.register_for_checkpointing(Holder())
    acc.save_state(ckpt)
    return "saved"

def data_launch(d, ckpt, how, value=0.0):
    return nbaccel.notebook_launcher(data_work, args=(d, ckpt, how, value), num_processes=2)

def big_result(d):
    _record(d, "rank", os.getpid())
    return torch.ones(1_000_000)
'''
)


@pytest.fixture(scope="module")
def kernel():
    with KernelSession(
        env={"NBACCEL_VIEW": "text"}, startup=DATA_WORKLOAD, background_shutdown=True
    ) as k:
        yield k


def launch(kernel, call: str, error: str | None = None) -> str:
    """Run ``call`` in the kernel; the failure's text when ``error`` (a pattern its headline
    starts with) is expected, else the value."""
    cell = kernel.execute(call)
    if error is None:
        assert cell.error is None, cell.error_text
        return cell.results[-1]["text/plain"]
    assert cell.error is not None, f"{call} should have failed"
    assert cell.error["ename"] == "RankFailedError", cell.error_text
    assert re.match(error, cell.error["evalue"]), cell.error_text
    assert "multiprocessing/" not in cell.error_text, cell.error_text
    return cell.error["evalue"]


def run_full_disk(kernel, d: str, ckpt: str) -> None:
    text = launch(
        kernel,
        f"data_launch({d!r}, {ckpt!r}, 'save', 2.0)",
        re.escape(
            "rank 0 (of 2) raised nbaccel.core.disk_space.OutOfSpaceError: save_state: no space "
            f"left to write {ckpt}: it needs about 1.2 MB"
        ),
    )
    assert "Free space on that disk, or pass another folder" in text, text


def run_killed_save(kernel, d: str, ckpt: str) -> None:
    launch(
        kernel,
        f"data_launch({d!r}, {ckpt!r}, 'kill', 2.0)",
        # Rank 1, waiting in save_state's barrier, sees the reset; its report often reaches the
        # relay before rank 0's death does, and the death that came first is still named.
        r"rank 0 \(of 2\) was killed by signal SIGKILL",
    )
    assert (Path(ckpt).parent / ".ckpt.partial").is_dir()  # until the next save


def run_corrupt_file(kernel, d: str, ckpt: str) -> None:
    model = Path(ckpt) / "optimizer.bin"
    model.write_bytes(model.read_bytes()[:1000])  # an interrupted copy
    launch(
        kernel,
        f"data_launch({d!r}, {ckpt!r}, 'load')",
        r"rank [01] \(of 2\) raised "  # both read it: either may report first
        + re.escape(
            f"nbaccel.training.file_reading.UnreadableFileError: {model} cannot be read as a "
            "torch checkpoint file: it holds a zip archive (torch's format) cut short"
        ),
    )


def run_full_shm(kernel, tmp_path: Path) -> None:
    with small_tmpfs(tmp_path / "shm", "1m") as shm:
        kernel.execute(f"os.environ['NBACCEL_SHM_DIR'] = {str(shm)!r}")
        try:
            text = launch(
                kernel,
                f"nbaccel.notebook_launcher(big_result, args=({str(tmp_path)!r},), "
                "num_processes=2)",
                re.escape(
                    "rank 0 (of 2) raised nbaccel.core.disk_space.OutOfSpaceError: rank 0's "
                    f"return value: no space left to write {shm}/nbaccel-"
                ),
            )
        finally:
            kernel.execute("os.environ.pop('NBACCEL_SHM_DIR', None)")
        assert "it needs about 4.0 MB" in text and "NBACCEL_SHM_DIR" in text, text
        assert os.listdir(shm) == []


SAVE_THEN = {
    "full_disk": run_full_disk,
    "killed_save": run_killed_save,
    "corrupt": run_corrupt_file,
}


@pytest.mark.parametrize("case", ["full_shm", *SAVE_THEN])
def test_data_fault(case, kernel, tmp_path):
    d = str(tmp_path)
    if case == "full_shm":
        run_full_shm(kernel, tmp_path)
    else:
        (tmp_path / "disk").mkdir()
        with small_tmpfs(tmp_path / "disk", "2m") if case == "full_disk" else nullcontext():
            ckpt = str(tmp_path / "disk" / "ckpt")
            assert launch(kernel, f"data_launch({d!r}, {ckpt!r}, 'save', 1.0)") == "'saved'"
            SAVE_THEN[case](kernel, d, ckpt)
            if case != "corrupt":  # the previous checkpoint loads
                assert launch(kernel, f"data_launch({d!r}, {ckpt!r}, 'load')") == "[1.0]"
            if case == "killed_save":  # the next save removes what the killed one left
                assert launch(kernel, f"data_launch({d!r}, {ckpt!r}, 'save', 3.0)") == "'saved'"
            assert hidden_leftovers(tmp_path / "disk") == []
    assert_nothing_left(tmp_path, marker=f"nbaccel-fault-{uuid.uuid4().hex}")  # by pid
    assert kernel.leftovers() == []
    assert launch(kernel, "nbaccel.notebook_launcher(seven, num_processes=2)") == "7"
