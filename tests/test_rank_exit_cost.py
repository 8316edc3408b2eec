"""What a rank runs as it leaves (``rank.exit.leave``): not the finalisers that only undo its
own state (torch.library's, 174 of them from the fork server's ``torch._dynamo``), but every
exit hook and finaliser of the user's. Real ranks; what they saw is written to files."""

from __future__ import annotations

import json

import pytest

import nbaccel

pytestmark = pytest.mark.slow  # real ranks


def _registers_exit_work(folder):
    import atexit
    import json
    import os
    import sys
    import weakref

    class Kept:
        pass

    kept = Kept()
    sys.modules["__kept_by_rank__"] = kept  # alive until exit: its finaliser runs at exit
    rank = os.environ["RANK"]

    def mark():
        with open(os.path.join(folder, f"finalized-{rank}"), "w") as f:
            f.write("yes")

    weakref.finalize(kept, mark)

    def look():  # runs before weakref's exit hook (registered long before this one)
        import torch.library

        registry = weakref.finalize._registry
        pending = [f.atexit for f, i in registry.items() if i.func is torch.library._del_library]
        with open(os.path.join(folder, f"seen-{rank}"), "w") as f:
            json.dump({"library": len(pending), "at_exit": sum(pending)}, f)

    atexit.register(look)
    return rank


def test_a_ranks_exit_skips_torch_librarys_finalisers_but_runs_the_users(tmp_path):
    assert (
        nbaccel.notebook_launcher(
            _registers_exit_work, args=(str(tmp_path),), num_processes=2, progress=False
        )
        == "0"
    )
    for rank in (0, 1):
        seen = json.loads((tmp_path / f"seen-{rank}").read_text())
        assert seen["library"] > 0 and seen["at_exit"] == 0, seen
        assert (tmp_path / f"finalized-{rank}").read_text() == "yes"
