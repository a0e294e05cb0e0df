"""``--resume``: the settings a resumed run must share with its checkpoint (checked before any
model loads), the data and reference it must still find, and the state it continues from."""

from __future__ import annotations

import hashlib
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from safetensors import SafetensorError

from dpocache.config import Config, ConfigError, flag_name
from dpocache.data.pairs import PreferenceData
from dpocache.distributed.fsdp import (
    GatheredOptimizer,
    load_full_weights,
)
from dpocache.distributed.process_group import (
    broadcast_object,
)
from dpocache.models.checkpoint import (
    STATE_FILE,
    checkpoints,
    latest_checkpoint,
    load_model_weights,
    load_trainer_state,
)
from dpocache.training.state import Run, global_batch, is_sharded

# What a resumed run must share with the run that wrote its checkpoint: everything that changes
# which pairs it trains on and what a step computes from them. The batch may change (a warning:
# a different world size can keep it); steps, epochs, logging, saving, evals and trackers may too.
RESUME_FIXED_SECTIONS = ("loss", "optim", "lora")


RESUME_FIXED_FIELDS = ("model.path", "model.ref_model", "model.reference", "model.dtype", "data.train",
                       "data.max_length", "data.max_prompt_length", "data.skip_invalid", "data.prompt_field",
                       "data.chosen_field", "data.rejected_field", "train.seed")


RESUME_PATHS = ("model.path", "model.ref_model", "data.train")


def check_resumable(cfg: Config, out: Path) -> ResumedFrom | None:
    """Refuse ``--resume`` with settings that differ from those the newest checkpoint was
    trained with (a changed loss, learning rate, data or model would make the "resumed" run a
    different run, logged and summarised as if it were one); before any model loads. Returns
    the checkpoint's record of its inputs, which ``ResumedFrom.check_data`` and
    ``check_namespace`` compare once the data and the reference's weights are read (None: no
    resume, or no checkpoint)."""
    found = latest_checkpoint(out) if cfg.train.resume else None
    if found is None:
        return None
    try:
        state = json.loads((found / STATE_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise damaged_checkpoint(found, out, e) from None
    saved = state.get("config") or {}
    now = cfg.to_dict()
    fields = [f"{section}.{name}" for section in RESUME_FIXED_SECTIONS for name in now[section]]
    changed = []
    for dotted in (*RESUME_FIXED_FIELDS, *fields):
        section, name = dotted.split(".", 1)
        if name not in saved.get(section, {}):
            continue  # a field newer than the checkpoint
        old, new = saved[section][name], now[section][name]
        if dotted in RESUME_PATHS and old is not None and new is not None:
            old, new = os.path.realpath(old), os.path.realpath(new)
        if old != new:
            changed.append(f"{flag_name(dotted)} {saved[section][name]!r} -> {now[section][name]!r}")
    if changed:
        raise ConfigError(f"--resume: {found} was trained with other settings ({'; '.join(changed)}); a resumed "
                          "run continues the same training: pass the same values, or start a new run in another "
                          "--output-dir")
    return ResumedFrom(found, state.get("inputs") or {})


def damaged_checkpoint(ckpt: Path, out: Path, error: BaseException) -> ConfigError:
    """One line for a checkpoint that cannot be read (a file cut short or missing, its state not
    JSON), naming the one before it, from which a run resumes once this one is moved away. The
    checkpoint is left as it is: what is wrong with it is for its owner to see."""
    older = [c for c in checkpoints(out) if c != ckpt]
    what = str(error).splitlines()[0] if str(error) else type(error).__name__
    hint = (f"; move it out of {ckpt.parent} to resume from {older[-1].name}, the one before it" if older
            else "; no checkpoint before it: start again without --resume")
    return ConfigError(f"--resume: {ckpt} cannot be read ({type(error).__name__}: {what}){hint}")


def data_digest(data: PreferenceData) -> str:
    """A hash of the training pairs' keys in file order: their tokens after template and
    truncation, their number and their order (the order a seed permutes)."""
    h = hashlib.blake2b(digest_size=16)
    for pair in data.pairs:
        h.update(pair.key)
    return h.hexdigest()


@dataclass
class ResumedFrom:
    """The checkpoint a resumed run continues and its record of what it trained on (``inputs``
    of its state file: ``train_pairs``, ``train_digest``, ``reference_namespace``; a checkpoint
    older than the record has none, and nothing is compared)."""

    checkpoint: Path
    inputs: dict

    def check_data(self, cfg: Config, data: PreferenceData) -> None:
        """The same path can hold other rows (a file rewritten in place, re-tokenised by another
        tokenizer): refuse them before any model loads."""
        saved = self.inputs.get("train_digest")
        if saved is not None and saved != data_digest(data):
            raise ConfigError(f"--resume: {flag_name('data.train')} {cfg.data.train} holds other pairs than when "
                              f"{self.checkpoint} was saved ({self.inputs.get('train_pairs')} pairs then, "
                              f"{len(data)} now, and their tokens or order differ); a resumed run trains on the "
                              "same data: restore the file, or start a new run in another --output-dir")

    def check_namespace(self, cfg: Config, namespace: str) -> None:
        """The reference's weights, hashed by content, before any reference pass: a model
        directory rewritten in place would give the resumed steps another reference."""
        saved = self.inputs.get("reference_namespace")
        if saved is not None and saved != namespace:
            ref = cfg.model.ref_model or cfg.model.path
            raise ConfigError(f"--resume: the reference {ref} is not the one {self.checkpoint} was trained against "
                              f"(its weights, config or adapter hash to namespace {namespace}, then {saved}); a "
                              "resumed run keeps its reference: restore the model directory, or start a new run "
                              "in another --output-dir")


def resume(run: Run) -> None:
    """Continue from the newest checkpoint (rank 0's choice; every rank reads it, so the output
    directory must be shared). Checkpoints hold full weights and optimizer state, so the
    world size may differ from the run that wrote them."""
    found = latest_checkpoint(run.out)
    ckpt = broadcast_object(run.env, str(found) if found else None)
    if ckpt is None:
        if run.env.is_main:
            print(f"no checkpoint in {run.out / 'checkpoints'}; starting from step 0", file=sys.stderr)
        run.writer.rewind(0)  # the killed attempt's rows: this run logs them again
        return
    ckpt = Path(ckpt)
    try:
        if is_sharded(run):
            load_full_weights(ckpt, run.policy, run.env)
            state = load_trainer_state(ckpt, GatheredOptimizer(run.policy, run.optimizer), run.scheduler)
        else:
            load_model_weights(ckpt, run.policy)
            state = load_trainer_state(ckpt, run.optimizer, run.scheduler)
    except (OSError, ValueError, KeyError, SafetensorError) as e:  # cut short, edited, a file missing
        raise damaged_checkpoint(ckpt, run.out, e) from None
    if state.get("total_steps") not in (None, run.total_steps):
        _follow_new_schedule(run, state["step"], state["total_steps"])
    if run.scaler is not None and state.get("grad_scaler"):
        run.scaler.load_state_dict(state["grad_scaler"])  # the scale the run had reached, not 65536 again
    run.step = run.saved_step = state["step"]
    run.writer.rewind(run.step)
    # run.json describes the whole run: where this attempt took over, and the step-0 audit of the
    # attempt that ran step 0 (a resumed run runs none).
    run.info["resumed_from"] = {"checkpoint": str(ckpt), "step": run.step}
    if state.get("step0_audit") is not None:
        run.info["reference"]["step0_audit"] = state["step0_audit"]
    if run.env.is_main:
        print(f"resumed from {ckpt} at step {run.step}", file=sys.stderr)
        saved = state.get("global_batch")
        if saved is not None and saved != global_batch(run):
            print(other_batch_warning(run.step, saved, global_batch(run)), file=sys.stderr)


def _follow_new_schedule(run: Run, step: int, saved_total: int) -> None:
    """A resume with another step count (``--max-steps``, ``--epochs``, or the batch): the
    learning-rate schedule is stretched over the new count. The optimizer's state holds the
    rate the old schedule set for the next step; the new one's is set instead, so every
    resumed step follows one schedule, and the jump is said."""
    scheduler = run.scheduler
    before = [group["lr"] for group in run.optimizer.param_groups]
    for group, base, rate in zip(run.optimizer.param_groups, scheduler.base_lrs, scheduler.lr_lambdas):
        group["lr"] = base * rate(scheduler.last_epoch)
    scheduler._last_lr = [group["lr"] for group in run.optimizer.param_groups]
    if run.env.is_main:
        print(f"warning: the run had {saved_total} steps and now has {run.total_steps} (--max-steps, --epochs or "
              f"the batch changed): the learning-rate schedule is spread over "
              f"{run.total_steps} steps from here, so step {step + 1} trains at {scheduler._last_lr[0]:.4g} where the "
              f"first run's would have trained at {before[0]:.4g}", file=sys.stderr)


def other_batch_warning(step: int, saved: int, now: int) -> str:
    """What a resume at ``step`` under another global batch does to the data: it goes on from
    ``step x now`` pairs into the run's order, where the first run had trained ``step x saved``."""
    trained, here = step * saved, step * now
    change = (f"pairs {here:,} to {trained - 1:,} of the data's order are trained again" if now < saved else
              f"pairs {trained:,} to {here - 1:,} of the data's order are skipped")
    return (f"warning: the global batch was {saved} and is now {now} (batch_size x grad_accum x world_size): the "
            f"first run had trained {trained:,} pairs by step {step}, this one goes on from pair {here:,}, so "
            f"{change}, and its steps and learning-rate schedule are those of a batch of {now}; keep the product at "
            f"{saved} to continue exactly")
