"""``dpocache train`` under two sets of options, A and B, in alternating processes on the same
cache: the side-by-side A/B of a training option on this machine.

    python bench/probes/train_ab.py --a "--skip-unread-products true" --b "--skip-unread-products false" \
        [--common "--lora-r 16 --gradient-checkpointing true"] [--config 58m] [--rounds 3] [--steps 9] \
        [--batch-size 8] [--dtype float32] [--device cpu] [--out result.json]

Each run is ``dpocache train`` in a process of its own (the first run builds the reference
cache, which every later run reads), with ``--common`` and then its own options. Its throughput
is the tokens/s of its logging windows after the first (the first holds the warm-up step).
Rounds alternate which side runs first, so a slow spell of a shared machine falls on both alike.
Prints one line per run and a JSON line (also written to ``--out``) with each side's tokens/s
per round, their medians and the median of the rounds' ratios A/B.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(BENCH))

from common import CONFIGS, build_inputs  # noqa: E402


def train_tokens_per_s(options: list[str], inputs: Path, cache: Path, out: Path, dtype: str, device: str,
                       batch_size: int, steps: int) -> float:
    """One ``dpocache train`` of ``inputs`` (``build_inputs``' directory) in a process of its
    own, with ``options`` last: the tokens/s of its logging windows after the first (the first
    holds the warm-up step)."""
    logging = max(1, steps // 3)
    cmd = [sys.executable, "-m", "dpocache", "train", "--model", str(inputs / "model"),
           "--data", str(inputs / "data.jsonl"), "--cache-dir", str(cache), "--output-dir", str(out),
           "--dtype", dtype, "--device", device, "--batch-size", str(batch_size),
           "--max-steps", str(steps), "--logging-steps", str(logging), "--train.progress", "false",
           "--train.save_minutes", "0", "--max-length", "none", "--lr", "1e-6", *options]
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", TQDM_DISABLE="1")
    subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    windows = [r for r in rows if "tokens_per_s" in r][1:]
    tokens = sum(r["tokens_per_s"] * r["seconds"] for r in windows)
    return tokens / sum(r["seconds"] for r in windows)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--a", required=True, help="side A's options, one string")
    parser.add_argument("--b", required=True, help="side B's options, one string")
    parser.add_argument("--common", default="", help="both sides' options, before their own")
    parser.add_argument("--config", default="58m", choices=list(CONFIGS))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=9)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", type=Path, help="also write the JSON line here")
    args = parser.parse_args(argv)
    cfg = CONFIGS[args.config]
    inputs = build_inputs(cfg, cfg.pairs)
    sides = {"a": shlex.split(args.common) + shlex.split(args.a), "b": shlex.split(args.common) + shlex.split(args.b)}
    speeds: dict[str, list[float]] = {side: [] for side in sides}
    with tempfile.TemporaryDirectory() as scratch:
        cache = Path(scratch) / "cache"
        for round_ in range(args.rounds):
            for side in ("a", "b") if round_ % 2 == 0 else ("b", "a"):
                speeds[side].append(train_tokens_per_s(sides[side], inputs, cache, Path(scratch) / f"{side}-{round_}",
                                                       args.dtype, args.device, args.batch_size, args.steps))
                print(f"round {round_} {side} ({shlex.join(sides[side])}): {speeds[side][-1]:.0f} tokens/s",
                      flush=True)
    ratios = [a / b for a, b in zip(speeds["a"], speeds["b"])]
    result = {"command": "python bench/probes/train_ab.py " + shlex.join(argv if argv is not None else sys.argv[1:]),
              "config": args.config, "dtype": args.dtype, "device": args.device, "batch_size": args.batch_size,
              "steps": args.steps, "cpus": os.cpu_count(), "options": {side: sides[side] for side in sides},
              "tokens_per_s": {side: [round(v) for v in speeds[side]] for side in sides},
              "median": {side: round(statistics.median(speeds[side])) for side in sides},
              "median_ratio_a_b": round(statistics.median(ratios), 3)}
    print(json.dumps(result))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
