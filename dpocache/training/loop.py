"""The training loop: setup → (train_step → log → evaluate → checkpoint)* → save. Read top to
bottom.

The reference model never runs here. Before the first step every training (and eval) pair
must have a cached reference value; what is missing is built by ``dpocache.cache`` (from
``model.ref_model`` if given, else the initial policy's weights), and the reference model is
freed before the policy is loaded. ``run.json`` records where the values came from and that no
reference forward pass ran during training. When the policy starts from the reference's
weights, its first micro-batch's log-probs are reference log-probs: they audit the cache
(``dpocache.training.audit``). A run that diverges, with a NaN or without, stops (``dpocache.training.divergence``).
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import importlib.metadata
import json
import math
import os
import platform
import shutil
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import NoReturn

import torch
from tqdm.auto import tqdm

from dpocache import __version__
from dpocache.cache import CacheStore, default_cache_dir, namespace_for_dir
from dpocache.cache.build import adapter_base_dir, build_distributed, reference_source
from dpocache.cache.fingerprint import default_memo_path
from dpocache.cache.probes import ProbeMemo
from dpocache.cli.cache import load_tokenizer
from dpocache.config import Config, ConfigError, check_batch_fits, flag_name
from dpocache.data.pairs import DataError, PreferenceData, TokenizedPair, load_preference_data
from dpocache.data.values import PairValues
from dpocache.distributed.fsdp import (
    GatheredModel,
    GatheredOptimizer,
    full_model_state,
    full_optimizer_state,
    load_full_weights,
)
from dpocache.distributed.process_group import (
    DistEnv,
    all_reduce_max,
    barrier,
    broadcast_object,
    destroy,
    differing_on_ranks,
    init_distributed,
)
from dpocache.distributed.sharded_reference import reference_loader
from dpocache.losses.formulas import parse_loss_spec, preference_loss, wpo_weights
from dpocache.losses.ld_dpo import ld_values
from dpocache.losses.wpo import wpo_sums
from dpocache.models.checkpoint import (
    STATE_FILE,
    checkpoint_dir,
    latest_checkpoint,
    load_model_weights,
    load_trainer_state,
    name_hub_base,
    save_checkpoint,
)
from dpocache.models.hub import push_folder
from dpocache.models.hub_ids import resolve_model_path
from dpocache.models.policy import (
    build_grad_scaler,
    build_optimizer,
    build_scheduler,
    check_lora_settings,
    load_policy,
    load_sharded_policy,
    wrap_for_distributed,
)
from dpocache.models.reference import dtype_name, resolve_dtype
from dpocache.runtime.allocator import configure_cpu_allocator, configure_cuda_allocator
from dpocache.runtime.preflight import model_context, model_vocab_size
from dpocache.runtime.signals import Interrupted, StopRequest, stop_signals
from dpocache.scoring.compiling import compile_layers
from dpocache.scoring.layout_choice import LayoutChoice
from dpocache.scoring.logprobs import CompletionLogProbs, autocast
from dpocache.scoring.padded import epoch_order, steps_per_epoch
from dpocache.scoring.shared import layout_logprobs, scorer_core, training_layout
from dpocache.training import audit, divergence
from dpocache.training.divergence import ProgressMonitor
from dpocache.training.metrics import (
    WANDB_RUN_ID_FILE,
    MetricsWriter,
    MetricWindow,
    count_params,
    import_tracker,
    measured_peak_flops,
    model_shape,
    trackers,
    train_flops_per_token,
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


# ------------------------------------------------------------------------------------ setup


def setup(cfg: Config) -> Run:
    cfg.validate(required=("model.path", "data.train"))  # every mistake a value can show, before any work
    for name in trackers(cfg.train.report_to, cfg.train.tensorboard):
        import_tracker(name)  # a missing tracker library: one line now, not after the reference pass
    env = init_distributed(cfg.model.device, cfg.distributed.backend)
    try:
        return _setup(cfg, env)
    except BaseException as failed:
        # ``train`` ends the group only for a run it got: one that failed here must end it too,
        # while the interpreter is alive (``distributed.destroy``; a gloo group that had run a
        # collective aborted the process at exit, exit -6, instead of the error's exit 2). What
        # the failed frames held (a model wrapped in DDP holds the group) is dropped first.
        traceback.clear_frames(failed.__traceback__)
        destroy(env)
        raise


def _setup(cfg: Config, env: DistEnv) -> Run:
    check_same_settings_on_every_rank(cfg, env)  # as given: a Hub id resolves to each machine's own cache
    cfg.model.path, cfg.model.ref_model = resolve_model_path(cfg.model.path), resolve_model_path(cfg.model.ref_model)
    if cfg.distributed.fsdp and env.enabled and cfg.lora.r > 0:
        raise ConfigError("--fsdp (distributed.fsdp) with LoRA is not supported: "
                          "LoRA trains few parameters, use DDP (no --fsdp)")
    if env.is_main:
        for note in unused_settings(cfg, env):
            print(f"warning: {note}", file=sys.stderr)
    out = Path(cfg.train.output_dir)
    resumed_from = check_resumable(cfg, out)
    check_lora_settings(cfg)
    if not cfg.train.resume:
        start_fresh(cfg, out, env)  # before any model loads: refusing later would waste the reference pass
    if env.is_main:
        out.mkdir(parents=True, exist_ok=True)
    barrier(env)
    dtype = resolve_dtype(cfg.model.dtype, env.device)
    torch.manual_seed(cfg.train.seed)
    tokenizer = load_tokenizer(cfg.model.path)
    train_data = _load_data(cfg, cfg.data.train, tokenizer, env)
    if resumed_from is not None:
        resumed_from.check_data(cfg, train_data)
    eval_data = _load_data(cfg, cfg.data.eval, tokenizer, env) if cfg.data.eval else None
    check_same_data_on_every_rank(cfg, env, train_data, eval_data)
    if eval_data is not None and len(eval_data) < env.world_size:
        raise DataError(str(cfg.data.eval), None, f"{len(eval_data)} pairs, fewer than the {env.world_size} "
                        "ranks that share it")
    check_batch_fits(cfg, train_data, env.world_size)  # before any model loads
    spec = parse_loss_spec(cfg.loss.name, **cfg.loss.params())
    ref_train, ref_eval, ref_info = prepare_reference(cfg, env, dtype, spec, tokenizer, train_data, eval_data,
                                                      resumed_from)
    fsdp = cfg.distributed.fsdp and env.enabled
    if fsdp:  # created on the meta device, filled shard by shard: never whole in every process
        policy, scorer = load_sharded_policy(cfg, env, dtype, ProbeMemo(cache_dir_of(cfg)))
    else:
        policy = load_policy(cfg, env.device)
        scorer = wrap_for_distributed(CompletionLogProbs(policy), policy, cfg, env)
    # After the scorer's fast-path probe (a compile for its few tokens would be wasted). Training
    # compiles with "on" only: "auto" is measured for the reference pass; FSDP2's units stay eager.
    compiled_layers = compile_layers(policy) if cfg.model.compile == "on" and not fsdp else 0
    # WPO (dpocache.losses.wpo): the policy's head also returns log sum_v p(v)^2 per scored token.
    scorer_core(scorer).sum_sq_probs = cfg.loss.use_weighting
    # scoring.layout_choice: packed where supported, else padded; the attention backend by scoring.attention
    layout = training_layout(scorer, cfg.train.layout, cfg.model.attention)
    global_batch = cfg.train.batch_size * cfg.train.grad_accum * env.world_size
    epoch_steps = steps_per_epoch(len(train_data), global_batch)  # check_batch_fits: at least one
    total = cfg.train.max_steps if cfg.train.max_steps is not None else cfg.train.epochs * epoch_steps
    optimizer = build_optimizer(cfg, policy)
    scheduler = build_scheduler(cfg, optimizer, total)
    writer = MetricsWriter(out, cfg.train.tensorboard, enabled=env.is_main, report_to=cfg.train.report_to,
                           config=cfg.to_dict(), resume=cfg.train.resume)
    run = Run(cfg, env, out, dtype, tokenizer, train_data, eval_data, ref_train, ref_eval, spec, policy, scorer,
              optimizer, scheduler, total, epoch_steps, writer, layout, compiled_layers,
              scaler=build_grad_scaler(dtype, env.device, fsdp))
    run.info = _run_info(run, ref_info)
    run.inputs = {"train_pairs": len(train_data), "train_digest": data_digest(train_data),
                  "reference_namespace": ref_info.get("namespace")}
    if cfg.train.resume:
        resume(run)
    run.audit_step0 = plan_audit(run)
    return run


# Settings that may differ between the machines of one run: where things are shown or pushed
# (rank 0 alone does it), a cache directory each machine may hold a copy of at its own path, and
# the data files, whose pairs are compared instead (check_same_data_on_every_rank): a copy at
# another path on each machine is the same data.
PER_MACHINE_SETTINGS = ("cache.dir", "train.progress", "train.report_to", "train.tensorboard", "train.push_to_hub",
                        "data.train", "data.eval")


def check_same_settings_on_every_rank(cfg: Config, env: DistEnv) -> None:
    """Every rank must run the same training: a config file that differs between machines (on a
    disk that is not shared) would give each rank its own learning rate, batch or loss, which
    DDP does not notice (its replicas drift apart) and which no collective reports."""
    settings = {f"{section}.{name}": value for section, fields in cfg.to_dict().items()
                for name, value in fields.items() if f"{section}.{name}" not in PER_MACHINE_SETTINGS}
    differing = differing_on_ranks(env, settings)
    if differing:
        raise ConfigError(f"the ranks were started with different values of {', '.join(map(flag_name, differing))} "
                          "(a config file that differs between machines?); every rank must run the same training")


def check_same_data_on_every_rank(cfg: Config, env: DistEnv, train_data: PreferenceData,
                                  eval_data: PreferenceData | None) -> None:
    """Every rank must read the same pairs (each takes its share of a step's batch by index, so
    a data file that differs between machines, on a disk that is not shared, would train and
    evaluate on a mixture, silently). Before any model loads."""
    digests = {"data.train": data_digest(train_data)}
    if eval_data is not None:
        digests["data.eval"] = data_digest(eval_data)
    differing = differing_on_ranks(env, digests)
    if differing:
        dotted = differing[0]
        raise ConfigError(f"{flag_name(dotted)} {getattr(cfg.data, dotted.split('.')[1])}: the ranks read different "
                          "pairs from it (a file that differs between machines, or is not on a shared disk?); every "
                          "rank must read the same data")


def unused_settings(cfg: Config, env: DistEnv) -> list[str]:
    """Settings this run cannot act on but that a shared config file may well hold (the shipped
    LoRA config sets eval steps and leaves the eval data optional): said once, not refused."""
    notes = []
    if not cfg.data.eval:
        notes += [f"{flag_name(d)} {value} has no effect without --eval-data" for d, value in
                  (("train.eval_steps", cfg.train.eval_steps), ("train.eval_batch_size", cfg.train.eval_batch_size))
                  if value is not None]
    if cfg.distributed.fsdp and not env.enabled:
        notes.append(f"{flag_name('distributed.fsdp')} has no effect in one process (run under torchrun to shard)")
    return notes


# What a run leaves in its output directory. A fresh run there with --train.overwrite removes
# them all: an earlier final/ left in place would mix with the new one (an old adapter_config.json
# beside new full weights makes transformers load the old adapter), and old TensorBoard events
# would be drawn as the new run's.
RUN_OUTPUTS = ("checkpoints", "final", "metrics.jsonl", "run.json", "tensorboard", "curves.png",
               WANDB_RUN_ID_FILE)


def start_fresh(cfg: Config, out: Path, env: DistEnv) -> None:
    """A run that does not resume must not mix with an earlier one's outputs (a later --resume
    would pick up the wrong checkpoint, final/ would hold two models' files): refuse, unless
    told to overwrite. Runs before any model loads and before the metrics writer opens its files."""
    earlier = latest_checkpoint(out) is not None or (out / "metrics.jsonl").exists() or (out / "final").exists()
    if earlier and not cfg.train.overwrite:
        raise FileExistsError(
            f"{out} holds an earlier run (metrics.jsonl, checkpoints or final/). Pass --resume to continue it, "
            "--train.overwrite to start afresh there, or another --output-dir."
        )
    if earlier and env.is_main:
        for name in RUN_OUTPUTS:
            path = out / name
            if path.is_dir():
                shutil.rmtree(path)
            else:
                path.unlink(missing_ok=True)


def _load_data(cfg: Config, source: str, tokenizer, env: DistEnv) -> PreferenceData:
    data = load_preference_data(source, tokenizer, cfg.data.max_length, cfg.data.max_prompt_length,
                                cfg.data.skip_invalid, show_progress=env.is_main and cfg.train.progress,
                                columns=cfg.data.columns(), context=model_context(cfg.model.path),
                                vocab_size=model_vocab_size(cfg.model.path))
    if data.skipped and env.is_main:
        print(f"{source}: skipped {len(data.skipped)} invalid rows, first: {data.skipped[0]}", file=sys.stderr)
    return data


def cache_dir_of(cfg: Config) -> Path:
    return Path(cfg.cache.dir) if cfg.cache.dir else default_cache_dir()


def prepare_reference(cfg: Config, env: DistEnv, dtype: torch.dtype, spec, tokenizer, train_data: PreferenceData,
                      eval_data: PreferenceData | None, resumed_from: ResumedFrom | None = None):
    """Reference sums for every pair, from the cache; builds what is missing first, then frees
    the reference model. A resumed run's reference must hash as its checkpoint's did (checked
    before any build). Returns (train values, eval values, report for run.json)."""
    if not spec.needs_reference:
        return None, None, {"source": "none (reference-free loss)", "forward_passes_during_training": 0}
    ref_path = cfg.model.ref_model or cfg.model.path
    ref_dir, adapter = reference_source(ref_path, cfg.model.reference)
    cache_dir = cache_dir_of(cfg)
    store = CacheStore(cache_dir, namespace_for_dir(ref_path, dtype, cache_dir, cfg.model.reference))
    if resumed_from is not None:
        resumed_from.check_namespace(cfg, store.namespace.id)
    pairs = train_data.pairs + (eval_data.pairs if eval_data else [])
    load = reference_loader(ref_dir, dtype, env, cfg.cache.layout, sharded=cfg.distributed.fsdp, adapter=adapter,
                            attention=cfg.model.attention, probe_memo=ProbeMemo(cache_dir), compile=cfg.model.compile)
    # Every rank scores its token-balanced share of what is missing (one rank: all of it).
    summary = build_distributed(
        store, pairs, load, env,
        pad_id=tokenizer.pad_token_id or 0, max_tokens=cfg.cache.max_tokens, shard_pairs=cfg.cache.shard_size,
        show_progress=cfg.train.progress and env.is_main, per_token=cfg.loss.ld_alpha is not None,  # LD-DPO
        sharded=cfg.distributed.fsdp,
    )
    if env.is_main:
        for bad in summary.corrupt_shards:
            print(f"corrupt shard {store.dir / bad}; recomputing its pairs", file=sys.stderr)
    if summary.computed:
        gc.collect()  # the reference model is unreachable now; give its memory back
    if not env.is_main:
        store.open()  # rank 0's store already holds every rank's new shards
    ld = cfg.loss.ld_alpha is not None  # LD-DPO: the sums are recombined from the cached per-token values
    train_vals = store.lookup([p.key for p in train_data.pairs], per_token=ld)
    eval_vals = store.lookup([p.key for p in eval_data.pairs], per_token=ld) if eval_data else None
    info = {
        "source": "cache", "cache_dir": str(store.dir), "namespace": store.namespace.id,
        "model": store.namespace.model,
        "reference": cfg.model.reference,
        "dtype": dtype_name(dtype), "pairs": len(set(p.key for p in pairs)),
        "computed": summary.computed, "reused": summary.reused, "built_on_ranks": summary.world_size,
        # The build's own count (its summary), all before the first step. The loop holds no
        # reference model: the build's is unreachable once it returns (freed above).
        "forward_passes": summary.forward_passes, "forward_passes_during_training": 0,
    }
    if ld:
        train_vals = ld_values(train_vals, cfg.loss.ld_alpha)
        eval_vals = ld_values(eval_vals, cfg.loss.ld_alpha) if eval_data else None
        return train_vals, eval_vals, {**info, "ld_alpha": cfg.loss.ld_alpha}
    return train_vals, eval_vals, info


def plan_audit(run: Run) -> bool:
    """Whether the first micro-batch audits the cache: only when the policy starts from the
    reference's own weights (the same on every rank: it depends on the config and the step)."""
    cfg, reason = run.cfg, None
    ref_path = cfg.model.ref_model or cfg.model.path
    if run.ref_train is None:
        reason = "no cached reference (reference-free loss)"
    elif run.step > 0:
        if "step0_audit" in run.info["reference"]:
            return False  # the record of the attempt that ran step 0, from the checkpoint (resume)
        reason = f"resumed at step {run.step}: the policy is no longer the reference"
    elif Path(ref_path).resolve() != Path(cfg.model.path).resolve():
        reason = "the reference (--ref-model) is another model than the policy"
    elif cfg.model.reference == "base" and adapter_base_dir(cfg.model.path) is not None:
        reason = "--reference base: the reference is the adapter's bare base, the policy starts with the adapter on"
    elif cfg.lora.dropout > 0 and adapter_base_dir(cfg.model.path) is not None:
        # a fresh adapter adds 0 whatever its dropout; a trained one does not, so its training forward is random
        reason = "--lora.dropout on a loaded adapter: the policy's training forward is not the reference's"
    if reason is not None:
        run.info["reference"]["step0_audit"] = {"skipped": reason}
    return reason is None


def audit_step0(run: Run, pairs: list[TokenizedPair], policy_c: torch.Tensor, policy_r: torch.Tensor,
                ref_c: torch.Tensor, ref_r: torch.Tensor) -> None:
    """The first micro-batch's policy log-probs ``(B,)`` are reference log-probs: compare them with
    the cached values ``(B,)`` (``dpocache.training.audit``), record the drift in run.json, stop if it is
    too large. Both sides are the loss's inputs (LD-DPO's weighted sums when ``ld_alpha`` is set:
    the same weighting of the same per-token values)."""
    dtype = dtype_name(run.dtype)
    result = audit.gather(run.env, audit.compare(pairs, policy_c, policy_r, ref_c, ref_r, dtype))
    ok = result["over"] == 0
    run.info["reference"]["step0_audit"] = {
        "ok": ok, "sequences": result["sequences"], "ranks": result["ranks"], "max_abs_drift": result["max_abs_drift"],
        "max_drift_over_tolerance": result["max_drift_over_tolerance"], "tolerance": audit.tolerance_text(dtype),
        **({"worst": result["worst"]} if not ok else {}),
    }
    run.audit_step0 = False
    if not ok:
        _write_run_json(run)
        ns_dir = run.info["reference"]["cache_dir"]
        rebuild = _rebuild_command(run.cfg, ns_dir, dtype)
        raise audit.ReferenceAuditFailed(audit.failure_message(result, ns_dir, rebuild))


def _rebuild_command(cfg: Config, ns_dir: str, dtype: str) -> str:
    """Shell commands that drop the namespace (and the weight-hash memo, in case a weight file
    changed under the same mtime) and build it again."""
    cache_root = Path(ns_dir).parent
    parts = [f"rm -r {ns_dir} {default_memo_path(cache_root)} && dpocache cache build",
             f"--model {cfg.model.ref_model or cfg.model.path}", f"--data {cfg.data.train}",
             f"--cache-dir {cache_root}",
             f"--dtype {dtype}",
             f"--layout {cfg.cache.layout}"]
    if cfg.data.max_length is not None:
        parts.append(f"--max-length {cfg.data.max_length}")
    if cfg.data.max_prompt_length is not None:
        parts.append(f"--max-prompt-length {cfg.data.max_prompt_length}")
    if cfg.model.reference != "initial":
        parts.append(f"--reference {cfg.model.reference}")
    again = "run this training again, which builds what is missing"
    return " ".join(parts) + (f" (and the same for --eval-data), or {again}" if cfg.data.eval else f" (or {again})")


def _run_info(run: Run, ref_info: dict) -> dict:
    # Installed versions, without importing peft (4 s of imports) in a run without LoRA.
    versions = {name: importlib.metadata.version(name) for name in ("transformers", "peft")}

    return {
        "config": run.cfg.to_dict(),
        "versions": {"dpocache": __version__, "torch": torch.__version__, "transformers": versions["transformers"],
                     "peft": versions["peft"], "python": platform.python_version()},
        "device": str(run.env.device), "world_size": run.env.world_size, "dtype": dtype_name(run.dtype),
        "data": {"train_pairs": len(run.train_data), "steps_per_epoch": run.steps_per_epoch,
                 # pairs of each epoch's first steps that fill its last batch again (epoch_order)
                 "train_repeated_per_epoch": run.steps_per_epoch * _global_batch(run) - len(run.train_data),
                 "train_skipped": len(run.train_data.skipped),
                 "train_truncated": run.train_data.truncated, "train_identical": run.train_data.identical,
                 "eval_pairs": len(run.eval_data) if run.eval_data else 0},
        "policy": {"parameters": count_params(run.policy), "trainable": count_params(run.policy, trainable_only=True),
                   "compiled_layers": run.compiled_layers},
        "loss": str(run.spec), "total_steps": run.total_steps, "layout": run.layout.to_json(),
        "reference": ref_info,
    }


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
    except (OSError, ValueError):
        return None  # an unreadable state fails in resume() with its own message
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
    if _sharded(run):
        load_full_weights(ckpt, run.policy, run.env)
        state = load_trainer_state(ckpt, GatheredOptimizer(run.policy, run.optimizer), run.scheduler)
    else:
        load_model_weights(ckpt, run.policy)
        state = load_trainer_state(ckpt, run.optimizer, run.scheduler)
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
        if saved is not None and saved != _global_batch(run):
            print(f"warning: the global batch was {saved} and is now {_global_batch(run)} (batch_size x grad_accum x "
                  f"world_size); steps after {run.step} take different pairs than the first run would have",
                  file=sys.stderr)


def _global_batch(run: Run) -> int:
    return run.cfg.train.batch_size * run.cfg.train.grad_accum * run.env.world_size


def _sharded(run: Run) -> bool:
    return run.cfg.distributed.fsdp and run.env.enabled


# ------------------------------------------------------------------------------- one step


def step_indices(run: Run, step: int, micro: int) -> list[int]:
    """Pair indices of this rank's micro-batch ``micro`` of optimizer step ``step``.

    The global batch of a step is a slice of the epoch's seeded permutation (filled up to whole
    batches, ``batching.epoch_order``); micro-batch ``a`` of rank ``r`` is its
    ``(a * world + r)``-th block of ``batch_size``. So a run on W ranks with batch b sees
    exactly the pairs of a 1-rank run with batch W*b.
    """
    cfg, env = run.cfg.train, run.env
    global_batch = _global_batch(run)
    epoch, within = divmod(step, run.steps_per_epoch)
    order = epoch_order(len(run.train_data), cfg.seed, epoch, global_batch)
    start = within * global_batch + (micro * env.world_size + env.rank) * cfg.batch_size
    return order[start:start + cfg.batch_size]


def batch_losses(run: Run, pairs: list[TokenizedPair], ref: PairValues | None, idx: list[int],
                 window: MetricWindow, prefix: str = "", check_cache: bool = False):
    """Policy forward on ``pairs``; returns the loss per example ``(B,)``, for MoE policies the
    router load-balancing loss (a scalar, else None), and the loss's inputs (pairs and the
    detached ``(B,)`` policy and reference sums); records the metrics.
    ``check_cache``: first compare the policy's log-probs with the cached ones (``audit_step0``)."""
    ld_alpha = run.cfg.loss.ld_alpha  # LD-DPO: sums recombined from per-token values, as the cache's were
    with autocast(run.dtype, run.env.device):
        pad_id = run.tokenizer.pad_token_id or 0
        lp, tokens = layout_logprobs(run.scorer, run.layout.used, pairs, pad_id, run.env.device,
                                     per_token=ld_alpha is not None)
    # The loss's inputs; the logged log-probs stay the plain sums.
    loss_lp = ld_values(lp, ld_alpha) if ld_alpha is not None else lp
    ref = ref.select(idx).to(run.env.device) if ref is not None else None
    ref_c = ref.chosen_logps if ref is not None else None
    ref_r = ref.rejected_logps if ref is not None else None
    pc, pr = loss_lp.chosen_logps, loss_lp.rejected_logps
    if check_cache:
        audit_step0(run, pairs, pc, pr, ref_c, ref_r)
    inputs = (pairs, pc.detach(), pr.detach(), ref_c, ref_r)  # the loss's inputs, for _stop_non_finite
    wpo = {}
    if run.cfg.loss.use_weighting:  # WPO: weights from the policy's plain per-token values (as TRL), not LD-DPO's
        cw, rw = wpo_sums(lp, scorer_core(run.scorer).log_sum_sq_probs)
        wpo = {"chosen_wpo_logps": cw, "rejected_wpo_logps": rw}
        window.add_mean(prefix + "wpo/weights", wpo_weights(cw, rw, lp.chosen_tokens.clamp(min=1),
                                                             lp.rejected_tokens.clamp(min=1)))
    losses, rc, rr = preference_loss(run.spec, pc, pr, ref_c, ref_r, lp.chosen_tokens, lp.rejected_tokens, **wpo)
    window.add_mean(prefix + "loss", losses)
    window.add_mean(prefix + "rewards/chosen", rc)
    window.add_mean(prefix + "rewards/rejected", rr)
    window.add_mean(prefix + "rewards/average", (rc + rr) / 2)
    # A tie (policy == reference) counts half: accuracy starts at chance, 0.5, not 0.
    window.add_mean(prefix + "rewards/accuracies", (rc > rr).float() + 0.5 * (rc == rr).float())
    window.add_mean(prefix + "rewards/margins", rc - rr)
    window.add_mean(prefix + "logps/chosen", lp.chosen_logps)
    window.add_mean(prefix + "logps/rejected", lp.rejected_logps)
    if _has_nll(run):
        window.add_mean(prefix + "sft_loss", -(lp.chosen_logps.detach() / lp.chosen_tokens.clamp(min=1)))
    window.add_total(prefix + "tokens", float(tokens))  # counted on the host, from the pairs
    aux = scorer_core(run.scorer).aux_loss
    if aux is not None:
        window.add(prefix + "aux_loss", aux.detach(), 1.0)
    return losses, aux, inputs


def _has_nll(run: Run) -> bool:
    names = {n for n, _ in run.spec.terms}
    return bool(names & {"sft", "orpo"}) or run.spec.params.get("rpo_alpha") is not None


def train_step(run: Run, window: MetricWindow) -> None:
    """One optimizer step over ``grad_accum`` micro-batches.

    No micro-batch waits for the device: the metrics stay device tensors until the logging step
    (``MetricWindow``), and whether a loss was finite is kept as a device flag. The step waits
    once, before the optimizer step, for that flag (reduced over ranks) and the gradient norm
    together: stopping on a NaN or a runaway norm is a host decision, made before any weight
    changes (``dpocache.training.divergence``)."""
    cfg = run.cfg.train
    run.scorer.train()
    params = [p for p in run.policy.parameters() if p.requires_grad]
    if run.monitor is None:
        run.monitor = ProgressMonitor(params)  # the norm of the weights the run starts (or resumes) from
    run.step_batches, losses_seen = [], []
    for micro in range(cfg.grad_accum):
        idx = step_indices(run, run.step, micro)
        pairs = [run.train_data.pairs[i] for i in idx]
        sync = micro == cfg.grad_accum - 1
        with _no_sync(run.scorer, sync):
            audit_now = run.audit_step0 and micro == 0
            losses, aux, inputs = batch_losses(run, pairs, run.ref_train, idx, window, check_cache=audit_now)
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
    not_finite, norm = torch.cat([not_finite, grad_norm.double().reshape(1).to(run.env.device)]).tolist()  # one sync
    if not_finite:
        _stop_non_finite(run, losses_seen)
    if run.scaler is None and not math.isfinite(norm):
        # A finite loss whose gradient overflowed (a bfloat16 backward, a loss at the edge of its
        # range): the update would write NaN into every weight, and the monitor would then blame
        # the weights' growth. float16's scaler skips such a step instead (_apply_update).
        raise TrainingDiverged(f"step {run.step + 1}: the gradient norm is {norm} (not finite) while the loss is "
                               f"finite. Stopped before the update, without saving; {_last_good(run)}. Try "
                               "--dtype float32, or another --beta or loss.")
    skipped = _apply_update(run, window, grad_norm, norm)
    run.optimizer.zero_grad(set_to_none=True)
    run.step += 1
    reason = run.monitor.check(norm, skipped)
    if reason is not None:
        raise TrainingDiverged(f"step {run.step}: {reason}. Stopped without saving; {_last_good(run)}. "
                               "Try a lower --lr, or another --beta or loss.")


def _apply_update(run: Run, window: MetricWindow, grad_norm: torch.Tensor, norm: float) -> bool:
    """The optimizer and schedule step after the gradients are clipped; ``grad_norm`` is their
    norm as a device scalar, ``norm`` the same on the host. Returns whether the update was
    skipped: float16 gradients that overflowed (their unscaled norm is not finite) skip it and
    halve the loss scale; the schedule waits for the next update, as in Hugging Face's Trainer.
    The step still counts (its pairs were seen)."""
    skipped = run.scaler is not None and not math.isfinite(norm)
    if not skipped:
        window.add("grad_norm", grad_norm, 1.0)
    window.add("lr", run.scheduler.get_last_lr()[0], 1.0)
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
            f"{_last_good(run)}.{advice}"
        )


def _last_good(run: Run) -> str:
    last = latest_checkpoint(run.out)
    return f"the last good checkpoint is {last if last else 'none (no checkpoint was saved yet)'}"


# ------------------------------------------------------------------------------- evaluation


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
            batch_losses(run, [run.eval_data.pairs[i] for i in idx], run.ref_eval, idx, window, prefix="eval/")
        elif _sharded(run):
            # An FSDP forward is a collective (it all-gathers each layer): a rank whose stride is
            # one pair shorter still runs it, on any pair, and records nothing.
            batch_losses(run, run.eval_data.pairs[:1], run.ref_eval, [0], MetricWindow(), prefix="eval/")
    metrics = window.reduce(env)
    metrics.pop("eval/tokens", None)
    return metrics


# ------------------------------------------------------------------------------------ loop


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
        env = run.env
        try:
            return _train(run, stop)
        finally:
            # The models (DDP's reducer, FSDP's state) hold the process group: gone first, so
            # that destroy ends the group while the interpreter is alive (``distributed.destroy``).
            run = None  # noqa: F841 - the last reference to the run
            destroy(env)


def _train(run: Run, stop: StopRequest) -> dict:
    cfg = run.cfg
    layers, hidden = model_shape(run.policy)
    mean_len = sum(p.num_tokens for p in run.train_data.pairs) / (2 * len(run.train_data))
    flops_per_token = train_flops_per_token(count_params(run.policy), layers, hidden, mean_len)
    _write_run_json(run)
    # From here a signal only sets ``stop``; the loop acts on it between optimizer steps and
    # between eval batches. A checkpoint is saved before an eval, so an eval stopped loses nothing.
    with stop.deferred():
        bar = tqdm(total=run.total_steps, initial=run.step, desc="train", unit="step", dynamic_ncols=True,
                   disable=not (run.env.is_main and cfg.train.progress))
        if run.step == 0 or _eval_missed(run):
            _eval_or_stop(run, stop, bar)
        window, t0 = MetricWindow(), time.perf_counter()
        run.saved_at = _clock()
        while run.step < run.total_steps:
            train_step(run, window)
            bar.update(1)
            last = run.step == run.total_steps
            save_due, signum = _save_or_stop(run, stop)
            # A checkpointed step logs its partial window: a run resumed there keeps the rows up to
            # it and redoes only the steps after it, so the steps since the last log would be in
            # no row. (A stopped run saves too.)
            if run.step % cfg.train.logging_steps == 0 or last or signum or save_due:
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
        if run.saved_step != run.step:
            _save(run)
        final_eval = _final_eval(run, stop, bar)
        bar.close()
        final_dir = save_final(run)
        summary = _finish(run, final_eval, final_dir)
    run.writer.close()
    return summary


def _clock() -> float:
    """Seconds on a monotonic clock, for the time-interval checkpoints."""
    return time.monotonic()


def _save_or_stop(run: Run, stop: StopRequest) -> tuple[bool, int]:
    """(whether a checkpoint is due, the stop signal or 0), the same on every rank: ranks must
    save together (FSDP gathers) and stop together (a rank left in a collective waits forever).
    Rank 0's clock decides a time-interval save; a signal on any rank stops every rank."""
    cfg = run.cfg.train
    by_steps = bool(cfg.save_steps) and run.step % cfg.save_steps == 0
    by_time = run.env.is_main and bool(cfg.save_minutes) and _clock() - run.saved_at >= 60 * cfg.save_minutes
    agreed = all_reduce_max(run.env, torch.tensor([float(by_time), float(stop.signum or 0)], device=run.env.device))
    by_time, signum = agreed.tolist()
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


def _save(run: Run) -> None:
    """One checkpoint, written by rank 0 (DDP replicas are identical; FSDP shards are gathered
    to rank 0 first)."""
    model, optimizer = run.policy, run.optimizer
    if _sharded(run):
        model = GatheredModel(run.policy, full_model_state(run.policy))  # collectives: every rank
        optimizer = GatheredOptimizer(run.policy, run.optimizer, full_optimizer_state(run.policy, run.optimizer))
    if run.env.is_main:
        extra = {"config": run.cfg.to_dict(), "epoch": run.step / run.steps_per_epoch,
                 "world_size": run.env.world_size, "global_batch": _global_batch(run),
                 "inputs": run.inputs, "step0_audit": run.info["reference"].get("step0_audit")}
        if run.scaler is not None:
            extra["grad_scaler"] = run.scaler.state_dict()
        save_checkpoint(run.out, run.step, model, run.tokenizer, optimizer, run.scheduler, extra,
                        run.cfg.train.save_total_limit)
    barrier(run.env)
    run.saved_step, run.saved_at = run.step, _clock()


def save_final(run: Run) -> Path:
    """``final/``: the trained model and tokenizer, and nothing else. Written to ``final.tmp``
    and renamed, as checkpoints are: files an earlier final/ held (a LoRA adapter's config beside
    full weights, which transformers would load instead) never mix in, and a save that fails
    midway leaves no final/ that looks complete."""
    final = run.out / "final"
    model = run.policy
    if _sharded(run):
        model = GatheredModel(run.policy, full_model_state(run.policy))
    if run.env.is_main:
        tmp = final.with_name(final.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        model.save_pretrained(tmp)
        name_hub_base(tmp)
        run.tokenizer.save_pretrained(tmp)
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
    barrier(run.env)
    return final


def _finish(run: Run, final_eval: dict, final_dir: Path) -> dict:
    run.info["final"] = {"step": run.step, "eval": final_eval, "output": str(final_dir)}
    _write_run_json(run)
    if run.cfg.train.push_to_hub and run.env.is_main:
        push_folder(final_dir, run.cfg.train.push_to_hub)
    return run.info


def _write_run_json(run: Run) -> None:
    if run.env.is_main:
        info = {k: v for k, v in run.info.items() if not k.startswith("_")}
        (run.out / "run.json").write_text(json.dumps(info, indent=1, default=str))
