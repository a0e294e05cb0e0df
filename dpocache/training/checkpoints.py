"""What a run writes besides its metrics: checkpoints (rank 0, FSDP shards gathered first), the
final model, and the summary in run.json (pushed to the Hub when asked). A write that fails for
want of space raises ``models.checkpoint.CheckpointWriteError`` (one line, the checkpoints kept)."""

from __future__ import annotations

import shutil
from pathlib import Path

from dpocache.cache.atomic import as_umask_allows
from dpocache.distributed.fsdp import (
    GatheredModel,
    GatheredOptimizer,
    full_model_state,
    full_optimizer_state,
)
from dpocache.distributed.process_group import (
    barrier,
)
from dpocache.models.checkpoint import (
    name_adapter_base,
    save_checkpoint,
    writing,
)
from dpocache.models.hub import push_folder
from dpocache.scoring.compiling import compiler_since
from dpocache.training.state import Run, global_batch, is_sharded, write_run_json


def save(run: Run) -> None:
    """One checkpoint, written by rank 0 (DDP replicas are identical; FSDP shards are gathered
    to rank 0 first)."""
    model, optimizer = run.policy, run.optimizer
    if is_sharded(run):
        model = GatheredModel(run.policy, full_model_state(run.policy))  # collectives: every rank
        optimizer = GatheredOptimizer(run.policy, run.optimizer, full_optimizer_state(run.policy, run.optimizer))
    if run.env.is_main:
        extra = {"config": run.cfg.to_dict(), "epoch": run.step / run.steps_per_epoch,
                 "world_size": run.env.world_size, "global_batch": global_batch(run), "total_steps": run.total_steps,
                 "inputs": run.inputs, "step0_audit": run.info["reference"].get("step0_audit")}
        if run.scaler is not None:
            extra["grad_scaler"] = run.scaler.state_dict()
        save_checkpoint(run.out, run.step, model, run.tokenizer, optimizer, run.scheduler, extra,
                        run.cfg.train.save_total_limit)
    barrier(run.env)


def save_final(run: Run) -> Path:
    """``final/``: the trained model and tokenizer, and nothing else. Written to ``final.tmp``
    and renamed, as checkpoints are: files an earlier final/ held (a LoRA adapter's config beside
    full weights, which transformers would load instead) never mix in, and a save that fails
    midway leaves no final/ that looks complete."""
    final = run.out / "final"
    model = run.policy
    if is_sharded(run):
        model = GatheredModel(run.policy, full_model_state(run.policy))
    if run.env.is_main:
        tmp = final.with_name(final.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        with writing(tmp, "the final model", run.out, model):  # a full disk: one line, the checkpoints kept
            model.save_pretrained(tmp)
            name_adapter_base(tmp)
            run.tokenizer.save_pretrained(tmp)
            as_umask_allows(tmp)
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
    barrier(run.env)
    return final


def finish(run: Run, final_eval: dict, final_dir: Path | None, loop_s: float) -> dict:
    """run.json's last record: the step reached, the final eval, where the model went (None: a
    run of no step wrote none), the loop's wall time (``loop_s``: this process's steps, evals and
    saves), what compiling and streaming did."""
    run.info["final"] = {"step": run.step, "eval": final_eval, "output": final_dir and str(final_dir),
                         "loop_s": round(loop_s, 3)}
    if run.compiler_at_start is not None:  # what compiling the policy's layers took, this run's share
        run.info["policy"]["compiler"] = compiler_since(run.compiler_at_start)
    streamed = getattr(run.policy, "dpocache_streamed", None)
    if streamed is not None:  # the run's copies, their time and the compute's waits for them
        run.info["policy"]["streamed"]["transfers"] = streamed.transfers.to_json()
    write_run_json(run)
    if run.cfg.train.push_to_hub and run.env.is_main and final_dir is not None:
        push_folder(final_dir, run.cfg.train.push_to_hub)
    return run.info
