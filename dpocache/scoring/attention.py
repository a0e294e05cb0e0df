"""Attention backends behind the shared and packed layouts (``--attention auto|sdpa|flex|causal``).

- ``sdpa``: the model's attention as loaded (``sdpa``, or ``eager``) with the dense boolean
  block mask ``(B, 1, T, T)`` of ``scoring.shared.attention_mask``; every query scores every key
  of its row, masked or not.
- ``flex``: ``torch.nn.attention.flex_attention`` (compiled by transformers' flex integration)
  with a ``BlockMask`` (``scoring.shared.flex_block_masks``) over the same rule, written as a
  ``mask_mod`` over two int32 key ranges per query (``scoring.shared.key_ranges``: its pair's
  prompt, and its own completion up to itself), and the sliding window on positions where a
  layer type has one; its blocks are counted from the same ranges, with no compile
  (``scoring.shared.block_mask_from_ranges``). Blocks of 128 x 128 that the rule masks entirely
  are skipped, so the cost follows the tokens that attend, not ``T**2``. Gemma 2's attention
  soft-capping is a ``score_mod`` that transformers' ``flex_attention_forward`` applies from the
  model's ``softcap`` argument. Torch 2.13 runs it compiled on CPU too, forward only (no
  backward: training on CPU keeps ``sdpa``).
- ``causal``: each sequence (a pair's prompt, then one of its completions) gathered into a row
  of its own (``SequenceRows``, built by the collate) and run through SDPA's causal kernel with
  no mask (flash, not cuDNN: ``sdpa_kernels``), outputs taken back to the batch's rows. Only
  the prompt's attention to itself runs twice; no ``T x T`` mask is built or read. The rows come
  in a few groups of similar lengths, each as wide as its longest (one SDPA call each): a row's
  work grows with its width squared, and one width for all spent half of it on padding. It needs
  transformers' attention interface and plain causal layers (no sliding window, no
  soft-capping: ``causal_supported``).

``auto`` is ``causal`` on GPUs where it serves the model, else ``sdpa``. On an H100 the causal
rows on flash ran the eager reference pass faster than sdpa's masked kernel, and a pass whose
batch shapes are new (as in a cache build) faster than the causal rows on cuDNN
(``bench/probes/gpu_compile_probe.py --variant causal|sdpa [--no-cudnn-sdp]``:
docs/benchmarks/vs-trl-h100-20261123.md). On the 2-core CPU the one masked flash call measured
faster than the shared row split into causal calls and than SDPA's math backend
(``bench/probes/cpu_attention_probe.py``: docs/benchmarks/vs-trl-cpu-avx2-2core-20261123.md), so
``auto`` stays ``sdpa`` there. ``flex`` runs when asked for where the architecture supports it
(``_supports_flex_attn``), and a requested ``flex`` or ``causal`` that cannot run falls back to
``sdpa`` and says why; a run on the padded layout keeps the model's loaded attention, and says
so too (``choose_layout``). Flex is not the default: on an H100, with the mask rule of
``scoring.shared.key_ranges`` and the decoder layers compiled, its best reference pass (packed
rows padded to the budget, ``scoring.layouts.reference_row_width``) was barely faster than
compiled sdpa's, for longer compiles, and a whole ``cache build --compile on`` ran slower under
flex than under sdpa (docs/benchmarks/probes-h100-20261122.md). Varlen flash attention (two
unmasked causal sequences per pair) was measured there too and is not offered: its gain on the
attention kernel is a small part of the pass, and torch 2.11's has no grouped-query support.
On the CPU flex compiles each shape statically (``compile_settings``). The model is switched in
place (``set_attn_implementation``), so its config names the backend that runs and
``dpocache.scoring.layout_choice.LayoutChoice.attention`` records it.

Rows are padded to a multiple of ``FLEX_BLOCK`` tokens for flex: the BlockMask's block size,
and few distinct row widths, so the compiled kernel is reused instead of recompiled per batch;
packed reference rows all to the token budget (one width: ``scoring.layouts.reference_row_width``).
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import replace
from typing import NamedTuple, Sequence

import torch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from dpocache.scoring.layout_choice import (
    ATTENTIONS,
    CAUSAL,
    CAUSAL_SDPA_ENV,
    CAUSAL_SDPA_MODES,
    LayoutChoice,
    select_layout,
    shares_prompts,
)

FLEX = "flex_attention"  # transformers' name of the implementation
FLEX_BLOCK = 128  # torch's default BlockMask block size
# Set on an attention module whose causal rows run another way: a callable taking the rows'
# inputs (``causal_attention_forward``), returning the output or None (the rows as usual).
# ``--checkpoint-keep attention`` sets ``dpocache.models.kept_attention.kept_rows_attention``.
ROWS_ATTENTION = "dpocache_rows_attention"


class SequenceRows(NamedTuple):
    """Each sequence of a shared or packed batch (its pair's prompt, then one completion)
    gathered into a row of its own, for an unmasked causal kernel (the ``causal`` backend).
    The rows come in groups, ``S_g`` sequences of similar lengths in rows of ``W_g`` slots, each
    row ending past its sequence (``scoring.shared.sequence_rows``); the slots are numbered
    group after group, row after row (a group's first slot after the previous group's
    ``S_g * W_g``). The batch has ``B`` rows of ``T`` tokens.

    A NamedTuple (of a tuple and tensors), so DDP and FSDP2 move and cast its tensors like any
    input's."""

    # per group, (S_g, W_g) long: flat index b*T + t of the batch token in each slot (past a
    # sequence's end: its last token again)
    gather: tuple[torch.Tensor, ...]
    scatter: torch.Tensor  # (B*T,) long: the slot whose attention output each token takes
    # (B*T,) long: a prompt token's slot in its pair's second row; any other token's: a slot past a sequence's end
    second: torch.Tensor

    def map(self, fn) -> "SequenceRows":
        """``fn`` applied to each tensor (``.to(device)``, ``.pin_memory()``)."""
        return SequenceRows(tuple(fn(g) for g in self.gather), fn(self.scatter), fn(self.second))


class _GatherRows(torch.autograd.Function):
    """``x (B*T, h, D)`` → ``x[gather] (slots, h, D)``, whose backward gathers rather than
    scatter-adds (``index_select``'s own backward is an ``index_add_``, atomic adds over every
    slot: docs/benchmarks/gpu-suite-h200-20261126-0556.md).

    A token's gradient is the sum over the slots holding it, and only two of them can be
    nonzero: the slot whose output it takes (``scatter``), and for a key or value of a prompt its
    copy in the pair's second row (``second``). Every other slot holding it (a prompt query's copy,
    a repeat past a sequence's end) produces no output that is read, so its gradient is exactly
    zero: no query after it reads an output, and the causal kernel lets no earlier one see it.
    ``second`` of a token without a copy names a slot past a sequence's end, a zero. So the
    backward is one gather for queries, two and an add for keys and values: the same sum, bit
    for bit (``tests/scoring/test_causal_attention.py``)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, gather: torch.Tensor, scatter: torch.Tensor, second: torch.Tensor | None):
        ctx.save_for_backward(scatter, second)
        return x.index_select(0, gather)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        scatter, second = ctx.saved_tensors
        out = grad.index_select(0, scatter)
        if second is not None:
            out += grad.index_select(0, second)
        return out, None, None, None


class _TakeOutputs(torch.autograd.Function):
    """``out (slots, h, D)`` → ``out[scatter] (B*T, h, D)``, each batch token's attention output;
    its backward copies each token's gradient into its slot (a slot feeds one real token; the
    padding tokens, whose gradient is zero, share one slot past a sequence's end) instead of
    ``index_select``'s atomic ``index_add_``."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, scatter: torch.Tensor):
        ctx.save_for_backward(scatter)
        ctx.slots = out.shape[0]
        return out.index_select(0, scatter)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (scatter,) = ctx.saved_tensors
        return grad.new_zeros((ctx.slots, *grad.shape[1:])).index_copy_(0, scatter, grad), None


def row_slots(gather: Sequence[torch.Tensor]) -> torch.Tensor:
    """The batch token in each slot of ``SequenceRows.gather``'s groups, group after group: ``(slots,)``."""
    return torch.cat([g.reshape(-1) for g in gather]) if len(gather) > 1 else gather[0].reshape(-1)


def slots_as_rows(x: torch.Tensor, gather: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """``x (slots, h, D)``, the slots of ``gather``'s groups in turn, as each group's rows
    ``(S_g, h, W_g, D)`` (views)."""
    parts = x.split([g.numel() for g in gather])
    return [part.view(*g.shape, *x.shape[1:]).transpose(1, 2) for part, g in zip(parts, gather)]


def causal_attention_forward(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                             attention_mask, dpocache_gather: torch.Tensor | None = None,
                             dpocache_scatter: torch.Tensor | None = None, dpocache_second: torch.Tensor | None = None,
                             **kwargs):
    """transformers' attention interface for the ``causal`` backend: ``query (B, H, T, D)``,
    ``key``/``value (B, Hkv, T, D)`` gathered into the sequence rows, ``(S_g, H, W_g, D)`` for
    each group, SDPA with ``is_causal`` and no mask over each group (``sdpa_attention_forward``:
    grouped-query heads, scale, dropout as for sdpa), each batch token's output taken back →
    ``((B, T, H, D), None)``.

    Why it is exact: in a sequence row a completion token sees, causally, its pair's prompt and
    its own completion: the block mask's rule (``scoring.shared.attention_mask``). A prompt token's
    output comes from its pair's first row; the copies in the other rows are discarded (their
    gradient is zero), and keys and values used by several rows sum their gradients
    (``_GatherRows``).

    Without the rows (a plain forward of a switched model, such as a head probe) it is sdpa,
    with the mask transformers built (``register_causal``). A module with ``ROWS_ATTENTION``
    runs its rows through that, where it serves them."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if dpocache_gather is None or dpocache_scatter is None or dpocache_second is None:  # a plain forward
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    other = getattr(module, ROWS_ATTENTION, None)
    if other is not None:
        out = other(query, key, value, dpocache_gather, dpocache_scatter, dpocache_second, **kwargs)
        if out is not None:
            return out, None
    b, t = query.shape[0], query.shape[2]
    slots = row_slots(dpocache_gather)

    def rows(x: torch.Tensor, second: torch.Tensor | None) -> list[torch.Tensor]:  # (B, h, T, D) -> [(S_g, h, W_g, D)]
        flat = x.transpose(1, 2).reshape(b * t, x.shape[1], x.shape[3])
        return slots_as_rows(_GatherRows.apply(flat, slots, dpocache_scatter, second), dpocache_gather)

    kwargs.pop("is_causal", None)
    outs = []
    with sdpa_kernels():
        for q, k, v in zip(rows(query, None), rows(key, dpocache_second), rows(value, dpocache_second)):
            out, _ = sdpa_attention_forward(module, q, k, v, None, is_causal=True, **kwargs)  # (S_g, W_g, H, D)
            outs.append(out.reshape(-1, out.shape[2], out.shape[3]))
    out = torch.cat(outs) if len(outs) > 1 else outs[0]  # (slots, H, D)
    return _TakeOutputs.apply(out, dpocache_scatter).view(b, t, out.shape[1], out.shape[2]), None


# SDPA's kernels for the causal rows: flash, or memory-efficient and math where flash cannot
# (fp32, head sizes past 256); not cuDNN. cuDNN builds an execution plan for each new shape of
# its inputs, and the rows' shape (sequences x longest sequence) is new in almost every batch
# of a cache build and every training step. On an H100 (eager reference pass, 1.1B Llama, bf16)
# flash ran a pass of new shapes, as a cache build is, faster than cuDNN, which was faster only
# over shapes already planned; in a compiled training step each cuDNN call cost several times
# more host time than its kernel took on the GPU (docs/benchmarks/vs-trl-h100-20261123.md).
# CPUs have no cuDNN: there this picks what SDPA would pick anyway.
CAUSAL_SDPA_BACKENDS = (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH)
# ``$DPOCACHE_CAUSAL_SDPA=any`` leaves the causal rows to SDPA's own choice (cuDNN first on
# Hopper GPUs), to measure the choice again; checked by ``Config.validate``. Read once, at
# import: a compiled layer traces the choice into its graph.
CAUSAL_SDPA = os.environ.get(CAUSAL_SDPA_ENV, CAUSAL_SDPA_MODES[0])


def sdpa_kernels() -> contextlib.AbstractContextManager:
    """The SDPA kernels the causal rows may use (``CAUSAL_SDPA_BACKENDS``; all of them with
    ``$DPOCACHE_CAUSAL_SDPA=any``), as a context inside the attention function rather than
    ``torch.backends.cuda.enable_cudnn_sdp``: it touches nothing else in the process (a
    library's user may run other models beside ours), and under ``torch.compile`` it is traced
    into the graph. A process-wide flag is not: torch's AOTAutograd cache does not key on the
    SDPA flags, and a graph traced with cuDNN was reused from it after the flag was switched
    off (docs/benchmarks/vs-trl-h100-20261123.md, "Correction")."""
    if CAUSAL_SDPA == "any":
        return contextlib.nullcontext()
    return sdpa_kernel(list(CAUSAL_SDPA_BACKENDS))


def causal_supported(model: nn.Module) -> str | None:
    """Why ``model`` (a transformers causal LM) cannot run the ``causal`` backend (None: it can):
    it needs transformers' attention interface and plain causal attention in every layer (SDPA
    takes no sliding window and no soft-capping)."""
    config = model.config
    if not getattr(type(model), "_supports_attention_backend", False):
        return f"{type(model).__name__} does not take a custom attention function in transformers"
    if getattr(config, "sliding_window", None) is not None and getattr(config, "use_sliding_window", True):
        return "sliding-window attention layers (SDPA's causal kernel has no window)"
    if getattr(config, "attn_logit_softcapping", None) is not None:
        return "attention soft-capping (SDPA's causal kernel has none)"
    return None


def register_causal() -> None:
    """Register the backend with transformers, its masks for plain forwards those of sdpa."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    if CAUSAL not in AttentionInterface._global_mapping:
        AttentionInterface.register(CAUSAL, causal_attention_forward)
        AttentionMaskInterface.register(CAUSAL, sdpa_mask)


def flex_supported(model: nn.Module) -> str | None:
    """Why ``model`` (a transformers causal LM) cannot run FlexAttention here (None: it can)."""
    if not getattr(type(model), "_supports_flex_attn", False):
        return f"{type(model).__name__} does not support flex_attention in transformers"
    return None


# The implementations dpocache switches a model to, and back from (to the one it was loaded with).
SWITCHED = (FLEX, CAUSAL)


def use_attention(model: nn.Module, requested: str | None, device: torch.device | str,
                  backward: bool = False) -> str | None:
    """Switch ``model`` (a transformers causal LM) to the backend ``requested`` resolves to on
    ``device`` (None: leave it as loaded); ``backward``: training will differentiate through
    it. Returns why a requested ``flex`` or ``causal`` did not run (None: no fallback)."""
    if requested is None:
        return None
    if requested not in ATTENTIONS:
        raise ValueError(f"attention must be one of {', '.join(ATTENTIONS)}; got '{requested}'")
    on_cuda = torch.device(device).type == "cuda"
    if requested == "auto":  # causal on GPUs where it serves the model (the module docstring says why)
        wanted = CAUSAL if on_cuda and causal_supported(model) is None else None
    else:
        wanted = {"flex": FLEX, "causal": CAUSAL}.get(requested)  # sdpa: the loaded attention
    why_not = None
    if wanted == FLEX:
        why_not = flex_supported(model)
        if why_not is None and backward and not on_cuda:
            why_not = "FlexAttention has no backward on CPU (torch 2.13)"
    elif wanted == CAUSAL:
        why_not = causal_supported(model)
    target = wanted if why_not is None else None
    current = getattr(model.config, "_attn_implementation", None)
    if target is not None and current != target:
        if current not in SWITCHED:
            model._dpocache_loaded_attention = current  # to switch back to (Gemma 2 has eager, no sdpa)
        if target == CAUSAL:
            register_causal()
        model.set_attn_implementation(target)
    elif target is None and current in SWITCHED:  # a model switched earlier in this process
        model.set_attn_implementation(getattr(model, "_dpocache_loaded_attention", None) or "sdpa")
    ran = model.config._attn_implementation
    return f"{why_not}; {ran} ran" if why_not else None


def choose_layout(model: nn.Module, scorer: nn.Module, requested: str, attention: str | None,
                  training: bool = False) -> LayoutChoice:
    """The layout and attention that run, for the reference pass and for training alike:
    ``model`` (a transformers causal LM) switched to the ``attention`` backend first
    (``use_attention``; ``training``: a backward runs through it), then
    ``scoring.layout_choice.select_layout``'s rule for ``scorer`` (a ``CompletionLogProbs``: its head probe
    and, in training, its router loss).

    The padded layout has no block mask, so when it runs (requested, or a fallback) a model
    switched to flex goes back to its loaded attention, and the choice says so. Left on flex,
    transformers built a ``BlockMask`` from the padding and compiled the kernel for every batch
    shape on the CPU, which made a small ``cache build --layout padded --attention flex`` many
    times slower than under sdpa (docs/benchmarks/probes-cpu-2core-20261123.md)."""
    device = next(model.parameters()).device
    why = use_attention(model, attention, device, backward=training)
    choice = select_layout(requested, scorer.config, fast_path=scorer.fast_path,
                           router_loss=training and scorer.router_loss, attention_reason=why, training=training)
    if shares_prompts(choice.used) or model.config._attn_implementation not in SWITCHED:
        return choice
    use_attention(model, "sdpa", device)
    note = "the padded layout runs the model's loaded attention (flex and causal serve the shared and packed layouts)"
    return replace(choice, attention=str(model.config._attn_implementation),
                   reason="; ".join(r for r in (choice.reason, note) if r))


def is_flex(config) -> bool:
    return getattr(config, "_attn_implementation", None) == FLEX


def is_causal(config) -> bool:
    return getattr(config, "_attn_implementation", None) == CAUSAL


# Row shapes a CPU run compiles FlexAttention for before dynamo runs it uncompiled (with a warning).
FLEX_CPU_SHAPES = 64


def compile_settings(config, device: torch.device | str):
    """The context a forward of a model that may run FlexAttention runs in: on the CPU, one
    static compile per row shape (``(batch, heads, width)``), up to ``FLEX_CPU_SHAPES``.

    transformers compiles ``flex_attention`` with dynamo's automatic dynamic shapes: the second
    row width of a run recompiles it with the key length symbolic, and torch 2.13's inductor
    fails to build that CPU kernel (a C++ compile error, ``cur_kvSplitSize8`` undeclared: the
    third batch of a shared-layout reference pass on the 58m bench model). Compiled per shape
    it runs, one compile per row width (widths are multiples of ``FLEX_BLOCK``, so few; the
    compile's time on the 2-core CPU: docs/benchmarks/probes-cpu-2core-20261123.md). GPUs keep
    dynamic shapes."""
    if not is_flex(config) or torch.device(device).type != "cpu":
        return contextlib.nullcontext()
    return torch._dynamo.config.patch(automatic_dynamic_shapes=False, recompile_limit=FLEX_CPU_SHAPES)


def row_multiple(config) -> int:
    """Row widths are padded to a multiple of this (``FLEX_BLOCK`` for flex, else 1)."""
    return FLEX_BLOCK if is_flex(config) else 1
