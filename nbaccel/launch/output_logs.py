"""Every rank's full output on disk, whatever the views show of it: one folder per launch.

The views keep what a person reads live bounded (the last lines, lines cut at 64 KiB, a text
budget); these files keep every byte, ``rank0.stdout.log`` and ``rank0.stderr.log`` for each
rank, in ``$NBACCEL_LOG_DIR`` (default: ``~/.cache/nbaccel/logs``, else the temp folder). The
folder is made at a launch's first output byte, and the oldest folders beyond the newest
``KEEP`` are removed then; one file stops growing at ``FILE_LIMIT`` bytes with a last line
saying so. A file that cannot be written (a full disk) stops being written and never fails the
launch: ``LaunchState.log_problem`` says why, and the summary shows it.

>>> import tempfile, os
>>> os.environ["NBACCEL_LOG_DIR"] = tempfile.mkdtemp()
>>> from nbaccel.launch.state import LaunchState
>>> state = LaunchState(None, {})
>>> log = LaunchLogs(state).file(0, "stdout")
>>> log.write(b"hello\\n")
>>> open(log.path).read(), log.path == state.log_path(0, "stdout")
('hello\\n', True)
>>> del os.environ["NBACCEL_LOG_DIR"]
"""

from __future__ import annotations

import itertools
import os
import re
import shutil
import tempfile
import time

from nbaccel.launch.state import LaunchState

KEEP = 20  # launch folders kept (the newest by their files' modification time)
FILE_LIMIT = 1 << 30  # bytes one stream's file may reach
_launches = itertools.count(1)
_FOLDER = re.compile(r"^\d{8}-\d{6}-\d+-\d+$")  # only folders named so are ever removed


def logs_root() -> str:
    """Where the launch folders go: ``$NBACCEL_LOG_DIR``, else the user's cache folder."""
    forced = os.environ.get("NBACCEL_LOG_DIR")
    if forced:
        return forced
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(cache, "nbaccel", "logs")


class LaunchLogs:
    """The log files of one launch (or one ``%ranks`` session), made at the first byte; where
    they are (``state.log_folder``) and what went wrong (``state.log_problem``) go in ``state``
    for the views."""

    def __init__(self, state: LaunchState) -> None:
        self.state = state
        self._files: dict[tuple[int, str], RankLog] = {}

    def file(self, rank: int, stream: str) -> RankLog:
        """The log of ``rank``'s ``stream`` ("stdout" or "stderr")."""
        key = (rank, stream)
        if key not in self._files:
            self._files[key] = RankLog(self, rank, stream)
        return self._files[key]

    def made_folder(self) -> bool:
        """Make the launch's folder if it is not there yet; report whether there is one."""
        state = self.state
        if state.log_folder is None and not state.log_problem:
            name = f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}-{next(_launches)}"
            for root in (logs_root(), os.path.join(tempfile.gettempdir(), "nbaccel-logs")):
                try:
                    os.makedirs(os.path.join(root, name), mode=0o700)
                except OSError as exc:
                    state.log_problem = f"no log folder in {root} ({exc.strerror})"
                    continue
                state.log_folder, state.log_problem = os.path.join(root, name), ""
                prune(root, keep=KEEP, current=name)
                break
        return state.log_folder is not None


class RankLog:
    """One stream of one rank: appended as bytes arrive (opened per write, so a launch of many
    ranks holds no descriptors for its logs)."""

    def __init__(self, logs: LaunchLogs, rank: int, stream: str) -> None:
        self._logs, self._rank, self._stream = logs, rank, stream
        self.written = 0
        self.stopped = False

    @property
    def path(self) -> str | None:
        return self._logs.state.log_path(self._rank, self._stream)

    def write(self, data: bytes) -> None:
        if self.stopped or not data or not self._logs.made_folder():
            return
        room = FILE_LIMIT - self.written
        if len(data) > room:
            data = data[:room] + f"\n[nbaccel: log stopped at {FILE_LIMIT:,} bytes]\n".encode()
            self.stopped = True
        try:
            with open(self.path, "ab") as f:  # type: ignore[arg-type]  # folder exists
                f.write(data)
        except OSError as exc:
            self.stopped = True
            self._logs.state.log_problem = f"{self.path} stopped: {exc.strerror}"
        self.written += len(data)


def prune(root: str, keep: int, current: str) -> None:
    """Remove the launch folders in ``root`` beyond the newest ``keep`` (``current`` stays)."""
    try:
        names = [n for n in os.listdir(root) if n != current and _FOLDER.match(n)]
    except OSError:
        return

    def newest(name: str) -> float:
        folder = os.path.join(root, name)
        try:
            times = [os.stat(os.path.join(folder, f)).st_mtime for f in os.listdir(folder)]
            return max(times, default=os.stat(folder).st_mtime)
        except OSError:
            return 0.0

    for name in sorted(names, key=newest, reverse=True)[keep - 1 :]:
        shutil.rmtree(os.path.join(root, name), ignore_errors=True)
