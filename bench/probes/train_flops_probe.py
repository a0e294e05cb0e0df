"""The matrix-product FLOPs a training step executes, counted by torch, against what its method
implies: does a step compute more than it should?

    python bench/probes/train_flops_probe.py [--config 58m] [--batch-size 4] \
        [--variant full=] [--variant lora="--lora-r 16"] \
        [--variant lora-checkpointed="--lora-r 16 --gradient-checkpointing true"]

Runs ``dpocache train`` on the configuration's model and pairs on the CPU in fp32 (FLOP counts
depend on shapes only, not on the device) and counts the second step's products with
``torch.utils.flop_counter.FlopCounterMode`` (every ``mm``/``addmm``/``bmm``, forward and
backward; attention's own kernel aside). Prints one JSON line per variant: its FLOPs, its tokens
(each prompt once), FLOPs per token over the model's matrix parameters (``N``: the decoder's
linear layers and the output head), and the ratio to the first variant. Full training runs 6N
per token, LoRA 4N (no weight gradients for the frozen base, plus its small adapters),
gradient checkpointing one forward (2N) more.
"""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
import sys
import tempfile
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(BENCH), str(BENCH.parent)]  # bench/common.py, and dpocache in a checkout not installed

from common import CONFIGS, build_inputs, timed_train_args  # noqa: E402

DEFAULT_VARIANTS = ["full=", "lora=--lora-r 16", "lora-checkpointed=--lora-r 16 --gradient-checkpointing true"]


def count_step(inputs: Path, batch_size: int, train_args: list[str], scratch: Path) -> dict:
    """The products of step 2 (step 1 audits the cache) of a run with ``train_args``."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    import dpocache.training.loop as loop
    from dpocache.config import build_config
    from dpocache.training import prefetch

    seen: dict = {}
    original = loop.train_step

    def counted(run, window):
        if run.step != 1:
            return original(run, window)
        idx = [i for micro in range(run.cfg.train.grad_accum) for i in prefetch.step_indices(run, run.step, micro)]
        seen["tokens"] = sum(run.train_data.pairs[i].unique_tokens for i in idx)
        seen["matrix_parameters"] = sum(m.weight.numel() for name, m in run.policy.named_modules()
                                        if isinstance(m, torch.nn.Linear) and "lora_" not in name)
        with FlopCounterMode(display=False) as counter:
            original(run, window)
        seen["flops"] = counter.get_total_flops()
        return None

    loop.train_step = counted
    try:
        overrides = timed_train_args(inputs / "model", inputs / "data.jsonl", "float32", "cpu", scratch / "cache",
                                     scratch / "run", batch_size, 2)
        loop.train(build_config(None, [*overrides, *train_args]))
    finally:
        loop.train_step = original
        shutil.rmtree(scratch / "run", ignore_errors=True)
    return seen


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", default="58m", choices=list(CONFIGS))
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--variant", action="append", metavar="NAME=OPTIONS",
                        help="a name and its dpocache train options (repeatable; "
                             "default: full, lora, lora-checkpointed)")
    args = parser.parse_args()
    inputs = build_inputs(CONFIGS[args.config], CONFIGS[args.config].pairs)
    scratch = Path(tempfile.mkdtemp(prefix="train-flops-"))
    first = None
    try:
        for variant in args.variant or DEFAULT_VARIANTS:
            name, _, options = variant.partition("=")
            seen = count_step(inputs, args.batch_size, shlex.split(options), scratch)
            per_token = seen["flops"] / seen["tokens"]
            first = first or seen["flops"]
            print(json.dumps({"config": args.config, "variant": name, "train_args": options, **seen,
                              "flops_per_token_over_N": round(per_token / seen["matrix_parameters"], 3),
                              "vs_first": round(seen["flops"] / first, 3)}), flush=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
