"""Training with its micro-batches laid out ahead on a thread (``--train.prefetch on``) against
laid out in turn (``off``), in alternating processes on the same cache.

    python bench/probes/prefetch_ab.py [--config 58m] [--rounds 3] [--steps 9] [--batch-size 8]
        [--dtype float32] [--device cpu]

Each run is ``dpocache train`` in a process of its own (the first run builds the reference
cache, which every later run reads). Its throughput is the tokens/s of its logging windows after
the first (the first holds the warm-up step). Rounds alternate which setting runs first, so a
slow spell of a shared machine falls on both alike. Prints one line per run and a JSON line with
each setting's tokens/s per round, their medians and the median ratio on/off: the figure
``train.prefetch``'s ``auto`` is set from on this device.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(BENCH))

from common import CONFIGS, build_inputs, train_tokens_per_s  # noqa: E402

SETTINGS = ("on", "off")


def run(setting: str, inputs: Path, cache: Path, out: Path, args) -> float:
    """One ``dpocache train`` with ``--train.prefetch setting``: tokens/s of its windows after the first."""
    return train_tokens_per_s(["--train.prefetch", setting], inputs, cache, out, args.dtype, args.device,
                              args.batch_size, args.steps)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", default="58m", choices=list(CONFIGS))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=9)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    cfg = CONFIGS[args.config]
    inputs = build_inputs(cfg, cfg.pairs)
    speeds: dict[str, list[float]] = {s: [] for s in SETTINGS}
    with tempfile.TemporaryDirectory() as scratch:
        cache = Path(scratch) / "cache"
        for round_ in range(args.rounds):
            for setting in SETTINGS if round_ % 2 == 0 else SETTINGS[::-1]:
                speeds[setting].append(run(setting, inputs, cache, Path(scratch) / f"{setting}-{round_}", args))
                print(f"round {round_} prefetch {setting}: {speeds[setting][-1]:.0f} tokens/s", flush=True)
    ratios = [on / off for on, off in zip(speeds["on"], speeds["off"])]
    print(json.dumps({"config": args.config, "dtype": args.dtype, "device": args.device,
                      "batch_size": args.batch_size, "steps": args.steps, "cpus": os.cpu_count(),
                      "tokens_per_s": {s: [round(v) for v in speeds[s]] for s in SETTINGS},
                      "median": {s: round(statistics.median(speeds[s])) for s in SETTINGS},
                      "median_ratio_on_off": round(statistics.median(ratios), 3)}))


if __name__ == "__main__":
    main()
