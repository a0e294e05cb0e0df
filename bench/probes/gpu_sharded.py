"""The sharded reference pass on a CUDA GPU: each process's peak GPU memory and the values,
``cache build --fsdp`` against the unsharded build.

    python bench/probes/gpu_sharded.py [--config 1b-2048] [--pairs 64] [--reps 3] [--max-tokens 32768]

Three builds of the same cache, each in fresh processes, ``--reps`` times (medians reported):

- ``one``: the unsharded build in one process (``python -m dpocache cache build``);
- ``two``: the unsharded build in two processes (each loads the whole reference and scores its
  token-balanced share): the same batches as the sharded build, so its values and activations
  are the like-for-like comparison;
- ``two-fsdp``: ``cache build --fsdp`` in two processes, the reference's weights sharded over
  them with FSDP2 (``dpocache.distributed.sharded_reference``).

With one GPU both processes share it, each with its own caching allocator, so each one's
``torch.cuda.max_memory_allocated`` is its own peak. NCCL refuses two ranks on one device, so
the two processes join a gloo group before dpocache starts (``--backend``): FSDP2's
all-gathers of CUDA tensors then go through the host, so tokens/s of the two-process builds
measure the transport, not the sharded pass (on several GPUs dpocache uses NCCL). Memory and
values do not depend on the transport.

Values: the chosen and rejected sums of every pair are compared with the ``one`` and ``two``
builds (largest absolute difference, and whether they are bit-identical). Results go to
``bench/results/gpu-sharded-<config>-<time>.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(BENCH), str(BENCH.parent)]  # bench/common.py, and dpocache in a checkout not installed

from common import BENCH_DIR, CONFIGS, build_inputs, write_results  # noqa: E402


def worker(backend: str, report: Path, argv: list[str]) -> None:
    """One rank of a two-process build on one GPU: joins ``backend``'s group on ``cuda:0``
    before dpocache does (it then uses this group), runs the command, writes its own peaks."""
    import torch
    import torch.distributed as dist

    from dpocache.cli.entry import main
    from dpocache.distributed.process_group import release_group_references

    cuda = torch.cuda.is_available()
    os.environ["LOCAL_RANK"] = "0"  # every rank on the one GPU (dpocache puts rank r on cuda:LOCAL_RANK)
    if cuda:
        torch.cuda.set_device(0)
    kwargs = {"device_id": torch.device("cuda", 0)} if backend == "nccl" else {}
    dist.init_process_group(backend=backend, **kwargs)
    code = main(argv)
    peaks = ({"allocated": torch.cuda.max_memory_allocated(), "reserved": torch.cuda.max_memory_reserved()} if cuda
             else {})
    (report / f"rank-{dist.get_rank()}.json").write_text(json.dumps(peaks))
    release_group_references()  # the group is this worker's, so dpocache's destroy leaves it to us
    dist.destroy_process_group()
    raise SystemExit(code)


def _build(argv: list[str], nproc: int, backend: str, report: Path) -> dict:
    """One build in fresh processes: the summary line of rank 0 and each rank's GPU peaks."""
    shutil.rmtree(report, ignore_errors=True)
    report.mkdir(parents=True)
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1")
    if nproc == 1:
        cmd = [sys.executable, "-m", "dpocache", *argv]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-port", "29533",
               str(Path(__file__).resolve()), "--worker", backend, "--report", str(report), "--", *argv]
    started = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - started
    if proc.returncode:
        raise RuntimeError(f"{' '.join(cmd)}\n{proc.stdout[-2000:]}\n{proc.stderr[-6000:]}")
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    ranks = [json.loads(p.read_text()) for p in sorted(report.glob("rank-*.json"))]
    return {"summary": summary, "ranks": ranks, "wall_s": wall}


def _pair_keys(model: Path, data: Path, max_length: int) -> list[bytes]:
    from dpocache.cli.cache import load_tokenizer
    from dpocache.data.pairs import load_preference_data

    pairs = load_preference_data(str(data), load_tokenizer(model), max_length=max_length, show_progress=False).pairs
    return [p.key for p in pairs]


def _values(cache: Path, model: Path, keys: list[bytes]):
    """``(2P,)`` the chosen then the rejected sums of ``keys`` in the bf16 cache under ``cache``."""
    import torch

    from dpocache.cache import CacheStore, namespace_for_dir

    got = CacheStore(cache, namespace_for_dir(model, torch.bfloat16, cache)).open().lookup(keys)
    return torch.cat([got.chosen_logps, got.rejected_logps])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", choices=list(CONFIGS), default="1b-2048")
    p.add_argument("--pairs", type=int, default=64)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=32768)
    p.add_argument("--max-length", type=int, default=2048)
    p.add_argument("--device", default="cuda", help="cpu: a smoke test of this script (--config 58m)")
    p.add_argument("--backend", default="gloo", help="the two-process builds' group (nccl needs a GPU per rank)")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--report", type=Path, help=argparse.SUPPRESS)
    p.add_argument("rest", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args.worker, args.report, [a for a in args.rest if a != "--"])

    import torch

    inputs = build_inputs(CONFIGS[args.config], args.pairs)
    info = json.loads((inputs / "info.json").read_text())
    model, data = inputs / "model", inputs / "data.jsonl"
    work = BENCH_DIR / "work" / f"gpu-sharded-{args.config}"
    common = ["cache", "build", "--model", str(model), "--data", str(data), "--dtype", "bfloat16",
              "--device", args.device, "--max-length", str(args.max_length), "--max-tokens", str(args.max_tokens),
              "--compile", "off", "--json"]
    builds = {"one": (1, []), "two": (2, []), "two-fsdp": (2, ["--fsdp"])}
    runs: dict[str, list] = {name: [] for name in builds}
    for rep in range(args.reps):
        for name, (nproc, extra) in builds.items():
            cache = work / f"cache-{name}"
            shutil.rmtree(cache, ignore_errors=True)
            runs[name].append(_build([*common, "--cache-dir", str(cache), *extra], nproc, args.backend,
                                     work / f"report-{name}"))
            r = runs[name][-1]
            gib = [round(x["allocated"] / 2**30, 2) for x in r["ranks"] if x]
            print(f"rep {rep + 1} {name}: peak allocated per rank (GiB) "
                  f"{gib or r['summary']['peak_memory_bytes'] / 2**30}"
                  f", {r['summary']['tokens_per_s']:,.0f} tokens/s, layout {r['summary']['layout']}", flush=True)

    def peak(r: dict) -> int:  # the largest rank's peak (one process: the summary's own figure)
        ranks = [x["allocated"] for x in r["ranks"] if x]
        return max(ranks) if ranks else r["summary"]["peak_memory_bytes"]

    med = {name: statistics.median(peak(r) for r in rs) for name, rs in runs.items()}
    keys = _pair_keys(model, data, args.max_length)
    one, two, fsdp = (_values(work / f"cache-{n}", model, keys) for n in builds)
    summary = {
        "config": args.config, "parameters": info["parameters"], "pairs": args.pairs, "reps": args.reps,
        "max_tokens": args.max_tokens, "backend": args.backend,
        "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "torch": torch.__version__,
        "peak_allocated_per_process": med,
        "fsdp_over_one": med["two-fsdp"] / med["one"], "fsdp_over_two": med["two-fsdp"] / med["two"],
        "tokens_per_s": {n: statistics.median(r["summary"]["tokens_per_s"] for r in rs) for n, rs in runs.items()},
        "values": {
            "fsdp_vs_two_max_abs": float((fsdp - two).abs().max()),
            "fsdp_vs_two_identical": bool(torch.equal(fsdp, two)),
            "fsdp_vs_one_max_abs": float((fsdp - one).abs().max()),
            "fsdp_vs_one_identical": bool(torch.equal(fsdp, one)),
            "sequences": int(one.numel()),
        },
    }
    write_results(f"gpu-sharded-{args.config}", summary, runs)


if __name__ == "__main__":
    main()
