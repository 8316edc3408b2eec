"""Reading checkpoint and model files back (``torch.load`` with ``weights_only=True``, and
safetensors), and, for a file that cannot be read, an error that names it and says what it
holds (empty, cut short, zeros, text, another format) instead of the library's internals
(``OSError: [Errno 22]``, ``KeyError: 101``, advice to pass ``weights_only=False``).

>>> import os, tempfile
>>> path = os.path.join(tempfile.mkdtemp(), "model_0.pt")
>>> with open(path, "w") as f:
...     _ = f.write("version https://git-lfs.github.com/spec/v1")
>>> describe(path)
"text: 'version https://git-lfs.github.com/spec/v1'"
"""

from __future__ import annotations

import json
import os
import pickle
import struct
import warnings
import zipfile
from pathlib import Path
from typing import Any

import torch

from nbaccel.core.disk_space import format_size

# Errors that already name the file and say what is wrong: left as they are.
_CLEAR = (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError)


class UnreadableFileError(ValueError):
    """A checkpoint or model file that cannot be read: its path and what it holds.

    Example::

        except UnreadableFileError as exc: print(exc.path)
    """

    def __init__(self, path: str | os.PathLike[str], kind: str) -> None:
        self.path = str(path)
        super().__init__(
            f"{self.path} cannot be read as a {kind}: it holds {describe(path)}. An interrupted "
            "save or copy, or another file put in its place, leaves such a file; copy it "
            "again, restore it from a backup, or save it again."
        )

    def __reduce__(self) -> tuple:  # rebuilt from its message in the kernel
        return (_rebuilt, (str(self), self.path))


def _rebuilt(message: str, path: str) -> UnreadableFileError:
    exc = ValueError.__new__(UnreadableFileError)
    ValueError.__init__(exc, message)
    exc.path = path
    return exc


def torch_load(path: str | os.PathLike[str], trusted_fallback: bool = False) -> Any:
    """``torch.load(path, weights_only=True)`` on the CPU. A whole file that holds other objects
    is loaded with ``weights_only=False`` (with a warning) when ``trusted_fallback``; a damaged
    one raises :class:`UnreadableFileError`.

    Example::

        state = torch_load("ckpt/model_0.pt")
    """
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except _CLEAR:
        raise
    except Exception as exc:
        if not (isinstance(exc, pickle.UnpicklingError) and _intact_torch_file(path)):
            raise UnreadableFileError(path, "torch checkpoint file") from exc
        if not trusted_fallback:
            raise
    warnings.warn(
        f"{path} holds objects other than tensors and plain containers, so it is loaded with "
        "weights_only=False; only load checkpoints you wrote yourself.",
        stacklevel=3,
    )
    return torch.load(path, map_location="cpu", weights_only=False)


def torch_load_with_numpy(path: str | os.PathLike[str]) -> Any:
    """:func:`torch_load` of a file that may hold NumPy arrays too (a NumPy generator's state in
    ``random_states_<i>.pkl``): arrays are plain numbers, so ``weights_only`` may rebuild them.

    Example::

        states = torch_load_with_numpy("ckpt/random_states_0.pkl")
    """
    try:
        import numpy as np
    except ImportError:
        return torch_load(path)
    import codecs

    multiarray = getattr(np, "_core", None) or np.core  # NumPy 2 renamed it
    multiarray = multiarray.multiarray
    arrays: list[Any] = [multiarray._reconstruct, np.ndarray, np.dtype, codecs.encode]
    arrays += [type(np.dtype(kind)) for kind in ("uint32", "float64", "int64")]
    with torch.serialization.safe_globals(arrays):
        return torch_load(path)


def safetensors_load(path: str | os.PathLike[str]) -> tuple[dict[str, torch.Tensor], dict]:
    """The tensors of a safetensors file and its metadata, or :class:`UnreadableFileError`.

    Example::

        state, metadata = safetensors_load("out/model.safetensors")
    """
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            return {k: f.get_tensor(k) for k in f.keys()}, f.metadata() or {}  # noqa: SIM118
    except _CLEAR:
        raise
    except Exception as exc:
        raise UnreadableFileError(path, "safetensors file") from exc


def _intact_torch_file(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a whole torch archive (or legacy pickle): then a weights-only
    refusal is about its contents, not damage."""
    try:
        with zipfile.ZipFile(path) as archive:
            return any(name.endswith("/data.pkl") for name in archive.namelist())
    except (zipfile.BadZipFile, OSError):
        pass
    with open(path, "rb") as f:
        head = f.read(2)
    return len(head) == 2 and head[0] == 0x80 and 2 <= head[1] <= 5


def describe(path: str | os.PathLike[str]) -> str:
    """What ``path`` holds, in a few words: its format as far as it can be told, and whether
    it is whole.

    Example::

        describe("ckpt/model_0.pt")   # 'a zip archive (torch's format) cut short: 918 bytes ...'
    """
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(256)
    if size == 0:
        return "nothing (0 bytes)"
    if head.startswith(b"PK\x03\x04"):
        return _describe_zip(path, size)
    if len(head) > 8 and head[8:9] == b"{":
        return _describe_safetensors(path, size)
    if not head.strip(b"\0"):
        return f"only zero bytes ({format_size(size)}): space set aside but never written"
    if head[0] == 0x80 and 2 <= head[1] <= 5:
        return f"a pickle ({format_size(size)}) that does not load: cut short or damaged"
    try:
        text = head.decode("utf-8")
    except UnicodeDecodeError:
        return f"{format_size(size)} of data in no known format, starting {head[:8].hex(' ')}"
    return f"text: {text.splitlines()[0][:60]!r}" if text.strip() else "only whitespace"


def _describe_zip(path: Path, size: int) -> str:
    try:
        with zipfile.ZipFile(path) as archive:
            names = archive.namelist()
    except zipfile.BadZipFile:
        return f"a zip archive (torch's format) cut short: {format_size(size)}, its end missing"
    if not any(name.endswith("/data.pkl") for name in names):
        return f"a zip archive that is not a torch checkpoint ({', '.join(names[:3])}, ...)"
    return f"a torch.save archive ({format_size(size)})"


def _describe_safetensors(path: Path, size: int) -> str:
    with open(path, "rb") as f:
        (header_size,) = struct.unpack("<Q", f.read(8))
        header = f.read(min(header_size, 100_000_000))
    try:
        entries = json.loads(header)
        end = (
            8
            + header_size
            + max(
                (e["data_offsets"][1] for k, e in entries.items() if k != "__metadata__"), default=0
            )
        )
    except (ValueError, KeyError, TypeError, IndexError):
        return f"the start of a safetensors file ({format_size(size)}) with its header cut short"
    if end > size:
        return f"a safetensors file cut short: {size} of its {end} bytes"
    return f"a safetensors file ({format_size(size)})"
