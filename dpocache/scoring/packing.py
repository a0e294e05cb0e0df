"""Where pairs go in the packed layout: several pairs per row, each ``prompt + chosen +
rejected`` with its shared prompt (``dpocache.scoring.shared``), pairs block-diagonal in their row.

Two planners, pure functions of lengths (no tensors):

- ``place``: a training micro-batch's pairs into as few rows of a given width (its longest
  pair's) as first-fit decreasing finds.
- ``budget_batches``: the reference pass's pairs into rows of the token budget
  (``--cache.max_tokens``), one row per forward, first-fit decreasing over the whole data set.
"""

from __future__ import annotations

from typing import Callable, Sequence, TypeVar

T = TypeVar("T")


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def place(lengths: Sequence[int], width: int) -> list[tuple[int, int]]:
    """``(row, offset)`` of each item (in the order of ``lengths``), packed first fit into rows
    of ``width`` tokens, longest first."""
    if lengths and max(lengths) > width:
        raise ValueError(f"an item of {max(lengths)} tokens does not fit a row of {width}")
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    fills: list[int] = []  # tokens used in each row
    out: list[tuple[int, int]] = [(0, 0)] * len(lengths)
    for i in order:
        row = next((r for r, used in enumerate(fills) if used + lengths[i] <= width), len(fills))
        if row == len(fills):
            fills.append(0)
        out[i] = (row, fills[row])
        fills[row] += lengths[i]
    return out


def budget_batches(items: Sequence[T], max_tokens: int, length: Callable[[T], int],
                   max_items: int | None = None) -> list[list[T]]:
    """The reference pass's batches in the packed layout: each one row of at most
    ``max_tokens`` tokens, filled first fit, longest items first (an item longer than the
    budget gets a row of its own). Sorted by length, a row's gaps take the short items, so the
    rows run almost without padding."""
    fills: list[int] = []
    bins: list[list[T]] = []
    for item in sorted(items, key=length, reverse=True):
        n = length(item)
        row = next((r for r, used in enumerate(fills) if used + n <= max_tokens
                    and (max_items is None or len(bins[r]) < max_items)), len(fills))
        if row == len(fills):
            fills.append(0)
            bins.append([])
        fills[row] += n
        bins[row].append(item)
    return bins
