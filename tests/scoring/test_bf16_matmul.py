"""bf16 linear layers through the fp32 GEMM (dpocache.scoring.bf16_matmul): the same numbers as CPU
bf16 autocast, forward and backward, up to the order of summation."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from dpocache.scoring import bf16_matmul
from dpocache.scoring.logprobs import CompletionLogProbs


def bf16_ulp(t: torch.Tensor) -> torch.Tensor:
    """One unit in the last place of bf16 (8 significant bits) at each element of ``t``."""
    t = t.float().abs().clamp(min=1e-30)
    return torch.exp2(torch.floor(torch.log2(t)) - 7)


def within_ulps(a: torch.Tensor, b: torch.Tensor, ulps: float) -> bool:
    """``a`` and ``b`` differ by at most ``ulps`` bf16 ulps of ``b`` everywhere (summation
    order can move a rounded value by one ulp)."""
    return bool(((a.float() - b.float()).abs() <= ulps * bf16_ulp(b) + 1e-30).all())


def pair_of_linears(bias: bool, seed: int = 0):
    torch.manual_seed(seed)
    native = nn.Linear(96, 80, bias=bias)
    emulated = copy.deepcopy(native)
    assert bf16_matmul.install(emulated, "fp32-gemm") == 1
    return native, emulated


@pytest.mark.parametrize("bias", [False, True])
def test_forward_and_backward_match_cpu_bf16_autocast(bias):
    native, emulated = pair_of_linears(bias)
    x = torch.randn(3, 37, 96)  # (B, T, I): a 3-D input, as in a transformer
    grad = torch.randn(3, 37, 80)
    outs = []
    for layer in (native, emulated):
        xi = x.clone().requires_grad_(True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = layer(xi)
        y.backward(grad.to(y.dtype))
        outs.append((y, xi.grad, layer.weight.grad, None if layer.bias is None else layer.bias.grad))
    (y_n, gx_n, gw_n, gb_n), (y_e, gx_e, gw_e, gb_e) = outs
    assert y_e.dtype == y_n.dtype == torch.bfloat16
    assert gx_e.dtype == gx_n.dtype == torch.float32 and gw_e.dtype == torch.float32
    assert within_ulps(y_e, y_n, 1)
    assert within_ulps(gx_e, gx_n, 1)
    # The weight gradient sums over B*T = 111 products per element: rounding of the bf16
    # grad and the summation order differ between the kernels, so allow a little more.
    assert within_ulps(gw_e, gw_n, 2)
    if bias:
        assert within_ulps(gb_e, gb_n, 2)
    # And it is bf16, not fp32: the fp32 product is measurably different.
    exact = nn.functional.linear(x, native.weight, native.bias)
    assert (y_e.float() - exact).abs().max() > 1e-4


def test_outside_bf16_autocast_the_layer_is_plain_fp32():
    native, emulated = pair_of_linears(bias=True)
    x = torch.randn(5, 96)
    assert torch.equal(native(x), emulated(x))
    with torch.autocast("cpu", dtype=torch.float16):
        assert torch.equal(native(x), emulated(x))


def test_rounded_frozen_weights_give_the_same_values_and_the_mark_expires():
    _, layer = pair_of_linears(bias=False)
    x = torch.randn(7, 96)
    with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16):
        before = layer(x)
    assert bf16_matmul.round_frozen_weights_(layer) == 1
    assert torch.equal(layer.weight, layer.weight.to(torch.bfloat16).float())  # bf16 values now
    with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.equal(layer(x), before)
    # An in-place update afterwards makes the weight un-rounded again: it must be rounded.
    with torch.no_grad():
        layer.weight.add_(1e-4)
    assert bf16_matmul._bf16_valued_fp32(layer.weight) is not layer.weight


def test_checkpoint_recomputation_runs_the_same_arithmetic():
    """Backward recomputes a checkpointed chunk with autocast restored and no function modes;
    the replaced forward gives the same bf16 output there, so gradients match a plain run."""
    _, layer = pair_of_linears(bias=False)
    x = torch.randn(4, 96)
    grads = []
    for use_checkpoint in (False, True):
        layer.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = checkpoint(layer, x, use_reentrant=False) if use_checkpoint else layer(x)
        y.float().square().sum().backward()
        grads.append(layer.weight.grad.clone())
    assert torch.equal(grads[0], grads[1])


def test_install_is_idempotent_skips_subclasses_and_honours_native(monkeypatch):
    class QuantLinear(nn.Linear):
        pass

    model = nn.Sequential(nn.Linear(4, 4), QuantLinear(4, 4), nn.Linear(4, 2))
    assert bf16_matmul.install(model, "native") == 0
    assert bf16_matmul.install(model, "fp32-gemm") == 2
    assert bf16_matmul.install(model, "fp32-gemm") == 0
    assert bf16_matmul.install(nn.Linear(4, 4, device="meta"), "fp32-gemm") == 0  # only models on the CPU
    monkeypatch.setenv(bf16_matmul.ENV_VAR, "fast")
    with pytest.raises(ValueError, match="DPOCACHE_BF16_MATMUL"):
        bf16_matmul.resolve_mode()
    monkeypatch.setenv(bf16_matmul.ENV_VAR, "native")
    assert bf16_matmul.resolve_mode() == "native"
    monkeypatch.delenv(bf16_matmul.ENV_VAR)
    monkeypatch.setattr(bf16_matmul, "cpu_has_amx_bf16", lambda: True)
    assert bf16_matmul.resolve_mode() == "native"
    monkeypatch.setattr(bf16_matmul, "cpu_has_amx_bf16", lambda: False)
    assert bf16_matmul.resolve_mode() == "fp32-gemm"


def test_whole_model_log_probs_match_native_bf16(tiny_models, monkeypatch):
    """On a tiny Llama, per-sequence log-probs through the fp32 GEMM stay within the spread of
    bf16 itself: closer to native bf16 than native bf16 is to fp32."""
    base = tiny_models["llama"]
    torch.manual_seed(0)
    ids = torch.randint(3, base.config.vocab_size, (3, 40))
    attn = torch.ones_like(ids)
    comp = torch.zeros_like(ids)
    comp[:, 15:] = 1
    sums = {}
    for mode, dtype in (("native", torch.float32), ("native", torch.bfloat16), ("fp32-gemm", torch.bfloat16)):
        monkeypatch.setenv(bf16_matmul.ENV_VAR, mode)
        scorer = CompletionLogProbs(copy.deepcopy(base))
        with torch.inference_mode(), torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
            sums[mode, dtype] = scorer(ids, attn, comp).sum(-1)  # (N,)
    fp32, native, emulated = (sums["native", torch.float32], sums["native", torch.bfloat16],
                              sums["fp32-gemm", torch.bfloat16])
    assert not torch.equal(emulated, fp32)
    assert (emulated - native).abs().max() <= (native - fp32).abs().max() + 1e-3


def test_peak_flops_of_bf16_under_the_fp32_gemm_route_is_the_fp32_gemms(monkeypatch):
    """MFU's denominator is the kernel the products run: under the fp32-GEMM route that is the
    fp32 GEMM (a native bf16 product of 2048 rows took a minute on an AVX2-only CPU)."""
    from dpocache.training import metrics
    monkeypatch.setattr(metrics, "_PEAK_CACHE", {})
    monkeypatch.setenv("DPOCACHE_BF16_MATMUL", "fp32-gemm")
    peak = metrics.measured_peak_flops(torch.device("cpu"), torch.bfloat16, size=512, seconds=0.05)
    assert list(metrics._PEAK_CACHE) == [("cpu", "torch.float32", 512)] and peak > 0


def test_peak_flops_are_remembered_per_size(monkeypatch):
    # The key was (device, dtype): the best of two sizes (bench_vs_trl.measure_peak) returned the
    # first size's figure twice.
    from dpocache.training import metrics
    monkeypatch.setattr(metrics, "_PEAK_CACHE", {})
    monkeypatch.setattr(metrics, "_time_mm", lambda a, b: 0.01)  # every product 10 ms: the size shows
    small = metrics.measured_peak_flops(torch.device("cpu"), torch.float32, size=256, seconds=0)
    large = metrics.measured_peak_flops(torch.device("cpu"), torch.float32, size=512, seconds=0)
    assert (small, large) == (2.0 * 256**3 / 0.01, 2.0 * 512**3 / 0.01)
    monkeypatch.setattr(metrics, "_time_mm", lambda a, b: 0.02)
    assert metrics.measured_peak_flops(torch.device("cpu"), torch.float32, size=512, seconds=0) == large  # cached
    assert metrics.measured_peak_flops(torch.device("cpu"), torch.float32, size=512, seconds=0,
                                       cached=False) == large / 2
