"""The training configuration: one typed dataclass tree; defaults live here and nowhere else.

Every field is settable from a YAML file (nested sections, as ``configs/*.yaml``) and from the
command line as ``--section.field value``; the common ones also have short flags (``--lr``,
``--beta``, ...: see ``ALIASES``). Later sources win: defaults < YAML < command line. A flag or
key that sets nothing is answered with the closest real name, and TRL's names (``TRL_NAMES``)
with dpocache's: ``unknown_name``.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib.util
import inspect
import itertools
import math
import os
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from dpocache.data.sources import pattern_naming
from dpocache.runtime.allocator import ENV as CPU_ALLOCATOR_ENV
from dpocache.runtime.allocator import MODES as CPU_ALLOCATOR_MODES
from dpocache.scoring.layout_choice import (
    ATTENTIONS,
    BF16_MATMUL_ENV,
    BF16_MATMUL_MODES,
    CAUSAL_SDPA_ENV,
    CAUSAL_SDPA_MODES,
    COMPILES,
    LAYOUTS,
    LORA_CAST_ENV,
    LORA_CAST_MODES,
    ROW_GROUPS_ENV,
    ROW_GROUPS_MODES,
    may_share_prompts,
)

# torch (and dpocache.losses.formulas, which needs it) is imported by validate() and help_text() only:
# 1.5 s of imports that reading the options and checking the paths they name do not need.


@dataclass
class ModelConfig:
    path: str | None = None  # policy: a Hugging Face model directory
    ref_model: str | None = None  # reference model directory (default: the initial policy)
    reference: str = "initial"  # initial: an adapter dir's reference is base + adapter | base: the bare base
    dtype: str = "auto"  # compute dtype: auto | float32 | bfloat16 | float16 (autocast over fp32 weights)
    device: str | None = None  # cpu | cuda (default: cuda if available)
    attn_implementation: str = "sdpa"  # train's policy only: sdpa | eager | flash_attention_2 (transformers)
    attention: str = "auto"  # shared/packed layouts: auto (GPU: causal, else sdpa) | sdpa | flex | causal
    compile: str = "auto"  # decoder layers compiled: auto (reference passes that repay it) | on (training too) | off
    kernels: str = "auto"  # Liger's RMSNorm, RoPE, SwiGLU: auto (on CUDA, where installed) | liger | none
    gradient_checkpointing: bool = False  # recompute activations in the backward pass (less memory, slower)
    checkpoint_keep: str = "none"  # LoRA, checkpointed: frozen linears (o_proj,..) or attention, kept for recompute
    skip_unread_products: bool = True  # checkpointed: the recompute skips products no backward reads (down_proj)
    stream_reference: bool = False  # reference pass (GPU): decoder layers stay in host memory, copied in one ahead
    stream_base: bool = False  # LoRA training (GPU): the frozen base's layers likewise (needs gradient checkpointing)
    resident_layers: int = 0  # --stream-base: this many base layers stay on the GPU, spread out (hiding the copies)
    turn_layers: int = 0  # --stream-base: this many more streamed layers wait on the GPU from a backward to a forward


@dataclass
class LoraConfig:
    r: int = 0  # 0: full fine-tuning; > 0: LoRA rank (PEFT)
    alpha: int = 16  # LoRA scaling numerator (scale = alpha / r)
    dropout: float = 0.0  # LoRA dropout
    target_modules: str = "all-linear"  # comma-separated module names, or all-linear


@dataclass
class DataConfig:
    train: str | None = None  # preference data for training
    eval: str | None = None  # held-out preference data
    max_length: int | None = 1024  # tokens of prompt + completion (see dpocache.data.pairs for the rule)
    max_prompt_length: int | None = None  # tokens the prompt keeps at least when truncating (None: max_length // 2)
    skip_invalid: bool = False  # skip bad rows (reported) instead of failing
    prompt_field: str = "prompt"  # the column holding the prompt (e.g. question)
    chosen_field: str = "chosen"  # the column holding the preferred completion
    rejected_field: str = "rejected"  # the column holding the dispreferred completion

    def columns(self) -> tuple[str | None, str, str]:
        """(prompt, chosen, rejected) column names; a prompt column ``none`` means implicit prompts."""
        prompt = None if self.prompt_field.lower() in ("none", "null") else self.prompt_field
        return prompt, self.chosen_field, self.rejected_field


@dataclass
class LossConfig:
    name: str = "sigmoid"  # a loss, or a weighted combination "sigmoid:1,sft:0.1"
    beta: float = 0.1  # > 0: the KL strength (reward scale)
    label_smoothing: float | None = None  # cDPO / robust / exo epsilon (None: the loss's default)
    gamma: float | None = None  # SimPO target margin
    orpo_alpha: float | None = None  # ORPO lambda
    discopop_tau: float | None = None  # DiscoPOP temperature
    rpo_alpha: float | None = None  # RPO: adds alpha * NLL(chosen) to any loss
    ld_alpha: float | None = None  # LD-DPO: weight in [0, 1] of tokens past the shorter completion (TRL name)
    use_weighting: bool = False  # WPO: weight each pair by the policy's aligned length-normalised probabilities
    f_divergence_type: str = "reverse_kl"  # f-DPO: reverse_kl | forward_kl | js_divergence | alpha_divergence
    f_alpha_divergence_coef: float = 0.5  # f-DPO alpha_divergence coefficient, as TRL defines it

    def params(self) -> dict[str, float | None]:
        return {k: v for k, v in dataclasses.asdict(self).items() if k != "name"}


@dataclass
class OptimConfig:
    lr: float = 5e-7  # peak learning rate (AdamW)
    weight_decay: float = 0.0  # AdamW weight decay (not on biases and norms)
    adam_beta1: float = 0.9  # AdamW beta1
    adam_beta2: float = 0.999  # AdamW beta2
    adam_eps: float = 1e-8  # AdamW epsilon
    schedule: str = "linear"  # linear | cosine | constant, after warm-up
    warmup_ratio: float = 0.1  # fraction of the steps with a linear warm-up, in [0, 1]
    max_grad_norm: float = 1.0  # 0 disables clipping


@dataclass
class TrainLoopConfig:
    output_dir: str = "runs/dpo"  # metrics.jsonl, run.json, checkpoints/ and final/
    batch_size: int = 8  # pairs per device per micro-batch
    layout: str = "auto"  # auto (packed where supported) | shared (prompt once per pair) | packed | padded
    grad_accum: int = 1  # micro-batches per optimizer step
    epochs: int = 1  # passes over the training data
    max_steps: int | None = None  # optimizer steps; overrides epochs (0: evaluate only; unset: epochs)
    seed: int = 42  # data order and LoRA initialisation
    logging_steps: int = 10  # optimizer steps per metrics.jsonl row (and a row at each checkpoint)
    eval_steps: int | None = None  # None: evaluate at the start and the end only
    eval_batch_size: int | None = None  # default: batch_size
    save_steps: int | None = None  # also save every N steps (None: by save_minutes and at the end)
    save_minutes: float | None = 30.0  # save every this many minutes (rank 0's clock) and at the end; 0/None: off
    save_total_limit: int = 2  # checkpoints kept (the newest)
    resume: bool = False  # continue from the newest checkpoint in output_dir
    overwrite: bool = False  # start afresh in an output_dir that holds an earlier run
    report_to: str = "none"  # trackers beside metrics.jsonl: none | tensorboard | wandb (or "tensorboard,wandb")
    tensorboard: bool = False  # also write TensorBoard events to output_dir (same as --report-to tensorboard)
    push_to_hub: str | None = None  # a Hub repo id for the final checkpoint
    progress: bool = True  # progress bars on stderr
    prefetch: str = "auto"  # lay the next micro-batches out on a background thread: auto (on CUDA) | on | off


@dataclass
class CacheConfig:
    dir: str | None = None  # default: $DPOCACHE_CACHE_DIR, else $XDG_CACHE_HOME/dpocache, else ~/.cache/dpocache
    max_tokens: int | None = None  # padded tokens per reference forward (None: cache.build.default_max_tokens)
    layout: str = "auto"  # reference pass: auto | shared (each prompt once) | packed | padded (scoring.layout_choice)
    shard_size: int = 4096  # pairs per cache shard (a shard is also flushed every 60 s)


@dataclass
class DistributedConfig:
    fsdp: bool = False  # under torchrun, FSDP2-shard train's policy (and its reference build), cache build's reference
    backend: str | None = None  # default: nccl on CUDA, gloo on CPU


@dataclass
class Config:
    """Every setting of a run, one section per area; and, off its fields (so not in run.json),
    ``set_in_file``: ``{dotted field: (config file, key as written)}`` for the values a file set
    and no flag overrode, which a bad value's error names (``in_config_file``)."""

    model: ModelConfig = field(default_factory=ModelConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    data: DataConfig = field(default_factory=DataConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainLoopConfig = field(default_factory=TrainLoopConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)

    def __post_init__(self) -> None:
        self.set_in_file: dict[str, tuple[str, str]] = {}  # not a field: asdict and run.json leave it out

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def validate(self, required: tuple[str, ...] = ()) -> "Config":
        """Check every value that can be checked without loading a model or reading data, so
        that a typo costs one line and no waiting. ``required``: dotted fields that must be set
        (``("model.path", "data.train")`` for ``train``). Raises ``ConfigError`` naming the
        field; returns ``self``."""
        missing = [flag_name(d) for d in required if _get(self, d) is None]
        if missing:
            raise ConfigError(f"missing {' and '.join(missing)}")
        try:
            _validate_loss(self.loss)
            _validate_data(self.data)
            _validate_choices(self)
            _validate_counts(self)
            _validate_hub(self.train)
            validate_device(self.model.device)
            _validate_kernels(self.model)
            _validate_streaming(self)
            _validate_checkpoint_keep(self)
        except ConfigError as e:
            raise ConfigError(in_config_file(self, str(e))) from None
        validate_environment()
        return self


# Short command-line flags for the fields users set most.
ALIASES = {
    "model": "model.path", "ref_model": "model.ref_model", "dtype": "model.dtype", "device": "model.device",
    "reference": "model.reference",
    "gradient_checkpointing": "model.gradient_checkpointing", "lora_r": "lora.r",
    "data": "data.train", "eval_data": "data.eval", "max_length": "data.max_length",
    "max_prompt_length": "data.max_prompt_length", "loss": "loss.name", "beta": "loss.beta",
    "lr": "optim.lr", "output_dir": "train.output_dir", "batch_size": "train.batch_size",
    "grad_accum": "train.grad_accum", "epochs": "train.epochs", "max_steps": "train.max_steps", "seed": "train.seed",
    "logging_steps": "train.logging_steps", "eval_steps": "train.eval_steps", "save_steps": "train.save_steps",
    "resume": "train.resume", "push_to_hub": "train.push_to_hub", "cache_dir": "cache.dir", "fsdp": "distributed.fsdp",
    "skip_invalid": "data.skip_invalid", "max_tokens": "cache.max_tokens", "shard_size": "cache.shard_size",
    "report_to": "train.report_to", "attention": "model.attention", "compile": "model.compile",
    "kernels": "model.kernels", "stream_reference": "model.stream_reference", "stream_base": "model.stream_base",
    "checkpoint_keep": "model.checkpoint_keep", "resident_layers": "model.resident_layers",
    "turn_layers": "model.turn_layers", "skip_unread_products": "model.skip_unread_products",
}

# The names of TRL's DPOConfig and TrainingArguments (and its scripts' ModelConfig) that a TRL user
# types by habit, with the dpocache setting that does their job: name -> (dotted field, the value
# to give it where the name is a switch, how the two differ). They are answered, not accepted: an
# alias would give one setting two names (in configs, run.json and --help), and where the meaning
# differs (warmup_steps is a count, ours a fraction) it would change the run without a word.
# Names both spell alike (--beta, --max-length, --seed, ...) are dpocache's own flags: docs/usage.md.
TRL_NAMES: dict[str, tuple[str, str | None, str]] = {
    "learning_rate": ("optim.lr", None, ""),
    "num_train_epochs": ("train.epochs", None, "whole epochs only"),
    "per_device_train_batch_size": ("train.batch_size", None, "pairs per device per micro-batch, as in TRL"),
    "per_device_eval_batch_size": ("train.eval_batch_size", None, "pairs per device, as in TRL"),
    "gradient_accumulation_steps": ("train.grad_accum", None, ""),
    "warmup_ratio": ("optim.warmup_ratio", None, ""),
    "warmup_steps": ("optim.warmup_ratio", None, "a fraction of the optimizer steps, not a count"),
    "lr_scheduler_type": ("optim.schedule", None, "linear, cosine or constant, each after the warm-up; "
                          "TRL's constant_with_warmup is dpocache's constant"),
    "weight_decay": ("optim.weight_decay", None, ""),
    "max_grad_norm": ("optim.max_grad_norm", None, ""),
    "adam_beta1": ("optim.adam_beta1", None, ""),
    "adam_beta2": ("optim.adam_beta2", None, ""),
    "adam_epsilon": ("optim.adam_eps", None, ""),
    "save_total_limit": ("train.save_total_limit", None, ""),
    "save_strategy": ("train.save_steps", "N", "runs save at the end, every train.save_minutes, and every N steps "
                      "if set"),
    "eval_strategy": ("train.eval_steps", "N", "--eval-data is evaluated at the start and the end, and every N "
                      "steps if set"),
    "evaluation_strategy": ("train.eval_steps", "N", "--eval-data is evaluated at the start and the end, and every "
                            "N steps if set"),
    "resume_from_checkpoint": ("train.resume", None, "a switch: it continues from the newest checkpoint in "
                               "--output-dir"),
    "hub_model_id": ("train.push_to_hub", "REPO", "the repo id itself, with no separate switch"),
    "loss_type": ("loss.name", None, "several losses as one weighted value, e.g. sigmoid:1,sft:0.1"),
    "loss_weights": ("loss.name", None, "the weights go beside the loss names, e.g. sigmoid:1,sft:0.1"),
    "label_smoothing": ("loss.label_smoothing", None, ""),
    "use_weighting": ("loss.use_weighting", None, ""),
    "ld_alpha": ("loss.ld_alpha", None, ""),
    "rpo_alpha": ("loss.rpo_alpha", None, ""),
    "discopop_tau": ("loss.discopop_tau", None, ""),
    "f_divergence_type": ("loss.f_divergence_type", None, ""),
    "f_alpha_divergence_coef": ("loss.f_alpha_divergence_coef", None, ""),
    "max_completion_length": ("data.max_length", None, "it bounds prompt + completion; a completion keeps what "
                              "the prompt leaves"),
    "bf16": ("model.dtype", "bfloat16", "autocast over float32 weights, as TRL's mixed precision"),
    "fp16": ("model.dtype", "float16", "autocast over float32 weights, as TRL's mixed precision"),
    "torch_dtype": ("model.dtype", None, "the autocast dtype; the weights stay float32"),
    "use_cpu": ("model.device", "cpu", ""),
    "no_cuda": ("model.device", "cpu", ""),
    "model_name_or_path": ("model.path", None, "a model directory, or a Hub id already in the local cache"),
    "dataset_name": ("data.train", None, "a local file or datasets directory, not a Hub data set name"),
    "use_peft": ("lora.r", "N", "a LoRA rank above 0 turns LoRA on"),
    "lora_alpha": ("lora.alpha", None, ""),
    "lora_dropout": ("lora.dropout", None, ""),
    "lora_target_modules": ("lora.target_modules", None, ""),
    "torch_compile": ("model.compile", "on", "the decoder layers, in training and in reference passes"),
    "use_liger_kernel": ("model.kernels", "liger", "RMSNorm, RoPE and SwiGLU, on CUDA; auto applies them where "
                         "liger-kernel is installed; the output head stays dpocache's (no fused cross entropy)"),
}

SCHEDULES = ("linear", "cosine", "constant")
PREFETCHES = ("auto", "on", "off")  # train.prefetch: dpocache.training.prefetch
BOOL_WORDS = ("true", "1", "yes", "on", "false", "0", "no", "off")  # a switch's values: the first four are true
TRACKERS = ("none", "tensorboard", "wandb")
DTYPE_NAMES = ("auto", "float32", "bfloat16", "float16")
KERNELS = ("auto", "liger", "none")  # model.kernels (dpocache.models.kernels), here so that checking imports no torch
LIGER_MISSING = "liger-kernel is not installed (pip install 'dpocache[liger]')"
# cache export's formats (dpocache.cache.export writes them); here so that checking a flag imports no torch.
EXPORT_FORMATS = ("jsonl", "parquet", "datasets", "safetensors", "keys")
# The format an --out name picks when --format is not given (a directory or another name: say --format).
EXPORT_SUFFIXES = {".jsonl": "jsonl", ".parquet": "parquet", ".safetensors": "safetensors"}


def with_fields(record_type: type, record, fields: dict):
    """``record`` (a dataclass of ``record_type``; None: its defaults) with ``fields`` set over it:
    the options records (``cache.build.BuildOptions``, ``service.ServiceOptions``) also take
    their fields as keyword arguments. An unknown field is a ``TypeError`` naming it."""
    unknown = sorted(set(fields) - {f.name for f in dataclasses.fields(record_type)})
    if unknown:
        raise TypeError(f"unknown {record_type.__name__} field(s): {', '.join(unknown)}")
    return dataclasses.replace(record or record_type(), **fields)


class ConfigError(ValueError):
    """A setting that cannot run: the message names the flag, or the config file and key."""


def whole_number(value: Any, least: int) -> bool:
    """Whether ``value`` is an integer (Python's or numpy's; not a bool) of at least ``least``:
    the check of every count an API argument gives (``max_tokens``, ``num_replicas``)."""
    return hasattr(value, "__index__") and not isinstance(value, bool) and value >= least


# ------------------------------------------------------------------------------- validation


def check_batch_fits(cfg: Config, data, world_size: int = 1) -> None:
    """One optimizer step's pairs must exist: checked after the data loads, before any model does."""
    global_batch = cfg.train.batch_size * cfg.train.grad_accum * world_size
    if global_batch > len(data):
        raise ConfigError(f"{flag_name('train.batch_size')} {cfg.train.batch_size} x grad_accum "
                          f"{cfg.train.grad_accum} x {world_size} ranks = {global_batch} pairs per step, more than "
                          f"the {len(data)} pairs of {cfg.data.train}")


def _get(cfg: Config, dotted: str) -> Any:
    section, name = dotted.split(".", 1)
    return getattr(getattr(cfg, section), name)


def in_config_file(cfg: Config, message: str) -> str:
    """``message`` (which starts with the flag of the field it is about, ``flag_name``) naming
    the config file and its key instead, where the value came from a file and no flag set it
    over it: ``b0.yaml: loss.beta: must be ...``, not ``--beta (loss.beta): ...``, a flag the
    user never typed."""
    for dotted, (source, key) in cfg.set_in_file.items():
        shown = flag_name(dotted)
        if message.startswith(shown) and message[len(shown):len(shown) + 1] in (":", " ", ""):
            return f"{source}: {key}{message[len(shown):]}"
    return message


def flag_name(dotted: str) -> str:
    """``train.batch_size`` -> ``--batch-size (train.batch_size)``: the flag a user typed, and the field."""
    alias = {v: k for k, v in ALIASES.items()}.get(dotted)
    return f"--{alias.replace('_', '-')} ({dotted})" if alias else f"--{dotted}"


def _validate_loss(loss: LossConfig) -> None:
    from dpocache.losses.registry import check_loss_values, check_params_read, parse_loss_spec  # noqa: PLC0415 - see the note on torch above

    if not (loss.beta > 0 and math.isfinite(loss.beta)):  # also catches NaN
        raise ConfigError(f"{flag_name('loss.beta')}: must be a finite number > 0, got {loss.beta}")
    try:
        spec = parse_loss_spec(loss.name, **loss.params())
        check_loss_values(spec)
        check_params_read(spec)
    except ValueError as e:
        # A message about one of the loss's parameters names that flag, not --loss.
        key = next((k for k in loss.params() if str(e).startswith((f"{k} ", f"{k}="))), None)
        where = flag_name(f"loss.{key}") if key else f"{flag_name('loss.name')} {loss.name!r}"
        raise ConfigError(f"{where}: {e}") from None


def _validate_data(data: DataConfig) -> None:
    for dotted, value in (("data.max_length", data.max_length), ("data.max_prompt_length", data.max_prompt_length)):
        if value is not None and value < 1:
            raise ConfigError(f"{flag_name(dotted)}: must be >= 1 (or none), got {value}")
    both = data.max_length is not None and data.max_prompt_length is not None
    if both and data.max_prompt_length >= data.max_length:
        raise ConfigError(f"{flag_name('data.max_prompt_length')} ({data.max_prompt_length}) must be below "
                          f"{flag_name('data.max_length')} ({data.max_length})")
    names = {"data.prompt_field": data.prompt_field, "data.chosen_field": data.chosen_field,
             "data.rejected_field": data.rejected_field}
    for dotted, value in names.items():
        if not value.strip():
            raise ConfigError(f"{flag_name(dotted)}: cannot be empty")
    if len(set(names.values())) < len(names):
        raise ConfigError(f"--data.prompt_field, --data.chosen_field and --data.rejected_field must name three "
                          f"different columns, got {list(names.values())}")


def _validate_choices(cfg: Config) -> None:
    choices = {"model.dtype": DTYPE_NAMES, "model.reference": ("initial", "base"), "optim.schedule": SCHEDULES,
               "train.layout": LAYOUTS, "cache.layout": LAYOUTS, "model.attention": ATTENTIONS,
               "model.compile": COMPILES, "train.prefetch": PREFETCHES, "model.kernels": KERNELS}
    for dotted, allowed in choices.items():
        if _get(cfg, dotted) not in allowed:
            raise ConfigError(f"{flag_name(dotted)}: must be one of {', '.join(allowed)}; got {_get(cfg, dotted)!r}")
    for name in cfg.train.report_to.split(","):
        if name.strip() not in TRACKERS:
            raise ConfigError(f"{flag_name('train.report_to')}: must be one of {', '.join(TRACKERS)} (or several, "
                              f"comma-separated); got {name.strip()!r}")
    if cfg.train.resume and cfg.train.overwrite:  # one would silently win over the other
        raise ConfigError(f"{flag_name('train.resume')} continues the run in {cfg.train.output_dir} and "
                          "--train.overwrite deletes it: pass one of them")


def _validate_hub(train: TrainLoopConfig) -> None:
    # TRL's push_to_hub is a switch (the repo is hub_model_id): `--push-to-hub` alone here would
    # name a repo "true", and fail only at the end of the run.
    if train.push_to_hub is not None and train.push_to_hub.lower() in BOOL_WORDS:
        raise ConfigError(f"{flag_name('train.push_to_hub')} takes a Hub repo id (org/name), got "
                          f"'{train.push_to_hub}' (TRL's push_to_hub + hub_model_id REPO is dpocache's "
                          "--push-to-hub REPO)")
    if train.push_to_hub is not None and train.max_steps == 0:
        raise ConfigError(f"{flag_name('train.push_to_hub')} with {flag_name('train.max_steps')} 0: a run of no "
                          "step writes no model to push")


# Fields that count something: at least 1 (the optional ones when set); intervals where 0 means "off".
POSITIVE = ("train.batch_size", "train.grad_accum", "train.epochs", "train.logging_steps", "train.eval_batch_size",
            "cache.max_tokens", "cache.shard_size", "train.save_total_limit")
NON_NEGATIVE = ("train.eval_steps", "train.save_steps", "train.max_steps",  # max_steps 0: evaluate only
                "train.save_minutes", "optim.weight_decay", "optim.max_grad_norm")
ZERO_MEANS = {"train.max_steps": "no training step: the step-0 evaluation only; unset: --epochs decides, which TRL "
                                 "spells -1",
              "train.eval_steps": "at the start and the end only, as unset"}
# Values torch.optim.AdamW and peft refuse only after the reference pass: [low, high) each.
HALF_OPEN = {"optim.adam_beta1": (0.0, 1.0), "optim.adam_beta2": (0.0, 1.0), "lora.dropout": (0.0, 1.0)}


def _validate_counts(cfg: Config) -> None:
    for dotted in POSITIVE:
        value = _get(cfg, dotted)
        if value is not None and value < 1:
            raise ConfigError(f"{flag_name(dotted)}: must be >= 1, got {value}")
    for dotted in NON_NEGATIVE:
        value = _get(cfg, dotted)
        if value is not None and value < 0:
            raise ConfigError(f"{flag_name(dotted)}: must be >= 0 (0: {ZERO_MEANS.get(dotted, 'never')}), got {value}")
    if cfg.lora.r < 0:
        raise ConfigError(f"{flag_name('lora.r')}: must be >= 0 (0: full fine-tuning), got {cfg.lora.r}")
    if not (math.isfinite(cfg.optim.lr) and cfg.optim.lr >= 0):
        raise ConfigError(f"{flag_name('optim.lr')}: must be a finite number >= 0, got {cfg.optim.lr}")
    if not 0 <= cfg.optim.warmup_ratio <= 1:
        raise ConfigError(f"--optim.warmup_ratio: must be in [0, 1], got {cfg.optim.warmup_ratio}")
    for dotted, (low, high) in HALF_OPEN.items():
        value = _get(cfg, dotted)
        if not low <= value < high:  # also catches NaN
            raise ConfigError(f"{flag_name(dotted)}: must be in [{low:g}, {high:g}), got {value}")
    if not cfg.optim.adam_eps > 0:
        raise ConfigError(f"{flag_name('optim.adam_eps')}: must be > 0, got {cfg.optim.adam_eps}")
    if cfg.lora.r > 0 and not cfg.lora.alpha > 0:
        raise ConfigError(f"{flag_name('lora.alpha')}: must be > 0 (the adapter's scale is alpha / r), "
                          f"got {cfg.lora.alpha}")


def validate_environment() -> None:
    """The environment variables dpocache reads whose values are a choice (every command checks
    them first: ``dpocache.cli.entry``)."""
    for name, modes in ((CAUSAL_SDPA_ENV, CAUSAL_SDPA_MODES), (CPU_ALLOCATOR_ENV, CPU_ALLOCATOR_MODES),
                        (BF16_MATMUL_ENV, BF16_MATMUL_MODES), (LORA_CAST_ENV, LORA_CAST_MODES),
                        (ROW_GROUPS_ENV, ROW_GROUPS_MODES)):
        value = os.environ.get(name)
        if value is not None and value not in modes and not (value == "" and name == CPU_ALLOCATOR_ENV):
            raise ConfigError(f"${name} must be {' or '.join(modes)}; got '{value}'")


def validate_device(device: str | None, flag: str | None = None) -> None:
    """``device`` (None: the default) names a device this machine has; ``flag`` names it in the
    error (default: ``model.device``'s flag; ``score``, which has no configuration, passes ``--device``)."""
    if device is None:
        return
    import torch  # noqa: PLC0415 - see the note on torch above

    flag = flag or flag_name("model.device")
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError):
        raise ConfigError(f"{flag}: '{device}' is not a device (cpu, cuda, cuda:N)") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"{flag} {device}: no CUDA device is available; use cpu")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise ConfigError(f"{flag} {device}: only {torch.cuda.device_count()} CUDA devices")


def liger_unavailable(device_type: str, installed: bool | None = None) -> str | None:
    """Why Liger's kernels cannot run on a device of ``device_type`` (``cuda``, ``cpu``), or None
    where they can. ``installed``: whether liger-kernel is (None: look, without importing it).
    The one rule of ``--kernels`` that needs no model: ``dpocache.models.kernels`` adds the family."""
    if device_type != "cuda":  # Liger's kernels are Triton's, which runs on GPUs only
        return f"Liger's kernels run on CUDA only, and this run's device is {device_type}"
    if not (importlib.util.find_spec("liger_kernel") is not None if installed is None else installed):
        return LIGER_MISSING
    return None


def device_type(device: str | None) -> str:
    """The type of the device a run with ``device`` (None: the default) runs on: cuda where
    one is available, else cpu. After ``validate_device``: ``device`` is one."""
    import torch  # noqa: PLC0415 - see the note on torch above

    return torch.device(device).type if device else "cuda" if torch.cuda.is_available() else "cpu"


def _validate_kernels(model: ModelConfig) -> None:
    """``--kernels liger`` where Liger cannot run, refused before any model loads (``auto`` runs
    the model's own code there instead). After ``validate_device``: the device is one."""
    if model.kernels != "liger":
        return
    reason = liger_unavailable(device_type(model.device))
    if reason:
        raise liger_refused(reason)


# The layer counts --stream-base takes: what each counts, and what it is.
STREAMED_LAYER_COUNTS = {
    "model.resident_layers": ("decoder layers", "the base layers that stay on the GPU while the others stream"),
    "model.turn_layers": ("streamed layers", "streamed base layers that wait on the GPU from a backward to the next "
                                             "forward"),
}


def _validate_streaming(cfg: Config) -> None:
    """``--stream-reference`` and ``--stream-base`` where they cannot run, refused before any
    model loads (``dpocache.models.streaming``). After ``validate_device``: the device is one."""
    if cfg.model.stream_reference and cfg.model.compile == "on":
        # A LoRA policy's streamed layers compile inside their checkpoints (models.checkpointing)
        raise ConfigError(f"{flag_name('model.stream_reference')}: a streamed reference's layers swap their weights "
                          "around each call, which a compiled layer would trace; use "
                          f"{flag_name('model.compile')} auto or off with it")
    for dotted in ("model.stream_reference", "model.stream_base"):
        if _get(cfg, dotted):
            _validate_streamed(cfg, flag_name(dotted))
    if cfg.model.stream_base:
        flag = flag_name("model.stream_base")
        if not _trains_lora(cfg):
            raise ConfigError(f"{flag}: streams the frozen base of a LoRA policy; pass {flag_name('lora.r')} N "
                              "(full fine-tuning trains every weight, which the optimizer needs on the device)")
        if not cfg.model.gradient_checkpointing:
            raise ConfigError(f"{flag}: needs {flag_name('model.gradient_checkpointing')} true (without it autograd "
                              "keeps every layer's weights for the backward, which a streamed layer gives back)")
    for dotted, (counted, what) in STREAMED_LAYER_COUNTS.items():
        flag, value = flag_name(dotted), _get(cfg, dotted)
        if value < 0:
            raise ConfigError(f"{flag}: a number of {counted}, 0 or more; got {value}")
        if value and not cfg.model.stream_base:
            raise ConfigError(f"{flag}: {what}; pass {flag_name('model.stream_base')} true with it")



def _trains_lora(cfg: Config) -> bool:
    """A LoRA run: a fresh adapter (``--lora-r``) or a PEFT adapter directory as ``--model``."""
    adapter_dir = bool(cfg.model.path) and (Path(cfg.model.path) / "adapter_config.json").is_file()
    return cfg.lora.r > 0 or adapter_dir


# ``--checkpoint-keep``'s name for the attention's output (``dpocache.models.kept_attention``).
KEEP_ATTENTION = "attention"


def checkpoint_keep_names(text: str | None) -> tuple[str, ...]:
    """``--checkpoint-keep``'s module names, once each: ``none`` (or empty) is none; else
    comma-separated names, each a Python identifier (``down_proj``). ``ConfigError`` otherwise."""
    if text is None or text.strip().lower() in ("", "none"):
        return ()
    names = tuple(name.strip() for name in text.split(","))
    bad = [name for name in names if not name.isidentifier()]
    if bad:
        raise ConfigError(f"{flag_name('model.checkpoint_keep')}: {bad[0]!r} is not a module name; give the decoder "
                          "layers' linear layers by name, comma-separated (down_proj,o_proj), or none")
    return tuple(dict.fromkeys(names))


def _validate_checkpoint_keep(cfg: Config) -> None:
    """``--checkpoint-keep`` where it cannot run, refused before any model loads
    (``dpocache.models.checkpointing``); ``train`` matches its names against the model's config
    before any model loads (``check_keep_names``)."""
    if not checkpoint_keep_names(cfg.model.checkpoint_keep):
        return
    flag = flag_name("model.checkpoint_keep")
    if not cfg.model.gradient_checkpointing:
        raise ConfigError(f"{flag}: keeps products through activation checkpointing's recompute; pass "
                          f"{flag_name('model.gradient_checkpointing')} true with it")
    if not _trains_lora(cfg):
        raise ConfigError(f"{flag}: keeps the products of frozen matrices (a LoRA policy's base); pass "
                          f"{flag_name('lora.r')} N (a trained matrix needs its input for its own gradient too)")
    if cfg.model.compile == "on" and not cfg.model.stream_base:
        # a streamed base's layers compile inside their checkpoints, which keep products (models.checkpointing)
        raise ConfigError(f"{flag}: a resident layer compiles whole, its checkpoint inside the graph, where no "
                          f"product can be kept; use {flag_name('model.compile')} auto or off with it (or "
                          f"{flag_name('model.stream_base')} true)")
    if KEEP_ATTENTION in checkpoint_keep_names(cfg.model.checkpoint_keep):
        if cfg.model.attention in ("sdpa", "flex"):
            raise ConfigError(f"{flag}: {KEEP_ATTENTION} keeps the causal rows' attention output; "
                              f"{flag_name('model.attention')} {cfg.model.attention} runs none (use causal or auto)")
        if not may_share_prompts(cfg.train.layout):  # padded: no causal rows
            raise ConfigError(f"{flag}: {KEEP_ATTENTION} keeps the causal rows' attention output; the "
                              f"{cfg.train.layout} layout ({flag_name('train.layout')}) runs none")


def _validate_streamed(cfg: Config, flag: str) -> None:
    if cfg.distributed.fsdp:
        raise ConfigError(f"{flag}: a model sharded with {flag_name('distributed.fsdp')} is loaded a shard per GPU "
                          "and gathered a layer at a time already; pass one of them")
    if device_type(cfg.model.device) != "cuda":
        raise ConfigError(f"{flag}: streams weights from host memory to a GPU; this run's device is "
                          f"{device_type(cfg.model.device)}, where they are in host memory already")


def liger_refused(reason: str) -> ConfigError:
    """The one line that refuses ``--kernels liger`` for ``reason``."""
    return ConfigError(f"{flag_name('model.kernels')} liger: {reason}; --kernels auto runs Liger's kernels where they "
                       "can run and the model's own code elsewhere")


def _sections() -> dict[str, type]:
    return {f.name: f.default_factory().__class__ for f in dataclasses.fields(Config)}  # type: ignore[misc]


def field_types() -> dict[str, Any]:
    """``{"section.field": annotation}`` for every field of the tree."""
    out = {}
    for section, cls in _sections().items():
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            out[f"{section}.{f.name}"] = hints[f.name]
    return out


# Fields given as comma-separated names, which a YAML file may also give as a list of names.
LIST_FIELDS = ("lora.target_modules",)


def _coerce(dotted: str, annotation: Any, value: Any) -> Any:
    """Turn ``value`` (a YAML scalar or a command-line string) into the field's type."""
    optional = type(None) in typing.get_args(annotation)
    base = _base_type(annotation)
    if value is None or (isinstance(value, str) and optional and value.lower() in ("none", "null")):
        if optional:
            return None
        raise ConfigError(f"{dotted}: cannot be empty")
    if dotted in LIST_FIELDS and isinstance(value, list) and value and all(isinstance(v, str) for v in value):
        return ",".join(value)  # as PEFT and TRL configs write it: [q_proj, v_proj]
    if isinstance(value, (dict, list)):
        # A YAML list or mapping where a scalar belongs: str() would accept it silently, int()
        # and float() raise TypeError.
        raise ConfigError(f"{dotted}: expected {getattr(base, '__name__', base)}, got {value!r}")
    try:
        if base is bool:
            if isinstance(value, bool):
                return value
            if str(value).lower() in BOOL_WORDS[:4]:
                return True
            if str(value).lower() in BOOL_WORDS[4:]:
                return False
            raise ValueError(value)
        if base is int:
            if isinstance(value, float) and not value.is_integer():
                raise ValueError(value)
            return int(value)
        if base is float:
            return float(value)
        return str(value)
    except ValueError:
        raise ConfigError(f"{dotted}: expected {getattr(base, '__name__', base)}, got {value!r}") from None


# The fields that name files or directories: a leading ~ is the user's home.
PATH_FIELDS = ("model.path", "model.ref_model", "data.train", "data.eval", "train.output_dir", "cache.dir")


def _base_type(annotation: Any) -> Any:
    """``int | None`` -> ``int``."""
    args = typing.get_args(annotation)
    return next((a for a in args if a is not type(None)), annotation) if args else annotation


def _resolve(name: str, aliases: dict[str, str] | None = None) -> str:
    """A flag's or YAML key's name (``batch-size``, ``optim.lr``) -> the dotted field it would set."""
    key = str(name).replace("-", "_")
    return {**ALIASES, **(aliases or {})}.get(key, key)


def _set(cfg: Config, dotted: str, value: Any, aliases: dict[str, str] | None = None,
         shown: str | None = None) -> None:
    """Set the field ``dotted`` (or a name for it) to ``value``; ``shown``: how a bad value's
    error names it (default: the dotted field)."""
    types_ = field_types()
    if _resolve(dotted, aliases) not in types_:  # build_config and apply_mapping check every name first
        raise ConfigError(unknown_name(dotted, value, aliases))
    dotted = _resolve(dotted, aliases)
    section, name = dotted.split(".", 1)
    value = _coerce(shown or dotted, types_[dotted], value)
    if dotted in PATH_FIELDS and isinstance(value, str):
        # A shell expands ~ at a word's start only (not in --cache-dir=~/x), and YAML never: a
        # directory named '~' in the working directory is a trap for whoever removes it.
        value = os.path.expanduser(value)
    setattr(getattr(cfg, section), name, value)


def apply_mapping(cfg: Config, mapping: dict, source: str) -> None:
    """Apply a (possibly nested) mapping from YAML: ``{optim: {lr: 1e-6}}`` or ``{lr: 1e-6}``.
    Every unknown key is named, in one error, before any is applied."""
    problems = _unknown_keys(mapping)
    if problems:
        raise ConfigError(f"{source}: {' | '.join(problems)}")
    for key, value in mapping.items():
        if isinstance(value, dict) and key in _sections():
            for sub, v in value.items():
                _set_from(cfg, f"{key}.{sub}", v, source)
        elif not _empty_section(key, value):
            _set_from(cfg, key, value, source)


def _empty_section(key: Any, value: Any) -> bool:
    """A section with nothing under it (``optim:`` with its every field commented out), which
    YAML reads as null: it sets nothing."""
    return value is None and key in _sections()


def _set_from(cfg: Config, dotted: str, value: Any, source: str, aliases: dict[str, str] | None = None) -> None:
    try:
        _set(cfg, dotted, value, aliases)
    except ConfigError as e:
        raise ConfigError(f"{source}: {e}") from None
    # Which file set the field, and under which key: its value's errors name them (in_config_file).
    cfg.set_in_file[_resolve(dotted, aliases)] = (source, dotted)


def load_yaml(path: str | Path) -> dict:
    try:
        data = yaml.safe_load(Path(path).read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: invalid YAML: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping at the top level")
    return data


def parse_overrides(args: list[str]) -> list[tuple[str, str | None]]:
    """``["--optim.lr", "1e-6", "--resume", "--beta=0.2"]`` → ``[(optim.lr, 1e-6), (resume, None), (beta, 0.2)]``.
    A flag followed by another flag (or nothing) has no value (None): a switch, where its field
    is a bool (``switch_value``)."""
    out = []
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--"):
            raise ConfigError(_expanded_pattern(out[-1] if out else None, args[i:]) or
                              f"unexpected argument '{arg}' (options are --key value)")
        key = arg[2:]
        if "=" in key:
            key, value = key.split("=", 1)
            i += 1
        elif i + 1 < len(args) and not args[i + 1].startswith("--"):
            value = args[i + 1]
            i += 2
        else:
            value = None
            i += 1
        out.append((key, value))
    return out


def _expanded_pattern(flag: tuple[str, str | None] | None, rest: list[str]) -> str | None:
    """What to say where a flag's value is followed by more files: the shell expanded an unquoted
    pattern (``--data data/train-*.parquet``) into them; None otherwise."""
    if flag is None or flag[1] is None:
        return None
    files = [flag[1], *itertools.takewhile(lambda a: not a.startswith("--"), rest)]
    if not all(Path(f).is_file() for f in files):
        return None
    shown = ", ".join(files[:2]) + (", ..." if len(files) > 2 else "")
    return (f"--{flag[0]} takes one path and got {len(files)} files ({shown}), as the shell expands an unquoted "
            f"pattern: quote the pattern, and dpocache reads the files it names as one data set, as --{flag[0]} "
            f"'{pattern_naming(files)}'")


def switch_value(flag: str, annotation: Any, value: str | None) -> str:
    """A flag's value as typed; a flag given without one is ``true`` where it is a switch (a bool),
    else one line: a path flag followed by another flag had become the string 'true' (a run
    written into ./true)."""
    if value is not None:
        return value
    if _base_type(annotation) is not bool:
        raise ConfigError(f"{flag} needs a value ({flag} VALUE); none was given before the next flag or the end")
    return "true"


def build_config(yaml_path: str | Path | None = None, overrides: list[str] | None = None,
                 aliases: dict[str, str] | None = None, options: tuple[str, ...] = ()) -> Config:
    """Defaults < YAML < ``overrides`` (``--key value`` strings). ``aliases``: a command's own
    short flags on top of ``ALIASES`` (``cache build --layout`` is ``cache.layout``). ``options``:
    the command's options that are not fields (``--per-token``), named when a flag is one's typo."""
    cfg = Config()
    if yaml_path is not None:
        apply_mapping(cfg, load_yaml(yaml_path), str(yaml_path))
    pairs = parse_overrides(overrides or [])
    # Every unknown flag at once, before any is applied: one run to fix them all.
    unknown = [unknown_name(k, v, aliases, options) for k, v in pairs if _resolve(k, aliases) not in field_types()]
    if unknown:
        raise ConfigError(" | ".join(unknown))
    for key, value in pairs:
        dotted = _resolve(key, aliases)
        if value is None and dotted == "train.push_to_hub":
            value = "true"  # TRL's switch: _validate_hub's line says what dpocache's flag takes
        value = switch_value(f"--{key}", field_types()[dotted], value)
        cfg.set_in_file.pop(dotted, None)  # the flag's value is the one checked
        # a bad value is named by the flag as typed, and its field where the flag is a short one
        _set(cfg, key, value, aliases, shown=f"--{key}" + (f" ({dotted})" if key.replace("-", "_") != dotted else ""))
    return cfg


# ------------------------------------------------------------------------------- unknown names


def unknown_name(typed: str, value: Any, aliases: dict[str, str] | None = None, options: tuple[str, ...] = (),
                 yaml: bool = False) -> str:
    """What to say of a flag (``typed`` as given, without its ``--``) or, with ``yaml``, a config
    file's key that sets no field: the closest of the real names, the command's own ``options`` and
    TRL's names (``TRL_NAMES``, answered with dpocache's). ``value``: what was given with it, which
    breaks ties (``--bata 0.2`` is a typo of the number --beta rather than of the path --data)."""
    aliases = {**ALIASES, **(aliases or {})}
    key = str(typed).replace("-", "_")
    head = f"unknown field '{key}'" if yaml else f"unknown flag --{typed}"
    names = _known_names(aliases)
    match = _closest(key, value, names, options)
    if match in TRL_NAMES:
        dotted, given, note = TRL_NAMES[match]
        ours = _shown(dotted, dotted, aliases, yaml, given)
        return f"{head}; did you mean {ours}? (TRL's {match} is dpocache's {ours}{': ' + note if note else ''})"
    if match in options:  # one of the command's own options, which are not fields
        return f"{head}; did you mean --{match.replace('_', '-')}?"
    head += "" if yaml else f" (config field '{key}')"
    if match is None:
        return f"{head}; see --help for the {'fields' if yaml else 'flags'}"
    return f"{head}; did you mean {_shown(match, names[match], aliases, yaml)}?"


def _known_names(aliases: dict[str, str]) -> dict[str, str]:
    """Every name a flag or YAML key may use (underscored) -> the dotted field it sets: the short
    flags, the dotted fields, and for suggestions only a field's bare name where one section has
    it (``warmup_ratio`` is ``optim.warmup_ratio``)."""
    dotted = list(field_types())
    bare = [d.split(".", 1)[1] for d in dotted]
    return {**{b: d for b, d in zip(bare, dotted) if bare.count(b) == 1}, **{d: d for d in dotted}, **aliases}


def _shown(name: str, dotted: str, aliases: dict[str, str], yaml: bool, value: str | None = None) -> str:
    """How to write ``dotted`` (and ``value``, if given) on the command line (its short flag if it
    has one, as ``name`` or at all: ``--dtype bfloat16``) or in YAML, quoted (the short name only
    where the user gave one: ``'model.dtype: bfloat16'``)."""
    if yaml:
        key = name if name in aliases else dotted
        return f"'{key}: {value}'" if value else f"'{key}'"
    short = name if name in aliases else {v: k for k, v in aliases.items()}.get(dotted)
    flag = f"--{short.replace('_', '-')}" if short else f"--{dotted}"
    return f"{flag} {value}" if value else flag


def _closest(key: str, value: Any, names: dict[str, str], options: tuple[str, ...]) -> str | None:
    """The name in ``names``, ``options`` or ``TRL_NAMES`` closest to ``key`` (difflib's ratio,
    at least 0.6; ties go to the name whose field takes a value like ``value``); None if none is
    close. A key under a real section (``optim.lerning_rate``) is compared within that section."""
    section, _, rest = key.rpartition(".")
    if section in _sections():
        pool = {d.split(".", 1)[1]: d for d in names.values() if d.startswith(f"{section}.")}
        query = rest
    else:
        pool = {n: n for n in [*names, *options]}
        query = key
    pool.update({t: t for t in TRL_NAMES})
    # The start of one field's name (--out for --output-dir), as argparse would take it.
    started = [n for n in pool if len(query) >= 3 and n.rsplit(".", 1)[-1].startswith(query)]
    if len({names.get(pool[n], pool[n]) for n in started}) == 1:
        return pool[min(started, key=len)]
    found = difflib.get_close_matches(query, pool, n=5, cutoff=0.6)
    if not found:
        return None
    types_ = field_types()

    def rank(candidate: str) -> tuple[float, int]:
        target = TRL_NAMES[candidate][0] if candidate in TRL_NAMES else names.get(pool[candidate])
        return -difflib.SequenceMatcher(None, candidate, query).ratio(), _fit(value, types_.get(target))

    return pool[min(found, key=rank)]


def _fit(value: Any, annotation: Any) -> int:
    """0 where ``value`` looks like what a field of type ``annotation`` takes (a number for a number,
    a switch for a boolean, words for text; anything for an option that is not a field), else 1."""
    if annotation is None:
        return 0
    base = _base_type(annotation)
    if base is bool:
        return 0 if str(value).lower() in BOOL_WORDS else 1
    return 0 if _is_number(value) == (base in (int, float)) else 1


def _is_number(value: Any) -> bool:
    if isinstance(value, bool):
        return False
    try:
        float(value)
    except (TypeError, ValueError):
        return False
    return True


def _unknown_keys(mapping: dict) -> list[str]:
    """What is wrong with each key of a config file's ``mapping`` that sets no field."""
    problems = []
    for key, value in mapping.items():
        if isinstance(value, dict) and key in _sections():
            problems += [unknown_name(f"{key}.{sub}", v, yaml=True) for sub, v in value.items()
                         if _resolve(f"{key}.{sub}") not in field_types()]
        elif _empty_section(key, value):
            continue
        elif key in _sections() and _resolve(key) not in field_types():
            fields = [name for name in field_types() if name.startswith(f"{key}.")][:2]
            problems.append(f"'{key}' is a section: its fields go under it, indented (such as {', '.join(fields)}); "
                            f"got the value {value!r}")
        elif isinstance(value, dict) and _resolve(key) not in field_types():
            # A section's name, misspelt: its fields are then not the question.
            close = difflib.get_close_matches(str(key), _sections(), n=1)
            problems.append(f"unknown section '{key}'; " + (f"did you mean '{close[0]}'?" if close else
                                                            f"the sections are {', '.join(_sections())}"))
        elif _resolve(key) not in field_types():
            problems.append(unknown_name(key, value, yaml=True))
    return problems


def field_help() -> dict[str, str]:
    """``{"section.field": description}``: each field's trailing comment in this file's source,
    so the description lives next to the default it explains and cannot drift from it."""
    out = {}
    for section, cls in _sections().items():
        try:
            source = inspect.getsource(cls)
        except (OSError, TypeError):  # no source shipped: descriptions are optional
            continue
        for match in re.finditer(r"^    (\w+): [^=\n]+=[^#\n]*#\s*(.+)$", source, re.MULTILINE):
            out[f"{section}.{match.group(1)}"] = match.group(2).strip()
    return out


def help_text(sections: tuple[str, ...] | None = None, fields: tuple[str, ...] = (), exclude: tuple[str, ...] = (),
              aliases: dict[str, str] | None = None) -> str:
    """Every field (of ``sections``, default all; plus the dotted ``fields``, less ``exclude``)
    with its type, default and description, then the loss names, for ``--help``. ``aliases``:
    a command's own short flags (name -> dotted field), shown beside the field."""
    defaults = Config().to_dict()
    reverse = {v: k for k, v in {**ALIASES, **(aliases or {})}.items()}
    described = field_help()
    lines = []
    for dotted, annotation in field_types().items():
        section, name = dotted.split(".", 1)
        if dotted in exclude or (sections is not None and section not in sections and dotted not in fields):
            continue
        alias = reverse.get(dotted)
        flag = f"--{dotted}" + (f" (--{alias.replace('_', '-')})" if alias else "")
        type_name = _type_name(annotation)
        lines.append(f"  {flag:<52} {type_name:<14} default: {defaults[section][name]!r}")
        if dotted in described:
            lines.append(f"      {described[dotted]}")
    if sections is None or "loss" in sections:
        from dpocache.losses.registry import LOSSES  # noqa: PLC0415 - see the note on torch above

        lines += ["", "Losses (--loss NAME, or a weighted sum such as sigmoid:1,sft:0.1):", "  " + ", ".join(LOSSES)]
    return "\n".join(lines)


def _type_name(annotation: Any) -> str:
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        return " | ".join(getattr(a, "__name__", str(a)).replace("NoneType", "None")
                          for a in typing.get_args(annotation))
    return getattr(annotation, "__name__", str(annotation))
