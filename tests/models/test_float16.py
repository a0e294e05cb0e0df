"""float16 training: the loss is scaled before backward (dpocache.models.policy.build_grad_scaler), so
gradients below float16's range are not lost, steps whose gradients overflow are skipped, and
the scale is part of a checkpoint (resume stays exact)."""

from __future__ import annotations

import json

import pytest
import torch
from train_fixtures import (  # noqa: F401  (fixtures are used by name; one_thread is autouse)
    base_model, flags, interrupted_then_resumed, load_tensors, max_abs_diff, one_thread, run_training, train_jsonl,
    train_records,
)

from dpocache.models.checkpoint import STATE_FILE
from dpocache.training import divergence
from dpocache.training import loop as train_mod
from dpocache.training import setup as setup_mod

# With beta 1e-7 the loss's gradient is about 5e-8 per pair: below float16's smallest subnormal
# (6e-8) once it meets the model's weights, so unscaled float16 backward rounds all of it to 0.
TINY_BETA = ("--beta", "1e-7")
# A first scale far too large for the tiny model's gradients: float16 overflows at the first
# steps, each skipped with the scale halved, until it fits.
HUGE_SCALE = 2.0 ** 21


def _fp16(*extra: str) -> tuple[str, ...]:
    return ("--dtype", "float16", *extra)


def _scaler_starting_at(scale: float):
    return lambda dtype, device, sharded: torch.amp.GradScaler(device.type, init_scale=scale)


def test_float16_gradients_match_float32_where_unscaled_float16_loses_them(tmp_path, base_model, train_jsonl,
                                                                             monkeypatch):
    cache = tmp_path / "cache"
    runs = {}
    for name, extra in (("fp32", ()), ("fp16", _fp16())):
        run_training(*flags(base_model, train_jsonl, tmp_path / name, cache, "--max-steps", "2", *TINY_BETA, *extra))
        runs[name] = [r["grad_norm"] for r in train_records(tmp_path / name)]
    assert min(runs["fp32"]) > 1e-7
    assert runs["fp16"] == pytest.approx(runs["fp32"], rel=1e-3)

    # The same run without the scaler: every gradient underflows (what the scaler is for).
    monkeypatch.setattr(setup_mod, "build_grad_scaler", lambda *args: None)
    run_training(*flags(base_model, train_jsonl, tmp_path / "unscaled", cache, "--max-steps", "2", *TINY_BETA,
                        *_fp16()))
    assert [r["grad_norm"] for r in train_records(tmp_path / "unscaled")] == [0.0, 0.0]


def test_float16_overflow_skips_the_update_and_halves_the_scale(tmp_path, base_model, train_jsonl, monkeypatch):
    monkeypatch.setattr(setup_mod, "build_grad_scaler", _scaler_starting_at(HUGE_SCALE))
    out = tmp_path / "run"
    run_training(*flags(base_model, train_jsonl, out, tmp_path / "cache", "--max-steps", "6", "--save-steps", "6",
                        "--optim.warmup_ratio", "0.5", *_fp16()))
    rows = train_records(out)
    skipped = [r["skipped_fraction"] for r in rows]
    k = skipped.index(0.0)
    assert 1 <= k < 6 and skipped == [1.0] * k + [0.0] * (6 - k), skipped
    assert all("grad_norm" not in r for r in rows[:k]) and all(r["grad_norm"] > 0 for r in rows[k:])
    # The warm-up waits for the first update: its learning rate is step 1's.
    assert rows[k]["lr"] == rows[0]["lr"] < rows[k + 1]["lr"]
    state = json.loads((out / "checkpoints" / "step-000006" / STATE_FILE).read_text())
    assert state["grad_scaler"]["scale"] == HUGE_SCALE / 2 ** k


def test_float16_weights_unchanged_by_a_skipped_step(tmp_path, base_model, train_jsonl, monkeypatch):
    monkeypatch.setattr(setup_mod, "build_grad_scaler", _scaler_starting_at(2.0 ** 60))
    out = tmp_path / "run"
    run_training(*flags(base_model, train_jsonl, out, tmp_path / "cache", "--max-steps", "1", *_fp16()))
    assert train_records(out)[0]["skipped_fraction"] == 1.0
    assert max_abs_diff(load_tensors(out / "final" / "model.safetensors"),
                        load_tensors(base_model / "model.safetensors")) == 0.0


def test_float16_gradients_that_always_overflow_stop_the_run(tmp_path, base_model, train_jsonl, monkeypatch):
    monkeypatch.setattr(setup_mod, "build_grad_scaler", _scaler_starting_at(2.0 ** 100))
    monkeypatch.setattr(divergence, "OVERFLOW_STEPS", 3)
    with pytest.raises(train_mod.TrainingDiverged) as err:
        run_training(*flags(base_model, train_jsonl, tmp_path / "run", tmp_path / "cache", "--max-steps", "6",
                            *_fp16()))
    assert "step 3: the float16 gradients overflowed at 3 consecutive steps" in str(err.value)


def test_float16_resume_restores_the_scale_and_matches_an_uninterrupted_run(tmp_path, base_model, train_jsonl,
                                                                             monkeypatch):
    """Skipped steps before the step-4 checkpoint leave the scale below its start; a resume that
    began again at the first scale would skip other steps and part from the uninterrupted run."""
    monkeypatch.setattr(setup_mod, "build_grad_scaler", _scaler_starting_at(HUGE_SCALE))
    a, b = interrupted_then_resumed(tmp_path, base_model, train_jsonl, tmp_path / "cache", *_fp16())
    saved = json.loads((b / "checkpoints" / "step-000004" / STATE_FILE).read_text())["grad_scaler"]["scale"]
    assert saved < HUGE_SCALE
    ra, rb = train_records(a), train_records(b)
    assert [r["step"] for r in rb] == list(range(1, 9))
    for x, y in zip(ra, rb):
        for key in ("loss", "lr", "skipped_fraction", "rewards/margins"):
            assert y[key] == pytest.approx(x[key], abs=1e-6, rel=0), (x["step"], key)
    assert max_abs_diff(load_tensors(a / "final" / "model.safetensors"),
                        load_tensors(b / "final" / "model.safetensors")) <= 1e-6
