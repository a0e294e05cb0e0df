"""The group layout: one row per prompt, ``prompt + completion_0 + ... + completion_{G-1}``, so a
GRPO group's prompt (or a DPO pair's, or a single sequence's) runs through the model once.

This is ``dpocache.scoring.shared``'s shared-prompt layout generalised from two completions to G: the
segment of a token is ``PROMPT`` (0), ``k + 1`` for completion ``k``, or ``PAD`` (-1), and the
block mask of ``prefix.attention_mask`` (a token sees the prompt and its own segment, causally;
sliding windows on positions) is already written for any number of segments, so it is reused
as is, as is ``prefix.shared_prompt_logps`` (the body once, the chunked output head on the
scored positions only). Position ids restart at ``p`` for every completion, so each completion
sees exactly the positions of its own sequence ``prompt + completion``.

Where the model's attention takes no custom mask (``prefix.shared_prompt_supported``), callers
use ``collate_sequences``: one right-padded row per sequence, scored by ``CompletionLogProbs``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence, TypeVar

import torch

from dpocache.scoring.padded import pad_sequences
from dpocache.scoring.shared import PAD, PROMPT

T = TypeVar("T")


@dataclass(frozen=True)
class Group:
    """One prompt and the completions scored under it (a request, or part of one that fits the
    token budget). ``ids`` says which completion of its request each one is."""

    request: int
    prompt: tuple[int, ...]
    completions: tuple[tuple[int, ...], ...]
    ids: tuple[int, ...]

    @property
    def unique_tokens(self) -> int:
        """Tokens of the group layout's row: the prompt counted once."""
        return len(self.prompt) + sum(len(c) for c in self.completions)

    @property
    def sequence_tokens(self) -> int:
        """Tokens of the G separate sequences ``prompt + completion``."""
        return len(self.prompt) * len(self.completions) + sum(len(c) for c in self.completions)

    @property
    def padded_width(self) -> int:
        """Width of this group's rows in the per-sequence layout."""
        return len(self.prompt) + max(len(c) for c in self.completions)


@dataclass
class GroupBatch:
    """``B`` groups as ``B`` right-padded rows ``prompt + completion_0 + ... + completion_{G_b-1}``.

    The ``M`` scored tokens are ordered group by group, completion by completion, as
    ``counts`` lists them. The attributes ``prefix.attention_mask`` and
    ``prefix.shared_prompt_logps`` read are those of ``prefix.SharedPromptBatch``.
    """

    input_ids: torch.Tensor  # (B, T)
    position_ids: torch.Tensor  # (B, T)
    segments: torch.Tensor  # (B, T) int16: PROMPT, k + 1 for completion k, or PAD
    source: torch.Tensor  # (M,) flat index b*T + t of the position that predicts each scored token
    labels: torch.Tensor  # (M,) the scored token ids
    counts: list[int]  # tokens of each completion, group after group

    @property
    def num_tokens(self) -> int:
        """Real (non-padding) tokens."""
        return int((self.segments != PAD).sum())

    def to(self, device) -> "GroupBatch":
        moved = (t.to(device, non_blocking=True) for t in (self.input_ids, self.position_ids, self.segments,
                                                           self.source, self.labels))
        return GroupBatch(*moved, self.counts)


def collate_groups(groups: Sequence[Group], pad_id: int = 0) -> GroupBatch:
    """The group layout of ``groups`` (see the module docstring)."""
    b = len(groups)
    width = max(g.unique_tokens for g in groups)
    input_ids = torch.full((b, width), pad_id, dtype=torch.long)
    position_ids = torch.zeros((b, width), dtype=torch.long)
    segments = torch.full((b, width), PAD, dtype=torch.int16)
    source: list[int] = []
    labels: list[int] = []
    counts: list[int] = []
    for row, g in enumerate(groups):
        p = len(g.prompt)
        if p == 0:
            raise ValueError(f"request {g.request}: an empty prompt cannot score its first completion token")
        base = row * width
        input_ids[row, :p] = torch.tensor(g.prompt, dtype=torch.long)
        position_ids[row, :p] = torch.arange(p)
        segments[row, :p] = PROMPT
        start = p  # where the current completion starts in the row
        for k, c in enumerate(g.completions):
            n = len(c)
            input_ids[row, start:start + n] = torch.tensor(c, dtype=torch.long)
            position_ids[row, start:start + n] = torch.arange(p, p + n)
            segments[row, start:start + n] = k + 1
            # Token j of the completion sits at start+j and is predicted from start+j-1, except
            # j = 0, predicted from the prompt's last token (its own sequence's previous one).
            source.append(base + p - 1)
            source.extend(range(base + start, base + start + n - 1))
            labels.extend(c)
            counts.append(n)
            start += n
    as_long = lambda xs: torch.tensor(xs, dtype=torch.long)  # noqa: E731
    return GroupBatch(input_ids, position_ids, segments, as_long(source), as_long(labels), counts)


@dataclass
class SequenceBatch:
    """The fallback layout: one right-padded row ``prompt + completion`` per sequence, in the
    order of the groups' completions (``CompletionLogProbs``'s inputs)."""

    input_ids: torch.Tensor  # (N, T)
    attention_mask: torch.Tensor  # (N, T)
    completion_mask: torch.Tensor  # (N, T)


def collate_sequences(groups: Sequence[Group], pad_id: int = 0) -> SequenceBatch:
    """One right-padded row per (prompt, completion) of ``groups`` (the padded fallback)."""
    return SequenceBatch(*pad_sequences([(g.prompt, c) for g in groups for c in g.completions], pad_id))


def per_sequence(token_logps: torch.Tensor, batch: SequenceBatch) -> list[torch.Tensor]:
    """``(N, T)`` per-token log-probs (0 off the completion) → N tensors ``(c_i,)``."""
    mask = batch.completion_mask.bool()
    return [token_logps[i][mask[i]] for i in range(token_logps.shape[0])]


# ------------------------------------------------------------------------------- splitting


def split_group(request: int, prompt: Sequence[int], completions: Sequence[Sequence[int]], ids: Sequence[int],
                max_tokens: int) -> list[Group]:
    """One request's completions as groups whose row ``prompt + completions`` fits ``max_tokens``
    (a completion too long for the budget gets a group of its own): G completions of 4k tokens
    in one row would make a (G*4k)^2 mask."""
    prompt = tuple(prompt)
    groups: list[Group] = []
    comps: list[tuple[int, ...]] = []
    kept: list[int] = []
    width = len(prompt)
    for i, c in zip(ids, completions):
        if comps and width + len(c) > max_tokens:
            groups.append(Group(request, prompt, tuple(comps), tuple(kept)))
            comps, kept, width = [], [], len(prompt)
        comps.append(tuple(c))
        kept.append(i)
        width += len(c)
    if comps:
        groups.append(Group(request, prompt, tuple(comps), tuple(kept)))
    return groups


def budget_batches(items: Sequence[T], max_tokens: int, width: Callable[[T], int],
                   rows: Callable[[T], int] = lambda item: 1) -> list[list[T]]:
    """Length-grouped batches whose padded size (rows x widest row) stays under ``max_tokens``.

    Longest first, so the largest batch runs first and an out-of-memory shows at once; an
    item larger than the budget gets a batch of its own.
    """
    batches: list[list[T]] = []
    current: list[T] = []
    widest = n_rows = 0
    for item in sorted(items, key=width, reverse=True):
        w, r = width(item), rows(item)
        if current and (n_rows + r) * max(widest, w) > max_tokens:
            batches.append(current)
            current, widest, n_rows = [], 0, 0
        current.append(item)
        widest, n_rows = max(widest, w), n_rows + r
    if current:
        batches.append(current)
    return batches
