"""Micro-batches laid out ahead on a background thread (``dpocache.training.prefetch``): a run that
prefetches computes exactly what a run that lays each micro-batch out when it needs it computes,
step for step, in every layout; the prefetcher serves the loop's order, a resumed start and a
stop; on a GPU, the laid-out batch reaches the device from page-locked memory."""

from __future__ import annotations

import threading

import pytest
import torch
from train_fixtures import (  # noqa: F401 (fixtures)
    base_model,
    flags,
    load_tensors,
    max_abs_diff,
    one_thread,
    run_json,
    run_training,
    train_jsonl,
    train_records,
)

from dpocache.training import prefetch
from dpocache.training.prefetch import Prefetcher, prefetching

TIMING = {"seconds", "tokens_per_s", "mfu"}


def _values(out) -> list[dict]:
    return [{k: v for k, v in r.items() if k not in TIMING} for r in train_records(out)]


@pytest.mark.parametrize("layout", ["packed", "padded"])
def test_a_prefetching_run_equals_the_plain_run(tmp_path, base_model, train_jsonl, layout, monkeypatch):  # noqa: F811
    threads: set[str] = set()
    real = prefetch.prepare

    def recorded(*args, **kwargs):
        threads.add(threading.current_thread().name)
        return real(*args, **kwargs)

    monkeypatch.setattr(prefetch, "prepare", recorded)
    outs = {}
    for setting in ("off", "on"):
        threads.clear()
        outs[setting] = tmp_path / setting
        run_training(*flags(base_model, train_jsonl, outs[setting], tmp_path / "cache", "--max-steps", "4",
                            "--grad-accum", "2", "--batch-size", "2", "--train.layout", layout,
                            "--train.prefetch", setting))
        on_thread = {name for name in threads if name.startswith("dpocache-prefetch")}
        assert bool(on_thread) == (setting == "on"), threads  # the switch is what decides where layouts are built
        assert run_json(outs[setting])["policy"]["prefetch"] == (setting == "on")
    plain, ahead = _values(outs["off"]), _values(outs["on"])
    assert len(plain) == 4 and plain == ahead  # every logged value, bit for bit
    weights = [load_tensors(outs[s] / "final" / "model.safetensors") for s in ("off", "on")]
    assert max_abs_diff(*weights) == 0.0


class _Run:
    """What ``Prefetcher`` reads of a run, with ``prepare`` replaced by a record of its calls."""

    class cfg:
        class train:
            grad_accum = 2

    total_steps = 3

    class env:
        device = torch.device("cpu")


def test_the_prefetcher_serves_the_loop_order_a_resumed_start_and_stops(monkeypatch):
    made = []
    monkeypatch.setattr(Prefetcher, "_prepare", lambda self, step, micro: made.append((step, micro)) or (step, micro))
    batches = Prefetcher(_Run(), background=True)
    try:
        order = [(s, m) for s in range(3) for m in range(2)]
        assert [batches.get(s, m) for s, m in order] == order
        assert sorted(made) == order  # each laid out once, none past the last step
        made.clear()
        assert batches.get(1, 1) == (1, 1)  # a loop restarted at another step (a resume) gets its own
        assert batches.get(2, 0) == (2, 0)
        assert made.count((1, 1)) == 1 and made.count((2, 0)) == 1
    finally:
        batches.close()
    assert batches.pool is None and not batches.pending
    plain = Prefetcher(_Run(), background=False)
    assert plain.get(0, 1) == (0, 1) and not plain.pending  # nothing ahead, nothing on a thread


def test_auto_prefetches_on_cuda_only():
    assert prefetching("auto", torch.device("cuda")) and not prefetching("auto", torch.device("cpu"))
    assert prefetching("on", torch.device("cpu")) and not prefetching("off", torch.device("cuda"))
    with pytest.raises(ValueError, match="train.prefetch"):
        prefetching("always", torch.device("cpu"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_a_prefetching_run_equals_the_plain_run_from_pinned_memory(tmp_path, base_model,  # noqa: F811
                                                                          train_jsonl, monkeypatch):  # noqa: F811
    """The prefetching step equals the plain step exactly in what it is given: every tensor of
    every micro-batch, in the same order. Its values then agree exactly at step 1 (the same
    weights, the same batch) and to float rounding after it: a GPU's backward is not bitwise
    reproducible (its kernels add in an order of their own; on an H200 the two runs' grad norms
    differed at step 3 by 2e-5 relative)."""
    pinned, seen = [], {"off": [], "on": []}
    real = prefetch.prepare

    def recorded(*args, **kwargs):
        batch = real(*args, **kwargs)
        pinned.append(batch.laid.batch.input_ids.is_pinned())
        batch.laid.batch._map(lambda t: seen[setting].append(t.tolist()) or t)  # every tensor of the layout
        if batch.ref is not None:
            batch.ref.map(lambda t: seen[setting].append(t.tolist()) or t)  # and of the reference values
        return batch

    monkeypatch.setattr(prefetch, "prepare", recorded)
    outs = {}
    for setting in ("off", "on"):
        outs[setting] = tmp_path / setting
        run_training(*flags(base_model, train_jsonl, outs[setting], tmp_path / "cache", "--max-steps", "4",
                            "--grad-accum", "2", "--batch-size", "2", "--device", "cuda", "--dtype", "bfloat16",
                            "--train.prefetch", setting))
    assert any(pinned) and not all(pinned)  # "on" pinned its batches, "off" did not
    assert seen["off"] and seen["off"] == seen["on"]
    off, on = _values(outs["off"]), _values(outs["on"])
    assert off[0] == on[0] and len(off) == len(on)
    for a, b in zip(off[1:], on[1:]):
        assert a.keys() == b.keys()
        for key, value in a.items():  # numbers to float rounding, anything else exactly
            expected = pytest.approx(b[key], rel=1e-3, abs=1e-5) if isinstance(value, float) else b[key]
            assert value == expected, (a["step"], key)
    weights = [load_tensors(outs[s] / "final" / "model.safetensors") for s in ("off", "on")]
    for name, w in weights[0].items():
        assert (w.float() - weights[1][name].float()).norm() <= 1e-3 * w.float().norm() + 1e-6, name


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("options", [(), ("--lora-r", "4", "--gradient-checkpointing", "true")],
                         ids=["full", "lora-checkpointed"])
def test_on_cuda_a_step_waits_for_the_device_only_for_the_divergence_check(tmp_path, base_model,  # noqa: F811
                                                                          train_jsonl, monkeypatch,  # noqa: F811
                                                                          options):
    """torch's own sync detector (``set_sync_debug_mode``) sees every wait, those inside torch
    (a ``nonzero``, a boolean index, a pageable copy) included, which ``test_metric_syncs``'s
    counter of dpocache's calls cannot. Watched: each step and the loop's decision after it."""
    import warnings

    from dpocache.training import loop as train_mod

    per_step = []

    def watched(real, new_step: bool):
        def call(*args):
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("warn")
            try:
                with warnings.catch_warnings(record=True) as seen:
                    warnings.simplefilter("always")
                    return real(*args)
            finally:
                torch.cuda.set_sync_debug_mode("default")
                waits = [str(w.message) for w in seen if "synchroniz" in str(w.message)]
                per_step.append(waits) if new_step else per_step[-1].extend(waits)

        return call

    monkeypatch.setattr(train_mod, "train_step", watched(train_mod.train_step, True))
    monkeypatch.setattr(train_mod, "_save_or_stop", watched(train_mod._save_or_stop, False))
    run_training(*flags(base_model, train_jsonl, tmp_path / "run", tmp_path / "cache", "--max-steps", "4",
                        "--grad-accum", "2", "--batch-size", "2", "--device", "cuda", "--dtype", "bfloat16",
                        "--logging-steps", "4", *options))
    # Step 1 audits the cache (training.audit); after it, one wait: the NaN flag, the gradient
    # norm and the last step's weights' norm together.
    assert len(per_step) == 4 and all(len(waits) == 1 for waits in per_step[1:]), per_step
