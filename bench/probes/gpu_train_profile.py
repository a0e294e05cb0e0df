"""Where a training step's time goes: ``dpocache train`` steps with torch.profiler over a few.

    python bench/probes/gpu_train_profile.py [--config 1b-2048] [--batch-size 4] [--warmup 4] [--profile-steps 2]
        [--train-args "--compile on ..."]

Runs ``dpocache.training.loop`` on the configuration's model and pairs (its cache built first, by the
run itself), times every step with the device synchronised, and wraps steps ``warmup + 1`` to
``warmup + profile-steps`` in torch.profiler. Prints the kernel table (sorted by device time)
and one JSON line: the step times, the useful FLOPs of a step (``common.flops_of_build``'s
convention), the median step's MFU against the device's nominal bf16 peak, and per profiled step
the host's own op time (its waits in synchronising CUDA calls apart) against the device's busy
time (a step whose host time is the larger is bound by the host). Without CUDA it
runs on the CPU (``--config 58m --dtype float32``: a smoke test of the code path).
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

BENCH = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(BENCH), str(BENCH.parent)]  # bench/common.py, and dpocache in a checkout not installed

from common import CONFIGS, parse_probe_args, probe_inputs, profile_summary, timed_train_args  # noqa: E402

import dpocache.training.loop as train_mod  # noqa: E402
from dpocache.config import build_config  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", default="1b-2048", choices=list(CONFIGS))
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=4, help="steps before the profiled ones (compiles included)")
    parser.add_argument("--profile-steps", type=int, default=2)
    parser.add_argument("--rows", type=int, default=40, help="rows of the kernel table")
    parser.add_argument("--train-args", default="", help="more dpocache train options, one string")
    args = parse_probe_args(parser)

    cfg = CONFIGS[args.config]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    inputs, flops, peak = probe_inputs(cfg, device == "cuda")
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])

    def synchronize() -> None:
        if device == "cuda":
            torch.cuda.synchronize()

    steps: list[float] = []
    profiled = range(args.warmup, args.warmup + args.profile_steps)
    original_step = train_mod.train_step
    profiler = profile(activities=activities)

    def timed_step(run, window):
        index = len(steps)
        if index == profiled.start:
            profiler.__enter__()
        synchronize()
        start = time.perf_counter()
        original_step(run, window)
        synchronize()
        steps.append(time.perf_counter() - start)
        if index == profiled.stop - 1:
            profiler.__exit__(None, None, None)

    train_mod.train_step = timed_step
    scratch = Path(tempfile.mkdtemp(prefix="train-profile-"))
    overrides = timed_train_args(inputs / "model", inputs / "data.jsonl", args.dtype, device, scratch / "cache",
                                 scratch / "run", args.batch_size, profiled.stop)
    train_mod.train(build_config(None, [*overrides, *shlex.split(args.train_args)]))
    key = "cuda_time_total" if device == "cuda" else "cpu_time_total"
    averages = profiler.key_averages()
    print(averages.table(sort_by=key, row_limit=args.rows, max_name_column_width=70), flush=True)
    median = statistics.median(steps[args.warmup:] or steps)
    step_flops = flops["train_per_pair"] * args.batch_size
    print(json.dumps({
        "config": args.config, "dtype": args.dtype, "batch_size": args.batch_size, "train_args": args.train_args,
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "torch": torch.__version__,
        "step_s": [round(s, 4) for s in steps], "median_profiled_step_s": round(median, 4),
        "step_tflop": round(step_flops / 1e12, 2),
        **profile_summary(averages, args.profile_steps, device == "cuda"),
        "mfu_nominal": round(step_flops / median / peak, 4) if peak else None,
        "peak_gpu_allocated_bytes": torch.cuda.max_memory_allocated() if device == "cuda" else None,
    }), flush=True)


if __name__ == "__main__":
    main()
