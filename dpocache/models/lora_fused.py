"""A LoRA layer's update added inside one GEMM: ``result.addmm_(h, B.T, alpha=scaling)``.

PEFT's LoRA linear layer computes ``result + lora_B(lora_A(x)) * scaling``: after the base
layer's product and ``lora_A``'s, a product for ``lora_B``, then a multiplication by the scale and
an addition, each a kernel that reads and writes a ``(tokens, out_features)`` tensor, and a third
such kernel in the backward (the scale's). In an 8B Llama with every linear layer adapted those
tensors are up to 14,336 wide (their share of a LoRA step on a GPU:
docs/benchmarks/gpu-suite-h200-20261126-0556.md). Here ``lora_B``'s product
is accumulated into the base layer's output in place, scaled in the GEMM's epilogue: one kernel
instead of three, no ``(tokens, out_features)`` tensor beyond the output, and in the backward
only ``(tokens, r)`` and ``(r, out)`` tensors are scaled.

The values: the product is rounded once, with the scale and the sum, instead of three times
(product, scale, sum), so they differ from PEFT's within the compute dtype's rounding. An
adapter whose ``B`` is zero (a fresh one) leaves the base's output exactly as it is, so the
policy still starts at the cached reference.

The same forward casts an fp32 input once for the consecutive layers that take it (q, k and v;
gate and up), where autocast cast it for each base layer and each ``lora_A``, and sends each
consumer's gradient back on its own (``_AsCast``), so that they are summed in fp32 as before.
That trades host time (a Python autograd node per consumer, ``bench/probes/lora_host_probe.py``)
for 8 fewer casts of an activation per decoder layer and forward on the device, which bounds
an 8B LoRA step; ``$DPOCACHE_LORA_CAST=per-product`` turns it off (docs/speed.md).

A compiled layer traces the product and the update as one operation, ``dpocache::lora_linear``:
traced as they are, the in-place addition becomes an ``addmm`` into a new buffer that the product
is first copied into (``_lora_linear``). Bases with a forward of their own keep it (a kept product),
but for one whose product the recompute skips, which the operation skips with its update.

Only for a run under bf16 or fp16 autocast on native kernels (``fuses_lora_updates``): fp32 runs
keep PEFT's forward, and so do calls it does not cover (several or no active adapters, a
variant such as DoRA, a bias on ``B``, merged weights, adapters off, extra arguments), which
fall through to PEFT's own forward at each call.
"""

from __future__ import annotations

import os
import types
import weakref

import torch
import torch.nn.functional as F
from torch import nn

from dpocache.models.checkpoint_phases import current_phase
from dpocache.models.checkpointing import COMPILED_UNREAD, KEEPS_PRODUCT, autocast_inputs, input_grad
from dpocache.scoring.layout_choice import LORA_CAST_ENV, LORA_CAST_MODES


def fuse_lora_updates_(model: nn.Module) -> int:
    """Give every PEFT LoRA ``Linear`` of ``model`` the fused forward (``fused_lora_forward``),
    on the instance; returns how many layers changed."""
    from peft.tuners.lora.layer import Linear as LoraLinear

    layers = [m for m in model.modules() if type(m) is LoraLinear]
    for layer in layers:
        layer.forward = types.MethodType(fused_lora_forward, layer)
    return len(layers)


def fused_lora_forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """PEFT's ``Linear.forward`` with the adapter's update added in ``lora_B``'s GEMM:
    ``x (..., in)`` → ``(..., out)``. Falls through to PEFT's forward for any call it does not
    cover (the module docstring)."""
    adapter = _plain_adapter(self, args, kwargs)
    if adapter is None:
        return type(self).forward(self, x, *args, **kwargs)
    # (N, in) each: the update goes into a whole tensor, not a view of one. The cast is keyed on x
    # itself, the tensor the decoder layer hands to q, k and v (gate and up).
    to_base, to_adapter = (t.reshape(-1, t.shape[-1]) for t in _compute_inputs(x))
    lora_a, lora_b = self.lora_A[adapter], self.lora_B[adapter]
    h = lora_a(self.lora_dropout[adapter](self._cast_input_dtype(to_adapter, lora_a.weight.dtype)))  # (N, r)
    base = self.base_layer
    if torch.compiler.is_compiling() and (unread := _traced_base(base)) is not None:
        x_in, weight, bias = autocast_inputs(to_base, base.weight, base.bias)
        result = torch.ops.dpocache.lora_linear(x_in, weight, bias, h.to(x_in.dtype), lora_b.weight.to(x_in.dtype),
                                                self.scaling[adapter], unread)
        return result.view(*x.shape[:-1], result.shape[-1])
    result = base(to_base)  # (N, out), a new tensor: its product does not keep it for backward
    # addmm_ is in place, which autocast does not cast: B in the output's dtype, as autocast
    # would cast it for lora_B's product (the same rounding). A base that keeps its product
    # through the recompute (dpocache.models.checkpointing) gets a new tensor instead: its product
    # is kept as it is (one copy of it, in addmm).
    update = torch.addmm if getattr(base, KEEPS_PRODUCT, False) else torch.Tensor.addmm_
    result = update(result, h.to(result.dtype), lora_b.weight.to(result.dtype).t(), alpha=self.scaling[adapter])
    return result.view(*x.shape[:-1], result.shape[-1])


def _traced_base(base: nn.Module) -> bool | None:
    """How a compiled layer traces ``base``'s product inside ``dpocache::lora_linear``: False for
    a frozen ``nn.Linear`` with its class's forward and no hooks, True for one whose product the
    recompute skips (``compiled_unread_product_forward``, marked ``COMPILED_UNREAD``); None for any
    other (a kept product, a forward of ``bf16_matmul``'s, a hook that fetches streamed weights, a
    trained weight), which keeps its own forward."""
    if type(base) is not nn.Linear or base._forward_hooks or base._forward_pre_hooks \
            or any(p.requires_grad for p in base.parameters()):
        return None
    if getattr(base, COMPILED_UNREAD, False):
        return True
    return False if base.__dict__.get("forward") is None else None


@torch.library.custom_op("dpocache::lora_linear", mutates_args=())
def _lora_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, h: torch.Tensor,
                 lora_b: torch.Tensor, scaling: float, unread: bool) -> torch.Tensor:
    """A LoRA layer's output as a compiled layer computes it: ``x (N, in) @ weight (out, in)^T +
    bias + scaling * h (N, r) @ lora_b (out, r)^T`` → ``(N, out)``, the update added in place in
    its GEMM into the product made here. Traced as plain operations, the in-place addition
    becomes an ``addmm`` that the compiled graph gives a new buffer, into which the product is
    first copied: a read and a write of the whole output more, in every LoRA layer's forward and
    recompute. ``unread``: zeros in a checkpointed call's recompute, where nothing reads this
    output (``compiled_unread_product_forward``)."""
    if unread and (phase := current_phase()) is not None and phase.recompute:
        return x.new_zeros((x.shape[0], weight.shape[0]))
    return F.linear(x, weight, bias).addmm_(h, lora_b.t(), alpha=scaling)


@_lora_linear.register_fake
def _(x, weight, bias, h, lora_b, scaling, unread) -> torch.Tensor:
    return x.new_empty((x.shape[0], weight.shape[0]))


def _lora_linear_context(ctx, inputs, output) -> None:
    x, weight, _, h, lora_b, scaling, _ = inputs
    ctx.save_for_backward(weight, h, lora_b)
    ctx.scaling, ctx.x_dtype = scaling, x.dtype


def _lora_linear_backward(ctx, grad: torch.Tensor):
    """The gradients of ``x``, ``h`` and ``lora_b`` (the frozen weight and bias have none):
    ``grad (N, out)`` through the base, and through the update scaled as ``addmm``'s backward
    scales it."""
    weight, h, lora_b = ctx.saved_tensors
    grad_x = input_grad(grad, weight, ctx.x_dtype) if ctx.needs_input_grad[0] else None
    grad_h = grad.mm(lora_b) * ctx.scaling if ctx.needs_input_grad[3] else None  # (N, r)
    grad_b = grad.t().mm(h) * ctx.scaling if ctx.needs_input_grad[4] else None  # (out, r)
    return grad_x, None, None, grad_h, grad_b, None, None


_lora_linear.register_autograd(_lora_linear_backward, setup_context=_lora_linear_context)


class _AsCast(torch.autograd.Function):
    """``x`` (fp32) as ``y``, its cast to the autocast dtype made once before (no graph), for one
    consumer: the backward casts that consumer's gradient to fp32, as autocast's own cast
    (``ToCopyBackward``) would, so each consumer's gradient reaches ``x`` and is summed there
    in fp32, in the same order: the same gradients, bit for bit."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return y.view_as(y)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad.to(torch.float32), None


# ``$DPOCACHE_LORA_CAST=per-product`` leaves each product's cast to autocast, to measure the choice
# again (checked by ``config.validate_environment``). Read once, at import.
CAST_ONCE = os.environ.get(LORA_CAST_ENV, LORA_CAST_MODES[0]) == LORA_CAST_MODES[0]

# The last fp32 input cast for a LoRA layer: (a weak reference to it, its version, the dtype, the
# cast). q, k and v (gate and up) take the same normed input one after the other: autocast cast it
# twice for each (its base and its lora_A), six times in all, where once gives the same values.
_last_cast: tuple | None = None


def _forget_cast(_ref=None) -> None:
    global _last_cast
    _last_cast = None


def _compute_inputs(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` for the base layer's product and for ``lora_A``'s: under autocast, an fp32 input cast
    once to the autocast dtype and shared by consecutive layers (``_last_cast``), each consumer
    with its own gradient node (``_AsCast``). Anything else, and under ``torch.compile`` (whose
    graph casts once by itself), ``x`` as it is."""
    global _last_cast
    device = x.device.type
    if not CAST_ONCE or x.dtype != torch.float32 or not torch.is_autocast_enabled(device) \
            or torch.compiler.is_compiling() or x.is_inference():  # an inference tensor has no version to key on
        return x, x
    dtype = torch.get_autocast_dtype(device)
    last = _last_cast
    if last is None or last[0]() is not x or last[1] != x._version or last[2] != dtype:
        with torch.no_grad():
            cast = x.to(dtype)
        last = _last_cast = (weakref.ref(x, _forget_cast), x._version, dtype, cast)  # dropped with x
    if not torch.is_grad_enabled() or not x.requires_grad:
        return last[3], last[3]
    return _AsCast.apply(x, last[3]), _AsCast.apply(x, last[3])


def _plain_adapter(layer, args: tuple, kwargs: dict) -> str | None:
    """The name of the layer's one active plain LoRA adapter where the fused forward computes
    what PEFT's would; None otherwise."""
    if args or kwargs or layer.disable_adapters or layer.merged or len(layer.active_adapters) != 1:
        return None
    name = layer.active_adapters[0]
    if name not in layer.lora_A or name in getattr(layer, "lora_variant", {}) or layer.lora_B[name].bias is not None:
        return None
    return name
