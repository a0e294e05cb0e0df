"""A flag or config key that sets nothing is answered with the closest real one ("did you mean"),
and the names a TRL user types by habit (``--learning-rate``, ``--per-device-train-batch-size``)
with dpocache's own (``TRL_NAMES``). How the CLI prints these lines (one line, exit status 2) is
in test_errors.py; this file checks what they say."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from dpocache.cli.entry import build_parser, unknown_flags
from dpocache.config import TRL_NAMES, Config, ConfigError, build_config, field_types

REPO = Path(__file__).resolve().parents[2]


def message(*args: str, yaml_text: str | None = None, tmp_path: Path | None = None, **kw) -> str:
    """The ConfigError of ``build_config`` for these flags (or this YAML file)."""
    path = None
    if yaml_text is not None:
        path = tmp_path / "config.yaml"
        path.write_text(yaml_text)
    with pytest.raises(ConfigError) as err:
        build_config(path, list(args), **kw)
    return str(err.value)


def example_value(dotted: str) -> str:
    """A value the field takes other than its default (build_config only coerces; validate is not
    the question here)."""
    base = {int: "3", float: "0.37", bool: "true"}
    annotation = field_types()[dotted]
    return next((v for t, v in base.items() if t is annotation or t in getattr(annotation, "__args__", ())), "x")


@pytest.mark.parametrize("name", list(TRL_NAMES))
def test_every_trl_name_is_answered_with_a_flag_that_sets_its_field(name):
    """Each answer names a flag that exists and sets the field the table says (so the table and
    the flags cannot drift apart), and no TRL name is silently one of dpocache's own."""
    dotted, given, _ = TRL_NAMES[name]
    line = message(f"--{name.replace('_', '-')}", "1")
    assert f"unknown flag --{name.replace('_', '-')}; did you mean " in line, line
    assert f"(TRL's {name} is dpocache's " in line, line
    suggested = re.search(r"did you mean (.+?)\? \(", line).group(1).split()
    flag, value = suggested[0], {"N": "2", "REPO": "org/name"}.get(given, given) or example_value(dotted)
    assert len(suggested) == (2 if given else 1), line
    cfg, default = build_config(None, [flag, value]).to_dict(), Config().to_dict()
    section, field = dotted.split(".")
    assert cfg[section][field] != default[section][field], (flag, value, dotted)


def test_trl_names_in_a_config_file_are_answered_with_the_yaml_name(tmp_path):
    line = message(yaml_text="learning_rate: 1.0e-5\ntrain:\n  per_device_train_batch_size: 4\nbf16: true\n",
                   tmp_path=tmp_path)
    assert line.startswith(f"{tmp_path / 'config.yaml'}: "), line
    assert "unknown field 'learning_rate'; did you mean 'optim.lr'? (TRL's learning_rate is dpocache's 'optim.lr')" \
        in line
    assert "unknown field 'train.per_device_train_batch_size'; did you mean 'train.batch_size'?" in line
    assert "unknown field 'bf16'; did you mean 'model.dtype: bfloat16'?" in line


@pytest.mark.parametrize("args, suggestion", [
    (("--bata", "0.2"), "--beta"),  # beta and data are as close: the number decides
    (("--bata", "prefs.jsonl"), "--data"),  # ... and a file name the other way
    (("--batch-sise", "4"), "--batch-size"),
    (("--loss.bata", "0.2"), "--beta"),  # under a real section: that section's fields
    (("--optim.warmup-ratoi", "0.1"), "--optim.warmup_ratio"),
    (("--target-modules", "q_proj"), "--lora.target_modules"),  # a field's bare name: the flag that sets it
    (("--optim.lerning_rate", "1e-5"), "--lr"),  # a TRL name's typo, under a section
])
def test_a_typo_gets_the_closest_flag(args, suggestion):
    assert f"; did you mean {suggestion}?" in message(*args)


def test_a_flag_like_none_gets_the_help():
    assert message("--zzz", "1") == "unknown flag --zzz (config field 'zzz'); see --help for the flags"


def test_every_unknown_flag_is_named_at_once():
    line = message("--bata", "0.2", "--lerning-rate", "1e-5", "--zzz", "1")
    assert line.count("unknown flag") == 3 and line.count(" | ") == 2, line


def test_unknown_flags_are_named_before_a_bad_value_of_a_known_one():
    assert "unknown flag --bata" in message("--batch-size", "x", "--bata", "0.2")


def test_a_commands_own_options_are_suggested_only_for_that_command():
    line = message("--per-tokens", options=("per_token", "json"))
    assert line == "unknown flag --per-tokens; did you mean --per-token?"
    assert "--per-token?" not in message("--per-tokens")


def test_a_commands_short_flags_are_suggested():
    assert "did you mean --layout?" in message("--layuot", "shared", aliases={"layout": "cache.layout"})


@pytest.mark.parametrize("text, expected", [
    ("optimizer:\n  lr: 1.0\n", "unknown section 'optimizer'; did you mean 'optim'?"),
    ("zzz:\n  lr: 1.0\n", "unknown section 'zzz'; the sections are model, lora, data, loss, optim, train, cache, "
                          "distributed"),
    ("optim:\n  lrr: 1.0\n  schedul: cosine\n", "unknown field 'optim.lrr'; did you mean 'optim.lr'? | "
                                                 "unknown field 'optim.schedul'; did you mean 'optim.schedule'?"),
    ("bata: 0.2\n", "unknown field 'bata'; did you mean 'beta'?"),
    ("1: x\n", "unknown field '1'; see --help for the fields"),  # not a string: named, not a traceback
    # a section given a value: it was "unknown field 'train'; did you mean 'data.train'?"
    ("train: runs/z\n", "'train' is a section: its fields go under it, indented (such as train.output_dir, "
                        "train.batch_size); got the value 'runs/z'"),
])
def test_config_file_keys_that_set_nothing_are_named_with_the_file(tmp_path, text, expected):
    assert message(yaml_text=text, tmp_path=tmp_path) == f"{tmp_path / 'config.yaml'}: {expected}"


def test_a_section_with_every_field_commented_out_sets_nothing(tmp_path):
    """``optim:`` alone (YAML's null) was "unknown field 'optim'; did you mean 'optim.lr'?"."""
    path = tmp_path / "config.yaml"
    path.write_text("optim:\n  # lr: 1.0e-6\ntrain:\n  batch_size: 4\n")
    cfg = build_config(str(path), [])
    assert cfg.optim == build_config(None, []).optim and cfg.train.batch_size == 4


def test_a_mapping_under_a_field_is_a_wrong_value_not_an_unknown_section(tmp_path):
    assert message(yaml_text="lr: {a: 1}\n", tmp_path=tmp_path).endswith("optim.lr: expected float, got {'a': 1}")


def test_target_modules_as_a_yaml_list_are_its_names(tmp_path):
    """PEFT's and TRL's configs write them as a list; it was refused ("expected str")."""
    from dpocache.config import build_config

    config = tmp_path / "lora.yaml"
    config.write_text("lora:\n  r: 4\n  target_modules: [q_proj, v_proj]\n")
    assert build_config(str(config), []).lora.target_modules == "q_proj,v_proj"
    assert message(yaml_text="lora:\n  target_modules: [1, 2]\n", tmp_path=tmp_path).endswith(
        "lora.target_modules: expected str, got [1, 2]")


def test_a_config_files_wrong_value_is_named_by_its_file_and_field(tmp_path):
    assert message(yaml_text="train:\n  batch_size: two\n", tmp_path=tmp_path) == \
        f"{tmp_path / 'config.yaml'}: train.batch_size: expected int, got 'two'"


@pytest.mark.parametrize("value", ["true", "False", "yes"])
def test_push_to_hub_as_trls_switch_is_refused(value):
    cfg = build_config(None, ["--push-to-hub", value])
    with pytest.raises(ConfigError, match=r"--push-to-hub \(train\.push_to_hub\) takes a Hub repo id"):
        cfg.validate()
    build_config(None, ["--push-to-hub", "org/dpo-model"]).validate()


SCORE = ["--model", "m", "--data", "d.jsonl", "--out", "o.jsonl"]


@pytest.mark.parametrize("args, expected", [
    ([*SCORE, "--temprature", "0.5"], "unknown flag --temprature; did you mean --temperature?"),
    ([*SCORE, "--cache_dir=c"], "unknown flag --cache_dir; did you mean --cache-dir?"),
    (["--modle", "m"], "unknown flag --modle; did you mean --model?"),
    ([*SCORE, "--zzz"], "unknown flag --zzz; see dpocache score --help"),
    ([*SCORE, "--bata", "1", "--zzz"], "unknown flag --bata; did you mean --data? | unknown flag --zzz; see "),
    ([*SCORE, "--chunk", "8"], None),  # the start of one flag: argparse takes it for --chunk-rows
    ([*SCORE, "--", "--zzz"], None),  # after --, not options
    ([*SCORE, "-x"], None),  # one dash: argparse's to refuse
])
def test_score_flags_are_checked_against_its_parser(args, expected):
    problem = unknown_flags(build_parser().commands["score"], args)
    if expected is None:
        assert problem is None, problem
    else:
        assert problem is not None and problem.startswith(expected), problem


def test_usage_md_answers_every_trl_name():
    """docs/usage.md's "Coming from TRL" table lists each name the CLI answers."""
    text = (REPO / "docs" / "usage.md").read_text(encoding="utf-8")
    section = text.split("## Coming from TRL", 1)[1].split("\n## ", 1)[0]
    assert not [name for name in TRL_NAMES if f"`{name}`" not in section]


@pytest.mark.parametrize("typed, meant", [("--out", "--output-dir"), ("--max-len", "--max-length"),
                                          ("--epoch", "--epochs")])
def test_the_start_of_one_flags_name_is_answered_with_that_flag(typed, meant):
    """As argparse takes a flag's start: --out was answered with --lora.dropout (closer by
    difflib's ratio than the much longer --output-dir)."""
    assert message(typed, "2").endswith(f"did you mean {meant}?")


def test_files_after_a_flags_value_are_a_pattern_the_shell_expanded(tmp_path):
    """--data data/train-*.parquet unquoted reaches dpocache as several files: said so, with the
    pattern to quote (it was "unexpected argument '...'")."""
    shards = [tmp_path / "data" / f"train-0000{k}-of-00003.parquet" for k in range(3)]
    shards[0].parent.mkdir()
    for shard in shards:
        shard.write_bytes(b"")
    assert message("--data", *map(str, shards)) == (
        f"--data takes one path and got 3 files ({shards[0]}, {shards[1]}, ...), as the shell expands an unquoted "
        f"pattern: quote the pattern, and dpocache reads the files it names as one data set, as --data "
        f"'{tmp_path / 'data' / 'train*.parquet'}'")
    assert message("--data", str(shards[0]), "extra") == "unexpected argument 'extra' (options are --key value)"
