"""The reference pass on a GPU under torch.compile variants, one variant per process (no TRL).

    python bench/probes/gpu_compile_probe.py --variant sdpa|flex|flex-layers|sdpa-layers [--layout shared|packed]
        [--dynamic] [--unpadded-rows] [--profile]

- ``sdpa``: today's default (the shared layout's dense boolean mask through SDPA), eager.
- ``flex``: FlexAttention with a ``BlockMask`` (transformers compiles the attention call alone).
- ``causal``: each prompt + completion gathered into a row of its own, SDPA's causal kernel, no mask.
- ``*-layers``: the same, with each decoder layer compiled (``nn.Module.compile``: the layers
  share one code object, so dynamo compiles the layer once and reuses it for every layer, the
  "regional compilation" recipe), so the layer's element-wise work (RMSNorm, RoPE, SiLU, casts,
  residual adds) is fused into a few kernels instead of tens of launches per layer.

Prints one JSON line per variant: each pass's tokens/s (prompt once) and MFU against the
device's nominal bf16 peak (the convention of ``common.flops_of_build``), the first pass
(which includes every compile) and the later ones apart, and dynamo's compile counters.
Without CUDA it runs on the CPU (``--config tiny``: a smoke test of the code path; ``--config
58m --dtype float32``: the CPU bench model).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

BENCH = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(BENCH), str(BENCH.parent)]  # bench/common.py, and dpocache in a checkout not installed

from common import CONFIGS, BenchConfig, parse_probe_args, probe_inputs, synchronize  # noqa: E402

from dpocache.scoring.layouts import budget_batches, reference_row_width  # noqa: E402
from dpocache.cache.build import score_batch  # noqa: E402
from dpocache.cli.cache import load_tokenizer  # noqa: E402
from dpocache.data.pairs import load_preference_data  # noqa: E402
from dpocache.scoring.logprobs import decoder_layers  # noqa: E402
from dpocache.models.reference import ReferenceModel  # noqa: E402

TINY = BenchConfig("tiny", vocab_size=2048, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, prompt_words=(60, 200), completion_words=(20, 60),
                   pairs=24)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--variant", required=True,
                        choices=["sdpa", "flex", "causal", "flex-layers", "sdpa-layers", "causal-layers"])
    parser.add_argument("--layout", default="shared", choices=["shared", "packed", "padded"])
    parser.add_argument("--config", default="1b-2048", choices=[*CONFIGS, "tiny"])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--budget", type=int, default=32768)
    parser.add_argument("--passes", type=int, default=3)
    parser.add_argument("--dynamic", action="store_true", help="*-layers: compile with dynamic shapes from the start")
    parser.add_argument("--unpadded-rows", action="store_true",
                        help="packed flex: rows as wide as their pairs, not padded to --budget (reference_row_width)")
    parser.add_argument("--profile", action="store_true", help="print a torch.profiler table of the last pass")
    args = parse_probe_args(parser)

    cfg = TINY if args.config == "tiny" else CONFIGS[args.config]
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    inputs, flops, peak = probe_inputs(cfg, device.type == "cuda")
    tok = load_tokenizer(inputs / "model")
    pairs = load_preference_data(str(inputs / "data.jsonl"), tok, None, None, False, show_progress=False).pairs

    attention = args.variant.removesuffix("-layers")
    ref = ReferenceModel.from_pretrained(inputs / "model", args.dtype, device, layout=args.layout,
                                         attention=attention)
    if args.variant.endswith("-layers"):
        for layer in decoder_layers(ref.model):  # compiling.compile_layers, with the old default as an option
            layer.compile(dynamic=True if args.dynamic else None)
    batches = budget_batches(pairs, args.budget, layout=ref.layout)
    max_tokens = None if args.unpadded_rows else args.budget  # packed flex rows padded to it, as the cache build does
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    passes = []
    for index in range(args.passes):
        profiling = args.profile and index == args.passes - 1
        with profile(activities=activities) if profiling else contextlib.nullcontext() as profiler:
            synchronize(device)
            start = time.perf_counter()
            for b in batches:
                score_batch(ref, b, 0, max_tokens)
            synchronize(device)
            seconds = time.perf_counter() - start
        if profiling:
            key = "cuda_time_total" if device.type == "cuda" else "cpu_time_total"
            print(profiler.key_averages().table(sort_by=key, row_limit=30, max_name_column_width=70), flush=True)
        passes.append({"seconds": round(seconds, 3), "tokens_per_s": round(flops["unique_tokens"] / seconds),
                       "mfu": round(flops["convention"] / seconds / peak, 4) if peak else None})
    from torch._dynamo.utils import counters

    print(json.dumps({
        "variant": args.variant, "dynamic": args.dynamic, "layout": ref.layout_choice.used,
        "row_width": reference_row_width(ref, max_tokens),
        "attention": ref.layout_choice.attention,
        "dtype": args.dtype, "budget": args.budget, "batches": len(batches),
        "device": torch.cuda.get_device_name() if peak else "cpu",
        "torch": torch.__version__, "passes": passes,
        "peak_gpu_allocated_bytes": torch.cuda.max_memory_allocated() if device.type == "cuda" else None,
        "dynamo": {k: dict(v) for k, v in counters.items() if k in ("stats", "frames", "recompiles")},
    }), flush=True)


if __name__ == "__main__":
    main()
