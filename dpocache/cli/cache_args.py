"""``dpocache cache build|info|verify|export``: the options, read into the same typed
configuration as ``dpocache train`` (``dpocache.config``) plus each command's own few. The paths
are checked before torch is even imported, so a wrong ``--model`` costs a fraction of a second."""

from __future__ import annotations

import argparse
from pathlib import Path

from dpocache.config import (
    EXPORT_FORMATS,
    EXPORT_SUFFIXES,
    Config,
    build_config,
    help_text,
    parse_overrides,
    switch_value,
)
from dpocache.models.hub_ids import resolve_model_path
from dpocache.runtime.preflight import UsageError, check_data_path, check_model_dir

# Each command's own options, which are not configuration: name -> (type, default, help).
OPTIONS = {
    "build": {"per_token": (bool, False, "also store per-token log-probs"),
              "json": (bool, False, "print the summary as one JSON object on stdout (its lines go to stderr)")},
    "info": {},
    "verify": {"samples": (int, 32, "pairs recomputed and compared with the cache"),
               "seed": (int, 0, "which pairs are sampled")},
    "export": {"out": (Path, None, "the file to write, or with --format datasets the directory (required)"),
               "with_ids": (bool, False, "include the token ids the values were computed on (--format keys, "
                                         "which it implies)"),
               "format": (str, None, "jsonl, parquet or datasets: the input rows plus ref_chosen_logps/"
                                     "ref_rejected_logps; safetensors: tensors, with each entry's source row "
                                     "(index); keys: the cache's own table (index, key, values) as JSON lines. "
                                     "Default: by --out's name (.jsonl, .parquet, .safetensors)")},
}
# The short flags the cache commands had before they read the configuration, kept working.
CACHE_ALIASES = {"layout": "cache.layout"}
# --help shows the model, data and cache sections, plus FSDP (cache build reads it), less what
# only training reads (the policy's attention kernel and activation checkpointing).
HELP_FIELDS = {"build": ("distributed.fsdp",)}
HELP_EXCLUDE = ("model.attn_implementation", "model.gradient_checkpointing", "model.checkpoint_keep",
                "model.stream_base", "model.resident_layers", "model.turn_layers", "model.skip_unread_products")
USAGE = """usage: dpocache cache {command} [CONFIG.yaml] [--key value ...]

{text}.
Settings are those of `dpocache train`: the same YAML file, --section.field flags and defaults
(--model is the reference model unless model.ref_model is set; --data the data to cache).

Example:
  dpocache cache {command} configs/lora-single-gpu.yaml --model ./sft --data prefs.jsonl

Options of this command:
{options}

Fields:
{fields}"""
TEXTS = {"build": "Compute the reference log-probs the cache lacks",
         "info": "List the cache's namespaces and token stores; with --model and --data, how many of the data's "
                 "pairs each namespace holds (exit 1 where none holds them all; no model loads)",
         "verify": "Check every shard's checksum and recompute a sample",
         "export": "Write the cached values of every row, in data order: with --format (or by --out's name) the "
                   "input rows plus TRL's reference columns (jsonl, parquet, datasets), tensors with each entry's "
                   "source row (safetensors) or the cache's own table (keys)"}


def parse_args(command: str, rest: list[str]) -> argparse.Namespace | None:
    """The typed configuration plus this command's options, as the attributes the commands
    read (``args.model``, ``args.max_length``, ...). None after printing ``--help``."""
    rest = [a for a in rest if a != "--"]
    given = list(rest)  # as typed after the command: what a message that names a command to run repeats
    if "-h" in rest or "--help" in rest:
        options = "\n".join(f"  --{k.replace('_', '-'):<50} {t.__name__:<14} default: {d!r}\n      {h}"
                            for k, (t, d, h) in OPTIONS[command].items()) or "  (none)"
        print(USAGE.format(command=command, text=TEXTS[command], options=options,
                           fields=help_text(("model", "data", "cache"), HELP_FIELDS.get(command, ()), HELP_EXCLUDE,
                                            CACHE_ALIASES)))
        return None
    config = None
    if rest and not rest[0].startswith("-"):
        config, rest = rest[0], rest[1:]
        if not Path(config).is_file():
            raise UsageError(f"{config}: no such config file (the first argument, if any, is a YAML file)")
    own, overrides = {}, []
    for key, value in parse_overrides(rest):
        name = key.replace("-", "_")
        if name in OPTIONS[command]:
            own[name] = _option_value(name, OPTIONS[command][name][0], switch_value(f"--{key}",
                                                                                     OPTIONS[command][name][0], value))
        else:
            overrides.append(f"--{key}" if value is None else f"--{key}={value}")
    cfg = build_config(config, overrides, CACHE_ALIASES, tuple(OPTIONS[command]))  # a typo of either is suggested
    # A Hub id (org/name[@revision]) becomes its snapshot directory in the local Hugging Face cache.
    cfg.model.path = resolve_model_path(cfg.model.path)
    cfg.model.ref_model = resolve_model_path(cfg.model.ref_model, "--ref-model")
    flagged = [d for d, value in (("model.path", cfg.model.path), ("data.train", cfg.data.train))
               if value and d not in cfg.set_in_file]
    if command == "info" and flagged and bool(cfg.model.path) != bool(cfg.data.train):  # a config file's: listed only
        given, lacking = ("--model", "--data") if cfg.model.path else ("--data", "--model")
        raise UsageError(f"cache info {given} needs {lacking} too: with both it counts the data's pairs each "
                         "namespace holds (the model's tokenizer tokenizes the data); with neither it lists the cache")
    if command != "info" or (cfg.model.path and cfg.data.train):
        # The paths first: they need no imports, and a wrong --model must not wait for torch.
        if cfg.model.path:
            check_model_dir(cfg.model.path, "--model")
        if cfg.model.ref_model:
            check_model_dir(cfg.model.ref_model, "--ref-model", tokenizer=False)
        check_data_path(cfg.data.train, "--data")
        check_data_path(cfg.data.eval if command == "build" else None, "--eval-data")
    cfg.validate(required=() if command == "info" else ("model.path", "data.train"))
    if command != "build" and cfg.cache.dir and not Path(cfg.cache.dir).is_dir():
        # info, verify and export only read the cache: a directory that is not there is a typo, not an empty cache.
        raise UsageError(f"--cache-dir {cfg.cache.dir}: no such directory")
    if own.get("samples") is not None and own["samples"] < 0:
        raise UsageError(f"--samples: must be >= 0, got {own['samples']}")
    if command == "export" and own.get("out") is None:
        raise UsageError("--out FILE is required")
    if command == "export":
        own["format"] = export_format(own.get("format"), own["out"], own.get("with_ids"))
    return _namespace(cfg, command, own, given)


def export_format(fmt: str | None, out: Path, with_ids: bool) -> str:
    """The format of an export: ``--format``, else what ``--out``'s name says (``.jsonl``: the
    input rows plus TRL's reference columns, with or without ``--format jsonl``), else ``keys``
    for ``--with-ids``; one line naming the flag where none fits."""
    if fmt is not None and fmt not in EXPORT_FORMATS:
        raise UsageError(f"--format must be one of {', '.join(EXPORT_FORMATS)}; got {fmt!r}")
    if fmt is None:
        fmt = "keys" if with_ids else EXPORT_SUFFIXES.get(out.suffix.lower())
    if fmt is None:
        raise UsageError(f"--out {out}: pass --format ({', '.join(EXPORT_FORMATS)}); a name ending in "
                         f"{', '.join(EXPORT_SUFFIXES)} picks its format")
    if with_ids and fmt != "keys":
        raise UsageError(f"--with-ids: only --format keys (the cache's own table) holds token ids; drop --with-ids "
                         f"or --format {fmt}")
    written = ".jsonl" if fmt == "keys" else next((x for x, f in EXPORT_SUFFIXES.items() if f == fmt), None)
    named = out.suffix.lower()
    if named in EXPORT_SUFFIXES and written is not None and named != written:
        # a .parquet file of JSON lines: readers fail on it ("Parquet magic bytes not found")
        raise UsageError(f"--out {out}: --format {fmt} writes a {written} file; name it so, or pass the format its "
                         f"name says (--format {EXPORT_SUFFIXES[named]})")
    return fmt


def _option_value(name: str, type_: type, value: str):
    if type_ is bool:
        if value.lower() in ("true", "1", "yes", "on", "false", "0", "no", "off"):
            return value.lower() in ("true", "1", "yes", "on")
    else:
        try:
            return Path(value).expanduser() if type_ is Path else type_(value)
        except ValueError:
            pass
    raise UsageError(f"--{name.replace('_', '-')}: expected {type_.__name__}, got {value!r}")


def _namespace(cfg: Config, command: str, own: dict, given: list[str]) -> argparse.Namespace:
    """The names the commands below were written against, read from the configuration; ``given``:
    the arguments as typed after the command."""
    defaults = {k: d for k, (_, d, _) in OPTIONS[command].items()}
    options = {**defaults, **own}
    if command == "build" and cfg.loss.ld_alpha is not None:
        options["per_token"] = True  # LD-DPO trains on per-token values: store them, as train's own build would
    return argparse.Namespace(
        cfg=cfg, cache_command=command, given=given, model=cfg.model.ref_model or cfg.model.path,
        tokenizer=cfg.model.path,
        reference=cfg.model.reference,
        data=cfg.data.train, eval_data=cfg.data.eval, max_length=cfg.data.max_length,
        max_prompt_length=cfg.data.max_prompt_length, skip_invalid=cfg.data.skip_invalid,
        dtype=cfg.model.dtype, device=cfg.model.device, cache_dir=Path(cfg.cache.dir) if cfg.cache.dir else None,
        max_tokens=cfg.cache.max_tokens, layout=cfg.cache.layout, attention=cfg.model.attention,
        compile=cfg.model.compile, kernels=cfg.model.kernels, shard_size=cfg.cache.shard_size,
        fsdp=cfg.distributed.fsdp, stream_reference=cfg.model.stream_reference,
        **options,
    )
