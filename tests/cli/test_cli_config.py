"""One configuration for every command: ``cache build|verify|export`` and ``train`` read the same
typed config (YAML file, --section.field flags, defaults), ``validate()`` rejects bad values by
field, and ``--help`` describes each field."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from dpocache.cache.fingerprint import WEIGHT_SUFFIXES
from dpocache.cli import entry as cli
from dpocache.cli.cache_args import parse_args
from dpocache.config import Config, ConfigError, build_config, field_help, field_types
from dpocache.losses.registry import LOSSES
from dpocache.runtime import preflight

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("flags, field", [
    (["--loss", "nope"], "loss.name"),
    (["--loss", "sigmoid:abc"], "loss.name"),
    (["--loss", "sigmoid:-1"], "loss.name"),
    (["--loss", "robust", "--loss.label_smoothing", "0.7"], "loss.name"),
    (["--beta", "0"], "loss.beta"),
    (["--beta", "-1"], "loss.beta"),
    (["--beta", "nan"], "loss.beta"),
    (["--beta", "inf"], "loss.beta"),
    (["--loss", "simpo", "--loss.gamma", "nan"], "gamma must be a finite number"),
    (["--loss", "orpo", "--loss.orpo_alpha", "-1"], "orpo_alpha"),
    (["--optim.schedule", "cosin"], "optim.schedule"),
    (["--dtype", "bf16"], "model.dtype"),
    (["--batch-size", "0"], "train.batch_size"),
    (["--grad-accum", "0"], "train.grad_accum"),
    (["--max-steps", "-1"], "train.max_steps"),
    (["--save-steps", "-5"], "train.save_steps"),
    (["--max-length", "0"], "data.max_length"),
    (["--max-length", "64", "--max-prompt-length", "64"], "data.max_prompt_length"),
    (["--train.layout", "dense"], "train.layout"),
    (["--cache.layout", "dense"], "cache.layout"),
    (["--device", "tpu9"], "model.device"),
    (["--lora-r", "-1"], "lora.r"),
    (["--optim.warmup_ratio", "2"], "optim.warmup_ratio"),
    (["--data.chosen_field", "prompt"], "data.chosen_field"),
])
def test_validate_names_the_field(flags, field):
    cfg = build_config(None, ["--model", "m", "--data", "d", *flags])
    with pytest.raises(ConfigError, match=re.escape(field)):
        cfg.validate()


def test_validate_accepts_the_defaults_and_every_shipped_config():
    Config().validate()
    for path in sorted((REPO / "configs").glob("*.yaml")) + sorted((REPO / "dpocache" / "configs").glob("*.yaml")):
        build_config(path).validate()


def test_validate_required_fields_are_named():
    with pytest.raises(ConfigError, match=r"missing --model \(model\.path\) and --data \(data\.train\)"):
        Config().validate(required=("model.path", "data.train"))


def test_train_help_describes_fields_and_names_losses(capsys):
    assert cli.main(["train", "--help"]) == 0
    out = capsys.readouterr().out
    described = field_help()
    for dotted in ("loss.beta", "optim.lr", "data.max_length", "train.batch_size", "data.prompt_field"):
        assert described.get(dotted), dotted
        assert described[dotted] in out, dotted
    assert len(described) == len(field_types())  # every field has its line
    assert ", ".join(LOSSES) in out


@pytest.mark.parametrize("argv", [["train", "--help"], ["cache", "build", "--help"], ["cache", "export", "--help"]])
def test_the_help_example_exists_and_parses(capsys, argv):
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    example = out.split("Example:\n", 1)[1].splitlines()[0].split()
    configs = [a for a in example if a.endswith(".yaml")]
    assert configs, example
    assert (REPO / configs[0]).is_file(), configs[0]
    build_config(REPO / configs[0]).validate()


@pytest.mark.parametrize("command", ["build", "verify", "export"])
def test_cache_help_lists_what_the_command_reads(capsys, command):
    """cache build reads --fsdp (README: a reference too big for one GPU); the policy's
    attention kernel and activation checkpointing are training's alone, not offered here."""
    assert cli.main(["cache", command, "--help"]) == 0
    out = capsys.readouterr().out
    assert ("--distributed.fsdp (--fsdp)" in out) == (command == "build")
    assert "--model.attn_implementation" not in out and "--model.gradient_checkpointing" not in out
    assert "--cache.layout (--layout)" in out and "$XDG_CACHE_HOME/dpocache" in out
    if command == "export":  # not "as JSON lines" alone: --format writes parquet, datasets, safetensors
        assert all(f in out.splitlines()[2] for f in ("--format", "parquet", "safetensors"))


def test_top_level_help_is_a_sentence(capsys):
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    out = capsys.readouterr().out
    assert cli.DESCRIPTION.split()[0] in out and "``" not in out
    assert re.match(r"[a-z]+ [a-z]+ .*\.$", cli.DESCRIPTION)


def test_cache_commands_and_train_share_defaults(model_dir, pref_jsonl):
    """Today cache build truncated nothing by default and train truncated at 1024."""
    args = parse_args("build", ["--model", str(model_dir), "--data", str(pref_jsonl)])
    cfg = Config()
    assert args.max_length == cfg.data.max_length == 1024
    assert (args.max_prompt_length, args.dtype, args.max_tokens, args.layout, args.shard_size, args.skip_invalid) == (
        cfg.data.max_prompt_length, cfg.model.dtype, cfg.cache.max_tokens, cfg.cache.layout, cfg.cache.shard_size,
        cfg.data.skip_invalid)


def test_cache_build_reads_the_yaml_and_the_old_flags(tmp_path, model_dir, pref_jsonl):
    m, d = str(model_dir), str(pref_jsonl)
    config = tmp_path / "c.yaml"
    config.write_text("data:\n  max_length: 333\n  prompt_field: question\ncache:\n  dir: somewhere\n")
    args = parse_args("build", [str(config), "--model", m, "--data", d, "--layout", "padded", "--max-tokens", "77",
                                "--shard-size", "5", "--skip-invalid", "--per-token", "--json"])
    assert (args.max_length, args.cache_dir, args.layout, args.max_tokens, args.shard_size) == (
        333, Path("somewhere"), "padded", 77, 5)
    assert args.skip_invalid and args.per_token and args.json
    assert args.cfg.data.columns() == ("question", "chosen", "rejected")
    verify = parse_args("verify", ["--model", m, "--data", d, "--samples", "3", "--seed", "9"])
    assert (verify.samples, verify.seed, verify.cfg.train.seed) == (3, 9, Config().train.seed)


def test_build_then_train_with_one_config_reuses_every_pair(tmp_path, capsys, model_dir, pref_jsonl, pref_rows):
    config = tmp_path / "run.yaml"
    config.write_text("model:\n  dtype: float32\n  device: cpu\ndata:\n  max_length: 24\n"
                      f"cache:\n  dir: {tmp_path / 'c'}\n"
                      "train:\n  batch_size: 8\n  max_steps: 1\n  progress: false\n")
    assert cli.main(["cache", "build", str(config), "--model", str(model_dir), "--data", str(pref_jsonl)]) == 0
    out = capsys.readouterr().out
    assert "truncated to max_length=24" in out
    assert cli.main(["train", str(config), "--model", str(model_dir), "--data", str(pref_jsonl),
                     "--output-dir", str(tmp_path / "run")]) == 0
    out = capsys.readouterr().out
    n = len(pref_rows)
    assert f"reference: {n} pairs from the cache (0 computed, {n} reused)" in out


def test_demo_output_dir_and_its_deprecated_alias(monkeypatch, capsys, tmp_path):
    import dpocache.training.demo

    seen = []
    monkeypatch.setattr(dpocache.training.demo, "run_demo", lambda out, overrides: seen.append((str(out), overrides)))
    assert cli.main(["demo", "--output-dir", str(tmp_path / "a")]) == 0
    assert cli.main(["demo", "--out", str(tmp_path / "b"), "--train.progress", "false"]) == 0
    assert seen == [(str(tmp_path / "a"), []), (str(tmp_path / "b"), ["--train.progress", "false"])]
    assert "--out is deprecated" in capsys.readouterr().err


def test_preflight_knows_the_weight_files_the_fingerprint_hashes():
    assert preflight.WEIGHT_SUFFIXES == WEIGHT_SUFFIXES
