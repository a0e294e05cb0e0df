"""The shared-prompt layout: each pair is one row ``prompt + chosen + rejected``, so the prompt
runs through the model once per pair instead of twice.

A block mask keeps the two completions apart: a prompt token attends to the prompt before it
(causal), a chosen token to the prompt and the chosen tokens before it, a rejected token to the
prompt and the rejected tokens before it, never to the chosen ones. Position ids restart after
the prompt for each completion (``p, p+1, ...``), so RoPE and learned position embeddings see
exactly the positions of the two separate sequences ``prompt + chosen`` and ``prompt +
rejected``; sliding windows are applied on these positions. Each completion token is scored
from the hidden state of the position before it *in its own sequence*: the first chosen and the
first rejected token both from the prompt's last position.

So the values are those of the padded two-row layout (``dpocache.scoring.padded``) up to float
rounding, at ``p + c + r`` tokens per pair instead of ``2 * (p + max(c, r))`` plus padding:
for prompts as long as the completions that is about 3/4 of the work before padding, for
prompts four times as long about 3/5.

The packed layout is the same rows with several pairs in each (``collate_packed``, placed by
``dpocache.scoring.packing``): a ``documents`` id per token keeps pairs apart (block-diagonal) and
position ids restart at 0 for each pair; the shared layout is its case of one pair per row
(``collate_shared``, one code path for both).

Supported where the model's body accepts a custom 4D mask and ``position_ids`` with the
``sdpa`` or ``eager`` attention (Llama, Qwen2, Mistral, Gemma 2, GPT-2 and most decoder-only
models of transformers >= 4.53), or a ``BlockMask`` with ``flex_attention``
(``flex_block_masks``, ``dpocache.scoring.attention``); ``dpocache.scoring.layout_choice.select_layout`` decides, for
the cache build and training alike, and names the reason when the padded layout runs instead.

The computation goes through ``CompletionLogProbs.forward`` (its gathered mode: a custom mask,
position ids and the flat positions to score), so a DDP- or FSDP2-wrapped scorer runs its hooks
(gradient reduction, parameter all-gather) in this layout as in the padded one.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.flex_attention import BlockMask

from dpocache.data.pairs import TokenizedPair
from dpocache.data.values import completion_sums
from dpocache.scoring import packing
from dpocache.scoring.attention import FLEX_BLOCK, SequenceRows, is_causal, is_flex, row_multiple
from dpocache.scoring.layout_choice import (
    BLOCK_MASK_ATTENTION,
    PACKED,
    ROW_GROUPS_ENV,
    ROW_GROUPS_MODES,
    every_layer_slides,
)
from dpocache.scoring.logprobs import scorer_core, unwrap_causal_lm

PROMPT, CHOSEN, REJECTED, PAD = 0, 1, 2, -1


@dataclass
class SharedPromptBatch:
    """``P`` pairs in ``B`` right-padded rows, each pair ``prompt + chosen + rejected`` at some
    offset of a row: one pair per row (the shared layout, ``B == P``) or several (the packed
    layout, ``dpocache.scoring.packing``), told apart by ``documents``.

    The ``M`` scored tokens are ordered pair by pair, chosen then rejected, in the pairs' order
    (whatever their rows): ``[c_0 chosen of pair 0, r_0 rejected of pair 0, c_1 chosen of pair 1, ...]``.
    """

    input_ids: torch.Tensor  # (B, T)
    position_ids: torch.Tensor  # (B, T) restarting at 0 for each pair, at p for each completion
    segments: torch.Tensor  # (B, T) int8: PROMPT, CHOSEN, REJECTED or PAD
    source: torch.Tensor  # (M,) flat index b*T + t of the position that predicts each scored token
    labels: torch.Tensor  # (M,) the scored token ids
    sequence: torch.Tensor  # (M,) which sequence each scored token belongs to: i (chosen) or P + i (rejected)
    chosen_tokens: torch.Tensor  # (P,) long
    rejected_tokens: torch.Tensor  # (P,)
    documents: torch.Tensor  # (B, T) int16: which pair of its row a token belongs to (PAD on padding)
    rows: SequenceRows | None = None  # each sequence in a row of its own: the causal backend's input

    @property
    def num_pairs(self) -> int:
        return self.chosen_tokens.shape[0]

    @property
    def num_tokens(self) -> int:
        """Real (non-padding) tokens."""
        return int((self.segments != PAD).sum())

    def to(self, device) -> "SharedPromptBatch":
        return self._map(lambda t: t.to(device, non_blocking=True))

    def pin_memory(self) -> "SharedPromptBatch":
        return self._map(torch.Tensor.pin_memory)

    def _map(self, fn) -> "SharedPromptBatch":
        rows = None if self.rows is None else self.rows.map(fn)
        return SharedPromptBatch(*(fn(t) for t in (
            self.input_ids, self.position_ids, self.segments, self.source, self.labels, self.sequence,
            self.chosen_tokens, self.rejected_tokens, self.documents)), rows=rows)


def collate_shared(pairs: Sequence[TokenizedPair], pad_id: int = 0, placement: Sequence[tuple[int, int]] | None = None,
                   width: int | None = None, rows: bool = False) -> SharedPromptBatch:
    """The shared-prompt layout of ``pairs`` (see the module docstring): pair ``i`` at
    ``placement[i] = (row, offset)`` (default: row ``i``, offset 0) in rows of ``width`` tokens
    (default: as wide as the fullest row); ``rows``: with its ``SequenceRows`` (``sequence_rows``)."""
    n = len(pairs)
    placement = [(i, 0) for i in range(n)] if placement is None else list(placement)
    n_rows = 1 + max(row for row, _ in placement)
    width = width or max(offset + p.unique_tokens for (_, offset), p in zip(placement, pairs))
    input_ids = torch.full((n_rows, width), pad_id, dtype=torch.long)
    position_ids = torch.zeros((n_rows, width), dtype=torch.long)
    segments = torch.full((n_rows, width), PAD, dtype=torch.int8)
    documents = torch.full((n_rows, width), PAD, dtype=torch.int16)
    source, labels, sequence = [], [], []
    docs_in_row = [0] * n_rows
    for i, (pair, (row, start)) in enumerate(zip(pairs, placement)):
        p, c, r = len(pair.prompt_ids), len(pair.chosen_ids), len(pair.rejected_ids)
        if p == 0:
            raise ValueError(f"pair {pair.index}: an empty prompt cannot score its first completion token")
        end = start + p + c + r
        input_ids[row, start:end] = torch.tensor(pair.prompt_ids + pair.chosen_ids + pair.rejected_ids,
                                                 dtype=torch.long)
        position_ids[row, start:start + p + c] = torch.arange(p + c)
        position_ids[row, start + p + c:end] = torch.arange(p, p + r)
        segments[row, start:start + p] = PROMPT
        segments[row, start + p:start + p + c] = CHOSEN
        segments[row, start + p + c:end] = REJECTED
        documents[row, start:end] = docs_in_row[row]
        docs_in_row[row] += 1
        base = row * width + start
        # chosen token k sits at p+k and is predicted from p+k-1; rejected token k sits at p+c+k
        # and is predicted from p+c+k-1, except k = 0, predicted from the prompt's last token.
        source.extend(range(base + p - 1, base + p + c - 1))
        if r:
            source.append(base + p - 1)
            source.extend(range(base + p + c, base + p + c + r - 1))
        labels.extend(pair.chosen_ids)
        labels.extend(pair.rejected_ids)
        sequence.extend([i] * c + [n + i] * r)
    as_long = lambda xs: torch.tensor(xs, dtype=torch.long)  # noqa: E731
    return SharedPromptBatch(
        input_ids, position_ids, segments, as_long(source), as_long(labels), as_long(sequence),
        as_long([len(p.chosen_ids) for p in pairs]), as_long([len(p.rejected_ids) for p in pairs]), documents,
        rows=sequence_rows(pairs, placement, n_rows, width) if rows else None,
    )


# A group's rows as wide as a multiple of 8: on CUDA inductor specializes a compiled layer's
# kernels on whether a width is, so a width of each kind compiled the layers again, once per run
# (the 8B LoRA row's 3 graphs in docs/benchmarks/gpu-suite-h200-20261127.md); the slots past a
# sequence's end repeat its last token, which the causal rows' real tokens never attend to.
ROW_ALIGN = 8
# The causal rows in this many groups (fewer only with fewer than twice as many sequences: no group
# has one row, see row_groups), of similar lengths, each as wide as its longest: causal attention's
# work on a row grows with its width squared, so one width for all rows spent about half of it on
# padding (batches of 8 pairs of the GPU suite's shapes, prompts 200-1,200 tokens and completions
# 100-800, by arithmetic over random draws: 48% of it on real tokens in one group, 72% in two, 83%
# in three). A fixed count keeps a compiled layer's graph the same from batch to batch.
# ``$DPOCACHE_ROW_GROUPS`` sets it (1: one group, to measure the groups again); read once, at
# import, as every command checks it first.
_ROW_GROUPS_SET = os.environ.get(ROW_GROUPS_ENV)
ROW_GROUPS = int(_ROW_GROUPS_SET if _ROW_GROUPS_SET in ROW_GROUPS_MODES else ROW_GROUPS_MODES[0])


def row_width(length: int) -> int:
    """The slots of a causal row for a sequence of ``length`` tokens: at least one past its end,
    rounded up to ``ROW_ALIGN``."""
    return packing.round_up(1 + length, ROW_ALIGN)


def row_groups(lengths: Sequence[int], groups: int = ROW_GROUPS) -> list[int]:
    """Where to cut ``lengths`` (sequence lengths, longest first) into runs with the least
    attention work, a run ``[j, i)`` costing ``(i - j) * W**2`` with ``W`` its rows' width
    (``row_width`` of its first length): the starts of the runs after the first.

    ``min(groups, n // 2)`` runs (one when ``n < 4``), each of two lengths or more (of one when
    ``n`` is 1): the compiler specialises a size of 1, so a group of one row, as the longest
    sequence alone would often be, compiled every layer's graphs again in the middle of a run
    (``tests/scoring/test_causal_attention.py``)."""
    n = len(lengths)
    shortest = 2 if n >= 2 else 1
    runs = max(1, min(groups, n // shortest))
    width = [row_width(length) for length in lengths]
    best = {n: (0, [])}  # start j -> (least work, cuts) of lengths[j:] in the runs counted so far
    for k in range(1, runs + 1):  # lengths[j:] in k runs, the first [j, i), each at least `shortest` long
        best = {j: min(((i - j) * width[j] ** 2 + best[i][0], ([i] if i < n else []) + best[i][1])
                       for i in range(j + shortest, n - (k - 1) * shortest + 1) if i in best)
                for j in range(n - k * shortest + 1)}
    return best[0][1]


def sequence_rows(pairs: Sequence[TokenizedPair], placement: Sequence[tuple[int, int]], n_rows: int,
                  width: int) -> SequenceRows:
    """The ``SequenceRows`` of pairs placed at ``placement`` (``(row, offset)`` each) in
    ``n_rows`` rows of ``width`` tokens: ``prompt + chosen`` and ``prompt + rejected`` of each pair (one of them
    when the other completion is empty; the prompt alone when both are), longest first, in
    ``row_groups``, each group's ``W_g`` the ``row_width`` of its longest sequence, so that every
    row ends past its sequence. A prompt token takes its output from
    its pair's first row, a completion token from its own, a padding token from the last slot of
    the longest row (past its sequence; never read). ``second``: a prompt token's slot in its
    pair's second row; any other token's is that last slot of the longest row."""
    spans = []  # per sequence: (prompt's flat start, prompt length, completion's flat start, completion length)
    prompts = []  # per pair: (prompt's flat start, prompt length, its first sequence, its sequences)
    for pair, (row, start) in zip(pairs, placement):
        p, c, r = len(pair.prompt_ids), len(pair.chosen_ids), len(pair.rejected_ids)
        base = row * width + start
        first = len(spans)
        spans.extend((base, p, at, n) for at, n in ((base + p, c), (base + p + c, r)) if n)
        if len(spans) == first:  # both completions empty: the prompt still needs a row
            spans.append((base, p, base + p, 0))
        prompts.append((base, p, first, len(spans) - first))
    lengths = [p + n for _, p, _, n in spans]
    order = sorted(range(len(spans)), key=lambda s: -lengths[s])  # longest first
    starts = [0, *row_groups([lengths[s] for s in order])]
    ends = [*starts[1:], len(order)]
    gathers, slot = [], [0] * len(spans)  # slot[s]: sequence s's first slot
    offset = 0
    for lo, hi in zip(starts, ends):
        w = row_width(lengths[order[lo]])
        gather = torch.empty(hi - lo, w, dtype=torch.long)
        for i, s in enumerate(order[lo:hi]):
            base, p, at, n = spans[s]
            gather[i, :p] = torch.arange(base, base + p)
            gather[i, p:p + n] = torch.arange(at, at + n)
            gather[i, p + n:] = base + p - 1 if n == 0 else at + n - 1  # past the sequence: its last token
            slot[s] = offset + i * w
        gathers.append(gather)
        offset += (hi - lo) * w
    past = gathers[0].shape[1] - 1  # the longest row's last slot, past its sequence
    scatter = torch.full((n_rows * width,), past, dtype=torch.long)
    second = torch.full((n_rows * width,), past, dtype=torch.long)
    for s, (base, p, at, n) in enumerate(spans):
        scatter[at:at + n] = torch.arange(slot[s] + p, slot[s] + p + n)
    for base, p, s, count in prompts:
        scatter[base:base + p] = torch.arange(slot[s], slot[s] + p)
        if count == 2:
            second[base:base + p] = torch.arange(slot[s + 1], slot[s + 1] + p)
    return SequenceRows(tuple(gathers), scatter, second)


def collate_packed(pairs: Sequence[TokenizedPair], pad_id: int = 0, width: int | None = None,
                   multiple: int = 1, rows: bool = False) -> SharedPromptBatch:
    """The packed layout: ``pairs`` first fit, longest first, into rows of ``width`` tokens
    (default: the longest pair's) rounded up to a multiple of ``multiple``. The scored tokens
    come in the pairs' order, as in the shared layout."""
    lengths = [p.unique_tokens for p in pairs]
    width = packing.round_up(width or max(lengths), multiple)
    return collate_shared(pairs, pad_id, packing.place(lengths, width), width, rows)


def collate_layout(layout: str, pairs: Sequence[TokenizedPair], pad_id: int = 0, multiple: int = 1,
                   one_row: bool = False, width: int | None = None, rows: bool = False) -> SharedPromptBatch:
    """``pairs`` in the ``shared`` layout (one pair per row) or the ``packed`` one (rows of the
    longest pair's width; ``one_row``: all in one row, a reference batch of
    ``packing.budget_batches``, at least ``width`` tokens wide); rows padded to a multiple of
    ``multiple`` tokens (FlexAttention: one compiled kernel per width bucket); ``rows``: with the
    batch's ``SequenceRows`` (the causal backend's input)."""
    if layout == PACKED:
        row = max(width or 0, sum(p.unique_tokens for p in pairs)) if one_row else None  # None: the longest pair's
        return collate_packed(pairs, pad_id, row, multiple, rows)
    return collate_shared(pairs, pad_id, width=packing.round_up(max(p.unique_tokens for p in pairs), multiple),
                          rows=rows)


def layout_batch(layout: str, pairs: Sequence[TokenizedPair], pad_id: int, config, one_row: bool = False,
                 width: int | None = None) -> SharedPromptBatch:
    """``collate_layout`` for a model with ``config``: rows padded to its backend's multiple
    (``attention.row_multiple``), with the sequence rows its backend runs on if it is ``causal``.

    Under the ``causal`` backend a packed batch is one row: its attention runs on each
    sequence's own row (``SequenceRows``) whatever the batch's rows are, so rows of the longest
    pair's width would only add padding for every projection and MLP to compute (a 58M Llama's
    training micro-batches of 4 pairs: 21-42% more tokens; ``bench/probes/train_flops_probe.py``)."""
    causal = is_causal(config)
    one_row = one_row or (causal and layout == PACKED)
    return collate_layout(layout, pairs, pad_id, row_multiple(config), one_row, width, rows=causal)


# ---------------------------------------------------------------------------------- masks


def shared_prompt_supported(model: nn.Module) -> bool:
    """True when the model's attention takes the custom mask this layout needs."""
    config = unwrap_causal_lm(model).config
    return getattr(config, "_attn_implementation", None) in BLOCK_MASK_ATTENTION


def sliding_layers(config) -> tuple[list[str] | None, int | None, bool]:
    """``(layer types, window, every layer slides)``; window None where no layer slides.

    A model with ``layer_types`` (Gemma 2, Qwen2) slides on its ``sliding_attention`` layers.
    One without (Mistral, whose config defaults to a 4096 window, Mixtral, Phi-3, Starcoder2,
    Qwen3-MoE) slides on every layer wherever ``sliding_window`` is set: transformers builds
    their sliding mask from that alone, so a block mask without the window attends further back
    than the model does, silently, once a sequence is longer than the window."""
    layer_types = getattr(config, "layer_types", None)
    window = getattr(config, "sliding_window", None)
    if layer_types:
        return layer_types, (window if "sliding_attention" in layer_types else None), False
    every_layer = every_layer_slides(lambda name, default: getattr(config, name, default))
    return None, (window if every_layer else None), every_layer


def attention_mask(batch: SharedPromptBatch, config, dtype: torch.dtype = torch.float32):
    """The block mask ``(B, 1, T, T)``, or ``{layer type: mask}`` for models with sliding layers.

    A token attends causally to the tokens of its own pair (``documents``; absent: one pair or
    group per row) that are prompt or of its own segment. Bool (True: attend) for SDPA;
    additive float (0 / most negative) for eager attention. Padding queries attend to
    themselves, so no row of the mask is empty (an all-masked row would give NaN); their
    outputs are never read.
    """
    seg, pos = batch.segments, batch.position_ids  # (B, T)
    t = seg.shape[1]
    idx = torch.arange(t, device=seg.device)
    causal = idx[None, :] <= idx[:, None]  # (T, T): key index <= query index
    sq, sk = seg[:, :, None], seg[:, None, :]  # (B, T, 1), (B, 1, T)
    allowed = causal & (sk != PAD) & ((sk == PROMPT) | (sk == sq))  # (B, T, T)
    documents = getattr(batch, "documents", None)
    if documents is not None:
        allowed &= documents[:, :, None] == documents[:, None, :]  # block-diagonal between packed pairs
    allowed |= (sq == PAD) & torch.eye(t, dtype=torch.bool, device=seg.device)
    masks = {"full_attention": allowed}
    layer_types, window, every_layer = sliding_layers(config)
    if window:
        distance = pos[:, :, None] - pos[:, None, :]  # (B, T, T) query position - key position
        masks["sliding_attention"] = allowed & (distance < window)
    impl = getattr(config, "_attn_implementation", "sdpa")
    if impl == "eager":
        neg = torch.finfo(dtype).min
        masks = {k: torch.zeros(m.shape, dtype=dtype, device=m.device).masked_fill_(~m, neg) for k, m in masks.items()}
    masks = {k: m[:, None] for k, m in masks.items()}  # (B, 1, T, T)
    if layer_types:
        return {lt: masks.get(lt, masks["full_attention"]) for lt in set(layer_types)}
    return masks["sliding_attention" if every_layer else "full_attention"]


def key_ranges(batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``attention_mask``'s rule as two ranges of keys per query token, ``(B, T)`` int32 each:
    ``(lo, pe, ss, shift)``. A query ``q`` attends the keys ``[lo, pe)`` (its pair's or group's
    prompt) and ``[ss, q]`` (its own run of one segment of one pair); a padding query attends
    itself alone (``lo == pe == ss == q``). ``shift`` is ``q``'s position minus the row index
    its prompt's positions count from, so a prompt key ``k`` is ``shift - k`` positions back
    (sliding windows). Assumes what the collates write: each pair (or group) contiguous, its
    prompt first, each segment one run of consecutive positions.

    Why int32 ranges: FlexAttention evaluates the ``mask_mod`` on every element of the blocks
    that are neither empty nor full, so what it loads there sets the kernel's speed. On an H100
    (``bench/probes/gpu_flex_mask_probe.py``) the rule read from the int8 segments and int16 pair
    ids of both tokens was slower than a dense causal kernel over the whole row; the same rule
    on int32 copies was several times faster, and these ranges, which load the query's side
    only, faster still (docs/benchmarks/probes-h100-20261122.md).
    """
    seg = batch.segments.long()  # (B, T)
    docs = getattr(batch, "documents", None)
    docs = torch.zeros_like(seg) if docs is None else docs.long()
    b, t = seg.shape
    idx = torch.arange(t, device=seg.device).expand(b, t)
    first = torch.ones(b, 1, dtype=torch.bool, device=seg.device)
    new_doc = torch.cat([first, docs[:, 1:] != docs[:, :-1]], 1)
    new_run = new_doc | torch.cat([first, seg[:, 1:] != seg[:, :-1]], 1)
    ss = torch.where(new_run, idx, 0).cummax(1).values  # start of the token's run
    lo = torch.where(new_doc, idx, 0).cummax(1).values  # start of the token's pair: its prompt's first token
    ends_run = torch.cat([new_run[:, 1:], first], 1)
    run_end = torch.where(ends_run, idx + 1, t).flip(1).cummin(1).values.flip(1)  # one past the token's run
    pe = run_end.gather(1, lo)  # the pair's first run is its prompt (never empty: collate_shared)
    pad = seg == PAD
    lo, pe, ss = (torch.where(pad, idx, x) for x in (lo, pe, ss))
    pos = batch.position_ids.long()
    shift = pos - pos.gather(1, lo) + lo
    return lo.int(), pe.int(), ss.int(), shift.int()


def flex_block_masks(batch, config, block: int = FLEX_BLOCK):
    """``attention_mask``'s rule as a FlexAttention ``BlockMask`` (``dpocache.scoring.attention``), or
    ``{layer type: BlockMask}`` for models with sliding layers; built on the batch's device.
    ``batch``: a ``SharedPromptBatch`` or a ``groups.GroupBatch`` (no ``documents``: one
    pair or group per row). The ``mask_mod`` reads the query's ``key_ranges`` alone, and the
    blocks come from the same ranges (``block_mask_from_ranges``). ``block``: the block size."""
    lo, pe, ss, shift = key_ranges(batch)  # (B, T) each
    q = torch.arange(lo.shape[1], device=lo.device, dtype=lo.dtype)  # (T,) query index
    after = (q + 1).expand_as(lo)  # (B, T) one past the last key a query may attend (k <= q)

    def allowed(bi, h, q, k):  # scalars: batch row, head, query index, key index
        return (k <= q) & (((k >= lo[bi, q]) & (k < pe[bi, q])) | (k >= ss[bi, q]))

    # The same rule as key intervals: the prompt [lo, min(pe, q + 1)) and the own run [ss, q + 1).
    masks = {"full_attention": block_mask_from_ranges((lo, torch.minimum(pe, after)), (ss, after), allowed, block)}
    layer_types, window, every_layer = sliding_layers(config)
    if window:
        def sliding(bi, h, q, k):  # query position - key position < window
            prompt = (k >= lo[bi, q]) & (k < pe[bi, q]) & (shift[bi, q] - k < window)
            own = (k >= ss[bi, q]) & (q - k < window)
            return (k <= q) & (prompt | own)

        prompt = (torch.maximum(lo, shift - window + 1), torch.minimum(pe, after))
        own = (torch.maximum(ss, q - window + 1), after)
        masks["sliding_attention"] = block_mask_from_ranges(prompt, own, sliding, block)
    if layer_types:
        return {lt: masks.get(lt, masks["full_attention"]) for lt in set(layer_types)}
    return masks["sliding_attention" if every_layer else "full_attention"]


def block_mask_from_ranges(first: tuple[torch.Tensor, torch.Tensor], second: tuple[torch.Tensor, torch.Tensor],
                           mask_mod, block: int = FLEX_BLOCK, max_elements: int = 1 << 24):
    """The ``BlockMask`` of a rule under which each query attends two intervals of keys,
    ``[first[0], first[1]) | [second[0], second[1])`` (``(B, T)`` int32 bounds each; an empty
    interval has its end at or before its start), with ``mask_mod`` the same rule element by
    element (FlexAttention applies it on the blocks that are neither empty nor full).

    The blocks are those of ``create_block_mask(mask_mod, B, None, T, T, BLOCK_SIZE=block)``,
    tensor for tensor (``tests/scoring/test_attention.py`` compares them), counted from the intervals
    instead of from the ``(B, T, T)`` mask: for each query and each block of keys, how many of
    the block's keys the query attends (``|A ∩ J| + |B ∩ J| - |A ∩ B ∩ J|``), then the least and
    the most over the block's queries: a block is full when every query attends all of its
    ``block`` keys, partial when some query attends some key and it is not full. That is
    ``B x T x T / block`` integers instead of ``B x T x T`` evaluations of ``mask_mod``, with no
    compile: ``create_block_mask`` run eagerly materialises the dense mask (4 GiB of booleans for
    one row of 65,536 tokens), and compiled, as transformers runs it on GPUs, it costs a compile
    in the pass's first batch. Queries past ``T`` in the last block (``T`` not a multiple of
    ``block``) count as attending nothing, as the padding of ``create_block_mask`` does."""
    (a0, a1), (b0, b1) = first, second
    rows, t = a0.shape
    n = -(-t // block)  # blocks per side
    k0 = torch.arange(n, device=a0.device, dtype=a0.dtype) * block  # (n,) first key of each block
    k1 = (k0 + block).clamp_(max=t)  # (n,) one past its last key
    c0, c1 = torch.maximum(a0, b0), torch.minimum(a1, b1)  # A ∩ B, counted twice by the sum
    partial = torch.empty(rows, n, n, dtype=torch.bool, device=a0.device)  # (B, query block, key block)
    full = torch.empty_like(partial)
    step = max(1, max_elements // (rows * block * n))  # query blocks per chunk: bounded temporaries

    def keys(lo: torch.Tensor, hi: torch.Tensor, queries: slice) -> torch.Tensor:
        """(B, queries, n): how many keys of each block lie in [lo, hi) for each query."""
        return (torch.minimum(hi[:, queries, None], k1) - torch.maximum(lo[:, queries, None], k0)).clamp_(min=0)

    for i in range(0, n, step):
        j = min(n, i + step)
        queries = slice(i * block, min(t, j * block))
        count = keys(a0, a1, queries) + keys(b0, b1, queries) - keys(c0, c1, queries)  # (B, queries, n)
        missing = (j - i) * block - count.shape[1]  # queries past T in the last block attend nothing
        count = F.pad(count, (0, 0, 0, missing)).view(rows, j - i, block, n)
        least, most = count.amin(2), count.amax(2)  # (B, j - i, n)
        full[:, i:j] = least == block
        partial[:, i:j] = (most > 0) & (least < block)

    def ordered(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, n, n) bool → (B, 1, n) block counts and (B, 1, n, n) their key-block indices first."""
        blocks = blocks.to(torch.int32)
        indices = torch.argsort(blocks, dim=-1, descending=True, stable=True)
        return blocks.sum(-1, dtype=torch.int32)[:, None], indices.to(torch.int32)[:, None]

    return BlockMask.from_kv_blocks(*ordered(partial), *ordered(full), BLOCK_SIZE=block, mask_mod=mask_mod,
                                    seq_lengths=(t, t))


# ------------------------------------------------------------------------------- log-probs


def shared_prompt_logps(lp: nn.Module, batch: SharedPromptBatch) -> torch.Tensor:
    """``(M,)`` fp32 log-probs of the scored tokens of ``batch``, through ``lp``'s own
    ``forward`` (a ``CompletionLogProbs``, possibly DDP/FSDP2-wrapped, so their hooks run): its
    body with the block mask, then its chunked, completion-only output head (the same code the
    padded layout runs)."""
    config = scorer_core(lp).config
    if is_causal(config):
        if batch.rows is None:
            raise ValueError("the causal attention backend needs the batch's sequence rows (layout_batch)")
        mask = batch.rows
    else:
        mask = flex_block_masks(batch, config) if is_flex(config) else attention_mask(batch, config)
    return lp(batch.input_ids, mask, position_ids=batch.position_ids, source=batch.source, labels=batch.labels)


def sequence_sums(logps: torch.Tensor, batch: SharedPromptBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """``(M,)`` scored log-probs → (chosen sums ``(B,)``, rejected sums ``(B,)``), fp32: each
    sequence's tokens are one run of ``logps`` (``data.values.completion_sums``)."""
    return completion_sums(logps.float(), batch.chosen_tokens, batch.rejected_tokens)


def split_per_token(logps: torch.Tensor, batch: SharedPromptBatch,
                    pairs: Sequence[TokenizedPair] | None = None) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """``(M,)`` → per-pair lists of chosen and of rejected per-token log-probs (the counts from
    ``pairs`` when given: known on the host, no device sync)."""
    if pairs is not None:
        counts = [n for p in pairs for n in (len(p.chosen_ids), len(p.rejected_ids))]  # c0, r0, c1, r1, ...
    else:
        counts = torch.stack([batch.chosen_tokens, batch.rejected_tokens], 1).reshape(-1).tolist()
    parts = logps.split(counts)
    return list(parts[0::2]), list(parts[1::2])
