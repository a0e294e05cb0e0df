"""The training configuration: one typed dataclass tree; defaults live here and nowhere else.

Every field is settable from a YAML file (nested sections, as ``configs/*.yaml``) and from the
command line as ``--section.field value``; the common ones also have short flags (``--lr``,
``--beta``, ...: see ``ALIASES``). Later sources win: defaults < YAML < command line.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class ModelConfig:
    path: str | None = None  # policy: a Hugging Face model directory
    ref_model: str | None = None  # reference model directory (default: the initial policy)
    dtype: str = "auto"  # compute dtype: auto | float32 | bfloat16 (autocast over fp32 master weights)
    device: str | None = None  # cpu | cuda (default: cuda if available)
    attn_implementation: str = "sdpa"
    gradient_checkpointing: bool = False
    compile: bool = False  # torch.compile the policy's log-prob forward


@dataclass
class LoraConfig:
    r: int = 0  # 0: full fine-tuning; > 0: LoRA rank (PEFT)
    alpha: int = 16
    dropout: float = 0.0
    target_modules: str = "all-linear"  # comma-separated module names, or all-linear


@dataclass
class DataConfig:
    train: str | None = None  # preference data for training
    eval: str | None = None  # held-out preference data
    max_length: int | None = 1024  # tokens of prompt + completion (see dpocache.data for the rule)
    max_prompt_length: int | None = None  # tokens the prompt keeps at least when truncating
    skip_invalid: bool = False  # skip bad rows (reported) instead of failing


@dataclass
class LossConfig:
    name: str = "sigmoid"  # a loss, or a weighted combination "sigmoid:1,sft:0.1"
    beta: float = 0.1
    label_smoothing: float | None = None  # cDPO / robust / exo epsilon (None: the loss's default)
    gamma: float | None = None  # SimPO target margin
    orpo_alpha: float | None = None  # ORPO lambda
    discopop_tau: float | None = None
    rpo_alpha: float | None = None  # RPO: adds alpha * NLL(chosen) to any loss
    ld_alpha: float | None = None  # LD-DPO: weight in [0, 1] of tokens past the shorter completion (TRL name)
    use_weighting: bool = False  # WPO: weight each pair by the policy's aligned length-normalised probabilities
    f_divergence_type: str = "reverse_kl"  # f-DPO: reverse_kl | forward_kl | js_divergence | alpha_divergence
    f_alpha_divergence_coef: float = 0.5  # f-DPO alpha_divergence coefficient, as TRL defines it

    def params(self) -> dict[str, float | None]:
        return {k: v for k, v in dataclasses.asdict(self).items() if k != "name"}


@dataclass
class OptimConfig:
    lr: float = 5e-7
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    schedule: str = "linear"  # linear | cosine | constant, after warm-up
    warmup_ratio: float = 0.1
    max_grad_norm: float = 1.0  # 0 disables clipping


@dataclass
class TrainLoopConfig:
    output_dir: str = "runs/dpo"
    batch_size: int = 8  # pairs per device per micro-batch
    layout: str = "shared"  # shared: prompt once per pair (dpocache.prefix; single process, dense models) | padded
    grad_accum: int = 1
    epochs: int = 1
    max_steps: int | None = None  # optimizer steps; overrides epochs
    seed: int = 42
    logging_steps: int = 10
    eval_steps: int | None = None  # None: evaluate at the start and the end only
    eval_batch_size: int | None = None  # default: batch_size
    save_steps: int | None = None  # None: save at the end only
    save_total_limit: int = 2  # checkpoints kept (the newest)
    resume: bool = False  # continue from the newest checkpoint in output_dir
    overwrite: bool = False  # start afresh in an output_dir that holds an earlier run
    tensorboard: bool = False
    push_to_hub: str | None = None  # a Hub repo id for the final checkpoint
    progress: bool = True


@dataclass
class CacheConfig:
    dir: str | None = None  # default: $DPOCACHE_CACHE_DIR or ~/.cache/dpocache
    max_tokens: int = 4096  # padded tokens per reference forward (measured best on CPU; raise on GPU)
    layout: str = "shared"  # reference pass: shared (each prompt once, dpocache.prefix) | padded (two rows per pair)
    shard_size: int = 4096


@dataclass
class DistributedConfig:
    fsdp: bool = False  # shard the policy with FSDP2 (fully_shard) under torchrun
    backend: str | None = None  # default: nccl on CUDA, gloo on CPU


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    data: DataConfig = field(default_factory=DataConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainLoopConfig = field(default_factory=TrainLoopConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# Short command-line flags for the fields users set most.
ALIASES = {
    "model": "model.path", "ref_model": "model.ref_model", "dtype": "model.dtype", "device": "model.device",
    "gradient_checkpointing": "model.gradient_checkpointing", "lora_r": "lora.r",
    "data": "data.train", "eval_data": "data.eval", "max_length": "data.max_length",
    "max_prompt_length": "data.max_prompt_length", "loss": "loss.name", "beta": "loss.beta",
    "lr": "optim.lr", "output_dir": "train.output_dir", "batch_size": "train.batch_size",
    "grad_accum": "train.grad_accum", "epochs": "train.epochs", "max_steps": "train.max_steps", "seed": "train.seed",
    "logging_steps": "train.logging_steps", "eval_steps": "train.eval_steps", "save_steps": "train.save_steps",
    "resume": "train.resume", "push_to_hub": "train.push_to_hub", "cache_dir": "cache.dir", "fsdp": "distributed.fsdp",
}


class ConfigError(ValueError):
    pass


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


def _coerce(dotted: str, annotation: Any, value: Any) -> Any:
    """Turn ``value`` (a YAML scalar or a command-line string) into the field's type."""
    args = typing.get_args(annotation)
    optional = type(None) in args
    base = next((a for a in args if a is not type(None)), annotation) if args else annotation
    if value is None or (isinstance(value, str) and optional and value.lower() in ("none", "null")):
        if optional:
            return None
        raise ConfigError(f"{dotted}: cannot be empty")
    if isinstance(value, (dict, list)):
        # A YAML list or mapping where a scalar belongs: str() would accept it silently, int()
        # and float() raise TypeError.
        raise ConfigError(f"{dotted}: expected {getattr(base, '__name__', base)}, got {value!r}")
    try:
        if base is bool:
            if isinstance(value, bool):
                return value
            if str(value).lower() in ("true", "1", "yes", "on"):
                return True
            if str(value).lower() in ("false", "0", "no", "off"):
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


def _set(cfg: Config, dotted: str, value: Any) -> None:
    dotted = ALIASES.get(dotted.replace("-", "_"), dotted.replace("-", "_"))
    types_ = field_types()
    if dotted not in types_:
        raise ConfigError(f"unknown config field '{dotted}'; see dpocache train --help")
    section, name = dotted.split(".", 1)
    setattr(getattr(cfg, section), name, _coerce(dotted, types_[dotted], value))


def apply_mapping(cfg: Config, mapping: dict, source: str) -> None:
    """Apply a (possibly nested) mapping from YAML: ``{optim: {lr: 1e-6}}`` or ``{lr: 1e-6}``."""
    for key, value in mapping.items():
        if isinstance(value, dict) and key in _sections():
            for sub, v in value.items():
                _set_from(cfg, f"{key}.{sub}", v, source)
        else:
            _set_from(cfg, key, value, source)


def _set_from(cfg: Config, dotted: str, value: Any, source: str) -> None:
    try:
        _set(cfg, dotted, value)
    except ConfigError as e:
        raise ConfigError(f"{source}: {e}") from None


def load_yaml(path: str | Path) -> dict:
    import yaml

    try:
        data = yaml.safe_load(Path(path).read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: invalid YAML: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping at the top level")
    return data


def parse_overrides(args: list[str]) -> list[tuple[str, str]]:
    """``["--optim.lr", "1e-6", "--resume", "--beta=0.2"]`` → ``[(optim.lr, 1e-6), (resume, true), (beta, 0.2)]``.
    A flag followed by another flag (or nothing) is a boolean switch."""
    out = []
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--"):
            raise ConfigError(f"unexpected argument '{arg}' (options are --key value)")
        key = arg[2:]
        if "=" in key:
            key, value = key.split("=", 1)
            i += 1
        elif i + 1 < len(args) and not args[i + 1].startswith("--"):
            value = args[i + 1]
            i += 2
        else:
            value = "true"
            i += 1
        out.append((key, value))
    return out


def build_config(yaml_path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    cfg = Config()
    if yaml_path is not None:
        apply_mapping(cfg, load_yaml(yaml_path), str(yaml_path))
    for key, value in parse_overrides(overrides or []):
        _set_from(cfg, key, value, "command line")
    return cfg


def help_text() -> str:
    """Every field with its type and default, for ``dpocache train --help``."""
    defaults = Config().to_dict()
    reverse = {v: k for k, v in ALIASES.items()}
    lines = []
    for dotted, annotation in field_types().items():
        section, name = dotted.split(".", 1)
        alias = reverse.get(dotted)
        flag = f"--{dotted}" + (f" (--{alias.replace('_', '-')})" if alias else "")
        type_name = _type_name(annotation)
        lines.append(f"  {flag:<52} {type_name:<14} default: {defaults[section][name]!r}")
    return "\n".join(lines)


def _type_name(annotation: Any) -> str:
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        return " | ".join(getattr(a, "__name__", str(a)).replace("NoneType", "None") for a in typing.get_args(annotation))
    return getattr(annotation, "__name__", str(annotation))
