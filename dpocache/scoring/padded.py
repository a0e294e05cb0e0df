"""The padded pair layout (``scoring.layouts`` switches between it and the shared-prompt ones).

Pair layout: a batch of B pairs becomes 2B right-padded rows, ``prompt + chosen`` in rows
``[0, B)`` and ``prompt + rejected`` in rows ``[B, 2B)``; ``completion_mask`` marks the
completion tokens, the only ones scored.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from dpocache.data.pairs import TokenizedPair
from dpocache.data.values import PairValues
from dpocache.scoring.logprobs import CompletionLogProbs, scored_positions


@dataclass
class PairBatch:
    input_ids: torch.Tensor  # (2B, T)
    attention_mask: torch.Tensor  # (2B, T)
    completion_mask: torch.Tensor  # (2B, T)
    scored: torch.Tensor | None = None  # (M,) ``scored_positions(completion_mask)``, built on the host

    def __post_init__(self):
        if self.scored is None and self.completion_mask.device.type == "cpu":
            self.scored = scored_positions(self.completion_mask)

    @property
    def num_pairs(self) -> int:
        return self.input_ids.shape[0] // 2

    def to(self, device) -> "PairBatch":
        return self._map(lambda t: t.to(device, non_blocking=True))

    def pin_memory(self) -> "PairBatch":
        return self._map(torch.Tensor.pin_memory)

    def _map(self, fn) -> "PairBatch":
        return PairBatch(fn(self.input_ids), fn(self.attention_mask), fn(self.completion_mask),
                         None if self.scored is None else fn(self.scored))


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


def pair_values(token_logps: torch.Tensor, batch: PairBatch,
                pairs: Sequence[TokenizedPair] | None = None) -> PairValues:
    """``(2B, T)`` per-token log-probs of ``batch`` split into chosen and rejected halves; with
    ``pairs`` (those of ``batch``), the per-token values too, cut at host-known offsets (no
    device sync)."""
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


def pair_logprobs(lp: CompletionLogProbs, batch: PairBatch,
                  pairs: Sequence[TokenizedPair] | None = None) -> PairValues:
    """Run ``lp`` on a pair batch and split the result (``pair_values``)."""
    token_logps = lp(batch.input_ids, batch.attention_mask, batch.completion_mask, scored=batch.scored)  # (2B, T)
    return pair_values(token_logps, batch, pairs)
