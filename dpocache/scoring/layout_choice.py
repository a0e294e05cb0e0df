"""Which layout runs: one rule for the reference pass (cache build) and for training, in one
process, under DDP and under FSDP2.

Layouts (how pairs become model inputs):

- ``padded`` (``dpocache.scoring.padded``): two right-padded rows per pair, ``prompt + chosen`` and
  ``prompt + rejected``; runs on every model.
- ``shared`` (``dpocache.scoring.shared``): one row ``prompt + chosen + rejected`` per pair with a
  block mask and position ids restarting per completion; each prompt runs once.
- ``packed`` (``dpocache.scoring.shared`` and ``dpocache.scoring.packing``): the shared layout with several
  pairs per row, block-diagonal between pairs, positions restarting per pair: the reference
  pass fills one row of ``--cache.max_tokens`` per forward, training packs a micro-batch into
  rows of its longest pair (into one row under the ``causal`` backend:
  ``scoring.shared.layout_batch``). Same support as ``shared``.

``auto`` (the default) is, wherever they run, ``packed`` in training and ``shared`` in the
reference pass (``packed`` there too under the ``causal`` attention backend), else ``padded``.
Measured against the padded layout in one process on 2 CPU cores (``bench/bench_layouts.py``,
fp32: docs/benchmarks/layouts-cpu-2core-20261122.md):

- training: shared and packed both well ahead of padded, packed a little ahead of shared (within
  each other's noise). A packed micro-batch's rows are as wide as the shared layout's (its
  longest pair) and never more of them: packing can only remove rows.
- reference pass: shared ahead of padded and of packed, at the token budgets of 4096 and 1024.
  With the dense SDPA mask a row's attention grows as its width squared, and length-sorted
  batches leave the shared layout little padding to remove. Packed reference rows are for
  FlexAttention, whose block-sparse kernel skips the masked blocks (measured on an H100:
  docs/benchmarks/probes-h100-20261122.md), and for the ``causal`` backend, whose attention
  runs on each sequence's own row whatever the batch's rows: there a packed pass is one full
  row of the budget per forward, with none of the shared layout's padding (2% of the GPU
  suite's 8B pass: 28 forwards against 26).

The shared and packed layouts need
an attention that takes a custom 4D mask (``sdpa`` or ``eager``), the fast path's reproduced
output head (``CompletionLogProbs.fast_path``) and, in training, no router loss: a
mixture-of-experts model's load-balancing loss is computed from the padded layout's 2D mask.
A fallback is never silent: ``LayoutChoice.reason`` says why, and ``run.json`` and the cache
build's JSON summary carry the choice.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Callable

PADDED, SHARED, PACKED = "padded", "shared", "packed"  # one row per sequence; one per pair; several pairs a row
LAYOUTS = ("auto", PADDED, SHARED, PACKED)
PROMPT_SHARING = (SHARED, PACKED)  # the layouts that run each prompt once for both completions
ATTENTIONS = ("auto", "sdpa", "flex", "causal")  # backends of the shared and packed layouts (scoring.attention)
COMPILES = ("auto", "on", "off")  # the reference pass's decoder layers compiled (dpocache.scoring.compiling)
CAUSAL = "dpocache_causal"  # transformers' name of dpocache.scoring.attention's causal backend
# Which SDPA kernels the causal backend's rows may use (dpocache.scoring.attention.sdpa_kernels): not
# cuDNN (the default), or any (SDPA's own choice; to measure the choice again).
CAUSAL_SDPA_ENV = "DPOCACHE_CAUSAL_SDPA"
CAUSAL_SDPA_MODES = ("no-cudnn", "any")
# Into how many groups of similar lengths the causal backend's rows go (dpocache.scoring.shared.ROW_GROUPS;
# the default first): 1 is every row as wide as the batch's longest sequence, to measure the groups again.
ROW_GROUPS_ENV = "DPOCACHE_ROW_GROUPS"
ROW_GROUPS_MODES = ("3", "1", "2", "4")
# How bf16 linears run on a CPU (dpocache.scoring.bf16_matmul); here, as the two above, so that checking
# the environment (config.validate_environment) imports no torch.
BF16_MATMUL_ENV = "DPOCACHE_BF16_MATMUL"
BF16_MATMUL_MODES = ("auto", "native", "fp32-gemm")
# How a LoRA layer's fp32 input reaches its bf16 products (dpocache.models.lora_fused): cast once for
# the layers that share it (the default), or by autocast for each product (to measure the choice again).
LORA_CAST_ENV = "DPOCACHE_LORA_CAST"
LORA_CAST_MODES = ("once", "per-product")
# Attentions that serve the shared and packed layouts: with their custom mask, a dense one (sdpa,
# eager) or a BlockMask (flex_attention), or with their sequence rows (causal; dpocache.scoring.attention).
BLOCK_MASK_ATTENTION = ("sdpa", "eager", "flex_attention", CAUSAL)


def shares_prompts(layout: str) -> bool:
    """Whether ``layout`` runs each prompt once for both completions (``shared``, ``packed``)."""
    return layout in PROMPT_SHARING


def may_share_prompts(requested: str) -> bool:
    """Whether a requested layout (``--train.layout``, ``--cache.layout``) may run each prompt
    once: ``auto`` (packed where supported), ``shared`` and ``packed``; not ``padded``."""
    return requested == "auto" or shares_prompts(requested)


def every_layer_slides(get: Callable[[str, Any], Any]) -> bool:
    """Whether a model slides a window on every layer, its config's fields read through
    ``get(name, default)`` (a config object's ``getattr``, a ``config.json`` dict's ``get``): a
    ``sliding_window`` and no ``layer_types`` (Mistral, Mixtral, Phi-3, Starcoder2), unless
    ``use_sliding_window`` is false (Qwen3-MoE's default). transformers builds such a model's
    sliding mask from these fields alone (``scoring.shared.sliding_layers``)."""
    return (get("sliding_window", None) is not None and not get("layer_types", None)
            and bool(get("use_sliding_window", True)))


@dataclass(frozen=True)
class LayoutChoice:
    """The layout asked for, the one that runs, the model's attention, and why they differ."""

    requested: str
    used: str  # "padded", "shared" or "packed"
    attention: str  # the attention that ran (config._attn_implementation: sdpa, eager, flex_attention, ...)
    reason: str | None = None  # why ``used`` (or the attention) is not what was asked for (None: no fallback)

    def to_json(self) -> dict:
        return asdict(self)


def select_layout(requested: str, config, fast_path: bool = True, router_loss: bool = False,
                  attention_reason: str | None = None, training: bool = False) -> LayoutChoice:
    """The layout that runs for ``requested`` (``auto``, ``padded``, ``shared`` or ``packed``)
    on a model with ``config``; ``fast_path``: the chunked head reproduces the model's (else its
    own forward runs, on padded rows); ``router_loss``: training needs a MoE load-balancing
    loss; ``attention_reason``: why a requested attention backend did not run
    (``dpocache.scoring.attention.use_attention``), carried into the choice's reason; ``training``:
    ``auto`` means ``packed`` (see the module docstring)."""
    if requested not in LAYOUTS:
        raise ValueError(f"layout must be one of {', '.join(LAYOUTS)}; got '{requested}'")
    attention = str(getattr(config, "_attn_implementation", None) or "unknown")
    reason = None
    if requested == PADDED:
        pass
    elif attention not in BLOCK_MASK_ATTENTION:
        reason = (f"attention '{attention}' takes no custom 4D mask (the {requested} layout needs sdpa, eager or "
                  "flex_attention)")
    elif not fast_path:
        reason = "the model's output head is not reproduced by the chunked head; its own forward runs on padded rows"
    elif router_loss:
        reason = "mixture-of-experts: the router's load-balancing loss is computed on the padded layout"
    reasons = "; ".join(r for r in (attention_reason, reason) if r) or None
    if requested == PADDED or reason is not None:
        return LayoutChoice(requested, PADDED, attention, reasons)
    auto = PACKED if training or attention == CAUSAL else SHARED
    return LayoutChoice(requested, auto if requested == "auto" else requested, attention, reasons)
