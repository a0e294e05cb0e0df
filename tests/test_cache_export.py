"""``dpocache cache export --format jsonl|parquet|datasets|safetensors`` (dpocache.cache.export):
the input rows in input order with TRL's reference columns; index-aligned safetensors."""

from __future__ import annotations

import json

import pytest

from dpocache.cli import main


def _cache_args(command, model_dir, data, cache_dir, *extra):
    return [str(a) for a in ["cache", command, "--model", model_dir, "--data", data, "--cache-dir", cache_dir,
                             "--dtype", "float32", "--device", "cpu", "--max-length", 32, *extra]]


@pytest.fixture(scope="module")
def exported(tmp_path_factory, model_dir, pref_jsonl):
    """A built cache and dpocache's own JSON-lines export (the reference values, in data order)."""
    root = tmp_path_factory.mktemp("export")
    assert main(_cache_args("build", model_dir, pref_jsonl, root / "cache")) == 0
    assert main(_cache_args("export", model_dir, pref_jsonl, root / "cache", "--out", root / "own.jsonl")) == 0
    own = [json.loads(line) for line in (root / "own.jsonl").read_text().splitlines()]
    return root, own


def _export(root, model_dir, data, fmt, name):
    out = root / name
    assert main(_cache_args("export", model_dir, data, root / "cache", "--out", out, "--format", fmt)) == 0
    return out


def _check_rows(rows, pref_rows, own):
    assert len(rows) == len(pref_rows) == len(own)
    for row, source, values in zip(rows, pref_rows, own):
        assert {k: row[k] for k in source} == source  # the input's row, in the input's order
        assert row["ref_chosen_logps"] == pytest.approx(values["chosen_logps"], abs=1e-6)
        assert row["ref_rejected_logps"] == pytest.approx(values["rejected_logps"], abs=1e-6)


def test_parquet_export_read_with_datasets(exported, model_dir, pref_jsonl, pref_rows):
    from datasets import load_dataset

    root, own = exported
    out = _export(root, model_dir, pref_jsonl, "parquet", "prefs.parquet")
    dataset = load_dataset("parquet", data_files=str(out), split="train")
    assert {"ref_chosen_logps", "ref_rejected_logps"} <= set(dataset.column_names)
    _check_rows(list(dataset), pref_rows, own)


def test_jsonl_and_datasets_exports(exported, model_dir, pref_jsonl, pref_rows):
    from datasets import load_from_disk

    root, own = exported
    out = _export(root, model_dir, pref_jsonl, "jsonl", "prefs_ref.jsonl")
    _check_rows([json.loads(line) for line in out.read_text().splitlines()], pref_rows, own)
    out = _export(root, model_dir, pref_jsonl, "datasets", "prefs_ds")
    _check_rows(list(load_from_disk(str(out))), pref_rows, own)


def test_safetensors_export_loads_with_safetensors_only(exported, model_dir, pref_jsonl):
    from safetensors.numpy import load_file

    root, own = exported
    out = _export(root, model_dir, pref_jsonl, "safetensors", "ref.safetensors")
    tensors = load_file(str(out))
    assert tensors["chosen_logps"].shape == tensors["rejected_logps"].shape == (len(own),)
    assert tensors["index"].tolist() == list(range(len(own)))
    assert tensors["chosen_logps"].tolist() == pytest.approx([r["chosen_logps"] for r in own], abs=1e-6)
    assert tensors["rejected_logps"].tolist() == pytest.approx([r["rejected_logps"] for r in own], abs=1e-6)


def test_unknown_format_is_one_line_exit_2(exported, model_dir, pref_jsonl, capsys):
    root, _ = exported
    code = main(_cache_args("export", model_dir, pref_jsonl, root / "cache", "--out", root / "x", "--format", "csv"))
    assert code == 2
    err = capsys.readouterr().err
    assert "--format" in err and "csv" in err and len(err.strip().splitlines()) == 1


def test_with_ids_and_format_is_one_line_exit_2(exported, model_dir, pref_jsonl, capsys):
    """--with-ids was silently ignored with --format: refused, before anything loads."""
    root, _ = exported
    out = root / "ids.parquet"
    code = main(_cache_args("export", model_dir, pref_jsonl, root / "cache", "--out", out, "--format", "parquet",
                            "--with-ids", "true"))
    assert code == 2 and not out.exists()
    err = capsys.readouterr().err
    assert err.startswith("dpocache cache export: error: --with-ids") and "--format parquet" in err
    assert len(err.strip().splitlines()) == 1


def test_a_missing_value_is_named_after_the_command(exported, model_dir, tmp_path, pref_rows, capsys):
    """Every command's errors start with ``dpocache COMMAND: error:``."""
    from dpocache.data import write_jsonl

    root, _ = exported
    data = write_jsonl([{**pref_rows[0], "chosen": pref_rows[0]["chosen"] + " 0"}], tmp_path / "new.jsonl")
    code = main(_cache_args("export", model_dir, data, root / "cache", "--out", tmp_path / "o.jsonl"))
    assert code == 1
    assert capsys.readouterr().err.startswith("dpocache cache export: error: ")
