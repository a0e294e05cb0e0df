"""Hub model ids (dpocache.models.hub_ids): ``org/name[@revision]`` from a Hugging Face cache layout
built in a temporary HF_HOME, with the network disabled."""

from __future__ import annotations

import hashlib
import os
import shutil
import socket

import pytest
from train_fixtures import base_model, flags, one_thread, run_json, train_jsonl, train_records  # noqa: F401

from dpocache.cli.entry import main as cli_main
from dpocache.models.hub_ids import ModelNotCachedError, parse_model_id, resolve

COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture
def hf_home(tmp_path, base_model, monkeypatch):
    """HF_HOME with models--org--tiny: every file a blob named by its SHA-256, linked from
    snapshots/COMMIT, refs/main and refs/v1 pointing at COMMIT."""
    home = tmp_path / "hf"
    repo = home / "hub" / "models--org--tiny"
    (repo / "blobs").mkdir(parents=True)
    snapshot = repo / "snapshots" / COMMIT
    snapshot.mkdir(parents=True)
    for f in base_model.iterdir():
        digest = hashlib.sha256(f.read_bytes()).hexdigest()
        shutil.copyfile(f, repo / "blobs" / digest)
        os.symlink(os.path.join("..", "..", "blobs", digest), snapshot / f.name)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    (repo / "refs" / "v1").write_text(COMMIT)
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return home


@pytest.fixture
def no_network(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a network connection was attempted")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)


def test_parse_model_id(tmp_path):
    assert parse_model_id("org/name") == ("org/name", "main")
    assert parse_model_id("org/name@v1.2") == ("org/name", "v1.2")
    assert parse_model_id(str(tmp_path)) is None  # an existing path is a path
    assert parse_model_id("just-a-name") is None


def test_resolve_branch_tag_and_commit(hf_home, no_network):
    snapshot = hf_home / "hub" / "models--org--tiny" / "snapshots" / COMMIT
    for spec in ("org/tiny", "org/tiny@main", "org/tiny@v1", f"org/tiny@{COMMIT}"):
        resolved = resolve(spec)
        assert resolved.path == snapshot and resolved.commit == COMMIT and resolved.repo_id == "org/tiny"


def test_missing_ids_fail_in_one_line(hf_home, no_network):
    with pytest.raises(ModelNotCachedError, match="revision 'v2' of org/tiny is not in the local Hugging Face cache"):
        resolve("org/tiny@v2")
    with pytest.raises(ModelNotCachedError, match="other/model"):
        resolve("other/model")


def test_train_from_a_hub_id_offline(hf_home, no_network, tmp_path, train_jsonl):
    out = tmp_path / "run"
    args = flags("org/tiny", train_jsonl, out, tmp_path / "cache", "--max-steps", "1")
    from train_fixtures import run_training

    run_training(*args)
    assert train_records(out)[0]["step"] == 1
    assert COMMIT in run_json(out)["config"]["model"]["path"]  # run.json records the resolved snapshot


def test_train_with_a_missing_id_exits_2_in_one_line_at_once(hf_home, no_network, tmp_path, train_jsonl, capsys,
                                                              monkeypatch):
    """It fails before loading anything (no tokenizer, no model) and without a network call."""
    import transformers

    def refuse(*args, **kwargs):
        raise AssertionError("something was loaded before the model id was resolved")

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", refuse)
    rc = cli_main(["train", *flags("org/absent", train_jsonl, tmp_path / "run", tmp_path / "cache")])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1 and "--model org/absent: no such directory" in err, err
    # the reference's id is named by its own flag
    rc = cli_main(["train", *flags("org/tiny", train_jsonl, tmp_path / "run2", tmp_path / "cache"),
                   "--ref-model", "org/absent"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1 and "--ref-model org/absent: no such directory" in err, err


def test_the_python_api_names_its_own_argument_for_a_missing_id(hf_home, no_network):
    from dpocache import ReferenceService

    with pytest.raises(ModelNotCachedError, match=r"^ReferenceService.from_pretrained: path org/absent: no such"):
        ReferenceService.from_pretrained("org/absent")


def test_snapshot_repo_reads_the_cache_layout(tmp_path):
    from dpocache.models.hub_ids import snapshot_repo

    snapshot = tmp_path / "hub" / "models--org--tiny-v2" / "snapshots" / COMMIT
    assert snapshot_repo(snapshot) == ("org/tiny-v2", COMMIT)
    assert snapshot_repo(tmp_path / "hub" / "models--gpt2" / "snapshots" / COMMIT) == ("gpt2", COMMIT)
    assert snapshot_repo(tmp_path / "models" / "tiny") is None
    assert snapshot_repo(tmp_path / "hub" / "models--org--tiny" / "snapshots" / "not-a-commit") is None


def test_lora_from_a_hub_id_saves_an_adapter_naming_the_hub_id(hf_home, no_network, tmp_path, train_jsonl):
    # The adapter's base was the snapshot's local path, which exists on this machine only (and in
    # an adapter pushed with --train.push_to_hub, on none of its readers').
    import json

    from train_fixtures import run_training

    out = tmp_path / "run"
    run_training(*flags("org/tiny", train_jsonl, out, tmp_path / "cache", "--max-steps", "1", "--lora-r", "4"))
    adapter = json.loads((out / "final" / "adapter_config.json").read_text())
    assert adapter["base_model_name_or_path"] == "org/tiny" and adapter["revision"] == COMMIT
    # The adapter directory trains on: its base is found in the local cache, at that commit.
    out2 = tmp_path / "run2"
    run_training(*flags(str(out / "final"), train_jsonl, out2, tmp_path / "cache", "--max-steps", "1"))
    assert train_records(out2)[0]["step"] == 1
    assert COMMIT in run_json(out2)["reference"]["model"]


def test_score_from_a_hub_id_offline(hf_home, no_network, tmp_path, base_model):
    """``dpocache score --model org/tiny`` was refused as "not a model directory" where ``cache
    build`` and ``ReferenceService.from_pretrained`` take the id; its lines equal the directory's."""
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"prompt_ids": [5, 6, 7], "completion_ids": [[8, 9], [10]]}\n')
    outs = {}
    for model in ("org/tiny", str(base_model)):
        out = outs[model] = tmp_path / f"{model.replace('/', '_')}.jsonl"
        assert cli_main(["score", "--model", model, "--data", str(rows), "--out", str(out), "--device", "cpu",
                         "--dtype", "float32", "--cache-dir", str(tmp_path / f"cache-{len(outs)}")]) == 0
    assert outs["org/tiny"].read_text() == outs[str(base_model)].read_text() != ""
