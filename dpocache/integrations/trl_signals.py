"""Stop signals inside a TRL trainer's ``train()``, as ``dpocache train`` takes them.

A ``transformers.Trainer`` installs no signal handlers: SIGTERM (Slurm, Kubernetes, ``timeout``),
SIGUSR1 (Slurm's ``--signal=USR1@SECONDS`` ahead of its time limit) and SIGHUP kill the process
at once, and every step since the last checkpoint is lost. ``CachedDPOTrainer.train`` and
``CachedGRPOTrainer.train`` route them (and Ctrl-C's SIGINT) to ``runtime.signals``: the step
that is running finishes, a checkpoint of it is saved (``output_dir/checkpoint-N``, whatever
``save_strategy`` says), no evaluation is started, and ``Interrupted`` is raised naming the
checkpoint; ``train(resume_from_checkpoint=True)`` continues from it. A signal on any process of a
distributed run stops every process at the same step. A handler the caller installed for one of
these signals is left as it is (Ray's SIGTERM handler, a bare ``sys.exit``, is not the caller's),
and so is a signal set to be ignored.
"""

from __future__ import annotations

import os
import signal
from typing import Any, Callable

import torch

from dpocache.runtime.signals import STOP_SIGNALS, StopRequest, stop_signals

try:  # imported by the TRL trainers' modules only, after TRL (which imports transformers)
    from transformers import TrainerCallback
except ImportError as e:
    raise ImportError("dpocache.integrations.trl_signals needs TRL 1.16: pip install 'dpocache[trl]'") from e

# What Python installs for SIGINT (KeyboardInterrupt) counts as untouched, as SIG_DFL does.
_UNTOUCHED = (signal.SIG_DFL, signal.default_int_handler)


def _replaceable(handler: Any) -> bool:
    """A handler this may take over during training: Python's defaults, and the one ``ray.init``
    installs for SIGTERM in the driver (``sys.exit``, at whatever point the signal lands: a
    ``ReferencePool``'s trainer would lose its steps as if killed). The caller's own are kept."""
    return handler in _UNTOUCHED or str(getattr(handler, "__module__", "")).startswith("ray.")


def _agreed(signum: int, device: torch.device) -> int:
    """The signal any process received (the largest number), the same on every process."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()) \
            or torch.distributed.get_world_size() == 1:
        return signum
    if torch.distributed.get_backend() == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    flag = torch.tensor([signum], dtype=torch.int32, device=device)
    torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
    return int(flag.item())


class StopAtStepEnd(TrainerCallback):
    """At the end of each optimizer step, if a stop signal arrived on any process: save a
    checkpoint of this step, start no evaluation, stop training. One all-reduce of one integer a
    step in a distributed run, so that every process stops at the same step (a process that went
    on alone would wait for the others in its next collective)."""

    def __init__(self, stop: StopRequest):
        self.stop = stop
        self.signum = 0  # the agreed signal, once training stops for one
        self.step = 0

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        self.signum = _agreed(self.stop.signum or 0, args.device)
        if self.signum:
            self.step = state.global_step
            control.should_save = True
            control.should_evaluate = False
            control.should_training_stop = True
        return control

    def on_epoch_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        if self.signum:  # the step's checkpoint is saved; the epoch's end adds nothing to wait for
            control.should_save = False
            control.should_evaluate = False
        return control


def train_until_signal(trainer: Any, train: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``train(*args, **kwargs)`` (the trainer's ``Trainer.train``) with the stop signals routed
    to a ``StopAtStepEnd`` callback; ``Interrupted`` once a signal stopped it at a checkpoint."""
    signals = tuple(s for s in STOP_SIGNALS if _replaceable(signal.getsignal(s)))
    with stop_signals(signals) as stop, stop.deferred():
        callback = StopAtStepEnd(stop)
        trainer.add_callback(callback)
        try:
            output = train(*args, **kwargs)
        finally:
            trainer.remove_callback(callback)
        signum, step = callback.signum, callback.step
        if not signum:
            # After the last step's end (its evaluation, its save): the training is complete, and
            # is saved too before stopping, so that the caller's own save is not needed.
            signum, step = _agreed(stop.signum or 0, trainer.args.device), trainer.state.global_step
            if signum and not os.path.isdir(_checkpoint(trainer, step)):
                trainer._save_checkpoint(trainer.model, trial=None)
        if signum:
            raise stop.interrupted(f"step {step} finished and saved in {_checkpoint(trainer, step)}; "
                                   "trainer.train(resume_from_checkpoint=True) continues from it", signum=signum)
    return output


def _checkpoint(trainer: Any, step: int) -> str:
    """Where ``Trainer._save_checkpoint`` saves step ``step``."""
    return os.path.join(trainer.args.output_dir, f"checkpoint-{step}")
