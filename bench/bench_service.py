"""The reference service on a GRPO-shaped workload, against what torchforge's reference does.

Workload: groups of one prompt (200-800 tokens) and G = 8 completions (50-300 tokens), token
ids drawn at random (the model is built from a config with random weights; nothing is
downloaded). Three measurements, side by side in every repetition, same model, same dtype:

- ``padded``: torchforge's way. Each group is G rows ``prompt + completion`` right-padded to
  the group's longest, one forward of the whole causal LM, full logits ``(G, T, V)`` upcast to
  fp32, log-softmax, gather of the completion tokens.
- ``service``: ``ReferenceService.score`` with no cache: the group layout (each prompt once),
  length-grouped batches under ``--max-tokens``, the head on completion positions only.
- ``cached``: a service with a look-aside cache: its first ``score`` (computes and writes) and
  its second (every sequence a hit).

tokens/s counts the same tokens for both: each sequence's ``prompt + completion`` (the prompt
G times, as G separate sequences hold it). Medians of ``--reps``; ratios printed; the JSON goes
to bench/results/. With ``--peak-tflops`` (or a known GPU) the service's MFU is printed: model
FLOPs of the work it does (each prompt once; 2 x body parameters per token, the head on
completion tokens, attention on each sequence's own context) over time and peak.

    python bench/bench_service.py                        # 58m Llama, 2 groups, fp32 on the CPU: minutes
    python bench/bench_service.py --size 1b --dtype bfloat16 --groups 64 --max-tokens 32768   # one GPU
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dpocache.cache.build import peak_memory_bytes  # noqa: E402
from dpocache.scoring.logprobs import autocast  # noqa: E402
from dpocache.models.reference import resolve_dtype  # noqa: E402
from dpocache.service.reference_service import ReferenceService  # noqa: E402

BENCH_DIR = Path(__file__).resolve().parent

SIZES = {  # Llama bodies (hidden, intermediate, layers, heads, key-value heads); vocabulary 32000
    "small": (256, 688, 4, 4, 4),
    "58m": (512, 1376, 8, 8, 8),  # bench/common.py's 58m
    "1b": (2048, 5632, 22, 32, 4),  # TinyLlama's shape
}
PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0}  # dense bf16 tensor-core peaks


def build_model(size: str, device: torch.device):
    from transformers import LlamaConfig, LlamaForCausalLM

    hidden, inter, layers, heads, kv_heads = SIZES[size]
    config = LlamaConfig(vocab_size=32000, max_position_embeddings=2048, tie_word_embeddings=False,
                         hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=kv_heads, attn_implementation="sdpa")
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(config)
    return model.eval().requires_grad_(False)


def workload(groups: int, g: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    ids = lambda n: [rng.randrange(10, 32000) for _ in range(n)]  # noqa: E731
    return [{"prompt_ids": ids(rng.randint(200, 800)),
             "completion_ids": [ids(rng.randint(50, 300)) for _ in range(g)]} for _ in range(groups)]


def sequence_tokens(requests) -> int:
    return sum(len(r["prompt_ids"]) * len(r["completion_ids"]) + sum(map(len, r["completion_ids"])) for r in requests)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.inference_mode()
def padded_forward(model, requests, dtype, device) -> list[list[torch.Tensor]]:
    """torchforge's reference: G padded rows per group, full fp32 logits, log-softmax, gather."""
    out = []
    for r in requests:
        p, comps = r["prompt_ids"], r["completion_ids"]
        width = len(p) + max(map(len, comps))
        ids = torch.zeros((len(comps), width), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, c in enumerate(comps):
            ids[i, :len(p) + len(c)] = torch.tensor(p + c)
            mask[i, :len(p) + len(c)] = 1
        ids, mask = ids.to(device), mask.to(device)
        with autocast(dtype, device):
            logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits  # (G, T, V)
        logps = logits.float().log_softmax(-1)[:, :-1].gather(-1, ids[:, 1:, None]).squeeze(-1)  # (G, T-1)
        out.append([logps[i, len(p) - 1:len(p) - 1 + len(c)].cpu() for i, c in enumerate(comps)])
    return out


def timed(fn, device):
    _sync(device)
    start = time.perf_counter()
    result = fn()
    _sync(device)
    return time.perf_counter() - start, result


def service_flops(model, requests) -> float:
    """Model FLOPs of the service's work: 2 x body parameters per unique token, the head on
    completion tokens, attention (QK^T and AV) over each sequence's own causal context."""
    cfg = model.config
    body = sum(p.numel() for n, p in model.named_parameters() if "embed_tokens" not in n and "lm_head" not in n)
    unique = sum(len(r["prompt_ids"]) + sum(map(len, r["completion_ids"])) for r in requests)
    completion = sum(sum(map(len, r["completion_ids"])) for r in requests)
    attn = 0
    for r in requests:
        p = len(r["prompt_ids"])
        attn += p * (p + 1) // 2 + sum(len(c) * p + len(c) * (len(c) + 1) // 2 for c in r["completion_ids"])
    attn_flops = 4 * cfg.num_hidden_layers * cfg.hidden_size * attn
    return 2 * body * unique + 2 * cfg.hidden_size * cfg.vocab_size * completion + attn_flops


def one_rep(model, requests, dtype, device, max_tokens: int) -> dict:
    rep = {}
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    rep["padded_s"], base = timed(lambda: padded_forward(model, requests, dtype, device), device)
    rep["padded_peak_bytes"] = peak_memory_bytes(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    service = ReferenceService(model, dtype=dtype, max_tokens=max_tokens)
    rep["service_s"], values = timed(lambda: service.score(requests), device)
    rep["service_peak_bytes"] = peak_memory_bytes(device)
    rep["service_stats"] = service.stats()
    rep["max_abs_diff_vs_padded"] = max((a - b).abs().max().item() for x, y in zip(base, values) for a, b in zip(x, y))
    with tempfile.TemporaryDirectory() as cache_dir:
        cached = ReferenceService(model, dtype=dtype, max_tokens=max_tokens, cache_dir=cache_dir)
        rep["cached_first_s"], _ = timed(lambda: cached.score(requests), device)
        rep["cached_second_s"], _ = timed(lambda: cached.score(requests), device)
        rep["cached_second_forward_passes"] = cached.stats()["forward_passes"] - rep["service_stats"]["forward_passes"]
    return rep


def summarise(res: dict) -> list[str]:
    reps, tokens = res["reps"], res["sequence_tokens"]
    med = lambda k: statistics.median(r[k] for r in reps)  # noqa: E731
    lines = [
        f"{'':<44}{'padded (torchforge)':>20}{'service':>12}{'ratio':>9}",
        f"{'tokens/s (prompt + completion per sequence)':<44}{tokens / med('padded_s'):>20.0f}"
        f"{tokens / med('service_s'):>12.0f}{med('padded_s') / med('service_s'):>8.2f}x",
        f"{'seconds':<44}{med('padded_s'):>20.3f}{med('service_s'):>12.3f}",
        f"cached: first pass {med('cached_first_s'):.3f} s, second {med('cached_second_s'):.4f} s "
        f"({med('cached_first_s') / med('cached_second_s'):.0f}x; forward passes in the second: "
        f"{max(r['cached_second_forward_passes'] for r in reps)})",
        f"max |service - padded| per token: {max(r['max_abs_diff_vs_padded'] for r in reps):.2e}",
    ]
    if res["device"].startswith("cuda"):  # on a CPU only the process's lifetime peak is known (in the JSON)
        lines.insert(3, f"{'peak memory (MiB)':<44}{med('padded_peak_bytes') / 2**20:>20.0f}"
                        f"{med('service_peak_bytes') / 2**20:>12.0f}")
    if res.get("peak_tflops"):
        mfu = res["service_flops"] / med("service_s") / (res["peak_tflops"] * 1e12)
        lines.append(f"service MFU: {100 * mfu:.1f}% of {res['peak_tflops']:.0f} TFLOP/s "
                     f"({res['service_flops'] / med('service_s') / 1e12:.1f} TFLOP/s)")
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", choices=sorted(SIZES), default="58m")
    p.add_argument("--groups", type=int, default=2)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--device", default=None)
    p.add_argument("--max-tokens", type=int, default=4096)
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    p.add_argument("--peak-tflops", type=float, default=None, help="device peak for MFU (known GPUs: automatic)")
    p.add_argument("--out", type=Path, default=BENCH_DIR / "results")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = resolve_dtype(args.dtype, device)
    model = build_model(args.size, device)
    requests = workload(args.groups, args.group_size)
    peak = args.peak_tflops
    if peak is None and device.type == "cuda":
        peak = next((v for k, v in PEAK_TFLOPS.items() if k in torch.cuda.get_device_name(device)), None)
    res = {"size": args.size, "dtype": str(dtype).removeprefix("torch."), "device": str(device),
           "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
           "threads": torch.get_num_threads(), "groups": args.groups, "group_size": args.group_size,
           "max_tokens": args.max_tokens, "sequence_tokens": sequence_tokens(requests),
           "service_flops": service_flops(model, requests), "peak_tflops": peak, "reps": []}
    one_rep(model, workload(1, args.group_size, seed=1), dtype, device, args.max_tokens)  # warm-up
    for i in range(args.reps):
        res["reps"].append(one_rep(model, requests, dtype, device, args.max_tokens))
        res["reps"][-1]["loadavg"] = os.getloadavg()
        print(f"rep {i + 1}/{args.reps}: padded {res['reps'][-1]['padded_s']:.2f} s, "
              f"service {res['reps'][-1]['service_s']:.2f} s", file=sys.stderr)
    title = (f"{args.size} Llama, {res['dtype']} on {res['device_name']}, {args.groups} groups of 1 prompt + "
             f"{args.group_size} completions, {res['sequence_tokens']} sequence tokens, medians of {args.reps}")
    print(title)
    for line in summarise(res):
        print("  " + line)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"service-{args.size}-{res['dtype']}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(res, indent=1))
    print(f"  results: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
