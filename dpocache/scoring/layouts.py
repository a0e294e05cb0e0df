"""The one switch between the three layouts: how a batch of pairs becomes model inputs, and how
its completion log-probs come back as one ``PairValues`` record.

- ``padded`` (``scoring.padded``): a ``PairBatch``, two right-padded rows per pair,
  ``prompt + chosen`` and ``prompt + rejected``;
- ``shared`` (``scoring.shared``): a ``SharedPromptBatch``, one row per pair,
  ``prompt + chosen + rejected`` under a block mask;
- ``packed`` (``scoring.shared``, ``scoring.packing``): a ``SharedPromptBatch`` with several
  shared-prompt pairs per row, kept apart block-diagonally.

The reference pass (``ReferenceModel.score``, behind the cache build and the sharded
reference), training and evaluation (``layout_logprobs``) call ``budget_batches`` and
``score_pairs``, which is ``lay_out`` (host work: a ``LaidOut``, which a background thread can
build ahead) then ``run_laid_out`` (the forward); nothing else branches on a layout's name.
Which layout runs is decided apart, once per model (``scoring.layout_choice``,
``scoring.attention.choose_layout``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Protocol, Sequence

import torch
from torch import nn

from dpocache.data.pairs import TokenizedPair
from dpocache.data.values import PairValues
from dpocache.scoring import packing
from dpocache.scoring.attention import choose_layout, is_flex, row_multiple
from dpocache.scoring.layout_choice import PACKED, PADDED, SHARED, LayoutChoice, shares_prompts
from dpocache.scoring.logprobs import CompletionLogProbs, scorer_core, unwrap_causal_lm
from dpocache.scoring.padded import PairBatch, collate_pairs, pair_values
from dpocache.scoring.shared import (
    SharedPromptBatch,
    layout_batch,
    sequence_sums,
    shared_prompt_logps,
    split_per_token,
)


class LayoutRunner(Protocol):
    """What runs a laid-out batch through a model: ``run_padded`` → ``(2B, T)`` per-token
    log-probs (0 off the completions), ``run_shared`` → ``(M,)`` log-probs of the scored tokens."""

    def run_padded(self, batch: PairBatch) -> torch.Tensor: ...

    def run_shared(self, batch: SharedPromptBatch) -> torch.Tensor: ...


def _row_cost(layout: str):
    """(rows per pair, width of a pair's row) in ``layout``: the padded layout runs two rows of
    ``prompt + longer completion``; the shared-prompt layout one row of ``prompt + chosen + rejected``."""
    if layout == SHARED:
        return 1, lambda p: p.unique_tokens
    return 2, lambda p: len(p.prompt_ids) + max(len(p.chosen_ids), len(p.rejected_ids))


def budget_batches(pairs: Sequence[TokenizedPair], max_tokens: int, layout: str,
                   max_pairs: int | None = None) -> list[list[TokenizedPair]]:
    """Group pairs of similar length into batches whose padded size in ``layout`` (rows x
    longest row) stays under ``max_tokens``; in the packed layout, batches of rows filled by
    ``packing.budget_batches``.

    For inference only (the reference pass), where order does not matter: pairs are sorted
    longest first, so the largest batch runs first and an out-of-memory shows at once; sorted
    by length, the padding left is the difference between neighbouring lengths. A single pair
    larger than the budget gets a batch of its own.
    """
    if layout == PACKED:  # rows filled with the shortest pairs too (scoring.packing)
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


@dataclass
class LaidOut:
    """A batch of pairs laid out for the model, on the host: what ``lay_out`` builds and
    ``run_laid_out`` runs. Built apart from the forward so that a background thread can lay out
    the next micro-batch while the device runs this one (``dpocache.training.prefetch``)."""

    layout: str  # the layout it was built in (scoring.layout_choice)
    batch: PairBatch | SharedPromptBatch  # host tensors (pinned by ``pin_memory``)
    pairs: Sequence[TokenizedPair]
    tokens: int  # real tokens the forward runs (each prompt once in the shared layouts)

    def pin_memory(self) -> "LaidOut":
        """The same batch in page-locked host memory: its copy to a GPU can then run
        ``non_blocking``, behind the work already queued, instead of stalling the host."""
        return replace(self, batch=self.batch.pin_memory())


def lay_out(layout: str, pairs: Sequence[TokenizedPair], pad_id: int, config, one_row: bool = False,
            width: int | None = None) -> LaidOut:
    """``pairs`` laid out in ``layout`` for a model with ``config``, on the host (``one_row`` and
    ``width``: a packed reference batch in one row at least ``width`` tokens wide, as
    ``packing.budget_batches`` planned it)."""
    if layout not in (PADDED, SHARED, PACKED):
        raise ValueError(f"layout must be one of {PADDED}, {SHARED}, {PACKED}; got {layout!r}")
    if shares_prompts(layout):
        batch = layout_batch(layout, pairs, pad_id, config, one_row=one_row, width=width)
        return LaidOut(layout, batch, pairs, sum(p.unique_tokens for p in pairs))
    return LaidOut(layout, collate_pairs(pairs, pad_id), pairs, sum(p.num_tokens for p in pairs))


def run_laid_out(runner: LayoutRunner, laid: LaidOut, device=None, per_token: bool = False) -> tuple[PairValues, int]:
    """``laid`` run by ``runner``: (``PairValues`` of its ``B`` pairs, per-token values only if
    ``per_token``; real tokens run). ``device``: where the batch goes first (None: the runner
    moves it, and returns its values on the host). The values are combined with the batch where
    they are, so every tensor of the result is on one device. Nothing here waits for the device:
    counts and offsets come from the pairs."""
    pairs = laid.pairs
    batch = laid.batch if device is None else laid.batch.to(device)
    if shares_prompts(laid.layout):
        logps = runner.run_shared(batch)  # (M,)
        chosen, rejected = sequence_sums(logps, batch)
        cpt, rpt = split_per_token(logps, batch, pairs) if per_token else (None, None)
        values = PairValues(chosen, rejected, batch.chosen_tokens, batch.rejected_tokens, cpt, rpt)
        return values, laid.tokens
    token_logps = runner.run_padded(batch)  # (2B, T)
    return pair_values(token_logps, batch, pairs if per_token else None), laid.tokens


def score_pairs(runner: LayoutRunner, layout: str, pairs: Sequence[TokenizedPair], pad_id: int, config,
                device=None, per_token: bool = False, one_row: bool = False,
                width: int | None = None) -> tuple[PairValues, int]:
    """``pairs`` laid out in ``layout`` for a model with ``config`` (``lay_out``) and run by
    ``runner`` (``run_laid_out``): (``PairValues`` of the ``B`` pairs, per-token values only if
    ``per_token``; real tokens run)."""
    return run_laid_out(runner, lay_out(layout, pairs, pad_id, config, one_row, width), device, per_token)


class ModuleRunner:
    """A ``CompletionLogProbs`` (possibly DDP- or FSDP2-wrapped) run through its own forward, so
    the wrappers' hooks run: the policy in training and evaluation."""

    def __init__(self, scorer: nn.Module):
        self.scorer = scorer

    def run_padded(self, batch: PairBatch) -> torch.Tensor:
        return self.scorer(batch.input_ids, batch.attention_mask, batch.completion_mask, scored=batch.scored)

    def run_shared(self, batch: SharedPromptBatch) -> torch.Tensor:
        return shared_prompt_logps(self.scorer, batch)


def layout_logprobs(scorer: nn.Module, layout: str, pairs: Sequence[TokenizedPair], pad_id: int, device,
                    per_token: bool = False, laid: LaidOut | None = None) -> tuple[PairValues, int]:
    """Policy log-probs of ``pairs`` in ``layout`` (packed: the micro-batch first fit into rows
    of its longest pair's width), through ``scorer``'s forward: (``PairValues`` carrying the
    graph, per-token values only if ``per_token``; real tokens run). ``laid``: ``pairs`` laid
    out already (``lay_out``, by a prefetching thread). ``policy_logps`` is the same for a
    loop of one's own."""
    core = scorer_core(scorer)
    if not isinstance(core, CompletionLogProbs):
        raise TypeError(f"scorer: expected a CompletionLogProbs, got {type(core).__name__}; wrap the model once: "
                        "scorer = dpocache.CompletionLogProbs(model)")
    if laid is None:
        laid = lay_out(layout, pairs, pad_id, core.config)
    return run_laid_out(ModuleRunner(scorer), laid, device, per_token)


def policy_logps(scorer: nn.Module, pairs: Sequence[TokenizedPair], pad_id: int, device=None, layout: str = PADDED,
                 per_token: bool = False) -> PairValues:
    """A policy's completion log-probs of ``pairs``, with their graph, for a training loop of
    one's own: what ``CacheStore.lookup`` gives for the reference, for the same pairs.

    ``scorer``: ``CompletionLogProbs(model)``, made once per model (it finds the model's head;
    DDP- or FSDP2-wrapped as training wraps it). ``pad_id``: the tokenizer's (never scored).
    ``device``: where the batch runs (None: the scorer's parameters'). ``layout``: ``padded``
    (two rows a pair), ``shared`` or ``packed`` (the prompt once a pair; not every model takes
    them: ``dpocache.scoring.select_layout``). Returns a ``PairValues`` of the ``B`` pairs on
    ``device``: ``chosen_logps``, ``rejected_logps`` ``(B,)`` float32 sums over each completion's
    tokens, ``chosen_tokens``, ``rejected_tokens`` ``(B,)`` counts; per-token lists with
    ``per_token``. Dropout and autocast are the caller's (``model.eval()``,
    ``dpocache.scoring.autocast(dtype, device)``)."""
    if device is None:
        device = next(scorer.parameters()).device
    values, _ = layout_logprobs(scorer, layout, pairs, pad_id, device, per_token)
    return values


def training_layout(scorer: nn.Module, requested: str, attention: str = "auto") -> LayoutChoice:
    """The layout a training run's ``scorer`` (``CompletionLogProbs``, possibly DDP/FSDP2-wrapped)
    runs for ``requested``, its model switched to the ``attention`` backend first
    (``scoring.attention``): ``scoring.layout_choice.select_layout``'s rule, with the router loss
    of a mixture-of-experts model kept (padded)."""
    core = scorer_core(scorer)
    return choose_layout(unwrap_causal_lm(core.model), core, requested, attention, training=True)


def reference_row_width(reference, max_tokens: int | None) -> int | None:
    """The width every packed reference row is padded to under FlexAttention: ``max_tokens``
    (rounded up to ``FLEX_BLOCK``), so every batch of the pass has one shape and its kernels
    (and compiled layers) compile once; None elsewhere (rows as wide as their pairs).

    On an H100 (1.1B Llama, bf16, decoder layers compiled) rows padded to the budget ran the
    pass faster than rows as wide as their pairs under one dynamic compile
    (docs/benchmarks/probes-h100-20261122.md). The padding is the budget's unfilled tail: the
    rows are filled first fit, longest pairs first, so only the last few have room left."""
    if max_tokens is None or getattr(reference, "layout", None) != PACKED:
        return None
    config = unwrap_causal_lm(reference.model).config
    return packing.round_up(max_tokens, row_multiple(config)) if is_flex(config) else None
