"""Distributed cache build and training: ``torchrun`` with 2 CPU processes on gloo, compared
with one process doing the same work.

Each ``torchrun`` start costs seconds (two interpreters import torch and transformers), so the
runs are module fixtures shared by the tests, and single-process baselines run in this process.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import dpocache
from dpocache.cache.build import split_by_tokens
from dpocache.data.rows import write_jsonl
from dpocache.models.tiny import save_tiny_model
from dpocache.scoring.layout_choice import CAUSAL
from dpocache.training.demo import sorting_pairs
from dpocache.training.metrics import read_metrics

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
                       reason="needs torch.distributed with gloo"),
]

TOL = 1e-5
SHARED_RAN = {"requested": "auto", "used": "shared", "attention": "sdpa", "reason": None}  # the reference pass
PACKED_RAN = {**SHARED_RAN, "used": "packed"}  # training's auto


# ------------------------------------------------------------------------------ helpers


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(*args: str, nproc: int = 2, timeout: float = 300,
             script: Path | None = None, check: bool = True) -> subprocess.CompletedProcess:
    """``python -m torch.distributed.run --nproc-per-node N -m dpocache ARGS`` on CPU/gloo
    (``script``: a driver of ``dpocache ARGS`` instead of ``-m dpocache``), expected to
    succeed unless ``check`` is false."""
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1",
               CUDA_VISIBLE_DEVICES="")
    entry = [str(script)] if script is not None else ["-m", "dpocache"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
           "--master-addr", "127.0.0.1", "--master-port", str(_free_port()), *entry, *args]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0 or not check, (f"{' '.join(cmd)}\nexit {proc.returncode}\n"
                                  f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return proc


def in_process(*args: str) -> int:
    from dpocache.cli.entry import main

    return main(list(args))


def train_args(a: dict, out: Path, batch: int, model: Path | None = None, *extra: str) -> list[str]:
    return ["--model", str(model or a["model"]), "--ref-model", str(a["ref"]), "--data", str(a["train"]),
            "--eval-data", str(a["eval"]), "--cache-dir", str(a["cache"]), "--dtype", "float32", "--device", "cpu",
            "--max-length", "64", "--max-steps", "4", "--save-steps", "2", "--train.save_total_limit", "5",
            "--logging-steps", "1", "--lr", "1e-3", "--optim.warmup_ratio", "0", "--train.progress", "false",
            "--batch-size", str(batch), "--output-dir", str(out), *extra]


def train_in_process(args: list[str]) -> dict:
    from dpocache.config import build_config
    from dpocache.training.loop import train

    return train(build_config(None, args))


def losses(run_dir: Path) -> dict[int, dict]:
    """``{step: record}`` of the training records (not eval) in metrics.jsonl."""
    return {r["step"]: r for r in read_metrics(run_dir) if "loss" in r}


def evals(run_dir: Path) -> list[dict]:
    return [r for r in read_metrics(run_dir) if "eval/loss" in r]


def assert_close_records(got: dict, want: dict, keys=("loss", "grad_norm", "rewards/margins", "rewards/accuracies",
                                                        "logps/chosen")) -> None:
    for k in keys:
        assert abs(got[k] - want[k]) <= TOL * max(1.0, abs(want[k])), (k, got[k], want[k])


def truncate_to(src: Path, dst: Path, step: int) -> Path:
    """A copy of run ``src`` as if it had been killed right after checkpoint ``step``."""
    shutil.copytree(src, dst)
    shutil.rmtree(dst / "final", ignore_errors=True)
    for ckpt in (dst / "checkpoints").glob("step-*"):
        if int(ckpt.name.split("-")[1]) > step:
            shutil.rmtree(ckpt)
    return dst


# ------------------------------------------------------------------------------ fixtures


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("dist")
    return {
        "root": root,
        "model": save_tiny_model(root / "policy", "llama", seed=0),
        # A reference with other weights: the first step's loss is not log 2, so it tests something.
        "ref": save_tiny_model(root / "ref", "llama", seed=1),
        "tied": save_tiny_model(root / "tied", "llama", seed=0, tie_word_embeddings=True),
        "pairs37": write_jsonl(sorting_pairs(37, 11), root / "pairs37.jsonl"),
        "train": write_jsonl(sorting_pairs(64, 12), root / "train.jsonl"),
        "eval": write_jsonl(sorting_pairs(11, 13), root / "eval.jsonl"),  # odd: the ranks' strides differ
        "cache": root / "train-cache",
    }


@pytest.fixture(scope="module")
def ddp_run(assets) -> tuple[Path, subprocess.CompletedProcess]:
    """2 ranks x batch 4, 4 steps, checkpoints at 2 and 4; builds the reference cache itself."""
    out = assets["root"] / "ddp"
    return out, torchrun("train", *train_args(assets, out, 4))


@pytest.fixture(scope="module")
def single_run(assets, ddp_run) -> Path:
    """The same run in one process with batch 8 (after ddp_run: the cache is complete)."""
    out = assets["root"] / "single"
    train_in_process(train_args(assets, out, 8))
    return out


# ------------------------------------------------------------------------------ cache build


def test_split_by_tokens_is_balanced_deterministic_and_exact(assets):
    from dpocache.data.pairs import load_preference_data
    from dpocache.models.loading import load_tokenizer

    pairs = load_preference_data(str(assets["pairs37"]), load_tokenizer(assets["model"]), show_progress=False).pairs
    for world in (1, 2, 3, 8):
        parts = split_by_tokens(pairs, world)
        keys = [p.key for part in parts for p in part]
        assert sorted(keys) == sorted(p.key for p in pairs)  # each pair in exactly one share
        assert split_by_tokens(list(reversed(pairs)), world) == parts  # no dependence on order
        loads = [sum(p.num_tokens for p in part) for part in parts]
        # Greedy longest-first: no share exceeds another by more than the largest pair.
        assert max(loads) - min(loads) <= max(p.num_tokens for p in pairs)
    assert len(split_by_tokens(pairs[:1], 4)[0]) == 1  # more ranks than pairs: the others idle


def test_distributed_build_equals_single_process_and_caches_each_pair_once(assets, tmp_path):
    from dpocache.cache import CacheStore, build_missing, namespace_for_dir
    from dpocache.data.pairs import load_preference_data
    from dpocache.models.loading import load_tokenizer
    from dpocache.models.reference import ReferenceModel

    model, data = assets["model"], assets["pairs37"]
    common = ["--model", str(model), "--data", str(data), "--dtype", "float32", "--device", "cpu",
              "--max-length", "64"]
    single, multi = tmp_path / "single", tmp_path / "multi"
    assert in_process("cache", "build", *common, "--cache-dir", str(single)) == 0

    # A build killed earlier left 10 pairs in shards no manifest lists: they must be adopted.
    pairs = load_preference_data(str(data), load_tokenizer(model), max_length=64, show_progress=False).pairs
    orphan_store = CacheStore(multi, namespace_for_dir(model, torch.float32, multi)).open()
    build_missing(orphan_store, pairs[:10], lambda: ReferenceModel.from_pretrained(model, "float32", "cpu"),
                  shard_pairs=4, show_progress=False, update_manifest=False)
    assert not (orphan_store.dir / "manifest.json").exists()

    proc = torchrun("cache", "build", *common, "--cache-dir", str(multi), "--shard-size", "5", "--json")
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert proc.stdout.count('"computed"') == 1  # rank 0 alone prints
    assert (summary["pairs"], summary["unique"], summary["computed"], summary["reused"]) == (37, 37, 27, 10)
    assert summary["world_size"] == 2 and summary["tokens"] > 0
    assert summary["layout"] == SHARED_RAN  # the reference pass's layout, named in the summary

    ns_dir = orphan_store.dir
    manifest = json.loads((ns_dir / "manifest.json").read_text())
    on_disk = {p.name for p in ns_dir.glob("shard-*.safetensors")}
    assert {s["file"] for s in manifest["shards"]} == on_disk
    assert manifest["pairs"] == 37
    assert sum(s["pairs"] for s in manifest["shards"]) == 37  # no pair computed twice
    from safetensors.torch import load_file

    keys = [bytes(k.tolist()) for f in on_disk for k in load_file(str(ns_dir / f))["keys"]]
    assert len(keys) == len(set(keys)) == 37

    exports = {}
    for name, cache in (("single", single), ("multi", multi)):
        out = tmp_path / f"{name}.jsonl"
        assert in_process("cache", "export", *common, "--cache-dir", str(cache), "--out", str(out), "--format",
                          "keys") == 0
        exports[name] = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(exports["multi"]) == 37
    for a, b in zip(exports["single"], exports["multi"]):
        assert a["key"] == b["key"] and a["chosen_tokens"] == b["chosen_tokens"]
        for side in ("chosen_logps", "rejected_logps"):
            assert abs(a[side] - b[side]) <= 1e-6 * max(1.0, abs(a[side])), (side, a, b)


def test_score_splits_the_rows_over_ranks_and_writes_one_output_in_data_order(assets, tmp_path):
    """``dpocache score`` under torchrun: each rank scores its share of the rows (no row twice),
    rank 0 alone writes the output, the same as one process's, and no part file is left."""
    rows = [{"prompt": r["prompt"], "completions": [r["chosen"], r["rejected"]]} for r in sorting_pairs(9, 21)]
    data = write_jsonl(rows, tmp_path / "rows.jsonl")
    common = ["score", "--model", str(assets["model"]), "--data", str(data), "--dtype", "float32", "--device", "cpu",
              "--chunk-rows", "2"]
    single, multi = tmp_path / "single.jsonl", tmp_path / "multi" / "logps.jsonl"
    assert in_process(*common, "--out", str(single), "--cache-dir", str(tmp_path / "c1")) == 0
    proc = torchrun(*common, "--out", str(multi), "--cache-dir", str(tmp_path / "c2"))
    summary = [line for line in proc.stdout.splitlines() if line.startswith("rows 9:")]
    assert len(summary) == 1 and "(0 from the cache, 18 computed" in summary[0], proc.stdout  # rank 0 speaks
    got = [json.loads(line) for line in multi.read_text().splitlines()]
    want = [json.loads(line) for line in single.read_text().splitlines()]
    assert [r["index"] for r in got] == [r["index"] for r in want] == list(range(9))
    for g, w in zip(got, want):
        assert g["tokens"] == w["tokens"]
        for a, b in zip(g["token_logps"], w["token_logps"]):
            assert max(abs(x - y) for x, y in zip(a, b)) < TOL
    assert sorted(p.name for p in multi.parent.iterdir()) == ["logps.jsonl"]


def test_score_refuses_ranks_that_read_different_rows(assets, tmp_path, monkeypatch):
    """A rows file whose path holds other rows on rank 1: one line naming --data, exit 2, no
    output (each rank scored its share of its own file and rank 0 merged them, exit 0)."""
    for rank, seed in ((0, 21), (1, 22)):
        rows = [{"prompt": r["prompt"], "completions": [r["chosen"]]} for r in sorting_pairs(4, seed)]
        write_jsonl(rows, tmp_path / f"rank{rank}" / "rows.jsonl")
    monkeypatch.chdir(tmp_path / "rank0")
    monkeypatch.setenv("RANK1_CWD", str(tmp_path / "rank1"))
    driver = tmp_path / "driver.py"
    driver.write_text(RANK1_DIFFERS)
    out = tmp_path / "out.jsonl"
    proc = torchrun("score", "--model", str(assets["model"]), "--data", "rows.jsonl", "--dtype", "float32",
                    "--device", "cpu", "--out", str(out), "--cache-dir", str(tmp_path / "cache"), script=driver,
                    check=False)
    codes = worker_exit_codes(proc)
    assert 2 in codes.values() and set(codes.values()) <= {2, -15}, proc.stderr[-6000:]
    lines = [line for line in proc.stderr.splitlines() if line.startswith("dpocache score: error: ")]
    assert lines and all("--data rows.jsonl: the ranks read different rows" in line for line in lines), proc.stderr
    assert not worker_traceback(proc) and not out.exists()


def test_missing_after_build_names_the_keys(assets, tmp_path):
    from dpocache.cache import CacheStore, namespace_for_dir
    from dpocache.cache.build import _missing_after_build, unique_pairs
    from dpocache.data.pairs import load_preference_data
    from dpocache.models.loading import load_tokenizer

    pairs = load_preference_data(str(assets["pairs37"]), load_tokenizer(assets["model"]), show_progress=False).pairs
    store = CacheStore(tmp_path, namespace_for_dir(assets["model"], torch.float32, tmp_path)).open()
    message = _missing_after_build(store, unique_pairs(pairs), per_token=False)
    assert "37 of 37 pairs" in message and pairs[0].key.hex()[:12] in message and "shared" in message


# ------------------------------------------------------------------------------ training


def test_two_ranks_match_one_process_with_the_global_batch(assets, ddp_run, single_run):
    out, proc = ddp_run
    multi, single = losses(out), losses(single_run)
    assert sorted(multi) == sorted(single) == [1, 2, 3, 4]
    assert abs(multi[1]["loss"] - 0.6931) > 1e-3  # the reference differs from the policy
    for step in (1, 2, 3, 4):
        assert_close_records(multi[step], single[step])
    # Eval: 11 pairs split 6/5 over the ranks, reduced as one mean over 11.
    for got, want in zip(evals(out), evals(single_run), strict=True):
        assert_close_records(got, want, keys=("eval/loss", "eval/rewards/accuracies", "eval/rewards/margins"))
    # Rank 0 alone writes: one line per step, one run.json; the cache was built on both ranks.
    assert [r["step"] for r in read_metrics(out)] == [0, 1, 2, 3, 4, 4]
    info = json.loads((out / "run.json").read_text())
    assert info["world_size"] == 2
    # The packed layout ran under DDP (its forward is the wrapped module's: hooks fire).
    assert info["layout"] == PACKED_RAN == json.loads((single_run / "run.json").read_text())["layout"]
    ref = info["reference"]
    assert ref["computed"] == 75 and ref["built_on_ranks"] == 2 and ref["forward_passes_during_training"] == 0
    assert json.loads((single_run / "run.json").read_text())["reference"]["computed"] == 0
    state = json.loads((out / "checkpoints" / "step-000002" / "trainer_state.json").read_text())
    assert state["world_size"] == 2 and state["global_batch"] == 8


def test_two_rank_resume_matches_uninterrupted_run(assets, ddp_run):
    out, _ = ddp_run
    resumed = truncate_to(out, assets["root"] / "ddp-resumed", step=2)
    proc = torchrun("train", *train_args(assets, resumed, 4), "--resume")
    assert "resumed from" in proc.stderr and "step 2" in proc.stderr
    got, want = losses(resumed), losses(out)
    assert sorted(got) == [1, 2, 3, 4]  # steps 1-2 kept from before the kill, 3-4 recomputed
    for step in (3, 4):
        assert_close_records(got[step], want[step])
    assert_close_records(evals(resumed)[-1], evals(out)[-1], keys=("eval/loss", "eval/rewards/margins"))


def test_two_rank_checkpoint_resumes_in_one_process(assets, ddp_run):
    out, _ = ddp_run
    resumed = truncate_to(out, assets["root"] / "ddp-to-single", step=2)
    train_in_process(train_args(assets, resumed, 8, None, "--resume"))
    got, want = losses(resumed), losses(out)
    for step in (3, 4):
        assert_close_records(got[step], want[step])


def test_fsdp2_on_cpu_resumes_a_single_process_run_with_tied_embeddings(assets, ddp_run):
    """FSDP2 (fully_shard) runs on CPU/gloo: it loads a 1-process checkpoint into shards,
    trains on (matching the 1-process run), and writes gathered checkpoints identical to it."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    single = assets["root"] / "tied-single"
    train_in_process(train_args(assets, single, 8, assets["tied"]))
    sharded = truncate_to(single, assets["root"] / "tied-fsdp", step=2)
    proc = torchrun("train", *train_args(assets, sharded, 4, assets["tied"], "--fsdp", "--resume"))
    assert "resumed from" in proc.stderr
    got, want = losses(sharded), losses(single)
    for step in (3, 4):
        assert_close_records(got[step], want[step])
    assert_close_records(evals(sharded)[-1], evals(single)[-1], keys=("eval/loss", "eval/rewards/margins"))

    # The gathered checkpoint is the one a single process writes: same tensors, same layout.
    for name, tol in (("model.safetensors", 1e-5), ("optimizer.safetensors", 1e-6)):
        a = load_file(str(sharded / "checkpoints" / "step-000004" / name))
        b = load_file(str(single / "checkpoints" / "step-000004" / name))
        assert sorted(a) == sorted(b), name
        for k in (k for k in a if not k.startswith("rng.")):  # RNG state is per process
            assert torch.allclose(a[k].float(), b[k].float(), atol=tol, rtol=0), (name, k)
    final = AutoModelForCausalLM.from_pretrained(str(sharded / "final"))
    assert final.lm_head.weight.data_ptr() == final.model.embed_tokens.weight.data_ptr()  # still tied
    info = json.loads((sharded / "run.json").read_text())
    assert info["config"]["distributed"]["fsdp"] is True and info["layout"] == PACKED_RAN


def test_lora_with_ddp_matches_one_process_in_the_padded_layout(assets, ddp_run):
    lora = ("--lora-r", "4", "--max-steps", "2", "--save-steps", "0", "--train.layout", "padded")
    multi, single = assets["root"] / "lora-ddp", assets["root"] / "lora-single"
    torchrun("train", *train_args(assets, multi, 4, None, *lora))
    train_in_process(train_args(assets, single, 8, None, *lora))
    got, want = losses(multi), losses(single)
    assert sorted(got) == [1, 2]
    for step in (1, 2):
        assert_close_records(got[step], want[step])
    assert (multi / "final" / "adapter_model.safetensors").exists()
    assert json.loads((multi / "run.json").read_text())["layout"] == {
        "requested": "padded", "used": "padded", "attention": "sdpa", "reason": None}


# The streamed base on the CPU, past the device check (a CPU stands in for the GPUs).
STREAMED_ON_CPU = r"""
import sys
import dpocache.config
from dpocache.cli.entry import main

dpocache.config._validate_streamed = lambda cfg, flag: None
raise SystemExit(main(sys.argv[1:]))
"""


def test_lora_with_ddp_and_a_streamed_base_matches_one_process(assets, tmp_path):
    """``--stream-base`` under DDP (2 ranks x 4 pairs, its streamed weights left out of DDP:
    dpocache.models.policy.wrap_for_distributed): the same losses as one resident process on
    the 8 pairs, every rank streaming its base's layers."""
    lora = ("--lora-r", "4", "--max-steps", "2", "--save-steps", "0", "--gradient-checkpointing", "true")
    multi, single = tmp_path / "streamed-ddp", tmp_path / "resident-single"
    driver = tmp_path / "driver.py"
    driver.write_text(STREAMED_ON_CPU)
    torchrun("train", *train_args(assets, multi, 4, None, *lora, "--stream-base", "true", "--resident-layers", "1"),
             script=driver)
    train_in_process(train_args(assets, single, 8, None, *lora))
    got, want = losses(multi), losses(single)
    assert sorted(got) == [1, 2]
    for step in (1, 2):
        assert_close_records(got[step], want[step])
    streamed = json.loads((multi / "run.json").read_text())["policy"]["streamed"]
    assert streamed["layers"] + streamed["resident_layers"] == 2 and streamed["transfers"]["copies"] > 0


@pytest.fixture(scope="module")
def mixed(assets, make_rows) -> dict:
    """Pairs of 21 to 71 tokens (at --max-length 64): in micro-batches of 4, packed into rows of
    their longest pair, 48 pairs take 44 rows in data order (some rows hold two pairs)."""
    rows = make_rows(48, seed=21, min_prompt=1, max_prompt=60, max_completion=6)
    return {**assets, "train": write_jsonl(rows, assets["root"] / "mixed.jsonl")}


def test_packed_layout_in_ddp_and_fsdp2_matches_one_process(mixed):
    """The packed layout (each rank packs its micro-batch of 4 into rows of its longest pair;
    the reference pass packs rows of the token budget) under DDP and under FSDP2 with a
    sharded reference build gives the losses of the one-process padded run with batch 8. Both
    run the causal attention backend (``auto``'s choice on GPUs): its sequence rows go through
    DDP's and FSDP2's input handling with the batch."""
    root = mixed["root"]

    def run(name: str, *extra: str) -> list[str]:
        args = train_args(mixed, root / name, 4 if extra[:1] != ("padded",) else 8)
        args[args.index("--cache-dir") + 1] = str(root / f"{name}-cache")  # each its own reference pass
        layout = extra[0]
        return [*args, "--train.layout", layout, "--cache.layout", layout, *extra[1:]]

    train_in_process(run("mixed-single", "padded"))
    torchrun("train", *run("mixed-ddp", "packed", "--model.attention", "causal"))
    proc = torchrun("train", *run("mixed-fsdp", "packed", "--fsdp", "--model.attention", "causal"))
    assert "reference: FSDP2-sharded over 2 processes" in proc.stderr
    want = losses(root / "mixed-single")
    for name in ("mixed-ddp", "mixed-fsdp"):
        got = losses(root / name)
        assert sorted(got) == sorted(want) == [1, 2, 3, 4]
        for step in (1, 2, 3, 4):
            assert_close_records(got[step], want[step])
        assert_close_records(evals(root / name)[-1], evals(root / "mixed-single")[-1],
                             keys=("eval/loss", "eval/rewards/margins"))
        info = json.loads((root / name / "run.json").read_text())
        assert info["world_size"] == 2 and info["reference"]["built_on_ranks"] == 2
        assert info["layout"] == {"requested": "packed", "used": "packed", "attention": CAUSAL, "reason": None}


def test_float16_under_fsdp2_skips_overflowing_steps_on_every_rank(assets):
    """float16 training scales its loss (dpocache.models.policy.build_grad_scaler). Under FSDP2 each
    rank holds only its shard of the gradients, so whether they overflowed is reduced over the
    ranks (ShardedGradScaler). With beta 3 the first step overflows float16 at the first scale
    (65536) and later ones fit: the steps logged as skipped (from the norm over every shard) are
    the ones rank 0's scaler backed off for, each halving its scale."""
    out = assets["root"] / "f16-fsdp"
    args = train_args(assets, out, 4, None, "--dtype", "float16", "--beta", "3", "--max-steps", "6",
                      "--save-steps", "6", "--fsdp")
    args[args.index("--cache-dir") + 1] = str(assets["root"] / "f16-cache")  # float16 reference values
    torchrun("train", *args)
    rows = losses(out)
    skipped = [rows[step]["skipped_fraction"] for step in range(1, 7)]
    assert skipped[0] == 1.0 and 0.0 in skipped, skipped
    for step in range(1, 7):
        assert ("grad_norm" in rows[step]) == (rows[step]["skipped_fraction"] == 0.0), step  # no norm when skipped
        assert math.isfinite(rows[step]["loss"])
    state = json.loads((out / "checkpoints" / "step-000006" / "trainer_state.json").read_text())
    assert state["grad_scaler"]["scale"] == 65536.0 / 2 ** sum(skipped)

# ------------------------------------------------------------------------------ stop signals


def torchrun_signalled(script: str, tmp_path: Path, *args: str, **hook: str) -> subprocess.CompletedProcess:
    """``torchrun`` of ``script`` (a driver of ``dpocache ARGS`` that signals itself, see
    test_signals.py; its settings in ``hook``), expected to stop with 128 + the signal (SIGTERM:
    143) on every rank."""
    driver = tmp_path / "driver.py"
    driver.write_text(script)
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1",
               CUDA_VISIBLE_DEVICES="", **hook)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(_free_port()), str(driver), *args]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0, proc.stderr[-3000:]
    # torchrun's report names the workers' exit status: every rank stopped with 128 + the signal.
    code = 128 + getattr(signal, hook.get("SIGNAL_NAME", "SIGTERM"))
    assert proc.stderr.count(f"exitcode  : {code}") >= 1 and "exitcode  : -" not in proc.stderr, proc.stderr[-6000:]
    return proc


@pytest.mark.parametrize("signame", ["SIGTERM", "SIGUSR1"])
def test_a_stop_signal_to_one_rank_of_a_build_keeps_every_pair_computed(assets, tmp_path, capsys, signame):
    """Rank 1 gets SIGTERM (or Slurm's SIGUSR1) once its progress passes 30%: it flushes and
    stops, rank 0 finishes its share, the manifest lists both, every rank exits 128 + signum with
    one line, and the next build reuses every pair computed before the signal."""
    from test_signals import SIGNAL_AT_PROGRESS

    from dpocache.cache import CacheStore, namespace_for_dir
    from dpocache.data.pairs import load_preference_data
    from dpocache.models.loading import load_tokenizer

    cache, report = tmp_path / "cache", tmp_path / "seen"
    common = ["--model", str(assets["model"]), "--data", str(assets["pairs37"]), "--dtype", "float32",
              "--device", "cpu", "--max-tokens", "1", "--cache-dir", str(cache)]
    proc = torchrun_signalled(SIGNAL_AT_PROGRESS, tmp_path, "cache", "build", *common, SIGNAL_RANK="1",
                              SIGNAL_AT_FRACTION="0.3", SIGNAL_NAME=signame, SIGNAL_REPORT=str(report))
    lines = proc.stderr.splitlines()
    rank1 = f"dpocache (rank 1): stopped by {signame}: "
    assert sum(line.startswith(rank1) for line in lines) == 1, proc.stderr[-6000:]
    assert sum(line.startswith(f"dpocache: stopped by {signame}: ") for line in lines) == 1, proc.stderr[-6000:]

    pairs = load_preference_data(str(assets["pairs37"]), load_tokenizer(assets["model"]), show_progress=False).pairs
    shares = split_by_tokens(pairs, 2)
    seen = int(report.read_text())
    assert 0.3 * len(shares[1]) < seen < len(shares[1])
    store = CacheStore(cache, namespace_for_dir(assets["model"], torch.float32, cache)).open()
    manifest = json.loads((store.dir / "manifest.json").read_text())
    assert len(store) == manifest["pairs"] == len(shares[0]) + seen
    assert {s["file"] for s in manifest["shards"]} == {p.name for p in store.dir.glob("shard-*.safetensors")}

    assert in_process("cache", "build", *common, "--json") == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert (summary["reused"], summary["computed"]) == (len(shares[0]) + seen, 37 - len(shares[0]) - seen)


def test_sigterm_to_one_rank_inside_an_eval_stops_both_at_that_step(assets, tmp_path):
    """Rank 1 gets SIGTERM in the middle of the step-2 eval: both ranks leave the eval at the
    same batch (their agreement is a collective), step 2 is checkpointed, no eval row is logged
    for it, and --resume logs it before going on."""
    from test_signals import SIGNAL_IN_EVAL

    from dpocache.models.checkpoint import checkpoints

    out = tmp_path / "stopped"
    args = train_args(assets, out, 4, None, "--save-steps", "0", "--eval-steps", "2", "--train.eval_batch_size", "1")
    proc = torchrun_signalled(SIGNAL_IN_EVAL, tmp_path, "train", *args, SIGNAL_RANK="1", SIGNAL_IN_EVAL_STEP="2")
    assert "dpocache: stopped by SIGTERM: checkpoint of step 2 of 4" in proc.stderr, proc.stderr[-6000:]
    assert [p.name for p in checkpoints(out)] == ["step-000002"]
    assert [r["step"] for r in evals(out)] == [0]
    torchrun("train", *args, "--resume")
    assert [r["step"] for r in evals(out)] == [0, 2, 4]


def test_sigterm_to_one_rank_of_training_checkpoints_and_resumes_exactly(assets, ddp_run, tmp_path):
    """Default settings (no --save-steps): rank 1 gets SIGTERM after step 2; every rank agrees to
    stop there, one checkpoint of step 2 is saved, and --resume matches the uninterrupted run."""
    from test_signals import SIGNAL_AFTER_STEP

    from dpocache.models.checkpoint import checkpoints

    out, _ = ddp_run
    stopped = tmp_path / "stopped"
    args = train_args(assets, stopped, 4, None, "--save-steps", "0")
    proc = torchrun_signalled(SIGNAL_AFTER_STEP, tmp_path, "train", *args, SIGNAL_RANK="1", SIGNAL_AFTER_STEP="2")
    assert "dpocache: stopped by SIGTERM: checkpoint of step 2 of 4" in proc.stderr, proc.stderr[-6000:]
    assert [p.name for p in checkpoints(stopped)] == ["step-000002"]
    torchrun("train", *args, "--resume")
    got, want = losses(stopped), losses(out)
    assert sorted(got) == [1, 2, 3, 4]
    for step in (1, 2, 3, 4):
        assert_close_records(got[step], want[step])
    assert [r["step"] for r in read_metrics(stopped)] == [0, 1, 2, 3, 4, 4]


def worker_exit_codes(proc: subprocess.CompletedProcess) -> dict[int, int]:
    """``{rank: exit status}`` of the failed workers, from torchrun's report (a rank's block has
    "rank      : 1 (local_rank: 1)", then "exitcode  : 2 (pid: ...)"; -15: killed by torchrun's
    SIGTERM once another worker had failed)."""
    return {int(rank): int(code) for rank, code in
            re.findall(r"rank\s*:\s*(\d+) \(local_rank.*?\n\s*exitcode\s*:\s*(-?\d+)", proc.stderr)}


# The package's own folder: a clone named "dpocache" holding its virtualenv has torchrun's files
# under ".../dpocache/.venv/...", which must not count as dpocache's code.
PACKAGE = Path(dpocache.__file__).parent
PACKAGE_DIRS = {f'File "{d}{os.sep}' for d in (PACKAGE, PACKAGE.resolve())}


def worker_traceback(proc: subprocess.CompletedProcess) -> bool:
    """Whether a worker printed a traceback through dpocache's code (torchrun's own report of
    failed workers has a traceback of torchrun's)."""
    return any(d in line for line in proc.stderr.splitlines() for d in PACKAGE_DIRS)


def test_setup_mistake_under_torchrun_is_one_line_per_rank(assets, tmp_path):
    """A mistake found once the process group is up (--fsdp with LoRA) is a user error on every
    rank: one line each and exit 2, not a traceback and exit 1."""
    proc = torchrun("train", *train_args(assets, tmp_path / "run", 4, None, "--fsdp", "--lora-r", "4"), check=False)
    codes = worker_exit_codes(proc)
    # torchrun reports the first rank to fail; the other has printed its line by then, or is
    # stopped by torchrun's SIGTERM (-15) before it got there.
    assert 2 in codes.values() and set(codes.values()) <= {2, -15}, proc.stderr[-6000:]
    lines = [line for line in proc.stderr.splitlines() if line.startswith("dpocache train: error: --fsdp")]
    assert 1 <= len(lines) <= 2 and not worker_traceback(proc), proc.stderr[-6000:]


# Rank 1 runs in directory RANK1_CWD (a relative path then names another file there, as a path on
# a disk that is not shared does) and with the flags RANK1_ARGS added (a config file that differs).
RANK1_DIFFERS = r"""
import os, sys
import dpocache.cache.build
from dpocache.cli.entry import main

dpocache.cache.build.PROBE_WAIT_S = float(os.environ.get("PROBE_WAIT_S", dpocache.cache.build.PROBE_WAIT_S))

args = sys.argv[1:]
if os.environ["RANK"] == "1":
    os.chdir(os.environ.get("RANK1_CWD", "."))
    args += os.environ.get("RANK1_ARGS", "").split()
raise SystemExit(main(args))
"""


@pytest.mark.parametrize("differs", ["data", "setting", "reference", "cache"])
def test_ranks_with_other_data_settings_or_reference_are_refused(assets, tmp_path, monkeypatch, differs):
    """A data file whose path holds other pairs on rank 1, a setting rank 1 alone was given, or
    a reference directory whose path holds another model on rank 1 stops every rank with one
    line naming it, before any model loads (it trained, exit 0, each rank on its own pairs, with
    its own learning rate, or against its own reference's values from a cache holding both); a
    cache directory whose path is another directory on rank 1 (a node's own disk), before the
    reference pass (it ran the whole pass, then found rank 1's values missing)."""
    for rank in (0, 1):
        rows = sorting_pairs(16, 14 if differs == "data" and rank == 1 else 12)
        write_jsonl(rows, tmp_path / f"rank{rank}" / "train.jsonl")
        ref = assets["tied"] if differs == "reference" and rank == 1 else assets["ref"]  # neither is the policy
        (tmp_path / f"rank{rank}" / "ref").symlink_to(ref)
    if differs == "reference":  # a cache complete for both: no build to disagree on what it lacks
        for model in (assets["ref"], assets["tied"]):
            data = tmp_path / "rank0" / "train.jsonl"
            assert in_process("cache", "build", "--model", str(model), "--data", str(data),
                              "--cache-dir", str(tmp_path / "cache"), "--dtype", "float32", "--device", "cpu",
                              "--max-length", "64") == 0
    monkeypatch.chdir(tmp_path / "rank0")  # torchrun's processes inherit it, RANK1_CWD and RANK1_ARGS
    monkeypatch.setenv("RANK1_CWD", str(tmp_path / "rank1"))
    monkeypatch.setenv("RANK1_ARGS", "--lr 2e-3" if differs == "setting" else "")
    monkeypatch.setenv("PROBE_WAIT_S", "0")  # a shared file system's caches need no waiting for here
    driver = tmp_path / "driver.py"
    driver.write_text(RANK1_DIFFERS)
    args = train_args(assets, tmp_path / "run", 4)
    cache = "cache" if differs == "cache" else str(tmp_path / "cache")  # relative: each rank's own
    for flag, value in (("--data", "train.jsonl"), ("--eval-data", "train.jsonl"), ("--ref-model", "ref"),
                        ("--cache-dir", cache)):
        args[args.index(flag) + 1] = value
    proc = torchrun("train", *args, script=driver, check=False)
    codes = worker_exit_codes(proc)
    code = 1 if differs in ("reference", "cache") else 2  # the cache build's checks (CacheError)
    assert code in codes.values() and set(codes.values()) <= {code, -15}, proc.stderr[-6000:]
    named = {"data": "--data (data.train) train.jsonl: the ranks read different pairs",
             "setting": "the ranks were started with different values of --lr (optim.lr)",
             "reference": "ranks disagree on the reference's namespace",
             "cache": "files there: each node has a directory of its own under that name"}[differs]
    lines = [line for line in proc.stderr.splitlines() if line.startswith("dpocache train: error: ")]
    assert 1 <= len(lines) <= 2 and all(named in line for line in lines), proc.stderr[-6000:]
    assert not worker_traceback(proc) and not (tmp_path / "run" / "run.json").exists(), proc.stderr[-6000:]
    if differs == "cache":  # nothing scored, no probe left behind
        for rank in (0, 1):
            assert not list((tmp_path / f"rank{rank}" / "cache").rglob("shard-*")), rank
            assert not list((tmp_path / f"rank{rank}" / "cache").glob(".rank-probe-*")), rank


def test_rank_failing_alone_leaves_one_line_on_the_other(assets, ddp_run, tmp_path):
    """Rank 0 fails while saving a checkpoint (a plain file where its temporary directory goes)
    and exits with its own line; rank 1, waiting for it in a collective, says in one line that
    another rank exited, instead of printing gloo's traceback."""
    out = tmp_path / "run"
    (out / "checkpoints").mkdir(parents=True)
    (out / "checkpoints" / "step-000002.tmp").write_text("in the way")
    proc = torchrun("train", *train_args(assets, out, 4), check=False)
    codes = worker_exit_codes(proc)
    # Rank 0 exits 2 after its line, unless rank 1 (which learns of it as rank 0 ends its process
    # group) has exited first and torchrun's SIGTERM (-15) meets rank 0 after its line.
    assert codes.get(1) == 1 and codes.get(0) in (2, -15), proc.stderr[-6000:]
    lines = proc.stderr.splitlines()
    assert sum(line.startswith("dpocache train: error: ") and "File exists" in line for line in lines) == 1
    peer = [line for line in lines if line.startswith("dpocache (rank 1): stopped because another rank exited")]
    assert len(peer) == 1 and not worker_traceback(proc), proc.stderr[-6000:]


# ------------------------------------------------------------------------------ sharded reference (FSDP2)


def _pairs(assets, model: Path, max_length: int = 64):
    from dpocache.data.pairs import load_preference_data
    from dpocache.models.loading import load_tokenizer

    return load_preference_data(str(assets["pairs37"]), load_tokenizer(model), max_length=max_length,
                                show_progress=False).pairs


def test_sharded_build_on_two_ranks_matches_one_process_in_fp32(assets, tmp_path):
    """``cache build --fsdp``: the reference's weights sharded over 2 processes, each scoring
    its own share; the values are the single process's (sums and per-token values)."""
    from dpocache.cache import CacheStore, namespace_for_dir

    model = assets["model"]
    common = ["--model", str(model), "--data", str(assets["pairs37"]), "--dtype", "float32", "--device", "cpu",
              "--max-length", "64", "--per-token"]
    assert in_process("cache", "build", *common, "--cache-dir", str(tmp_path / "one")) == 0
    proc = torchrun("cache", "build", *common, "--cache-dir", str(tmp_path / "sharded"), "--fsdp", "--json")
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert (summary["computed"], summary["world_size"]) == (37, 2)
    pairs = _pairs(assets, model)
    got, want = ([CacheStore(tmp_path / d, namespace_for_dir(model, torch.float32, tmp_path / d)).open()
                  for d in ("sharded", "one")])
    a, b = got.lookup([p.key for p in pairs]), want.lookup([p.key for p in pairs])
    for side in ("chosen_logps", "rejected_logps"):
        assert torch.allclose(getattr(a, side), getattr(b, side), atol=TOL, rtol=0), side
    for p in pairs:
        for x, y in zip(got.token_logps(p.key), want.token_logps(p.key), strict=True):
            assert torch.allclose(x, y, atol=TOL, rtol=0)


# Names the gloo threads of the process just before and just after dpocache's teardown calls
# destroy_process_group, one JSON file per rank in THREADS_REPORT.
GLOO_THREADS_AT_DESTROY = r"""
import json, os, sys
import torch.distributed as dist
from dpocache.cli.entry import main

def gloo_threads():
    names = [open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task")]
    return sorted(n for n in names if "gloo" in n)

seen = {}
destroy_process_group = dist.destroy_process_group

def recorded(*args, **kwargs):
    seen["before"] = gloo_threads()
    destroy_process_group(*args, **kwargs)
    seen["after"] = gloo_threads()

dist.destroy_process_group = recorded
code = main(sys.argv[1:])
with open(os.path.join(os.environ["THREADS_REPORT"], os.environ["RANK"] + ".json"), "w") as f:
    json.dump(seen, f)
raise SystemExit(code)
"""


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="names a process's threads from /proc")
@pytest.mark.parametrize("command", ["build", "train"])
def test_fsdp_runs_end_their_process_group_before_the_interpreter_exits(assets, tmp_path, monkeypatch, command):
    """``cache build --fsdp`` and ``train --fsdp`` end their gloo group at teardown, its threads
    joined, on every rank. A group that outlives ``destroy_process_group`` (held by a model, by
    a ``DeviceMesh`` that DTensor's caches keep, or by ``torch.distributed.nn``'s default
    arguments) ends at interpreter exit, where a gloo worker that drops a finished collective's
    tensors aborted the process now and then ("terminate called without an active exception")."""
    driver = tmp_path / "driver.py"
    driver.write_text(GLOO_THREADS_AT_DESTROY)
    monkeypatch.setenv("THREADS_REPORT", str(tmp_path))  # torchrun's processes inherit it
    if command == "build":
        args = ["cache", "build", "--model", str(assets["model"]), "--data", str(assets["pairs37"]), "--dtype",
                "float32", "--device", "cpu", "--max-length", "64", "--cache-dir", str(tmp_path / "cache"), "--fsdp"]
    else:
        args = ["train", *train_args(assets, tmp_path / "run", 4, None, "--fsdp", "--max-steps", "2")]
    torchrun(*args, script=driver)
    for rank in (0, 1):
        seen = json.loads((tmp_path / f"{rank}.json").read_text())
        assert seen["before"], seen  # the group's threads, by the names gloo gives them
        assert seen["after"] == [], (rank, seen)


@pytest.mark.parametrize("name,mode", [("tied", "native"), ("model", "native"), ("model", "fp32-gemm")])
def test_sharded_build_on_four_ranks_equals_the_unsharded_shares_in_bf16(assets, tmp_path, monkeypatch, name, mode):
    """bf16 with the native kernels (matrices stored in bf16, so each FSDP unit mixes bf16 and
    fp32 parameters) or the fp32-GEMM route, a tied head (one FSDP unit with the root) or an
    untied one (embeddings and head streamed from their shards, dpocache.distributed.vocab_stream), the
    padded layout, and shares of different batch counts (the ranks that finish first run
    padding forwards). Equal, bit for bit, to the unsharded reference run over the same shares
    in the same batches."""
    from dpocache.cache import CacheStore, build_missing, namespace_for_dir
    from dpocache.cache.build import reference_batches
    from dpocache.models.reference import ReferenceModel

    monkeypatch.setenv("DPOCACHE_BF16_MATMUL", mode)  # torchrun's processes inherit it
    model, bf16 = assets[name], torch.bfloat16
    pairs = _pairs(assets, model)
    reference = ReferenceModel.from_pretrained(model, "bfloat16", "cpu", layout="padded")
    shares = split_by_tokens(pairs, 4)
    assert len({len(reference_batches(reference, share, 120)) for share in shares}) > 1  # unequal batch counts
    unsharded = CacheStore(tmp_path / "u", namespace_for_dir(model, bf16, tmp_path / "u")).open()
    for share in shares:
        build_missing(unsharded, share, lambda: reference, max_tokens=120, show_progress=False)

    torchrun("cache", "build", "--model", str(model), "--data", str(assets["pairs37"]), "--dtype", "bfloat16",
             "--device", "cpu", "--max-length", "64", "--layout", "padded", "--max-tokens", "120",
             "--cache-dir", str(tmp_path / "s"), "--fsdp", nproc=4)
    sharded = CacheStore(tmp_path / "s", namespace_for_dir(model, bf16, tmp_path / "s")).open()
    assert sharded.namespace.id == unsharded.namespace.id  # bf16 storage leaves the namespace alone
    a, b = sharded.lookup([p.key for p in pairs]), unsharded.lookup([p.key for p in pairs])
    assert torch.equal(a.chosen_logps, b.chosen_logps) and torch.equal(a.rejected_logps, b.rejected_logps)


def test_fsdp_train_shards_its_reference_build_and_matches_one_process(assets, single_run):
    """``train --fsdp`` from scratch with an empty cache: the reference pass is sharded, the
    policy is created on the meta device and filled from rank 0 (per-layer activation
    checkpointing on); the losses are those of the one-process run."""
    out = assets["root"] / "fsdp-fresh"
    args = train_args(assets, out, 4, None, "--fsdp", "--gradient-checkpointing", "true")
    args[args.index("--cache-dir") + 1] = str(assets["root"] / "fsdp-cache")
    proc = torchrun("train", *args)
    assert "reference: FSDP2-sharded over 2 processes" in proc.stderr
    assert "policy: FSDP2-sharded over 2 processes" in proc.stderr
    got, want = losses(out), losses(single_run)
    assert sorted(got) == [1, 2, 3, 4]
    for step in (1, 2, 3, 4):
        assert_close_records(got[step], want[step])
    ref = json.loads((out / "run.json").read_text())["reference"]
    assert ref["computed"] == 75 and ref["built_on_ranks"] == 2 and ref["forward_passes_during_training"] == 0


# The workers write STEP_FILE after each optimizer step (rank 0) and take a little longer per step,
# so that a signal sent from outside lands mid-run.
SLOW_STEPS = r"""
import os, sys, time
import dpocache.training.loop as train
from dpocache.cli.entry import main

one_step = train.train_step

def slow_step(run, window):
    one_step(run, window)
    time.sleep(0.3)
    if run.env.is_main:
        with open(os.environ["STEP_FILE"], "w") as f:
            f.write(str(run.step))

train.train_step = slow_step
raise SystemExit(main(sys.argv[1:]))
"""


@pytest.mark.slow
def test_sigusr1_to_torchrun_stops_every_rank_at_a_checkpoint(assets, tmp_path):
    """Slurm's SIGUSR1 to the torchrun agent, started with --signals-to-handle naming it (as
    docs/distributed.md says): the agent forwards it, every rank stops at the same step with one
    line and exit 138, that step is checkpointed, and --resume finishes the run."""
    from dpocache.models.checkpoint import checkpoints

    driver, step_file, out = tmp_path / "driver.py", tmp_path / "step", tmp_path / "run"
    driver.write_text(SLOW_STEPS)
    args = train_args(assets, out, 4, None, "--save-steps", "0", "--max-steps", "30")
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1",
               CUDA_VISIBLE_DEVICES="", STEP_FILE=str(step_file))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(_free_port()), "--signals-to-handle", "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1",
           str(driver), "train", *args]
    agent = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 240
    while not (step_file.exists() and step_file.read_text().strip() not in ("", "0", "1")):
        assert agent.poll() is None and time.monotonic() < deadline, agent.communicate()[1][-4000:]
        time.sleep(0.1)
    agent.send_signal(signal.SIGUSR1)
    stdout, stderr = agent.communicate(timeout=240)
    assert agent.returncode != 0
    stop = "dpocache: stopped by SIGUSR1: checkpoint of step"
    stops = [line for line in stderr.splitlines() if line.startswith(stop)]
    assert len(stops) == 1, stderr[-6000:]
    assert not worker_traceback(subprocess.CompletedProcess(cmd, agent.returncode, stdout, stderr)), stderr[-6000:]
    step = int(stops[0].split("checkpoint of step ")[1].split()[0])
    assert [p.name for p in checkpoints(out)] == [f"step-{step:06d}"] and 2 <= step < 30
    torchrun("train", *args, "--resume")
    assert sorted(losses(out)) == list(range(1, 31))
