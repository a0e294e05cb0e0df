"""Attention backends behind the shared and packed layouts (``--attention auto|sdpa|flex``).

- ``sdpa``: the model's attention as loaded (``sdpa``, or ``eager``) with the dense boolean
  block mask ``(B, 1, T, T)`` of ``prefix.attention_mask``; every query scores every key of its
  row, masked or not.
- ``flex``: ``torch.nn.attention.flex_attention`` (compiled by transformers' flex integration)
  with a ``BlockMask`` (``prefix.flex_block_masks``) over the same rule, written as a
  ``mask_mod`` over two int32 key ranges per query (``prefix.key_ranges``: its pair's prompt,
  and its own completion up to itself), and the sliding window on positions where a layer type
  has one; its blocks are counted from the same ranges, with no compile
  (``prefix.block_mask_from_ranges``). Blocks of 128 x 128 that the rule masks entirely are
  skipped, so the cost follows the tokens that attend, not ``T**2``. Gemma 2's attention soft-capping is a
  ``score_mod`` that transformers' ``flex_attention_forward`` applies from the model's
  ``softcap`` argument. Torch 2.13 runs it compiled on CPU too, forward only (no backward:
  training on CPU keeps ``sdpa``).

``auto`` is ``sdpa``, on GPUs too; ``flex`` runs when asked for where the architecture
supports it (``_supports_flex_attn``), and a requested ``flex`` that cannot run falls back to
``sdpa`` and says why; a run on the padded layout keeps the model's loaded attention, and says
so too (``choose_layout``). Measured on an H100 (1.1B Llama, bf16, 256 pairs up to 2,600 tokens,
``--max-tokens 32768``; README, "On a GPU"): with the mask rule of ``prefix.key_ranges`` the
kernel on a packed row of 32,768 tokens takes 2.9 ms (the rule it replaced 18.6 ms), and the
reference pass with its decoder layers compiled runs at 149,000 tokens/s under flex (packed
rows padded to the budget, ``prefix.reference_row_width``) against 145,500 under sdpa (shared
rows), 1.02x, for 3 s more of compiles; a whole 1,024-pair ``cache build --compile on`` ran at
45,800 tokens/s under flex against 60,600 under sdpa. Not enough to make flex the default.
Varlen flash attention (two unmasked causal sequences per pair) was measured there too and is
not offered: 1.31x the masked SDPA kernel, torch 2.11's having no grouped-query support. On the
CPU flex compiles each shape statically (``compile_settings``). The model is switched in place
(``set_attn_implementation``), so its config names the backend that runs and
``dpocache.layouts.LayoutChoice.attention`` records it.

Rows are padded to a multiple of ``FLEX_BLOCK`` tokens for flex: the BlockMask's block size,
and few distinct row widths, so the compiled kernel is reused instead of recompiled per batch;
packed reference rows all to the token budget (one width: ``prefix.reference_row_width``).
"""

from __future__ import annotations

import contextlib
from dataclasses import replace

import torch
from torch import nn

from .layouts import ATTENTIONS, LayoutChoice, select_layout

FLEX = "flex_attention"  # transformers' name of the implementation
FLEX_BLOCK = 128  # torch's default BlockMask block size


def flex_supported(model: nn.Module) -> str | None:
    """Why ``model`` (a transformers causal LM) cannot run FlexAttention here (None: it can)."""
    try:
        from torch.nn.attention.flex_attention import create_block_mask  # noqa: F401
    except ImportError:
        return "this torch has no torch.nn.attention.flex_attention"
    if not getattr(type(model), "_supports_flex_attn", False):
        return f"{type(model).__name__} does not support flex_attention in transformers"
    return None


def use_attention(model: nn.Module, requested: str | None, device: torch.device | str,
                  backward: bool = False) -> str | None:
    """Switch ``model`` (a transformers causal LM) to the backend ``requested`` resolves to on
    ``device`` (None: leave it as loaded); ``backward``: training will differentiate through
    it. Returns why a requested ``flex`` did not run (None: no fallback)."""
    if requested is None:
        return None
    if requested not in ATTENTIONS:
        raise ValueError(f"attention must be one of {', '.join(ATTENTIONS)}; got '{requested}'")
    on_cuda = torch.device(device).type == "cuda"
    why_not = flex_supported(model)
    if why_not is None and backward and not on_cuda:
        why_not = "FlexAttention has no backward on CPU (torch 2.13)"
    wants_flex = requested == "flex"  # auto: sdpa (the module docstring says why)
    flex = wants_flex and why_not is None
    current = getattr(model.config, "_attn_implementation", None)
    if flex and current != FLEX:
        model._dpocache_loaded_attention = current  # to switch back to (Gemma 2 has eager, no sdpa)
        model.set_attn_implementation(FLEX)
    elif not flex and current == FLEX:  # a model switched to flex earlier in this process
        model.set_attn_implementation(getattr(model, "_dpocache_loaded_attention", None) or "sdpa")
    ran = model.config._attn_implementation
    return f"{why_not}; {ran} ran" if wants_flex and why_not else None


def choose_layout(model: nn.Module, scorer: nn.Module, requested: str, attention: str | None,
                  training: bool = False) -> LayoutChoice:
    """The layout and attention that run, for the reference pass and for training alike:
    ``model`` (a transformers causal LM) switched to the ``attention`` backend first
    (``use_attention``; ``training``: a backward runs through it), then
    ``layouts.select_layout``'s rule for ``scorer`` (a ``CompletionLogProbs``: its head probe
    and, in training, its router loss).

    The padded layout has no block mask, so when it runs (requested, or a fallback) a model
    switched to flex goes back to its loaded attention, and the choice says so. Left on flex,
    transformers built a ``BlockMask`` from the padding and compiled the kernel for every batch
    shape on the CPU: a 24-pair ``cache build --layout padded --attention flex`` of a tiny model
    took 260 s against 14 s under sdpa."""
    device = next(model.parameters()).device
    why = use_attention(model, attention, device, backward=training)
    choice = select_layout(requested, scorer.config, fast_path=scorer.fast_path,
                           router_loss=training and scorer.router_loss, attention_reason=why, training=training)
    if choice.used != "padded" or not is_flex(model.config):
        return choice
    use_attention(model, "sdpa", device)
    note = "the padded layout runs the model's loaded attention (flex serves the shared and packed layouts)"
    return replace(choice, attention=str(model.config._attn_implementation),
                   reason="; ".join(r for r in (choice.reason, note) if r))


def is_flex(config) -> bool:
    return getattr(config, "_attn_implementation", None) == FLEX


# Row shapes a CPU run compiles FlexAttention for before dynamo runs it uncompiled (with a warning).
FLEX_CPU_SHAPES = 64


def compile_settings(config, device: torch.device | str):
    """The context a forward of a model that may run FlexAttention runs in: on the CPU, one
    static compile per row shape (``(batch, heads, width)``), up to ``FLEX_CPU_SHAPES``.

    transformers compiles ``flex_attention`` with dynamo's automatic dynamic shapes: the second
    row width of a run recompiles it with the key length symbolic, and torch 2.13's inductor
    fails to build that CPU kernel (a C++ compile error, ``cur_kvSplitSize8`` undeclared: the
    third batch of a shared-layout reference pass on the 58m bench model). Compiled per shape
    it runs (about 10 s per compile on a 2-core CPU; widths are multiples of ``FLEX_BLOCK``).
    GPUs keep dynamic shapes."""
    if not is_flex(config) or torch.device(device).type != "cpu":
        return contextlib.nullcontext()
    return torch._dynamo.config.patch(automatic_dynamic_shapes=False, recompile_limit=FLEX_CPU_SHAPES)


def row_multiple(config) -> int:
    """Row widths are padded to a multiple of this (``FLEX_BLOCK`` for flex, else 1)."""
    return FLEX_BLOCK if is_flex(config) else 1
