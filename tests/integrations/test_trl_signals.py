"""Stop signals inside ``CachedGRPOTrainer.train`` and ``CachedDPOTrainer.train``
(``dpocache.integrations.trl_signals``): the running step finishes and is checkpointed,
``Interrupted`` names the checkpoint, and resuming from it ends where an uninterrupted run ends.
The process signals itself from a callback, in the middle of a step. Skipped without TRL."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("trl")

from train_fixtures import one_thread  # noqa: E402,F401

STEPS = 5


def _signal_during_step(step: int, signum: int):
    """A callback sending ``signum`` to this process once step ``step`` (1-based) has begun."""
    from transformers import TrainerCallback

    class SignalDuring(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            if state.global_step == step - 1:
                os.kill(os.getpid(), signum)

    return SignalDuring()


def _grpo(model_dir: Path, out: Path, callbacks=()):
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig

    from dpocache.integrations.trl_grpo import CachedGRPOTrainer
    from dpocache.training.demo import sorting_pairs

    args = GRPOConfig(output_dir=str(out), per_device_train_batch_size=8, num_generations=4, max_completion_length=8,
                      max_steps=STEPS, logging_steps=1, report_to=[], use_cpu=True, bf16=False, fp16=False, seed=0,
                      beta=0.04, learning_rate=1e-3, lr_scheduler_type="constant", save_strategy="no",
                      disable_tqdm=True)
    data = Dataset.from_list([{"prompt": row["prompt"]} for row in sorting_pairs(48, seed=3)])
    return CachedGRPOTrainer(model=AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
                             reward_funcs=lambda completions, **_: [float(len(c)) for c in completions], args=args,
                             train_dataset=data, processing_class=AutoTokenizer.from_pretrained(model_dir),
                             callbacks=list(callbacks))


def _dpo(model_dir: Path, rows: list[dict], out: Path, callbacks=()):
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import DPOConfig

    from dpocache.integrations.trl import CachedDPOTrainer

    args = DPOConfig(output_dir=str(out), per_device_train_batch_size=2, max_steps=STEPS, logging_steps=1,
                     report_to="none", use_cpu=True, max_length=24, learning_rate=1e-3, save_strategy="no",
                     bf16=False, fp16=False, seed=0, disable_tqdm=True)
    return CachedDPOTrainer(model=AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32), args=args,
                            train_dataset=Dataset.from_list(rows[:12]),
                            processing_class=AutoTokenizer.from_pretrained(model_dir),
                            cache_dir=out.parent / "cache", callbacks=list(callbacks))


def _losses(trainer) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in trainer.state.log_history if "loss" in r}


@pytest.mark.parametrize("trainer", ["grpo", "dpo"])
def test_a_signal_saves_the_running_step_and_resuming_ends_as_an_uninterrupted_run(
        tmp_path, model_dir, pref_rows, trainer):
    from dpocache.runtime.signals import Interrupted

    make = (lambda out, cbs=(): _grpo(model_dir, out, cbs)) if trainer == "grpo" else \
        (lambda out, cbs=(): _dpo(model_dir, pref_rows, out, cbs))
    whole = make(tmp_path / "whole")
    whole.train()

    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR1)}
    stopped = make(tmp_path / "stopped", [_signal_during_step(3, signal.SIGUSR1)])
    with pytest.raises(Interrupted) as raised:
        stopped.train()
    checkpoint = tmp_path / "stopped" / "checkpoint-3"
    assert raised.value.signum == signal.SIGUSR1 and raised.value.exit_code == 138
    assert str(raised.value) == (f"stopped by SIGUSR1: step 3 finished and saved in {checkpoint}; "
                                 "trainer.train(resume_from_checkpoint=True) continues from it")
    assert stopped.state.global_step == 3 and checkpoint.is_dir()  # no step past the signal's
    assert {s: signal.getsignal(s) for s in before} == before  # the handlers are given back

    resumed = make(tmp_path / "stopped")
    resumed.train(resume_from_checkpoint=True)
    assert resumed.state.global_step == STEPS
    want, got = _losses(whole), {**_losses(stopped), **_losses(resumed)}
    assert sorted(got) == list(range(1, STEPS + 1))
    assert max(abs(got[s] - want[s]) for s in want) <= 1e-5, (got, want)
    for (name, a), b in zip(whole.model.named_parameters(), resumed.model.parameters()):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, msg=name)


def _ray_sigterm_handler(signum, frame):
    sys.exit(signum)  # what ray.init installs in the driver (ray._private.worker's sigterm_handler)


_ray_sigterm_handler.__module__ = "ray._private.worker"


@pytest.mark.parametrize("handler", ["default", "ray's"])
def test_a_signal_after_the_last_step_saves_it(tmp_path, model_dir, handler):
    """After the last step's end (here: in the callbacks at the end of training) the training is
    complete; it is saved before stopping, so the caller's own save that a stop skips is not needed.
    The SIGTERM handler ray.init leaves in the driver (a ReferencePool's trainer) is taken over
    too: it exited at whatever point the signal landed."""
    from transformers import TrainerCallback

    from dpocache.runtime.signals import Interrupted

    class SignalAtEnd(TrainerCallback):
        def on_train_end(self, args, state, control, **kwargs):
            os.kill(os.getpid(), signal.SIGTERM)

    installed = signal.SIG_DFL if handler == "default" else _ray_sigterm_handler
    previous = signal.signal(signal.SIGTERM, installed)
    try:
        trainer = _grpo(model_dir, tmp_path / "run", [SignalAtEnd()])
        with pytest.raises(Interrupted, match=f"step {STEPS} finished and saved in .*checkpoint-{STEPS};"):
            trainer.train()
        assert signal.getsignal(signal.SIGTERM) is installed  # given back
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert (tmp_path / "run" / f"checkpoint-{STEPS}" / "trainer_state.json").is_file()


def test_a_handler_of_the_callers_own_is_left_in_place(tmp_path, model_dir):
    """A SIGUSR1 handler the caller installed still gets the signal; training goes on."""
    received = []
    previous = signal.signal(signal.SIGUSR1, lambda signum, frame: received.append(signum))
    try:
        trainer = _grpo(model_dir, tmp_path / "run", [_signal_during_step(2, signal.SIGUSR1)])
        trainer.train()
    finally:
        signal.signal(signal.SIGUSR1, previous)
    assert received == [signal.SIGUSR1] and trainer.state.global_step == STEPS
