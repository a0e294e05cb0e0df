"""Shared pieces of the benchmarks: model configurations, the generated preference set, and
the inputs directory both sides read (a ``save_pretrained`` model with its tokenizer, and a
JSONL file of standard-format rows); the matmul peaks and the reference pass's FLOPs that MFU is
read against; a timed reference pass and the options of the in-process A/Bs; a GPU probe's start.

Nothing is downloaded: the model is built from a config with random weights, the tokenizer is
``dpocache.models.tiny.build_tokenizer`` (a byte-level BPE trained offline), the text is random words.

This is the one bench module the probes in ``bench/probes/`` import (they put ``bench/`` on
``sys.path``); the maintained benchmarks import it too, and nothing here imports them.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

BENCH_DIR = Path(__file__).resolve().parent


@dataclass(frozen=True)
class BenchConfig:
    name: str
    # Llama body
    vocab_size: int = 32000
    hidden_size: int = 512
    intermediate_size: int = 1376
    num_hidden_layers: int = 8
    num_attention_heads: int = 8
    num_key_value_heads: int = 8
    # data: words per prompt and per completion (uniform in the range)
    prompt_words: tuple[int, int] = (20, 120)
    completion_words: tuple[int, int] = (10, 150)
    pairs: int = 256


CONFIGS = {
    # The configuration of the issue: a 58M-parameter Llama, 20-120-word prompts, 10-150-word completions.
    "58m": BenchConfig("58m"),
    # Same model, prompts 4x the completions (mean 160 vs 40 words): the shared prompt matters more.
    "long-prompt": BenchConfig("long-prompt", prompt_words=(80, 240), completion_words=(10, 70), pairs=128),
    # Llama 3.1 8B's ratios (an MLP 3.5x the hidden size, 4 query heads to a key head) at a quarter
    # of its width and 8 layers: where the decoder layers' products, not the head, set a step's work.
    "8b-ratio": BenchConfig("8b-ratio", hidden_size=1024, intermediate_size=3584, num_attention_heads=8,
                            num_key_value_heads=2, pairs=128),
    # ~1.1B parameters (TinyLlama's shape), for the cache-hit start-up time only.
    "1b": BenchConfig("1b", hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
                      num_key_value_heads=4, pairs=16),
    # The GPU configuration of the layout issue: the same 1.1B Llama, sequences up to 2048 tokens
    # (the tokenizer makes one token per word here): prompts 1,100-1,400, completions 500-640.
    "1b-2048": BenchConfig("1b-2048", hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
                           num_attention_heads=32, num_key_value_heads=4, prompt_words=(1100, 1400),
                           completion_words=(500, 640), pairs=256),
}

TOKENIZER_VOCAB = 8000  # trained size (the BPE saturates below it on the generated corpus); <= the model's


def inputs_dir(cfg: BenchConfig, pairs: int, root: Path | None = None) -> Path:
    return (root or BENCH_DIR / "work") / f"{cfg.name}-{pairs}"


def make_rows(cfg: BenchConfig, pairs: int, seed: int = 0) -> list[dict]:
    from dpocache.models.tiny import _WORDS

    rng = random.Random(seed)

    def words(lo_hi: tuple[int, int]) -> str:
        return " ".join(rng.choice(_WORDS) for _ in range(rng.randint(*lo_hi)))

    rows = []
    for i in range(pairs):
        rows.append({"prompt": f"question {i}: " + words(cfg.prompt_words),
                     "chosen": " " + words(cfg.completion_words),
                     "rejected": " " + words(cfg.completion_words)})
    return rows


def build_inputs(cfg: BenchConfig, pairs: int, root: Path | None = None, seed: int = 0) -> Path:
    """``<root>/<config>-<pairs>/{model/, data.jsonl, info.json}``; reused when already built."""
    out = inputs_dir(cfg, pairs, root)
    info_path = out / "info.json"
    if info_path.exists():
        return out
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from dpocache.data.rows import write_jsonl
    from dpocache.models.tiny import build_tokenizer

    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(TOKENIZER_VOCAB)
    config = LlamaConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers, num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads, max_position_embeddings=4096,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    with torch.device("cpu"):
        model = LlamaForCausalLM(config)
    n_params = sum(p.numel() for p in model.parameters())
    model.save_pretrained(out / "model")
    tokenizer.save_pretrained(out / "model")
    del model
    write_jsonl(make_rows(cfg, pairs, seed), out / "data.jsonl")
    info = {"config": asdict(cfg), "pairs": pairs, "parameters": n_params, "tokenizer_vocab": len(tokenizer)}
    info_path.write_text(json.dumps(info, indent=1))
    return out


def bench_pairs(name: str, limit: int | None = None) -> tuple[Path, list]:
    """The model directory of configuration ``name`` and its tokenized pairs (the first
    ``limit``; all by default), built on first use."""
    from dpocache.cli.cache import load_tokenizer
    from dpocache.data.pairs import load_preference_data

    cfg = CONFIGS[name]
    inputs = build_inputs(cfg, cfg.pairs)
    tokenizer = load_tokenizer(inputs / "model")
    data = load_preference_data(str(inputs / "data.jsonl"), tokenizer, None, None, False, show_progress=False)
    return inputs / "model", data.pairs[:limit]


def write_results(name: str, summary: dict, runs: dict) -> Path:
    """``bench/results/<name>-<time>.json``: the summary and every run; prints the summary."""
    out = BENCH_DIR / "results" / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.write_text(json.dumps({"summary": summary, "runs": runs}, indent=1))
    print(json.dumps(summary, indent=1))
    print(f"wrote {out}")
    return out


def read_results(paths: list[Path]) -> list[dict]:
    """Each of ``paths`` read as a result file (JSON); ``ValueError`` names the first that cannot
    be read (``--merge`` of bench_vs_trl.py and gpu_suite.py)."""
    results = []
    for path in paths:
        try:
            results.append(json.loads(Path(path).read_text()))
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"{path}: not a readable result ({e})") from None
    return results


# --------------------------------------------------------------------------- peaks and FLOPs

# Dense bf16 tensor-core peaks from the vendor's data sheets (no sparsity), by device name.
NOMINAL_BF16_PEAKS = {"H100 PCIe": 756e12, "H100": 989.4e12, "H200": 989.4e12, "A100": 312e12}


def nominal_bf16_peak(device_name: str) -> float | None:
    """The dense bf16 peak (FLOP/s) of the GPU named ``device_name`` (``torch.cuda.get_device_name``),
    None for one not in ``NOMINAL_BF16_PEAKS``; needs no torch, so a parent process that only
    starts workers can read it without initialising CUDA."""
    for key, peak in NOMINAL_BF16_PEAKS.items():  # "H100 PCIe" before "H100"
        if key in device_name:
            return peak
    return None


def measure_peak(dtype_name: str, device: str = "cpu", seconds: float = 3.0, cached: bool = True) -> float:
    import torch

    from dpocache.training.metrics import measured_peak_flops

    dtype = getattr(torch, dtype_name)
    sizes, seconds = ((1024, 2048), seconds) if device == "cpu" else ((4096, 8192), 1.0)
    return max(measured_peak_flops(torch.device(device), dtype, size=size, seconds=seconds, cached=cached)
               for size in sizes)


def nominal_peaks(device: str) -> dict:
    """``{"nominal bfloat16": FLOP/s}`` for a known GPU, else empty."""
    if device == "cpu":
        return {}
    import torch

    name = torch.cuda.get_device_name()
    for key, peak in NOMINAL_BF16_PEAKS.items():  # "H100 PCIe" before "H100"
        if key in name:
            return {f"nominal bfloat16 ({name})": peak}
    return {}


def flops_of_build(inputs: Path, info: dict) -> dict:
    """Reference-pass FLOPs of the data set, two ways:

    - ``convention``: the issue's (and dpocache.training.metrics') 2N per token, prompt counted once,
      plus attention 4·L·H·(mean sequence length) per token; N includes the embeddings.
    - ``executed``: the matmuls dpocache actually runs: 2·(non-embedding body parameters) per
      token, the output head 2·H·V on completion positions only, the same attention term.
    """
    from dpocache.cli.cache import load_tokenizer
    from dpocache.data.pairs import load_preference_data
    from dpocache.training.metrics import forward_flops_per_token

    cfg = info["config"]
    tok = load_tokenizer(inputs / "model")
    pairs = load_preference_data(str(inputs / "data.jsonl"), tok, None, None, False, show_progress=False).pairs
    unique = sum(p.unique_tokens for p in pairs)
    completion = sum(len(p.chosen_ids) + len(p.rejected_ids) for p in pairs)
    mean_seq = sum(p.num_tokens for p in pairs) / (2 * len(pairs))
    n, layers, hidden, vocab = info["parameters"], cfg["num_hidden_layers"], cfg["hidden_size"], cfg["vocab_size"]
    attention = 4.0 * layers * hidden * mean_seq
    body = n - 2 * vocab * hidden  # untied embeddings and head
    return {
        "unique_tokens": unique,
        "convention": unique * forward_flops_per_token(n, layers, hidden, mean_seq),
        "executed": unique * (2.0 * body + attention) + completion * 2.0 * hidden * vocab,
        # A training step: forward and backward (3x the forward) over the same tokens, per pair.
        "train_per_pair": 3.0 * unique / len(pairs) * forward_flops_per_token(n, layers, hidden, mean_seq),
        "unique_tokens_per_pair": unique / len(pairs),
    }


# ---------------------------------------------------------------- a timed reference pass, A/Bs


def synchronize(device: torch.device) -> None:
    """Wait for the GPU's queued work, so a pass's wall time is its own (no-op on a CPU)."""
    if device.type == "cuda":
        import torch

        torch.cuda.synchronize()


def timed_pass(reference, batches: list, budget: int, device: torch.device) -> float:
    """Seconds to score ``batches`` (planned under ``budget``)."""
    from dpocache.cache.build import score_batch

    synchronize(device)
    start = time.perf_counter()
    for batch in batches:
        score_batch(reference, batch, 0, budget)
    synchronize(device)
    return time.perf_counter() - start


def add_pass_arguments(parser: argparse.ArgumentParser) -> None:
    """The options that say which reference pass an A/B runs (``token_budget_ab.py``'s and
    ``probes/compile_ab.py``'s)."""
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--segments", type=int, default=8, help="interleaved stretches per pass")
    parser.add_argument("--pairs", type=int, default=None, help="the first N pairs (default: the configuration's)")
    parser.add_argument("--config", default="58m", choices=list(CONFIGS))
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--layout", default="shared", choices=["shared", "packed", "padded"])


def segments(batches: list, count: int) -> list[list]:
    """``batches`` cut into ``count`` consecutive stretches of about equal tokens."""
    sizes = [sum(p.unique_tokens for p in batch) for batch in batches]
    total, done, out = sum(sizes), 0, [[] for _ in range(count)]
    for batch, size in zip(batches, sizes):
        out[min(count - 1, done * count // total)].append(batch)
        done += size
    return out


# ----------------------------------------------------------------------------- GPU probes


def parse_probe_args(parser: argparse.ArgumentParser) -> argparse.Namespace:
    """A GPU probe's arguments, with ``--no-cudnn-sdp`` (SDPA kept off its cuDNN kernel for the
    whole process) added and applied."""
    parser.add_argument("--no-cudnn-sdp", action="store_true",
                        help="keep SDPA off its cuDNN kernel (torch.backends.cuda.enable_cudnn_sdp(False))")
    args = parser.parse_args()
    if args.no_cudnn_sdp:
        import torch

        torch.backends.cuda.enable_cudnn_sdp(False)
        # torch's AOTAutograd cache does not key on the SDPA flags: a compiled run would reuse
        # graphs an earlier run traced with cuDNN (one did, 2026-11-23). Inductor's own cache
        # keys on the traced graph, which names the kernel, so it stays on.
        torch._functorch.config.enable_autograd_cache = False
    return args


def probe_inputs(cfg: BenchConfig, on_cuda: bool) -> tuple[Path, dict, float | None]:
    """A probe's start: ``cfg``'s inputs directory (built on first use), its reference-pass
    FLOPs (``flops_of_build``) and the CUDA device's nominal bf16 peak (None off CUDA or for an
    unknown GPU)."""
    inputs = build_inputs(cfg, cfg.pairs)
    flops = flops_of_build(inputs, json.loads((inputs / "info.json").read_text()))
    peak = next(iter(nominal_peaks("cuda").values()), None) if on_cuda else None
    return inputs, flops, peak


# CUDA runtime calls in which the host waits for the device (a synchronising copy waits inside its
# cudaMemcpyAsync): their self CPU time is a wait, not host work.
HOST_WAITS = {"cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy",
              "cudaMemcpyAsync"}


def profile_summary(averages, steps: int, on_cuda: bool) -> dict:
    """Per step of a torch.profiler run over ``steps`` steps (``averages``: its
    ``key_averages()``): the host's own op time, its waits in synchronising CUDA calls apart, and
    the device's busy time (its kernels' time). A step whose host time exceeds its device time
    is bound by the host (the profiler inflates the host side by its own cost)."""
    from torch.autograd import DeviceType

    waits_s = sum(e.self_cpu_time_total for e in averages if e.key in HOST_WAITS) / 1e6 / steps
    host_s = sum(e.self_cpu_time_total for e in averages) / 1e6 / steps - waits_s
    # Kernels only, as torch's own table totals them: an op's self device time repeats its kernels'
    device_s = sum(e.self_device_time_total for e in averages
                   if e.device_type != DeviceType.CPU and not e.is_user_annotation) / 1e6 / steps if on_cuda else None
    return {"profiled_host_op_s_per_step": round(host_s, 4), "profiled_host_wait_s_per_step": round(waits_s, 4),
            "profiled_device_busy_s_per_step": None if device_s is None else round(device_s, 4)}


def timed_train_args(model, data, dtype: str, device: str, cache_dir, output_dir, batch_size: int,
                     steps: int) -> list[str]:
    """The ``dpocache train`` options of a benchmark's timed steps: a tiny learning rate and no
    warm-up (the steps' cost is measured, not their learning), no log or progress bar among
    them, no truncation (the data was built to fit)."""
    return ["--model", str(model), "--data", str(data), "--dtype", dtype, "--device", device,
            "--cache-dir", str(cache_dir), "--output-dir", str(output_dir), "--batch-size", str(batch_size),
            "--max-steps", str(steps), "--lr", "1e-6", "--optim.warmup_ratio", "0", "--logging-steps", "10000",
            "--train.progress", "false", "--max-length", "none"]
