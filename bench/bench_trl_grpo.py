"""TRL 1.16's ``GRPOTrainer`` against ``CachedGRPOTrainer``: reference time per GRPO step and the
trainer process's peak memory, side by side in one run.

Same model (the 58M Llama of bench/common.py, its ``long-prompt`` prompts: 83-243 tokens, mean
166), same seed, completions of exactly ``--completion-tokens`` (40: prompts about 4x the
completions), one prompt and its G completions per step, ``beta`` 0.04. Two kinds of run, each
its own process:

- ``paired`` (time): ``CachedGRPOTrainer`` training, and in every step TRL's own reference pass
  on the same batch, back to back, in alternating order: ``GRPOTrainer._get_per_token_logps_and_entropies``
  on a reference built as ``GRPOTrainer`` builds it (``create_model_from_path`` in the policy's
  dtype, dropout off, TRL's fused head at the trainer's temperature, ``accelerator.prepare_model``),
  against the service's answer laid out as TRL's tensor. Both see the same batch and the same
  load; the largest difference of their values is recorded. The first step is left out (warm-up).
- memory: one process per trainer, peak RSS of the trainer's process (``RUSAGE_SELF``: a Ray
  replica's own memory is not in it): ``trl`` (``GRPOTrainer``, its reference model in the
  process), ``dpocache`` (``CachedGRPOTrainer``, ``reference=None``: the same weights, in process,
  through ``ReferenceService``), ``pool`` (``CachedGRPOTrainer`` with a ``ReferencePool`` of one
  Ray replica in another process: the trainer's process holds no reference weights). Each also
  records its own reference time per step.

Medians over repetitions (and timed steps); prints a table and ratios (TRL over dpocache for
time, dpocache over TRL for memory), writes the JSON; the last line is the reference speed-up at
G=8 (the first ``--dtype``). ``--threads`` defaults to 1: on a shared 2-core machine two OpenMP
threads spin-wait for a core another process holds, and a pass of many small kernels collapses
(measured: dpocache's pass 4.4 s with 2 threads against 0.47 s with 1, TRL's 4.8 against 2.8).

    python bench/bench_trl_grpo.py --quick                 # float32, G=8, 1 repetition: under 5 min on 2 cores
    python bench/bench_trl_grpo.py --reps 3 --out bench/results/trl-grpo-cpu-2core-20261125.json
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import BENCH_DIR, CONFIGS, build_inputs  # noqa: E402

SIDES = ("trl", "dpocache", "pool")  # the memory runs; "paired" is the time run
CONFIG = "long-prompt"  # the 58M Llama; prompts 4x the completions


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"])
    p.add_argument("--groups", nargs="+", type=int, default=[8, 16], help="G values (completions per prompt)")
    p.add_argument("--sides", nargs="*", default=list(SIDES), choices=SIDES, help="memory runs")
    p.add_argument("--reps", type=int, default=3, help="repetitions of the paired (time) run")
    p.add_argument("--memory-reps", type=int, default=2, help="repetitions of each memory run")
    p.add_argument("--steps", type=int, default=3, help="GRPO steps of a paired run, the first not timed")
    p.add_argument("--memory-steps", type=int, default=2, help="GRPO steps of a memory run")
    p.add_argument("--completion-tokens", type=int, default=40)
    p.add_argument("--threads", type=int, default=1, help="torch threads of the trainer (and of a Ray replica)")
    p.add_argument("--quick", action="store_true", help="float32, G=8, 1 repetition; memory: trl and pool")
    p.add_argument("--out", type=Path, default=None, help="default: bench/results/trl-grpo-<time>.json")
    p.add_argument("--worker", type=Path, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.quick:
        args.dtype, args.groups, args.reps, args.memory_reps, args.sides = ["float32"], [8], 1, 1, ["trl", "pool"]
    return args


# ------------------------------------------------------------------------------ the worker


def _timed(base):
    """``base`` whose reference pass (``_get_per_token_logps_and_entropies`` of ``ref_model``) is
    timed; with ``trl_reference`` set (the paired run), TRL's own pass on that model runs on the
    same batch too, before or after (alternating), timed, and the two answers compared."""

    class Timed(base):
        reference_seconds: list = []
        trl_seconds: list = []
        max_abs_diff: list = []
        trl_reference = None

        def _get_per_token_logps_and_entropies(self, model, *args, **kwargs):
            if model is not self.ref_model:
                return super()._get_per_token_logps_and_entropies(model, *args, **kwargs)
            if self.trl_reference is None:
                return self._timed_pass(model, self.reference_seconds, args, kwargs)
            passes = [(model, self.reference_seconds), (self.trl_reference, self.trl_seconds)]
            if len(self.reference_seconds) % 2:
                passes.reverse()
            outs = {id(m): self._timed_pass(m, times, args, kwargs) for m, times in passes}
            ours, theirs = outs[id(model)], outs[id(self.trl_reference)]
            self.max_abs_diff.append(float((ours[0] - theirs[0]).abs().max()))
            return ours

        def _timed_pass(self, model, times, args, kwargs):
            start = time.perf_counter()
            out = super()._get_per_token_logps_and_entropies(model, *args, **kwargs)
            times.append(time.perf_counter() - start)
            return out

    return Timed


def trl_reference(trainer):
    """The reference model as ``GRPOTrainer.__init__`` builds it for ``trainer``'s policy."""
    from trl.trainer.utils import (
        add_fused_lm_head,
        create_model_from_path,
        disable_dropout_in_model,
        get_config_model_id,
    )

    policy = trainer.model
    ref = create_model_from_path(get_config_model_id(policy.config), dtype=policy.dtype, trust_remote_code=False,
                                 attn_implementation=policy.config._attn_implementation)
    disable_dropout_in_model(ref)
    add_fused_lm_head(ref, temperature=trainer.temperature, cast_lm_head_to_fp32=trainer.args.cast_lm_head_to_fp32)
    return trainer.accelerator.prepare_model(ref, evaluation_mode=True)


def _pool(spec: dict, model_dir: Path):
    import ray

    from dpocache.service import ReferencePool

    threads = str(spec["threads"])
    ray.init(num_cpus=spec["threads"], include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads}})
    return ReferencePool(model_dir, num_replicas=1, dtype=spec["dtype"], device="cpu", temperature=1.0)


def rss_bytes() -> int:
    """The process's resident set size now (Linux)."""
    status = Path("/proc/self/status").read_text()
    return int(status.split("VmRSS:")[1].split()[0]) * 1024


def worker(spec: dict) -> dict:
    """One trainer, ``spec["steps"]`` GRPO steps; its reference times, step times, peak RSS, and
    RSS after the imports, after the reference pool's start and after the trainer's construction."""
    import torch

    torch.set_num_threads(spec["threads"])
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from dpocache.integrations.trl_grpo import CachedGRPOTrainer

    model_dir, g, c = Path(spec["model"]), spec["group"], spec["completion_tokens"]
    prompts = [json.loads(line)["prompt"] for line in open(spec["data"])]
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    args = GRPOConfig(output_dir=spec["scratch"], per_device_train_batch_size=g, num_generations=g,
                      max_completion_length=c, generation_kwargs={"min_new_tokens": c}, max_steps=spec["steps"],
                      beta=0.04, learning_rate=1e-6, logging_steps=1, report_to=[], use_cpu=True,
                      bf16=spec["dtype"] == "bfloat16", seed=0, save_strategy="no", disable_tqdm=True)
    rss = {"imports": rss_bytes()}
    extra = {"reference": _pool(spec, model_dir)} if spec["side"] == "pool" else {}
    rss["pool"] = rss_bytes()
    steps: list[float] = []

    class StepTimes(TrainerCallback):
        def on_step_begin(self, *a, **k):
            steps.append(-time.perf_counter())

        def on_step_end(self, *a, **k):
            steps[-1] += time.perf_counter()

    cls = _timed(GRPOTrainer if spec["side"] == "trl" else CachedGRPOTrainer)
    trainer = cls(model=AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
                  reward_funcs=lambda completions, **_: [float(len(x)) for x in completions], args=args,
                  train_dataset=Dataset.from_list([{"prompt": p} for p in prompts]), processing_class=tokenizer,
                  callbacks=[StepTimes()], **extra)
    rss["trainer"] = rss_bytes()
    if spec["side"] == "paired":
        cls.trl_reference = trl_reference(trainer)
    trainer.train()
    logs = [r for r in trainer.state.log_history if "kl" in r]
    return {"reference_s": cls.reference_seconds, "trl_reference_s": cls.trl_seconds,
            "max_abs_diff": cls.max_abs_diff, "step_s": steps, "kl": [r["kl"] for r in logs],
            "loss": [r["loss"] for r in logs], "completion_tokens": [r["completions/mean_length"] for r in logs],
            "rss_bytes": rss, "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}  # KiB


# ------------------------------------------------------------------------------ the driver


def run_worker(spec: dict, scratch: Path, log: Path) -> dict:
    """One worker process; a failure is recorded (with its log) rather than ending the bench."""
    spec_path = scratch / "spec.json"
    spec = {**spec, "scratch": str(scratch / "run")}
    spec_path.write_text(json.dumps(spec))
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1", TQDM_DISABLE="1",
               OMP_NUM_THREADS=str(spec["threads"]), TRANSFORMERS_VERBOSITY="error")
    start = time.perf_counter()
    with open(log, "a") as f:
        f.write(f"\n=== {json.dumps(spec)}\n")
        f.flush()
        done = subprocess.run([sys.executable, __file__, "--worker", str(spec_path)], stdout=f,
                              stderr=subprocess.STDOUT, env=env)
    if done.returncode != 0:
        return {"failed": f"exit code {done.returncode}; see {log}"}
    return {**json.loads((scratch / "result.json").read_text()), "wall_s": time.perf_counter() - start}


def median(xs: list) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def _timed_steps(runs: list[dict], key: str) -> list[float]:
    return [t for r in runs for t in r[key][1:]]  # the first step of each run is its warm-up


def summarise(runs: list[dict], weights_bytes: int) -> dict:
    """Per (dtype, G): the paired run's reference times per step (TRL's and dpocache's, medians
    over timed steps of every repetition) and their ratio; each memory run's median peak RSS,
    its own reference and step times, and its memory against TRL's."""
    summary = {}
    for dtype, group in sorted({(r["dtype"], r["group"]) for r in runs}):
        mine = [r for r in runs if (r["dtype"], r["group"]) == (dtype, group) and "failed" not in r]
        row: dict = {}
        paired = [r for r in mine if r["side"] == "paired"]
        if paired:
            trl, ours = _timed_steps(paired, "trl_reference_s"), _timed_steps(paired, "reference_s")
            row["time"] = {"trl_reference_s": median(trl), "dpocache_reference_s": median(ours),
                           "reference_speedup": median(trl) / median(ours), "timed_steps": len(ours),
                           "step_s": median(_timed_steps(paired, "step_s")),
                           "max_abs_diff": max(d for r in paired for d in r["max_abs_diff"])}
        for side in SIDES:
            some = [r for r in mine if r["side"] == side]
            if some:
                row[side] = {"peak_rss_mib": median([r["peak_rss_bytes"] for r in some]) / 2**20, "runs": len(some),
                             "reference_s": median(_timed_steps(some, "reference_s")),
                             "step_s": median(_timed_steps(some, "step_s"))}
        for side in ("dpocache", "pool"):
            if "trl" in row and side in row:
                saved = (row["trl"]["peak_rss_mib"] - row[side]["peak_rss_mib"]) * 2**20
                row[side].update(peak_rss_ratio=row[side]["peak_rss_mib"] / row["trl"]["peak_rss_mib"],
                                 peak_rss_saved_mib=saved / 2**20, peak_rss_saved_weight_copies=saved / weights_bytes)
        summary[f"{dtype} G={group}"] = row
    return summary


def print_table(summary: dict, weights_bytes: int) -> None:
    print("\nreference time per GRPO step, the same batches back to back (medians, seconds)")
    print(f"{'run':<16}{'TRL':>9}{'dpocache':>10}{'speed-up':>10}{'step s':>8}{'max |diff|':>12}")
    for name, row in summary.items():
        if "time" in row:
            t = row["time"]
            print(f"{name:<16}{t['trl_reference_s']:>9.3f}{t['dpocache_reference_s']:>10.3f}"
                  f"{t['reference_speedup']:>9.2f}x{t['step_s']:>8.2f}{t['max_abs_diff']:>12.2e}")
    print(f"\npeak RSS of the trainer's process (medians; one copy of the fp32 weights = "
          f"{weights_bytes / 2**20:.0f} MiB), and each run's own reference time per step")
    print(f"{'run':<16}{'side':<10}{'peak MiB':>10}{'vs TRL':>8}{'saved MiB (copies)':>20}{'ref s/step':>12}")
    for name, row in summary.items():
        for side in SIDES:
            if side in row:
                r = row[side]
                ratio = f"{r['peak_rss_ratio']:.2f}x" if "peak_rss_ratio" in r else ""
                saved = f"{r['peak_rss_saved_mib']:.0f} ({r['peak_rss_saved_weight_copies']:.2f})" \
                    if "peak_rss_saved_mib" in r else ""
                print(f"{name:<16}{side:<10}{r['peak_rss_mib']:>10.0f}{ratio:>8}{saved:>20}{r['reference_s']:>12.3f}")


def _shown(result: dict) -> str:
    if "failed" in result:
        return result["failed"]
    trl = f"TRL {median(result['trl_reference_s'][1:]):.3f} s, " if result["trl_reference_s"] else ""
    return (f"reference {trl}dpocache/own {median(result['reference_s'][1:]):.3f} s per step, peak RSS "
            f"{result['peak_rss_bytes'] / 2**20:.0f} MiB, {result['wall_s']:.0f} s")


def main() -> None:
    args = parse_args()
    if args.worker is not None:
        spec = json.loads(args.worker.read_text())
        result = worker(spec)
        (args.worker.parent / "result.json").write_text(json.dumps(result))
        return
    started, load = time.perf_counter(), os.getloadavg()  # the machine's load: a shared one is noisy
    cfg = CONFIGS[CONFIG]
    inputs = build_inputs(cfg, cfg.pairs)
    info = json.loads((inputs / "info.json").read_text())
    weights_bytes = info["parameters"] * 4
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out = args.out or BENCH_DIR / "results" / f"trl-grpo-{stamp}.json"
    log = Path(tempfile.gettempdir()) / f"bench-trl-grpo-{stamp}.log"
    runs = []
    for rep in range(max(args.reps, args.memory_reps)):
        for dtype in args.dtype:
            for group in args.groups:
                turn = rep % max(1, len(args.sides))
                memory = args.sides[turn:] + args.sides[:turn] if rep < args.memory_reps else []  # rotated
                for side in (["paired"] if rep < args.reps else []) + memory:
                    spec = {"side": side, "dtype": dtype, "group": group, "threads": args.threads,
                            "steps": args.steps if side == "paired" else args.memory_steps,
                            "completion_tokens": args.completion_tokens, "model": str(inputs / "model"),
                            "data": str(inputs / "data.jsonl"), "rep": rep}
                    with tempfile.TemporaryDirectory(prefix="bench-trl-grpo-") as scratch:
                        result = run_worker(spec, Path(scratch), log)
                    # the inputs named from the repository's root: no machine path in a result
                    root = Path(__file__).resolve().parents[1]
                    where = {k: os.path.relpath(spec[k], root) for k in ("model", "data")}
                    runs.append({**spec, **result, **where})
                    print(f"rep {rep} {dtype} G={group} {side}: {_shown(result)}", flush=True)
    summary = summarise(runs, weights_bytes)
    meta = {"command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]), "config": CONFIG,
            "parameters": info["parameters"], "weights_fp32_bytes": weights_bytes, "threads": args.threads,
            "cpus": os.cpu_count(), "steps": args.steps, "reps": args.reps, "memory_steps": args.memory_steps,
            "memory_reps": args.memory_reps,
            "completion_tokens": args.completion_tokens, "seconds": time.perf_counter() - started,
            "load_average_at_start": load, "load_average_at_end": os.getloadavg()}
    out.write_text(json.dumps({"meta": meta, "summary": summary, "runs": runs}, indent=1))
    print_table(summary, weights_bytes)
    print(f"wrote {out} (worker log: {log})")
    speedup = summary.get(f"{args.dtype[0]} G=8", {}).get("time", {}).get("reference_speedup")
    print(f"reference speed-up at G=8: {speedup:.2f}x" if speedup else "reference speed-up at G=8: n/a")


if __name__ == "__main__":
    main()
