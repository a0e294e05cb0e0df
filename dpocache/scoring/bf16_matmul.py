"""bf16 linear layers computed by the fp32 GEMM, for CPUs whose bf16 GEMM is the slower one.

Why: a CPU with AVX512-BF16 but no AMX tiles runs bf16 matrix products slower than fp32 ones
(measured on the project's 2-core machine, one layer with ``bench/probes/bf16_linear.py`` and
the whole bench: docs/benchmarks/levers-cpu-2core-20261123.md). Yet a product of two bf16
numbers is exact in fp32 (8 + 8 significant bits fit in 24), and the bf16 kernels accumulate in
fp32 too. So rounding the operands to bf16, multiplying them with the fp32 GEMM and rounding the
result to bf16 gives bf16 numerics, the bf16 kernel's values up to the order of summation, at
fp32 GEMM speed.

Scope: every ``nn.Linear`` (the projections of each layer and the output head), and only while
CPU autocast to bf16 is on, so the rest of the model (attention, norms, residual adds) sees
exactly what autocast gives it. The module's forward is replaced, not a torch function mode,
so checkpoint recomputation in backward (which restores the autocast state, but no modes) runs
the same arithmetic as the forward.

Memory matches autocast: the input is saved for backward in bf16 and the weight by reference;
backward rounds the weight again instead of keeping an fp32 copy.

Weights of a frozen reference model are rounded to bf16 values once, in place, and marked, so
the forward skips rounding them (``round_frozen_weights_``); the fp32 storage then holds exactly
the bf16 values autocast would have produced on each call.
"""

from __future__ import annotations

import os
import types
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from dpocache.scoring.layout_choice import BF16_MATMUL_ENV as ENV_VAR  # defined where checking it imports no torch
from dpocache.scoring.layout_choice import BF16_MATMUL_MODES as MODES

# Set on a Parameter whose fp32 values are all bf16-representable; holds the tensor version at
# the time, so an in-place update afterwards (an optimizer step) invalidates the mark.
_EXACT_VERSION = "_dpocache_bf16_exact_version"
_INSTALLED = "_dpocache_bf16_via_fp32"


def cpu_has_amx_bf16() -> bool:
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "amx_bf16" in flags.split()


def resolve_mode(mode: str | None = None) -> str:
    """``auto`` (default; ``$DPOCACHE_BF16_MATMUL`` overrides it) → ``fp32-gemm`` on CPUs
    without AMX tiles, ``native`` elsewhere (with AMX, bf16 GEMMs are several times faster)."""
    mode = mode or os.environ.get(ENV_VAR, "auto")
    if mode not in MODES:
        raise ValueError(f"{ENV_VAR} must be one of {', '.join(MODES)}; got '{mode}'")
    if mode == "auto":
        return "native" if cpu_has_amx_bf16() else "fp32-gemm"
    return mode


def _bf16_valued_fp32(t: torch.Tensor) -> torch.Tensor:
    """``t`` rounded to bf16, as fp32 (a no-op for a marked weight that has not changed since)."""
    marked = getattr(t, _EXACT_VERSION, None)  # looked at first: an inference tensor has no version
    if t.dtype == torch.float32 and marked is not None and marked == t._version:
        return t
    return t.to(torch.bfloat16).float()


class _LinearBf16ViaFp32(torch.autograd.Function):
    """``y = round_bf16(round_bf16(x) @ round_bf16(W)^T + round_bf16(b))``, fp32 GEMMs both ways.

    Shapes: ``x (..., I)``, ``weight (O, I)``, ``bias (O,)`` or None → ``(..., O)`` bf16.
    Backward follows autocast: the bf16 grad meets bf16-valued operands, each product is
    rounded to bf16, then cast to its input's dtype (what autocast's cast nodes do).
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        x_bf16 = x.to(torch.bfloat16)
        b32 = None if bias is None else bias.to(torch.bfloat16).float()
        out = F.linear(x_bf16.float(), _bf16_valued_fp32(weight), b32).to(torch.bfloat16)  # (..., O)
        ctx.save_for_backward(x_bf16, weight)
        ctx.x_dtype, ctx.has_bias = x.dtype, bias is not None
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        x_bf16, weight = ctx.saved_tensors
        g = grad_out.to(torch.bfloat16).float().reshape(-1, grad_out.shape[-1])  # (N, O)
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_x = (g @ _bf16_valued_fp32(weight)).to(torch.bfloat16).to(ctx.x_dtype)  # (N, I)
            grad_x = grad_x.reshape(*grad_out.shape[:-1], -1)
        if ctx.needs_input_grad[1]:
            grad_w = (g.T @ x_bf16.reshape(-1, x_bf16.shape[-1]).float()).to(torch.bfloat16).to(weight.dtype)  # (O, I)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = g.sum(0).to(torch.bfloat16).float()  # (O,)
        return grad_x, grad_w, grad_b


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear``, through the fp32 GEMM under CPU bf16 autocast: what a switched layer's
    forward computes, for callers that hold the weight (a sharded head's tiles)."""
    if (x.device.type == "cpu" and torch.is_autocast_enabled("cpu")
            and torch.get_autocast_dtype("cpu") == torch.bfloat16):
        with torch.autocast("cpu", enabled=False):
            return _LinearBf16ViaFp32.apply(x, weight, bias)
    return F.linear(x, weight, bias)


def _forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return linear(x, self.weight, self.bias)


def plain_linear(module: nn.Module) -> bool:
    """``nn.Linear`` itself, or FSDP2's subclass of it (``fully_shard`` swaps a unit's class
    for ``FSDP<class>``, whose forward is still ``nn.Linear``'s: a sharded output head)."""
    cls = type(module)
    return cls is nn.Linear or (cls.__name__ == "FSDPLinear" and cls.__bases__[-1] is nn.Linear)


def install(model: nn.Module, mode: str | None = None) -> int:
    """Route the model's ``nn.Linear`` layers through the fp32 GEMM under CPU bf16 autocast
    (see the module docstring). Idempotent; returns how many layers were switched (0 with mode
    ``native`` or a model not on the CPU). Subclasses of ``nn.Linear`` (quantised layers) are
    left alone, except FSDP2's (``plain_linear``), and so are layers given a forward of
    activation checkpointing's own (``--checkpoint-keep``, ``--skip-unread-products``)."""
    first = next(model.parameters(), None)
    if resolve_mode(mode) != "fp32-gemm" or (first is not None and first.device.type != "cpu"):
        return 0
    count = 0
    for module in model.modules():
        # a layer that keeps or skips its product in the recompute has its own forward, left
        # alone (dpocache.models.checkpointing: its product runs under autocast as it is)
        if plain_linear(module) and not getattr(module, _INSTALLED, False) \
                and not getattr(module, "dpocache_checkpoint_forward", False):
            module.forward = types.MethodType(_forward, module)
            setattr(module, _INSTALLED, True)
            count += 1
    return count


def installed(module: nn.Module) -> bool:
    """True for a layer ``install`` switched to the fp32 GEMM (it needs its weight stored in fp32)."""
    return bool(getattr(module, _INSTALLED, False))


@torch.no_grad()
def round_frozen_weights_(model: nn.Module) -> int:
    """Round the fp32 weights of the switched layers to bf16 values in place and mark them, so
    the forward does not round them on every call. Only for a model used under bf16 alone (a
    frozen reference it owns): the fp32 precision is gone afterwards. Returns the count."""
    count = 0
    for module in model.modules():
        if getattr(module, _INSTALLED, False) and module.weight.dtype == torch.float32:
            module.weight.copy_(module.weight.to(torch.bfloat16))
            setattr(module.weight, _EXACT_VERSION, module.weight._version)
            count += 1
    return count
