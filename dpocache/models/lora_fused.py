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
from torch import nn

from dpocache.models.checkpointing import KEEPS_PRODUCT
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
    result = self.base_layer(to_base)  # (N, out), a new tensor: its product does not keep it for backward
    lora_a, lora_b = self.lora_A[adapter], self.lora_B[adapter]
    h = lora_a(self.lora_dropout[adapter](self._cast_input_dtype(to_adapter, lora_a.weight.dtype)))  # (N, r)
    # addmm_ is in place, which autocast does not cast: B in the output's dtype, as autocast
    # would cast it for lora_B's product (the same rounding). A base that keeps its product
    # through the recompute (dpocache.models.checkpointing) gets a new tensor instead: its product
    # is kept as it is (one copy of it, in addmm).
    update = torch.addmm if getattr(self.base_layer, KEEPS_PRODUCT, False) else torch.Tensor.addmm_
    result = update(result, h.to(result.dtype), lora_b.weight.to(result.dtype).t(), alpha=self.scaling[adapter])
    return result.view(*x.shape[:-1], result.shape[-1])


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
