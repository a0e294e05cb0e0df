"""Training throughput of the layouts under ``torchrun`` on CPU: each layout's pairs per second
in a 2-process (gloo) DDP run, the layouts interleaved within each repetition so that a busy
machine slows them alike, medians of the steps after the first.

    python bench/bench_torchrun_layouts.py --config long-prompt --reps 3

The reference cache is built once (one process) and every run trains on it; each run is
``torchrun --standalone --nproc-per-node N -m dpocache train ... --train.layout L`` (launched
as ``python -m torch.distributed.run``) with one thread per process, and its ``metrics.jsonl``
(one row per step) gives each step's wall time (``seconds``). Results:
``bench/results/torchrun-layouts-<config>-<time>.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import BENCH_DIR, CONFIGS, build_inputs  # noqa: E402


def run(cmd: list[str], env: dict, log: Path) -> None:
    with open(log, "a") as f:
        f.write(f"\n=== {' '.join(cmd)}\n")
        f.flush()
        done = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env)
    if done.returncode != 0:
        raise SystemExit(f"failed ({done.returncode}): {' '.join(cmd)}; see {log}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="long-prompt", choices=sorted(CONFIGS))
    p.add_argument("--pairs", type=int, default=None)
    p.add_argument("--layouts", nargs="+", default=["padded", "shared", "packed"])
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=4, help="pairs per process per step")
    p.add_argument("--steps", type=int, default=6, help="optimizer steps per run (the first is not counted)")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--out", default=str(BENCH_DIR / "results"))
    args = p.parse_args(argv)

    cfg = CONFIGS[args.config]
    inputs = build_inputs(cfg, args.pairs or cfg.pairs)
    model, data = str(inputs / "model"), str(inputs / "data.jsonl")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    log = out / f"torchrun-layouts-{args.config}-{stamp}.log"
    scratch = Path(tempfile.mkdtemp(prefix="bench-torchrun-layouts-"))
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1")
    common = ["--model", model, "--data", data, "--cache-dir", str(scratch / "cache"), "--dtype", "float32",
              "--device", "cpu", "--max-length", "none"]
    run([sys.executable, "-m", "dpocache", "cache", "build", *common], env, log)
    steps: dict[str, list[float]] = {layout: [] for layout in args.layouts}
    for rep in range(args.reps):
        order = args.layouts[rep % len(args.layouts):] + args.layouts[:rep % len(args.layouts)]
        for layout in order:
            workdir = scratch / f"{layout}-{rep}"
            torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                        str(args.nproc)]
            run([*torchrun, "-m", "dpocache", "train", *common,
                 "--output-dir", str(workdir), "--batch-size", str(args.batch_size), "--max-steps", str(args.steps),
                 "--logging-steps", "1", "--train.layout", layout, "--lr", "1e-6", "--optim.warmup_ratio", "0",
                 "--train.progress", "false"], env, log)
            rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
            steps[layout] += [r["seconds"] for r in rows if "seconds" in r][1:]  # the first includes warm-up
            print(f"  rep {rep + 1} {layout}: {[round(r['seconds'], 2) for r in rows if 'seconds' in r]}", flush=True)
    global_batch = args.batch_size * args.nproc
    result = {"config": args.config, "nproc": args.nproc, "batch_size": args.batch_size, "steps": args.steps,
              "reps": args.reps, "step_seconds": steps, "loadavg": os.getloadavg(),
              "pairs_per_s": {k: global_batch / statistics.median(v) for k, v in steps.items()}}
    base = result["pairs_per_s"][args.layouts[0]]
    print(f"\n{args.config}, {args.nproc} processes x batch {args.batch_size}, medians of {args.reps} x "
          f"{args.steps - 1} steps:")
    for layout, pps in result["pairs_per_s"].items():
        print(f"  {layout:7s} {pps:6.2f} pairs/s  x{pps / base:.2f}")
    path = out / f"torchrun-layouts-{args.config}-{stamp}.json"
    path.write_text(json.dumps(result, indent=1))
    print(f"wrote {path}")
    shutil.rmtree(scratch, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
