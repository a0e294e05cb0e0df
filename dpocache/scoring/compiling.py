"""``--compile auto|on|off``: each decoder layer compiled, in the reference pass and in training.

Why layers, not the model: a decoder's layers share one code object, so dynamo compiles the
layer once and reuses the code for every layer (the "regional compilation" recipe of the
PyTorch tutorials), and inductor fuses the layer's element-wise work (RMSNorm in fp32, RoPE,
SiLU and its product, casts, residual adds) into a few kernels instead of tens of launches per
layer. Compiling the whole scorer with dynamic shapes instead did not finish three reference
passes on an H100 in the time given (docs/benchmarks/vs-trl-h100-20261123.md).

Compiling costs a fixed time once (beyond eager's own first-pass warm-up) and then saves time
on every token, more the larger the layer, while the compile time does not grow with the
layer's size: it pays only on a pass long enough. Measured on one H100 in bf16
(``python bench/probes/gpu_compile_probe.py --variant sdpa|sdpa-layers``:
docs/benchmarks/probes-h100-20261122.md) and on the 2-core AVX2 CPU in fp32
(``bench/probes/gpu_compile_probe.py`` at the 4096 token budget, ``bench/probes/compile_ab.py``
at 1024: docs/benchmarks/probes-cpu-2core-20261123.md). At the CPU's budget of 1024 eager keeps
a batch's element-wise work in cache, so the compile gains less there than at 4096, and more
with torch's inductor cache warm than fresh.

``auto`` compiles where it was measured to pay, when the pass's work (tokens x parameters) is at
least ``AUTO_MIN_WORK`` for the device and dtype: twice the break-even measured there (on the
CPU, with a fresh inductor cache), so the compile is never a net loss on the measured shape.
Elsewhere (not measured: CPU bf16, whose linear layers take the fp32 GEMM through a custom
autograd function, ``dpocache.scoring.bf16_matmul``, and CUDA fp32) ``auto`` stays eager. A
sharded reference (FSDP2 units with their gather hooks) stays eager. Training compiles the
policy's layers with ``on`` only, and not under FSDP2: ``auto`` there is eager, since on the
2-core CPU compiled steps repay their first step's compile only over a few hundred steps
(docs/benchmarks/probes-cpu-2core-20261123.md), and on an H100 eager and compiled training were
not measured side by side (docs/benchmarks/vs-trl-h100-20261123.md).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.fx.experimental._config as fx_config
from torch import nn

from dpocache.runtime.preflight import UsageError
from dpocache.scoring.attention import is_flex
from dpocache.scoring.layout_choice import COMPILES
from dpocache.scoring.logprobs import decoder_layers, unwrap_causal_lm

# tokens x parameters of a pass from which ``auto`` compiles, per (device type, dtype): twice the
# break-even (compile time / time saved per token-parameter) measured there: one H100 in bf16
# (docs/benchmarks/probes-h100-20261122.md), the 2-core CPU in fp32 at its 1024 token budget with
# a fresh inductor cache (docs/benchmarks/probes-cpu-2core-20261123.md, which gives the earlier
# threshold at the 4096 budget too).
AUTO_MIN_WORK = {("cuda", torch.bfloat16): 1.3e16, ("cpu", torch.float32): 2.7e13}


def compile_layers(model: nn.Module) -> int:
    """Compile each decoder layer of ``model`` in place (``nn.Module.compile``: the module keeps
    its parameters, state dict and hooks; its calls go through the compiled forward), with
    dynamic shapes from the first batch, so a run compiles once, whatever its batch shapes.
    Left to dynamo's automatic dynamic shapes, the first batch compiled a static graph and the
    first batch of another shape a dynamic one, which every later batch ran (on the H100: two
    or three graphs in a reference pass, three slow first steps in training); compiling the
    dynamic graph at once skips the static one: one graph, a shorter first pass and the same
    speed after it (on the 2-core CPU with ``bench/probes/gpu_compile_probe.py --variant
    sdpa-layers [--dynamic]``: docs/benchmarks/probes-cpu-2core-20261123.md; on the H100:
    docs/benchmarks/probes-h100-20261122.md). Under FlexAttention on the CPU the layers compile
    statically instead, one graph per batch shape (``flex_on_cpu``). The layers are FSDP2's units
    (``scoring.logprobs.decoder_layers``). Returns how many were compiled (0: the model has none).
    On a CPU that cannot compile (``cpu_compile_blocked``) it stops with one line instead."""
    blocked = cpu_compile_blocked()
    if blocked and next(model.parameters()).device.type == "cpu":
        raise UsageError(f"--compile on: {blocked}; use --compile off (or auto), or install under a path "
                         "without spaces")
    layers = decoder_layers(model)
    dynamic = not flex_on_cpu(model)
    if dynamic:
        sizes_apart()
    for layer in layers:
        layer.compile(dynamic=dynamic)
    return len(layers)


@functools.cache
def compiled_function(function: Callable) -> Callable:
    """``function`` (a decoder layer class's ``forward``) compiled with dynamic shapes, once per
    process: every layer of the class, and every model of it, runs the one compiled function,
    the layer passed as its first argument (dynamo reads each layer's parameters as inputs of
    the graph, so the layers share its code, as with ``compile_layers``). For a layer compiled
    inside its checkpoint (``models.checkpointing.LayerCheckpoint``)."""
    sizes_apart()
    return torch.compile(function, dynamic=True)


def sizes_apart() -> None:
    """Dynamic sizes that happen to be equal when a graph is traced stay apart in it: by default
    the compiler gives them one symbol ("duck sizing") and guards on their equality, so a later
    batch whose sizes differ compiled every layer's graph again, mid-run; the causal rows' groups
    (``scoring.shared.row_groups``) often hold as many rows, or are as wide, as another group of
    one batch and not of the next (``tests/scoring/test_causal_attention.py``). torch's own
    remedy, named in its guard. It holds for the whole process, as the compiler reads it when it
    traces, on a layer's first call: in a process that trains with TRL beside a compiled
    dpocache reference, TRL's compiled graphs too, which then only guard less."""
    fx_config.use_duck_shape = False


# The most recompile and graph-break reasons run.json keeps: the first ones say why, the rest repeat.
COMPILER_REASONS = 8


@dataclass(frozen=True)
class CompilerMark:
    """Where torch's compiler stood at one moment of this process: the graphs it had compiled,
    the graph breaks it had met (per reason) and the guard failures (recompiles) it had recorded
    per compiled function. ``compiler_since`` tells a run its own share."""

    graphs: int
    graph_breaks: dict[str, int]
    guard_failures: dict[object, int]  # code object -> recompiles recorded so far


def compiler_mark() -> CompilerMark:
    utils = torch._dynamo.utils  # torch imports its compiler on first use
    return CompilerMark(utils.counters["stats"]["unique_graphs"], dict(utils.counters["graph_break"]),
                        {code: len(reasons) for code, reasons in utils.guard_failures.items()})


def compiler_since(mark: CompilerMark) -> dict:
    """What torch's compiler did after ``mark`` (run.json's ``policy.compiler``): the graphs it
    compiled, the graph breaks it met, and why it recompiled and broke (up to
    ``COMPILER_REASONS`` distinct reasons each, a recompile's as ``function (file:line): guard
    that failed``). A graph per layer or per batch shape, or a break inside a layer, only slows
    a run; its reasons say which guard to look at (on a GPU, where the compile differs from the
    CPU's)."""
    now = compiler_mark()
    breaks = {reason: count - mark.graph_breaks.get(reason, 0) for reason, count in now.graph_breaks.items()}
    # each recompile records the guard that failed for each graph the function had (dict: once each)
    recompiles = dict.fromkeys(f"{_code_name(code)}: {_first_line(reason)}"
                               for code, reasons in list(torch._dynamo.utils.guard_failures.items())
                               for reason in reasons[mark.guard_failures.get(code, 0):])
    return {"graphs": now.graphs - mark.graphs, "graph_breaks": sum(breaks.values()),
            "recompile_reasons": list(recompiles)[:COMPILER_REASONS],
            "graph_break_reasons": [_first_line(r) for r, count in breaks.items() if count > 0][:COMPILER_REASONS]}


def _code_name(code) -> str:
    name = getattr(code, "co_name", str(code))
    file = getattr(code, "co_filename", None)
    return f"{name} ({Path(file).name}:{code.co_firstlineno})" if file else name


def _first_line(reason) -> str:
    """A guard failure's or graph break's reason, its first line without dynamo's frame id."""
    line = str(reason).strip().splitlines()[0] if str(reason).strip() else ""
    head, sep, rest = line.partition(": ")
    return rest.strip() if sep and head.replace("/", "").isdigit() else line.strip()


def flex_on_cpu(model: nn.Module) -> bool:
    """Whether ``model`` runs FlexAttention on the CPU, where torch 2.13's inductor cannot build
    the flex kernel with a symbolic key length (``scoring.attention.compile_settings``): a compiled
    layer holds that kernel, so it compiles one static graph per batch shape there, up to
    ``scoring.attention.FLEX_CPU_SHAPES`` (dynamic, ``cache build --attention flex --layout shared
    --compile on`` failed with a C++ compile error at its second batch shape)."""
    config = getattr(unwrap_causal_lm(model), "config", None)
    parameter = next(model.parameters(), None)
    return config is not None and is_flex(config) and parameter is not None and parameter.device.type == "cpu"


def cpu_compile_blocked() -> str | None:
    """Why torch's compiler cannot build CPU kernels in this environment, or None. torch 2.13's
    inductor hands its own library folder to the linker unquoted, so a torch installed under a
    path with a space (a virtualenv in a clone at ``~/My Projects/dpocache``) fails to link every
    CPU kernel."""
    lib = Path(torch.__file__).parent / "lib"
    if any(c.isspace() for c in str(lib)):
        return f"torch is installed under a path with a space ({lib}), which its CPU compiler cannot link from"
    return None


def should_compile(requested: str, device_type: str, dtype: torch.dtype, tokens: int, parameters: int) -> bool:
    """Whether a pass over ``tokens`` with a model of ``parameters`` computing in ``dtype`` on
    ``device_type`` compiles its layers (``auto`` on a CPU that cannot compile: never)."""
    if requested not in COMPILES:
        raise ValueError(f"compile must be one of {', '.join(COMPILES)}; got '{requested}'")
    if requested != "auto":
        return requested == "on"
    if device_type == "cpu" and cpu_compile_blocked():
        return False
    threshold = AUTO_MIN_WORK.get((device_type, dtype))
    return threshold is not None and tokens * parameters >= threshold
