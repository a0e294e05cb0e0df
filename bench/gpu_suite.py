"""dpocache against TRL 1.16 on one GPU, in one command: three rows, side by side, on the same
model, data, dtype and batch, each system's run in its own process.

    bench/gpu_suite.sh install                                 # on a GPU machine without TRL (offline)
    python bench/gpu_suite.py                                  # every row: 6 min on one H200 (2026-11-26)
    python bench/gpu_suite.py --only ref-8b                    # a part (a lent GPU runs 10 min a call)
    python bench/gpu_suite.py --merge A.json B.json --out bench/results/gpu-suite-h100-<date>.json
    python bench/gpu_suite.py --dry-run --out /tmp/suite.json  # every row at tiny shapes on a CPU
    python bench/gpu_suite.py --only train-8b-lora --profile   # and 2 dpocache steps more under torch.profiler
    python bench/gpu_suite.py --worker-timeout 240             # a side past 240 s killed, the next row runs
    python bench/gpu_suite.py --only train-8b-lora --no-trl --train-args "--compile off"  # an A/B: eager layers
    python bench/gpu_suite.py --only ref-8b --no-trl --build-args "--stream-reference false"  # resident weights
    python bench/gpu_suite.py --only train-8b-lora --no-trl --train-args "--resident-layers 0"  # all 32 streamed
    python bench/gpu_suite.py --only train-8b-lora --no-trl --train-args "--skip-unread-products false"  # recomputed
    python bench/gpu_suite.py --only train-8b-lora --variants "--turn-layers 8" "--compile off"  # one build
    python bench/gpu_suite.py --check --batch-size 8 --variants "--turn-layers 8"  # flags checked, on any machine

Rows:

- ``ref-8b``: the reference pass of a Llama-3.1-8B-shaped model (built from a config, random
  weights initialised on the GPU and saved once in bf16 under the work directory) over
  Tulu-shaped pairs (prompts 200-1,200 tokens, completions 100-800, no pair over 2,048 tokens,
  256 pairs): ``dpocache cache build`` against TRL's ``precompute_ref_log_probs``; on a GPU
  dpocache's with ``--stream-reference true`` (its decoder layers in host memory: the row's
  memory target lies below the weights).
- ``train-8b-lora``: DPO steps with LoRA (r 16, alpha 32, every linear layer, gradient
  checkpointing) on the same model and data (the first batch x steps pairs), against TRL's
  ``DPOTrainer`` with the same ``peft_config``; on a GPU dpocache's with ``--stream-base true
  --resident-layers 4 --turn-layers 8 --checkpoint-keep attention --compile on`` (its frozen
  base in host memory but for 4 layers spread among the others, 8 kept through each turn, each
  layer's forward compiled inside its checkpoint, whose recompute takes the attention's kept
  output and skips the down projections' products, as every checkpointed LoRA run does; the dry
  run neither streams nor compiles). ``--build-args``/``--train-args "--stream-base false ..."``
  turn them off for an A/B (later flags win); ``--variants`` runs dpocache's side once more per set of options after
  every row, on the inputs already built, each against the row's own TRL run (an entry's leading
  ``DPOCACHE_NAME=VALUE`` words go to its worker's environment: ``"DPOCACHE_ROW_GROUPS=1"``).
- ``train-1b-full``: full-parameter DPO steps of the 1.1B Llama of ``bench_vs_trl.py --config
  1b-2048``, with the options of its H100 run (``--attention causal --compile on``), against TRL's.

Definitions (also written into the result, with every worker's raw figures, so a reader can
recompute):

- Tokens are real tokens, each prompt once plus chosen and rejected (with their EOS), counted the
  same way for both systems. ``ref-8b``: the pass's tokens over its compute time (model load
  excluded; TRL: its ``_precompute_ref_logps``). Training rows: the tokens of the steps after the
  warm-up steps over their wall time, timed as one window with the GPU synchronised at its two
  ends only, so each system's steps overlap as in a real run (``workers.StepClock``).
- MFU counts useful FLOPs only: 2N per token for a forward, 6N for full training, 4N for a frozen
  base under LoRA (plus 6 per adapter parameter), attention included (4·L·H·T a forward, three
  times that with its backward), recomputation not counted. N is the parameters that multiply
  (the input embedding, a lookup, is left out; the untied output head is in). The peak is the
  device's dense bf16 peak (989.4 TFLOP/s for H100 SXM and H200); ``--dry-run`` reads its MFU
  against the CPU's measured fp32 matmul peak.
- Peak memory: ``torch.cuda.max_memory_allocated`` of each worker process (``--dry-run``: its
  peak RSS, as there is no GPU).

Choices: TRL loads the 8B model in bfloat16 (``trl_model_dtype``; 1.1B: float32, as its H100
run), since an fp32 8B model plus TRL's reference copy is not how anyone runs it; dpocache runs
``--dtype bfloat16`` (autocast over fp32 master weights; its reference pass stores frozen
matrices in bf16). TRL's state-dict hash, outside every timed span, is skipped (about 20 s a
process on the 8B model). Both systems read each data set without truncation (no pair exceeds
the maximum length). The training rows' reference values come, untimed, from each system's own
cache: dpocache's from a ``cache build`` run first (a hit after ``ref-8b``), TRL's from its
precompute in the training process.

Each finished row is written to the result at once; a row that fails (out of GPU memory, say)
is recorded with an ``error`` and the suite goes on. Inputs are built once under ``--work``
(default ``bench/work/``, git-ignored) and reused.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import random
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field, replace
from importlib import metadata
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_vs_trl import portable, run_worker  # noqa: E402
from common import (  # noqa: E402
    BENCH_DIR,
    CONFIGS,
    TOKENIZER_VOCAB,
    BenchConfig,
    build_inputs,
    measure_peak,
    nominal_bf16_peak,
    read_results,
    timed_train_args,
)

ROOT = BENCH_DIR.parent
ROWS = ("ref-8b", "train-8b-lora", "train-1b-full")
# The targets: tokens/s ratio and MFU at least, memory ratio at most.
TARGETS = {
    "ref-8b": {"mfu": 0.50, "vs_trl": 3.0, "mem_vs_trl": 0.6},
    "train-8b-lora": {"mfu": 0.35, "mem_vs_trl": 0.6},
    "train-1b-full": {"mfu": 0.35, "vs_trl": 2.0, "mem_vs_trl": 0.6},
}
LORA = {"r": 16, "alpha": 32}
DPO_LORA_ARGS = ["--lora-r", str(LORA["r"]), "--lora.alpha", str(LORA["alpha"]), "--gradient-checkpointing", "true"]

# Llama-3.1-8B's shape (its llama3 RoPE scaling left out: it changes no FLOP or byte).
LLAMA_8B = {"vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
            "num_attention_heads": 32, "num_key_value_heads": 8, "rope_theta": 500000.0,
            "max_position_embeddings": 8192, "rms_norm_eps": 1e-5}
TINY_LLAMA = {"vocab_size": 1024, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "rope_theta": 500000.0,
              "max_position_embeddings": 4096, "rms_norm_eps": 1e-5}


@dataclass(frozen=True)
class Shapes:
    """What a run measures at: the GPU suite's shapes (``GPU``) or the dry run's (``DRY``)."""

    device: str
    dtype: str  # both systems' compute dtype (dpocache --dtype; TRL bf16=True for bfloat16)
    llama: dict  # the 8B rows' model (LlamaConfig keywords)
    llama_dir: str  # its directory under the work directory
    model_dtype: str  # the dtype it is initialised and saved in
    trl_8b_dtype: str  # the dtype TRL loads it in
    prompt_tokens: tuple[int, int]
    completion_tokens: tuple[int, int]
    max_length: int
    ref_pairs: int
    batch_size: int  # pairs a step of the 1.1B row, and TRL's precompute batch
    lora_batch_size: int  # pairs a step of the 8B LoRA row
    lora_steps: int
    lora_warmup: int
    full_config: BenchConfig
    full_steps: int
    full_warmup: int  # the compiled steps recompile for new shapes in the first few
    full_train_args: tuple[str, ...]
    ref_build_args: tuple[str, ...]  # ref-8b's own cache build options
    lora_train_args: tuple[str, ...]  # train-8b-lora's own train options


# The 8B rows' memory targets (0.6x TRL's peak) lie below the bf16 weights both sides hold, so on
# a GPU their frozen decoder layers stay in host memory (docs/memory.md). The LoRA row keeps each
# layer's attention output through the recompute (no flash forward there), and spends the memory
# it takes on fewer resident layers (4 of 32, spread out) and 8 kept through each turn: on an
# H200 35.1% MFU at 18.9 GiB, where 10 resident without it ran 34.7% at 17.6 GiB (0.56x and 0.52x
# of TRL's peak; docs/benchmarks/gpu-suite-h200-20261127-1850.md). Its recompute skips the down
# projections' products, as every checkpointed LoRA run does. It compiles each layer's forward
# inside its checkpoint (its host time was as long as its device time on an H200 before:
# docs/speed.md), so its first steps compile and it leaves two out of the timing. It runs 8
# pairs a step, dpocache's default.
STREAMED_REFERENCE = ("--stream-reference", "true")
STREAMED_LORA = ("--stream-base", "true", "--resident-layers", "4", "--turn-layers", "8", "--checkpoint-keep",
                 "attention", "--compile", "on")

GPU = Shapes(device="cuda", dtype="bfloat16", llama=LLAMA_8B, llama_dir="llama-8b", model_dtype="bfloat16",
             trl_8b_dtype="bfloat16", prompt_tokens=(200, 1200), completion_tokens=(100, 800), max_length=2048,
             ref_pairs=256, batch_size=4, lora_batch_size=8, lora_steps=7, lora_warmup=2,
             full_config=CONFIGS["1b-2048"],
             full_steps=10, full_warmup=3, full_train_args=("--attention", "causal", "--compile", "on"),
             ref_build_args=STREAMED_REFERENCE, lora_train_args=STREAMED_LORA)
DRY = Shapes(device="cpu", dtype="float32", llama=TINY_LLAMA, llama_dir="dryrun-llama", model_dtype="float32",
             trl_8b_dtype="float32", prompt_tokens=(20, 60), completion_tokens=(10, 40), max_length=128,
             ref_pairs=12, batch_size=2, lora_batch_size=2, lora_steps=2, lora_warmup=1,
             full_config=BenchConfig("dryrun-1b", vocab_size=1024, hidden_size=64, intermediate_size=128,
                                     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                     prompt_words=(20, 60), completion_words=(10, 40), pairs=4),
             full_steps=2, full_warmup=1, full_train_args=(),
             ref_build_args=(), lora_train_args=())  # streaming needs a GPU


@dataclass
class Suite:
    """One run's settings and places: shapes, work and scratch directories, the workers' log,
    the flags every dpocache command gets, the peak MFU is read against."""

    shapes: Shapes
    work: Path
    scratch: Path
    log: Path
    kernel_args: list[str]
    peak: float | None
    profile_to: Path | None = None  # --profile: each row's dpocache side profiled, tables here
    # --profile's build runs, after every row is measured and written: (row, worker mode, spec)
    profiles: list = field(default_factory=list)
    train_args: tuple[str, ...] = ()  # --train-args: more dpocache train options in both training rows
    build_args: tuple[str, ...] = ()  # --build-args: more dpocache cache build options in ref-8b
    no_trl: bool = False  # --no-trl: dpocache's side only
    worker_timeout: float | None = None  # --worker-timeout: each side's process killed past it
    variants: tuple[tuple[str, ...], ...] = ()  # --variants: each more train options, dpocache's side again
    # the variants' runs, after every row is measured and written: (row, spec, warm-up steps, options)
    variant_runs: list = field(default_factory=list)


# ------------------------------------------------------------------------------ inputs


def tulu_rows(shapes: Shapes, pairs: int, seed: int = 0) -> list[dict]:
    """``pairs`` rows of random words, Tulu-shaped in tokens (the benchmarks' tokenizer makes one
    token of each word): prompt and completion lengths uniform in ``shapes``' ranges, each
    completion short enough that prompt + completion + EOS fits ``max_length``. One seeded
    stream: the first N rows of any longer set are the N-row set."""
    from dpocache.models.tiny import _WORDS

    rng = random.Random(seed)
    lo, hi = shapes.completion_tokens

    def words(n: int) -> str:
        return " ".join(rng.choice(_WORDS) for _ in range(n))

    rows = []
    for _ in range(pairs):
        prompt = rng.randint(*shapes.prompt_tokens)
        top = max(lo, min(hi, shapes.max_length - prompt - 1))
        rows.append({"prompt": words(prompt), "chosen": " " + words(rng.randint(lo, top)),
                     "rejected": " " + words(rng.randint(lo, top))})
    return rows


def data_stats(model: Path, data: Path, max_length: int) -> dict:
    """Token counts of ``data`` as dpocache tokenizes it (TRL's count, in the workers, is the same
    rule): ranges, totals, the mean sequence length (prompt + one completion) the attention FLOPs
    use. Raises ``ValueError`` for a pair over ``max_length``: both systems read without truncation."""
    from dpocache.cli.cache import load_tokenizer
    from dpocache.data.pairs import load_preference_data

    pairs = load_preference_data(str(data), load_tokenizer(model), None, None, False, show_progress=False).pairs
    prompts = [len(p.prompt_ids) for p in pairs]
    completions = [len(c) for p in pairs for c in (p.chosen_ids, p.rejected_ids)]
    longest = max(len(p.prompt_ids) + max(len(p.chosen_ids), len(p.rejected_ids)) for p in pairs)
    if longest > max_length:
        raise ValueError(f"{data.name}: a pair of {longest} tokens, over the maximum length {max_length}")
    return {"pairs": len(pairs), "prompt_tokens": [min(prompts), max(prompts)],
            "completion_tokens": [min(completions), max(completions)], "longest_sequence": longest,
            "max_length": max_length, "unique_tokens": sum(p.unique_tokens for p in pairs),
            "mean_seq_len": sum(p.num_tokens for p in pairs) / (2 * len(pairs))}


def llama_inputs(suite: Suite, pairs: int) -> tuple[Path, Path, dict]:
    """The 8B rows' model directory (built once, by the ``build-model`` worker on the suite's
    device), the file of their first ``pairs`` pairs, and the model's info."""
    s = suite.shapes
    root = suite.work / s.llama_dir
    model, info_path = root / "model", root / "model-info.json"
    if not info_path.exists():
        t = time.perf_counter()
        built = run_worker("build-model", {"model_dir": str(model), "llama": s.llama, "device": s.device,
                                           "dtype": s.model_dtype, "tokenizer_vocab": TOKENIZER_VOCAB, "seed": 0},
                           _row_scratch(suite, "inputs"), suite.log)
        info = {"llama": s.llama, "dtype": s.model_dtype, "parameters": built["parameters"],
                "init_s": built["init_s"], "save_s": built["save_s"], "wall_s": time.perf_counter() - t}
        info_path.write_text(json.dumps(info, indent=1))
        print(f"  built the {s.llama_dir} model in {info['wall_s']:.0f} s", flush=True)
    data = root / f"data-{pairs}.jsonl"
    if not data.exists():
        from dpocache.data.rows import write_jsonl

        write_jsonl(tulu_rows(s, pairs), data)
    return model, data, json.loads(info_path.read_text())


# ------------------------------------------------------------------------------- FLOPs


def model_dims(llama: dict, n_params: int) -> dict:
    """The sizes the FLOP rules need: layers, hidden, all parameters, the ones that multiply
    (less the input embedding), and a rank-16 all-linear LoRA adapter's parameters."""
    layers, hidden, inter = llama["num_hidden_layers"], llama["hidden_size"], llama["intermediate_size"]
    kv = hidden // llama["num_attention_heads"] * llama["num_key_value_heads"]
    # q, k, v, o, gate, up, down: r x (in + out) each
    per_layer = 2 * hidden + 2 * (hidden + kv) + 2 * hidden + 2 * (hidden + inter) + (inter + hidden)
    return {"layers": layers, "hidden": hidden, "parameters": n_params,
            "matmul_parameters": n_params - llama["vocab_size"] * hidden,
            "lora_parameters": layers * LORA["r"] * per_layer}


def flops_per_token(kind: str, dims: dict, seq_len: float) -> float:
    """Useful FLOPs per real token: ``forward`` 2N + attention (``forward_flops_per_token``),
    ``full`` three times that (``train_flops_per_token``: 6N), ``lora`` 4N of the frozen base
    (forward and the input gradients, no weight gradients) + 6 per adapter parameter + the
    attention's forward and backward. Recomputation (gradient checkpointing) is not counted."""
    from dpocache.training.metrics import forward_flops_per_token, train_flops_per_token

    n, layers, hidden = dims["matmul_parameters"], dims["layers"], dims["hidden"]
    if kind == "forward":
        return forward_flops_per_token(n, layers, hidden, seq_len)
    if kind == "full":
        return train_flops_per_token(n, layers, hidden, seq_len)
    return 4.0 * n + 6.0 * dims["lora_parameters"] + 3.0 * 4.0 * layers * hidden * seq_len


# -------------------------------------------------------------------------------- rows


def _row_scratch(suite: Suite, row: str) -> Path:
    """The row's own scratch directory (its workers' specs, results, TRL and dpocache outputs)."""
    path = suite.scratch / row
    path.mkdir(parents=True, exist_ok=True)
    return path


def run_side(suite: Suite, row: str, mode: str, spec: dict) -> tuple[dict | None, str | None]:
    """One worker run: (its result, None), or (None, why it failed: the exit code and the last
    line of its log, e.g. torch.OutOfMemoryError). A failure ends no row."""
    if suite.no_trl and mode.startswith("trl-"):
        return None, None
    try:
        return run_worker(mode, spec, _row_scratch(suite, row), suite.log, suite.worker_timeout), None
    except RuntimeError as e:
        return None, f"{mode}: {e}: {last_log_line(suite.log)}"


def last_log_line(log: Path) -> str:
    """Why the last worker failed: the last line of its part of the log that names an error
    (``torch.OutOfMemoryError: ...``, ``dpocache train: error: ...``), else its last line."""
    section = log.read_text(errors="replace").rsplit("\n=== ", 1)[-1]
    lines = [ln.strip() for ln in section.splitlines()[1:] if ln.strip()]
    errors = [ln for ln in lines if re.search(r"\w(Error|Exception)\b|\berror:", ln)]
    return (errors or lines or [""])[-1][:500]


def base_spec(suite: Suite, model: Path, data: Path, steps: int = 1, batch_size: int | None = None) -> dict:
    """What both systems' workers of a row share: model, data, dtype, batch (the shapes' by
    default), device, steps."""
    s = suite.shapes
    return {"model": str(model), "data": str(data), "dtype": s.dtype, "batch_size": batch_size or s.batch_size,
            "device": s.device, "steps": steps}


def row_batch_size(shapes: Shapes, row: str) -> int:
    """Pairs a step of a training row."""
    return shapes.lora_batch_size if row == "train-8b-lora" else shapes.batch_size


def trl_spec(suite: Suite, row: str, side: str, model_dtype: str) -> dict:
    """TRL's own settings: a fresh datasets cache (so its precompute is computed, not read), its
    model's load dtype, no state-dict hash (see the module docstring)."""
    scratch = _row_scratch(suite, row)
    return {"workdir": str(scratch / f"trl-{side}"), "env": {"HF_DATASETS_CACHE": str(scratch / f"hf-{side}")},
            "trl_model_dtype": model_dtype, "trl_skip_hash": True}


def steady_tokens_per_s(result: dict | None, warmup: int) -> float | None:
    """Tokens of the steps after the first ``warmup`` over their wall time: the window the worker
    timed from step ``warmup`` to the last (``workers.StepClock``), else the steps' summed times
    (None: no such step)."""
    if not result or len(result.get("step_s", [])) <= warmup:
        return None
    tokens = sum(result["step_tokens"][warmup:])
    if result.get("window_s") and result.get("timed_from") == warmup:
        return tokens / result["window_s"]
    return tokens / sum(result["step_s"][warmup:])


def row_ref_8b(suite: Suite) -> dict:
    """``dpocache cache build`` (cold: its cache directory emptied first) against TRL's precompute."""
    s = suite.shapes
    model, data, info = llama_inputs(suite, s.ref_pairs)
    stats = data_stats(model, data, s.max_length)
    cache = suite.work / s.llama_dir / "dpocache-cache"
    shutil.rmtree(cache, ignore_errors=True)
    base = base_spec(suite, model, data)
    trl, trl_err = run_side(suite, "ref-8b", "trl-precompute",
                            {**base, **trl_spec(suite, "ref-8b", "pre", s.trl_8b_dtype)})
    build = {**base, "cache_dir": str(cache), "extra_args": [*s.ref_build_args, *suite.kernel_args, *suite.build_args]}
    dpo, dpo_err = run_side(suite, "ref-8b", "dpo-build", build)
    if dpo is not None and suite.profile_to is not None:
        suite.profiles.append(("ref-8b", "dpo-build", build))
    dims = model_dims(s.llama, info["parameters"])
    setup = {"pairs": s.ref_pairs, "trl_precompute_batch_size": s.batch_size, "dtype": s.dtype,
             "trl_model_dtype": s.trl_8b_dtype, "dpocache_args": ["cache", "build", *build["extra_args"]]}
    return finish_row(suite, "ref-8b", dpo, trl, dpo and dpo["tokens_per_s"], trl and trl["tokens_per_s"],
                      flops_per_token("forward", dims, stats["mean_seq_len"]), [trl_err, dpo_err], setup,
                      {"data": stats, "model": dims, "token_counts": {
                          "data": stats["unique_tokens"], "dpocache": dpo and dpo["tokens"],
                          "trl": trl and trl["tokens"]["unique"]}})


def train_row(suite: Suite, row: str, model: Path, data: Path, cache: Path, steps: int, warmup: int,
              trl_extra: dict, dpo_args: list[str]) -> tuple[dict | None, dict | None, dict | None, list]:
    """A training row's runs: dpocache's reference values built (untimed; a hit when the cache
    holds them), TRL's steps, dpocache's steps, each side's steps after ``warmup`` timed as one
    window, synchronised at its two ends only (steps overlap as in a real run). Returns (prep,
    trl, dpocache, errors)."""
    base = base_spec(suite, model, data, steps, row_batch_size(suite.shapes, row))
    train_base = {**base, "timed_from": warmup}
    prep, prep_err = run_side(suite, row, "dpo-build", {**base, "cache_dir": str(cache),
                                                        "extra_args": suite.kernel_args})
    trl, trl_err = run_side(suite, row, "trl-train", {**train_base, **trl_extra})
    dpo_spec = {**train_base, "cache_dir": str(cache), "workdir": str(_row_scratch(suite, row) / "dpo"),
                "extra_args": dpo_args}
    dpo, dpo_err = (None, "dpo-train: not run, its reference values failed to build") if prep_err else run_side(
        suite, row, "dpo-train", {**dpo_spec, **profiling_spec(suite, row, steps)})
    if dpo is not None and suite.profile_to is not None:
        dpo["profile"] = train_profile(suite, row, dpo)
    if not prep_err:
        suite.variant_runs.extend((row, dpo_spec, warmup, options) for options in suite.variants)
    return prep, trl, dpo, [prep_err, trl_err, dpo_err]


# A --variants entry's leading words that set an environment variable dpocache reads
VARIANT_ENV = re.compile(r"(DPOCACHE_[A-Z0-9_]+)=(.*)")


def split_variant(options: tuple[str, ...]) -> tuple[dict[str, str], tuple[str, ...]]:
    """A ``--variants`` entry: (its leading ``DPOCACHE_NAME=VALUE`` words as an environment,
    the ``dpocache train`` options after them)."""
    env: dict[str, str] = {}
    for i, word in enumerate(options):
        match = VARIANT_ENV.fullmatch(word)
        if match is None:
            return env, options[i:]
        env[match[1]] = match[2]
    return env, ()


def variant_run(suite: Suite, row: dict, spec: dict, warmup: int, options: tuple[str, ...]) -> dict:
    """``--variants``: a training row's dpocache side once more with ``options`` after the row's
    own (a fresh output directory; the reference values its cache holds), read against the
    row's TRL run and targets: its tokens/s, MFU, peak memory and their ratios, and its raw
    figures."""
    workdir = str(Path(tempfile.mkdtemp(prefix="dpo-variant-", dir=_row_scratch(suite, row["name"]))) / "run")
    env, train = split_variant(options)
    spec = {**spec, "extra_args": [*spec["extra_args"], *train], "workdir": workdir,
            "env": {**spec.get("env", {}), **env}}
    result, err = run_side(suite, row["name"], "dpo-train", spec)
    tps = steady_tokens_per_s(result, warmup)
    mem = peak_mem_gib(result, suite.shapes.device)
    variant = {"name": row["name"], "train_args": list(options), "tokens_per_s": tps,
               "mfu": _ratio(tps and tps * row["flops_per_token"], suite.peak),
               "vs_trl": _ratio(tps, row.get("trl_tokens_per_s")), "peak_mem_gib": mem,
               "mem_vs_trl": _ratio(mem, row.get("trl_peak_mem_gib")), "raw": result}
    variant["met"] = targets_met(variant)
    if err:
        variant["error"] = err
    return variant


def describe_variant(variant: dict) -> str:
    """A variant's figures on one line: its options, tokens/s, MFU and peak memory, each ratio
    to TRL where the row ran TRL, each target's verdict; then, indented, what its raw figures
    say of its compiled graphs and streamed copies (``run_details``)."""
    def verdict(key: str) -> str:
        return {True: " ok", False: " MISS", None: ""}[variant["met"].get(key)]

    options = " ".join(variant["train_args"])
    if variant.get("error"):
        return f"  variant    {options}: error: {variant['error']}"
    ratios = {"vs_trl": "", "mem_vs_trl": ""}
    for key in ratios:
        if variant.get(key) is not None:
            ratios[key] = f" ({_fmt(variant[key], 'x')} TRL{verdict(key)})"
    line = (f"  variant    {options}: {_fmt(variant['tokens_per_s'], 'n')} tokens/s{ratios['vs_trl']}, "
            f"MFU {_fmt(variant['mfu'], '%')}{verdict('mfu')}, peak {_fmt(variant['peak_mem_gib'], 'g')} GiB"
            f"{ratios['mem_vs_trl']}")
    return "\n".join([line, *run_details(variant.get("raw") or {}, indent="    ")])


# A profile's figures per step (per forward pass of a build), as the workers give them.
PROFILE_KEYS = ("profiled_steps", "profiled_host_op_s_per_step", "profiled_host_wait_s_per_step",
                "profiled_device_busy_s_per_step")
PROFILED_TRAIN_STEPS = 2


def profile_table(suite: Suite, row: str) -> Path:
    """Where ``--profile`` writes a row's kernel table: beside the result."""
    suite.profile_to.mkdir(parents=True, exist_ok=True)
    return suite.profile_to / f"{row}-dpocache-profile.txt"


def profiling_spec(suite: Suite, row: str, steps: int) -> dict:
    """``--profile``: a training row's dpocache run goes on for ``PROFILED_TRAIN_STEPS`` steps
    past its ``steps`` timed ones under torch.profiler, in the same process (its model loaded,
    its layers compiled and its allocator warm once: on an 8B model a run of its own costs a
    minute of the GPU), its figures and peak memory read before them (``workers.StepClock``)."""
    if suite.profile_to is None:
        return {}
    return {"profile": str(profile_table(suite, row)), "profile_steps": PROFILED_TRAIN_STEPS,
            "steps": steps + PROFILED_TRAIN_STEPS}


def train_profile(suite: Suite, row: str, result: dict) -> dict:
    """A training row's profiled steps, from its dpocache run: the kernel table's name, the
    figures per step and the steps' tokens; why there are none where its steps ended short."""
    if not result.get("profiled_steps"):
        return {"error": "its profiled steps did not all run (see the log)"}
    return {"table": profile_table(suite, row).name, **{k: result[k] for k in PROFILE_KEYS},
            "tokens": result.get("profiled_tokens")}


def profile_run(suite: Suite, row: str, mode: str, spec: dict) -> dict:
    """``--profile`` for the reference build: its pass once more under torch.profiler, its cache
    emptied first so the pass is computed (apart from the timed run, whose figures the profiler
    would slow; after every row, so a time limit cuts a profile, not a row); its kernel table
    written beside the result. Returns the profiled pass's summary per forward pass, or the
    error."""
    table = profile_table(suite, row)
    shutil.rmtree(spec["cache_dir"], ignore_errors=True)
    result, err = run_side(suite, row, mode, {**spec, "profile": str(table)})
    if err:
        return {"error": err}
    return {"table": table.name, **{k: result[k] for k in (*PROFILE_KEYS, "compute_s") if k in result}}


# Where a training row's reference values come from, untimed, on each side.
REFERENCE_VALUES = {
    "dpocache_reference_values": "its cache, built by a `cache build` run before training (a hit after ref-8b)",
    "trl_reference_values": "its precompute, in its training process (counted in TRL's peak memory)",
}


def lora_dpo_args(suite: Suite) -> list[str]:
    """train-8b-lora's ``dpocache train`` options: the row's own, then ``--kernels`` and ``--train-args``."""
    return [*DPO_LORA_ARGS, *suite.shapes.lora_train_args, *suite.kernel_args, *suite.train_args]


def full_dpo_args(suite: Suite) -> list[str]:
    """train-1b-full's ``dpocache train`` options: the row's own, then ``--kernels`` and ``--train-args``."""
    return [*suite.shapes.full_train_args, *suite.kernel_args, *suite.train_args]


DPO_TRAIN_ARGS = {"train-8b-lora": lora_dpo_args, "train-1b-full": full_dpo_args}


def refused_train_args(suite: Suite, rows: list[str], as_on_a_gpu: bool = False) -> str | None:
    """Why ``dpocache train`` would refuse a training row's options (``--train-args`` beside the
    row's own), checked as ``train`` checks them before any model loads; None where every row's
    pass, each ``--variants`` entry after them as well. The suite stops on it at once: a refused
    flag otherwise costs a GPU call the row's model build and its worker's start (45 s on an
    H200). ``as_on_a_gpu`` (``--check``): on a machine without one, checked as if it had a CUDA
    device (the GPU's shapes and flags, which name ``--device cuda``)."""
    from unittest import mock

    from dpocache.config import ConfigError

    gpu = (mock.patch.multiple("torch.cuda", is_available=lambda: True, device_count=lambda: 1) if as_on_a_gpu
           else contextlib.nullcontext())
    with gpu:
        for row, variant in [(r, v) for r in rows if r in DPO_TRAIN_ARGS for v in [(), *suite.variants]]:
            try:
                check_train_options(suite, row, variant)
            except ConfigError as err:
                return f"{row}{' with --variants ' + shlex.quote(' '.join(variant)) if variant else ''}: {err}"
    return None


def check_train_options(suite: Suite, row: str, variant: tuple[str, ...]) -> None:
    """A training row's options with one ``--variants`` entry (``()``: none) checked as ``train``
    checks them before any model loads, the LoRA row's ``--checkpoint-keep`` names against the
    8B's config on the meta device: ``ConfigError`` if refused."""
    from unittest import mock

    from transformers import LlamaConfig

    from dpocache.config import build_config, checkpoint_keep_names, validate_environment
    from dpocache.models.checkpointing import check_keep_names_against

    env, train = split_variant(variant)
    options = [*timed_train_args("<model>", "<data>", suite.shapes.dtype, suite.shapes.device, "<cache>", "<out>",
                                 row_batch_size(suite.shapes, row), 1),
               *DPO_TRAIN_ARGS[row](suite), *train]
    with mock.patch.dict(os.environ, env):
        validate_environment()
    cfg = build_config(None, options).validate(required=("model.path", "data.train"))
    if row == "train-8b-lora":
        check_keep_names_against(LlamaConfig(**suite.shapes.llama), checkpoint_keep_names(cfg.model.checkpoint_keep),
                                 cfg.model.attention, cfg.model.device or suite.shapes.device)


def row_train_8b_lora(suite: Suite) -> dict:
    """LoRA DPO steps on the 8B model, gradient checkpointing on both sides."""
    s = suite.shapes
    model, data, info = llama_inputs(suite, s.lora_batch_size * s.lora_steps)
    stats = data_stats(model, data, s.max_length)
    trl_extra = {**trl_spec(suite, "train-8b-lora", "train", s.trl_8b_dtype), "trl_lora": LORA,
                 "trl_gradient_checkpointing": True}
    dpo_args = lora_dpo_args(suite)
    cache = suite.work / s.llama_dir / "dpocache-cache"  # ref-8b's: a hit after it
    prep, trl, dpo, errors = train_row(suite, "train-8b-lora", model, data, cache, s.lora_steps, s.lora_warmup,
                                       trl_extra, dpo_args)
    dims = model_dims(s.llama, info["parameters"])
    setup = {"pairs": stats["pairs"], "batch_size": s.lora_batch_size, "steps": s.lora_steps,
             "warmup_steps": s.lora_warmup, "dtype": s.dtype, "trl_model_dtype": s.trl_8b_dtype,
             "lora": {**LORA, "target_modules": "all-linear", "dropout": 0.0}, "gradient_checkpointing": True,
             "dpocache_args": ["train", *dpo_args], **REFERENCE_VALUES}
    return finish_row(suite, "train-8b-lora", dpo, trl, steady_tokens_per_s(dpo, s.lora_warmup),
                      steady_tokens_per_s(trl, s.lora_warmup), flops_per_token("lora", dims, stats["mean_seq_len"]),
                      errors, setup, {"data": stats, "model": dims, "dpocache_reference_build": prep})


def row_train_1b_full(suite: Suite) -> dict:
    """Full-parameter DPO steps of the 1.1B Llama (``bench_vs_trl.py``'s ``1b-2048``)."""
    s = suite.shapes
    inputs = build_inputs(s.full_config, s.batch_size * s.full_steps, root=suite.work)
    info = json.loads((inputs / "info.json").read_text())
    model, data = inputs / "model", inputs / "data.jsonl"
    stats = data_stats(model, data, 2048)
    trl_extra = trl_spec(suite, "train-1b-full", "train", "float32")
    dpo_args = full_dpo_args(suite)
    prep, trl, dpo, errors = train_row(suite, "train-1b-full", model, data, inputs / "dpocache-cache", s.full_steps,
                                       s.full_warmup, trl_extra, dpo_args)
    dims = model_dims(info["config"], info["parameters"])
    setup = {"config": s.full_config.name, "pairs": stats["pairs"], "batch_size": s.batch_size, "steps": s.full_steps,
             "warmup_steps": s.full_warmup, "dtype": s.dtype, "trl_model_dtype": "float32",
             "gradient_checkpointing": False, "dpocache_args": ["train", *dpo_args], **REFERENCE_VALUES}
    return finish_row(suite, "train-1b-full", dpo, trl, steady_tokens_per_s(dpo, s.full_warmup),
                      steady_tokens_per_s(trl, s.full_warmup), flops_per_token("full", dims, stats["mean_seq_len"]),
                      errors, setup, {"data": stats, "model": dims, "dpocache_reference_build": prep})


RUNNERS = {"ref-8b": row_ref_8b, "train-8b-lora": row_train_8b_lora, "train-1b-full": row_train_1b_full}


def _ratio(a: float | None, b: float | None) -> float | None:
    """``a / b``, or None where either is missing (a side that failed)."""
    return a / b if a is not None and b else None


def peak_mem_gib(result: dict | None, device: str) -> float | None:
    """A worker's peak memory in GiB: GPU memory allocated, or (on a CPU) its peak RSS."""
    if not result:
        return None
    value = result.get("peak_gpu_allocated_bytes") if device != "cpu" else result.get("peak_rss_bytes")
    return None if value is None else value / 2**30


def targets_met(row: dict) -> dict:
    """Each target of the row: met (True/False), or None where its figure is missing."""
    met = {}
    for key, target in TARGETS[row["name"]].items():
        value = row.get(key)
        met[key] = None if value is None else (value <= target if key == "mem_vs_trl" else value >= target)
    return met


def finish_row(suite: Suite, name: str, dpo: dict | None, trl: dict | None, tps: float | None,
               trl_tps: float | None, fpt: float, errors: list, setup: dict, raw: dict) -> dict:
    """The row of the result's schema, from both sides' worker results."""
    device = suite.shapes.device
    mem, trl_mem = peak_mem_gib(dpo, device), peak_mem_gib(trl, device)
    row = {"name": name, "tokens_per_s": tps, "mfu": _ratio(tps and tps * fpt, suite.peak),
           "trl_tokens_per_s": trl_tps, "vs_trl": _ratio(tps, trl_tps), "peak_mem_gib": mem,
           "trl_peak_mem_gib": trl_mem, "mem_vs_trl": _ratio(mem, trl_mem),
           "trl_mfu": _ratio(trl_tps and trl_tps * fpt, suite.peak), "flops_per_token": fpt,
           "targets": TARGETS[name], "setup": setup, "raw": {**raw, "dpocache": dpo, "trl": trl}}
    row["met"] = targets_met(row)
    errors = [e for e in errors if e]
    if errors:
        row["error"] = "; ".join(errors)
    return row


# ----------------------------------------------------------------------- environment


def _version(package: str) -> str | None:
    """The installed version of ``package`` (None: not installed), without importing it."""
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def gpu_name() -> str:
    """The CUDA device's name, read in a short-lived process: this one stays off the GPU, whose
    memory is each worker's to measure."""
    code = "import sys, torch; sys.exit('no CUDA device') if not torch.cuda.is_available() else " \
           "print(torch.cuda.get_device_name(0))"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"no CUDA device here ({proc.stderr.strip()[-200:]}); --dry-run runs every row at tiny "
                         "shapes on a CPU")
    return proc.stdout.strip()


def device_slug(name: str) -> str:
    """``h100``, ``h200``, ``h100-pcie``, ...: the device part of the result's file name."""
    low = name.lower()
    for key in ("h200", "h100", "a100", "b200"):
        if key in low:
            return key + ("-pcie" if "pcie" in low else "")
    return re.sub(r"[^a-z0-9]+", "-", low).strip("-") or "gpu"


def environment(dry_run: bool) -> dict:
    """The result's header: device, versions, the peak MFU is read against and where it is from."""
    versions = {pkg: _version(pkg) for pkg in ("torch", "transformers", "trl", "peft")}
    if dry_run:
        name = f"cpu ({platform.machine()}, {os.cpu_count()} cores), dry run"
        peak = measure_peak("float32", "cpu", seconds=0.5)
        return {"device": name, "device_slug": "cpu-dryrun", **versions, "peak_flops": peak,
                "peak_source": "measured fp32 matmul peak of this CPU (dry run: tiny shapes, fp32)",
                "memory_measure": "peak RSS of each worker process (dry run: no GPU)"}
    name = gpu_name()
    peak = nominal_bf16_peak(name)
    return {"device": name, "device_slug": device_slug(name), **versions, "peak_flops": peak,
            "peak_source": f"nominal dense bf16 peak of {name}" if peak else f"{name}: no nominal peak known, no MFU",
            "memory_measure": "torch.cuda.max_memory_allocated of each worker process"}


DEFINITIONS = {
    "tokens": "real tokens: each prompt once, plus chosen and rejected (with their EOS), both systems alike",
    "tokens_per_s": "ref-8b: the reference pass's tokens over its compute time (model load excluded; TRL: "
                    "_precompute_ref_logps). Training rows: the tokens of the steps after warmup_steps over their "
                    "wall time, one window synchronised at its two ends only (raw: window_s, and step_s, the "
                    "host's intervals, and step_tokens of each step)",
    "mfu": "useful FLOPs per token (flops_per_token) x tokens_per_s / peak_flops: 2N per token for a forward, 6N "
           "for full training, 4N for a frozen base under LoRA plus 6 per adapter parameter, attention "
           "4*L*H*T a forward (x3 with its backward, T = mean prompt + completion length), recomputation not "
           "counted; N = the parameters that multiply (input embedding excluded, untied head included)",
    "vs_trl": "tokens_per_s / trl_tokens_per_s", "mem_vs_trl": "peak_mem_gib / trl_peak_mem_gib",
}


# ---------------------------------------------------------------------------- output


def portable_argv(argv: list[str]) -> list[str]:
    """``argv`` with no machine path: paths in the repository relative to it, others as
    ``<dir>/name``."""
    out = []
    for arg in argv:
        if os.path.isabs(arg):
            path = Path(arg).resolve()
            arg = path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else f"<dir>/{path.name}"
        out.append(arg)
    return out


def write_result(path: Path, result: dict, names: dict[str, str]) -> None:
    """``result`` as JSON at ``path`` (written whole, then renamed into place), this machine's
    directories named by their role."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(portable(json.dumps(result, indent=1, default=str), names) + "\n")
    os.replace(tmp, path)


def _fmt(value: float | None, kind: str) -> str:
    """A figure for the printed lines: percent, ratio, count or GiB; ``-`` where missing."""
    if value is None:
        return "-"
    return {"%": f"{100 * value:.1f}%", "x": f"{value:.2f}x", "n": f"{value:,.0f}", "g": f"{value:.1f}"}[kind]


def describe_row(row: dict) -> str:
    """A row's figures with its targets beside them (``ok`` / ``MISS``)."""
    met, targets = row.get("met", {}), TARGETS[row["name"]]

    def target(key: str, kind: str) -> str:
        if key not in targets:
            return ""
        sign = "<=" if key == "mem_vs_trl" else ">="
        verdict = {True: "ok", False: "MISS", None: "-"}[met.get(key)]
        return f" (target {sign} {_fmt(targets[key], kind)}: {verdict})"

    lines = [f"{row['name']}: wall {row.get('wall_s', 0):.0f} s",
             f"  tokens/s   dpocache {_fmt(row['tokens_per_s'], 'n')}  TRL {_fmt(row['trl_tokens_per_s'], 'n')}  "
             f"{_fmt(row['vs_trl'], 'x')}{target('vs_trl', 'x')}",
             f"  MFU        dpocache {_fmt(row['mfu'], '%')}{target('mfu', '%')}  TRL {_fmt(row.get('trl_mfu'), '%')}",
             f"  peak GiB   dpocache {_fmt(row['peak_mem_gib'], 'g')}  TRL {_fmt(row['trl_peak_mem_gib'], 'g')}  "
             f"{_fmt(row['mem_vs_trl'], 'x')}{target('mem_vs_trl', 'x')}"]
    lines.extend(run_details((row.get("raw") or {}).get("dpocache") or {}))
    for variant in row.get("variants", []):
        lines.append(describe_variant(variant))
    if row.get("error"):
        lines.append(f"  error: {row['error']}")
    return "\n".join(lines)


def run_details(dpo: dict, indent: str = "  ") -> list[str]:
    """What a dpocache training run's raw figures (``dpo``: a row's or a variant's) say beyond its
    speed: its compiled graphs and why it compiled more; for a streamed base on a GPU its copies,
    the compute's waits for them, and the layer starts where the device had run dry; and where
    the caching allocator called CUDA in the timed window, how often; ``--profile``'s steps after
    the timed ones, their host and device time per step."""
    lines = []
    compiler = (dpo.get("ran") or {}).get("compiler")
    if compiler:  # a compiled policy: its graphs, and the guards that made it compile more
        reasons = "; ".join(compiler.get("recompile_reasons", [])[:3])
        lines.append(f"{indent}compiler   {compiler['graphs']} graphs, {compiler['graph_breaks']} graph breaks"
                     + (f"; recompiled for: {reasons}" if reasons else ""))
    copies = dpo.get("streamed_window")
    if copies and copies.get("stall_s") is not None and dpo.get("window_s"):  # a streamed base on a GPU: hidden?
        kept = f" ({copies['turn_kept']} started without one, kept through a turn)" if copies.get("turn_kept") else ""
        lines.append(f"{indent}copies     {copies['copies']} layers{kept}, {copies['copied_gib']:.1f} GiB in "
                     f"{copies['copy_s']:.2f} s; the compute waited {copies['stall_s']:.2f} s of the window's "
                     f"{dpo['window_s']:.2f} s")
        if copies.get("idle_entries") is not None:
            lines.append(f"{indent}host       the device had run dry at {copies['idle_entries']} of "
                         f"{copies['entries']} streamed layer starts (there the host set the pace)")
    allocator = dpo.get("allocator_window")
    if allocator and any(allocator.values()):  # the caching allocator called CUDA in the timed window
        lines.append(f"{indent}allocator  {allocator['alloc_retries']} retries, {allocator['device_allocs']} "
                     f"cudaMalloc, {allocator['device_frees']} cudaFree, {allocator['all_stream_syncs']} syncs of all "
                     "streams in the window (each free or sync waits for the whole device)")
    profile = dpo.get("profile")
    if profile:
        lines.append(f"{indent}profile    " + (profile["error"] if "error" in profile else (
            f"{profile['profiled_steps']} steps ({', '.join(map(str, profile['tokens'] or []))} tokens): host ops "
            f"{profile['profiled_host_op_s_per_step']} s a step, device busy "
            f"{profile['profiled_device_busy_s_per_step']} s; the kernels in {profile['table']}")))
    return lines


def summary_table(rows: list[dict]) -> str:
    """Every row in one markdown table, each figure with its target (``ok`` / ``MISS``)."""

    def cell(row: dict, key: str, kind: str) -> str:
        text = _fmt(row.get(key), kind)
        if key in TARGETS.get(row["name"], {}):
            sign = "<=" if key == "mem_vs_trl" else ">="
            verdict = {True: "ok", False: "MISS", None: "-"}[row.get("met", {}).get(key)]
            text += f" ({sign} {_fmt(TARGETS[row['name']][key], kind)}: {verdict})"
        return text

    lines = ["| row | tokens/s | TRL tokens/s | vs TRL | MFU | TRL MFU | peak GiB | TRL peak GiB | memory vs TRL "
             "| wall s |", "| --- |" + " ---: |" * 9]
    for row in rows:
        lines.append(f"| {row['name']}{' (error)' if row.get('error') else ''} | {cell(row, 'tokens_per_s', 'n')} | "
                     f"{cell(row, 'trl_tokens_per_s', 'n')} | {cell(row, 'vs_trl', 'x')} | {cell(row, 'mfu', '%')} | "
                     f"{cell(row, 'trl_mfu', '%')} | {cell(row, 'peak_mem_gib', 'g')} | "
                     f"{cell(row, 'trl_peak_mem_gib', 'g')} | {cell(row, 'mem_vs_trl', 'x')} | "
                     f"{_fmt(row.get('wall_s'), 'n')} |")
    return "\n".join(lines)


def rows_to_run(only: list[str] | None) -> list[str]:
    """``--only``'s rows in its order (a row that cannot fail first, one that may run long last),
    each once; every row without it."""
    return list(dict.fromkeys(only)) if only else list(ROWS)


def default_out(slug: str, only: list[str] | None, dry_run: bool) -> Path:
    """``bench/results/gpu-suite-<device>-<date>[-<rows>].json``; a dry run's in the temp directory."""
    name = f"gpu-suite-{slug}-{time.strftime('%Y%m%d')}" + (f"-{'-'.join(only)}" if only else "") + ".json"
    return Path(tempfile.gettempdir()) / name if dry_run else BENCH_DIR / "results" / name


# ----------------------------------------------------------------------------- merge

SAME_FIELDS = ("device", "dry_run", "kernels", "train_args", "build_args", "no_trl", "torch", "transformers", "trl",
               "peft")
# what a result written before these options ran
FIELD_DEFAULTS = {"train_args": [], "build_args": [], "no_trl": False}


def merge_parts(paths: list[Path]) -> dict:
    """One result of the rows of several part files (``--only`` runs) of one device. Refuses,
    with ``ValueError``, a file that cannot be read, one whose device (or versions, dry-run flag,
    ``--kernels``, ``--train-args``, ``--build-args``, ``--no-trl``) differs from the first's, and a row measured
    without error in two files; a row that failed in one part is taken from a part where it did not."""
    parts = read_results(paths)
    first = parts[0]
    rows: dict[str, dict] = {}
    for path, part in zip(paths, parts):
        for name in SAME_FIELDS:
            value, expected = (FIELD_DEFAULTS.get(name) if p.get(name) is None else p.get(name) for p in (part, first))
            if value != expected:
                raise ValueError(f"{path}: {name} {value!r}, not {expected!r} as in {paths[0]}")
        for row in part["rows"]:
            kept = rows.get(row["name"])
            if kept is not None and not kept.get("error") and not row.get("error"):
                raise ValueError(f"{path}: row {row['name']} is in another part too; merge one of them")
            if kept is None or kept.get("error"):
                rows[row["name"]] = row
    order = {name: i for i, name in enumerate(ROWS)}
    merged = {k: v for k, v in first.items() if k != "rows"}
    merged["date"] = max(part["date"] for part in parts)
    merged["parts"] = [{"file": p.name, "command": part["command"], "date": part["date"]}
                       for p, part in zip(paths, parts)]
    merged["rows"] = sorted(rows.values(), key=lambda r: order.get(r["name"], len(order)))
    return merged


# ------------------------------------------------------------------------------ main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line (the module docstring's first paragraph is its description)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", nargs="+", choices=ROWS, metavar="ROW",
                   help=f"these rows only, in this order: {', '.join(ROWS)}")
    p.add_argument("--merge", nargs="+", metavar="JSON", help="one result of the rows of several parts (needs --out)")
    p.add_argument("--out", default=None, help="the result file (default: bench/results/gpu-suite-<device>-<date>"
                                               "[-<rows>].json; a dry run's in the temp directory)")
    p.add_argument("--kernels", default="auto", choices=["auto", "liger", "none"],
                   help="dpocache's --kernels (passed on when not auto)")
    p.add_argument("--profile", action="store_true",
                   help="dpocache's side of each row under torch.profiler: the reference pass once more after "
                        "every row, a training row's run 2 steps past its timed ones (its figures read before "
                        "them): kernel tables beside the result, host and device time per step in the row")
    p.add_argument("--train-args", default="", metavar="OPTIONS",
                   help="more dpocache train options, one string, in both training rows (an A/B: '--compile on')")
    p.add_argument("--build-args", default="", metavar="OPTIONS",
                   help="more dpocache cache build options, one string, in ref-8b (an A/B: '--stream-reference true')")
    p.add_argument("--variants", nargs="+", default=[], metavar="OPTIONS",
                   help="after every row, each training row's dpocache side once more per OPTIONS (one string "
                        "each, after --train-args), on the inputs built and against the row's TRL run: A/Bs "
                        "without building the model again; leading DPOCACHE_NAME=VALUE words set its environment")
    p.add_argument("--no-trl", action="store_true",
                   help="dpocache's side only (a comparison of dpocache's options on one machine; no ratio to TRL)")
    p.add_argument("--worker-timeout", type=float, default=None, metavar="S",
                   help="kill a side's process past S seconds: the row records why, the next one runs")
    p.add_argument("--dry-run", action="store_true", help="every row at tiny shapes on the CPU, in fp32")
    p.add_argument("--check", action="store_true",
                   help="check the training rows' options and --variants as dpocache train would on the GPU, "
                        "with the GPU's shapes, and stop: on any machine, before a GPU call spends its time")
    p.add_argument("--work", default=None, help="where inputs are built and reused (default: bench/work/)")
    p.add_argument("--ref-pairs", type=int, default=None, help="ref-8b's pairs (default 256; dry run 12)")
    p.add_argument("--batch-size", type=int, default=None,
                   help="pairs per training step and TRL's precompute batch, every row (default 4, the 8B "
                        "LoRA row 8; dry run 2)")
    p.add_argument("--train-steps", type=int, default=None,
                   help="steps of both training rows (default: 7 LoRA, 10 full; dry run 2)")
    p.add_argument("--warmup-steps", type=int, default=None,
                   help="first steps left out of the training rows' tokens/s (default: 2 LoRA, 3 full "
                        "(compiled steps recompile for new shapes in the first few); dry run 1)")
    return p.parse_args(argv)


def shapes_of(args: argparse.Namespace) -> Shapes:
    """The dry run's or the GPU's shapes, with the command line's counts in place of theirs."""
    s = DRY if args.dry_run else GPU
    over = {"ref_pairs": args.ref_pairs, "batch_size": args.batch_size, "lora_batch_size": args.batch_size,
            "lora_steps": args.train_steps,
            "full_steps": args.train_steps, "lora_warmup": args.warmup_steps, "full_warmup": args.warmup_steps}
    s = replace(s, **{k: v for k, v in over.items() if v is not None})
    if min(s.lora_steps - s.lora_warmup, s.full_steps - s.full_warmup) < 1:
        raise SystemExit("--train-steps must exceed --warmup-steps: no step would be timed")
    return s


def merge_main(args: argparse.Namespace) -> int:
    """``--merge``: the parts joined into ``--out`` and printed as one table; 2 when refused."""
    if not args.out:
        print("--merge needs --out FILE", file=sys.stderr)
        return 2
    try:
        merged = merge_parts([Path(x) for x in args.merge])
    except ValueError as e:
        print(f"--merge: {e}", file=sys.stderr)
        return 2
    merged["command"] = ["python", "bench/gpu_suite.py", *portable_argv(sys.argv[1:])]
    write_result(Path(args.out), merged, {})
    print(summary_table(merged["rows"]))
    print(f"wrote {args.out}")
    return 0


def check_main(args: argparse.Namespace, shapes: Shapes, rows: list[str]) -> int:
    """``--check``: the options' verdict in one line, 0 where ``dpocache train`` takes them all, 2 where not."""
    suite = Suite(shapes, Path(tempfile.gettempdir()), Path(tempfile.gettempdir()), Path(os.devnull), [], None,
                  train_args=tuple(shlex.split(args.train_args)),
                  variants=tuple(tuple(shlex.split(v)) for v in args.variants))
    refused = refused_train_args(suite, rows, as_on_a_gpu=not args.dry_run)
    if refused:
        print(f"gpu_suite: {refused}", file=sys.stderr)
        return 2
    trained = [row for row in rows if row in DPO_TRAIN_ARGS]
    print(f"gpu_suite: dpocache train takes the options of {', '.join(trained) or 'no training row'}"
          f"{f' and {len(suite.variants)} variants' if suite.variants and trained else ''} "
          f"({'the dry run' if args.dry_run else 'the GPU'}'s shapes, batch {shapes.batch_size}, "
          f"the LoRA row's {shapes.lora_batch_size})")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Run the rows asked for, writing the result after each; 1 if any row has an error."""
    args = parse_args(argv)
    if args.merge:
        return merge_main(args)
    shapes = shapes_of(args)
    rows = rows_to_run(args.only)
    if args.check:
        return check_main(args, shapes, rows)
    if _version("trl") is None:
        print("TRL is not installed: bench/gpu_suite.sh download (where PyPI is reachable), then "
              "bench/gpu_suite.sh install", file=sys.stderr)
        return 2
    env = environment(args.dry_run)
    out = Path(args.out) if args.out else default_out(env["device_slug"], args.only, args.dry_run)
    work = Path(args.work).resolve() if args.work else BENCH_DIR / "work"
    work.mkdir(parents=True, exist_ok=True)
    suite = Suite(shapes, work, Path(tempfile.mkdtemp(prefix="gpu-suite-", dir=work)),
                  work / f"gpu-suite-{time.strftime('%Y%m%d-%H%M%S')}.log",
                  [] if args.kernels == "auto" else ["--kernels", args.kernels], env["peak_flops"],
                  profile_to=out.parent / f"{out.stem}-profiles" if args.profile else None,
                  train_args=tuple(shlex.split(args.train_args)), build_args=tuple(shlex.split(args.build_args)),
                  no_trl=args.no_trl, worker_timeout=args.worker_timeout,
                  variants=tuple(tuple(shlex.split(v)) for v in args.variants))
    refused = refused_train_args(suite, rows)
    if refused:
        shutil.rmtree(suite.scratch, ignore_errors=True)
        print(f"gpu_suite: {refused}", file=sys.stderr)
        return 2
    names = {str(suite.scratch): "<scratch>", str(work): "<work>"}
    result = {**env, "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "dry_run": args.dry_run, "kernels": args.kernels,
              "train_args": list(suite.train_args), "build_args": list(suite.build_args), "no_trl": args.no_trl,
              "command": ["python", "bench/gpu_suite.py", *portable_argv(sys.argv[1:] if argv is None else argv)],
              "definitions": DEFINITIONS, "rows": []}
    print(f"{env['device']}: rows {', '.join(rows)}; log {suite.log}; result {out}", flush=True)
    start = time.perf_counter()
    try:
        for name in rows:
            t = time.perf_counter()
            print(f"{name} ...", flush=True)
            try:
                row = RUNNERS[name](suite)
            except Exception as e:  # inputs that failed to build: recorded, and the next row runs
                row = {"name": name, "error": f"{type(e).__name__}: {e}"}
            row["wall_s"] = time.perf_counter() - t
            result["rows"].append(row)
            write_result(out, result, names)  # every finished row on disk at once
            print(describe_row(row) if "tokens_per_s" in row else f"{name}: error: {row['error']}", flush=True)
            shutil.rmtree(suite.scratch / name, ignore_errors=True)  # a 1.1B run's checkpoint: 4 GiB
        for name, spec, warmup, options in suite.variant_runs:
            print(f"{name}: dpocache with {' '.join(options)} ...", flush=True)
            row = next(r for r in result["rows"] if r["name"] == name)
            row.setdefault("variants", []).append(variant := variant_run(suite, row, spec, warmup, options))
            write_result(out, result, names)
            print(describe_variant(variant), flush=True)
            shutil.rmtree(suite.scratch / name, ignore_errors=True)
        for name, mode, spec in suite.profiles:
            print(f"{name}: profiling dpocache's side ...", flush=True)
            row = next(r for r in result["rows"] if r["name"] == name)
            row["raw"]["dpocache"]["profile"] = profiled = profile_run(suite, name, mode, spec)
            write_result(out, result, names)
            print(f"  profile    {json.dumps(profiled)}", flush=True)
            shutil.rmtree(suite.scratch / name, ignore_errors=True)
    finally:
        shutil.rmtree(suite.scratch, ignore_errors=True)
    print(summary_table(result["rows"]))
    print(f"all rows: {time.perf_counter() - start:.0f} s; wrote {out}", flush=True)
    return 1 if any(r.get("error") for r in result["rows"]) else 0


if __name__ == "__main__":
    raise SystemExit(main())
