"""The order pairs are trained in: a seeded permutation per epoch, a pure function of (seed,
epoch), filled up to whole global batches."""

from __future__ import annotations

import functools
import random


def training_order(num_pairs: int, seed: int, epoch: int) -> list[int]:
    """The permutation of pair indices for ``epoch``: a pure function of (seed, epoch), so a
    resumed run replays the same order without storing it."""
    order = list(range(num_pairs))
    random.Random(seed * 1_000_003 + epoch).shuffle(order)
    return order


def steps_per_epoch(num_pairs: int, global_batch: int) -> int:
    """Optimizer steps that cover ``num_pairs`` once in batches of ``global_batch`` (the last one
    filled up: :func:`epoch_order`)."""
    return -(-num_pairs // global_batch)


# Each micro-batch reads its slice of the epoch's order: one shuffle per epoch, not one per
# micro-batch (100 ms at 270,000 pairs). Callers slice the list, never change it.
@functools.lru_cache(maxsize=2)
def epoch_order(num_pairs: int, seed: int, epoch: int, global_batch: int) -> list[int]:
    """:func:`training_order` filled up to whole global batches with the epoch's first pairs, as
    torch's ``DistributedSampler`` pads: every pair is trained on in every epoch and every step
    has a full batch (so W ranks with batch b still see what one rank with batch W*b sees).
    Dropping the remainder instead left up to ``global_batch - 1`` pairs untrained in every
    epoch. ``(steps_per_epoch * global_batch,)`` indices."""
    order = training_order(num_pairs, seed, epoch)
    missing = steps_per_epoch(num_pairs, global_batch) * global_batch - num_pairs
    return order + (order * (missing // num_pairs + 1))[:missing]
