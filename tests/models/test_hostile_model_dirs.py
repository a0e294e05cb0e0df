"""A model directory that cannot be loaded safely is refused in one line before any weight is
read (``dpocache.runtime.preflight.check_model_dir``), naming the flag, the file and the reason:
model code shipped with the model (``auto_map``; dpocache never passes ``trust_remote_code``), a
pickle that torch's ``weights_only`` loader refuses (dpocache never unpickles anything else), a
safetensors file whose header is absurd or cut short. Each was a traceback from transformers,
torch or safetensors, exit status 1. The three cases of the issue run through ``dpocache
train`` and ``dpocache cache build`` in processes of their own; the rest call the check."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dpocache.data.rows import write_jsonl
from dpocache.runtime.preflight import UsageError, check_model_dir

QUIET = {"OMP_NUM_THREADS": "1", "TQDM_DISABLE": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1",
         "TRANSFORMERS_VERBOSITY": "error"}
MARKER = "unpickled-marker"  # created by the hostile pickle's payload, if anything ever ran it


class _Payload:
    """What a hostile pickle holds: unpickling it calls ``open(MARKER, "w")`` (any call would do)."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return open, (str(self.marker), "w")


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _set_config(directory: Path, **fields) -> None:
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, **fields}))


@pytest.fixture(scope="module")
def work(tmp_path_factory, model_dir, pref_rows) -> Path:
    """data.jsonl and the hostile model directories, each a copy of the tiny llama with one file changed."""
    root = tmp_path_factory.mktemp("hostile")
    write_jsonl(pref_rows, root / "data.jsonl")
    # (a) a model_type transformers does not implement, and the model's own code to run instead
    _set_config(_copy(model_dir, root / "remote-code"), model_type="my_custom_llm",
                auto_map={"AutoConfig": "configuration_custom.CustomConfig",
                          "AutoModelForCausalLM": "modeling_custom.CustomForCausalLM"})
    # (b) pickled weights whose unpickling would run code
    pickled = _copy(model_dir, root / "pickled")
    (pickled / "model.safetensors").unlink()
    torch.save({"model.embed_tokens.weight": torch.zeros(2, 2), "x": _Payload(root / MARKER)},
               pickled / "pytorch_model.bin")
    # (c) a safetensors header length of 2**62 bytes
    huge = _copy(model_dir, root / "huge-header")
    (huge / "model.safetensors").write_bytes((2**62).to_bytes(8, "little") + b"{}")
    return root


def _run(work: Path, *args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dpocache", *map(str, args)], cwd=work, capture_output=True,
                          text=True, timeout=300, env={**os.environ, **QUIET})


ISSUE_CASES = {
    "remote-code": ["config.json", "model_type 'my_custom_llm'", "auto_map", "modeling_custom.CustomForCausalLM",
                    "trust_remote_code"],
    "pickled": ["pytorch_model.bin", "weights_only", "refuses", "never unpickles"],
    "huge-header": ["model.safetensors", f"header length field says {2**62:,} bytes", "damaged or not safetensors"],
}
COMMANDS = {
    "train": ("train", "--data", "data.jsonl", "--dtype", "float32", "--device", "cpu", "--cache-dir", "cache",
              "--output-dir", "run"),
    "cache build": ("cache", "build", "--data", "data.jsonl", "--dtype", "float32", "--device", "cpu",
                    "--cache-dir", "cache"),
}


@pytest.mark.parametrize("command", list(COMMANDS))
@pytest.mark.parametrize("case", list(ISSUE_CASES))
def test_unsafe_model_dir_is_one_line_exit_2(work, case, command):
    args = COMMANDS[command]
    proc = _run(work, *args[:2 if command == "cache build" else 1], "--model", case,
                *args[2 if command == "cache build" else 1:])
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and proc.returncode == 2, (proc.returncode, proc.stderr)
    assert lines[0].startswith(f"dpocache {command}: error: --model {case}: "), lines[0]
    assert all(f in lines[0] for f in ISSUE_CASES[case]), lines[0]
    assert not (work / MARKER).exists()  # the pickle's payload never ran
    assert not (work / "cache").exists() or not any((work / "cache").glob("*/shard-*"))


# ---------------------------------------------------------------------------- the check itself


def _refused(directory: Path, *fragments: str, flag: str = "--model") -> str:
    with pytest.raises(UsageError) as caught:
        check_model_dir(directory, flag)
    message = str(caught.value)
    assert "\n" not in message and message.startswith(f"{flag} {directory}"), message
    assert all(f in message for f in fragments), message
    return message


def test_the_sound_tiny_model_passes(model_dir):
    assert check_model_dir(model_dir) == model_dir


def test_unknown_model_type_without_code(tmp_path, model_dir):
    d = _copy(model_dir, tmp_path / "m")
    _set_config(d, model_type="llama9000")
    _refused(d, "model_type 'llama9000'", "no architecture transformers", "pip install -U transformers")


def test_config_without_model_type_or_not_json(tmp_path, model_dir):
    d = _copy(model_dir, tmp_path / "m")
    config = json.loads((d / "config.json").read_text())
    del config["model_type"]
    (d / "config.json").write_text(json.dumps(config))
    _refused(d, "config.json has no model_type")
    (d / "config.json").write_text('{"model_type": "llama",')
    _refused(d, "config.json is not valid JSON")


def test_auto_map_beside_a_known_model_type_passes(tmp_path, model_dir):
    """transformers uses its own class then (has_local_code): nothing of the model's runs."""
    d = _copy(model_dir, tmp_path / "m")
    _set_config(d, auto_map={"AutoModelForCausalLM": "modeling_custom.CustomForCausalLM"})
    assert check_model_dir(d) == d


def test_a_model_type_only_config_mapping_knows_passes(tmp_path, model_dir):
    """'gpt-sw3' is added to CONFIG_MAPPING by configuration_auto.py, not in the generated list
    read first: the exact lookup must still find it."""
    d = _copy(model_dir, tmp_path / "m")
    _set_config(d, model_type="gpt-sw3")
    assert check_model_dir(d) == d


def test_plain_pickled_weights_pass(tmp_path, model_dir):
    """A pytorch_model.bin of tensors only loads with weights_only, as transformers loads it."""
    from safetensors.torch import load_file

    d = _copy(model_dir, tmp_path / "m")
    torch.save(load_file(d / "model.safetensors"), d / "pytorch_model.bin")
    (d / "model.safetensors").unlink()
    assert check_model_dir(d) == d
    legacy = _copy(d, tmp_path / "legacy")  # the format before torch 1.6
    torch.save(load_file(model_dir / "model.safetensors"), legacy / "pytorch_model.bin",
               _use_new_zipfile_serialization=False)
    assert check_model_dir(legacy) == legacy


def test_a_pickle_nobody_loads_is_not_checked(tmp_path, model_dir):
    """Trainer's training_args.bin is a pickle of arbitrary objects; from_pretrained never reads it."""
    d = _copy(model_dir, tmp_path / "m")
    torch.save({"x": _Payload(tmp_path / MARKER)}, d / "training_args.bin")
    assert check_model_dir(d) == d
    assert not (tmp_path / MARKER).exists()


def test_a_damaged_pickle(tmp_path, model_dir):
    d = _copy(model_dir, tmp_path / "m")
    (d / "model.safetensors").unlink()
    (d / "pytorch_model.bin").write_bytes(b"\x00" * 64)
    _refused(d, "pytorch_model.bin")


@pytest.mark.parametrize("case", ["cut short", "trailing bytes", "header not JSON", "header a list", "lfs pointer",
                                  "too short", "longer than the file"])
def test_damaged_safetensors(tmp_path, model_dir, case):
    d = _copy(model_dir, tmp_path / "m")
    weights = d / "model.safetensors"
    raw = weights.read_bytes()
    length = int.from_bytes(raw[:8], "little")
    bad, fragment = {
        "cut short": (raw[:-100], "cut short"),
        "trailing bytes": (raw + b"\0" * 8, "the file is damaged"),
        "header not JSON": (raw[:8] + b"!" * length + raw[8 + length:], "not valid JSON"),
        "header a list": ((2).to_bytes(8, "little") + b"[]", "not a JSON object"),
        "lfs pointer": (b"version https://git-lfs.github.com/spec/v1\noid sha256:ab\nsize 1\n", "git lfs pull"),
        "too short": (b"\x01\x02", "too short"),
        "longer than the file": ((10_000).to_bytes(8, "little") + b"{}", "more than the file holds"),
    }[case]
    weights.write_bytes(bad)
    _refused(d, "model.safetensors", fragment)


def test_an_index_that_lists_a_missing_shard(tmp_path, model_dir):
    d = _copy(model_dir, tmp_path / "m")
    (d / "model.safetensors").rename(d / "model-00001-of-00002.safetensors")
    index = {"metadata": {}, "weight_map": {"a": "model-00001-of-00002.safetensors",
                                            "b": "model-00002-of-00002.safetensors"}}
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    _refused(d, "model.safetensors.index.json lists model-00002-of-00002.safetensors, which is not there")
    (d / "model.safetensors.index.json").write_text("{}")
    _refused(d, "model.safetensors.index.json is not a valid index")


def test_a_ref_model_is_checked_the_same_way(work):
    _refused(work / "huge-header", "model.safetensors", flag="--ref-model")


def test_a_sound_model_dir_is_checked_without_torch_or_transformers(model_dir):
    """The checks precede torch's import (seconds) so that a wrong --model costs none: the model
    type is looked up in transformers' generated list of names, read from its file alone."""
    code = ("import sys; from dpocache.runtime.preflight import check_model_dir; "
            f"check_model_dir({str(model_dir)!r}); print('torch' in sys.modules, 'transformers' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.split() == ["False", "False"], proc.stdout + proc.stderr
