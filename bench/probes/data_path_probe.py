"""The data path at scale, before a token store (issue 36): what one process pays at every start
to read and tokenize a Tulu-shaped preference set, dpocache against TRL 1.16's DPOTrainer.

    python bench/probes/data_path_probe.py [--pairs 20000] [--reps 3]

The set is generated (``common.make_rows``, seed 0): prompts of 300-700 words and completions of
100-300 words drawn uniformly from dpocache's tiny word list, every prompt numbered so that rows
are distinct; the tokenizer is ``dpocache.models.tiny.build_tokenizer(common.TOKENIZER_VOCAB)``,
saved with ``save_pretrained``. Nothing is downloaded.

Each measurement runs in a fresh subprocess, which imports everything and loads the tokenizer
first, then times one call and reports its wall seconds and its peak RSS (``ru_maxrss``) minus the
RSS just before the call:

- ``dpocache``: ``load_preference_data(path, tokenizer, max_length=2048, show_progress=False)``;
  the pairs stay in the process as ``TokenizedPair`` tuples of Python ints.
- ``trl cold``: ``datasets.Dataset.from_json(path)`` then TRL's own ``DPOTrainer._prepare_dataset``
  (called unbound, with ``DPOConfig(max_length=2048)``'s defaults: ``dataset_num_proc=None``),
  which maps its ``tokenize_fn`` over the rows into Arrow files; a fresh ``HF_DATASETS_CACHE``.
- ``trl warm``: the same call in a new process on the cache the cold run left (a fingerprint hit
  when no new cache file appears; the row says which).

Medians of ``--reps``; a table on stdout, and JSON to
``bench/results/data-path-cpu-2core-<date>.json`` (``--out`` to change).
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
import tempfile
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(BENCH), str(BENCH.parent)]  # bench/common.py, and dpocache in a checkout not installed

from common import TOKENIZER_VOCAB, BenchConfig, make_rows  # noqa: E402

TULU_SHAPED = BenchConfig("data-path", prompt_words=(300, 700), completion_words=(100, 300))
MAX_LENGTH = 2048
GIB = 1024 ** 3


def _rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def _peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


# ------------------------------------------------------------------------------ one measurement


def worker_dpocache(data: Path, tokenizer_dir: Path) -> dict:
    from transformers import AutoTokenizer

    from dpocache.data.pairs import load_preference_data

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    before = _rss_bytes()
    start = time.perf_counter()
    result = load_preference_data(str(data), tokenizer, max_length=MAX_LENGTH, show_progress=False)
    seconds = time.perf_counter() - start
    peak = _peak_rss_bytes()
    return {"seconds": seconds, "peak_rss_bytes": peak - before, "rss_before_bytes": before,
            "pairs": len(result.pairs), "tokens": sum(p.unique_tokens for p in result.pairs),
            "truncated": result.truncated}


def worker_trl(data: Path, tokenizer_dir: Path) -> dict:
    import datasets
    from transformers import AutoTokenizer
    from trl import DPOConfig, DPOTrainer

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    cache = Path(os.environ["HF_DATASETS_CACHE"])
    with tempfile.TemporaryDirectory() as out:
        args = DPOConfig(output_dir=out, max_length=MAX_LENGTH, report_to=[], use_cpu=True, bf16=False)
    trainer = type("TrainerStub", (), {"_tokenizer": tokenizer})()  # all _prepare_dataset reads of self
    files_before = {p for p in cache.rglob("*") if p.is_file()}
    before = _rss_bytes()
    start = time.perf_counter()
    dataset = datasets.Dataset.from_json(str(data))
    dataset = DPOTrainer._prepare_dataset(trainer, dataset, tokenizer, args, "train")
    seconds = time.perf_counter() - start
    peak = _peak_rss_bytes()
    new_files = {p for p in cache.rglob("*") if p.is_file()} - files_before
    table = dataset.data.table
    tokens = sum(len(table.column(c).combine_chunks().values) for c in ("prompt_ids", "chosen_ids", "rejected_ids"))
    return {"seconds": seconds, "peak_rss_bytes": peak - before, "rss_before_bytes": before,
            "pairs": len(dataset), "tokens": tokens,
            "new_cache_files": sorted(str(f.relative_to(cache)) for f in new_files),
            "cache_bytes": sum(p.stat().st_size for p in cache.rglob("*") if p.is_file())}


def run_worker(kind: str, data: Path, tokenizer_dir: Path, env: dict | None = None) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", kind, "--data", str(data),
           "--tokenizer", str(tokenizer_dir)]
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **(env or {})})
    if proc.returncode != 0:
        raise RuntimeError(f"{kind} worker failed:\n{proc.stderr[-4000:]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    result["process_seconds"] = time.perf_counter() - start
    return result


# ------------------------------------------------------------------------------------ the probe


def build_inputs(pairs: int, work: Path) -> tuple[Path, Path]:
    from dpocache.data.rows import write_jsonl
    from dpocache.models.tiny import build_tokenizer

    out = work / f"data-path-{pairs}"
    data, tok_dir = out / "data.jsonl", out / "tokenizer"
    if not (data.exists() and (tok_dir / "tokenizer.json").exists()):
        out.mkdir(parents=True, exist_ok=True)
        build_tokenizer(TOKENIZER_VOCAB).save_pretrained(tok_dir)
        rows = make_rows(TULU_SHAPED, pairs, seed=0)
        assert len({r["prompt"] for r in rows}) == len(rows)
        write_jsonl(rows, data)
    return data, tok_dir


def machine() -> dict:
    model = "unknown"
    try:
        for line in subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines():
            if line.startswith("Model name:"):
                model = line.split(":", 1)[1].strip()
    except OSError:
        pass
    return {"cpu": model, "cores": os.cpu_count()}


def summarise(name: str, runs: list[dict]) -> dict:
    row = {"name": name,
           "seconds": statistics.median(r["seconds"] for r in runs),
           "peak_rss_gib": statistics.median(r["peak_rss_bytes"] for r in runs) / GIB,
           "process_seconds": statistics.median(r["process_seconds"] for r in runs),
           "pairs": runs[0]["pairs"], "tokens": runs[0]["tokens"]}
    if "new_cache_files" in runs[0]:
        row["new_arrow_files"] = [sum(f.endswith(".arrow") for f in r["new_cache_files"]) for r in runs]
    for key in ("cache_bytes", "truncated"):
        if key in runs[0]:
            row[key] = [r[key] for r in runs]
    row["runs"] = runs
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=20000)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--no-trl", action="store_true", help="measure dpocache only")
    parser.add_argument("--work", type=Path, default=BENCH / "work", help="where the inputs are generated")
    parser.add_argument("--out", type=Path,
                        default=BENCH / "results" / f"data-path-cpu-2core-{time.strftime('%Y%m%d')}.json")
    parser.add_argument("--worker", choices=["dpocache", "trl"], help=argparse.SUPPRESS)
    parser.add_argument("--data", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--tokenizer", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        fn = worker_dpocache if args.worker == "dpocache" else worker_trl
        print(json.dumps(fn(args.data, args.tokenizer)))
        return

    start = time.perf_counter()
    data, tok_dir = build_inputs(args.pairs, args.work)
    print(f"inputs {data.parent} ({data.stat().st_size / 2**20:.1f} MiB JSONL) in {time.perf_counter() - start:.1f} s")
    runs: dict[str, list[dict]] = {"dpocache": [], "trl cold": [], "trl warm": []}
    for rep in range(args.reps):
        runs["dpocache"].append(run_worker("dpocache", data, tok_dir))
        print(f"rep {rep}: dpocache {runs['dpocache'][-1]['seconds']:.1f} s", flush=True)
        if args.no_trl:
            continue
        cache = Path(tempfile.mkdtemp(prefix="hf-datasets-", dir=args.work))
        try:
            env = {"HF_DATASETS_CACHE": str(cache), "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
            runs["trl cold"].append(run_worker("trl", data, tok_dir, env))
            runs["trl warm"].append(run_worker("trl", data, tok_dir, env))
        finally:
            shutil.rmtree(cache, ignore_errors=True)
        print(f"rep {rep}: trl cold {runs['trl cold'][-1]['seconds']:.1f} s, "
              f"warm {runs['trl warm'][-1]['seconds']:.1f} s", flush=True)

    rows = [summarise(name, r) for name, r in runs.items() if r]
    dp = rows[0]
    result = {"date": time.strftime("%Y-%m-%d"),
              "command": "python bench/probes/data_path_probe.py " + " ".join(sys.argv[1:]),
              "machine": machine(), "pairs": dp["pairs"], "tokens": dp["tokens"],
              "data": {"prompt_words": TULU_SHAPED.prompt_words, "completion_words": TULU_SHAPED.completion_words,
                       "jsonl_bytes": data.stat().st_size, "tokenizer_vocab": TOKENIZER_VOCAB,
                       "max_length": MAX_LENGTH},
              "reps": args.reps, "rows": rows}
    print(f"\n{dp['pairs']} pairs, {dp['tokens']:,} tokens (dpocache's, prompt once); medians of {args.reps}")
    print(f"{'run':<10} {'seconds':>8} {'peak RSS GiB':>13} {'process s':>10} {'tokens':>12}")
    for row in rows:
        print(f"{row['name']:<10} {row['seconds']:>8.2f} {row['peak_rss_gib']:>13.3f} "
              f"{row['process_seconds']:>10.2f} {row['tokens']:>12,}")
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
