"""``dpocache cache export --format jsonl|parquet|datasets|safetensors`` (dpocache.cache.export):
the input rows in input order with TRL's reference columns; index-aligned safetensors."""

from __future__ import annotations

import json

import pytest

from dpocache.cli.entry import main


def _cache_args(command, model_dir, data, cache_dir, *extra):
    return [str(a) for a in ["cache", command, "--model", model_dir, "--data", data, "--cache-dir", cache_dir,
                             "--dtype", "float32", "--device", "cpu", "--max-length", 32, *extra]]


@pytest.fixture(scope="module")
def exported(tmp_path_factory, model_dir, pref_jsonl):
    """A built cache and dpocache's own table (``--format keys``: the reference values, in data order)."""
    root = tmp_path_factory.mktemp("export")
    assert main(_cache_args("build", model_dir, pref_jsonl, root / "cache")) == 0
    assert main(_cache_args("export", model_dir, pref_jsonl, root / "cache", "--out", root / "own.jsonl",
                            "--format", "keys")) == 0
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


def test_a_failed_datasets_export_leaves_the_old_directory(exported, model_dir, pref_jsonl, pref_rows,
                                                          monkeypatch):
    # save_to_disk wrote straight into --out: a failure midway left a directory that
    # load_from_disk read as a complete data set, or could not read at all.
    from datasets import Dataset, load_from_disk

    root, own = exported
    out = _export(root, model_dir, pref_jsonl, "datasets", "again_ds")
    save = Dataset.save_to_disk

    def fail_midway(self, path, *args, **kwargs):
        save(self.select(range(2)), path, *args, **kwargs)  # files written, then the disk fills
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(Dataset, "save_to_disk", fail_midway)
    assert main(_cache_args("export", model_dir, pref_jsonl, root / "cache", "--out", out,
                            "--format", "datasets")) != 0
    _check_rows(list(load_from_disk(str(out))), pref_rows, own)  # the earlier export, whole
    assert not list(root.glob(".again_ds.*"))  # no temp directory left
    monkeypatch.setattr(Dataset, "save_to_disk", save)
    _check_rows(list(load_from_disk(str(_export(root, model_dir, pref_jsonl, "datasets", "again_ds")))),
                pref_rows, own)  # replaced whole
    assert not list(root.glob(".again_ds.*"))


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


def test_rows_dpocache_truncated_are_counted_on_stderr_and_marked(exported, model_dir, pref_jsonl, tokenizer, capsys):
    """dpocache's truncation is not TRL's collator's: the export says how many rows it cut (one
    line) and marks them in every format."""
    from datasets import load_dataset
    from safetensors.numpy import load_file

    from dpocache.data.pairs import load_preference_data

    root, _ = exported
    truncated = [p.truncated for p in load_preference_data(pref_jsonl, tokenizer, 32, show_progress=False).pairs]
    assert 0 < sum(truncated) < len(truncated)  # the data has both kinds at --max-length 32
    capsys.readouterr()
    out = _export(root, model_dir, pref_jsonl, "parquet", "marked.parquet")
    warnings = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and f"{sum(truncated)} of {len(truncated)} rows" in warnings[0]
    assert "--max-length 32" in warnings[0] and "TRL" in warnings[0]
    assert load_dataset("parquet", data_files=str(out), split="train")["dpocache_truncated"] == truncated
    tensors = load_file(str(_export(root, model_dir, pref_jsonl, "safetensors", "marked.safetensors")))
    assert tensors["truncated"].tolist() == truncated


def test_jsonl_export_of_a_parquet_source_with_dates_and_bytes(exported, model_dir, pref_rows, capsys):
    """A parquet source may hold values JSON cannot: dates are written as ISO strings, bytes are
    refused in one line naming the column (exit 2), and a failed export leaves no --out file."""
    import datetime

    import pyarrow as pa
    import pyarrow.parquet as pq

    root, own = exported
    created = [datetime.datetime(2024, 5, 1, 12, i % 60, tzinfo=datetime.timezone.utc) for i in range(len(pref_rows))]
    table = pa.Table.from_pylist([{**r, "created": c} for r, c in zip(pref_rows, created)])
    pq.write_table(table, root / "dated.parquet")
    out = _export(root, model_dir, root / "dated.parquet", "jsonl", "dated.jsonl")
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["created"] for r in rows] == [c.isoformat() for c in created]
    _check_rows([{k: v for k, v in r.items() if k != "created"} for r in rows], pref_rows, own)

    pq.write_table(table.append_column("blob", pa.array([b"\x00\x01"] * len(pref_rows))), root / "bytes.parquet")
    bad = root / "bytes.jsonl"
    capsys.readouterr()
    assert main(_cache_args("export", model_dir, root / "bytes.parquet", root / "cache", "--out", bad,
                            "--format", "jsonl")) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if not line.startswith("warning:")]
    assert len(err) == 1 and "'blob'" in err[0] and "--format parquet" in err[0]
    assert not bad.exists() and not list(root.glob(".bytes.jsonl.*"))  # no empty or partial file left


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
    from dpocache.data.rows import write_jsonl

    root, _ = exported
    data = write_jsonl([{**pref_rows[0], "chosen": pref_rows[0]["chosen"] + " 0"}], tmp_path / "new.jsonl")
    code = main(_cache_args("export", model_dir, data, root / "cache", "--out", tmp_path / "o.jsonl"))
    assert code == 1
    assert capsys.readouterr().err.startswith("dpocache cache export: error: ")


def test_a_jsonl_name_gives_one_schema_with_or_without_format(exported, model_dir, pref_jsonl, pref_rows):
    """``--out ref.jsonl`` writes the input rows plus TRL's reference columns whether or not
    ``--format jsonl`` is passed (it wrote the cache's own table without it); ``--with-ids``
    asks for that table, and a name that says no format asks for ``--format``."""
    root, own = exported
    plain, named = root / "plain.jsonl", root / "named.jsonl"
    assert main(_cache_args("export", model_dir, pref_jsonl, root / "cache", "--out", plain)) == 0
    assert main(_cache_args("export", model_dir, pref_jsonl, root / "cache", "--out", named, "--format", "jsonl")) == 0
    assert plain.read_text() == named.read_text()
    _check_rows([json.loads(line) for line in plain.read_text().splitlines()], pref_rows, own)
    ids = root / "ids.jsonl"
    assert main(_cache_args("export", model_dir, pref_jsonl, root / "cache", "--out", ids, "--with-ids")) == 0
    assert {"key", "chosen_logps", "prompt_ids"} <= set(json.loads(ids.read_text().splitlines()[0]))


@pytest.mark.parametrize("out, extra, words", [
    ("ref.json", (), ["--out", "ref.json", "pass --format"]),
    ("ref.json", ("--format", "parquet", "--with-ids"), ["--with-ids", "--format keys"]),
    # JSON lines in a file named .parquet: readers failed on it ("Parquet magic bytes not found")
    ("keys.parquet", ("--format", "keys"), ["--out", "keys.parquet: --format keys writes a .jsonl file",
                                            "(--format parquet)"]),
    ("ref.jsonl", ("--format", "parquet"), ["ref.jsonl: --format parquet writes a .parquet file"]),
])
def test_export_format_mistakes_are_one_line(exported, model_dir, pref_jsonl, capsys, out, extra, words):
    root, _ = exported
    code = main(_cache_args("export", model_dir, pref_jsonl, root / "cache", "--out", root / out, *extra))
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1 and all(w in err for w in words), err
    assert not (root / out).exists()


def test_a_full_disk_under_a_safetensors_export_is_one_line(exported, model_dir, pref_jsonl, capsys, monkeypatch):
    """safetensors reports a full disk as its own error, naming no file: the export names --out,
    exit 2, and leaves no partial file (it was a traceback)."""
    from safetensors import SafetensorError

    import dpocache.cache.export as export_mod

    def full(tensors, path, metadata=None):
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(export_mod, "save_file", full)
    root, _ = exported
    out = root / "full.safetensors"
    code = main(_cache_args("export", model_dir, pref_jsonl, root / "cache", "--out", out))
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err and not out.exists(), err
    assert err.strip().splitlines()[-1].endswith(f"--out {out}: cannot write it: No space left on device; the cache "
                                                 "is unchanged and no partial file is left"), err


def test_a_long_export_shows_its_bars(exported, model_dir, pref_jsonl, pref_rows, capsys, monkeypatch):
    from dpocache.cache import export as export_module

    root, own = exported
    monkeypatch.setattr(export_module, "BAR_FROM_ROWS", len(pref_rows))  # these rows count as many
    for fmt, bars in (("jsonl", ("reading rows", "writing")), ("keys", ("writing",))):
        capsys.readouterr()
        out = _export(root, model_dir, pref_jsonl, fmt, f"bars.{fmt}.jsonl")
        err = capsys.readouterr().err
        assert all(f"{bar}: 100%" in err for bar in bars), err
        assert len(out.read_text().splitlines()) == len(own)
    monkeypatch.setattr(export_module, "BAR_FROM_ROWS", len(pref_rows) + 1)  # one row fewer: no bar
    _export(root, model_dir, pref_jsonl, "jsonl", "few.jsonl")
    assert "writing" not in capsys.readouterr().err


def test_an_export_cut_as_trl_cuts_says_so(tmp_path, model_dir, pref_jsonl, capsys):
    """``--max-prompt-length`` one below ``--max-length`` cuts as TRL's collator does: the export's
    line says so (a note, not the warning that the values are of other tokens)."""
    cut = ("--max-length", 32, "--max-prompt-length", 31)

    def args(command, *extra):
        return [str(a) for a in _cache_args(command, model_dir, pref_jsonl, tmp_path / "c", *extra)]

    assert main(args("build", *cut)) == 0
    capsys.readouterr()
    assert main(args("export", *cut, "--out", tmp_path / "o.jsonl", "--format", "jsonl")) == 0
    err = capsys.readouterr().err
    assert "warning:" not in err and "note: " in err and "with --max-prompt-length 31 they were cut as TRL 1.16's " \
        "collator cuts them (the prompt whole, the completions their start)" in err, err
