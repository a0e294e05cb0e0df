"""Every example in examples/ runs to the end with its defaults (only its output folder moved into
the test's), as a user runs it after reading its docstring."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.mark.slow
def test_every_example_is_covered():
    # trl_grpo.py's test is tests/integrations/test_trl_grpo.py (it needs TRL, skipped without it)
    assert sorted(p.name for p in EXAMPLES.glob("*.py")) == ["dpo_loop.py", "grpo_kl.py", "trl_grpo.py"], \
        "a new example needs a test"


@pytest.mark.slow
def test_grpo_example_with_its_defaults_kl_starts_at_zero_and_rises(tmp_path):
    """examples/grpo_kl.py: the policy starts as the reference (KL 0 within float rounding) and
    moves away from it; the reference's prompt sharing is reported."""
    done = subprocess.run([sys.executable, str(EXAMPLES / "grpo_kl.py"), "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=900, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    kl = [float(line.split()[2]) for line in lines if line.split() and line.split()[0].isdigit()]  # step reward kl
    assert len(kl) == 20 and kl[0] < 1e-5 and max(kl[1:]) > 1e-4
    assert "prompt tokens saved by sharing" in lines[-1]


@pytest.mark.slow
def test_own_loop_example_starts_at_ln2_learns_and_reuses_the_cache(tmp_path):
    """examples/dpo_loop.py: the policy starts as the reference (the first loss is ln 2), the loss
    falls, and a second run reads every reference value from the cache."""
    def run(*extra):
        done = subprocess.run([sys.executable, str(EXAMPLES / "dpo_loop.py"), "--out", str(tmp_path), *extra],
                              capture_output=True, text=True, timeout=900, cwd=tmp_path)
        assert done.returncode == 0, done.stderr[-2000:]
        return done.stdout.splitlines()

    lines = run()
    assert lines[0] == f"reference: 400 pairs computed, 0 reused from {tmp_path / 'cache'}"
    losses = [float(line.split()[1]) for line in lines if line.split() and line.split()[0].isdigit()]
    assert abs(losses[0] - math.log(2)) < 1e-4 and losses[-1] < 0.5, losses  # printed to 4 places
    assert run("--steps", "1")[0] == f"reference: 0 pairs computed, 400 reused from {tmp_path / 'cache'}"
