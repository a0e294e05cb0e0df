"""Fixtures and helpers shared by the training tests (test_train, test_checkpoint_resume,
test_config, test_demo). Imported explicitly by those modules, not through conftest.py.

Everything is built offline: a tiny Llama saved with ``save_pretrained`` and the demo's sorting
task as JSON lines. A fixture imported into several modules is registered once per module, so
the expensive values are memoised here and built once per test session.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

TRAIN_PAIRS = 24  # batch 4 → 6 steps per epoch, so an 8-step run crosses an epoch boundary
RESUME_STEPS = 8  # interrupted_then_resumed: 6 steps per epoch, the resumed half crosses into the second epoch
EVAL_PAIRS = 8
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"

_BUILT: dict[str, Path] = {}


def _once(name: str, build) -> Path:
    if name not in _BUILT:
        _BUILT[name] = build()
    return _BUILT[name]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Run the tiny models on one intra-op thread (restored afterwards). Their matmuls are far
    too small to split, and on a busy 2-core CI machine OpenMP's spin-waiting threads made
    these runs 3-10x slower than one thread does."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def base_model(tmp_path_factory) -> Path:
    """A tiny Llama and its tokenizer, saved as a Hugging Face model directory."""
    from dpocache.models.tiny import save_tiny_model

    return _once("base_model", lambda: save_tiny_model(tmp_path_factory.mktemp("train-base-model"), "llama"))


def _rows_file(tmp_path_factory, name: str, n: int, seed: int) -> Path:
    from dpocache.data.rows import write_jsonl
    from dpocache.training.demo import sorting_pairs

    return _once(name, lambda: write_jsonl(sorting_pairs(n, seed),
                                           tmp_path_factory.mktemp("train-data") / f"{name}.jsonl"))


@pytest.fixture(scope="session")
def train_jsonl(tmp_path_factory) -> Path:
    return _rows_file(tmp_path_factory, "train", TRAIN_PAIRS, seed=1)


@pytest.fixture(scope="session")
def eval_jsonl(tmp_path_factory) -> Path:
    return _rows_file(tmp_path_factory, "eval", EVAL_PAIRS, seed=2)


def flags(model: Path, data: Path, out: Path, cache: Path, *extra: str) -> list[str]:
    """Command-line overrides for a small, deterministic fp32 CPU run; ``extra`` wins (later
    flags override earlier ones)."""
    return [
        "--model", str(model), "--data", str(data), "--output-dir", str(out), "--cache-dir", str(cache),
        "--train.progress", "false", "--dtype", "float32", "--device", "cpu", "--max-length", "64",
        "--batch-size", "4", "--logging-steps", "1", "--lr", "1e-3", "--optim.warmup_ratio", "0",
        *extra,
    ]


def run_training(*args: str) -> dict:
    """``build_config(None, args)`` then ``train``; returns the run summary."""
    from dpocache.config import build_config
    from dpocache.training.loop import train

    return train(build_config(None, list(args)))


def records(out: Path) -> list[dict]:
    from dpocache.training.metrics import read_metrics

    return read_metrics(out)


def train_records(out: Path) -> list[dict]:
    return [r for r in records(out) if "loss" in r]


def eval_records(out: Path) -> list[dict]:
    return [r for r in records(out) if any(k.startswith("eval/") for k in r)]


def run_json(out: Path) -> dict:
    return json.loads((Path(out) / "run.json").read_text())


def load_tensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path))


def max_abs_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys(), (sorted(a)[:5], sorted(b)[:5])
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


def namespace_dirs(cache: Path) -> list[Path]:
    """Namespace directories under a cache root (anything but the fingerprint memo and the token stores)."""
    if not cache.exists():
        return []
    return [p for p in cache.iterdir() if p.is_dir() and p.name != "tokens"]


def interrupted_then_resumed(tmp_path: Path, base_model: Path, train_jsonl: Path, cache: Path,
                             *extra: str) -> tuple[Path, Path]:
    """Uninterrupted run A of ``RESUME_STEPS`` steps; run B "killed" after its step-4 checkpoint
    (everything later deleted), then continued with --resume. Returns (A's dir, B's dir).

    B's first attempt would be the same deterministic run as A, so B starts as a copy of A's
    directory (half the test's time); B's steps 5..8 all come from the resumed run."""
    from dpocache.models.checkpoint import STATE_FILE, latest_checkpoint
    from dpocache.training import metrics

    common = ("--max-steps", str(RESUME_STEPS), "--save-steps", "4", *extra)
    a, b = tmp_path / "a", tmp_path / "b"
    # Each run is a process of its own in real use: none inherits the matmul peak another
    # measured (the measurement once shifted a resumed run's dropout masks).
    metrics._PEAK_CACHE.clear()
    run_training(*flags(base_model, train_jsonl, a, cache, *common))
    shutil.copytree(a, b)

    ckpts = sorted(p.name for p in (b / "checkpoints").iterdir())
    assert ckpts == ["step-000004", "step-000008"]
    shutil.rmtree(b / "checkpoints" / "step-000008")
    shutil.rmtree(b / "final")
    assert latest_checkpoint(b).name == "step-000004"
    assert json.loads((b / "checkpoints" / "step-000004" / STATE_FILE).read_text())["step"] == 4

    metrics._PEAK_CACHE.clear()
    run_training(*flags(base_model, train_jsonl, b, cache, *common, "--resume"))
    return a, b
