"""What the cache and the data reader say in three cases that were worded wrong.

A damaged ``manifest.json`` costs no value: the manifest only lists the shards, each shard
carries its own checksum, and a build or training run rebuilds the manifest from them. It was
reported as ``corrupt shard .../manifest.json: ...; recomputing its pairs`` while no pair was
recomputed, and ``cache verify`` ended FAILED although every sampled value matched. A row whose
``chosen`` is ``null`` was reported as "missing", with advice to map a column the row has."""

from __future__ import annotations

import json

import pytest
from train_fixtures import flags

from dpocache.data.pairs import load_preference_data
from dpocache.data.rows import DataError, write_jsonl

DTYPE = ("--dtype", "float32", "--device", "cpu")


@pytest.fixture
def built(tmp_path, cli, model_dir, pref_jsonl):
    """A complete cache of ``pref_jsonl`` in ``tmp_path/cache``; returns (cache dir, manifest path)."""
    cache = tmp_path / "cache"
    rc, _, err = cli("cache", "build", "--model", model_dir, "--data", pref_jsonl, "--cache-dir", cache, *DTYPE)
    assert rc == 0, err
    (manifest,) = cache.glob("*/manifest.json")
    manifest.write_text("[]")  # valid JSON, not a manifest
    return cache, manifest


def _damage_line(err: str, manifest) -> str:
    (line,) = [line for line in err.splitlines() if "manifest.json" in line]
    assert line.startswith(f"damaged manifest {manifest}: the manifest is a list, not an object; "), line
    assert "corrupt shard" not in line and "recomputing" not in line and "ignored" not in line, line
    return line


def test_train_says_a_damaged_manifest_is_rebuilt_and_recomputes_nothing(tmp_path, cli, model_dir, pref_jsonl,
                                                                         built):
    cache, manifest = built
    rc, _, err = cli("train", *flags(model_dir, pref_jsonl, tmp_path / "run", cache, "--max-steps", "1"))
    assert rc == 0, err
    line = _damage_line(err, manifest)
    assert line.endswith("rebuilt from the shards, which carry their own checksums (no pair is recomputed for it)")
    assert json.loads((tmp_path / "run" / "run.json").read_text())["reference"]["computed"] == 0
    assert isinstance(json.loads(manifest.read_text()), dict)  # rebuilt


def test_cache_build_says_the_same(cli, model_dir, pref_jsonl, built):
    cache, manifest = built
    rc, out, err = cli("cache", "build", "--model", model_dir, "--data", pref_jsonl, "--cache-dir", cache, *DTYPE)
    assert rc == 0, err
    assert "rebuilt from the shards" in _damage_line(err, manifest)
    assert "computed 0," in out


def test_verify_passes_when_only_the_manifest_is_damaged(cli, model_dir, pref_jsonl, built):
    cache, manifest = built
    args = ("cache", "verify", "--model", model_dir, "--data", pref_jsonl, "--cache-dir", cache, *DTYPE)
    rc, out, err = cli(*args)
    assert rc == 0, out + err
    lines = out.strip().splitlines()
    assert lines[-1] == "OK", out
    assert any(line.startswith(f"DAMAGED MANIFEST {manifest}: the manifest is a list, not an object; the shards "
                               "were checked without it") and "rebuilds it from them" in line for line in lines), out
    assert not any(line.startswith("CORRUPT") for line in lines), out
    # verify only reads: the manifest is left for the next build, and the stderr line says so.
    assert "not used; the next cache build or train rebuilds it" in _damage_line(err, manifest)
    assert manifest.read_text() == "[]"

    # A damaged shard still fails verify.
    shard = next(manifest.parent.glob("shard-*.safetensors"))
    shard.write_bytes(shard.read_bytes()[:-4] + b"\0\0\0\0")
    rc, out, _ = cli(*args)
    assert rc == 1 and out.strip().splitlines()[-1] == "FAILED", out
    assert f"CORRUPT {shard}" in out


@pytest.mark.parametrize("nulls", [("chosen",), ("rejected",), ("chosen", "rejected")])
def test_a_null_completion_is_called_null(tmp_path, tokenizer, nulls):
    path = write_jsonl([{"prompt": "sort 3 1", "chosen": " 1 3", "rejected": " 3 1"},
                        {"prompt": "sort 2 1", "chosen": " 1 2", "rejected": " 2 1", **dict.fromkeys(nulls)}],
                       tmp_path / "rows.jsonl")
    with pytest.raises(DataError) as caught:
        load_preference_data(path, tokenizer, show_progress=False)
    message = str(caught.value)
    where = f"field '{nulls[0]}': null, not a completion" if len(nulls) == 1 else \
        "fields 'chosen', 'rejected' null, not completions"
    assert message == f"{path}:2: {where} (fix or drop the row; --skip-invalid skips such rows)"
    assert "missing" not in message and "--data." not in message
    skipped = load_preference_data(path, tokenizer, skip_invalid=True, show_progress=False)
    assert len(skipped) == 1 and len(skipped.skipped) == 1
