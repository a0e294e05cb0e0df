"""dpocache against TRL's DPOTrainer, side by side, on the same model, data, dtype and batch.

    python bench/bench_vs_trl.py --config 58m --dtype bfloat16 --reps 3

Builds (once, under bench/work/) a Llama of the configuration's size from its config with random
weights, a tokenizer, and a preference set of the configuration's length distribution; then, for
each repetition, runs in separate processes (peak RSS is per process):

1. TRL ``DPOTrainer(precompute_ref_log_probs=True)``: its precompute, timed as TRL runs it (its
   DataLoader over the whole set); model load, tokenisation and its state-dict hash excluded.
2. ``dpocache cache build --json`` into a fresh cache directory; model load excluded.
3. TRL's training steps, with the values of its precompute run read back (its own datasets
   cache does not hit across processes here, so it would recompute them all).
4. ``dpocache train`` steps on the cache built in 2 (a cache hit), same batch size and dtype.
5. ``dpocache train`` up to its first step (start-up on a cache hit), and ``dpocache cache
   build`` again on the complete cache (no model load, no forward).

Sides alternate within a repetition, so both see the same load on a shared machine. Tokens are
counted the same way for both: each prompt once, plus chosen and rejected. Prints medians and
ratios and writes everything to bench/results/.

``--config 1b --startup-only`` measures the cache-hit start-up of a ~1.1B model only.
``--merge A.json B.json`` makes one table of the repetitions of the same run split over several
calls (a lent GPU machine runs at most 10 minutes a call).

On a GPU (``--device cuda``, e.g. ``--config 1b-2048 --dtype bfloat16``) each worker also records
its peak GPU memory, and MFU is given against the measured bf16 matmul peak and against the
device's nominal dense bf16 peak (H100/H200 SXM: 989.4 TFLOP/s).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (  # noqa: E402
    BENCH_DIR,
    CONFIGS,
    build_inputs,
    flops_of_build,
    measure_peak,
    nominal_peaks,
    read_results,
)

WORKERS = BENCH_DIR / "workers.py"


def run_worker(mode: str, spec: dict, scratch: Path, log: Path, timeout_s: float | None = None) -> dict:
    """Run one worker process; returns its result plus ``peak_rss_bytes`` and ``wall_s``.
    ``timeout_s``: past it the worker is killed (the compiler's worker processes end with their
    parent) and RuntimeError says so, as for a worker that failed."""
    spec = dict(spec)
    spec_path = scratch / f"{mode}-spec.json"
    spec["out"] = str(scratch / f"{mode}-result.json")
    spec["spawned_at"] = time.time()
    spec_path.write_text(json.dumps(spec))
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1", TQDM_DISABLE="1",
               HF_DATASETS_DISABLE_PROGRESS_BARS="1", TRANSFORMERS_VERBOSITY="error")
    env.update(spec.get("env", {}))
    t0 = time.perf_counter()
    with open(log, "a") as f:
        f.write(f"\n=== {mode} {json.dumps(spec)}\n")
        f.flush()
        proc = subprocess.Popen([sys.executable, str(WORKERS), mode, str(spec_path)],
                                stdout=f, stderr=subprocess.STDOUT, env=env)
        # in the suite's process group still: a timeout around the suite ends its workers too
        timer = threading.Timer(timeout_s, proc.kill) if timeout_s else None
        if timer is not None:
            timer.start()
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        if timer is not None:
            timer.cancel()
    wall = time.perf_counter() - t0
    if timeout_s and wall >= timeout_s and proc.returncode == -signal.SIGKILL:
        raise RuntimeError(f"{mode} ran past its {timeout_s:.0f} s and was killed; see {log}")
    if proc.returncode != 0:
        raise RuntimeError(f"{mode} failed with exit code {proc.returncode}; see {log}")
    result = json.loads(Path(spec["out"]).read_text())
    result["peak_rss_bytes"] = usage.ru_maxrss * 1024  # Linux: KiB
    result["wall_s"] = wall
    return result


def median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def train_pairs_per_s(result: dict, batch: int, skip: int = 1) -> float | None:
    if "step_s" not in result:  # the run failed (e.g. out of GPU memory): see the log
        return None
    steps = result["step_s"][skip:] or result["step_s"]
    return batch / statistics.median(steps)


def run_or_record(mode: str, spec: dict, scratch: Path, log: Path) -> dict:
    """``run_worker``, with a failed run (out of memory, say) recorded instead of ending the bench."""
    try:
        return run_worker(mode, spec, scratch, log)
    except RuntimeError as e:
        print(f"  {e}", flush=True)
        return {"failed": str(e)}


def bench_config(args, config_name: str, dtype: str, log: Path) -> dict:
    cfg = CONFIGS[config_name]
    pairs = args.pairs or cfg.pairs
    inputs = build_inputs(cfg, pairs)
    info = json.loads((inputs / "info.json").read_text())
    model, data = str(inputs / "model"), str(inputs / "data.jsonl")
    reps, scratch_dirs = [], {}
    for rep in range(args.reps):
        scratch = Path(tempfile.mkdtemp(prefix=f"bench-{config_name}-{dtype}-{rep}-", dir=args.scratch))
        scratch_dirs[str(scratch)] = f"<scratch-{rep}>"
        hf_cache = scratch / "hf-datasets"  # TRL's precompute cache: fresh per repetition, hit by its training run
        cache_dir = scratch / "dpocache"
        common = {"model": model, "data": data, "dtype": dtype, "batch_size": args.batch_size, "device": args.device}
        trl_env = {"env": {"HF_DATASETS_CACHE": str(hf_cache)},
                   "trl_precompute_batch_size": args.trl_precompute_batch_size,
                   "trl_gradient_checkpointing": args.trl_gradient_checkpointing,
                   "trl_ref_values": str(scratch / "trl-ref-values.json")}
        r: dict = {}
        order = ["trl", "dpo"] if rep % 2 == 0 else ["dpo", "trl"]
        for side in order:
            if args.startup_only:
                break
            if side == "trl" and not args.skip_trl:
                r["trl_precompute"] = run_or_record("trl-precompute", {**common, **trl_env,
                                                                    "workdir": str(scratch / "trl-pre")}, scratch, log)
            elif side == "dpo":
                r["dpo_build"] = run_worker("dpo-build", {**common, "cache_dir": str(cache_dir),
                                                          "extra_args": args.build_args}, scratch, log)
        if args.startup_only:
            # One cache for every repetition (built by the first): only the start-up is measured.
            cache_dir = inputs / "dpocache-cache"
            if rep == 0:
                r["dpo_build"] = run_worker("dpo-build", {**common, "cache_dir": str(cache_dir),
                                                          "extra_args": args.build_args}, scratch, log)
            if not args.skip_trl:
                r["trl_hash"] = run_worker("trl-hash", common, scratch, log)
        if args.train_steps > 0 and not args.startup_only:
            for side in order:
                if side == "trl" and not args.skip_trl:
                    r["trl_train"] = run_or_record("trl-train", {**common, **trl_env, "steps": args.train_steps,
                                                              "workdir": str(scratch / "trl-train")}, scratch, log)
                elif side == "dpo":
                    r["dpo_train"] = run_or_record("dpo-train", {**common, "cache_dir": str(cache_dir),
                                                              "steps": args.train_steps,
                                                              "workdir": str(scratch / "dpo-train"),
                                                              "extra_args": args.train_args}, scratch, log)
        if not args.no_startup:
            r["dpo_startup"] = run_worker("dpo-startup", {**common, "cache_dir": str(cache_dir),
                                                          "workdir": str(scratch / "dpo-startup"),
                                                          "extra_args": args.train_args}, scratch, log)
            r["dpo_build_hit"] = run_worker("dpo-build", {**common, "cache_dir": str(cache_dir),
                                                          "extra_args": args.build_args}, scratch, log)
        r["loadavg"] = os.getloadavg()
        reps.append(r)
        # Every finished repetition on disk at once: a run stopped later (a time limit) keeps them.
        (log.parent / f"{log.stem}-{dtype}-partial.json").write_text(portable(json.dumps(reps, default=str),
                                                                              scratch_dirs))
        print(f"  rep {rep + 1}/{args.reps} done (load average {r['loadavg'][0]:.1f})", flush=True)
        if not args.keep_scratch:
            shutil.rmtree(scratch, ignore_errors=True)
    return {"config": config_name, "dtype": dtype, "pairs": pairs, "inputs": info, "reps": reps,
            "scratch_dirs": scratch_dirs}


def portable(text: str, names: dict[str, str]) -> str:
    """``text`` with this machine's directories named by their role: the results are committed,
    and the temporary or home directories of the machine that ran them mean nothing elsewhere.
    ``names``: directory -> name (the repetitions' scratch directories); the repository's own
    directory becomes ``.``."""
    names = {**names, str(BENCH_DIR.parent): "."}
    for path in sorted(names, key=len, reverse=True):  # a scratch directory may lie inside the repository
        text = text.replace(path, names[path])
    return text


def summarise(res: dict, peaks: dict, batch: int) -> list[tuple[str, float | None, float | None, str]]:
    reps = res["reps"]
    get = lambda key, field: [r[key].get(field) for r in reps if key in r]  # noqa: E731
    rows = []
    tp_trl, tp_dpo = median(get("trl_precompute", "tokens_per_s")), median(get("dpo_build", "tokens_per_s"))
    rows.append(("cache tokens/s (prompt once)", tp_trl, tp_dpo, "x"))
    if tp_trl is not None:
        rows.append(("  TRL tokens/s (prompt twice, TRL's count)",
                     median(get("trl_precompute", "tokens_per_s_prompt_twice")), None, ""))
    rows.append(("cache peak RSS (MiB)", _mib(median(get("trl_precompute", "peak_rss_bytes"))),
                 _mib(median(get("dpo_build", "peak_rss_bytes"))), "x"))
    if any("peak_gpu_allocated_bytes" in r.get("dpo_build", {}) for r in reps):
        rows.append(("cache peak GPU memory allocated (MiB)",
                     _mib(median(get("trl_precompute", "peak_gpu_allocated_bytes"))),
                     _mib(median(get("dpo_build", "peak_gpu_allocated_bytes"))), "x"))
    if any("trl_train" in r or "dpo_train" in r for r in reps):
        rows.append(("train pairs/s",
                     median([train_pairs_per_s(r["trl_train"], batch) for r in reps if "trl_train" in r]),
                     median([train_pairs_per_s(r["dpo_train"], batch) for r in reps if "dpo_train" in r]), "x"))
        rows.append(("train peak RSS (MiB)", _mib(median(get("trl_train", "peak_rss_bytes"))),
                     _mib(median(get("dpo_train", "peak_rss_bytes"))), "x"))
        if any("peak_gpu_allocated_bytes" in r.get("dpo_train", {}) for r in reps):
            rows.append(("train peak GPU memory allocated (MiB)",
                         _mib(median(get("trl_train", "peak_gpu_allocated_bytes"))),
                         _mib(median(get("dpo_train", "peak_gpu_allocated_bytes"))), "x"))
        flops = res.get("flops") or {}
        if "train_per_pair" in flops:
            pps = {side: median([train_pairs_per_s(r[f"{side}_train"], batch) for r in reps if f"{side}_train" in r])
                   for side in ("trl", "dpo")}
            per_pair = flops["unique_tokens_per_pair"]
            rows.append(("train tokens/s (prompt once, mean tokens per pair x pairs/s)",
                         pps["trl"] and pps["trl"] * per_pair, pps["dpo"] and pps["dpo"] * per_pair, "x"))
            for pd, peak in peaks.items():
                if res["dtype"] not in pd:  # a training step's MFU against its own dtype's peak
                    continue
                for side, name in (("trl", "TRL"), ("dpo", "dpocache")):
                    if pps[side]:
                        rows.append((f"train-step MFU of {name} vs {pd} peak", None,
                                     pps[side] * flops["train_per_pair"] / peak, "%"))
        rows.append(("train start-up on cache hit, beyond model load (s)",
                     median(get("trl_train", "startup_beyond_load_s")),
                     median(get("dpo_train", "startup_beyond_load_s")), "x"))
    rows.append(("dpocache start-up to first step, beyond model load (s)", None,
                 median(get("dpo_startup", "startup_beyond_load_s")), ""))
    rows.append(("  of which interpreter start and imports (s)", None, median(get("dpo_startup", "imports_s")), ""))
    rows.append(("  beyond model load and imports (s)", None,
                 median(get("dpo_startup", "startup_beyond_load_and_imports_s")), ""))
    rows.append(("dpocache model load (s)", None, median(get("dpo_startup", "model_load_s")), ""))
    rows.append(("`dpocache cache build` on a complete cache, whole command (s)", None,
                 median(get("dpo_build_hit", "wall_s")), ""))
    if any("trl_precompute" in r or "trl_hash" in r for r in reps):
        rows.append(("TRL state-dict hash on each start (s)",
                     median(get("trl_precompute", "hash_module_s") + get("trl_hash", "hash_module_s")), None, ""))
    flops = res.get("flops")
    if flops and tp_dpo:
        secs = median(get("dpo_build", "compute_s"))
        pass_peaks = {pd: peak for pd, peak in peaks.items() if pass_peak_applies(pd, res)}
        for kind in ("convention", "executed"):
            achieved = flops[kind] / secs
            for pd, peak in pass_peaks.items():
                rows.append((f"cache-pass MFU vs {pd} peak ({kind} FLOPs)", None, achieved / peak, "%"))
        tp_trl_secs = median(get("trl_precompute", "precompute_s"))
        if tp_trl_secs:
            for pd, peak in pass_peaks.items():
                rows.append((f"TRL precompute MFU vs {pd} peak (convention FLOPs)", None,
                             flops["convention"] / tp_trl_secs / peak, "%"))
    return rows


def pass_peak_applies(peak_name: str, res: dict) -> bool:
    """Whether a reference pass's MFU is read against the peak ``peak_name``: its own dtype's,
    and on a CPU the fp32 GEMM's as well, since bf16 runs there go through it
    (``dpocache.scoring.bf16_matmul``); a GPU's bf16 pass against its fp32 peak means nothing."""
    return res["dtype"] in peak_name or res.get("args", {}).get("device", "cpu") == "cpu"


def _mib(x):
    return None if x is None else x / 2**20


def format_table(title: str, rows) -> str:
    """The markdown table of ``summarise``'s rows."""
    lines = [f"### {title}", "", "| metric | TRL 1.16 | dpocache | ratio |", "| --- | ---: | ---: | ---: |"]
    for name, trl, dpo, kind in rows:
        if kind == "%":
            lines.append(f"| {name} | | {100 * dpo:.1f}% | |")
            continue
        f = lambda v: "" if v is None else (f"{v:,.0f}" if v >= 100 else f"{v:.2f}")  # noqa: E731
        ratio = f"{dpo / trl:.2f}x" if kind == "x" and trl and dpo else ""
        lines.append(f"| {name} | {f(trl)} | {f(dpo)} | {ratio} |")
    return "\n".join(lines)


# What makes two results repetitions of one run: anything else differing (the time, the peaks
# measured around it) is the machine's, not the run's.
SAME_RUN_FIELDS = ("config", "dtype", "pairs")  # and the flags below (--startup-only among them)
SAME_RUN_ARGS = ("batch_size", "train_steps", "trl_precompute_batch_size", "trl_gradient_checkpointing", "skip_trl",
                 "startup_only", "no_startup", "device", "build_args", "train_args")


def merge_results(paths: list[Path]) -> dict:
    """One result over the repetitions of several results of the same run: a GPU machine lent for
    10 minutes a call runs one or two of the 1b-2048 repetitions per call (about 200 s each).
    The peaks are each the highest measured; ``merged_from`` names the files. Raises
    ``ValueError`` naming a file that cannot be read, or the first field in which a result differs
    from the first."""
    results = read_results(paths)
    first = results[0]
    for path, res in zip(paths[1:], results[1:]):
        for field in SAME_RUN_FIELDS:
            if res.get(field) != first.get(field):
                raise ValueError(f"{path}: {field} {res.get(field)!r}, not {first.get(field)!r} as in {paths[0]}")
        for field in SAME_RUN_ARGS:
            if res["args"].get(field) != first["args"].get(field):
                raise ValueError(f"{path}: --{field.replace('_', '-')} {res['args'].get(field)!r}, "
                                 f"not {first['args'].get(field)!r} as in {paths[0]}")
    merged = dict(first)
    merged["reps"] = [rep for res in results for rep in res["reps"]]
    names = list(dict.fromkeys(name for res in results for name in res["peaks"]))
    merged["peaks"] = {name: max(res["peaks"][name] for res in results if name in res["peaks"]) for name in names}
    merged["merged_from"] = [p.name for p in paths]
    merged["table"] = summarise(merged, merged["peaks"], merged["args"]["batch_size"])
    merged["markdown"] = format_table(table_title(merged), merged["table"])
    return merged


def table_title(res: dict) -> str:
    return (f"{res['config']}, {res['dtype']}, {res['pairs']} pairs, batch {res['args']['batch_size']}, "
            f"medians of {len(res['reps'])} "
            f"(load average {statistics.median(r['loadavg'][0] for r in res['reps']):.1f})")


def table_markdown(res: dict) -> str:
    return format_table(table_title(res), summarise(res, res["peaks"], res["args"]["batch_size"]))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="58m", choices=sorted(CONFIGS))
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"], nargs="+")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--pairs", type=int, default=None, help="pairs in the data set (default: the configuration's)")
    p.add_argument("--batch-size", type=int, default=8, help="training batch (pairs), both sides; TRL's default")
    p.add_argument("--train-steps", type=int, default=4,
                   help="training steps per run (the first is not timed); 0 skips training")
    p.add_argument("--trl-precompute-batch-size", type=int, default=None,
                   help="TRL's precompute_ref_batch_size (default: TRL's, the training batch size)")
    p.add_argument("--trl-gradient-checkpointing", action="store_true",
                   help="TRL's own default; off by default here, as dpocache's, so both train the same way")
    p.add_argument("--skip-trl", action="store_true", help="dpocache only (no TRL runs)")
    p.add_argument("--startup-only", action="store_true", help="only the cache build and the cache-hit start-up")
    p.add_argument("--no-startup", action="store_true", help="skip the cache-hit start-up runs")
    p.add_argument("--device", default="cpu", help="cpu or cuda (both sides)")
    p.add_argument("--build-args", nargs=argparse.REMAINDER, default=[],
                   help="extra `dpocache cache build` flags (last)")
    p.add_argument("--train-args", default="", help="extra `dpocache train` flags, one string")
    p.add_argument("--scratch", default=None, help="where per-run directories go (default: the system temp dir)")
    p.add_argument("--keep-scratch", action="store_true")
    p.add_argument("--out", default=str(BENCH_DIR / "results"))
    p.add_argument("--summarise", nargs="+", metavar="JSON", help="only re-print the tables of earlier results")
    p.add_argument("--merge", nargs="+", metavar="JSON",
                   help="one table over the repetitions of several results of the same run (written to --out)")
    args = p.parse_args(argv)
    if args.merge:
        try:
            res = merge_results([Path(x) for x in args.merge])
        except ValueError as e:
            print(f"--merge: {e}", file=sys.stderr)
            return 2
        print(res["markdown"], flush=True)
        Path(args.out).mkdir(parents=True, exist_ok=True)
        path = Path(args.out) / f"{res['config']}-{res['dtype']}-{time.strftime('%Y%m%d-%H%M%S')}-merged.json"
        path.write_text(json.dumps(res, indent=1, default=str))
        print(f"wrote {path}", flush=True)
        return 0
    if args.summarise:
        for path in args.summarise:
            print(table_markdown(json.loads(Path(path).read_text())), flush=True)
            print()
        return 0
    args.train_args = args.train_args.split()
    dtypes = args.dtype if isinstance(args.dtype, list) else [args.dtype]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    log = out / f"{args.config}-{stamp}.log"
    print(f"measuring the matmul peak (log: {log})", flush=True)
    peaks = {d: measure_peak(d, args.device) for d in ("bfloat16", "float32")}
    print("  " + ", ".join(f"{d}: {v / 1e9:.0f} GFLOP/s" for d, v in peaks.items()), flush=True)
    tables = []
    for dtype in dtypes:
        print(f"{args.config} {dtype}: {args.reps} repetitions", flush=True)
        res = bench_config(args, args.config, dtype, log)
        inputs = build_inputs(CONFIGS[args.config], res["pairs"])
        res["flops"] = None if args.startup_only else flops_of_build(inputs, res["inputs"])
        res["startup_only"] = args.startup_only
        peaks_after = ({d: measure_peak(d, args.device) for d in ("bfloat16", "float32")}
                       if not args.startup_only else peaks)
        res["peaks"] = {f"measured {d}": max(peaks[d], peaks_after[d]) for d in peaks}
        res["peaks"].update(nominal_peaks(args.device))
        res["args"] = vars(args)
        rows = summarise(res, res["peaks"], args.batch_size)
        res["table"] = rows
        res["markdown"] = format_table(table_title(res), rows)
        print(res["markdown"], flush=True)
        tables.append(res["markdown"])
        path = out / f"{args.config}-{dtype}-{stamp}.json"
        scratch_dirs = res.pop("scratch_dirs")
        path.write_text(portable(json.dumps(res, indent=1, default=str), scratch_dirs))
        print(f"wrote {path}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
