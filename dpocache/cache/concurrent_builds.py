"""Builds running at once on one cache namespace split the work instead of repeating it.

Two ``cache build``s (or trainings building what their cache lacks) started together on one
cache directory would otherwise go through the same pairs in the same order, each computing
everything the other computes. Instead each build cuts its batches into ``CHUNKS`` chunks and
claims a chunk before scoring it: an exclusive ``flock`` on ``.builds/claim-<chunk>.lock`` in
the namespace directory (the chunk named by its pairs' keys, so builds of the same pairs name
the same chunks), which the kernel releases when its process dies, however it dies. A chunk
another build holds is left for the end, when this build waits for it and then scores only
what the other did not write. While others run, a build flushes what it computed at the end of
each chunk (before releasing the claim); it reads what the others flushed before and after each
chunk, and skips the pairs they hold.

Each build also holds a numbered slot (``.builds/slot-<k>.lock``) and starts at its own place
in its chunks (slot 0 at the start, 1 at the middle, 2 and 3 at the quarters, ...), so builds
started together claim different chunks from the first one on. The claims are only a saving:
the values are the same whoever computes them, and a shard is named by its content.

Builds on a CPU also share its threads: each runs on its share of the threads it started with
(``torch.get_num_threads``) while others run, and on all of them again once it runs alone. Two
builds each running every core's threads wait on each other's; sharing them, two builds at
once end about when one alone would (measured in docs/cache.md).

    with shared_build(store.dir, stop) as shared:
        for chunk in shared.chunks(batches):   # each claimed while the loop body runs
            shared.exchange(writer, store)
            ...                                 # score the chunk's batches
            shared.exchange(writer, store)
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Iterator, Sequence

import torch

if TYPE_CHECKING:
    from dpocache.cache.store import CacheStore, ShardWriter
    from dpocache.data.pairs import TokenizedPair
    from dpocache.runtime.signals import StopRequest

BUILDS_DIR = ".builds"
CHUNKS = 64  # per build: at 270k pairs about one default shard (4,096 pairs) each
MAX_SLOTS = 256  # past them a build starts where slot 0 does (the claims still split the work)
WAIT_POLL_S = 0.2  # how often a build waiting for another's chunk looks again (and at a stop signal)

Batch = Sequence["TokenizedPair"]


NO_LOCK = -1  # a lock file this process cannot open (a directory another user made): go on without


def _try_lock(path: Path) -> int | None:
    """An open descriptor of ``path`` holding its exclusive lock; None where another holds it;
    ``NO_LOCK`` where the file cannot be opened (the build goes on as if it held it: waiting for
    a lock it can never take would stop it for good)."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError:
        return NO_LOCK
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    return fd


class SharedBuild:
    """This build's place among the builds running at once in one namespace directory:
    ``slot`` (0 when alone, or when the directory cannot hold the lock files: then it runs as if
    alone), its claims, and what it says of the others."""

    def __init__(self, directory: Path | None, slot: int, stop: StopRequest | None = None,
                 cpu_threads: int | None = None) -> None:
        self.directory = directory  # the namespace's .builds; None: not shared
        self.slot = slot
        self.stop = stop
        self.cpu_threads = cpu_threads  # the threads a build on a CPU started with; None: not on a CPU

    def others_running(self) -> int:
        """How many other builds hold a slot in this namespace."""
        if self.directory is None:
            return 0
        try:
            names = [n for n in os.listdir(self.directory) if n.startswith("slot-") and n != f"slot-{self.slot}.lock"]
        except OSError:
            return 0
        running = 0
        for name in names:
            fd = _try_lock(self.directory / name)
            if fd is None:
                running += 1
            else:
                _release(fd)  # free: this probe held it a moment
        return running

    def exchange(self, writer: ShardWriter, store: CacheStore) -> None:
        """While other builds run, flush what this one computed (for them to skip); read what
        others flushed (for this one to skip), also where the last has just ended; on a CPU,
        take this build's share of the threads."""
        if self.directory is None:
            return
        others = self.others_running()
        if others:
            writer.flush()
        store.refresh()
        self.share_threads(others + 1)

    def share_threads(self, builds: int) -> None:
        """On a CPU, run on this build's share of its threads among ``builds`` running."""
        if self.cpu_threads is not None:
            threads = max(1, self.cpu_threads // builds)
            if torch.get_num_threads() != threads:
                torch.set_num_threads(threads)

    def chunks(self, batches: Sequence[Batch]) -> Iterator[list[Batch]]:
        """``batches`` in chunks, each claimed while the caller works on it: from this slot's
        place round to it, those no other build holds; then those it held, each once the other
        has let it go. Ends early at a stop signal."""
        if self.directory is None:
            yield list(batches)
            return
        count = min(CHUNKS, len(batches))
        bounds = [len(batches) * i // count for i in range(count + 1)]
        parts = [list(batches[lo:hi]) for lo, hi in zip(bounds, bounds[1:])]
        parts = starting_at(parts, self.slot)
        held = []
        for part in parts:
            fd = _try_lock(self._claim(part))
            if fd is None:
                held.append(part)
                continue
            with _released(fd):
                yield part
        for part in held:
            fd = self._wait_for(self._claim(part))
            if fd is None:
                return  # a stop signal
            with _released(fd):
                yield part

    def _claim(self, part: list[Batch]) -> Path:
        digest = hashlib.sha256(b"".join(p.key for batch in part for p in batch)).hexdigest()[:16]
        return self.directory / f"claim-{digest}.lock"

    def _wait_for(self, path: Path) -> int | None:
        """The claim ``path``, once the build holding it lets it go; None at a stop signal."""
        while not self.stop:
            fd = _try_lock(path)
            if fd is not None:
                return fd
            time.sleep(WAIT_POLL_S)
        return None

    def tidy(self) -> None:
        """Remove the claim files once no other build runs (a claim is only a saving: one a build
        starting just now loses costs it at most a chunk computed twice)."""
        if self.directory is None or self.others_running():
            return
        for path in self.directory.glob("claim-*.lock"):
            with contextlib.suppress(OSError):
                path.unlink()


@contextlib.contextmanager
def shared_build(namespace_dir: Path, stop: StopRequest | None = None, enabled: bool = True,
                 on_cpu: bool = False) -> Iterator[SharedBuild]:
    """This build's ``SharedBuild`` in ``namespace_dir``, its slot (the lowest no other build
    holds) held for the block. ``enabled`` False: a build that shares nothing (a rank of a
    distributed build scores a share no other rank scores). ``on_cpu``: the build shares the
    CPU's threads with the others, and has all it started with again after the block."""
    directory = Path(namespace_dir) / BUILDS_DIR
    try:
        if enabled:
            directory.mkdir(parents=True, exist_ok=True)
    except OSError:
        enabled = False
    if not enabled:
        yield SharedBuild(None, 0)
        return
    with _threads_kept(on_cpu) as threads:
        for slot in range(MAX_SLOTS):
            fd = _try_lock(directory / f"slot-{slot}.lock")
            if fd is not None:
                with _released(fd):
                    shared = SharedBuild(directory, slot, stop, threads)
                    yield shared
                    shared.tidy()
                return
        yield SharedBuild(directory, MAX_SLOTS, stop, threads)  # holds no slot file: every held one is another's


@contextlib.contextmanager
def _threads_kept(on_cpu: bool) -> Iterator[int | None]:
    """The threads torch runs on (None where ``on_cpu`` is False), set back after the block."""
    if not on_cpu:
        yield None
        return
    threads = torch.get_num_threads()
    try:
        yield threads
    finally:
        torch.set_num_threads(threads)


def _release(fd: int) -> None:
    if fd != NO_LOCK:
        os.close(fd)  # releases its lock


@contextlib.contextmanager
def _released(fd: int) -> Iterator[None]:
    try:
        yield
    finally:
        _release(fd)


def start_fraction(slot: int) -> float:
    """Where in the work slot ``slot`` starts, as a fraction: 0, 1/2, 1/4, 3/4, 1/8, ... (the
    bits of ``slot`` mirrored behind the point), so that each new build starts in the middle of
    the longest stretch the builds before it have not started on."""
    fraction, weight = 0.0, 0.5
    while slot:
        fraction += weight * (slot & 1)
        slot >>= 1
        weight /= 2
    return fraction


def start_index(count: int, slot: int) -> int:
    """The index among ``count`` items slot ``slot`` starts at."""
    return min(count - 1, round(start_fraction(slot) * count)) if count else 0


def starting_at(items: Sequence, slot: int) -> list:
    """``items`` from slot ``slot``'s starting place, going round to where it started."""
    start = start_index(len(items), slot)
    return [*items[start:], *items[:start]]
