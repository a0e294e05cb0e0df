"""One run per output directory: a run holds an exclusive ``flock`` on a file in its output
directory from before it looks at what is there until it ends.

Two runs started into one directory (a job array or a retried scheduler job reusing a run name)
would both pass the "holds an earlier run" check when they start within a second of each other,
then interleave their metrics rows and checkpoints. The second now stops at once with one line
naming the directory and the first run's process id. The kernel releases a ``flock`` when its
process dies, so a run killed with SIGKILL never leaves a stale lock. Under torchrun rank 0
holds it for the job.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

from dpocache.runtime.preflight import UsageError

LOCK_FILE = ".dpocache-run.lock"


class OutputDirLock:
    """The held lock of one output directory; ``release`` gives it back (once; closing the
    descriptor releases it, as the process's death does)."""

    def __init__(self, fd: int):
        self.fd: int | None = fd

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def check_output_dir_free(out: str | Path) -> None:
    """Raise the ``UsageError`` of ``hold_output_dir`` at once if another run holds ``out``,
    holding nothing: the command line asks before its slow imports, so a second run is refused in
    a moment (the run's own hold, in ``training.setup``, still decides). A shared lock, so that the
    ranks of one torchrun job, asking together, never refuse each other."""
    lock_file = Path(out) / LOCK_FILE
    if not lock_file.is_file():
        return
    fd = os.open(lock_file, os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0))
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        raise UsageError(_busy(Path(out), fd)) from None
    finally:
        os.close(fd)


def _busy(out: Path, fd: int) -> str:
    holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
    return (f"--output-dir {out}: another dpocache run (pid {holder}) is writing there; wait for it to end, or pass "
            "another --output-dir")


def hold_output_dir(out: str | Path) -> OutputDirLock:
    """Lock ``out`` (created if absent) for this process. Raises ``UsageError`` at once if
    another run holds it."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    fd = os.open(out / LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0), 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        message = _busy(out, fd)
        os.close(fd)
        raise UsageError(message) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return OutputDirLock(fd)
