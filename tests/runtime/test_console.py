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


def test_a_figure_that_rounds_to_zero_has_no_sign():
    """The demo's step-0 margin (the policy is the reference: a hair below 0) read -0.000."""
    from dpocache.runtime.console import three_places

    assert [three_places(x) for x in (-1e-9, -0.0004, 0.0, -0.0005001, 2.2469, float("nan"))] == \
        ["0.000", "0.000", "0.000", "-0.001", "2.247", "nan"]
