"""The causal rows' attention kept through activation checkpointing's recompute
(``--checkpoint-keep attention``).

A checkpointed layer's recompute runs its attention forward again only because the attention's
backward reads what that forward saved. Flash attention's backward reads its inputs (queries,
keys and values, which the recompute rebuilds from the layer's input at the cost of three
projections and RoPE), its output and the log-sum-exp of each query's scores. This keeps the
last two from the forward (``dpocache::kept_rows_attention``): the recompute takes them instead
of running the flash forward again, and the backward is flash attention's own
(``dpocache::rows_attention_backward``). What it keeps is one ``(tokens, heads x head_dim)``
tensor in the compute dtype per decoder layer, the attention's output (the o projection's input),
and 4 bytes per head and row slot: the memory of the o projection's product, for more of the
recompute's time (docs/memory.md, "The attention's output, kept").

It serves the ``causal`` backend (``scoring.attention.causal_attention_forward``: each sequence
in a row of its own, rows in groups), where the rows' layout says which outputs are read: the
output is kept per batch token, as the o projection reads it, and the backward gathers it back
into the rows. A row slot whose output no token reads (a prompt query's copy in its pair's second
row, a slot past a sequence's end) gets a zero output gradient, and flash attention's backward
reads a query's output only through ``sum(dO * O)`` of that query, so whatever output such a slot
is given changes nothing: the gradients are those of the recompute, bit for bit
(``tests/models/test_kept_attention.py``). The keys' and values' gradients sum a prompt's copies
as ``scoring.attention._GatherRows`` does.

It runs where flash attention does: CUDA in bf16 or fp16 with a head size a multiple of 8 up to
256 (on GPUs flash attention runs on, Ampere and later), and CPUs (torch's CPU flash kernel, in
fp32, bf16 or fp16); with attention dropout, or elsewhere, the layer runs the causal rows as
without it. Both operations are opaque to the compiler, so a layer compiled inside its
checkpoint (``LayerCheckpoint``) keeps its attention too: the phase of the call is read when the
operation runs, not when it is traced.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from dpocache.config import KEEP_ATTENTION, ConfigError, flag_name
from dpocache.models.checkpoint_phases import current_phase
from dpocache.scoring.attention import ROWS_ATTENTION, row_slots, slots_as_rows
from dpocache.scoring.logprobs import decoder_layers

log = logging.getLogger(__name__)

# Keys of what one checkpointed call keeps (checkpoint_phases.Phase): each layer has one attention.
_OUTPUT, _LOGSUMEXP = "attention output", "attention logsumexp"


def keep_attention_(model: nn.Module) -> list[str]:
    """Give the attention module of each of ``model``'s decoder layers (``self_attn``) the kept
    rows' attention (``kept_rows_attention``, read by ``causal_attention_forward``). Returns
    their qualified names. A decoder layer without ``self_attn`` is a ``ConfigError`` naming
    the flag."""
    qualified = {id(m): name for name, m in model.named_modules()}
    modules = [getattr(layer, "self_attn", None) for layer in decoder_layers(model)]
    if any(m is None for m in modules):
        raise ConfigError(f"{flag_name('model.checkpoint_keep')}: {KEEP_ATTENTION}: the decoder layers have no "
                          "self_attn module to keep the output of")
    for module in modules:
        setattr(module, ROWS_ATTENTION, kept_rows_attention)
    log.info("activation checkpointing keeps the attention's output in %d decoder layers", len(modules))
    return [qualified[id(m)] for m in modules]


def flash_serves(query: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether flash attention's own operations run ``query``'s attention in ``dtype``: CUDA in
    bf16 or fp16 with a head size that is a multiple of 8 up to 256; CPUs in fp32, bf16 or fp16."""
    if query.device.type == "cpu":
        return dtype in (torch.float32, torch.bfloat16, torch.float16)
    head = query.shape[-1]
    return query.device.type == "cuda" and dtype in (torch.bfloat16, torch.float16) and head % 8 == 0 and head <= 256


def kept_rows_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        gather: tuple[torch.Tensor, ...], scatter: torch.Tensor, second: torch.Tensor,
                        dropout: float = 0.0, scaling: float | None = None, **_) -> torch.Tensor | None:
    """The causal rows' attention of ``query (B, H, T, D)``, ``key``/``value (B, Hkv, T, D)``
    (``gather``, ``scatter``, ``second``: ``scoring.attention.SequenceRows``), its output kept
    through the recompute → ``(B, T, H, D)``; None where it cannot run (attention dropout, or
    no flash kernel for these inputs: ``flash_serves``), and the caller runs the rows as
    without it."""
    dtype = _compute_dtype(query, key, value)
    if dropout or dtype is None or not flash_serves(query, dtype):
        return None
    b, h, t, d = query.shape
    flat = [x.transpose(1, 2).reshape(b * t, x.shape[1], d) for x in (query, key, value)]
    scale = d ** -0.5 if scaling is None else float(scaling)
    out, _ = torch.ops.dpocache.kept_rows_attention(*flat, list(gather), scatter, second, scale, dtype)
    return out.view(b, t, h, d)


def _compute_dtype(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.dtype | None:
    """The dtype SDPA would compute in: autocast's where it is on for the inputs' device (RoPE
    in fp32 leaves queries and keys in fp32 beside bf16 values), else the inputs' own (None
    where they differ)."""
    device = query.device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return query.dtype if query.dtype == key.dtype == value.dtype else None


def _rows(x: torch.Tensor, slots: torch.Tensor, gather: list[torch.Tensor], dtype: torch.dtype) -> list[torch.Tensor]:
    """``x (N, h, D)`` in ``dtype`` gathered into the rows of each group → ``[(S_g, h, W_g, D)]``
    (cast first: the same values as a cast of the rows, over fewer of them)."""
    return slots_as_rows(x.to(dtype).index_select(0, slots), gather)


def _flash_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float):
    """Causal flash attention of one group's rows → ``(out (S, H, W, D), logsumexp (S, H, W) fp32)``."""
    if q.device.type == "cuda":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True, False, scale=scale)[:2]
        return out, lse
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True, scale=scale)


def _flash_backward(grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                    lse: torch.Tensor, scale: float):
    """``_flash_forward``'s backward → ``(dq, dk, dv)``. Without dropout the CUDA kernel reads
    no random state: a zero seed and an empty offset, as torch's own varlen attention passes."""
    if q.device.type == "cuda":
        seed = torch.zeros(2, dtype=torch.uint64, device=q.device)
        width = q.shape[2]
        return torch.ops.aten._scaled_dot_product_flash_attention_backward(
            grad, q, k, v, out, lse, None, None, width, width, 0.0, True, seed, torch.empty(0, device=q.device),
            scale=scale)
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        grad, q, k, v, out, lse, 0.0, True, scale=scale)


@torch.library.custom_op("dpocache::kept_rows_attention", mutates_args=())
def _kept_rows_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, gather: list[torch.Tensor],
                         scatter: torch.Tensor, second: torch.Tensor, scale: float,
                         dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The causal rows' attention of ``query (N, H, D)``, ``key``/``value (N, Hkv, D)`` (``N``
    the batch's tokens), computed in ``dtype`` as SDPA's autocast casts its inputs → ``(out
    (N, H, D) in dtype, logsumexp (H * slots,) fp32)``, each group's ``(S_g, H, W_g)``
    flattened in turn. In a checkpointed call's forward both are kept (copies:
    a compiled graph may reuse its outputs' memory), and its recompute returns them."""
    phase = current_phase()
    if phase is not None and phase.recompute:
        return phase.take(_OUTPUT), phase.take(_LOGSUMEXP)
    slots = row_slots(gather)
    outs, lses = zip(*(_flash_forward(q, k, v, scale)
                       for q, k, v in zip(*(_rows(x, slots, gather, dtype) for x in (query, key, value)))))
    out = _slots_of_rows(outs).index_select(0, scatter)
    lse = torch.cat([lse.reshape(-1) for lse in lses])
    if phase is not None:
        phase.keep(_OUTPUT, out.clone())
        phase.keep(_LOGSUMEXP, lse.clone())
    return out, lse


@_kept_rows_attention.register_fake
def _(query, key, value, gather, scatter, second, scale, dtype):
    return (query.new_empty(query.shape, dtype=dtype),
            query.new_empty((query.shape[1] * sum(g.numel() for g in gather),), dtype=torch.float32))


def _kept_context(ctx, inputs, output) -> None:
    query, key, value, gather, scatter, second, scale, _ = inputs
    out, lse = output
    ctx.save_for_backward(query, key, value, scatter, second, out, lse, *gather)
    ctx.scale = scale


def _kept_backward(ctx, grad: torch.Tensor, _grad_lse):
    query, key, value, scatter, second, out, lse, *gather = ctx.saved_tensors
    dq, dk, dv = torch.ops.dpocache.rows_attention_backward(grad, query, key, value, out, lse, gather, scatter,
                                                            second, ctx.scale)
    return dq, dk, dv, [None] * len(gather), None, None, None, None


_kept_rows_attention.register_autograd(_kept_backward, setup_context=_kept_context)


@torch.library.custom_op("dpocache::rows_attention_backward", mutates_args=())
def _rows_attention_backward(grad: torch.Tensor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                             out: torch.Tensor, lse: torch.Tensor, gather: list[torch.Tensor], scatter: torch.Tensor,
                             second: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``dpocache::kept_rows_attention``'s backward: ``grad (N, H, D)`` of its output →
    ``(dq (N, H, D), dk, dv (N, Hkv, D))``. Each row slot gets the gradient of the token that
    reads its output (zero where none does) and the output that token took (any other, where
    none does: a zero gradient reads nothing of it); a query's gradient is its read slot's, a
    key's or value's the sum of its read slot's and, for a prompt token, its copy's in its
    pair's second row (``second``)."""
    slots, dtype, heads = row_slots(gather), out.dtype, query.shape[1]
    grad_rows = slots_as_rows(grad.new_zeros((len(slots), *grad.shape[1:])).index_copy_(0, scatter, grad), gather)
    lses = [part.view(g.shape[0], heads, g.shape[1]) for part, g in zip(lse.split([g.numel() * heads for g in gather]),
                                                                          gather)]
    rows = zip(grad_rows, *(_rows(x, slots, gather, dtype) for x in (query, key, value, out)), lses)
    grads = [_flash_backward(*group, scale) for group in rows]
    # in the inputs' dtypes before a key's copies are summed, as autocast's casts give them to the rows' gathers
    dq, dk, dv = (_slots_of_rows([part[i] for part in grads]).to(x.dtype) for i, x in enumerate((query, key, value)))
    return dq.index_select(0, scatter), _summed(dk, scatter, second), _summed(dv, scatter, second)


def _slots_of_rows(rows: list[torch.Tensor]) -> torch.Tensor:
    """Each group's rows ``(S_g, h, W_g, D)`` → ``(slots, h, D)``, group after group, row after row."""
    return torch.cat([r.transpose(1, 2).reshape(-1, r.shape[1], r.shape[3]) for r in rows])


def _summed(grad_slots: torch.Tensor, scatter: torch.Tensor, second: torch.Tensor) -> torch.Tensor:
    """A key's or value's gradient: its read slot's plus its second row copy's (a zero slot where it has none)."""
    return grad_slots.index_select(0, scatter) + grad_slots.index_select(0, second)


@_rows_attention_backward.register_fake
def _(grad, query, key, value, out, lse, gather, scatter, second, scale):
    return torch.empty_like(query), torch.empty_like(key), torch.empty_like(value)
