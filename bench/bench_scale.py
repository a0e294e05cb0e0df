"""The data path at scale: cold tokenization, a warm ``train`` start, and the private memory of
each process, for Tulu-shaped sets of 200 to 300,000 pairs, with 1 and 2 ranks.

    python bench/bench_scale.py [--pairs 200,20000] [--reps 3] [--ranks 1,2]

The set (``common.make_rows``, seed 0) is Tulu-shaped as the data-path probe's: prompts of 300-700
words and completions of 100-300 words, uniform, drawn from dpocache's tiny word list, every
prompt numbered; the tiny byte-level BPE makes about a token a word (900 tokens a pair, prompt
counted once; none reaches ``--max-length 2048``). The model is a 2-layer Llama of width 64 (its
forward is not what is measured). Nothing is downloaded.

Rows, each a median of ``--reps`` fresh processes:

- ``cold``: ``load_preference_data(..., max_length=2048)`` into an empty cache directory (the
  token store written), against the code before the store (``--before-tree``: a checkout of
  71b8f3c; its ``load_preference_data`` tokenized into Python tuples) and against this code's
  whole-text rule (``tokenize_continuations`` in place of ``continuation_ids``, no store), the
  variants interleaved rep by rep.
- ``warm load``: ``load_preference_data`` from the complete store in 1 and in 2 processes at once,
  each reading every pair's key and every token id once: the growth of private (anonymous) memory and
  of proportional set size (``Pss``: a page the processes share counted once over them), summed
  over the processes while all of them hold the data. The issue's goal: 2 processes at most
  1.25x one.
- ``warm start``: ``dpocache train --max-steps 1`` (one step of 2 pairs a rank) whose reference
  cache and token store are complete, from launch to exit, under 1 process and under
  ``torchrun`` with 2; with the peak private memory of the rank processes, sampled every 20 ms
  and summed. The difference between two sizes is what the data costs: the goal is at most a
  few seconds and 256 MiB from 200 to 20,000 pairs.

Prints a table and the ratios; writes ``bench/results/scale-<hardware>-<date>.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path[:0] = [str(BENCH), str(BENCH.parent)]

from common import TOKENIZER_VOCAB, BenchConfig, make_rows  # noqa: E402

TULU_SHAPED = BenchConfig("scale", prompt_words=(300, 700), completion_words=(100, 300))
MAX_LENGTH = 2048
MIB = 1024 ** 2


def build_inputs(pairs: int, work: Path) -> Path:
    """``work/scale-<pairs>/{model/, data.jsonl}``, reused when there."""
    out = work / f"scale-{pairs}"
    if (out / "data.jsonl").exists():
        return out
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from dpocache.data.rows import write_jsonl
    from dpocache.models.tiny import build_tokenizer

    tokenizer = build_tokenizer(TOKENIZER_VOCAB)
    config = LlamaConfig(vocab_size=TOKENIZER_VOCAB + 64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=4096,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(out / "model")
    tokenizer.save_pretrained(out / "model")
    write_jsonl(make_rows(TULU_SHAPED, pairs, seed=0), out / "data.tmp.jsonl").rename(out / "data.jsonl")
    return out


# ------------------------------------------------------------------------------ cold tokenization

_LOAD = """
import os, sys, time
from pathlib import Path
mode, data, model, cache, tree, sync, processes = sys.argv[1:8]
sys.path.insert(0, tree)  # ahead of the installed (editable) dpocache
from transformers import AutoTokenizer
from dpocache.data import pairs
assert pairs.__file__.startswith(tree), pairs.__file__

def memory(field):
    with open("/proc/self/smaps_rollup") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))

def anonymous():
    return memory("Anonymous")

def barrier(name):  # every process at this point before any goes on
    Path(sync, f"{name}-{os.getpid()}").touch()
    while len(list(Path(sync).glob(f"{name}-*"))) < int(processes):
        time.sleep(0.01)

tokenizer = AutoTokenizer.from_pretrained(model)
kwargs = {"cache_dir": cache} if mode in ("store", "warm") else {}
if mode == "whole":
    from dpocache.data import tokenize
    pairs.continuation_ids = tokenize.tokenize_continuations
before, pss_before = anonymous(), memory("Pss")
start = time.perf_counter()
result = pairs.load_preference_data(data, tokenizer, max_length=%d, show_progress=False, **kwargs)
keys = [p.key for p in result.pairs]  # every pair's key read once, as a run's first look-up does
columns = getattr(result.pairs, "columns", None)  # and every token id, as an epoch reads them
tokens = int(columns.ids.sum(dtype="int64")) if columns is not None else \
    sum(sum(p.prompt_ids) + sum(p.chosen_ids) + sum(p.rejected_ids) for p in result.pairs)
seconds = time.perf_counter() - start
barrier("loaded")  # each process's share of the pages they map is counted while all of them hold it
print(seconds, anonymous() - before, memory("Pss") - pss_before, len(result), flush=True)
barrier("measured")
""" % MAX_LENGTH


def load(inputs: Path, mode: str, cache: str, tree: Path = BENCH.parent, processes: int = 1) -> dict:
    """``load_preference_data`` in ``processes`` fresh processes at once (``tree``'s dpocache): the
    slowest one's seconds, and over the call, summed over the processes, their growth in
    anonymous (private) memory and in proportional set size (``Pss``: each mapped page counted
    once over the processes that share it), measured while all of them hold the data."""
    with tempfile.TemporaryDirectory() as sync:
        procs = [subprocess.Popen([sys.executable, "-c", _LOAD, mode, str(inputs / "data.jsonl"),
                                   str(inputs / "model"), cache, str(tree.resolve()), sync, str(processes)],
                                  cwd=sync, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for _ in range(processes)]
        outs = []
        for proc in procs:
            out, err = proc.communicate()
            if proc.returncode != 0:
                raise RuntimeError(f"load ({mode}) exited {proc.returncode}:\n{err[-3000:]}")
            outs.append(out.split())
    return {"seconds": max(float(o[0]) for o in outs), "anonymous_bytes": sum(int(o[1]) for o in outs),
            "pss_bytes": sum(int(o[2]) for o in outs)}


def cold(inputs: Path, mode: str, tree: Path = BENCH.parent) -> float:
    with tempfile.TemporaryDirectory() as cache:
        return load(inputs, mode, cache, tree)["seconds"]


# ------------------------------------------------------------------------------ warm start


def _anonymous_bytes(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Anonymous:"):
                    return int(line.split()[1]) * 1024
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        pass
    return 0


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(c) for c in f.read().split()]
    except FileNotFoundError:
        return []


def _python_ranks(root: int) -> list[int]:
    """The processes that run dpocache: the root under 1 rank, torchrun's workers under 2."""
    kids = _children(root)
    return kids if kids else [root]


def run_measured(cmd: list[str], env: dict) -> dict:
    """Run ``cmd``; its wall seconds, and the peak anonymous memory of each rank process and of
    their sum (sampled every 20 ms)."""
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    peaks: dict[int, int] = {}
    peak_sum = 0
    while proc.poll() is None:
        ranks = _python_ranks(proc.pid)
        sizes = {pid: _anonymous_bytes(pid) for pid in ranks}
        for pid, size in sizes.items():
            peaks[pid] = max(peaks.get(pid, 0), size)
        peak_sum = max(peak_sum, sum(sizes.values()))
        time.sleep(0.02)
    seconds = time.perf_counter() - start
    err = proc.stderr.read()
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode}:\n{err[-3000:]}")
    return {"seconds": seconds, "peak_anonymous_sum": peak_sum, "peak_anonymous_each": sorted(peaks.values())}


def _train_cmd(inputs: Path, cache: Path, out: Path, ranks: int) -> list[str]:
    launcher = [sys.executable, "-m", "dpocache"] if ranks == 1 else \
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks), "-m", "dpocache"]
    return [*launcher, "train", "--model", str(inputs / "model"), "--data", str(inputs / "data.jsonl"),
            "--cache-dir", str(cache), "--output-dir", str(out), "--max-length", str(MAX_LENGTH), "--dtype",
            "float32", "--device", "cpu", "--batch-size", str(2 * ranks), "--max-steps", "1",
            "--train.progress", "false"]


def warm_starts(inputs: Path, work: Path, ranks_list: list[int], reps: int) -> dict:
    cache = work / f"cache-{inputs.name}"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(BENCH.parent))
    # The reference cache and the token store, once (a cold start, not measured here).
    first = run_measured(_train_cmd(inputs, cache, work / "run-first", 1), env)
    shutil.rmtree(work / "run-first", ignore_errors=True)
    rows = {"first_start_seconds": first["seconds"]}
    for ranks in ranks_list:
        runs = []
        for rep in range(reps):
            out = work / f"run-{ranks}-{rep}"
            runs.append(run_measured(_train_cmd(inputs, cache, out, ranks), env))
            shutil.rmtree(out, ignore_errors=True)
        rows[f"ranks_{ranks}"] = {
            "seconds": statistics.median(r["seconds"] for r in runs),
            "peak_anonymous_sum_mib": statistics.median(r["peak_anonymous_sum"] for r in runs) / MIB,
            "peak_anonymous_max_rank_mib": statistics.median(max(r["peak_anonymous_each"]) for r in runs) / MIB,
            "runs": runs}
    return rows


# ------------------------------------------------------------------------------ main


def cold_rows(inputs: Path, args) -> dict:
    """Cold tokenization, medians of ``--reps``, the variants interleaved rep by rep."""
    modes = ["store"] + ([] if args.skip_cold_whole else ["whole"]) + (["before"] if args.before_tree else [])
    times: dict[str, list[float]] = {m: [] for m in modes}
    for _ in range(args.reps):
        for mode in modes:
            times[mode].append(cold(inputs, mode, args.before_tree if mode == "before" else BENCH.parent))
    row = {f"cold_{'whole_text' if m == 'whole' else m}_seconds": statistics.median(t) for m, t in times.items()}
    row["cold_runs"] = times
    if "whole" in times:
        row["cold_speedup"] = row["cold_whole_text_seconds"] / row["cold_store_seconds"]
    if "before" in times:
        row["cold_speedup_vs_before"] = row["cold_before_seconds"] / row["cold_store_seconds"]
    print(f"{inputs.name}: cold " + ", ".join(f"{m} {statistics.median(t):.1f} s" for m, t in times.items()),
          flush=True)
    return row


def machine() -> dict:
    return {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
            "python": platform.python_version()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pairs", default="200,20000", help="comma-separated set sizes (the first is the baseline)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--ranks", default="1,2")
    ap.add_argument("--skip-cold-whole", action="store_true", help="leave out today's rule (slow at 300k)")
    ap.add_argument("--before-tree", type=Path, default=None,
                    help="a checkout of dpocache before the token store (git worktree add DIR 71b8f3c): its "
                         "load_preference_data timed cold beside this one's")
    ap.add_argument("--only", choices=["cold", "warm"], default=None, help="measure one part")
    ap.add_argument("--work", type=Path, default=BENCH / "work")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    sizes = [int(n) for n in args.pairs.split(",")]
    ranks_list = [int(n) for n in args.ranks.split(",")]
    argv = ["BEFORE_TREE" if args.before_tree and a == str(args.before_tree) else a for a in sys.argv[1:]]
    results = {"command": " ".join(["python", "bench/bench_scale.py", *argv]), "machine": machine(),
               "date": time.strftime("%Y-%m-%d"), "max_length": MAX_LENGTH, "sizes": {}}
    for n in sizes:
        inputs = build_inputs(n, args.work)
        row: dict = {}
        results["sizes"][str(n)] = row
        if args.only != "warm":
            row.update(cold_rows(inputs, args))
        if args.only == "cold":
            continue
        row["warm"] = warm_starts(inputs, args.work, ranks_list, args.reps)
        cache = str(args.work / f"cache-{inputs.name}")
        row["warm_load"] = {}
        for k in ranks_list:
            runs = [load(inputs, "warm", cache, processes=k) for _ in range(args.reps)]
            row["warm_load"][str(k)] = {
                "seconds": statistics.median(r["seconds"] for r in runs),
                "anonymous_mib": statistics.median(r["anonymous_bytes"] for r in runs) / MIB,
                "pss_mib": statistics.median(r["pss_bytes"] for r in runs) / MIB}
        print("  warm load_preference_data, memory over the call (private / proportional, summed): "
              + ", ".join(f"{k} process(es) {v['anonymous_mib']:.1f} / {v['pss_mib']:.1f} MiB"
                          for k, v in row["warm_load"].items()), flush=True)
        for ranks in ranks_list:
            w = row["warm"][f"ranks_{ranks}"]
            print(f"  warm start, {ranks} rank(s): {w['seconds']:.1f} s, private memory "
                  f"{w['peak_anonymous_sum_mib']:.0f} MiB (largest rank {w['peak_anonymous_max_rank_mib']:.0f} MiB)",
                  flush=True)
    base, top = str(sizes[0]), str(sizes[-1])
    if base != top and args.only != "cold":
        deltas = {}
        for ranks in ranks_list:
            a, b = results["sizes"][base]["warm"][f"ranks_{ranks}"], results["sizes"][top]["warm"][f"ranks_{ranks}"]
            deltas[ranks] = {"seconds": b["seconds"] - a["seconds"],
                             "private_mib": b["peak_anonymous_sum_mib"] - a["peak_anonymous_sum_mib"]}
            print(f"warm start {base} -> {top} pairs, {ranks} rank(s): +{deltas[ranks]['seconds']:.1f} s, "
                  f"+{deltas[ranks]['private_mib']:.0f} MiB private")
        results["deltas"] = deltas
    if "warm_load" in results["sizes"][top] and {"1", "2"} <= set(results["sizes"][top]["warm_load"]):
        one, two = (results["sizes"][top]["warm_load"][k]["pss_mib"] for k in ("1", "2"))
        results["two_processes_over_one"] = two / one
        print(f"the data's memory at {top} pairs (Pss over the load): 2 processes together {two:.1f} MiB, "
              f"1 process {one:.1f} MiB: {two / one:.2f}x")
    for name in ("cold_speedup", "cold_speedup_vs_before"):
        if name in results["sizes"][top]:
            print(f"{name} at {top} pairs: {results['sizes'][top][name]:.2f}x")
    out = args.out or BENCH / "results" / f"scale-cpu-{os.cpu_count()}core-{time.strftime('%Y%m%d')}.json"
    out.write_text(json.dumps(results, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
