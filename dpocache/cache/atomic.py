"""File access for the cache: crash-safe writes and reads that refuse anything but a regular file.

Writes go to a temp file in the same directory, fsync, rename, fsync the directory: a reader
sees either the old file or the new one, never a torn one, whenever the process or the machine
stops. Files are created with mode 0666 less the process's umask, like any other file the user
writes, so a cache shared through group or world permissions is readable by its other users
(``tempfile.mkstemp`` would make every file 0600).

Reads never follow a symbolic link, never block on a FIFO and never open a device: a cache
directory is a place other people and programs can write to, and a link to ``/dev/zero`` or a
FIFO named like a shard must cost one line of error, not all memory or a hang.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import secrets
import shutil
import stat
import time
from pathlib import Path
from typing import Iterator


class UnsafeFileError(OSError):
    """A file the cache refuses to read: not a regular file, or larger than allowed."""


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    """``data`` as the whole of ``path`` (``atomic_output``)."""
    with atomic_output(path) as tmp, open(tmp, "wb") as f:
        f.write(data)


def atomic_write_text(path: str | Path, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


@contextlib.contextmanager
def atomic_output(path: str | Path) -> Iterator[Path]:
    """A new temp file next to ``path`` for a writer that takes a file name (pyarrow,
    safetensors) or streams rows; when the block ends cleanly it is fsynced and renamed over
    ``path``, else removed: ``path`` is the old file or the whole new one, never a torn or empty one."""
    path = Path(path)
    fd, tmp = _create_temp(path)
    os.close(fd)
    try:
        yield tmp
        _fsync_file(tmp)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    _fsync_dir(path.parent)


@contextlib.contextmanager
def atomic_output_dir(path: str | Path) -> Iterator[Path]:
    """``atomic_output`` for a writer that makes a directory (``datasets``' ``save_to_disk``): a
    new temp directory next to ``path``; when the block ends cleanly its files are fsynced and it
    takes the place of ``path`` (an old directory there is moved aside, then removed), else it is
    removed. ``path`` is never a partly written directory."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(6)}.tmp")
    tmp.mkdir()
    try:
        yield tmp
        for file in sorted(p for p in tmp.rglob("*") if p.is_file()):
            _fsync_file(file)
        old = None
        if path.exists():
            old = path.with_name(f".{path.name}.{secrets.token_hex(6)}.old")
            os.rename(path, old)
        os.rename(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _fsync_dir(path.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# The names _create_temp and atomic_output_dir give: "." + the final name + 12 hex digits.
TEMP_NAME = re.compile(r"\.[^/]+\.[0-9a-f]{12}\.(tmp|old)")


def remove_stale_temps(directory: str | Path, older_than_s: float) -> int:
    """Remove this module's temp files and directories in ``directory`` last modified more than
    ``older_than_s`` ago: those of a writer killed mid-write (SIGKILL, a lost machine), which no
    reader ever opens but which hold their space. A live writer's temp file is seconds old.
    Returns how many were removed."""
    directory = Path(directory)
    if not directory.is_dir():
        return 0
    removed, now = 0, time.time()
    for entry in os.scandir(directory):
        if not TEMP_NAME.fullmatch(entry.name):
            continue
        try:
            if now - entry.stat(follow_symlinks=False).st_mtime <= older_than_s:
                continue
            if entry.is_dir(follow_symlinks=False):
                shutil.rmtree(entry.path)
            else:
                os.unlink(entry.path)
            removed += 1
        except FileNotFoundError:  # another build removed it first
            continue
    return removed


def umask() -> int:
    """The process's umask, read where Linux tells it (``os.umask`` can only read it by setting it)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o077)
    os.umask(mask)
    return mask


def as_umask_allows(path: Path) -> None:
    """Give the safetensors files at ``path`` (a file, or every one under a directory) mode 0666
    less the umask, as every other file a run writes: safetensors' ``save_file`` (and so
    ``save_pretrained``) creates them 0600 whatever the umask, so a model trained on shared
    storage was unreadable to the team beside its readable config and tokenizer."""
    files = [path] if path.is_file() else path.rglob("*.safetensors")
    mode = 0o666 & ~umask()
    for file in files:
        os.chmod(file, mode)


def _create_temp(path: Path) -> tuple[int, Path]:
    """A new, exclusive temp file next to ``path``, mode 0666 less the umask (the kernel applies it)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
    for _ in range(100):
        tmp = path.with_name(f".{path.name}.{secrets.token_hex(6)}.tmp")
        try:
            return os.open(tmp, flags, 0o666), tmp
        except FileExistsError:
            continue
    raise FileExistsError(f"{path.parent}: could not create a temp file for {path.name}")


def _describe(mode: int) -> str:
    kinds = ((stat.S_ISLNK, "a symbolic link"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
             (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR, "a directory"))
    return next((name for test, name in kinds if test(mode)), "not a regular file")


def file_stamp(st: os.stat_result) -> dict:
    """What changes when a file is written or replaced: its size, times and inode (the ctime
    too, which no one can put back as ``touch -r`` puts back the mtime)."""
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "ctime_ns": st.st_ctime_ns, "inode": st.st_ino}


def read_regular_file_head(path: str | Path, max_bytes: int, head_bytes: int) -> tuple[bytes, dict]:
    """The first ``head_bytes`` of ``path``, with ``read_regular_file``'s checks on the whole
    file, and the file's ``file_stamp`` as read."""
    return read_regular_file(path, max_bytes, head_bytes, with_stamp=True)


def read_regular_file(path: str | Path, max_bytes: int, head_bytes: int | None = None,
                      with_stamp: bool = False):
    """The whole content of ``path`` if it is a regular file (or a symbolic link to one: the
    trees of DVC, git-annex and ``cp -rs``) of at most ``max_bytes`` bytes.

    Raises ``UnsafeFileError`` (naming what the path is) for a FIFO, device, socket or
    directory, or a link to one, or a file over the limit, without reading it;
    ``FileNotFoundError`` if it does not exist (or a link's target does not). ``stat`` decides
    before anything is opened (opening a device can have effects), and ``fstat`` of the
    descriptor opened ``O_NONBLOCK`` (``O_NOFOLLOW`` where the path was no link) confirms that
    it is still the same file."""
    path = Path(path)
    st = os.lstat(path)
    link = stat.S_ISLNK(st.st_mode)
    if link:
        st = os.stat(path)  # its target's
    if not stat.S_ISREG(st.st_mode):
        raise UnsafeFileError(f"{'a symbolic link to ' if link else ''}{_describe(st.st_mode)}, not a regular file")
    if st.st_size > max_bytes:
        raise UnsafeFileError(f"{st.st_size} bytes, more than the {max_bytes} a cache file may have")
    no_follow = 0 if link else os.O_NOFOLLOW
    try:
        fd = os.open(path, os.O_RDONLY | no_follow | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        if os.path.islink(path):  # replaced by a link between lstat and open (ELOOP)
            raise UnsafeFileError("a symbolic link, not a regular file") from e
        raise
    with os.fdopen(fd, "rb") as f:
        now = os.fstat(f.fileno())
        if not stat.S_ISREG(now.st_mode) or (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino):
            raise UnsafeFileError("replaced while being opened")
        if now.st_size > max_bytes:
            raise UnsafeFileError(f"{now.st_size} bytes, more than the {max_bytes} a cache file may have")
        data = f.read(now.st_size if head_bytes is None else min(head_bytes, now.st_size))
        return (data, file_stamp(now)) if with_stamp else data


@contextlib.contextmanager
def locked(lock_path: str | Path) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``lock_path`` (created empty if absent) for the block.

    ``flock`` excludes every other open of the file, in this process or another (Linux NFS
    clients map it onto POSIX locks, so a shared cache directory on NFS is covered too)."""
    flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
    if os.path.islink(lock_path):  # a ``cp -rs`` copy's link to another cache's lock: this one gets its own
        os.unlink(lock_path)
    try:
        fd = os.open(lock_path, flags, 0o666)
    except PermissionError:
        fd = os.open(lock_path, os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0))  # another user's lock file
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return  # not supported on this platform / file system
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
