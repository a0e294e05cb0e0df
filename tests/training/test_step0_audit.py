"""The step-0 audit: when the policy starts from the reference's weights, the first micro-batch's
log-probs are compared with the cached values; a cache that disagrees stops training at step 0
with one line naming the namespace directory, the worst pairs and the rebuild command."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from train_fixtures import (  # noqa: F401  (fixtures are used by name; one_thread is autouse)
    base_model, flags, one_thread, run_json, run_training, train_jsonl, train_records,
)

from dpocache.cache import CacheStore, namespace_for_dir
from dpocache.cli.entry import main as cli_main
from dpocache.data.pairs import KEY_BYTES, load_preference_data
from dpocache.models.checkpoint import STATE_FILE
from dpocache.models.loading import load_tokenizer
from dpocache.training.audit import ReferenceAuditFailed, audit_tolerance

SHIFT = 3.0  # nats added to every cached chosen value


def build_cache(model: Path, data: Path, cache: Path) -> CacheStore:
    argv = ["cache", "build", "--model", str(model), "--data", str(data), "--cache-dir", str(cache),
            "--dtype", "float32", "--device", "cpu", "--max-length", "64"]
    assert cli_main(argv) == 0
    return CacheStore(cache, namespace_for_dir(model, torch.float32, cache)).open()


def shift_cached_values(store: CacheStore, pairs, shift: float, only: set[bytes] | None = None) -> None:
    """Replace the namespace's shards by one holding the same pairs with ``chosen_logps + shift``
    (for the keys in ``only``, default all), written through the store's own API (so its
    checksum and manifest are valid)."""
    keys = list(dict.fromkeys(p.key for p in pairs))
    values = store.lookup(keys)
    if only is not None:
        shift = torch.tensor([shift if k in only else 0.0 for k in keys])
    shutil.rmtree(store.dir)
    fresh = CacheStore(store.root, store.namespace)
    fresh.add_shard({
        "keys": torch.frombuffer(bytearray(b"".join(keys)), dtype=torch.uint8).reshape(-1, KEY_BYTES),
        "chosen_logps": values.chosen_logps + shift, "rejected_logps": values.rejected_logps,
        "chosen_tokens": values.chosen_tokens, "rejected_tokens": values.rejected_tokens,
    })


@pytest.fixture
def pairs(base_model, train_jsonl):
    return load_preference_data(train_jsonl, load_tokenizer(base_model), 64, show_progress=False).pairs


def test_tolerance_per_dtype():
    assert audit_tolerance("float32", -100.0) == pytest.approx(1e-4 + 1e-3)
    tolerances = [audit_tolerance(dtype, -100.0) for dtype in ("bfloat16", "float16", "float32")]
    assert tolerances == sorted(tolerances, reverse=True)
    assert audit_tolerance("bfloat16", -100.0) < SHIFT


def test_shifted_cache_stops_training_at_step0(tmp_path, base_model, train_jsonl, pairs, capsys):
    cache = tmp_path / "cache"
    store = build_cache(base_model, train_jsonl, cache)
    shift_cached_values(store, pairs, SHIFT)
    out = tmp_path / "run"
    argv = flags(base_model, train_jsonl, out, cache, "--max-steps", "2")
    capsys.readouterr()
    assert cli_main(["train", *argv]) == 1
    err = [e for e in capsys.readouterr().err.strip().splitlines() if "dpocache" in e]
    assert len(err) == 1, err
    line = err[0]
    print("\n" + line)
    assert "step-0 audit" in line and str(store.dir) in line
    assert "row " in line and "chosen" in line and f"drift {SHIFT:.3g}" in line
    assert f"rm -r {store.dir}" in line and "dpocache cache build" in line and f"--cache-dir {cache}" in line
    assert not (out / "metrics.jsonl").exists() or not train_records(out), "a step was logged on a wrong cache"
    assert not (out / "final").exists() and not (out / "checkpoints").exists()
    audit = run_json(out)["reference"]["step0_audit"]
    assert audit["ok"] is False and audit["max_abs_drift"] == pytest.approx(SHIFT, abs=1e-3)
    assert audit["sequences"] == 8 and audit["worst"]


def test_weight_edited_in_place_with_mtime_restored(tmp_path, base_model, train_jsonl):
    """A cache made stale by an in-place weight edit whose mtime is restored is caught before
    step 0 (the fingerprint sees the edit: a new namespace, values recomputed) or at step 0
    (the audit): training never runs a step on the stale values."""
    from safetensors.torch import load_file, save_file

    model = tmp_path / "model"
    shutil.copytree(base_model, model)
    cache = tmp_path / "cache"
    build_cache(model, train_jsonl, cache)
    weights = model / "model.safetensors"
    st = os.stat(weights)
    tensors = load_file(str(weights))
    name = next(k for k in tensors if k.endswith("lm_head.weight") or k.endswith("embed_tokens.weight"))
    tensors[name] = tensors[name] * 3.0  # same shapes, same file size
    save_file(tensors, str(weights), metadata={"format": "pt"})
    assert os.stat(weights).st_size == st.st_size
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns))

    out = tmp_path / "run"
    try:
        run_training(*flags(model, train_jsonl, out, cache, "--max-steps", "1"))
    except ReferenceAuditFailed as err:
        print(f"\ncaught at step 0: {err}")
        assert "step-0 audit" in str(err)
        assert not (out / "metrics.jsonl").exists() or not train_records(out)
    else:  # caught before step 0: the values were recomputed for the edited weights
        ref = run_json(out)["reference"]
        assert ref["computed"] > 0 and ref["step0_audit"]["ok"]


def test_clean_run_records_the_drift(tmp_path, base_model, train_jsonl):
    out = tmp_path / "run"
    run_training(*flags(base_model, train_jsonl, out, tmp_path / "cache", "--max-steps", "1", "--grad-accum", "2"))
    audit = run_json(out)["reference"]["step0_audit"]
    print(f"\nfp32 step-0 audit: max drift {audit['max_abs_drift']:.3g} "
          f"({audit['max_drift_over_tolerance']:.3g} of the tolerance)")
    assert audit["ok"] and audit["sequences"] == 8 and audit["ranks"] == 1
    assert audit["max_abs_drift"] <= 1e-4 and "float32" in audit["tolerance"]


def test_no_audit_with_another_reference_or_after_step0(tmp_path, base_model, train_jsonl):
    """A --ref-model with other weights makes the policy's first forward no reference forward:
    the (correct) cache must not be flagged."""
    from dpocache.models.tiny import save_tiny_model

    ref = save_tiny_model(tmp_path / "ref", "llama", seed=1)
    out = tmp_path / "run"
    run_training(*flags(base_model, train_jsonl, out, tmp_path / "cache", "--max-steps", "2", "--save-steps", "1",
                        "--ref-model", str(ref)))
    assert "skipped" in run_json(out)["reference"]["step0_audit"]
    shutil.rmtree(out / "checkpoints" / "step-000002")
    shutil.rmtree(out / "final")
    run_training(*flags(base_model, train_jsonl, out, tmp_path / "cache", "--max-steps", "2", "--resume",
                        "--ref-model", str(ref)))  # the same reference: --resume refuses another
    # The first attempt's record stays (a checkpoint carries it); one without it says why none ran.
    assert "another model" in run_json(out)["reference"]["step0_audit"]["skipped"]
    assert run_json(out)["resumed_from"]["step"] == 1
    state_file = out / "checkpoints" / "step-000001" / STATE_FILE
    state_file.write_text(json.dumps({**json.loads(state_file.read_text()), "step0_audit": None}))
    shutil.rmtree(out / "checkpoints" / "step-000002")
    shutil.rmtree(out / "final")
    run_training(*flags(base_model, train_jsonl, out, tmp_path / "cache", "--max-steps", "2", "--resume",
                        "--ref-model", str(ref)))
    assert "resumed at step 1" in run_json(out)["reference"]["step0_audit"]["skipped"]


# ------------------------------------------------------------------------------ distributed


def torchrun(*args: str, nproc: int = 2) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1",
               CUDA_VISIBLE_DEVICES="")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-addr",
           "127.0.0.1", "--master-port", str(port), "-m", "dpocache", *args]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.slow
@pytest.mark.skipif(not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
                    reason="needs torch.distributed with gloo")
def test_distributed_ranks_audit_their_own_batch_and_agree(tmp_path, base_model, train_jsonl, pairs):
    """Under torchrun each rank audits its own first micro-batch; the results are gathered, so a
    value wrong only in rank 0's batch stops both ranks with the same line. A clean FSDP run
    records the drift over both ranks."""
    from dpocache.data.order import training_order

    cache = tmp_path / "cache"
    store = build_cache(base_model, train_jsonl, cache)
    clean = torchrun("train", *flags(base_model, train_jsonl, tmp_path / "fsdp", cache, "--max-steps", "1", "--fsdp",
                                     "--batch-size", "2"))
    assert clean.returncode == 0, clean.stderr[-4000:]
    audit = run_json(tmp_path / "fsdp")["reference"]["step0_audit"]
    assert audit["ok"] and audit["ranks"] == 2 and audit["sequences"] == 8

    rank0_first = pairs[training_order(len(pairs), 42, 0)[0]]  # rank 0's first pair at step 0 (seed 42)
    shift_cached_values(store, pairs, SHIFT, only={rank0_first.key})
    bad = torchrun("train", *flags(base_model, train_jsonl, tmp_path / "ddp", cache, "--max-steps", "1"))
    assert bad.returncode != 0
    # Both ranks write to torchrun's one stderr, so their lines can interleave (a message and
    # its newline are separate writes): count and check the messages, not the lines.
    messages = bad.stderr.split("dpocache train: error: step-0 audit")[1:]
    assert len(messages) == 2, bad.stderr[-4000:]
    for message in messages:
        assert f"row {rank0_first.index} chosen" in message and "1 of 16 sequences" in message, bad.stderr[-4000:]
