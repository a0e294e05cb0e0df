"""End-to-end tests of ``dpocache cache build|info|verify|export`` on a tiny llama (fp32, CPU).

The commands run in-process through ``dpocache.cli.entry.main`` (fast); only the SIGKILL test starts
a real ``python -m dpocache`` process.
"""

from __future__ import annotations

import json
import random
import re
import signal
import struct
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from dpocache.cache import CacheStore, namespace_for_dir
from dpocache.cache.build import CPU_MAX_TOKENS
from dpocache.data.rows import write_jsonl

SUMMARY_KEYS = {"computed", "reused", "tokens", "tokens_per_s", "cache_dir", "namespace"}


def cache_args(command, model_dir, data, cache_dir, *extra):
    return ["cache", command, "--model", model_dir, "--data", data, "--cache-dir", cache_dir,
            "--dtype", "float32", "--device", "cpu", *extra]


@pytest.fixture
def build(cli, model_dir):
    """``cache build --json`` → the summary: stdout holds its JSON object alone (for ``jq``), the
    summary's lines go to stderr."""

    def run(data, cache_dir, *extra):
        rc, out, err = cli(*cache_args("build", model_dir, data, cache_dir, "--json", *extra))
        assert rc == 0, err
        summary = json.loads(out)
        summary["stderr"] = err
        return summary

    return run


def export(cli, model_dir, data, cache_dir, out_path, *extra):
    rc, _, err = cli(*cache_args("export", model_dir, data, cache_dir, "--out", out_path, "--format", "keys", *extra))
    assert rc == 0, err
    return [json.loads(line) for line in out_path.read_text().splitlines()]


def _shards(cache_dir):
    return sorted(cache_dir.glob("*/shard-*.safetensors"))


# ------------------------------------------------------------------------------------ reuse


def test_build_reuses_by_content(tmp_path, build, model_dir, pref_rows, pref_jsonl, make_rows):
    cache = tmp_path / "cache"
    first = build(pref_jsonl, cache)
    assert SUMMARY_KEYS <= first.keys()
    assert (first["computed"], first["reused"]) == (len(pref_rows), 0)
    assert f"pairs {len(pref_rows)} (unique {len(pref_rows)}): computed {len(pref_rows)}, reused 0" in first["stderr"]
    assert first["tokens"] > 0 and first["tokens_per_s"] > 0
    # where the time went: the data (tokenizer, tokenizing) and the pass, within the whole
    assert 0 < first["data_s"] and first["data_s"] + first["seconds"] <= first["wall_s"]
    assert re.search(r"time: [\d.]+ s after the imports: [\d.]+ s loading the tokenizer and the data", first["stderr"])
    assert first["namespace"] == namespace_for_dir(model_dir, torch.float32, cache).id
    assert first["cache_dir"] == str(cache / first["namespace"])

    # No --max-tokens: the budget of the device (a CPU's), named in the summary; none when no pass ran.
    assert first["max_tokens"] == CPU_MAX_TOKENS
    second = build(pref_jsonl, cache)
    assert (second["computed"], second["reused"], second["forward_passes"]) == (0, len(pref_rows), 0)
    assert second["max_tokens"] is None

    rows = list(pref_rows)
    random.Random(1).shuffle(rows)
    rows += make_rows(3, seed=99)
    shuffled = write_jsonl(rows, tmp_path / "shuffled.jsonl")
    third = build(shuffled, cache)
    assert (third["computed"], third["reused"]) == (3, len(pref_rows))

    # Another cache root gets the same namespace: nothing but weights and dtype enter it (nor the budget).
    elsewhere = build(pref_jsonl, tmp_path / "elsewhere", "--max-tokens", "300")
    assert (elsewhere["namespace"], elsewhere["max_tokens"]) == (first["namespace"], 300)
    assert "reads no reference" not in first["stderr"]


def test_a_build_for_a_reference_free_loss_says_its_training_reads_none(tmp_path, cli, model_dir, pref_jsonl):
    """A sweep's config with SimPO: the build ran and said nothing of it."""
    config = tmp_path / "simpo.yaml"
    config.write_text("loss:\n  name: simpo\n")
    rc, _, err = cli("cache", "build", config, *cache_args("build", model_dir, pref_jsonl, tmp_path / "cache")[2:])
    assert rc == 0, err
    assert ("note: the loss 'simpo' reads no reference: a training with it reads nothing of this cache (other "
            "losses on the same model and data do)") in err


def test_max_length_recomputes_exactly_the_truncated_pairs(tmp_path, build, tokenizer, pref_rows, pref_jsonl):
    def n_tokens(text):
        return len(tokenizer(text, add_special_tokens=False)["input_ids"])

    # Lengths as the model sees them: prompt (the tiny tokenizer adds no BOS), completion + EOS.
    widths = [n_tokens(r["prompt"]) + 1 + max(n_tokens(r["chosen"]), n_tokens(r["rejected"])) for r in pref_rows]
    max_length = sorted(widths)[len(widths) // 2]
    expected = sum(w > max_length for w in widths)
    assert 0 < expected < len(pref_rows)

    cache = tmp_path / "cache"
    build(pref_jsonl, cache)
    cut = build(pref_jsonl, cache, "--max-length", max_length)
    assert cut["unique"] == len(pref_rows)
    assert (cut["computed"], cut["reused"]) == (expected, len(pref_rows) - expected)
    assert build(pref_jsonl, cache, "--max-length", max_length)["computed"] == 0


def test_malformed_line_exits_2_naming_the_line(tmp_path, cli, model_dir, pref_rows):
    path = write_jsonl(pref_rows[:6], tmp_path / "bad.jsonl")
    lines = path.read_text().splitlines()
    lines[4] = lines[4][:-5]  # line 5 loses its closing characters
    path.write_text("\n".join(lines) + "\n")
    rc, _, err = cli(*cache_args("build", model_dir, path, tmp_path / "cache"))
    assert rc == 2
    assert f"{path}:5" in err
    assert not _shards(tmp_path / "cache")


# ------------------------------------------------------------------------------------ values


def test_exported_values_equal_a_naive_computation(tmp_path, build, cli, model_dir, pref_jsonl, pref_rows):
    from transformers import AutoModelForCausalLM

    cache = tmp_path / "cache"
    build(pref_jsonl, cache, "--max-length", 32)  # some pairs truncated: values of the kept ids
    rows = export(cli, model_dir, pref_jsonl, cache, tmp_path / "export.jsonl", "--max-length", 32, "--with-ids")
    assert [r["index"] for r in rows] == list(range(len(pref_rows)))

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        for r in rows:
            assert len(r["prompt_ids"]) + max(len(r["chosen_ids"]), len(r["rejected_ids"])) <= 32
            for side in ("chosen", "rejected"):
                ids = torch.tensor([r["prompt_ids"] + r[f"{side}_ids"]])
                logps = model(input_ids=ids).logits.float()[0, :-1].log_softmax(-1)  # (T-1, V)
                start = len(r["prompt_ids"]) - 1  # the position that predicts the first completion token
                targets = ids[0, start + 1:]
                naive = logps[start:].gather(-1, targets[:, None]).sum().item()
                assert abs(r[f"{side}_logps"] - naive) < 1e-4, (r["index"], side)
                assert r[f"{side}_tokens"] == len(r[f"{side}_ids"])


def test_per_token_build(tmp_path, build, model_dir, pref_jsonl, pref_rows):
    n = len(pref_rows)
    cache = tmp_path / "cache"
    assert build(write_jsonl(pref_rows[:5], tmp_path / "first.jsonl"), cache)["computed"] == 5
    # A sums-only cache lacks per-token values: a per-token build recomputes them, and says so.
    again = build(pref_jsonl, cache, "--per-token")
    assert (again["computed"], again["reused"], again["per_token_again"]) == (n, 0, 5)
    said = (f"cache: 5 of the {n} pairs are cached without per-token values, which this run stores (cache build "
            "--per-token, or a loss with ld_alpha); they are scored again (their sums stay the same)")
    assert said in again["stderr"]
    assert f"computed {n} (5 of them cached as sums alone: scored again for --per-token), reused 0" in again["stderr"]
    assert build(pref_jsonl, cache, "--per-token")["computed"] == 0
    assert build(pref_jsonl, cache)["computed"] == 0
    assert build(pref_jsonl, cache)["computed"] == 0

    store = CacheStore(cache, namespace_for_dir(model_dir, torch.float32, cache)).open()
    keys = [k for s in store.shards if s.info.per_token for k in map(bytes, s.tensors["keys"].numpy())]
    assert len(set(keys)) == n
    values = store.lookup(keys)
    for i, key in enumerate(keys):
        chosen, rejected = store.token_logps(key)
        assert len(chosen) == values.chosen_tokens[i] and len(rejected) == values.rejected_tokens[i]
        torch.testing.assert_close(chosen.double().sum(), values.chosen_logps[i].double(), rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(rejected.double().sum(), values.rejected_logps[i].double(), rtol=1e-6, atol=1e-6)


def test_no_pickle_in_the_cache(tmp_path, build, pref_jsonl):
    cache = tmp_path / "cache"
    build(pref_jsonl, cache, "--shard-size", 8, "--max-tokens", 256)
    build(pref_jsonl, cache, "--per-token")
    files = [p for p in cache.rglob("*") if p.is_file()]
    assert len(files) >= 4
    for path in files:
        assert path.name.endswith((".json", ".jsonl", ".safetensors", ".npy", ".corrupt", ".lock")), path
        head = path.read_bytes()[:4]
        assert not head.startswith(b"\x80") and head != b"PK\x03\x04", path  # pickle / torch.save zip
        if path.suffix == ".json":
            json.loads(path.read_text())
        if path.suffix == ".npy":  # the token store: plain arrays, no object array to unpickle
            np.load(path, allow_pickle=False)


# ------------------------------------------------------------------------------------ damage


def _poison_chosen_logps(shard) -> int:
    """Overwrite a shard's ``chosen_logps`` with +100.0 (a value no log-prob has) in place,
    keeping the file parseable: only its checksum can tell. Returns the shard's pair count."""
    raw = bytearray(shard.read_bytes())
    (header_len,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + header_len])
    start, end = header["chosen_logps"]["data_offsets"]
    base = 8 + header_len
    n = (end - start) // 4
    raw[base + start:base + end] = struct.pack(f"<{n}f", *([100.0] * n))
    shard.write_bytes(bytes(raw))
    return n


@pytest.mark.parametrize("command", ["verify", "export"])
def test_reading_commands_refuse_a_cache_dir_that_is_not_there(tmp_path, cli, model_dir, pref_jsonl, command):
    """A typo in --cache-dir is one line and exit 2, as for ``cache info``: not a model loaded to
    report every pair missing, and no directory created under the typo."""
    typo = tmp_path / "cahce"
    extra = ("--out", tmp_path / "out.jsonl") if command == "export" else ()
    rc, _, err = cli(*cache_args(command, model_dir, pref_jsonl, typo, *extra))
    assert rc == 2 and err.strip() == f"dpocache cache {command}: error: --cache-dir {typo}: no such directory"
    assert not typo.exists()


def test_corrupt_shard_is_named_by_info_verify_and_build(tmp_path, cli, build, model_dir, pref_jsonl, pref_rows):
    cache = tmp_path / "cache"
    build(pref_jsonl, cache, "--shard-size", 8, "--max-tokens", 256)
    shards = _shards(cache)
    assert len(shards) >= 3
    bad = shards[1]
    n_bad = _poison_chosen_logps(bad)

    rc, out, _ = cli("cache", "info", "--cache-dir", cache)
    assert rc != 0 and bad.name in out and "CORRUPT" in out

    rc, out, err = cli(*cache_args("verify", model_dir, pref_jsonl, cache, "--samples", 8))
    assert rc != 0 and bad.name in out and "FAILED" in out
    assert f"shards: {len(shards)} hashed again, 1 damaged\n" in out
    assert bad.name in err  # also reported when the store is opened
    gone = shards[2].read_bytes()
    shards[2].unlink()  # listed in the manifest, not on disk: not a shard hashed
    rc, out, _ = cli(*cache_args("verify", model_dir, pref_jsonl, cache, "--samples", 8))
    assert rc != 0 and f"shards: {len(shards) - 1} hashed again, 1 damaged, 1 missing\n" in out
    shards[2].write_bytes(gone)

    summary = build(pref_jsonl, cache)
    assert bad.name in summary["stderr"] and "not loaded" in summary["stderr"]
    assert summary["computed"] == n_bad and summary["reused"] == len(pref_rows) - n_bad
    # Quarantined, so no later run trips on it. (The recomputed pairs may be written to a
    # shard of the same name again: names are content-addressed and the values are the same.)
    assert bad.with_name(bad.name + ".corrupt").exists()

    rows = export(cli, model_dir, pref_jsonl, cache, tmp_path / "export.jsonl")
    assert all(r["chosen_logps"] < 0 for r in rows)  # the poisoned +100s were never loaded
    rc, out, _ = cli("cache", "info", "--cache-dir", cache)
    assert rc == 0 and "CORRUPT" not in out
    rc, out, _ = cli(*cache_args("verify", model_dir, pref_jsonl, cache, "--samples", 8))
    assert rc == 0 and "OK" in out and " hashed again, 0 damaged" in out


def test_cache_info_with_model_and_data_counts_the_pairs_each_namespace_holds(tmp_path, cli, build, model_dir,
                                                                              other_model_dir, pref_jsonl, pref_rows):
    """"Is my cache complete for this data?" without loading a model (--model and --data were
    taken and silently ignored; only verify answered, by loading the model). Only --model's
    namespace answers: one of another model counted as complete for it."""
    from dpocache.data.rows import write_jsonl

    cache, part = tmp_path / "cache", write_jsonl(pref_rows[:5], tmp_path / "part.jsonl")
    build(part, cache)
    info = ["cache", "info", "--cache-dir", cache, "--model", model_dir, "--max-length", 1024, "--dtype", "float32",
            "--device", "cpu"]
    rc, out, _ = cli(*info, "--data", pref_jsonl)
    namespace = next(d.name for d in cache.iterdir() if (d / "manifest.json").exists())
    missing = len(pref_rows) - 5
    assert rc == 1 and f"{pref_jsonl}: {len(pref_rows):,} pairs (--max-length 1024)" in out
    assert f"  {namespace} ({model_dir}, float32): 5 cached, {missing:,} missing  <- this run's" in out
    assert f"--model {model_dir} in float32 lacks {missing:,} of them: dpocache cache build" in out
    build(pref_jsonl, cache)
    rc, out, _ = cli(*info, "--data", pref_jsonl)
    assert rc == 0 and f"{len(pref_rows):,} cached, all  <- this run's" in out
    # the token stores: their data's absolute path, length limit and date
    assert f"from {part.absolute()}  max_length 1024  written " in out
    # another model, or another dtype: nothing of this cache is theirs
    for other in (["--model", other_model_dir], ["--dtype", "bfloat16"]):
        rc, out, _ = cli(*info, "--data", pref_jsonl, *other)
        assert rc == 1 and f"{len(pref_rows):,} cached, all\n" in out, out
        assert "): not in the cache  <- this run's" in out and f"lacks {len(pref_rows):,} of them" in out
    rc, _, err = cli("cache", "info", "--cache-dir", cache, "--data", pref_jsonl)
    assert rc == 2 and "cache info --data needs --model too" in err


def test_an_export_of_pairs_not_cached_names_the_build_to_run(tmp_path, cli, build, model_dir, pref_jsonl, pref_rows):
    """The build command with this export's settings, ready to paste (it said --model <reference
    model> --data <data>, though the export had named both)."""
    from dpocache.data.rows import write_jsonl

    cache = tmp_path / "cache"
    build(write_jsonl(pref_rows[:3], tmp_path / "part.jsonl"), cache)
    rc, _, err = cli(*cache_args("export", model_dir, pref_jsonl, cache, "--out", tmp_path / "x.jsonl", "--with-ids",
                                 "--format", "keys", "--max-length=512"))
    line = err.strip().splitlines()[-1]
    assert rc == 1 and line == (
        f"dpocache cache export: error: {len(pref_rows) - 3} of the data's pairs have no cached reference log-probs; "
        f"build them first: dpocache cache build --model {model_dir} --data {pref_jsonl} --cache-dir {cache} "
        "--dtype float32 --device cpu --max-length=512")


def test_values_of_the_model_in_another_dtype_are_pointed_to(tmp_path, cli, build, model_dir, pref_jsonl, pref_rows):
    """``--dtype auto`` chooses by device (float32 on a login node's CPU, bfloat16 on a GPU): an
    export or a build in the other dtype found nothing, said nothing of the values beside it, and
    a build computed them all again."""
    cache = tmp_path / "cache"
    first = build(pref_jsonl, cache)  # float32
    bf16 = [a if a != "float32" else "bfloat16" for a in cache_args("export", model_dir, pref_jsonl, cache)]
    rc, _, err = cli(*bf16, "--out", tmp_path / "x.jsonl", "--format", "keys")
    assert rc == 1 and (f"{len(pref_rows)} of the data's pairs have no cached reference log-probs; namespace "
                        f"{first['namespace']} holds this model's values in float32: --dtype float32 reads them; or "
                        "build them in this dtype: dpocache cache build") in err, err
    rc, _, err = cli(*[a if a != "export" else "build" for a in bf16])
    assert rc == 0 and (f"cache: namespace {first['namespace']} holds this model's values in float32; this run "
                        "computes them in bfloat16 (--dtype float32 reads those)") in err, err


# The killed build is a real process running the real command; each shard flush is followed
# by a short sleep so that the kill lands part-way however loaded the machine is.
_SLOW_BUILD = """
import sys, time
from dpocache.cache import store
_flush = store.ShardWriter.flush
def flush(self):
    _flush(self)
    time.sleep(0.05)
store.ShardWriter.flush = flush
from dpocache.cli.entry import main
raise SystemExit(main(sys.argv[1:]))
"""


def test_killed_build_resumes_where_it_stopped(tmp_path, build, cli, model_dir, make_rows):
    n = 96
    data = write_jsonl(make_rows(n, seed=11), tmp_path / "big.jsonl")
    killed_cache, fresh_cache = tmp_path / "killed", tmp_path / "fresh"
    # One pair per forward (--max-tokens 1), so every value is computed alone in every build
    # and the killed-then-resumed cache can be compared bit for bit with a fresh one.
    args = ["--shard-size", 4, "--max-tokens", 1]
    cmd = [sys.executable, "-c", _SLOW_BUILD, *map(str, cache_args("build", model_dir, data, killed_cache, *args))]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    try:
        while len(_shards(killed_cache)) < 2:
            if proc.poll() is not None:
                pytest.fail(f"build ended before it could be killed (rc {proc.returncode}): "
                            f"{proc.stderr.read().decode()[-2000:]}")
            assert time.monotonic() < deadline, "no shard appeared in 120 s"
            time.sleep(0.005)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait()
        proc.stderr.close()
    assert proc.returncode == -signal.SIGKILL

    resumed = build(data, killed_cache, *args)
    assert resumed["computed"] + resumed["reused"] == resumed["unique"] == n
    assert 0 < resumed["computed"] < n and resumed["reused"] >= 8
    assert resumed["corrupt_shards"] == []

    assert build(data, fresh_cache, *args)["computed"] == n
    a = export(cli, model_dir, data, killed_cache, tmp_path / "a.jsonl")
    b = export(cli, model_dir, data, fresh_cache, tmp_path / "b.jsonl")
    assert a == b


def test_python_m_dpocache_runs_beside_a_folder_named_dpocache(tmp_path):
    """From the folder that holds a clone named dpocache (``cd ~; torchrun -m dpocache ...``),
    that clone's folder, found first on the path, was imported as an empty namespace package
    under the editable install's import hook: "cannot import name '__version__' from 'dpocache'
    (unknown location)". The install puts the repository on the path instead (pyproject.toml)."""
    (tmp_path / "dpocache").mkdir()
    (tmp_path / "dpocache" / "README.md").write_text("a clone of the repository\n")
    (tmp_path / "cache").mkdir()
    proc = subprocess.run([sys.executable, "-m", "dpocache", "cache", "info", "--cache-dir", "cache"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-2000:]


def test_a_new_namespace_beside_one_of_the_same_config_says_why(tmp_path, cli, build, model_dir, other_model_dir,
                                                                pref_jsonl, pref_rows):
    """A model saved again (another shard size, a file dropped beside it) is a new namespace, every
    pair computed again without a word: said, naming the namespace of the same config."""
    cache = tmp_path / "cache"
    first = build(pref_jsonl, cache)
    assert "no values here are of these weights" not in first["stderr"]
    rc, out, _ = cli("cache", "info", "--cache-dir", cache, "--model", other_model_dir, "--data", pref_jsonl,
                     "--dtype", "float32", "--device", "cpu")
    assert rc == 1 and f"  {first['namespace']} has the same config and dtype and other weight files: a model saved " \
        "again" in out, out
    rc, _, err = cli(*cache_args("build", other_model_dir, pref_jsonl, cache))
    assert rc == 0
    assert (f"cache: no values here are of these weights ({other_model_dir}); namespace {first['namespace']} "
            f"({model_dir}) has the same config and dtype and other weight files") in err, err
    rc, _, err = cli(*cache_args("build", other_model_dir, pref_jsonl, cache))
    assert "no values here are of these weights" not in err  # its own values now
