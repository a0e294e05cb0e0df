"""The embedded demo: a tiny Llama learns to prefer sorted lists, offline, end to end."""

from __future__ import annotations

import pytest
from train_fixtures import PNG_MAGIC, one_thread, run_json  # noqa: F401  (one_thread is autouse)


@pytest.mark.slow
def test_demo_learns_the_sorting_preference(tmp_path, capsys):
    from dpocache.training.demo import run_demo

    result = run_demo(tmp_path / "demo", ["--train.progress", "false"])
    print(f"\ndemo: accuracy {result['accuracy_before']:.3f} -> {result['accuracy_after']:.3f}, "
          f"margin {result['margin_before']:.3f} -> {result['margin_after']:.3f}, {result['seconds']:.0f} s")
    assert 0.3 <= result["accuracy_before"] <= 0.7  # the initial policy is the reference: chance
    assert result["accuracy_after"] >= 0.9
    assert result["margin_after"] > result["margin_before"]

    ref = result["reference"]
    assert ref["source"] == "cache"
    assert ref["computed"] == ref["pairs"] and ref["reused"] == 0  # a fresh cache, built once
    assert ref["forward_passes_during_training"] == 0
    run_dir = tmp_path / "demo" / "run"
    assert run_json(run_dir)["final"]["step"] > 0
    assert (run_dir / "final" / "model.safetensors").exists()
    with open(result["plot"], "rb") as f:
        assert f.read(8) == PNG_MAGIC
    out = capsys.readouterr().out
    assert "reward accuracy" in out and "reference forward passes during training" in out
