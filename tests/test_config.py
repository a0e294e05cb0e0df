"""The typed config tree: YAML (nested and flat), dotted command-line overrides, the order
they apply in, the errors, ``dpocache train --help``, and every shipped YAML."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from dpocache.cli.entry import main as cli_main
from dpocache.config import ALIASES, Config, ConfigError, build_config, field_types

REPO = Path(__file__).resolve().parents[1]


def _yaml(tmp_path, text: str) -> Path:
    path = tmp_path / "config.yaml"
    path.write_text(text)
    return path


def test_defaults_yaml_and_command_line_apply_in_order(tmp_path):
    path = _yaml(tmp_path, """
model:
  dtype: bfloat16
optim:
  lr: 1.0e-5
  schedule: cosine
train:
  batch_size: 2
  save_steps: 100
beta: 0.3            # a flat alias
lora_r: 8
train.epochs: 3      # a dotted key at the top level
""")
    cfg = build_config(path, ["--optim.lr", "2e-5", "--beta=0.4", "--max-steps", "7", "--eval-data", "e.jsonl",
                              "--resume", "--train.save_steps", "none", "--lora.alpha", "32"])
    # YAML over defaults
    assert cfg.model.dtype == "bfloat16"
    assert cfg.optim.schedule == "cosine"
    assert cfg.train.batch_size == 2
    assert cfg.lora.r == 8
    assert cfg.train.epochs == 3
    # command line over YAML (dotted, alias with '=', hyphenated alias, bare boolean, none)
    assert cfg.optim.lr == 2e-5
    assert cfg.loss.beta == 0.4
    assert cfg.train.max_steps == 7
    assert cfg.data.eval == "e.jsonl"
    assert cfg.train.resume is True
    assert cfg.train.save_steps is None
    assert cfg.lora.alpha == 32
    # untouched: the dataclass defaults
    default = Config()
    assert cfg.optim.weight_decay == default.optim.weight_decay
    assert cfg.train.seed == default.train.seed
    assert cfg.data.max_length == default.data.max_length
    # types are the fields' types, not strings
    assert isinstance(cfg.optim.lr, float) and isinstance(cfg.train.max_steps, int)


def test_yaml_nested_and_flat_spellings_are_equivalent(tmp_path):
    nested = build_config(_yaml(tmp_path, "optim: {lr: 3.0e-6}\nloss: {name: ipo, beta: 0.5}\n"
                                          "train: {grad_accum: 4}\n"))
    flat = build_config(_yaml(tmp_path, "lr: 3.0e-6\nloss: ipo\nbeta: 0.5\ngrad_accum: 4\n"))
    cli = build_config(None, ["--lr", "3e-6", "--loss", "ipo", "--beta", "0.5", "--grad-accum", "4"])
    assert nested.to_dict() == flat.to_dict() == cli.to_dict()
    assert nested.loss.name == "ipo" and nested.optim.lr == 3e-6 and nested.train.grad_accum == 4


def test_unknown_field_is_named(tmp_path):
    with pytest.raises(ConfigError, match=r"optim\.learning_rate"):
        build_config(_yaml(tmp_path, "optim:\n  learning_rate: 1.0\n"))
    with pytest.raises(ConfigError, match="config.yaml"):
        build_config(_yaml(tmp_path, "optimizer:\n  lr: 1.0\n"))
    with pytest.raises(ConfigError, match="'bogus'"):
        build_config(None, ["--bogus", "1"])
    with pytest.raises(ConfigError, match=r"train\.nope"):
        build_config(None, ["--train.nope", "1"])


@pytest.mark.parametrize("args, field", [
    (["--batch-size", "abc"], "train.batch_size"),
    (["--lora-r", "1.5"], "lora.r"),
    (["--lr", "fast"], "optim.lr"),
    (["--resume", "maybe"], "train.resume"),
    (["--beta", "none"], "loss.beta"),  # not optional
    (["--resident-layers", "x"], "model.resident_layers"),
])
def test_bad_value_on_the_command_line_is_named_by_the_flag_as_typed(args, field):
    """The flag the user typed, then the field it sets (a short flag's)."""
    with pytest.raises(ConfigError) as err:
        build_config(None, args)
    assert str(err.value).startswith(f"{args[0]} ({field}): expected "), err.value
    with pytest.raises(ConfigError) as err:  # the field's own flag: named once
        build_config(None, [f"--{field}", args[1]])
    assert str(err.value).startswith(f"--{field}: expected "), err.value


@pytest.mark.parametrize("text, field", [
    ("train:\n  epochs: [1, 2]\n", "train.epochs"),
    ("optim:\n  lr: {a: 1}\n", "optim.lr"),
    ("loss:\n  name: [sigmoid, sft]\n", "loss.name"),
    ("train:\n  batch_size: eight\n", "train.batch_size"),
])
def test_bad_value_in_yaml_is_a_config_error(tmp_path, text, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        build_config(_yaml(tmp_path, text))


@pytest.mark.parametrize("text, expected", [
    ("loss:\n  beta: 0.0\n", "config.yaml: loss.beta: must be a finite number > 0, got 0.0"),
    ("lr: -1\n", "config.yaml: lr: must be a finite number >= 0, got -1.0"),
    ("optim: {schedule: cosin}\n", "config.yaml: optim.schedule: must be one of linear, cosine, constant"),
    ("data: {max_length: 64, max_prompt_length: 64}\n", "config.yaml: data.max_prompt_length (64) must be below"),
])
def test_a_value_a_config_file_set_is_refused_naming_the_file_and_its_key(tmp_path, text, expected):
    path = _yaml(tmp_path, text)
    with pytest.raises(ConfigError) as err:  # the type is right: validate() is what refuses it
        build_config(path).validate()
    assert str(err.value).startswith(str(tmp_path / expected)), err.value
    # the same value given by its flag is named by the flag; a flag over the file's value wins
    with pytest.raises(ConfigError, match="^--beta \\(loss.beta\\)"):
        build_config(None, ["--beta", "0"]).validate()
    build_config(_yaml(tmp_path, "loss: {beta: 0.0}\n"), ["--beta", "0.1"]).validate()


def test_invalid_yaml_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="invalid YAML"):
        build_config(_yaml(tmp_path, "optim: [unclosed\n"))
    with pytest.raises(ConfigError, match="mapping"):
        build_config(_yaml(tmp_path, "- just\n- a list\n"))


def test_every_alias_names_a_field():
    fields = field_types()
    assert set(ALIASES.values()) <= set(fields)


def test_train_help_lists_every_field_with_its_default(capsys):
    assert cli_main(["train", "--help"]) == 0
    out = capsys.readouterr().out
    lines = {line.split()[0]: line for line in out.splitlines() if line.strip().startswith("--")}
    defaults = Config().to_dict()
    reverse = {v: k for k, v in ALIASES.items()}
    for dotted in field_types():
        flag = f"--{dotted}"
        assert flag in lines, f"{flag} missing from dpocache train --help"
        section, name = dotted.split(".")
        assert lines[flag].rstrip().endswith(f"default: {defaults[section][name]!r}"), lines[flag]
        if dotted in reverse:
            assert f"--{reverse[dotted].replace('_', '-')}" in lines[flag]


def test_resume_and_overwrite_together_are_refused():
    with pytest.raises(ConfigError, match=r"--resume \(train\.resume\) continues the run in .* and "
                                          r"--train.overwrite deletes it"):
        build_config(None, ["--resume", "--train.overwrite", "true", "--model", "m", "--data", "d"]).validate()
    build_config(None, ["--train.overwrite", "true"]).validate()  # either alone is fine
    build_config(None, ["--resume"]).validate()


def test_a_flag_without_its_value_is_one_line_and_a_switch_is_true():
    """A value flag followed by another flag, or last, had become the string 'true': a run
    written into ./true, a cache built in ./true."""
    for args, flag in ((["--output-dir", "--max-steps", "1"], "--output-dir"), (["--model", "m", "--cache-dir"],
                                                                               "--cache-dir"),
                       (["--optim.lr", "--resume"], "--optim.lr"), (["--max-steps"], "--max-steps")):
        with pytest.raises(ConfigError, match=rf"^{flag} needs a value \({flag} VALUE\)"):
            build_config(None, args)
    cfg = build_config(None, ["--resume", "--gradient-checkpointing", "--model", "m"])
    assert cfg.train.resume is True and cfg.model.gradient_checkpointing is True and cfg.model.path == "m"


@pytest.mark.parametrize("args, fragment", [
    (["--loss", "sigmoid", "--loss.gamma", "2"], "gamma=2.0 is set, but the loss 'sigmoid' does not read it"),
    # a sweep's base config set it: how to unset it from the command line
    (["--loss", "sigmoid", "--loss.gamma", "2"], "remove it (--loss.gamma none on the command line, over a config "
                                                 "file's), or use one of those losses"),
    (["--loss", "ipo,sft", "--loss.label_smoothing", "0.2"], "none of the losses ipo, sft reads it"),
    (["--loss", "simpo", "--loss.discopop_tau", "-5"], "discopop_tau is a param of discopop"),
    (["--loss.f_alpha_divergence_coef", "7"], "f_divergence_type is 'reverse_kl'"),
    # A parameter's own flag is named, not --loss (loss.name) 'sigmoid'.
    (["--loss.f_divergence_type", "kl"], "--loss.f_divergence_type: f_divergence_type must be one of"),
])
def test_a_loss_param_no_loss_reads_is_refused(args, fragment):
    with pytest.raises(ConfigError, match=re.escape(fragment)):
        build_config(None, args).validate()


def test_loss_params_that_are_read_are_accepted():
    for args in (["--loss", "simpo", "--loss.gamma", "1"],
                 ["--loss", "sigmoid:1,sft:0.1", "--loss.label_smoothing", "0.1"],
                 ["--loss.f_divergence_type", "alpha_divergence", "--loss.f_alpha_divergence_coef", "0.3"]):
        build_config(None, args).validate()


def test_cli_reports_config_errors_with_exit_code_2(capsys):
    assert cli_main(["train", "--bogus", "1"]) == 2
    assert "bogus" in capsys.readouterr().err
    assert cli_main(["train", "--batch-size", "x"]) == 2
    assert "train.batch_size" in capsys.readouterr().err


SHIPPED = sorted((REPO / "dpocache" / "configs").glob("*.yaml")) + sorted((REPO / "configs").glob("*.yaml"))


def test_there_are_shipped_configs():
    assert any(p.parent.name == "configs" and p.parent.parent.name == "dpocache" for p in SHIPPED)


@pytest.mark.parametrize("path", SHIPPED, ids=[str(p.relative_to(REPO)) for p in SHIPPED])
def test_every_shipped_yaml_parses(path):
    from dpocache.losses.registry import check_params_read, parse_loss_spec

    cfg = build_config(path)
    # the loss it names exists, its params are valid and each is read by a loss of the spec
    check_params_read(parse_loss_spec(cfg.loss.name, **cfg.loss.params()))
    assert cfg.model.dtype in ("auto", "float32", "bfloat16", "float16")


@pytest.mark.parametrize("backend, fragment", [("ncl", "not a torch.distributed backend"),
                                               ("nccl", "runs on cuda devices, and this run uses cpu")])
def test_distributed_backend_mistake_is_a_config_error_before_the_group_starts(monkeypatch, backend, fragment):
    """Under torchrun a backend torch does not know, or nccl on the CPU, was torch's assertion
    or ValueError from init_process_group: a traceback on every rank, exit 1."""
    import torch.distributed as dist

    from dpocache.distributed.process_group import init_distributed

    monkeypatch.setenv("WORLD_SIZE", "2")  # as torchrun sets it; the check comes before any rendezvous
    with pytest.raises(ConfigError, match=f"--distributed.backend {backend}: {fragment}"):
        init_distributed("cpu", backend)
    assert not dist.is_initialized()


def test_a_leading_tilde_in_a_path_is_the_home_directory(tmp_path, monkeypatch):
    """YAML and ``--flag=~/x`` (which no shell expands) had made a directory named '~' in the
    working directory, and ``DPOCACHE_CACHE_DIR='~/x'`` (quoted) likewise."""
    import os

    from dpocache.cache.build import default_cache_dir

    monkeypatch.setenv("HOME", str(tmp_path))
    config = tmp_path / "run.yaml"
    config.write_text("model: {path: ~/sft}\ndata: {train: ~/prefs.jsonl}\ncache: {dir: ~/yamlcache}\n")
    cfg = build_config(config, ["--output-dir=~/runs/x", "--ref-model", "~/ref"])
    assert (cfg.model.path, cfg.data.train, cfg.cache.dir, cfg.train.output_dir, cfg.model.ref_model) == tuple(
        os.path.join(str(tmp_path), p) for p in ("sft", "prefs.jsonl", "yamlcache", "runs/x", "ref"))
    assert build_config(None, ["--model", "org/name"]).model.path == "org/name"  # a Hub id stays one
    monkeypatch.setenv("DPOCACHE_CACHE_DIR", "~/envcache")
    assert default_cache_dir() == tmp_path / "envcache"
    monkeypatch.delenv("DPOCACHE_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", "~/xdg")
    assert default_cache_dir() == tmp_path / "xdg" / "dpocache"
