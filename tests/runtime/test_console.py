"""A quiet console: a command prints dpocache's own lines and bars, not transformers' or the Hub's
("Loading weights" when the reference loads); ``-v`` shows them again."""

from __future__ import annotations

import os
import subprocess
import sys

from train_fixtures import base_model, train_jsonl  # noqa: F401 - fixtures


def _build(tmp_path, base_model, train_jsonl, *verbose: str) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_DISABLE_PROGRESS_BARS", "TRANSFORMERS_VERBOSITY")}
    proc = subprocess.run([sys.executable, "-m", "dpocache", *verbose, "cache", "build", "--model", str(base_model),
                           "--data", str(train_jsonl), "--cache-dir", str(tmp_path / f"cache{len(verbose)}")],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return proc.stderr


def test_library_bars_only_with_verbose(tmp_path, base_model, train_jsonl):
    quiet = _build(tmp_path, base_model, train_jsonl)
    assert "reference log-probs" in quiet  # dpocache's own bar stays
    assert "Loading weights" not in quiet and "Warning" not in quiet, quiet
    assert "Loading weights" in _build(tmp_path, base_model, train_jsonl, "-v")  # the library's bar, shown with -v
