"""Replacing the weight files of a ``save_model`` folder all at once, in a folder the user
shares with other files (a ``config.json``, a README), which stay.

The new files are written into ``.nbaccel-save.partial/`` inside the folder; renaming it to
``.nbaccel-save.ready/`` (with the list of its files) is the commit point. Then the previous
save's weight files (both formats, sharded or not, and their index) are removed and the new
ones moved in. A failure before the commit point leaves the previous files untouched (the next
save removes the partial folder); a kill after it is finished by the next save
(:func:`roll_forward`), and until then :func:`current_files` gives readers the new files.

>>> import tempfile
>>> from pathlib import Path
>>> folder = Path(tempfile.mkdtemp())
>>> staged = stage(folder)
>>> _ = (staged / "model.safetensors").write_bytes(b"new")
>>> commit(folder, ["model.safetensors"])
>>> sorted(current_files(folder))
['model.safetensors']
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

PARTIAL, READY = ".nbaccel-save.partial", ".nbaccel-save.ready"
_MANIFEST = ".files"  # in READY: the names of the new save's files
# What a save_model writes, in either format; nothing else in the folder is touched.
_WEIGHT_FILE = re.compile(
    r"(model(-\d{5}-of-\d{5})?\.safetensors|pytorch_model(-\d{5}-of-\d{5})?\.bin)"
    r"|(model\.safetensors|pytorch_model\.bin)\.index\.json"
)


def is_weight_file(name: str) -> bool:
    """Whether ``name`` is one of the files a ``save_model`` writes (and the next replaces)."""
    return _WEIGHT_FILE.fullmatch(name) is not None


def stage(folder: Path) -> Path:
    """An empty folder inside ``folder`` to write a new save into, after finishing a swap a
    killed save committed and removing the partial files of one killed before that."""
    roll_forward(folder)
    staging = folder / PARTIAL
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    return staging


def discard(folder: Path) -> None:
    """Remove a staged save that failed; the previous files stay as they were."""
    shutil.rmtree(folder / PARTIAL, ignore_errors=True)


def commit(folder: Path, names: list[str]) -> None:
    """Swap the staged files ``names`` in for the previous save's (only the saving process)."""
    staging = folder / PARTIAL
    _write_synced(staging / _MANIFEST, json.dumps(names).encode())
    _fsync(staging)
    os.replace(staging, folder / READY)  # the commit point: from here on the new save counts
    _fsync(folder)
    roll_forward(folder)


def roll_forward(folder: Path) -> None:
    """Finish a committed swap; after a kill at any point of it, running it again finishes it."""
    ready = folder / READY
    if not ready.is_dir():
        return
    names = _manifest(ready)
    if names is not None:
        waiting = {p.name for p in ready.iterdir()}
        # Index files first: a reader never follows an old index to shards being removed.
        for path in sorted(folder.iterdir(), key=lambda p: not p.name.endswith(".json")):
            if is_weight_file(path.name) and (path.name not in names or path.name in waiting):
                path.unlink()  # the previous save's (a namesake of a new file not yet moved)
        for name in sorted(names, key=lambda n: n.endswith(".json")):  # the index last
            if name in waiting:
                os.replace(ready / name, folder / name)
        _fsync(folder)
        (ready / _MANIFEST).unlink()
    shutil.rmtree(ready)


def current_files(folder: Path) -> dict[str, Path]:
    """The weight files of the newest complete save in ``folder``, by name (read-only: every
    rank may call it while the saving process could still finish a swap)."""
    names = _manifest(folder / READY)
    if names is not None:
        return {
            n: folder / READY / n if (folder / READY / n).exists() else folder / n for n in names
        }
    return {p.name: p for p in folder.iterdir() if is_weight_file(p.name)}


def _manifest(ready: Path) -> list[str] | None:
    try:
        return json.loads((ready / _MANIFEST).read_text())
    except (FileNotFoundError, NotADirectoryError):
        return None


def _write_synced(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _fsync(folder: Path) -> None:
    """Make renames in ``folder`` durable (a power cut keeps the commit point)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:  # a platform without folder descriptors
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
