"""Every mistake a user can make on the command line gets one line naming the flag, file, line
or field, exit status 2 and no traceback (a traceback only with -v), before any model loads
where the mistake can be seen then. Each case runs the CLI in an interpreter apart from the
tests' (``python -m dpocache``, or for the many cases of ``CASES`` one interpreter that runs them
in turn, each with its stderr captured at the file descriptor)."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dpocache.data.rows import write_jsonl

QUIET = {"OMP_NUM_THREADS": "1", "TQDM_DISABLE": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1",
         "TRANSFORMERS_VERBOSITY": "error"}
# Under a minute of retries against the Hugging Face Hub is what a wrong --model cost; the
# checks now run before torch is imported. A bound on a hang, not a benchmark.
MODEL_PATH_BOUND_S = 5


def dpocache(*args, cwd: Path, timeout: float = 300, code: str | None = None) -> subprocess.CompletedProcess:
    """``python -m dpocache ARGS`` (or ``python -c CODE ARGS``) in ``cwd``."""
    head = ["-c", code] if code else ["-m", "dpocache"]
    return subprocess.run([sys.executable, *head, *map(str, args)], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **QUIET})


def one_line(proc: subprocess.CompletedProcess) -> str:
    """The single stderr line of a failed run, after checking status 2 and no traceback."""
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    return lines[0]


@pytest.fixture(scope="module")
def work(tmp_path_factory, model_dir, pref_rows) -> Path:
    """A directory holding: model/ (a tiny llama), data.jsonl, and the broken variants."""
    root = tmp_path_factory.mktemp("errors")
    shutil.copytree(model_dir, root / "model")
    write_jsonl(pref_rows, root / "data.jsonl")
    (root / "no-tokenizer").mkdir()
    (root / "no-weights").mkdir()
    for f in (root / "model").iterdir():
        is_tokenizer = f.name.startswith("tokenizer") or f.name.endswith(".jinja")
        if not is_tokenizer:
            shutil.copy(f, root / "no-tokenizer" / f.name)
        if not f.name.endswith(".safetensors"):
            shutil.copy(f, root / "no-weights" / f.name)
    write_jsonl([{"question": r["prompt"], "chosen": r["chosen"], "rejected": r["rejected"]} for r in pref_rows],
                root / "question.jsonl")
    write_jsonl([{"question": r["prompt"], "good": r["chosen"], "bad": r["rejected"]} for r in pref_rows],
                root / "good-bad.jsonl")  # every field under another name: one error, every flag to pass
    (root / "typo.yaml").write_text("optim:\n  learning_rate: 1.0e-5\nbata: 0.2\n")
    good = json.dumps(pref_rows[0]).encode()
    (root / "bytes.jsonl").write_bytes(good + b"\n" + b'{"prompt": "caf\xe9", "chosen": " a", "rejected": " b"}\n')
    (root / "bytes.csv").write_bytes(b"prompt,chosen,rejected\nsort 3 1, 1 3, 3 1\nsort \xff 2, 2, 1\n")
    (root / "surrogate.jsonl").write_text(json.dumps(pref_rows[0]) + "\n"
                                          + '{"prompt": "x \\ud83d y", "chosen": " a", "rejected": " b"}\n')
    (root / "deep.jsonl").write_text(json.dumps(pref_rows[0]) + "\n" + "[" * 200_000 + "]" * 200_000 + "\n")
    (root / "malformed.jsonl").write_text(json.dumps(pref_rows[0]) + "\n" + '{"prompt": "x", "chosen": \n')
    # Longer than the tiny llama's context (512 positions) and than any sane max_length.
    (root / "long.jsonl").write_text(json.dumps(pref_rows[0]) + "\n"
                                     + json.dumps({"prompt": "sort " * 600, "chosen": " 1", "rejected": " 2"}) + "\n")
    (root / "a-file").write_text("not a directory\n")
    (root / "files").mkdir()  # data files in a directory, not a saved dataset
    shutil.copy(root / "data.jsonl", root / "files" / "train.jsonl")
    shutil.copy(root / "data.jsonl", root / "files" / "eval.jsonl")
    (root / "empty").mkdir()
    (root / "earlier-run" / "checkpoints").mkdir(parents=True)  # what a run leaves
    (root / "earlier-run" / "run.json").write_text("{}")
    (root / "earlier-run" / "metrics.jsonl").write_text("")
    (root / "shards").mkdir()  # one split's files, read as one data set
    shutil.copy(root / "data.jsonl", root / "shards" / "train-00000-of-00001.jsonl")
    write_jsonl([{"prompt": r["prompt"], "completions": [r["chosen"], r["rejected"]]} for r in pref_rows],
                root / "score.jsonl")  # rows as score reads them
    (root / "broken.parquet").write_bytes(b"PAR1 but nothing else")
    # Weights saved under other names (a PEFT-wrapped model's state dict saved as a full model):
    # transformers would fill every weight at random.
    from safetensors.torch import load_file, save_file

    shutil.copytree(root / "model", root / "renamed-weights")
    weights = root / "renamed-weights" / "model.safetensors"
    save_file({f"base_model.model.{k}": v for k, v in load_file(weights).items()}, weights, metadata={"format": "pt"})
    # A tokenizer grown without resizing the model: the config's vocabulary is smaller than its ids.
    shutil.copytree(root / "model", root / "small-vocab")
    config = json.loads((root / "small-vocab" / "config.json").read_text())
    (root / "small-vocab" / "config.json").write_text(json.dumps({**config, "vocab_size": 8}))
    return root


TRAIN = ("train", "--model", "model", "--data", "data.jsonl", "--dtype", "float32", "--device", "cpu",
         "--cache-dir", "cache", "--output-dir", "run")
BUILD = ("cache", "build", "--model", "model", "--data", "data.jsonl", "--dtype", "float32", "--device", "cpu",
         "--cache-dir", "cache")



def with_data(args: tuple, data: str) -> tuple:
    i = args.index("--data")
    return (*args[:i + 1], data, *args[i + 2:])


# name -> (arguments, what the line must contain)
MODEL_PATH_CASES = {
    "train: nonexistent model": (("train", "--model", "no/such/dir", "--data", "data.jsonl"),
                                 ["--model no/such/dir", "no such directory in the working directory "]),
    "build: nonexistent model": (("cache", "build", "--model", "no/such/dir", "--data", "data.jsonl"),
                                 ["--model no/such/dir", "no such directory"]),
    "train: no weights": (("train", "--model", "no-weights", "--data", "data.jsonl"),
                          ["--model no-weights", "weights"]),
    "build: no weights": (("cache", "build", "--model", "no-weights", "--data", "data.jsonl"),
                          ["no-weights", "weights"]),
    "train: no tokenizer": (("train", "--model", "no-tokenizer", "--data", "data.jsonl"),
                            ["--model no-tokenizer", "no tokenizer"]),
    "verify: no tokenizer": (("cache", "verify", "--model", "no-tokenizer", "--data", "data.jsonl"),
                             ["--model no-tokenizer", "no tokenizer"]),
}

CASES = {
    "train without arguments": (("train",), ["--model", "--data"]),
    "command typo": (("traim", "--model", "model"), ["invalid choice: 'traim'", "did you mean 'train'?"]),
    "cache subcommand typo": (("cache", "biuld"), ["invalid choice: 'biuld'", "did you mean 'build'?"]),
    "no such command": (("zzz",), ["invalid choice: 'zzz'"]),
    "cache build without --data": (("cache", "build", "--model", "model"), ["--data"]),
    "a data file not in the working directory": (("cache", "build", "--model", "model", "--data", "absent.jsonl"),
                                                 ["--data absent.jsonl: no such file or directory in the working "
                                                  "directory "]),
    "config file missing": (("train", "nope.yaml", "--model", "model"), ["nope.yaml"]),
    "unknown flag": ((*TRAIN, "--bogus", "1"), ["unknown flag --bogus (config field 'bogus'); see --help"]),
    "unknown flag, cache build": ((*BUILD, "--bogus", "1"), ["bogus"]),
    "flag typo": ((*TRAIN, "--bata", "0.2"), ["unknown flag --bata (config field 'bata'); did you mean --beta?"]),
    "flag typo, cache build": ((*BUILD, "--max-lenght", "64"),
                               ["unknown flag --max-lenght (config field 'max_lenght'); did you mean --max-length?"]),
    "typo of cache build's own option": ((*BUILD, "--per-tokens"), ["unknown flag --per-tokens; did you mean "
                                                                    "--per-token?"]),
    "typo of cache verify's own option": (("cache", "verify", *BUILD[2:], "--sample", "3"),
                                          ["unknown flag --sample; did you mean --samples?"]),
    "every unknown flag at once": ((*TRAIN, "--bata", "0.2", "--lerning-rate", "1e-5"),
                                   ["did you mean --beta? | unknown flag --lerning-rate; did you mean --lr?"]),
    "TRL's learning_rate": ((*TRAIN, "--learning-rate", "1e-5"),
                            ["unknown flag --learning-rate; did you mean --lr? (TRL's learning_rate is dpocache's "
                             "--lr)"]),
    "TRL's per-device batch size": ((*TRAIN, "--per-device-train-batch-size", "4"),
                                    ["unknown flag --per-device-train-batch-size; did you mean --batch-size? (TRL's "
                                     "per_device_train_batch_size is dpocache's --batch-size: pairs per device per "
                                     "micro-batch, as in TRL)"]),
    "TRL's bf16 switch, cache build": ((*BUILD, "--bf16"), ["unknown flag --bf16; did you mean --dtype bfloat16?"]),
    "TRL's push_to_hub switch": ((*TRAIN, "--push-to-hub"), ["--push-to-hub (train.push_to_hub) takes a Hub repo id",
                                                             "got 'true'", "--push-to-hub REPO"]),
    "YAML typos": (("train", "typo.yaml", *TRAIN[1:]),
                   ["typo.yaml: unknown field 'optim.learning_rate'; did you mean 'optim.lr'? (TRL's learning_rate "
                    "is dpocache's 'optim.lr') | unknown field 'bata'; did you mean 'beta'?"]),
    "YAML typos, cache build": (("cache", "build", "typo.yaml", *BUILD[2:]),
                                ["typo.yaml: unknown field 'optim.learning_rate'", "did you mean 'beta'?"]),
    "score flag typo": (("score", "--model", "model", "--data", "score.jsonl", "--out", "o.jsonl", "--device", "cpu",
                         "--temprature", "0.5"), ["unknown flag --temprature; did you mean --temperature?"]),
    "score: typo of a required flag": (("score", "--modle", "model", "--data", "score.jsonl", "--out", "o.jsonl"),
                                       ["unknown flag --modle; did you mean --model?"]),
    "plot flag typo": (("plot", "run", "--ot", "c.png"), ["dpocache plot: error: unknown flag --ot; did you mean "
                                                          "--out?"]),
    "unknown loss": ((*TRAIN, "--loss", "sigmoidd"), ["--loss", "sigmoidd", "known losses"]),
    "malformed loss spec": ((*TRAIN, "--loss", "sigmoid:abc"), ["--loss", "abc"]),
    "beta 0": ((*TRAIN, "--beta", "0"), ["--beta", "> 0"]),
    "beta negative": ((*TRAIN, "--beta", "-0.1"), ["--beta", "> 0"]),
    "schedule typo": ((*TRAIN, "--optim.schedule", "cosin"), ["optim.schedule", "cosin"]),
    "batch size 0": ((*TRAIN, "--batch-size", "0"), ["--batch-size", ">= 1"]),
    "batch larger than the data": ((*TRAIN, "--batch-size", "64"), ["--batch-size", "48 pairs", "data.jsonl"]),
    "max_prompt_length >= max_length": ((*TRAIN, "--max-length", "32", "--max-prompt-length", "32"),
                                        ["--max-prompt-length", "--max-length"]),
    "max_prompt_length >= max_length, cache build": ((*BUILD, "--max-length", "32", "--max-prompt-length", "40"),
                                                     ["--max-prompt-length", "--max-length"]),
    "dtype typo": ((*TRAIN, "--dtype", "bf16"), ["--dtype", "bf16"]),
    "dtype typo, cache build": ((*BUILD, "--dtype", "fp32"), ["--dtype", "fp32"]),
    "Liger's kernels on a CPU": ((*TRAIN, "--kernels", "liger"), ["--kernels (model.kernels) liger", "CUDA only"]),
    "Liger's kernels on a CPU, cache build": ((*BUILD, "--kernels", "liger"),
                                              ["--kernels (model.kernels) liger", "CUDA only"]),
    "kernels typo": ((*TRAIN, "--kernels", "ligre"), ["--kernels (model.kernels)", "auto, liger, none", "'ligre'"]),
    # Several data files of one split are read as one data set (tests/data/test_data_sources.py); of two, refused.
    "a directory of two splits' files": (with_data(TRAIN, "files"),
                                         ["--data files: holds the splits train, eval; name the one to read with its "
                                          "pattern: 'files/train.jsonl' (train), 'files/eval.jsonl' (eval)"]),
    "a directory of two splits' files as eval data": ((*TRAIN, "--eval-data", "files"),
                                                      ["--eval-data files: holds the splits train, eval"]),
    "an empty directory as eval data": ((*TRAIN, "--eval-data", "empty"),
                                        ["--eval-data empty: no data file (.jsonl, .json, .parquet or .csv) in this "
                                         "directory, nor a data set datasets' save_to_disk wrote"]),
    "a pattern that matches no file": (with_data(BUILD, "nothing-*.jsonl"),
                                       ["--data nothing-*.jsonl: no file matches this pattern"]),
    # Its hint had named the model's config.json as the data file meant.
    "the model directory as data": (with_data(TRAIN, "model"),
                                     ["--data model: a model directory (config.json and weights), not preference "
                                      "data; pass the data's .jsonl, .json, .parquet or .csv file, or a folder of "
                                      "them"]),
    "output dir under a file": ((*TRAIN[:-1], "a-file/run"), ["--output-dir a-file/run"]),
    "output dir that is a file": ((*TRAIN[:-1], "a-file"), ["--output-dir a-file: a file, not a directory"]),
    "cache dir under a file": ((*BUILD[:-1], "a-file/cache"), ["--cache-dir a-file/cache"]),
    "question column": (with_data(BUILD, "question.jsonl"),
                        ["question.jsonl:1: field 'prompt': missing; the row has columns 'question', 'chosen', "
                         "'rejected': pass --data.prompt_field question (or --data.prompt_field none"]),
    "question/good/bad columns": (with_data(TRAIN, "good-bad.jsonl"),
                                  ["good-bad.jsonl:1: fields 'prompt', 'chosen', 'rejected' missing; the row has "
                                   "columns 'question', 'good', 'bad': pass --data.prompt_field question "
                                   "--data.chosen_field good --data.rejected_field bad (guessed from the file's "
                                   "column order: check it, above all that 'good' is the preferred completion)"]),
    "non-UTF-8 byte in .jsonl": (with_data(BUILD, "bytes.jsonl"), ["bytes.jsonl:2", "UTF-8", "0xe9"]),
    "non-UTF-8 byte in .csv": (with_data(BUILD, "bytes.csv"), ["bytes.csv:3", "UTF-8", "0xff"]),
    "lone surrogate escape": (with_data(BUILD, "surrogate.jsonl"), ["surrogate.jsonl:2", "'prompt'", "surrogate"]),
    "JSON nested 200,000 deep": (with_data(BUILD, "deep.jsonl"), ["deep.jsonl:2", "nested"]),
    "malformed JSON": (with_data(TRAIN, "malformed.jsonl"), ["malformed.jsonl:2", "malformed JSON"]),
    "row longer than the context": ((*with_data(BUILD, "long.jsonl"), "--max-length", "none"),
                                    ["long.jsonl:2", "context (512"]),
    "weights under other names": (("cache", "build", "--model", "renamed-weights", *BUILD[4:]),
                                  ["renamed-weights", "do not fit", "missing", "base_model.model."]),
    "weights under other names, train": (("train", "--model", "renamed-weights", *TRAIN[3:]),
                                         ["renamed-weights", "do not fit"]),
    "adam beta1 of 1.5": ((*TRAIN, "--optim.adam_beta1", "1.5"), ["--optim.adam_beta1", "[0, 1)", "1.5"]),
    "adam eps below 0": ((*TRAIN, "--optim.adam_eps", "-1"), ["--optim.adam_eps", "> 0"]),
    "lora dropout of 1.5": ((*TRAIN, "--lora-r", "4", "--lora.dropout", "1.5"), ["--lora.dropout", "[0, 1)"]),
    "lora alpha 0": ((*TRAIN, "--lora-r", "4", "--lora.alpha", "0"), ["--lora.alpha", "> 0"]),
    "negative clipping norm": ((*TRAIN, "--optim.max_grad_norm", "-1"), ["--optim.max_grad_norm", ">= 0"]),
    "keep no checkpoint": ((*TRAIN, "--train.save_total_limit", "0"), ["--train.save_total_limit", ">= 1"]),
    "verify negative samples": (("cache", "verify", *BUILD[2:], "--samples", "-3"), ["--samples", ">= 0"]),
    "loss of weight 0": ((*TRAIN, "--loss", "sigmoid:0"), ["--loss", "weight"]),
    "a LoRA target module that is not one": ((*TRAIN, "--lora-r", "4", "--lora.target_modules", "qproj,v_proj"),
                                             ["--lora.target_modules: no module of the model is named 'qproj' (did "
                                              "you mean 'q_proj'?); its linear layers are"]),
    "cache info of a directory that is not there": (("cache", "info", "--cache-dir", "no-such-cache"),
                                                    ["--cache-dir no-such-cache", "no such directory"]),
    "not a parquet file": (with_data(BUILD, "broken.parquet"), ["broken.parquet", "parquet"]),
    "cache export over its own data": (("cache", "export", "--model", "model", "--data", "data.jsonl", "--out",
                                        "data.jsonl", "--cache-dir", "cache", "--device", "cpu"),
                                       ["--out data.jsonl", "overwrite --data data.jsonl"]),
    "cache export into the model's directory": (("cache", "export", "--model", "model", "--data", "data.jsonl",
                                                 "--out", "model/model.safetensors", "--format", "safetensors",
                                                 "--cache-dir", "cache", "--device", "cpu"),
                                                ["--out model/model.safetensors", "overwrite --model model"]),
    # a new file among the data's files: it would be read as data by the next run (not "overwrite")
    "cache export into the folder of the data's files": (("cache", "export", "--model", "model", "--data", "shards",
                                                          "--out", "shards/ref.jsonl", "--cache-dir", "cache",
                                                          "--device", "cpu"),
                                                         ["--out shards/ref.jsonl: that would write into --data "
                                                          "shards; write somewhere else"]),
    # A datasets export replaces its directory: the folder holding the model and data was removed.
    "cache export --format datasets into the folder of its inputs": (
        ("cache", "export", "--model", "model", "--data", "data.jsonl", "--out", ".", "--format", "datasets",
         "--cache-dir", "cache", "--device", "cpu"),
        ["--out .: a directory that datasets' save_to_disk did not write", "name a new or empty directory"]),
    "score over its own data": (("score", "--model", "model", "--data", "data.jsonl", "--out", "data.jsonl",
                                 "--device", "cpu"), ["--out data.jsonl", "overwrite --data"]),
    "score into a directory": (("score", "--model", "model", "--data", "data.jsonl", "--out", "model",
                                "--device", "cpu"), ["--out model", "overwrite --model"]),
    "score: model without weights": (("score", "--model", "no-weights", "--data", "score.jsonl", "--out", "o.jsonl",
                                      "--device", "cpu"), ["--model no-weights", "no model weights"]),
    "score: text rows, model without a tokenizer": (("score", "--model", "no-tokenizer", "--data", "score.jsonl",
                                                     "--out", "o.jsonl", "--device", "cpu"),
                                                    ["--model no-tokenizer", "no tokenizer"]),
    "score --out under a file": (("score", "--model", "model", "--data", "score.jsonl", "--out", "a-file/o.jsonl",
                                  "--device", "cpu"), ["--out a-file: a file, not a directory"]),
    "score --stats a directory": (("score", "--model", "model", "--data", "score.jsonl", "--out", "o.jsonl",
                                   "--stats", "no-weights", "--device", "cpu"), ["--stats no-weights", "a directory"]),
    "score --cache-dir a file": (("score", "--model", "model", "--data", "score.jsonl", "--out", "o.jsonl",
                                  "--cache-dir", "a-file", "--device", "cpu"),
                                 ["--cache-dir a-file: a file, not a directory; name a directory"]),
    "score on a device that is not one": (("score", "--model", "model", "--data", "score.jsonl", "--out", "o.jsonl",
                                          "--device", "gpu"), ["--device", "'gpu'", "not a device"]),
    "score at temperature 0": (("score", "--model", "model", "--data", "score.jsonl", "--out", "o.jsonl",
                                "--temperature", "0", "--device", "cpu"), ["--temperature", "above 0"]),
    "score in a dtype that is not one": (("score", "--model", "model", "--data", "score.jsonl", "--out", "o.jsonl",
                                          "--dtype", "fp32", "--device", "cpu"),
                                         ["--dtype: must be one of auto, float32, bfloat16, float16; got 'fp32'"]),
    # A run's files beside a model's, another run's or the cache's: each was written, exit 0.
    "train into the model directory": ((*TRAIN[:-1], "model"),
                                       ["--output-dir model: is --model model, where the run's files would mix"]),
    "train into the cache": ((*TRAIN[:-1], "cache/run"), ["--output-dir cache/run: is inside --cache-dir cache"]),
    "train into another model's directory": ((*TRAIN[:-1], "no-tokenizer/run"),
                                             ["--output-dir no-tokenizer/run: inside the model directory",
                                              "name a directory of its own"]),
    "train into another run": ((*TRAIN[:-1], "earlier-run/checkpoints/step-1"),
                               ["--output-dir earlier-run/checkpoints/step-1: inside the run in", "earlier-run"]),
    "token ids beyond the model's vocabulary": (("cache", "build", "--model", "small-vocab", *BUILD[4:]),
                                                ["data.jsonl:1", "outside the model's vocabulary", "vocab_size 8"]),
}


@pytest.mark.parametrize("case", list(MODEL_PATH_CASES))
def test_model_path_mistake_is_one_line_within_seconds(work, case):
    args, fragments = MODEL_PATH_CASES[case]
    line = one_line(dpocache(*args, cwd=work, timeout=MODEL_PATH_BOUND_S))
    assert all(f in line for f in fragments), line


# Runs every case of CASES in one interpreter, one after another, as ``python -m dpocache`` would
# (``cli.main``), capturing file descriptor 2 around each: whatever reaches stderr (Python's, a
# logging handler's, a library's C code), as a process of its own would show it. One interpreter
# pays torch's and transformers' imports once instead of once per case (about 4 s each).
ALL_CASES = """
import contextlib, json, os, sys, tempfile, traceback
from pathlib import Path
from dpocache.cli.entry import main

def run(args):
    try:
        return main(args)
    except SystemExit as e:
        return e.code
    except BaseException:
        traceback.print_exc()
        return "raised"

def shards():
    return len(list(Path("cache").glob("*/shard-*")))

results = {}
for name, args in json.loads(sys.argv[1]).items():
    before = shards()
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as err, open(os.devnull, "w") as null, contextlib.redirect_stdout(null):
        os.dup2(err.fileno(), 2)
        try:
            code = run(args)
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
        err.seek(0)
        stderr = err.read().decode("utf-8", "replace")
    results[name] = {"code": code, "stderr": stderr, "shards_written": shards() - before}
print(json.dumps(results))
"""


@pytest.fixture(scope="module")
def case_results(work) -> dict:
    proc = dpocache(json.dumps({name: list(map(str, args)) for name, (args, _) in CASES.items()}), cwd=work,
                    code=ALL_CASES, timeout=900)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.splitlines()[-1])


@pytest.mark.parametrize("case", list(CASES))
def test_mistake_is_one_line_exit_2_no_traceback(case_results, case):
    result = case_results[case]
    line = one_line(subprocess.CompletedProcess([], result["code"], "", result["stderr"]))
    assert all(f in line for f in CASES[case][1]), line
    assert result["shards_written"] == 0  # nothing was computed


def test_device_cuda_without_cuda(work):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    line = one_line(dpocache(*TRAIN[:-4], "--device", "cuda", cwd=work))
    assert "--device" in line and "cuda" in line, line
    # score read the rows and loaded the model first: torch's AssertionError, a traceback, exit 1.
    line = one_line(dpocache("score", "--model", "model", "--data", "score.jsonl", "--out", "o.jsonl", "--device",
                             "cuda", cwd=work))
    assert "--device cuda" in line and "no CUDA device" in line, line
    assert not (work / "o.jsonl").exists()


@pytest.mark.parametrize("name, value, modes, command", [  # each variable once, both commands between them
    ("DPOCACHE_CPU_ALLOCATOR", "retainn", "retain or default", "build"),
    ("DPOCACHE_BF16_MATMUL", "fp32", "auto or native or fp32-gemm", "score"),
    ("DPOCACHE_CAUSAL_SDPA", "cudnn", "no-cudnn or any", "score"),
])
def test_bad_environment_variable_is_one_line(work, name, value, modes, command):
    """A value outside a variable's choices was a ValueError's traceback, exit 1 (but for
    $DPOCACHE_CAUSAL_SDPA), from every command."""
    args = BUILD if command == "build" else ("score", "--model", "model", "--data", "data.jsonl", "--out", "o.jsonl",
                                             "--device", "cpu")
    proc = subprocess.run([sys.executable, "-m", "dpocache", *args], cwd=work, capture_output=True, text=True,
                          timeout=300, env={**os.environ, **QUIET, name: value})
    line = one_line(proc)
    assert f"${name} must be {modes}; got '{value}'" in line, line
    assert not (work / "o.jsonl").exists()


def test_verbose_anywhere_shows_the_traceback(work):
    """Today ``dpocache -v train --model X`` read X as the YAML file."""
    for args in (("-v", "train", "--model", "no/such/dir"), ("train", "--model", "no/such/dir", "-v"),
                 ("cache", "build", "--verbose", "--model", "no/such/dir")):
        proc = dpocache(*args, cwd=work, timeout=MODEL_PATH_BOUND_S)
        assert proc.returncode == 2
        assert "Traceback" in proc.stderr and "--model no/such/dir" in proc.stderr.splitlines()[-1]


def test_verbose_shows_the_traceback_of_a_score_mistake(work):
    """score handles its own errors: -v was taken out of its arguments before they were parsed,
    so the line came without the traceback."""
    proc = dpocache("score", "-v", "--model", "model", "--data", "data.jsonl", "--out", "o.jsonl", "--device", "cpu",
                    cwd=work)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" in proc.stderr and "data.jsonl:1" in proc.stderr.splitlines()[-1], proc.stderr
    assert not (work / "o.jsonl").exists()


FULL_DISK = """
import errno, os, sys
def fail(fd):
    raise OSError(errno.{name}, os.strerror(errno.{name}))
os.fsync = fail  # every durable write in dpocache ends in an fsync
from dpocache.cli.entry import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.parametrize("name", ["ENOSPC", "EROFS"])
@pytest.mark.parametrize("command", ["build", "train"])
def test_full_or_read_only_disk_is_one_line(work, tmp_path, command, name):
    args = BUILD if command == "build" else (*TRAIN, "--max-steps", "1")
    args = [str(tmp_path / a) if prev in ("--cache-dir", "--output-dir") else a for prev, a in zip(("",) + args, args)]
    line = one_line(dpocache(*args, cwd=work, code=FULL_DISK.format(name=name)))
    assert "cannot write to" in line and os.strerror(getattr(__import__("errno"), name)) in line, line
    assert str(tmp_path / "cache") in line


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only directories")
def test_read_only_output_dir(work, tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        line = one_line(dpocache(*TRAIN[:-1], ro / "run", cwd=work))
    finally:
        ro.chmod(0o755)
    assert "--output-dir" in line


def _read_only_mounts() -> bool:
    """Whether this machine lets a user namespace bind-mount a directory read-only (what a team's
    cache shared read-only is), without root."""
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(["unshare", "-rm", "true"], capture_output=True)
    return probe.returncode == 0


def _on_read_only(directory: Path, *args, cwd: Path) -> subprocess.CompletedProcess:
    """``python -m dpocache ARGS`` with ``directory`` mounted read-only over itself."""
    command = " ".join(shlex.quote(str(a)) for a in (sys.executable, "-m", "dpocache", *args))
    script = f'mount --bind "$0" "$0" && mount -o remount,bind,ro "$0" && exec {command}'
    return subprocess.run(["unshare", "-rm", "bash", "-c", script, str(directory)], cwd=cwd, capture_output=True,
                          text=True, timeout=300, env={**os.environ, **QUIET})


def _built_cache(work: Path, tmp_path: Path, leave_out: int = 0) -> tuple[list[str], Path, tuple]:
    """(the data's rows, a cache built of all of them but the last ``leave_out`` (``most.jsonl``),
    the options naming the model and that cache)."""
    rows = (work / "data.jsonl").read_text().splitlines()
    (tmp_path / "most.jsonl").write_text("\n".join(rows[:len(rows) - leave_out]) + "\n")
    cache = tmp_path / "cache"
    common = ("--model", work / "model", "--dtype", "float32", "--device", "cpu", "--cache-dir", cache)
    built = dpocache("cache", "build", "--data", tmp_path / "most.jsonl", *common, cwd=tmp_path)
    assert built.returncode == 0, built.stderr
    return rows, cache, common


@pytest.mark.skipif(not _read_only_mounts(), reason="no user namespaces to mount a directory read-only")
def test_a_read_only_cache_is_read_and_its_missing_pairs_are_one_line(work, tmp_path):
    """A team's cache mounted read-only: training on pairs it holds reads it (it was refused:
    "--cache-dir ...: cannot write there"); pairs it lacks are one line before the model loads,
    from train and cache build alike."""
    rows, cache, common = _built_cache(work, tmp_path, leave_out=3)
    ran = _on_read_only(cache, "train", "--data", tmp_path / "most.jsonl", *common, "--output-dir", tmp_path / "run",
                        "--max-steps", "1", cwd=tmp_path)
    assert ran.returncode == 0 and f"(0 computed, {len(rows) - 3} reused)" in ran.stdout, ran.stderr
    for command in (("train", "--output-dir", tmp_path / "run2"), ("cache", "build")):
        proc = _on_read_only(cache, *command, "--data", work / "data.jsonl", *common, cwd=tmp_path)
        line = [x for x in proc.stderr.splitlines() if x.strip() and not x.startswith("tokens: ")]
        assert proc.returncode == 2 and "Traceback" not in proc.stderr and len(line) == 1, proc.stderr
        assert line[0].endswith(f"--cache-dir {cache}: cannot write there (Read-only file system), and 3 of the "
                                f"{len(rows)} pairs are not in it; build them into a cache that can be written, one "
                                f"that links every value already there: cp -rs {cache} DIR, then dpocache cache "
                                "build --cache-dir DIR and read from that one"), line[0]
    # as it says: a tree of links to the team's values, the 3 pairs computed into it, the team's cache as it was
    subprocess.run(["cp", "-rs", str(cache), str(tmp_path / "mine")], check=True)
    mine = [a if a != cache else tmp_path / "mine" for a in common]
    built = _on_read_only(cache, "cache", "build", "--data", work / "data.jsonl", *mine, cwd=tmp_path)
    assert built.returncode == 0 and f"computed 3, reused {len(rows) - 3}" in built.stdout, built.stderr


@pytest.mark.parametrize("command", [("train", "--help"), ("cache", "export", "--help")])
def test_help_into_a_closed_pipe_ends_quietly(tmp_path, command):
    """``dpocache train --help | head -1``: a reader gone before the help is written ended in a
    BrokenPipeError traceback and exit 1; now nothing on stderr and 141 (128 + SIGPIPE), as a
    shell reports for other commands a closed pipe stopped."""
    read, write = os.pipe()
    os.close(read)  # the reader is gone before the command writes
    try:
        proc = subprocess.run([sys.executable, "-m", "dpocache", *command], stdout=write, stderr=subprocess.PIPE,
                              text=True, timeout=120, cwd=tmp_path)
    finally:
        os.close(write)
    assert (proc.returncode, proc.stderr) == (141, "")


@pytest.mark.skipif(not _read_only_mounts(), reason="no user namespaces to mount a directory read-only")
def test_a_read_only_cache_with_a_killed_builds_leftovers_is_read_as_it_is(work, tmp_path):
    """A team's cache mounted read-only, a killed build's leftovers in it (a stale temp file, an
    empty shard, the manifest lost): training on pairs its sound shards hold reads them and
    changes nothing (each leftover made it stop with "cannot write to ...")."""
    rows, cache, common = _built_cache(work, tmp_path)
    namespace = next(d for d in cache.iterdir() if (d / "manifest.json").exists())
    stale = namespace / ".shard-0123456789abcdef.safetensors.0123456789ab.tmp"
    stale.write_bytes(b"half a shard")
    os.utime(stale, (time.time() - 7200, time.time() - 7200))
    (namespace / "shard-00000000000000aa.safetensors").write_bytes(b"")
    (namespace / "manifest.json").write_text('{"shards": ')  # cut short
    before = sorted((p.name, p.stat().st_size) for p in namespace.iterdir())
    ran = _on_read_only(cache, "train", "--data", work / "data.jsonl", *common, "--output-dir", tmp_path / "run",
                        "--max-steps", "1", cwd=tmp_path)
    assert ran.returncode == 0 and f"(0 computed, {len(rows)} reused)" in ran.stdout, ran.stderr
    built = _on_read_only(cache, "cache", "build", "--data", work / "data.jsonl", *common, cwd=tmp_path)
    assert built.returncode == 0 and f"computed 0, reused {len(rows)}" in built.stdout, built.stderr
    for said in (ran.stderr, built.stderr):  # what was left, said as left: nothing rebuilt, recomputed or moved
        bad = next(line for line in said.splitlines() if "shard-00000000000000aa.safetensors" in line)
        assert bad.endswith("; not loaded (left as it is: the cache cannot be written here)"), said
        assert "the next cache build or train rebuilds it" in said, said
        assert "recomputing" not in said and "rebuilt from the shards" not in said, said
    assert sorted((p.name, p.stat().st_size) for p in namespace.iterdir()) == before


@pytest.mark.skipif(not _read_only_mounts(), reason="no user namespaces to mount a directory read-only")
def test_a_colleagues_read_only_directories_inside_a_writable_cache(work, tmp_path):
    """The cache's top directory writable, its tokens/ or a namespace directory not (made by a
    colleague): the data is tokenized in memory (a token store is a convenience), and pairs a
    read-only namespace lacks are one line naming that directory (each was a "cannot write to
    .../tokens/.<key>.lock" or a failed shard write)."""
    rows, cache, common = _built_cache(work, tmp_path, leave_out=3)
    done = _on_read_only(cache / "tokens", "cache", "build", "--data", work / "data.jsonl", *common, cwd=tmp_path)
    assert done.returncode == 0 and "the data is tokenized in memory" in done.stderr, done.stderr
    assert "computed 3, reused" in done.stdout, done.stdout
    (tmp_path / "more.jsonl").write_text(rows[0].replace('"prompt": "', '"prompt": "new ') + "\n")
    namespace = next(d for d in cache.iterdir() if (d / "manifest.json").exists())
    proc = _on_read_only(namespace, "cache", "build", "--data", tmp_path / "more.jsonl", *common, cwd=tmp_path)
    line = [x for x in proc.stderr.splitlines() if x.strip() and not x.startswith("tokens: ")]
    assert proc.returncode == 2 and len(line) == 1, proc.stderr
    assert f"cannot write to its namespace directory {namespace.name} (Read-only file system), and 1 of the 1 " \
        "pairs are not in it" in line[0], line[0]
