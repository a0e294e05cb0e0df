"""A checkpointed LoRA step with and without ``--checkpoint-keep attention``, side by side in one
process: step times, and where the profiler puts each side's time.

    python bench/probes/kept_attention_probe.py [--dtype bfloat16|float32] [--layers 4] [--rounds 9] \
        [--steps 1] [--profile-steps 4] [--compiled]

The ``8b-ratio`` model of ``bench/common.py`` (Llama 3.1 8B's ratios at a quarter of its width:
hidden 1,024, MLP 3,584, 8 query heads to 2 key heads) with ``--layers`` decoder layers, LoRA r 16
on every linear layer, each layer checkpointed, the recompute skipping the down projections'
products as ``train`` does; 8 pairs of its data (prompts of 20 to 120 words, completions of 10
to 150; a word is a token), in the packed layout on the causal rows. Rounds alternate which side
runs first; a round's figure is the median of its ``--steps``. ``--compiled``: each layer's forward
compiled inside its checkpoint, as the GPU suite's streamed LoRA row runs (``LayerCheckpoint``;
the warm-up step compiles). Prints a JSON line: each side's step seconds per round and their
medians, and per profiled step each side's wall time and the self time of flash attention's
forward and of its backward.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

BENCH = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(BENCH))
sys.path.insert(0, str(BENCH.parent))  # dpocache in a checkout not installed

from common import CONFIGS, make_rows  # noqa: E402

FLASH_FORWARD = "aten::_scaled_dot_product_flash_attention_for_cpu"
FLASH_BACKWARD = FLASH_FORWARD + "_backward"


def build(keep: tuple[str, ...], tokenizer, layers: int, compiled: bool = False):
    """The probe's model checkpointed keeping ``keep`` (``compiled``: each layer's forward
    compiled inside its checkpoint): ``(model, scorer)``."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    from dpocache.models.checkpointing import enable_checkpointing
    from dpocache.scoring.layouts import training_layout
    from dpocache.scoring.logprobs import CompletionLogProbs

    shape = CONFIGS["8b-ratio"]
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=shape.hidden_size, num_hidden_layers=layers,
                         intermediate_size=shape.intermediate_size, num_attention_heads=shape.num_attention_heads,
                         num_key_value_heads=shape.num_key_value_heads, max_position_embeddings=4096)
    model = get_peft_model(LlamaForCausalLM(config), LoraConfig(r=16, target_modules="all-linear")).train()
    enable_checkpointing(model, keep, compiled=compiled, skip_unread=True)
    model.enable_input_require_grads()
    scorer = CompletionLogProbs(model)
    assert training_layout(scorer, "packed", "causal").reason is None
    return model, scorer


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=1, help="steps a round, its figure their median")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--profile-steps", type=int, default=4)
    parser.add_argument("--compiled", action="store_true", help="each layer compiled inside its checkpoint")
    args = parser.parse_args(argv)

    from torch.profiler import profile

    from dpocache.data.pairs import load_preference_data
    from dpocache.models.tiny import build_tokenizer
    from dpocache.scoring.layouts import layout_logprobs

    tokenizer = build_tokenizer()
    pairs = load_preference_data(make_rows(CONFIGS["8b-ratio"], 8), tokenizer, show_progress=False).pairs
    layers, steps = args.layers, args.steps
    sides = {side: build(keep, tokenizer, layers, args.compiled)
             for side, keep in (("kept", ("attention",)), ("recomputed", ()))}

    def step(side: str) -> None:
        model, scorer = sides[side]
        model.zero_grad()
        with torch.autocast("cpu", torch.bfloat16, enabled=args.dtype == "bfloat16"):
            logps, _ = layout_logprobs(scorer, "packed", pairs, tokenizer.pad_token_id, "cpu")
        (logps.chosen_logps.sum() - logps.rejected_logps.sum()).backward()

    for side in sides:  # warm-up
        step(side)
    seconds = {side: [] for side in sides}
    for r in range(args.rounds):
        for side in (list(sides) if r % 2 == 0 else list(reversed(sides))):
            times = []
            for _ in range(steps):
                start = time.perf_counter()
                step(side)
                times.append(time.perf_counter() - start)
            seconds[side].append(round(statistics.median(times), 5))
    profiled = {}
    for side in sides:
        with profile() as prof:
            start = time.perf_counter()
            for _ in range(args.profile_steps):
                step(side)
            wall = (time.perf_counter() - start) / args.profile_steps
        self_ms = {e.key: e.self_cpu_time_total / 1e3 / args.profile_steps for e in prof.key_averages()}
        profiled[side] = {"wall_s": round(wall, 4), "flash_forward_ms": round(self_ms.get(FLASH_FORWARD, 0.0), 1),
                          "flash_backward_ms": round(self_ms.get(FLASH_BACKWARD, 0.0), 1)}
    print(json.dumps({"command": "python bench/probes/kept_attention_probe.py " + " ".join(argv or sys.argv[1:]),
                      "dtype": args.dtype, "tokens": sum(p.unique_tokens for p in pairs), "layers": layers,
                      "compiled": args.compiled, "threads": torch.get_num_threads(), "seconds": seconds,
                      "median_s": {s: statistics.median(v) for s, v in seconds.items()},
                      "profiled_step": profiled}))


if __name__ == "__main__":
    main()
