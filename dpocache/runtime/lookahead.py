"""A loop's next item prepared on a background thread while the loop works on the current one.

``ahead(items, prepare)`` yields ``(item, prepare(item))`` in order, ``prepare`` of the next
item running on one background thread meanwhile. The reference pass lays out its next batch
this way (``dpocache.cache.build``): on a GPU the host's collation then overlaps the device's
forward instead of leaving the GPU idle between batches. ``prepare`` must be pure host work
(it runs on another thread); an exception it raises comes out of the loop at that item.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Iterable, Iterator, TypeVar

T = TypeVar("T")
R = TypeVar("R")


def ahead(items: Iterable[T], prepare: Callable[[T], R], background: bool = True) -> Iterator[tuple[T, R]]:
    """``(item, prepare(item))`` for each of ``items``; with ``background``, ``prepare`` of the
    next item runs on a thread while the caller holds this one. A caller that stops early (a
    ``break``, a signal) drops the one prepared ahead; nothing else is left running."""
    if not background:
        for item in items:
            yield item, prepare(item)
        return
    pool = ThreadPoolExecutor(1, thread_name_prefix="dpocache-lookahead")
    try:
        iterator = iter(items)
        current = next(iterator, _END)
        pending = pool.submit(prepare, current) if current is not _END else None
        while current is not _END:
            following = next(iterator, _END)
            ready = pending.result()
            pending = pool.submit(prepare, following) if following is not _END else None
            yield current, ready
            current = following
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


_END = object()
