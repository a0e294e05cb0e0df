"""The host's work in a whole ``dpocache train`` step of the GPU suite's 8B LoRA row, on a CPU:
a Llama as deep as the 8B (32 layers) but so narrow (hidden 64) that its kernels take little
time, over pairs of the GPU suite's Tulu lengths scaled down, trained through the real loop
(prefetch, layout, streamed base, compiled layers, loss, optimizer) with the row's options.
What is left of a step is mostly host work: where it goes, by ``cProfile``.

    python bench/probes/host_step_probe.py [--layers 32] [--pairs 8] [--steps 8] [--warmup 3] \
        [--profile-steps 3] [--scale 0.03] [--variants "OPTIONS" ...] [--top 30] [--out result.json]

Each variant is ``--row-args`` (the LoRA row's options on a GPU: ``bench/gpu_suite.py``'s
``STREAMED_LORA`` and LoRA flags, with the causal rows) followed by its own options, trained in
a process of its own on the same model (saved in fp32, loaded as training loads it), data and
reference cache (the first run builds it), on one CPU thread under bf16 autocast; the base
streams host to host (its check that the device is a GPU is lifted, as in the tests). Its steps
after ``--warmup`` are timed without a profiler, then ``--profile-steps`` more run under
``cProfile``. Prints and writes one JSON object, per variant: the step times, their median and
tokens; the profiled steps' functions by own time a step (``tottime``), the first ``--top``,
and each package's sum; what compiling took (``run.json``'s ``policy.compiler``: graphs and
recompile reasons); and what two walks over the policy cost (``walks_ms``). On a GPU the same
host work runs beside the kernels; it bounds the step only where the device waits for it.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(BENCH))
sys.path.insert(0, str(BENCH.parent))

# bench/gpu_suite.py's STREAMED_LORA, the LoRA flags of its train-8b-lora row, and the causal rows
# the row runs on a GPU (auto picks them there, not on a CPU)
ROW_ARGS = ("--lora-r 16 --lora.alpha 32 --gradient-checkpointing true --stream-base true --resident-layers 10 "
            "--compile on --attention causal")
# The GPU suite's Tulu shapes in tokens (the benchmarks' tokenizer makes one token of each word)
TULU_PROMPT, TULU_COMPLETION = (200, 1200), (100, 800)


def build(work: Path, layers: int, pairs: int, scale: float) -> tuple[Path, Path]:
    """The model (the GPU suite's dry-run Llama, 64 wide, ``layers`` deep) and ``pairs`` pairs of
    the Tulu lengths times ``scale``, under ``work`` (``common.build_inputs``)."""
    from common import BenchConfig, build_inputs

    def scaled(words: tuple[int, int]) -> tuple[int, int]:
        return max(1, round(words[0] * scale)), max(1, round(words[1] * scale))

    cfg = BenchConfig("host-step", vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, prompt_words=scaled(TULU_PROMPT),
                      completion_words=scaled(TULU_COMPLETION), pairs=pairs)
    inputs = build_inputs(cfg, pairs, root=work)
    return inputs / "model", inputs / "data.jsonl"


def package(filename: str) -> str:
    """The package a profiled function's file belongs to (``dpocache.models``, ``torch``,
    ``transformers``, ``peft``), ``builtins`` for C functions, else ``other``."""
    if filename == "~":
        return "builtins"
    parts = Path(filename).parts
    for name in ("dpocache", "torch", "transformers", "peft"):
        if name in parts:
            i = len(parts) - 1 - parts[::-1].index(name)
            if name == "dpocache" and i + 2 < len(parts):
                return f"dpocache.{parts[i + 1]}"
            return name
    return "other"


def profile_table(profile: cProfile.Profile, steps: int, top: int) -> dict:
    """The profiled steps' functions by own time a step (ms), the first ``top``, and each
    package's sum."""
    stats = pstats.Stats(profile).stats
    rows, packages = [], {}
    for (filename, line, name), (_, calls, tottime, cumtime, _) in stats.items():
        where = package(filename)
        packages[where] = packages.get(where, 0.0) + tottime
        short = name if filename == "~" else f"{Path(filename).name}:{line}({name})"
        rows.append({"function": short, "package": where, "own_ms": 1e3 * tottime / steps,
                     "cumulative_ms": 1e3 * cumtime / steps, "calls": calls // steps})
    rows.sort(key=lambda r: -r["own_ms"])
    return {"functions": rows[:top],
            "packages_ms": {k: round(1e3 * v / steps, 2) for k, v in sorted(packages.items(), key=lambda kv: -kv[1])}}


def module_walks(run, repeats: int = 50) -> dict:
    """What two walks over the policy cost the host (ms, medians of ``repeats``), beside the
    module and parameter counts: setting training mode on every module (``train()``) and
    listing the trainable parameters, which ``train_step`` once did every step."""
    def median_ms(fn) -> float:
        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
        return round(1e3 * statistics.median(times), 3)

    return {"modules": sum(1 for _ in run.scorer.modules()), "parameters": sum(1 for _ in run.policy.parameters()),
            "train_mode_ms": median_ms(run.scorer.train),
            "trainable_list_ms": median_ms(lambda: [p for p in run.policy.parameters() if p.requires_grad])}


def worker(args) -> None:
    """One variant's run in this process: timed steps, then profiled ones; its JSON to ``--out``."""
    import torch

    torch.set_num_threads(1)
    import dpocache.config as config_mod
    import dpocache.training.loop as loop
    from common import timed_train_args
    from dpocache.config import build_config
    from dpocache.training import prefetch

    steps_s, tokens, profile, profiled = [], [], cProfile.Profile(), []
    original = loop.train_step
    timed = args.warmup + args.steps

    runs = []

    def step(run, window):
        runs[:] = [run]
        n = sum(run.train_data.pairs[i].unique_tokens for micro in range(run.cfg.train.grad_accum)
                for i in prefetch.step_indices(run, run.step, micro))
        if len(steps_s) < timed:
            t = time.perf_counter()
            original(run, window)
            steps_s.append(time.perf_counter() - t)
            tokens.append(n)
            return
        profile.enable()
        original(run, window)
        profile.disable()
        profiled.append(n)

    loop.train_step = step
    config_mod._validate_streamed = lambda cfg, flag: None  # the CPU stands in for the GPU, as in the tests
    overrides = timed_train_args(args.model, args.data, "bfloat16", "cpu", args.cache, args.workdir, args.pairs,
                                 timed + args.profile_steps)
    loop.train(build_config(None, [*overrides, *shlex.split(args.options)]))
    after = steps_s[args.warmup:]
    walks = module_walks(runs[0])
    if args.pstats:
        profile.dump_stats(args.pstats)
    Path(args.out).write_text(json.dumps({
        "options": args.options, "step_s": steps_s, "step_tokens": tokens, "timed_from": args.warmup,
        "median_step_s": statistics.median(after), "median_tokens": statistics.median(tokens[args.warmup:]),
        "compiler": json.loads((Path(args.workdir) / "run.json").read_text())["policy"].get("compiler"),
        "walks_ms": walks, "profiled_tokens": profiled, "profile": profile_table(profile, len(profiled), args.top)}))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--pairs", type=int, default=8, help="pairs a step (the row's batch)")
    p.add_argument("--steps", type=int, default=8, help="timed steps after the warm-up")
    p.add_argument("--warmup", type=int, default=3, help="steps first, untimed (the compiled layers compile)")
    p.add_argument("--profile-steps", type=int, default=3)
    p.add_argument("--scale", type=float, default=0.03, help="the Tulu lengths times this")
    p.add_argument("--row-args", default=ROW_ARGS)
    p.add_argument("--variants", nargs="+", default=[""], help="more options, one string a variant")
    p.add_argument("--top", type=int, default=30)
    p.add_argument("--out")
    p.add_argument("--pstats", help="a variant's raw profile to this file (``pstats``), N its index: PATH-N")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--model"), p.add_argument("--data"), p.add_argument("--cache"), p.add_argument("--workdir")
    p.add_argument("--options", default="")
    args = p.parse_args(argv)
    if args.worker:
        return worker(args)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        steps = args.warmup + args.steps + args.profile_steps
        model, data = build(work, args.layers, args.pairs * steps, args.scale)
        results = []
        for i, options in enumerate(args.variants):
            out = work / f"variant-{i}.json"
            cmd = [sys.executable, __file__, "--worker", "--model", str(model), "--data", str(data),
                   "--cache", str(work / "cache"), "--workdir", str(work / f"run-{i}"), "--out", str(out),
                   "--options", f"{args.row_args} {options}", "--pairs", str(args.pairs), "--steps", str(args.steps),
                   "--warmup", str(args.warmup), "--profile-steps", str(args.profile_steps), "--top", str(args.top)]
            if args.pstats:
                cmd += ["--pstats", f"{args.pstats}-{i}"]
            env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1")
            subprocess.run(cmd, check=True, env=env)
            result = json.loads(out.read_text())
            results.append(result)
            print(f"{options or '(the row)'}: median step {result['median_step_s'] * 1e3:.1f} ms, "
                  f"{result['median_tokens']:.0f} tokens", file=sys.stderr, flush=True)
    summary = {"command": ["python", "bench/probes/host_step_probe.py", *(argv if argv is not None else sys.argv[1:])],
               "layers": args.layers, "pairs": args.pairs, "scale": args.scale, "row_args": args.row_args,
               "variants": results}
    text = json.dumps(summary, indent=1)
    if args.out:
        Path(args.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
