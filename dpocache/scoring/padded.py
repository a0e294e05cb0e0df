"""Batches of preference pairs: token-budget, length-grouped batches for the reference pass,
fixed-size batches in a seeded order for training, and the padded pair layout both use.

Pair layout: a batch of B pairs becomes 2B right-padded rows, ``prompt + chosen`` in rows
``[0, B)`` and ``prompt + rejected`` in rows ``[B, 2B)``; ``completion_mask`` marks the
completion tokens, the only ones scored.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Sequence

import torch

from dpocache.data.pairs import TokenizedPair
from dpocache.data.values import PairValues
from dpocache.scoring import packing
from dpocache.scoring.layout_choice import PACKED, PADDED, SHARED
from dpocache.scoring.logprobs import CompletionLogProbs


@dataclass
class PairBatch:
    input_ids: torch.Tensor  # (2B, T)
    attention_mask: torch.Tensor  # (2B, T)
    completion_mask: torch.Tensor  # (2B, T)

    @property
    def num_pairs(self) -> int:
        return self.input_ids.shape[0] // 2

    def to(self, device) -> "PairBatch":
        return PairBatch(*(t.to(device, non_blocking=True)
                           for t in (self.input_ids, self.attention_mask, self.completion_mask)))


def pad_sequences(seqs: Sequence[tuple[Sequence[int], Sequence[int]]], pad_id: int = 0):
    """``N`` (prompt, completion) id lists → right-padded ``input_ids``, ``attention_mask`` and
    ``completion_mask``, each ``(N, T)`` long, T the longest prompt + completion."""
    width = max(len(a) + len(b) for a, b in seqs)
    n = len(seqs)
    input_ids = torch.full((n, width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((n, width), dtype=torch.long)
    completion_mask = torch.zeros((n, width), dtype=torch.long)
    for row, (prompt, completion) in enumerate(seqs):
        p, c = len(prompt), len(completion)
        input_ids[row, :p + c] = torch.tensor(list(prompt) + list(completion), dtype=torch.long)
        attention_mask[row, :p + c] = 1
        completion_mask[row, p:p + c] = 1
    return input_ids, attention_mask, completion_mask


def collate_pairs(pairs: Sequence[TokenizedPair], pad_id: int = 0) -> PairBatch:
    """Right-padded 2B-row layout of ``pairs`` (see the module docstring)."""
    seqs = [(p.prompt_ids, p.chosen_ids) for p in pairs] + [(p.prompt_ids, p.rejected_ids) for p in pairs]
    return PairBatch(*pad_sequences(seqs, pad_id))


def pair_logprobs(lp: CompletionLogProbs, batch: PairBatch,
                  pairs: Sequence[TokenizedPair] | None = None) -> PairValues:
    """Run ``lp`` on a pair batch and split the result into chosen and rejected halves; with
    ``pairs`` (those of ``batch``), the per-token values too, cut at host-known offsets (no
    device sync)."""
    token_logps = lp(batch.input_ids, batch.attention_mask, batch.completion_mask)  # (2B, T)
    sums = token_logps.sum(-1)  # (2B,)
    counts = batch.completion_mask.sum(-1)  # (2B,)
    b = batch.num_pairs
    values = PairValues(sums[:b], sums[b:], counts[:b], counts[b:])
    if pairs is None:
        return values
    # Row i's completion sits at [prompt length, prompt length + completion length).
    chosen = [token_logps[i, len(p.prompt_ids):len(p.prompt_ids) + len(p.chosen_ids)] for i, p in enumerate(pairs)]
    rejected = [token_logps[b + i, len(p.prompt_ids):len(p.prompt_ids) + len(p.rejected_ids)]
                for i, p in enumerate(pairs)]
    return PairValues(values.chosen_logps, values.rejected_logps, values.chosen_tokens, values.rejected_tokens,
                      chosen, rejected)


def _row_cost(layout: str):
    """(rows per pair, width of a pair's row) in ``layout``: the padded layout runs two rows of
    ``prompt + longer completion``; the shared-prompt layout (``dpocache.scoring.shared``) one row of
    ``prompt + chosen + rejected``."""
    if layout == SHARED:
        return 1, lambda p: p.unique_tokens
    return 2, lambda p: len(p.prompt_ids) + max(len(p.chosen_ids), len(p.rejected_ids))


def token_budget_batches(pairs: Sequence[TokenizedPair], max_tokens: int, layout: str = PADDED,
                         max_pairs: int | None = None) -> list[list[TokenizedPair]]:
    """Group pairs of similar length into batches whose padded size in ``layout`` (rows x
    longest row) stays under ``max_tokens``; in the packed layout, batches of rows filled by
    ``packing.budget_batches``.

    For inference only (the reference pass), where order does not matter: pairs are sorted
    longest first, so the largest batch runs first and an out-of-memory shows at once; sorted
    by length, the padding left is the difference between neighbouring lengths. A single pair
    larger than the budget gets a batch of its own.
    """
    if layout == PACKED:  # rows filled with the shortest pairs too (dpocache.scoring.packing)
        return packing.budget_batches(pairs, max_tokens, lambda p: p.unique_tokens, max_pairs)
    rows, width_of = _row_cost(layout)
    ordered = sorted(pairs, key=width_of, reverse=True)
    batches: list[list[TokenizedPair]] = []
    current: list[TokenizedPair] = []
    width = 0
    for p in ordered:
        full = max_pairs is not None and len(current) >= max_pairs
        if current and (rows * (len(current) + 1) * max(width, width_of(p)) > max_tokens or full):
            batches.append(current)
            current, width = [], 0
        current.append(p)
        width = max(width, width_of(p))
    if current:
        batches.append(current)
    return batches


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


def epoch_order(num_pairs: int, seed: int, epoch: int, global_batch: int) -> list[int]:
    """:func:`training_order` filled up to whole global batches with the epoch's first pairs, as
    torch's ``DistributedSampler`` pads: every pair is trained on in every epoch and every step
    has a full batch (so W ranks with batch b still see what one rank with batch W*b sees).
    Dropping the remainder instead left up to ``global_batch - 1`` pairs untrained in every
    epoch. ``(steps_per_epoch * global_batch,)`` indices."""
    order = training_order(num_pairs, seed, epoch)
    missing = steps_per_epoch(num_pairs, global_batch) * global_batch - num_pairs
    return order + (order * (missing // num_pairs + 1))[:missing]
