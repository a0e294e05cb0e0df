"""``--compile auto|on|off``: each decoder layer compiled, in the reference pass and in training.

Why layers, not the model: a decoder's layers share one code object, so dynamo compiles the
layer once and reuses the code for every layer (the "regional compilation" recipe of the
PyTorch tutorials), and inductor fuses the layer's element-wise work (RMSNorm in fp32, RoPE,
SiLU and its product, casts, residual adds) into a few kernels instead of tens of launches per
layer. Compiling the whole scorer with dynamic shapes did not finish three reference passes in
280 s on an H100 (bench/README.md).

Measured on one H100 (``python bench/gpu_compile_probe.py --variant sdpa|sdpa-layers``; 1.1B
Llama, bf16, 256 pairs up to 2,048 tokens, shared layout, SDPA, ``--max-tokens 32768``):
103,500 tokens/s eager against 143,500 with the layers compiled (26.5% and 36.7% MFU), and the
first pass, compiles included, 11.7 s eager against 25.6 s compiled. So compiling costs about
16 s once (beyond eager's own first-pass warm-up) and saves 2.7 µs per token at 1.1B
parameters; the saving grows with the layer's size, the compile time does not.

On a 2-core AVX2 CPU, fp32, the 58M bench model, 256 pairs: at a token budget of 4096
(``python bench/gpu_compile_probe.py --config 58m --dtype float32 --budget 4096 --variant
sdpa|sdpa-layers``, two runs of each) 1,424-1,586 tokens/s eager against 1,763-1,872 compiled
after the first pass (1.17x), the compiles 10-14 s. At the CPU's budget of 1024 since
(``python bench/compile_ab.py [--warm-cache]``: eager and compiled copies interleaved in one
process, medians of 3 rounds) eager keeps its element-wise work in cache and the compile gains
less: 1.05x with the compile in a fresh inductor cache (11.2 s), 1.08x and 1.09x with torch's
cache warm (3.8 s and 6.7 s), so a break-even of about 235k tokens (fresh) and 120k (warm).

``auto`` compiles where it was measured to pay, when the pass's work (tokens x parameters) is at
least ``AUTO_MIN_WORK`` for the device and dtype: twice the break-even measured there, so the
compile is never a net loss on the measured shape (CUDA bf16: from about 12M tokens at 1.1B
parameters; CPU fp32: from about 470k tokens at 58M, twice the fresh-cache break-even).
Elsewhere (CPU bf16, whose linear layers take the fp32 GEMM through a custom autograd function,
``dpocache.scoring.bf16_matmul``, CUDA fp32) ``auto`` stays eager. A sharded reference (FSDP2 units
with their gather hooks) stays eager. Training compiles the policy's layers with ``on`` only
(``auto`` there is eager until eager and compiled training are measured side by side), and not
under FSDP2.
"""

from __future__ import annotations

import torch
from torch import nn

from dpocache.scoring.attention import is_flex
from dpocache.scoring.layout_choice import COMPILES
from dpocache.scoring.logprobs import decoder_layers, unwrap_causal_lm

# tokens x parameters of a pass from which ``auto`` compiles, per (device type, dtype): twice the
# break-even compile time / time saved per token-parameter, from the module docstring's figures:
# H100 16 s / 2.4e-15 s; 2-core CPU at its 1024 budget 235k tokens x 58.1M parameters
# (bench/results/cpu-compile-ab-58m-float32-20261123.jsonl; 155k at the 4096 budget before: a
# threshold of 310k tokens).
AUTO_MIN_WORK = {("cuda", torch.bfloat16): 1.3e16, ("cpu", torch.float32): 2.7e13}


def compile_layers(model: nn.Module) -> int:
    """Compile each decoder layer of ``model`` in place (``nn.Module.compile``: the module keeps
    its parameters, state dict and hooks; its calls go through the compiled forward), with
    dynamic shapes from the first batch, so a run compiles once, whatever its batch shapes.
    Left to dynamo's automatic dynamic shapes, the first batch compiled a static graph and the
    first batch of another shape a dynamic one, which every later batch ran (on the H100: two
    or three graphs in a reference pass, three slow first steps in training); compiling the
    dynamic graph at once skips the static one. Measured on the 2-core CPU
    (``python bench/gpu_compile_probe.py --variant sdpa-layers --config 58m --dtype float32
    --budget 4096 [--dynamic]``, a cold inductor cache each, two runs of each): 1 graph instead of
    2, the first pass 10.0-10.6 s slower than the later ones instead of 12.3-19.9 s, the later
    passes at the same speed (1,912-1,978 against 1,891-1,988 tokens/s). Under FlexAttention on
    the CPU the layers compile statically instead, one graph per batch shape (``flex_on_cpu``).
    The layers are FSDP2's units (``logprobs.decoder_layers``). Returns how many were compiled
    (0: the model has none)."""
    layers = decoder_layers(model)
    dynamic = not flex_on_cpu(model)
    for layer in layers:
        layer.compile(dynamic=dynamic)
    return len(layers)


def flex_on_cpu(model: nn.Module) -> bool:
    """Whether ``model`` runs FlexAttention on the CPU, where torch 2.13's inductor cannot build
    the flex kernel with a symbolic key length (``attention.compile_settings``): a compiled layer
    holds that kernel, so it compiles one static graph per batch shape there, up to
    ``attention.FLEX_CPU_SHAPES`` (dynamic, ``cache build --attention flex --layout shared
    --compile on`` failed with a C++ compile error at its second batch shape)."""
    config = getattr(unwrap_causal_lm(model), "config", None)
    parameter = next(model.parameters(), None)
    return config is not None and is_flex(config) and parameter is not None and parameter.device.type == "cpu"


def should_compile(requested: str, device_type: str, dtype: torch.dtype, tokens: int, parameters: int) -> bool:
    """Whether a pass over ``tokens`` with a model of ``parameters`` computing in ``dtype`` on
    ``device_type`` compiles its layers."""
    if requested not in COMPILES:
        raise ValueError(f"compile must be one of {', '.join(COMPILES)}; got '{requested}'")
    if requested != "auto":
        return requested == "on"
    threshold = AUTO_MIN_WORK.get((device_type, dtype))
    return threshold is not None and tokens * parameters >= threshold
