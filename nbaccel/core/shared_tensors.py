"""Large tensors and numpy arrays cross between the kernel and the ranks through shared memory.

A launch's arguments are pickled once, as today, except that every CPU tensor or numpy array of at
least :data:`MIN_BYTES` is replaced by a reference into one shared-memory block; its bytes are
copied there once for all ranks, instead of being pickled into every rank's job. Results go the
other way: a rank puts the large tensors of its return value into a file in ``/dev/shm`` that the
kernel maps (no copy) and unlinks as it loads the value (``NBACCEL_SHM_DIR`` puts them
elsewhere); a full ``/dev/shm`` says so, with the bytes needed and what to do.

Semantics — a rank gets what a fork of the kernel gives it: its own copy-on-write view of each
argument. The block is a ``memfd`` mapped ``MAP_PRIVATE`` in every rank, so a rank that changes an
argument in place changes only its own pages; the kernel's tensor and the other ranks' copies stay
as they were. Views of one storage within one argument stay views of one storage in the rank.

Cleanup cannot leak: the argument block has no name (a ``memfd``, passed to the ranks as a file
descriptor the way multiprocessing passes pipes), so the memory goes when the last process holding
it exits, however it exits. Result files are named ``nbaccel-<kernel pid>-<launch>-...``; the
kernel unlinks them as it loads them, :func:`release` removes those of a launch whose results were
never loaded (a rank failed, the launch was interrupted), and each new launch removes those left
by kernels that died (:func:`sweep_stale`).

Example (what ``plan`` and the rank entry do)::

    packer = shared_tensors.Packer()
    arg_bytes = [packer.dumps(a) for a in args]
    transfer = packer.seal()                 # one block for all ranks; goes into every RankSpec
    ...                                      # in a rank: pickling.loads(arg_bytes[0])
    payload = shared_tensors.dumps_result(value, transfer, rank=0)
    shared_tensors.release(transfer)         # kernel, after the results were loaded
"""

from __future__ import annotations

import contextlib
import ctypes
import glob
import io
import mmap
import os
import secrets
import sys
import tempfile
import weakref
from typing import Any

from nbaccel.core import libc, pickling
from nbaccel.core.disk_space import OutOfSpaceError, is_out_of_space

MIN_BYTES = 256 * 1024  # smaller tensors pickle faster than a trip through shared memory
_ALIGN = 64
_PREFIX = "nbaccel-"
_fds: dict[str, int] = {}  # launch token -> argument block fd (kernel: its own; rank: received)


def shm_dir() -> str:
    """Where result files go: ``$NBACCEL_SHM_DIR`` when set, else ``/dev/shm`` (memory) where
    it exists, else the temp folder."""
    if os.environ.get("NBACCEL_SHM_DIR"):
        return os.environ["NBACCEL_SHM_DIR"]
    if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK):
        return "/dev/shm"
    return tempfile.gettempdir()


class Transfer:
    """One launch's shared-memory facts, carried in every RankSpec: the launch token (which names
    result files) and the argument block's file descriptor (``None`` when nothing was shared)."""

    def __init__(self, token: str, fd: int | None, size: int) -> None:
        self.token, self.fd, self.size = token, fd, size

    def __reduce__(self) -> tuple:
        # multiprocessing's DupFd sends the descriptor with the process it starts (fork server:
        # SCM_RIGHTS, spawn: its resource sharer), as it does for a rank's pipes.
        from multiprocessing.reduction import DupFd

        handle = None if self.fd is None else DupFd(self.fd)
        return (_attach, (self.token, handle, self.size))


def _attach(token: str, handle: Any, size: int) -> Transfer:
    fd = None if handle is None else handle.detach()
    if fd is not None:
        _fds[token] = fd
    return Transfer(token, fd, size)


class _SegmentRef:
    """Stands for one shared block in a pickle; pickled once, then referenced (pickle's memo)."""

    def __init__(self, opener: Any, arg: str) -> None:
        self.opener, self.arg = opener, arg

    def __reduce__(self) -> tuple:
        return (self.opener, (self.arg,))


class _Segment:
    """A mapped block on the loading side; tensors made from it keep the mapping alive."""

    def __init__(self, mm: Any) -> None:
        self.mm = mm
        self._bases: dict[int, Any] = {}

    def tensor_base(self, offset: int, nbytes: int) -> Any:
        import torch

        base = self._bases.get(offset)
        if base is None:  # tensors that shared a storage in the kernel share one here too
            base = torch.frombuffer(self.mm, dtype=torch.uint8, count=nbytes, offset=offset)
            self._bases[offset] = base
        return base


def _open_arguments(token: str) -> _Segment:
    fd = _fds.get(token)
    if fd is None:
        raise RuntimeError(
            f"the shared-memory block of this launch's arguments (launch {token}) did not reach "
            "this process; tensors in args/kwargs cannot be loaded here."
        )
    size = os.fstat(fd).st_size
    # Copy-on-write: this rank's writes stay in this rank, as after a fork.
    return _Segment(mmap.mmap(fd, size, flags=mmap.MAP_PRIVATE))


def _open_result(path: str) -> _Segment:
    try:
        fd = os.open(path, os.O_RDWR)
    except FileNotFoundError:
        raise RuntimeError(
            f"a tensor of a rank's result was in shared memory at {path}, which is gone "
            "(removed by a cleanup?); run the launch again."
        ) from None
    try:
        os.unlink(path)  # from now on only this mapping holds the memory
        return _Segment(_map_shared(fd, os.fstat(fd).st_size))
    finally:
        os.close(fd)


def _map_shared(fd: int, size: int) -> Any:
    """A writable buffer over ``fd``'s first ``size`` bytes (shared), unmapped when the last
    tensor or array made from it goes, that holds no file descriptor: ``mmap.mmap`` keeps a
    duplicate of ``fd`` for as long as it lives, so each result kept in the kernel held one
    (a long sweep of launches reached the 1,024 limit). Where the C library's ``mmap`` is not
    at hand, ``mmap.mmap`` it is."""
    c = libc.load()
    if c is None or size == 0:
        return mmap.mmap(fd, size)
    c.mmap.restype = ctypes.c_void_p
    c.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int]
    c.mmap.argtypes += [ctypes.c_int, ctypes.c_long]
    address = c.mmap(None, size, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED, fd, 0)
    if address in (None, ctypes.c_void_p(-1).value):
        errno = ctypes.get_errno()
        raise OSError(errno, f"mmap of a result's shared memory failed: {os.strerror(errno)}")
    array = (ctypes.c_char * size).from_address(address)
    # The array's views (torch and numpy keep the buffer they were made from) keep it, and it
    # keeps the finaliser's owner: the pages go with the last of them.
    array._unmap = weakref.finalize(array, _unmap, address, size)  # type: ignore[attr-defined]
    return memoryview(array).cast("B")


def _unmap(address: int, size: int) -> None:
    c = libc.load()
    c.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    c.munmap(ctypes.c_void_p(address), size)


def _rebuild_tensor(
    segment: _Segment,
    offset: int,
    nbytes: int,
    dtype: Any,
    size: tuple,
    stride: tuple,
    storage_offset: int,
    requires_grad: bool,
    parameter: bool,
) -> Any:
    import torch

    base = segment.tensor_base(offset, nbytes)
    tensor = base.view(dtype).as_strided(size, stride, storage_offset)
    if parameter:
        return torch.nn.Parameter(tensor, requires_grad=requires_grad)
    return tensor.requires_grad_(requires_grad) if requires_grad else tensor


def _rebuild_array(
    segment: _Segment, offset: int, dtype: Any, shape: tuple, order: str, nbytes: int
) -> Any:
    import numpy

    flat = numpy.frombuffer(segment.mm, dtype=numpy.uint8, count=nbytes, offset=offset)
    return flat.view(dtype).reshape(shape, order=order)


class _Pickler(pickling._Pickler):
    def __init__(self, file: Any, packer: Packer) -> None:
        # A launch's arguments go to the ranks; a rank's result comes back to the kernel.
        to_ranks = packer._result_path is None
        super().__init__(file, pickling.cloudpickle.DEFAULT_PROTOCOL, main_by_reference=to_ranks)
        self._packer = packer

    def reducer_override(self, obj: Any) -> Any:
        reduced = self._packer.place(obj)
        return reduced if reduced is not None else super().reducer_override(obj)


class Packer:
    """Pickles values, setting large tensors and arrays aside to copy into one shared block.

    ``result_name``: write the block to a named file (a rank's return value) instead of an
    anonymous ``memfd`` (a launch's arguments).
    """

    def __init__(self, token: str | None = None, result_name: str | None = None) -> None:
        self.token = token or f"{os.getpid()}-{secrets.token_hex(6)}"
        self._result_path = (
            None if result_name is None else os.path.join(shm_dir(), _PREFIX + result_name)
        )
        opener, arg = (
            (_open_arguments, self.token)
            if self._result_path is None
            else (_open_result, self._result_path)
        )
        self._ref = _SegmentRef(opener, arg)
        self._placed: dict[tuple[int, int], int] = {}  # (address, nbytes) -> offset
        self._copies: list[tuple[int, int, int, Any]] = []  # (offset, address, nbytes, keep)
        self._size = 0
        # Whichever of them the process has imported (None otherwise); never imported here.
        self._torch: Any = sys.modules.get("torch")
        self._numpy: Any = sys.modules.get("numpy")

    def dumps(self, value: Any) -> bytes:
        buffer = io.BytesIO()
        _Pickler(buffer, self).dump(value)
        return buffer.getvalue()

    def _reserve(self, key: tuple[int, int], nbytes: int, keep: Any) -> int:
        offset = self._placed.get(key)
        if offset is None:
            offset = self._size
            self._size = -(-(offset + nbytes) // _ALIGN) * _ALIGN
            self._placed[key] = offset
            self._copies.append((offset, key[0], nbytes, keep))
        return offset

    def place(self, obj: Any) -> tuple | None:
        """The reduction that puts ``obj`` in the block, or ``None`` to pickle it as usual."""
        torch, numpy = self._torch, self._numpy
        kind = type(obj)
        if torch is not None and (kind is torch.Tensor or kind is torch.nn.Parameter):
            return self._place_tensor(obj, kind is torch.nn.Parameter)
        if numpy is not None and kind is numpy.ndarray:
            return self._place_array(obj)
        return None

    def _place_tensor(self, t: Any, parameter: bool) -> tuple | None:
        if (
            t.device.type != "cpu"
            or t.layout is not self._torch.strided
            or t.is_quantized
            or t.is_conj()
            or t.is_neg()
            or (t.requires_grad and not t.is_leaf)
            or t.__dict__  # attributes set on the tensor: torch's own pickling keeps them
        ):
            return None
        storage = t.untyped_storage()
        nbytes = storage.nbytes()
        if nbytes < MIN_BYTES:
            return None
        offset = self._reserve((storage.data_ptr(), nbytes), nbytes, storage)
        args = (self._ref, offset, nbytes, t.dtype, tuple(t.shape), t.stride())
        return (_rebuild_tensor, (*args, t.storage_offset(), t.requires_grad, parameter))

    def _place_array(self, a: Any) -> tuple | None:
        if a.dtype.hasobject or a.nbytes < MIN_BYTES:
            return None
        order = "F" if a.flags.f_contiguous and not a.flags.c_contiguous else "C"
        if not (a.flags.c_contiguous or a.flags.f_contiguous):
            a = self._numpy.ascontiguousarray(a)  # a strided view travels as its values
        offset = self._reserve((a.ctypes.data, a.nbytes), a.nbytes, a)
        return (_rebuild_array, (self._ref, offset, a.dtype, a.shape, order, a.nbytes))

    def seal(self) -> Transfer:
        """Copy what was set aside into the block; the :class:`Transfer` for every RankSpec."""
        if self._result_path is not None:
            raise TypeError("seal() is for a launch's arguments; results use dumps_result().")
        if not self._copies:
            return Transfer(self.token, None, 0)
        fd = _anonymous_fd(self._size)
        try:
            self._fill(fd)
        except BaseException:
            os.close(fd)
            raise
        _fds[self.token] = fd
        transfer = Transfer(self.token, fd, self._size)
        weakref.finalize(transfer, _close, self.token)  # in case release() is never called
        return transfer

    def _write_result_file(self, rank: int) -> None:
        path = self._result_path
        if path is None:
            raise TypeError("A launch's arguments are sealed with seal(), not written as a result.")
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, self._size)
            self._fill(fd)
        except BaseException as exc:
            os.close(fd)
            os.unlink(path)  # before measuring what is free: the partial file held it
            if is_out_of_space(exc):
                folder = os.path.dirname(path)
                raise OutOfSpaceError(
                    f"rank {rank}'s return value",
                    path,
                    self._size,
                    f"Its tensors go to the kernel through shared memory in {folder}. Free space "
                    "there (in Docker, start the container with a larger --shm-size), return "
                    "less (save big tensors to a file and return its path), or set "
                    "NBACCEL_SHM_DIR to a folder with room.",
                ) from None
            raise
        os.close(fd)

    def _fill(self, fd: int) -> None:
        # pwrite copies straight into the shared pages: about twice as fast as faulting in a
        # fresh mapping and copying into it.
        for offset, address, nbytes, _keep in self._copies:
            view = memoryview((ctypes.c_char * nbytes).from_address(address)).cast("B")
            done = 0
            while done < nbytes:
                done += os.pwrite(fd, view[done:], offset + done)
        self._copies.clear()


def _anonymous_fd(size: int) -> int:
    if hasattr(os, "memfd_create"):
        fd = os.memfd_create("nbaccel-args", os.MFD_CLOEXEC)
    else:  # macOS: a file unlinked at once is just as nameless
        fd, path = tempfile.mkstemp(prefix=_PREFIX + "args-", dir=shm_dir())
        os.unlink(path)
    try:
        os.ftruncate(fd, size)
    except BaseException:
        os.close(fd)
        raise
    return fd


def dumps_result(value: Any, transfer: Transfer | None, rank: int) -> bytes:
    """Pickle a rank's return value; its large tensors go to a shared-memory file that the
    kernel maps when it loads the value (plain pickling without a ``transfer``)."""
    if transfer is None:
        return pickling.dumps(value)
    packer = Packer(result_name=f"{transfer.token}-r{rank}-{os.getpid()}")
    payload = packer.dumps(value)
    if packer._copies:
        packer._write_result_file(rank)
    return payload


def _close(token: str) -> None:
    fd = _fds.pop(token, None)
    if fd is not None:
        with contextlib.suppress(OSError):
            os.close(fd)


def release(transfer: Transfer | None) -> None:
    """Kernel, after a launch: drop its hold on the argument block and remove result files of
    this launch that were never loaded."""
    if transfer is None:
        return
    _close(transfer.token)
    transfer.fd = None
    for path in glob.glob(os.path.join(shm_dir(), f"{_PREFIX}{transfer.token}-*")):
        with contextlib.suppress(OSError):
            os.unlink(path)


def sweep_stale() -> list[str]:
    """Remove result files left by kernels that are gone (killed while ranks were sending
    results); returns what was removed."""
    removed = []
    uid = os.getuid() if hasattr(os, "getuid") else None
    for path in glob.glob(os.path.join(shm_dir(), _PREFIX + "*-*-r*")):
        try:
            pid = int(os.path.basename(path)[len(_PREFIX) :].split("-", 1)[0])
            if uid is not None and os.stat(path).st_uid != uid:
                continue
            os.kill(pid, 0)
        except ProcessLookupError:
            with contextlib.suppress(OSError):
                os.unlink(path)
                removed.append(path)
        except (ValueError, OSError):
            continue
    return removed
