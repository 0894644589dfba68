"""Process-shared POSIX semaphores in a shared file: how the engine process of ``serve --workers N``
wakes a worker whose answer is in its slot (:mod:`dualtrack.serve.shared`), without a message.

Why not a socket or a pipe: the message path is what this bypasses. An answer sent as a message
waits for a thread of the engine process to wake, win the GIL, pickle and send it, then for the
worker's reader thread to wake and unpickle it (0.8-0.9 ms a request under load on the H200,
``hop_writer`` + ``hop_back``, docs/performance.md). ``sem_post`` is one futex call, made on the
thread that resolved the request, with the GIL kept. Why not :mod:`multiprocessing`'s semaphores:
those are made before the processes fork or travel by pickling to children; the workers here are
spawned by uvicorn's machinery and find the engine process by its socket, so they map a file.

glibc's ``sem_t`` through :mod:`ctypes`; :func:`available` is False where the C library has no
process-shared unnamed semaphores (then the caller keeps to messages).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
import time
from pathlib import Path

SEM_BYTES = 32  # sizeof(sem_t) on 64-bit glibc (x86_64, aarch64); each semaphore gets a 64-byte cell
_CELL = 64


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def _libraries() -> tuple[ctypes.CDLL, ctypes.PyDLL] | None:
    """libc twice: ``sem_timedwait`` lets the GIL go (it blocks); ``sem_post`` keeps it (it never
    blocks, and the thread that posts must not queue for the GIL again behind a dozen others)."""
    if os.uname().sysname != "Linux":
        return None
    for name in (ctypes.util.find_library("c"), ctypes.util.find_library("pthread")):
        if not name:
            continue
        try:
            waiting, holding = ctypes.CDLL(name, use_errno=True), ctypes.PyDLL(name, use_errno=True)
            for lib in (waiting, holding):
                for fn in ("sem_init", "sem_post", "sem_timedwait", "sem_trywait"):
                    getattr(lib, fn).restype = ctypes.c_int
            return waiting, holding
        except (OSError, AttributeError):
            continue
    return None


_LIBS = _libraries()


def map_file(path: Path, size: int, *, create: bool) -> mmap.mmap:
    """``path`` mapped shared, read-write, ``size`` bytes; with ``create``, a new file only its owner
    may open, its pages reserved now (on a full tmpfs a sparse file fails later, on first touch,
    with SIGBUS), removed again if they cannot be."""
    if create:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.posix_fallocate(fd, 0, size)
        except OSError:
            os.close(fd)
            path.unlink()
            raise
    else:
        fd = os.open(path, os.O_RDWR)
    try:
        return mmap.mmap(fd, size)
    finally:
        os.close(fd)


def post_function() -> int:
    """The address of the C library's ``sem_post`` (a C function of one pointer argument): what
    ``Engine.signal`` has the CUDA driver's thread call, with :meth:`SemaphoreFile.address`, so that
    the GPU itself wakes a worker. 0 where :func:`available` is False."""
    if _LIBS is None:
        return 0
    return int(ctypes.cast(_LIBS[1].sem_post, ctypes.c_void_p).value or 0)


def available() -> bool:
    """Whether this platform's C library gives process-shared semaphores (glibc on Linux)."""
    return _LIBS is not None


class SemaphoreFile:
    """``count`` semaphores in the file at ``path``, mapped in this process. The process that
    creates the file (``create=True``) initialises them (value 0). Nobody destroys them: a worker
    may still wait on one when the engine process closes, and glibc's ``sem_destroy`` does nothing
    for these; unmapping the file is all the cleanup there is."""

    def __init__(self, path: Path, count: int, *, create: bool) -> None:
        if _LIBS is None:
            raise OSError("no process-shared semaphores in this C library")
        self._wait_lib, self._post_lib = _LIBS
        self.path, self.count = path, count
        size = max(1, count) * _CELL
        self._map = map_file(path, size, create=create)
        self._cells = (ctypes.c_char * size).from_buffer(self._map)
        self._base = ctypes.addressof(self._cells)
        if create:
            for i in range(count):
                if self._post_lib.sem_init(ctypes.c_void_p(self.address(i)), 1, 0) != 0:
                    err = ctypes.get_errno()
                    self.close()
                    raise OSError(err, f"sem_init: {os.strerror(err)}")

    def address(self, index: int) -> int:
        """Where semaphore ``index`` lies in this process (valid until :meth:`close`)."""
        if not 0 <= index < self.count:
            raise IndexError(f"semaphore {index} of {self.count}")
        return self._base + index * _CELL

    def post(self, index: int) -> None:
        """Wake whoever waits on semaphore ``index`` (or the next wait); keeps the GIL."""
        self._post_lib.sem_post(ctypes.c_void_p(self.address(index)))

    def wait(self, index: int, timeout: float) -> bool:
        """Wait up to ``timeout`` s for semaphore ``index`` (the GIL is let go meanwhile); True if
        it was posted, False on the timeout or a signal."""
        deadline = time.time() + timeout  # sem_timedwait's clock is CLOCK_REALTIME
        spec = _Timespec(int(deadline), int((deadline % 1) * 1e9))
        return self._wait_lib.sem_timedwait(ctypes.c_void_p(self.address(index)), ctypes.byref(spec)) == 0

    def drain(self, index: int) -> int:
        """Take every post semaphore ``index`` holds now, without waiting; how many (keeps the GIL)."""
        address = ctypes.c_void_p(self.address(index))
        taken = 0
        while self._post_lib.sem_trywait(address) == 0:
            taken += 1
        return taken

    def close(self) -> None:
        """Unmap the file (in this process; the others keep their mappings)."""
        if self._map.closed:
            return
        del self._cells
        self._map.close()
