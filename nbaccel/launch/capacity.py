"""How many processes a launch can start on this machine, checked before anything starts.

Both launchers (``notebook_launcher``/``%ranks`` through ``launch.plan``, and ``nbaccel
launch``) call :func:`check_process_count`, so an impossible count is one clear error instead of
ranks that start and then fail with ``Too many open files`` deep in a relay. What a launch needs:

* open files in the launching process: each rank's four pipes, its sentinel and start-up
  connection (about 6 measured in a notebook kernel; counted as 8);
* open files in each rank: a gloo mesh holds a socket per peer and rank 0's store a
  connection per rank (2 per rank of the world);
* tasks (processes and threads, what ``pid_max``, ``threads-max`` and ``RLIMIT_NPROC`` count):
  a rank runs several threads (counted as 4);
* for CPU ranks, cores: beyond :data:`CPU_RANKS_PER_CORE` ranks a core they mostly wait for
  each other. ``NBACCEL_MAX_CPU_PROCESSES=N`` in the environment allows up to N anyway.

>>> check_process_count(2, 2, on_cpu=True)  # any machine holds two ranks
"""

from __future__ import annotations

import os

LAUNCHER_FDS_PER_RANK = 8
RANK_FDS_PER_RANK = 2
FD_MARGIN = 64  # what a process opens besides (its own streams, libraries, a kernel's sockets)
TASKS_PER_RANK = 4
CPU_RANKS_PER_CORE = 16
ENV_MAX_CPU_PROCESSES = "NBACCEL_MAX_CPU_PROCESSES"


def _open_files() -> int:
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:  # not Linux: count none, the margin covers a typical process
        return 0


def _file_limit() -> tuple[int, int] | None:
    try:
        import resource
    except ImportError:  # Windows
        return None
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    return (soft, hard) if soft != resource.RLIM_INFINITY else None


def _task_room() -> tuple[int, str] | None:
    """How many more tasks may start here, and which limit says so, where Linux tells.

    The machine's (``pid_max``, ``threads-max``) less every task running now; the user's
    ``RLIMIT_NPROC`` whole (their own tasks are not counted: other users' must not refuse a
    launch), except for root, who is not held to it."""
    rooms = []
    try:
        with open("/proc/loadavg") as f:
            running = int(f.read().split()[3].split("/")[1])  # "1/345": every task now
        for path in ("/proc/sys/kernel/pid_max", "/proc/sys/kernel/threads-max"):
            with open(path) as f:
                rooms.append(
                    (int(f.read()) - running, f"{os.path.basename(path)}, {running} running")
                )
    except (OSError, ValueError, IndexError):
        pass
    try:
        import resource

        soft = resource.getrlimit(resource.RLIMIT_NPROC)[0]
        if soft != resource.RLIM_INFINITY and os.geteuid() != 0:
            rooms.append((soft, "`ulimit -u`"))
    except (ImportError, AttributeError):
        pass
    return min(rooms) if rooms else None


def _cpu_cap() -> tuple[int, bool]:
    """The most CPU ranks allowed, and whether the user set it."""
    given = os.environ.get(ENV_MAX_CPU_PROCESSES, "").strip()
    if given.isdigit():
        return int(given), True
    return CPU_RANKS_PER_CORE * (os.cpu_count() or 1), False


def check_process_count(
    nprocs: int, world_size: int, on_cpu: bool, name: str = "num_processes"
) -> None:
    """Raise ``ValueError`` naming the limit and what to do when this machine cannot hold
    ``nprocs`` local ranks of a ``world_size``-rank launch (``name``: the setting's name)."""
    cap, chosen = _cpu_cap()
    if on_cpu and nprocs > cap:
        cores = os.cpu_count() or 1
        why = (
            f"{ENV_MAX_CPU_PROCESSES}={cap} allows {cap}"
            if chosen
            else f"beyond {CPU_RANKS_PER_CORE} a core ({cap}) ranks mostly wait for each other"
        )
        raise ValueError(
            f"{name}={nprocs} CPU processes on {cores} core{'s' if cores > 1 else ''}: {why}. "
            f"Start at most {cap}, or set {ENV_MAX_CPU_PROCESSES}={nprocs} in the environment "
            "to start them anyway."
        )
    files = _file_limit()
    if files is not None:
        soft, hard = files
        opened = _open_files()
        need = max(
            opened + LAUNCHER_FDS_PER_RANK * nprocs + FD_MARGIN,
            RANK_FDS_PER_RANK * world_size + FD_MARGIN,
        )
        if need > soft:
            fits = min(
                (soft - opened - FD_MARGIN) // LAUNCHER_FDS_PER_RANK,
                (soft - FD_MARGIN) // RANK_FDS_PER_RANK - (world_size - nprocs),
            )
            tail = (
                f", or raise the limit before starting Jupyter or the script (`ulimit -n {need}`)"
                if need <= hard
                else f"; this user cannot raise the limit above {hard}"
            )
            raise ValueError(
                f"{name}={nprocs} needs about {need} open files per process, and the limit "
                f"here is {soft} (RLIMIT_NOFILE). Start fewer processes (about "
                f"{max(1, fits)} fit){tail}."
            )
    room = _task_room()
    if room is not None and TASKS_PER_RANK * nprocs > room[0]:
        raise ValueError(
            f"{name}={nprocs} needs about {TASKS_PER_RANK * nprocs} processes and threads, and "
            f"there is room for {max(0, room[0])} ({room[1]}). Start fewer processes."
        )
