"""Everything before the first step: the settings checked (the same on every rank, a fresh or a
resumable output directory), the data read, the reference values prepared, the policy loaded,
wrapped and compiled, the optimizer and schedule built; a resumed run's state loaded."""

from __future__ import annotations

import importlib.metadata
import platform
import shutil
import sys
import traceback
from pathlib import Path

import torch

from dpocache import __version__
from dpocache.cache.probes import ProbeMemo
from dpocache.config import (
    KEEP_ATTENTION,
    Config,
    ConfigError,
    check_batch_fits,
    checkpoint_keep_names,
    flag_name,
)
from dpocache.data.order import steps_per_epoch
from dpocache.data.pairs import PreferenceData, load_preference_data
from dpocache.data.rows import DataError
from dpocache.distributed.process_group import (
    DistEnv,
    barrier,
    broadcast_object,
    destroy,
    differing_on_ranks,
    init_distributed,
)
from dpocache.losses.registry import parse_loss_spec
from dpocache.models.checkpoint import (
    latest_checkpoint,
)
from dpocache.models.checkpointing import check_keep_names
from dpocache.models.hub_ids import resolve_model_path
from dpocache.models.kernels import kernels_for
from dpocache.models.loading import load_tokenizer
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
from dpocache.models.streaming import check_streamed_layers
from dpocache.runtime.preflight import UsageError, model_context, model_vocab_size, unwritable
from dpocache.runtime.run_lock import OutputDirLock, hold_output_dir
from dpocache.scoring.compiling import compile_layers, compiler_mark
from dpocache.scoring.layout_choice import CAUSAL, LayoutChoice
from dpocache.scoring.layouts import training_layout
from dpocache.scoring.logprobs import CompletionLogProbs, decoder_layers, scorer_core
from dpocache.training.cached_reference import cache_dir_of, plan_audit, prepare_reference
from dpocache.training.metrics import (
    WANDB_RUN_ID_FILE,
    MetricsWriter,
    count_params,
    import_tracker,
    trackers,
)
from dpocache.training.prefetch import Prefetcher, prefetching
from dpocache.training.resume import check_resumable, data_digest, resume
from dpocache.training.state import Run, global_batch


def setup(cfg: Config) -> Run:
    cfg.validate(required=("model.path", "data.train"))  # every mistake a value can show, before any work
    for name in trackers(cfg.train.report_to, cfg.train.tensorboard):
        import_tracker(name)  # a missing tracker library: one line now, not after the reference pass
    env = init_distributed(cfg.model.device, cfg.distributed.backend)
    lock = None
    try:
        lock = hold_output_dir_for_job(cfg, env)  # before anything looks at what the directory holds
        run = _setup(cfg, env)
        run.lock = lock
        return run
    except BaseException as failed:
        if lock is not None:
            lock.release()
        # ``train`` ends the group only for a run it got: one that failed here must end it too,
        # while the interpreter is alive (``distributed.destroy``; a gloo group that had run a
        # collective aborted the process at exit, exit -6, instead of the error's exit 2). What
        # the failed frames held (a model wrapped in DDP holds the group) is dropped first.
        traceback.clear_frames(failed.__traceback__)
        destroy(env)
        raise


def check_kept_attention_runs(cfg: Config, layout: LayoutChoice) -> None:
    """``--checkpoint-keep attention`` where training's layout does not run the causal rows (a
    fallback the checks before any model loads could not foresee): ``ConfigError``."""
    if KEEP_ATTENTION in checkpoint_keep_names(cfg.model.checkpoint_keep) and layout.attention != CAUSAL:
        why = f" ({layout.reason})" if layout.reason else ""
        raise ConfigError(f"{flag_name('model.checkpoint_keep')}: {KEEP_ATTENTION} keeps the causal rows' attention "
                          f"output; training runs {layout.attention} on the {layout.used} layout{why}")


def hold_output_dir_for_job(cfg: Config, env: DistEnv) -> OutputDirLock | None:
    """Rank 0 locks the output directory for the job (``runtime.run_lock``); every rank stops
    with rank 0's one line if another run holds it."""
    lock, refused = None, None
    if env.is_main:
        try:
            lock = hold_output_dir(cfg.train.output_dir)
        except UsageError as e:
            refused = str(e)
    refused = broadcast_object(env, refused)
    if refused:
        raise UsageError(refused)
    return lock


def _setup(cfg: Config, env: DistEnv) -> Run:
    check_same_settings_on_every_rank(cfg, env)  # as given: a Hub id resolves to each machine's own cache
    cfg.model.path = resolve_model_path(cfg.model.path)
    cfg.model.ref_model = resolve_model_path(cfg.model.ref_model, "--ref-model")
    if cfg.distributed.fsdp and env.enabled and cfg.lora.r > 0:
        raise ConfigError("--fsdp (distributed.fsdp) with LoRA is not supported: "
                          "LoRA trains few parameters, use DDP (no --fsdp)")
    if env.is_main:
        for note in unused_settings(cfg, env):
            print(f"warning: {note}", file=sys.stderr)
    out = Path(cfg.train.output_dir)
    resumed_from = check_resumable(cfg, out)
    check_lora_settings(cfg)
    if cfg.model.gradient_checkpointing:  # --checkpoint-keep's names, against the model's config
        check_keep_names(cfg.model.path, checkpoint_keep_names(cfg.model.checkpoint_keep), cfg.model.attention,
                         env.device)
    if cfg.model.stream_base:  # --resident-layers and --turn-layers against the model's layers
        check_streamed_layers(cfg.model.path, cfg.model.resident_layers, cfg.model.turn_layers)
    # Liger's kernels or the model's own: --kernels liger on a family Liger lacks, refused before any model loads
    # (the reference's own choice is made as it loads: cached_reference).
    fsdp = cfg.distributed.fsdp and env.enabled
    # Training compiles with "on" only ("auto" is measured for the reference pass); FSDP2's units stay eager.
    compiled = cfg.model.compile == "on" and not fsdp
    kernels = kernels_for(cfg.model.kernels, env.device, cfg.model.path, compiled_training=compiled)
    if cfg.model.ref_model:
        kernels_for(cfg.model.kernels, env.device, cfg.model.ref_model)
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
                                                      resumed_from, compiled_policy=compiled)
    if fsdp:  # created on the meta device, filled shard by shard: never whole in every process
        policy, scorer = load_sharded_policy(cfg, env, dtype, ProbeMemo(cache_dir_of(cfg)), kernels)
    else:
        policy = load_policy(cfg, env.device, kernels, dtype)
        scorer = wrap_for_distributed(CompletionLogProbs(policy), policy, cfg, env)
    # After the scorer's fast-path probe (a compile for its few tokens would be wasted). A streamed
    # base's layers compile their forwards inside their checkpoints instead (load_policy).
    compiler_at_start = compiler_mark() if compiled else None
    if compiled and cfg.model.stream_base:
        compiled_layers = len(decoder_layers(policy))
    else:
        compiled_layers = compile_layers(policy) if compiled else 0
    # WPO (dpocache.losses.wpo): the policy's head also returns log sum_v p(v)^2 per scored token.
    scorer_core(scorer).sum_sq_probs = cfg.loss.use_weighting
    # scoring.layout_choice: packed where supported, else padded; the attention backend by scoring.attention
    layout = training_layout(scorer, cfg.train.layout, cfg.model.attention)
    check_kept_attention_runs(cfg, layout)
    global_batch = cfg.train.batch_size * cfg.train.grad_accum * env.world_size
    epoch_steps = steps_per_epoch(len(train_data), global_batch)  # check_batch_fits: at least one
    total = cfg.train.max_steps if cfg.train.max_steps is not None else cfg.train.epochs * epoch_steps
    if env.is_main:  # before the first step: a recipe's batch on another world size shows here, not in the curves
        print(describe_batch(cfg, env.world_size, total, epoch_steps), file=sys.stderr)
    optimizer = build_optimizer(cfg, policy)
    scheduler = build_scheduler(cfg, optimizer, total)
    writer = MetricsWriter(out, cfg.train.tensorboard, enabled=env.is_main, report_to=cfg.train.report_to,
                           config=cfg.to_dict(), resume=cfg.train.resume)
    run = Run(cfg, env, out, dtype, tokenizer, train_data, eval_data, ref_train, ref_eval, spec, policy, scorer,
              optimizer, scheduler, total, epoch_steps, writer, layout, compiled_layers,
              compiler_at_start, scaler=build_grad_scaler(dtype, env.device, fsdp))
    run.trainable = [p for p in policy.parameters() if p.requires_grad]
    # In training mode from here (a loaded model comes in eval mode): train_step sets it again
    # only after an eval, as setting it walks every module (a 32-layer LoRA Llama's 2,666: 7-17
    # ms of host time on a 2-core CPU, docs/benchmarks/host-step-cpu-2core-20261127.md).
    scorer.train()
    run.info = _run_info(run, ref_info, kernels.to_json())
    run.inputs = {"train_pairs": len(train_data), "train_digest": data_digest(train_data),
                  "reference_namespace": ref_info.get("namespace")}
    if cfg.train.resume:
        resume(run)
    run.audit_step0 = plan_audit(run)
    # Last: its thread is the one thing here that needs closing (loop.train closes it).
    run.batches = Prefetcher(run, prefetching(cfg.train.prefetch, env.device))
    run.info["policy"]["prefetch"] = run.batches.pool is not None
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


def describe_batch(cfg: Config, world_size: int, total: int, epoch_steps: int) -> str:
    """``train: 2,100 steps of 128 pairs (1 a device x 2 accumulated x 64 processes), 2,100 an
    epoch``: the global batch as the run computes it, named by its factors."""
    batch = cfg.train.batch_size * cfg.train.grad_accum * world_size
    processes = f"{world_size} process{'es' if world_size != 1 else ''}"
    return (f"train: {total:,} step{'s' if total != 1 else ''} of {batch:,} pairs ({cfg.train.batch_size} a device x "
            f"{cfg.train.grad_accum} accumulated x {processes}), {epoch_steps:,} an epoch")


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
    if cfg.model.ref_model and not parse_loss_spec(cfg.loss.name, **cfg.loss.params()).needs_reference:
        notes.append(f"{flag_name('model.ref_model')} {cfg.model.ref_model} has no effect: the loss "
                     f"'{cfg.loss.name}' reads no reference")
    if cfg.optim.lr == 0 and cfg.train.max_steps != 0:  # allowed: a dry run of the loop, or of its logging
        notes.append(f"{flag_name('optim.lr')} 0: no step changes the weights; the loss and rewards are the "
                     "initial model's throughout")
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
                                vocab_size=model_vocab_size(cfg.model.path), cache_dir=cache_dir_of(cfg),
                                cache_read_only=unwritable(cache_dir_of(cfg)) is not None)  # a read-only cache
    if data.skipped and env.is_main:
        n = len(data.skipped)
        print(f"{source}: skipped {n} invalid row{'s' if n != 1 else ''}, first: {data.skipped[0]}", file=sys.stderr)
    return data


def _streamed_json(policy) -> dict | None:
    """What streamed (``StreamedLayers.to_json``) and how many decoder layers stayed on the device."""
    streamed = getattr(policy, "dpocache_streamed", None)
    if streamed is None:
        return None
    return {**streamed.to_json(), "resident_layers": len(decoder_layers(policy)) - len(streamed.layers)}


def _products_json(run: Run, which: str) -> dict | None:
    """The linear layers whose products the recompute keeps (``which`` "kept":
    ``--checkpoint-keep``, with ``attention`` where the attention's output is kept too) or skips
    ("skipped": ``--skip-unread-products``): their short names and how many, or None."""
    products = getattr(run.policy, "dpocache_products", None)
    layers = getattr(products, which, None) or []
    attention = products.attention if products is not None and which == "kept" else []
    if not layers and not attention:
        return None
    names = dict.fromkeys(name.removesuffix(".base_layer").rsplit(".", 1)[-1] for name in layers)
    found = {"names": list(names) + ([KEEP_ATTENTION] if attention else []), "linear_layers": len(layers)}
    return {**found, "attention_layers": len(attention)} if attention else found


def _run_info(run: Run, ref_info: dict, kernels: dict) -> dict:
    # Installed versions, without importing peft (4 s of imports) in a run without LoRA.
    versions = {name: importlib.metadata.version(name) for name in ("transformers", "peft")}

    return {
        "config": run.cfg.to_dict(),
        "versions": {"dpocache": __version__, "torch": torch.__version__, "transformers": versions["transformers"],
                     "peft": versions["peft"], "python": platform.python_version()},
        "device": str(run.env.device), "world_size": run.env.world_size, "dtype": dtype_name(run.dtype),
        "data": {"train_pairs": len(run.train_data), "steps_per_epoch": run.steps_per_epoch,
                 # pairs of each epoch's first steps that fill its last batch again (epoch_order)
                 "train_repeated_per_epoch": run.steps_per_epoch * global_batch(run) - len(run.train_data),
                 "train_skipped": len(run.train_data.skipped),
                 "train_truncated": run.train_data.truncated, "train_identical": run.train_data.identical,
                 "eval_pairs": len(run.eval_data) if run.eval_data else 0},
        "policy": {"parameters": count_params(run.policy), "trainable": count_params(run.policy, trainable_only=True),
                   "compiled_layers": run.compiled_layers, "kernels": kernels,  # kernels: dpocache.models.kernels
                   # --stream-base: its frozen layers in host memory (dpocache.models.streaming), or None
                   "streamed": _streamed_json(run.policy),
                   # products the recompute keeps (--checkpoint-keep) or skips (--skip-unread-products), or None
                   "kept_products": _products_json(run, "kept"), "skipped_products": _products_json(run, "skipped")},
        "loss": str(run.spec), "total_steps": run.total_steps, "layout": run.layout.to_json(),
        "reference": ref_info,
    }
