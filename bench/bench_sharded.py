"""Host memory of the sharded reference pass and of ``train --fsdp``'s start-up (CPU, gloo).

    python bench/bench_sharded.py --reps 3 [--config 300m|1b]

Builds (once, under ``bench/work/``) a ~300M-parameter Llama (``--config 1b``: TinyLlama's shape,
1.1B) from its config and a small preference set, then measures, each run in fresh processes, medians over ``--reps``:

- the peak resident memory of an unsharded ``cache build`` (one process) and of each process
  of a 2-process ``cache build --fsdp`` (the reference's weights sharded over the two);
- the summed peak resident memory of the 2 processes of a ``train --fsdp`` start-up (``setup``:
  data, the cached reference values, the policy created on the meta device and filled shard by
  shard, the optimizer), against one copy of the model's fp32 weights.

Each process records its peak RSS (``VmHWM``) after importing torch, transformers and
dpocache (the interpreter's own share, the same in every process) and at the end; both raw
peaks and peaks net of that import baseline are reported. Results go to
``bench/results/sharded-<config>-<time>.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import BENCH_DIR, BenchConfig, build_inputs, write_results  # noqa: E402

CONFIGS = {
    "300m": BenchConfig("300m", hidden_size=1024, intermediate_size=2816, num_hidden_layers=20, num_attention_heads=16,
                        num_key_value_heads=8, prompt_words=(20, 60), completion_words=(10, 40), pairs=8),
    # TinyLlama's shape (1.1B): the per-process floor of the imports is a smaller share of it.
    "1b": BenchConfig("1b", hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
                      num_key_value_heads=4, prompt_words=(20, 60), completion_words=(10, 40), pairs=8),
}


def _rss() -> int:
    """This process's peak resident memory in bytes: ``VmHWM``. Not ``ru_maxrss``: Linux keeps
    that across ``execve``, so a worker started by a process that once held more (this script,
    after building the model) would report its parent's peak."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024  # kB
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def worker(kind: str, argv: list[str], out: Path) -> None:
    """One process of a measured run: imports, baseline, the work, peak; writes rank-N.json."""
    import torch  # noqa: F401
    import transformers  # noqa: F401

    from dpocache.cli import entry as cli
    from dpocache.training import loop as train

    baseline = _rss()
    if kind == "build":
        assert cli.main(argv) == 0
    else:
        from dpocache.config import build_config

        train.setup(build_config(None, argv))
    rank = int(os.environ.get("RANK", "0"))
    (out / f"rank-{rank}.json").write_text(json.dumps({"baseline": baseline, "peak": _rss()}))


def _run(kind: str, argv: list[str], nproc: int, out: Path) -> list[dict]:
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1",
               CUDA_VISIBLE_DEVICES="")
    me = [str(Path(__file__).resolve()), "--worker", kind, "--out", str(out), "--"]
    cmd = ([sys.executable, *me] if nproc == 1 else
           [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-port", "29517",
            *me])
    proc = subprocess.run(cmd + argv, env=env, capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"{' '.join(cmd + argv)}\n{proc.stderr[-4000:]}")
    return [json.loads((out / f"rank-{r}.json").read_text()) for r in range(nproc)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--config", choices=list(CONFIGS), default="300m")
    p.add_argument("--worker", choices=["build", "train"], help=argparse.SUPPRESS)
    p.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    p.add_argument("rest", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args.worker, [a for a in args.rest if a != "--"], args.out)

    config = CONFIGS[args.config]
    inputs = build_inputs(config, config.pairs)
    info = json.loads((inputs / "info.json").read_text())
    model, data, work = inputs / "model", inputs / "data.jsonl", BENCH_DIR / "work" / f"sharded-{args.config}"
    common = ["--model", str(model), "--data", str(data), "--dtype", "float32", "--device", "cpu",
              "--max-length", "128"]
    runs: dict[str, list] = {"unsharded_build": [], "sharded_build": [], "fsdp_train_startup": []}
    for rep in range(args.reps):
        builds = (("unsharded_build", "build", 1, []), ("sharded_build", "build", 2, ["--fsdp"]))
        for name, kind, nproc, extra in builds:
            cache = work / f"cache-{name}"
            shutil.rmtree(cache, ignore_errors=True)
            runs[name].append(_run(kind, ["cache", "build", *common, "--cache-dir", str(cache), *extra], nproc,
                                   work / name))
        train_argv = [*common, "--cache-dir", str(work / "cache-sharded_build"), "--fsdp", "--batch-size", "2",
                      "--output-dir", str(work / "train-out"), "--train.overwrite", "true",
                      "--train.progress", "false"]
        runs["fsdp_train_startup"].append(_run("train", train_argv, 2, work / "train"))
        print(f"rep {rep + 1}: " + json.dumps({k: v[-1] for k, v in runs.items()}), flush=True)

    def med(values):
        return statistics.median(values)

    fp32_bytes = info["parameters"] * 4
    unsharded = med([r[0]["peak"] for r in runs["unsharded_build"]])
    unsharded_net = med([r[0]["peak"] - r[0]["baseline"] for r in runs["unsharded_build"]])
    sharded = med([max(x["peak"] for x in r) for r in runs["sharded_build"]])
    sharded_net = med([max(x["peak"] - x["baseline"] for x in r) for r in runs["sharded_build"]])
    train_sum = med([sum(x["peak"] for x in r) for r in runs["fsdp_train_startup"]])
    train_net = med([sum(x["peak"] - x["baseline"] for x in r) for r in runs["fsdp_train_startup"]])
    summary = {
        "config": args.config, "parameters": info["parameters"], "fp32_weight_bytes": fp32_bytes, "reps": args.reps,
        "cpu_allocator": os.environ.get("DPOCACHE_CPU_ALLOCATOR", "retain"),
        "unsharded_build_peak": unsharded, "sharded_build_peak_per_process": sharded,
        "sharded_over_unsharded": sharded / unsharded,
        "sharded_over_unsharded_net_of_imports": sharded_net / unsharded_net,
        "fsdp_train_startup_summed_peak": train_sum, "fsdp_train_startup_over_fp32_weights": train_sum / fp32_bytes,
        "fsdp_train_startup_net_of_imports_over_fp32_weights": train_net / fp32_bytes,
    }
    write_results(f"sharded-{args.config}", summary, runs)


if __name__ == "__main__":
    main()
