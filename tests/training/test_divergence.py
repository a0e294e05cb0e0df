"""Divergence: a NaN loss names its source (the cache or the policy); runs that go wrong without
a NaN (gradient exactly 0 for many steps, weights growing without bound) stop too."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from train_fixtures import (  # noqa: F401  (fixtures are used by name; one_thread is autouse)
    base_model, flags, one_thread, records, run_training, train_jsonl,
)

from dpocache.cache import CacheStore, namespace_for_dir
from dpocache.cli.entry import main as cli_main
from dpocache.data.order import training_order
from dpocache.data.pairs import load_preference_data
from dpocache.models.loading import load_tokenizer
from dpocache.training import divergence
from dpocache.training import loop as train_mod
from dpocache.training import objective as objective_mod
from dpocache.training import setup as setup_mod


def test_monitor_counts_consecutive_zero_gradients():
    w = torch.nn.Parameter(torch.ones(4))
    monitor = divergence.ProgressMonitor([w], zero_grad_steps=3, weight_growth=10.0)
    assert [monitor.check(g) for g in (0.0, 0.0, 1e-30, 0.0, 0.0)] == [None] * 5  # the streak restarts
    assert "exactly 0 for 3 consecutive steps" in monitor.check(0.0)


def test_monitor_judges_the_weights_norm_it_measured_when_read():
    w = torch.nn.Parameter(torch.ones(4))
    grown = divergence.ProgressMonitor([w], weight_growth=10.0)
    assert grown.pending is None and grown.settle() is None  # nothing measured yet
    with torch.no_grad():
        w.mul_(9.0)
    grown.measure(1)
    assert grown.measured_step == 1 and grown.judge(float(grown.pending)) is None  # 9 times the start: within
    assert grown.pending is None  # consumed
    with torch.no_grad():
        w.mul_(2.0)
    grown.measure(2)
    with torch.no_grad():
        w.mul_(0.0)  # what the weights do after the measurement does not change it
    assert "growing without bound" in grown.settle() and grown.measured_step == 2
    with torch.no_grad():
        w.fill_(1.0)
        w[0] = float("inf")
    grown.measure(3)
    assert "growing without bound" in grown.settle()


def test_gradient_exactly_zero_for_many_steps_stops(tmp_path, base_model, train_jsonl, monkeypatch):
    """A loss with no gradient (here: multiplied by 0) never produces a NaN; the run still stops."""
    real = objective_mod.preference_loss

    def flat(*args, **kwargs):
        losses, rc, rr = real(*args, **kwargs)
        return losses * 0.0, rc, rr

    monkeypatch.setattr(objective_mod, "preference_loss", flat)
    monkeypatch.setattr(divergence, "ZERO_GRAD_STEPS", 3)
    out = tmp_path / "run"
    with pytest.raises(train_mod.TrainingDiverged) as err:
        run_training(*flags(base_model, train_jsonl, out, tmp_path / "cache", "--max-steps", "6"))
    assert "step 3: the gradient norm has been exactly 0 for 3 consecutive steps" in str(err.value)
    assert not (out / "final").exists()


@pytest.mark.parametrize("max_steps,logging_steps", [(3, 1), (3, 10), (1, 10)],
                         ids=["logged-step", "next-step-reads-it", "last-step"])
def test_weights_growing_without_bound_stop(tmp_path, base_model, train_jsonl, capsys, max_steps, logging_steps):
    """An update far too large (lr 1e3 with Adam moves every weight by about 1e3 at once) is
    caught after the step that made it, before any NaN, and before its weights are logged or
    saved: read before a log (or the last step's save), else with the next step's one wait."""
    out = tmp_path / "run"
    argv = flags(base_model, train_jsonl, out, tmp_path / "cache", "--max-steps", str(max_steps), "--lr", "1e3",
                 "--optim.max_grad_norm", "0", "--logging-steps", str(logging_steps))
    capsys.readouterr()
    assert cli_main(["train", *argv]) == 1
    err = capsys.readouterr().err
    assert "step 1: the trainable weights' norm is" in err and "growing without bound" in err
    rows = records(out) if (out / "metrics.jsonl").exists() else []
    assert not [r for r in rows if "loss" in r]  # no training row logged
    assert not (out / "final").exists() and not list(out.glob("checkpoint-*"))


class _InfiniteGradient(torch.autograd.Function):
    """The identity forward, an infinite gradient backward: a finite loss whose gradient overflowed."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad * float("inf")


def test_a_finite_loss_with_a_non_finite_gradient_stops_before_the_update(tmp_path, base_model, train_jsonl,
                                                                         monkeypatch):
    """The update is never applied: before, it wrote NaN into every weight and the run stopped
    one check later blaming the weights' growth."""
    real = objective_mod.preference_loss

    def overflowing(*args, **kwargs):
        losses, rc, rr = real(*args, **kwargs)
        return _InfiniteGradient.apply(losses), rc, rr

    monkeypatch.setattr(objective_mod, "preference_loss", overflowing)
    with pytest.raises(train_mod.TrainingDiverged) as err:
        run_training(*flags(base_model, train_jsonl, tmp_path / "run", tmp_path / "cache", "--max-steps", "2"))
    message = str(err.value)
    assert message.startswith("step 1: the gradient norm is") and "not finite) while the loss is finite" in message
    assert "growing without bound" not in message


def test_nan_from_the_cache_is_named(tmp_path, base_model, train_jsonl, monkeypatch):
    """A NaN cached value in step 2's batch (past the step-0 audit) is blamed on the cache.

    The store refuses to write or load a non-finite value (tests/test_cache_integrity.py), so the
    NaN is put into the values training received from it: the check is the last line of defence."""
    cache = tmp_path / "cache"
    argv = ["cache", "build", "--model", str(base_model), "--data", str(train_jsonl), "--cache-dir", str(cache),
            "--dtype", "float32", "--device", "cpu", "--max-length", "64"]
    assert cli_main(argv) == 0
    pairs = load_preference_data(train_jsonl, load_tokenizer(base_model), 64, show_progress=False).pairs
    store = CacheStore(cache, namespace_for_dir(base_model, torch.float32, cache)).open()
    target = pairs[training_order(len(pairs), 42, 0)[4]]  # the first pair of step 2 (batch 4, seed 42)
    real = setup_mod.prepare_reference

    def poisoned(*args, **kwargs):
        train_values, eval_values, info = real(*args, **kwargs)
        train_values.chosen_logps[target.index] = float("nan")
        return train_values, eval_values, info

    monkeypatch.setattr(setup_mod, "prepare_reference", poisoned)
    with pytest.raises(train_mod.TrainingDiverged) as err:
        run_training(*flags(base_model, train_jsonl, tmp_path / "run", cache, "--max-steps", "3"))
    message = str(err.value)
    print("\n" + message)
    assert message.startswith("step 2:") and "not finite" in message
    assert f"the cached reference values are not finite (rows {target.index})" in message and str(store.dir) in message
    assert "policy's log-probs are not finite" not in message


def test_nan_from_the_policy_is_named(tmp_path, base_model, train_jsonl):
    """A policy with a NaN weight against a clean reference: the NaN is the policy's."""
    from safetensors.torch import load_file, save_file

    policy = tmp_path / "policy"
    shutil.copytree(base_model, policy)
    weights = load_file(str(policy / "model.safetensors"))
    name = next(k for k in weights if k.endswith("layers.0.mlp.down_proj.weight"))
    weights[name][0, 0] = float("nan")
    save_file(weights, str(policy / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(train_mod.TrainingDiverged) as err:
        run_training(*flags(policy, train_jsonl, tmp_path / "run", tmp_path / "cache", "--max-steps", "2",
                            "--ref-model", str(Path(base_model))))
    message = str(err.value)
    assert message.startswith("step 1:") and "the policy's log-probs are not finite" in message
    assert "cached reference values are not finite" not in message
