"""Which on-disk format for the token store: numpy ``.npy`` files memory-mapped with ``np.load``
against an Arrow IPC file memory-mapped with pyarrow (``list<int32>`` columns, what ``datasets``
writes), for the columns of a Tulu-shaped set.

    python bench/probes/token_store_format_probe.py [--pairs 20000] [--reps 3]

The columns are generated (seed 0): per pair a prompt of 300-700 ids and two completions of
100-300, int32 ids below 8,000 (the shape of bench_scale's set, 18M ids at 20,000 pairs). Each
measurement is a fresh process: open the store, then read every pair's three id runs as Python
tuples (what ``StoredPair`` hands the collator) and every pair's lengths; it reports the wall
seconds of the open and of the reads, and the growth of private (anonymous) memory over both.
Medians of ``--reps``; a table on stdout and JSON to ``bench/results/token-store-format-<date>.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1]

_READ = """
import sys, time
import numpy as np
kind, root = sys.argv[1:3]

def anonymous():
    with open("/proc/self/smaps_rollup") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("Anonymous:"))

before = anonymous()
start = time.perf_counter()
if kind == "npy":
    ids = np.load(root + "/ids.npy", mmap_mode="r")
    bounds = np.load(root + "/bounds.npy", mmap_mode="r")
    opened = time.perf_counter()
    lengths = np.diff(bounds, axis=1)
    for b in bounds:
        parts = [tuple(ids[b[k]:b[k + 1]].tolist()) for k in range(3)]
else:
    import pyarrow as pa
    import pyarrow.ipc as ipc
    table = ipc.open_file(pa.memory_map(root + "/pairs.arrow")).read_all()
    opened = time.perf_counter()
    columns = [table.column(name).chunk(0) for name in ("prompt", "chosen", "rejected")]  # written as one batch
    lengths = [c.value_lengths() for c in columns]
    values = [c.values.to_numpy(zero_copy_only=True) for c in columns]
    offsets = [c.offsets.to_numpy(zero_copy_only=True) for c in columns]
    for i in range(len(table)):
        parts = [tuple(v[o[i]:o[i + 1]].tolist()) for v, o in zip(values, offsets)]
done = time.perf_counter()
print(opened - start, done - opened, anonymous() - before)
"""


def write_stores(pairs: int, root: Path) -> dict:
    import numpy as np
    import pyarrow as pa
    import pyarrow.ipc as ipc

    rng = np.random.default_rng(0)
    lengths = np.stack([rng.integers(300, 701, pairs), rng.integers(100, 301, pairs),
                        rng.integers(100, 301, pairs)], axis=1)
    total = int(lengths.sum())
    ids = rng.integers(0, 8000, total, dtype=np.int32)
    bounds = np.zeros((pairs, 4), np.int64)
    bounds[:, 1:] = np.cumsum(lengths, axis=1)
    bounds += np.concatenate([[0], np.cumsum(lengths.sum(axis=1))[:-1]])[:, None]
    start = time.perf_counter()
    np.save(root / "ids.npy", ids)
    np.save(root / "bounds.npy", bounds)
    npy_seconds = time.perf_counter() - start
    start = time.perf_counter()
    arrays = []
    for k in range(3):
        values = np.concatenate([ids[b[k]:b[k + 1]] for b in bounds])
        offsets = np.concatenate([[0], np.cumsum(lengths[:, k])]).astype(np.int32)
        arrays.append(pa.ListArray.from_arrays(pa.array(offsets), pa.array(values)))
    table = pa.table(dict(zip(("prompt", "chosen", "rejected"), arrays)))
    with ipc.new_file(str(root / "pairs.arrow"), table.schema) as writer:
        writer.write_table(table)
    arrow_seconds = time.perf_counter() - start
    return {"ids": total, "npy_write_seconds": npy_seconds, "arrow_write_seconds": arrow_seconds,
            "npy_bytes": sum((root / n).stat().st_size for n in ("ids.npy", "bounds.npy")),
            "arrow_bytes": (root / "pairs.arrow").stat().st_size}


def read(kind: str, root: Path) -> list[float]:
    out = subprocess.run([sys.executable, "-c", _READ, kind, str(root)], capture_output=True, text=True, check=True)
    return [float(x) for x in out.stdout.split()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pairs", type=int, default=20000)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        written = write_stores(args.pairs, root)
        runs = {"npy": [], "arrow": []}
        for _ in range(args.reps):
            for kind in runs:  # interleaved
                runs[kind].append(read(kind, root))
    result = {"command": " ".join(["python", "bench/probes/token_store_format_probe.py", *sys.argv[1:]]),
              "date": time.strftime("%Y-%m-%d"), "pairs": args.pairs, **written, "runs": runs}
    print(f"{args.pairs} pairs, {written['ids']} ids: npy {written['npy_bytes'] / 2**20:.1f} MiB written in "
          f"{written['npy_write_seconds']:.2f} s; arrow {written['arrow_bytes'] / 2**20:.1f} MiB in "
          f"{written['arrow_write_seconds']:.2f} s")
    for kind, rows in runs.items():
        med = [statistics.median(r[i] for r in rows) for i in range(3)]
        result[kind] = {"open_seconds": med[0], "read_all_seconds": med[1], "private_mib": med[2] / 2**20}
        print(f"{kind:6s} open {med[0] * 1000:.1f} ms, every pair read {med[1]:.2f} s, private memory "
              f"{med[2] / 2**20:.1f} MiB")
    out = args.out or BENCH / "results" / f"token-store-format-{time.strftime('%Y%m%d')}.json"
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
