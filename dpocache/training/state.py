"""A training run's state, one record from setup to the end (``Run``), and what several of the
training modules read off it."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from dpocache.config import Config
from dpocache.data.pairs import PreferenceData
from dpocache.data.values import PairValues
from dpocache.distributed.process_group import (
    DistEnv,
)
from dpocache.models.checkpoint import (
    latest_checkpoint,
)
from dpocache.scoring.compiling import CompilerMark
from dpocache.scoring.layout_choice import LayoutChoice
from dpocache.training.divergence import ProgressMonitor
from dpocache.training.metrics import (
    MetricsWriter,
)


class TrainingDiverged(RuntimeError):
    pass


@dataclass
class Run:
    cfg: Config
    env: DistEnv
    out: Path
    dtype: torch.dtype
    tokenizer: object
    train_data: PreferenceData
    eval_data: PreferenceData | None
    ref_train: PairValues | None  # cached reference values of every train pair (N,), on the CPU
    ref_eval: PairValues | None
    spec: object  # losses.LossSpec
    policy: torch.nn.Module  # the (PEFT-wrapped) causal LM, for saving
    scorer: torch.nn.Module  # CompletionLogProbs over the policy, DDP/FSDP-wrapped when distributed
    optimizer: torch.optim.Optimizer
    scheduler: object
    total_steps: int
    steps_per_epoch: int
    writer: MetricsWriter
    layout: LayoutChoice  # the layout the scorer runs (dpocache.scoring.layout_choice)
    compiled_layers: int = 0  # the policy's decoder layers compiled (--compile on; dpocache.scoring.compiling)
    compiler_at_start: CompilerMark | None = None  # the compiler before the policy compiled (None: not compiled)
    scaler: torch.amp.GradScaler | None = None  # float16 only: the loss scaler (policy.build_grad_scaler)
    info: dict = field(default_factory=dict)  # what run.json records
    inputs: dict = field(default_factory=dict)  # what checkpoints record of the data and reference (ResumedFrom)
    step: int = 0
    saved_step: int | None = None  # the step of the newest checkpoint (None: none yet)
    saved_at: float = 0.0  # _clock() at the newest checkpoint (or the start of the loop)
    audit_step0: bool = False  # compare the first micro-batch's log-probs with the cache (dpocache.training.audit)
    monitor: ProgressMonitor | None = None  # gradient and weight norms after each step (dpocache.training.divergence)
    # This step's micro-batches so far: (pairs, policy chosen, policy rejected, ref chosen, ref rejected), detached.
    step_batches: list = field(default_factory=list)
    lock: object = None  # rank 0: the output directory's runtime.run_lock.OutputDirLock, released at the end
    batches: object = None  # the training micro-batches, laid out ahead (dpocache.training.prefetch.Prefetcher)
    # The parameters the optimizer steps, in the model's order (their norm clipped and watched),
    # listed once: listing them every step walked every parameter of the policy (a 32-layer
    # LoRA Llama's 739: 3-7 ms of host time on a 2-core CPU,
    # docs/benchmarks/host-step-cpu-2core-20261127.md).
    trainable: list = field(default_factory=list)


def global_batch(run: Run) -> int:
    return run.cfg.train.batch_size * run.cfg.train.grad_accum * run.env.world_size


def is_sharded(run: Run) -> bool:
    return run.cfg.distributed.fsdp and run.env.enabled


def last_good(run: Run) -> str:
    last = latest_checkpoint(run.out)
    return f"the last good checkpoint is {last if last else 'none (no checkpoint was saved yet)'}"


def write_run_json(run: Run) -> None:
    if run.env.is_main:
        info = {k: v for k, v in run.info.items() if not k.startswith("_")}
        (run.out / "run.json").write_text(json.dumps(info, indent=1, default=str))
