"""One linear layer under CPU bf16 autocast: the native bf16 kernel against dpocache's fp32-GEMM
route (dpocache/scoring/bf16_matmul.py), with plain fp32 for scale. Medians of several runs, GFLOP/s.

    python bench/probes/bf16_linear.py [--reps 7] [--threads 2]

The shapes are the 58m benchmark model's (hidden 512, MLP 1376, vocab 32000) at a 4096-token
batch, plus one output-head chunk (131 rows, as CPU inference uses).
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # dpocache in a checkout not installed

from dpocache.scoring import bf16_matmul  # noqa: E402

SHAPES = [(4096, 512, 1376), (4096, 1376, 512), (4096, 512, 512), (131, 512, 32000)]  # (rows, in, out)


def median_seconds(fn, reps: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, {args.threads} threads, AMX: {bf16_matmul.cpu_has_amx_bf16()}")
    print("rows x in x out | native bf16 | fp32-gemm bf16 | fp32 (GFLOP/s) | fp32-gemm / native")
    for rows, fan_in, fan_out in SHAPES:
        native = nn.Linear(fan_in, fan_out, bias=False)
        frozen = copy.deepcopy(native)
        bf16_matmul.install(frozen, "fp32-gemm")
        bf16_matmul.round_frozen_weights_(frozen)  # as the reference model runs
        x = torch.randn(rows, fan_in)

        def under_bf16(layer):
            def run():
                with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16):
                    return layer(x)
            return run

        def fp32():
            with torch.inference_mode():
                return native(x)

        flops = 2 * rows * fan_in * fan_out
        rate = {name: flops / median_seconds(fn, args.reps) / 1e9 for name, fn in
                (("native", under_bf16(native)), ("routed", under_bf16(frozen)), ("fp32", fp32))}
        print(f"{rows} x {fan_in} x {fan_out} | {rate['native']:.0f} | {rate['routed']:.0f} | {rate['fp32']:.0f} | "
              f"{rate['routed'] / rate['native']:.2f}x")


if __name__ == "__main__":
    main()
