"""An exclusive lock that dies with its process: `flock` on a file holding the holder's pid.

Used for a run's output directory (fail at once when busy) and for the CPU kernel's build directory (wait,
announced, bounded). The kernel releases an flock when its process exits however it exits, so a lock file
left behind by a killed process holds nothing.
"""

from __future__ import annotations

import fcntl
import os
import time
from pathlib import Path
from typing import Callable


class Busy(Exception):
    """Another process holds the lock; `pid` is what it wrote (None if unreadable)."""

    def __init__(self, path: Path, pid: str | None):
        super().__init__(f"{path} is held by pid {pid or '?'}")
        self.path, self.pid = path, pid


def acquire(path: Path, *, wait_s: float = 0.0, on_busy: Callable[[str | None], None] | None = None) -> int:
    """The fd of an exclusive flock on `path`, with our pid written in it. When another process holds it:
    `on_busy(holder pid)` once, then retry every 0.5 s until `wait_s` has passed, then raise `Busy`. A holder
    may remove the file before releasing it (`release`): the lock taken is always on the file on disk."""
    deadline, announced = time.monotonic() + wait_s, False
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 64, 0).decode(errors="replace").split()[:1]
            os.close(fd)
            pid = holder[0] if holder else None
            if time.monotonic() >= deadline:
                raise Busy(path, pid) from None
            if on_busy is not None and not announced:
                on_busy(pid)
                announced = True
            time.sleep(0.5)
            continue
        try:
            same = os.stat(path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if same:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
            return fd
        os.close(fd)


def release(fd: int, path: Path | None = None) -> None:
    """Release the lock; with `path`, remove the lock file first, while it is still held."""
    if path is not None:
        Path(path).unlink(missing_ok=True)
    os.close(fd)
