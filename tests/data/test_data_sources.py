"""A data set of several files (``dpocache.data.sources``): a Hub download's folder of shards, or
a glob pattern, read file by file as one data set, each row named by its own file; refused where
the files are of several kinds or splits."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dpocache.data.pairs import load_preference_data
from dpocache.data.rows import DataError, write_jsonl
from dpocache.data.sources import SourceError, data_files


def _load(source, tokenizer, **kwargs):
    return load_preference_data(source, tokenizer, show_progress=False, **kwargs)


def _keys(data):
    return [p.key for p in data.pairs]


def _stores(cache_dir):
    return [p for p in (cache_dir / "tokens").iterdir() if not p.name.startswith(".")]


def _hub_folder(root, rows, shards=3):
    """A data set as a Hub download leaves it: data/train-0000k-of-0000n.parquet, a README and a
    hidden .cache folder (huggingface_hub's) holding a file that is not data."""
    data = root / "data"
    data.mkdir(parents=True)
    bounds = [len(rows) * k // shards for k in range(shards + 1)]
    for k in range(shards):
        pq.write_table(pa.Table.from_pylist(rows[bounds[k]:bounds[k + 1]]),
                       data / f"train-{k:05d}-of-{shards:05d}.parquet")
    (root / "README.md").write_text("# a data set\n")
    (root / ".cache").mkdir()
    (root / ".cache" / "stale.parquet").write_bytes(b"not data")
    return root


def test_a_folder_of_shards_and_a_pattern_read_as_the_one_file(tmp_path, tokenizer, make_rows):
    rows = make_rows(14, seed=21)
    expected = _keys(_load(write_jsonl(rows, tmp_path / "all.jsonl"), tokenizer))
    hub = _hub_folder(tmp_path / "hub", rows)
    for source in (hub, hub / "data", str(hub / "data" / "train-*.parquet"), str(hub / "**" / "*.parquet")):
        assert _keys(_load(source, tokenizer)) == expected, source
    assert [f.name for f in data_files(hub)] == [f"train-0000{k}-of-00003.parquet" for k in range(3)]


def test_a_bad_row_is_named_by_its_own_file_and_row_from_the_token_store_too(tmp_path, tokenizer, make_rows):
    rows = make_rows(9, seed=22)
    rows[7] = {"prompt": rows[7]["prompt"], "chosen": rows[7]["chosen"], "rejected": ""}  # shard 2, its row 1
    hub = _hub_folder(tmp_path / "hub", rows)
    where = f"{hub / 'data' / 'train-00002-of-00003.parquet'}:row 1: field 'rejected': empty string"
    with pytest.raises(DataError, match="^" + where.replace(".", r"\.")):
        _load(hub, tokenizer)
    for _ in range(2):  # tokenized, then mapped from the token store
        data = _load(hub, tokenizer, skip_invalid=True, cache_dir=tmp_path / "cache")
        assert [str(s) for s in data.skipped] == [where] and len(data) == 8
    assert len(_stores(tmp_path / "cache")) == 1


def test_rows_are_named_by_the_files_as_given_on_this_run_whatever_the_store_was_built_under(tmp_path, tokenizer,
                                                                                             make_rows):
    """One store serves the folder, its data/ folder and a pattern (its key is the files' names
    and bytes): each run names a row by the path it was given, and a moved folder by its new one."""
    rows = make_rows(9, seed=27)
    rows[7]["rejected"] = ""  # shard 2, its row 1
    rows[4]["prompt"] = "sort " * 80  # shard 1, its row 1: past a context of 64
    hub = _hub_folder(tmp_path / "hub", rows)
    cache = tmp_path / "cache"
    for source in (hub, hub / "data", str(hub / "data" / "train-*.parquet")):
        with pytest.raises(DataError) as err:  # from the store built by the first --skip-invalid run
            _load(source, tokenizer, cache_dir=cache)
        assert str(err.value) == (f"{hub / 'data' / 'train-00002-of-00003.parquet'}:row 1: field 'rejected': empty "
                                  "string (fix or drop the row; --skip-invalid skips such rows)")
        data = _load(source, tokenizer, skip_invalid=True, cache_dir=cache, context=64)
        assert [s.location for s in data.skipped] == [f"{hub / 'data' / f'train-0000{k}-of-00003.parquet'}:row 1"
                                                      for k in (2, 1)]
    # A shard without rows still counts among the files: the rows after it keep their own.
    pq.write_table(pa.Table.from_pylist(rows[:3]).slice(0, 0), hub / "data" / "train-00000-of-00003.parquet")
    data = _load(hub, tokenizer, skip_invalid=True, cache_dir=cache, context=64)
    assert len(data) == 4 and [s.location for s in data.skipped] == [
        f"{hub / 'data' / f'train-0000{k}-of-00003.parquet'}:row 1" for k in (2, 1)]
    pq.write_table(pa.Table.from_pylist(rows[:3]), hub / "data" / "train-00000-of-00003.parquet")
    moved = hub.rename(tmp_path / "moved")
    data = _load(moved, tokenizer, skip_invalid=True, cache_dir=cache, context=64)
    assert [s.location for s in data.skipped] == [f"{moved / 'data' / f'train-0000{k}-of-00003.parquet'}:row 1"
                                                  for k in (2, 1)]
    assert len(_stores(cache)) == 2  # the one of the three shards, and the one with the first shard empty


def test_a_pair_the_model_cannot_take_is_named_by_its_own_file(tmp_path, tokenizer, make_rows):
    """The checks made after loading (the model's context) locate a pair by its source row."""
    rows = make_rows(6, seed=23)
    rows[4]["prompt"] = "sort " * 80
    for suffix, write in ((".jsonl", lambda part, path: write_jsonl(part, path)),
                          (".parquet", lambda part, path: pq.write_table(pa.Table.from_pylist(part), path))):
        folder = tmp_path / suffix[1:]
        folder.mkdir()
        write(rows[:3], folder / f"train-0{suffix}")
        write(rows[3:], folder / f"train-1{suffix}")
        where = f"{folder / f'train-1{suffix}'}:{'row 1' if suffix == '.parquet' else '2'}: "
        for _ in range(2):  # tokenized, then from the token store
            with pytest.raises(DataError) as err:
                _load(folder, tokenizer, context=64, cache_dir=tmp_path / "cache")
            assert str(err.value).startswith(where), err.value


def test_an_edited_shard_gets_a_new_token_store(tmp_path, tokenizer, make_rows):
    rows = make_rows(6, seed=24)
    hub = _hub_folder(tmp_path / "hub", rows, shards=2)
    first = _load(hub, tokenizer, cache_dir=tmp_path / "cache")
    rows[5]["chosen"] = " an edited answer"
    pq.write_table(pa.Table.from_pylist(rows[3:]), hub / "data" / "train-00001-of-00002.parquet")
    second = _load(hub, tokenizer, cache_dir=tmp_path / "cache")
    assert _keys(first)[:5] == _keys(second)[:5] and _keys(first)[5] != _keys(second)[5]
    assert len(_stores(tmp_path / "cache")) == 2


def test_files_of_several_splits_or_kinds_are_refused_with_a_pattern_for_each(tmp_path, make_rows):
    rows = make_rows(4, seed=25)
    named = tmp_path / "named" / "data"
    named.mkdir(parents=True)
    for split in ("train", "test"):
        for k in range(2):
            write_jsonl(rows, named / f"{split}-{k:05d}-of-00002.jsonl")
    with pytest.raises(SourceError) as err:
        data_files(tmp_path / "named")
    assert str(err.value) == (f"{tmp_path / 'named'}: holds the splits train, test; name the one to read with its "
                              f"pattern: '{named / 'train*.jsonl'}' (train), '{named / 'test*.jsonl'}' (test)")
    assert len(data_files(str(named / "train-*"))) == 2

    folders = tmp_path / "folders"
    for split in ("train", "validation"):
        (folders / split).mkdir(parents=True)
        write_jsonl(rows, folders / split / "0000.jsonl")
    with pytest.raises(SourceError, match="holds the splits train, validation"):
        data_files(folders)
    assert [f.name for f in data_files(folders / "train")] == ["0000.jsonl"]

    # A working directory: its data, held-out data and a run's metrics are not one data set.
    work = tmp_path / "work"
    (work / "runs" / "a").mkdir(parents=True)
    for name in ("prefs.jsonl", "held.jsonl", "runs/a/metrics.jsonl"):
        write_jsonl(rows, work / name)
    with pytest.raises(SourceError) as err:
        data_files(work)
    assert str(err.value) == (f"{work}: holds held.jsonl, prefs.jsonl, runs/a/metrics.jsonl, not the files of one "
                              f"split (train-*, test-*, as the Hub names them): pass one, as {work / 'held.jsonl'}, "
                              f"or a pattern naming the ones to read, as '{work / '**' / '*.jsonl'}'")
    assert len(data_files(work / "runs")) == 1  # one file: read whole

    mixed = tmp_path / "mixed"
    mixed.mkdir()
    write_jsonl(rows, mixed / "train-a.jsonl")
    (mixed / "train-b.json").write_text(json.dumps(rows))
    with pytest.raises(SourceError, match=r"several kinds \(\.json, \.jsonl\): name the ones to read"):
        data_files(mixed)
    with pytest.raises(SourceError, match="no file matches this pattern"):
        data_files(str(tmp_path / "nothing-*.parquet"))


def test_cache_build_and_train_take_a_hub_folder(tmp_path, cli, model_dir, make_rows):
    rows = make_rows(8, seed=26)
    hub = _hub_folder(tmp_path / "hub", rows, shards=2)
    common = ["--model", model_dir, "--cache-dir", tmp_path / "cache", "--dtype", "float32", "--device", "cpu"]
    rc, out, err = cli("cache", "build", *common, "--data", hub, "--json")
    assert rc == 0, err
    assert json.loads(out)["computed"] == 8
    rc, out, err = cli("train", *common, "--data", str(hub / "data" / "train-*.parquet"), "--max-steps", "1",
                       "--batch-size", "2", "--output-dir", tmp_path / "run")
    assert rc == 0, err
    assert "(0 computed, 8 reused)" in out + err
