"""The training loop: setup → (train_step → log → evaluate → checkpoint)* → save. Read top to
bottom.

Beside it: ``setup`` (everything before the first step), ``cached_reference`` (the reference
values from the cache, what is missing built first, and the step-0 audit), ``resume``,
``objective`` (one micro-batch's forward, loss and metrics), ``checkpoints`` (checkpoints,
``final/``, ``run.json``) and ``state`` (the ``Run`` record they share).

The reference model never runs here. Before the first step every training (and eval) pair
must have a cached reference value; what is missing is built by ``dpocache.cache`` (from
``model.ref_model`` if given, else the initial policy's weights), and the reference model is
freed before the policy is loaded. ``run.json`` records where the values came from and that no
reference forward pass ran during training. When the policy starts from the reference's
weights, its first micro-batch's log-probs are reference log-probs: they audit the cache
(``training.audit``). A run that diverges, with a NaN or without, stops (``training.divergence``).
"""

from __future__ import annotations

import contextlib
import math
import time
from typing import NoReturn

import torch
from tqdm.auto import tqdm

from dpocache.config import Config
from dpocache.distributed.process_group import (
    all_reduce_max,
    broadcast_object,
    destroy,
)
from dpocache.models.checkpoint import (
    checkpoint_dir,
)
from dpocache.runtime.allocator import configure_cpu_allocator, configure_cuda_allocator
from dpocache.runtime.signals import Interrupted, StopRequest, stop_signals
from dpocache.training import divergence
from dpocache.training.checkpoints import finish, save, save_final
from dpocache.training.divergence import ProgressMonitor
from dpocache.training.metrics import (
    MetricWindow,
    count_params,
    measured_peak_flops,
    model_shape,
    train_flops_per_token,
)
from dpocache.training.objective import batch_losses
from dpocache.training.prefetch import prepare
from dpocache.training.setup import setup
from dpocache.training.state import Run, TrainingDiverged, is_sharded, last_good, write_run_json


def train_step(run: Run, window: MetricWindow) -> None:
    """One optimizer step over ``grad_accum`` micro-batches.

    No micro-batch waits for the device: the metrics stay device tensors until the logging step
    (``MetricWindow``), and whether a loss was finite is kept as a device flag. The step waits
    once, before the optimizer step, for that flag (reduced over ranks), the gradient norm and
    the norm of the weights the last step left, together: stopping on a NaN, a runaway norm or
    weights growing without bound is a host decision, made before any weight changes
    (``dpocache.training.divergence``). The weights' norm after this step's update is queued,
    not read (``ProgressMonitor.measure``)."""
    cfg = run.cfg.train
    if not run.scorer.training:  # after an eval (evaluate); setup set the mode for the first step
        run.scorer.train()
    params = run.trainable
    if run.monitor is None:
        run.monitor = ProgressMonitor(params)  # the norm of the weights the run starts (or resumes) from
    run.step_batches, losses_seen = [], []
    for micro in range(cfg.grad_accum):
        batch = run.batches.get(run.step, micro)
        sync = micro == cfg.grad_accum - 1
        with _no_sync(run.scorer, sync):
            audit_now = run.audit_step0 and micro == 0
            losses, aux, inputs = batch_losses(run, batch, window, check_cache=audit_now)
            run.step_batches.append(inputs)
            loss = losses.mean()
            if aux is not None:  # MoE: the model's own router loss, with its own coefficient, as TRL adds it
                loss = loss + getattr(run.policy.config, "router_aux_loss_coef", 0.001) * aux
            loss = loss / cfg.grad_accum
            losses_seen.append(loss.detach())
            # A non-finite loss's gradients are computed but never applied: the check below
            # stops the run before the optimizer step.
            (loss if run.scaler is None else run.scaler.scale(loss)).backward()
    if run.scaler is not None:
        run.scaler.unscale_(run.optimizer)  # the norm, its clipping and the monitor see the true gradients
    max_norm = run.cfg.optim.max_grad_norm
    grad_norm = torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm > 0 else float("inf"))
    if hasattr(grad_norm, "full_tensor"):  # FSDP2: a DTensor; the norm over every rank's shard
        grad_norm = grad_norm.full_tensor()
    grad_norm = grad_norm.detach()
    not_finite = (~torch.isfinite(torch.stack(losses_seen))).any().double().reshape(1).to(run.env.device)
    not_finite = all_reduce_max(run.env, not_finite)  # every rank stops on any rank's NaN
    pending = run.monitor.pending  # the last step's weights' norm, read in the same wait
    read = [not_finite, grad_norm.double().reshape(1).to(run.env.device)] + ([pending] if pending is not None else [])
    not_finite, norm, *weights = torch.cat(read).tolist()  # the step's one sync
    if weights:
        _stop_if_grown(run, run.monitor.judge(weights[0]))
    if not_finite:
        _stop_non_finite(run, losses_seen)
    if run.scaler is None and not math.isfinite(norm):
        # A finite loss whose gradient overflowed (a bfloat16 backward, a loss at the edge of its
        # range): the update would write NaN into every weight, and the monitor would then blame
        # the weights' growth. float16's scaler skips such a step instead (_apply_update).
        raise TrainingDiverged(f"step {run.step + 1}: the gradient norm is {norm} (not finite) while the loss is "
                               f"finite. Stopped before the update, without saving; {last_good(run)}. Try "
                               "--dtype float32, or another --beta or loss.")
    skipped = _apply_update(run, window, grad_norm, norm)
    run.optimizer.zero_grad(set_to_none=True)
    run.step += 1
    reason = run.monitor.check(norm, skipped)
    if reason is not None:
        raise TrainingDiverged(f"step {run.step}: {reason}. Stopped without saving; {last_good(run)}. "
                               "Try a lower --lr, or another --beta or loss.")
    run.monitor.measure(run.step)


def _stop_if_grown(run: Run, reason: str | None) -> None:
    """Stop on the weights' norm the monitor judged (``reason``: why, or None), naming the step
    whose update grew them: its weights are neither saved nor evaluated."""
    if reason is not None:
        raise TrainingDiverged(f"step {run.monitor.measured_step}: {reason}. Stopped without saving; "
                               f"{last_good(run)}. Try a lower --lr, or another --beta or loss.")


def _settle(run: Run) -> None:
    """Judge the weights the last step left now (one wait for the device), before they are
    logged, saved or evaluated; nothing is pending before the first step."""
    if run.monitor is not None:
        _stop_if_grown(run, run.monitor.settle())


def _apply_update(run: Run, window: MetricWindow, grad_norm: torch.Tensor, norm: float) -> bool:
    """The optimizer and schedule step after the gradients are clipped; ``grad_norm`` is their
    norm as a device scalar, ``norm`` the same on the host. Returns whether the update was
    skipped: float16 gradients that overflowed (their unscaled norm is not finite) skip it and
    halve the loss scale; the schedule waits for the next update, as in Hugging Face's Trainer.
    The step still counts (its pairs were seen)."""
    skipped = run.scaler is not None and not math.isfinite(norm)
    if not skipped:
        window.add("grad_norm", grad_norm, 1.0)
    window.set("lr", run.scheduler.get_last_lr()[0])  # the rate this step trains at: the window's last, not its mean
    if run.scaler is None:
        run.optimizer.step()
    else:
        window.add("skipped_fraction", float(skipped), 1.0)
        run.scaler.step(run.optimizer)  # skips the update itself when the gradients overflowed
        run.scaler.update()
    if not skipped:
        run.scheduler.step()
    return skipped


def _no_sync(scorer, sync: bool):
    if sync or not hasattr(scorer, "no_sync"):
        return contextlib.nullcontext()
    return scorer.no_sync()


def _stop_non_finite(run: Run, losses: list[torch.Tensor]) -> None:
    """Stop on a non-finite loss of this step (on some rank), naming where it came from
    (``dpocache.training.divergence``): every rank reports its first such micro-batch's sources, reduced
    so that all ranks stop with the same words. ``losses``: each micro-batch's scalar loss."""
    bad = next((i for i, loss in enumerate(losses) if not bool(torch.isfinite(loss))), None)
    finite = bad is None
    loss = losses[-1 if finite else bad]
    pairs, *values = run.step_batches[-1 if finite else bad]
    flags = [0.0, 0.0, 0.0] if finite else divergence.nan_flags(*values)
    reduced = all_reduce_max(run.env, torch.tensor([0.0 if finite else 1.0, *flags], device=run.env.device)).tolist()
    if reduced[0] > 0:
        rows = [] if finite else divergence.nan_rows(pairs, values)
        where = divergence.describe_nan(reduced[1:], run.info["reference"].get("cache_dir"), rows)
        cache_only = reduced[1 + divergence.CACHE] and not reduced[1 + divergence.POLICY]
        advice = "" if cache_only else " Try a lower --lr or --beta."
        raise TrainingDiverged(
            f"step {run.step + 1}: the loss is {float(loss)} (not finite): {where}. Stopped without saving; "
            f"{last_good(run)}.{advice}"
        )


@torch.no_grad()
def evaluate(run: Run, stop: StopRequest | None = None) -> dict[str, float]:
    """Loss, reward accuracy and margin on the eval set against its cached reference. With
    ``stop``, a stop signal on any rank ends it between batches, on every rank together (an
    eval can outlast the grace period of torchrun or Slurm before their SIGKILL):
    ``Interrupted`` is raised and nothing is logged."""
    if run.eval_data is None:
        return {}
    run.scorer.eval()
    window = MetricWindow()
    n, env = len(run.eval_data), run.env
    bs = run.cfg.train.eval_batch_size or run.cfg.train.batch_size
    mine = list(range(env.rank, n, env.world_size))  # each rank scores its stride of the set
    batches = math.ceil(math.ceil(n / env.world_size) / bs)  # the longest stride's count, the same on every rank
    for b in range(batches):
        if stop is not None:
            signum = stop.signum or 0
            if env.enabled:  # every rank stops at the same batch; one process needs no device sync for it
                signum = int(all_reduce_max(env, torch.tensor([float(signum)], device=env.device)).item())
            if signum:
                raise stop.interrupted(signum=signum)
        idx = mine[b * bs:(b + 1) * bs]
        if idx:
            batch_losses(run, prepare(run, run.eval_data, run.ref_eval, idx), window, prefix="eval/")
        elif is_sharded(run):
            # An FSDP forward is a collective (it all-gathers each layer): a rank whose stride is
            # one pair shorter still runs it, on any pair, and records nothing.
            batch_losses(run, prepare(run, run.eval_data, run.ref_eval, [0]), MetricWindow(), prefix="eval/")
    metrics = window.reduce(env)
    metrics.pop("eval/tokens", None)
    return metrics


def log_window(run: Run, window: MetricWindow, seconds: float, flops_per_token: float, peak: float) -> dict:
    m = window.reduce(run.env)
    tokens = m.pop("tokens", 0.0)  # all ranks'
    record = {"step": run.step, "epoch": run.step / run.steps_per_epoch, **m}
    record["tokens_per_s"] = tokens / seconds if seconds > 0 else 0.0
    record["seconds"] = seconds  # wall time of this logging window's steps
    # tokens_per_s counts every rank's tokens; peak is one device's: MFU is per device.
    record["mfu"] = record["tokens_per_s"] * flops_per_token / (peak * run.env.world_size) if peak > 0 else 0.0
    run.writer.write(record)
    window.clear()
    return record


def train(cfg: Config) -> dict:
    """Run a whole training job; returns the final summary (also written to run.json). Under
    torchrun every rank runs it; only rank 0 writes files, logs and progress bars. Sets the
    process's CPU allocator (``dpocache.runtime.allocator``) as the command line does.

    SIGTERM or SIGINT stops it after the optimizer step in flight, on every rank together: a
    checkpoint of that step is saved, then ``signals.Interrupted`` is raised (the command line
    exits 143 or 130); ``--resume`` continues exactly where it stopped."""
    configure_cpu_allocator()
    configure_cuda_allocator()
    with stop_signals() as stop:
        run = setup(cfg)
        env, lock = run.env, run.lock
        try:
            return _train(run, stop)
        finally:
            run.batches.close()  # its thread gone before the process group and the lock
            # The models (DDP's reducer, FSDP's state) hold the process group: gone first, so
            # that destroy ends the group while the interpreter is alive (``distributed.destroy``).
            run = None  # noqa: F841 - the last reference to the run
            destroy(env)
            if lock is not None:
                lock.release()  # the output directory is free for the next run


def _train(run: Run, stop: StopRequest) -> dict:
    cfg = run.cfg
    layers, hidden = model_shape(run.policy)
    mean_len = sum(p.num_tokens for p in run.train_data.pairs) / (2 * len(run.train_data))
    flops_per_token = train_flops_per_token(count_params(run.policy), layers, hidden, mean_len)
    write_run_json(run)
    # From here a signal only sets ``stop``; the loop acts on it between optimizer steps and
    # between eval batches. A checkpoint is saved before an eval, so an eval stopped loses nothing.
    with stop.deferred():
        bar = tqdm(total=run.total_steps, initial=run.step, desc="train", unit="step", dynamic_ncols=True,
                   disable=not (run.env.is_main and cfg.train.progress))
        if run.step == 0 or _eval_missed(run):
            _eval_or_stop(run, stop, bar)
        window, t0 = MetricWindow(), time.perf_counter()
        started = t0
        run.saved_at = _clock()
        while run.step < run.total_steps:
            train_step(run, window)
            bar.update(1)
            last = run.step == run.total_steps
            save_due, signum = _save_or_stop(run, stop)
            # A checkpointed step logs its partial window: a run resumed there keeps the rows up to
            # it and redoes only the steps after it, so the steps since the last log would be in
            # no row. (A stopped run saves too.)
            log_due = run.step % cfg.train.logging_steps == 0 or last or signum or save_due
            if log_due or _eval_due(run):
                _settle(run)
            if log_due:
                elapsed = time.perf_counter() - t0
                # Measured (0.5 s, once) at the first log rather than before the first step, so it
                # neither delays the start nor counts in a window's throughput.
                peak = measured_peak_flops(run.env.device, run.dtype)
                record = log_window(run, window, elapsed, flops_per_token, peak)
                bar.set_postfix(loss=f"{record['loss']:.4f}", acc=f"{record['rewards/accuracies']:.2f}",
                                tok_s=f"{record['tokens_per_s']:.0f}", refresh=False)
                t0 = time.perf_counter()
            if signum or (save_due and not last):
                _save(run)
            if signum:
                _stop(run, stop, signum, bar)
            if _eval_due(run) and not last:
                _eval_or_stop(run, stop, bar)
        # A run of no step (--max-steps 0: the evaluation, or the reference pass, alone) trained
        # nothing to save: a copy of the initial model would cost an 8B model's 16 GB for nothing.
        trained = run.total_steps > 0
        if trained and run.saved_step != run.step:
            _save(run)
        final_eval = _final_eval(run, stop, bar)
        bar.close()
        loop_s = time.perf_counter() - started  # steps, evals, saves: what a streamed run's waits are read against
        final_dir = save_final(run) if trained else None
        summary = finish(run, final_eval, final_dir, loop_s)
    run.writer.close()
    return summary


def _clock() -> float:
    """Seconds on a monotonic clock, for the time-interval checkpoints."""
    return time.monotonic()


def _save(run: Run) -> None:
    """A checkpoint of the step reached (``checkpoints.save``), and the clock of the time-interval saves restarted."""
    save(run)
    run.saved_step, run.saved_at = run.step, _clock()


def _save_or_stop(run: Run, stop: StopRequest) -> tuple[bool, int]:
    """(whether a checkpoint is due, the stop signal or 0), the same on every rank: ranks must
    save together (FSDP gathers) and stop together (a rank left in a collective waits forever).
    Rank 0's clock decides a time-interval save; a signal on any rank stops every rank. One
    process decides on the host alone: a device round trip here would make every step wait for
    its optimizer update."""
    cfg = run.cfg.train
    by_steps = bool(cfg.save_steps) and run.step % cfg.save_steps == 0
    by_time = run.env.is_main and bool(cfg.save_minutes) and _clock() - run.saved_at >= 60 * cfg.save_minutes
    flags = [float(by_time), float(stop.signum or 0)]
    if run.env.enabled:  # a collective, so it waits for the device
        flags = all_reduce_max(run.env, torch.tensor(flags, device=run.env.device)).tolist()
    by_time, signum = flags
    return by_steps or by_time > 0, int(signum)


def _stop(run: Run, stop: StopRequest, signum: int, bar) -> NoReturn:
    """Stop on a signal (every rank together): the step reached is checkpointed (if it is not
    yet), then ``Interrupted`` is raised."""
    bar.close()
    if run.step == 0:
        raise stop.interrupted("before the first step; nothing to save", signum)
    if run.saved_step != run.step:
        _save(run)
    raise stop.interrupted(f"checkpoint of step {run.step} of {run.total_steps} saved in "
                           f"{checkpoint_dir(run.out, run.step)}; continue with --resume", signum)


def _eval_due(run: Run) -> bool:
    every = run.cfg.train.eval_steps
    return bool(every) and run.step % every == 0


def _logged_eval(run: Run) -> dict | None:
    """The eval row logged at this step (by a run stopped after it), on every rank; None: none."""
    if run.eval_data is None:
        return None
    row = broadcast_object(run.env, run.writer.last_row(run.step, "eval/") if run.env.is_main else None)
    return {k: v for k, v in row.items() if k.startswith("eval/")} if row is not None else None


def _eval_missed(run: Run) -> bool:
    """Whether a resumed run stopped before logging the periodic eval of the step it resumes
    at (a stop during that eval leaves a checkpoint and no row)."""
    return 0 < run.step < run.total_steps and _eval_due(run) and _logged_eval(run) is None


def _eval_or_stop(run: Run, stop: StopRequest, bar) -> dict:
    try:
        return _log_eval(run, stop)
    except Interrupted as stopped:
        _stop(run, stop, stopped.signum, bar)


def _final_eval(run: Run, stop: StopRequest, bar) -> dict:
    """The eval at the last step. A resumed run that logged it before it stopped (a finished
    run resumed again) reads it back instead of logging a second one."""
    logged = _logged_eval(run)
    return logged if logged is not None else _eval_or_stop(run, stop, bar)


def _log_eval(run: Run, stop: StopRequest | None = None) -> dict:
    metrics = evaluate(run, stop)
    if metrics:
        run.writer.write({"step": run.step, "epoch": run.step / run.steps_per_epoch, **metrics})
    return metrics
