"""The host's cost of a LoRA layer's forward, with shapes so small that the kernels take no time:
PEFT's forward against dpocache's fused one (``dpocache.models.lora_fused``), with and without
the shared cast of an fp32 input (``$DPOCACHE_LORA_CAST``); and, checkpointed as the 8B LoRA
row runs, with and without its frozen base streamed (``--stream-base``:
``dpocache.models.streaming``, whose hooks and bookkeeping are host work; its copies here are
host to host), with the down projections' products kept through the recompute
(``--checkpoint-keep down_proj``: ``dpocache.models.checkpointing``), with torch's own
selective checkpointing keeping the attention kernel's output instead (a Python dispatch mode
over every op of the checkpointed layer), and compiled (``--compile on``): resident, each layer
compiled whole with its checkpoint inside the graph (``scoring.compiling.compile_layers``), and
streamed, each layer's forward compiled inside its checkpoint
(``models.checkpointing.LayerCheckpoint``), also with the down projections' products kept (an
opaque operation in the graph), and with each adapted layer's update traced as an ``addmm`` of
its own instead of inside ``dpocache::lora_linear`` with the product (``+addmm``: the layers
traced before that operation). The compiled variants' first steps compile; the warm-up takes
them.

    python bench/probes/lora_host_probe.py [--layers 8] [--rounds 8] [--steps 40] [--variants NAME ...]

A tiny Llama (hidden 64, 16 tokens) with every linear layer adapted (r 4), its base stored in bf16,
forward and backward under bf16 autocast on one CPU thread. The variants run in turn,
``--rounds`` times; each round's figure is the median of ``--steps`` forward-and-backward passes
after 5 of warm-up. Prints one JSON line: the median over the rounds per variant, in milliseconds,
and every round's. Compiled variants in one process share the layers' compiled code, each checking
the others' guards first (the +addmm variant guards on what the others do not): compare compiled
variants with ``--variants``, each in a process of its own. On a GPU the same host work runs beside
the kernels; it is the bound only where the device waits for it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # dpocache in a checkout not installed

VARIANTS = ("peft", "fused", "fused+cast-once", "checkpointed", "checkpointed+streamed", "checkpointed+kept",
            "checkpointed+torch-sac", "checkpointed+compiled", "checkpointed+streamed+compiled",
            "checkpointed+streamed+compiled+kept", "checkpointed+streamed+compiled+addmm")


def _save_attention(ctx, op, *args, **kwargs):
    """torch's selective checkpointing policy: keep the attention kernel's output, recompute the rest."""
    from torch.utils.checkpoint import CheckpointPolicy

    keep = op.name().startswith("aten::_scaled_dot_product")
    return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE


def build(variant: str, layers: int):
    """The tiny adapted Llama of ``variant``."""
    import functools

    import torch
    from peft import LoraConfig, get_peft_model
    from torch.utils.checkpoint import create_selective_checkpoint_contexts
    from transformers import LlamaConfig, LlamaForCausalLM

    from dpocache.models.checkpointing import enable_checkpointing
    from dpocache.models.lora_fused import fuse_lora_updates_
    from dpocache.models.policy import keep_adapter_inputs_

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=256)
    model = get_peft_model(LlamaForCausalLM(config), LoraConfig(r=4, target_modules="all-linear"))
    for module in model.modules():  # the frozen base in bf16, as load_policy stores it for bf16 runs
        if type(module) is torch.nn.Linear and not module.weight.requires_grad:
            module.weight.data = module.weight.data.bfloat16()
    keep_adapter_inputs_(model)
    if variant != "peft":
        fuse_lora_updates_(model)
    if variant.startswith("checkpointed"):  # the fused forward with the shared cast, checkpointed
        streamed_compiled = variant.startswith("checkpointed+streamed+compiled")  # compiled inside the checkpoint
        enable_checkpointing(model, ("down_proj",) if variant.endswith("kept") else (), compiled=streamed_compiled)
        model.enable_input_require_grads()
    if variant == "checkpointed+compiled":  # a resident layer compiled whole, its checkpoint inside the graph
        from dpocache.scoring.compiling import compile_layers

        compile_layers(model)
    if variant.endswith("torch-sac"):
        context_fn = functools.partial(create_selective_checkpoint_contexts, _save_attention)
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False,
                                                                               "context_fn": context_fn})
    if "streamed" in variant:
        from dpocache.models.streaming import StreamedLayers
        from dpocache.scoring.logprobs import decoder_layers

        StreamedLayers(model, decoder_layers(model), "cpu")
    return model


def time_steps(model, steps: int) -> float:
    """Median seconds of a forward and backward, after 5 of warm-up."""
    import torch

    ids = torch.randint(0, 256, (1, 16), generator=torch.Generator().manual_seed(0))
    times = []
    for _ in range(steps + 5):
        start = time.perf_counter()
        with torch.autocast("cpu", torch.bfloat16):
            logits = model(input_ids=ids).logits
        logits.float().sum().backward()
        times.append(time.perf_counter() - start)
    return statistics.median(times[5:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    args = parser.parse_args()

    import torch

    from dpocache.models import lora_fused

    torch.set_num_threads(1)
    models = {v: build(v, args.layers) for v in args.variants}
    rounds = {v: [] for v in args.variants}
    traced_base = lora_fused._traced_base
    for _ in range(args.rounds):
        for variant, model in models.items():
            lora_fused.CAST_ONCE = variant not in ("peft", "fused")
            # read where the layer is traced: the +addmm variant's graphs trace no base into the operation
            lora_fused._traced_base = (lambda base: None) if variant.endswith("+addmm") else traced_base
            rounds[variant].append(time_steps(model, args.steps) * 1e3)
    lora_fused._traced_base = traced_base
    print(json.dumps({"ms_median": {v: round(statistics.median(r), 2) for v, r in rounds.items()},
                      "ms_rounds": {v: [round(x, 2) for x in r] for v, r in rounds.items()},
                      "layers": args.layers, "threads": 1, "torch": torch.__version__}))


if __name__ == "__main__":
    main()
