"""``bench/bench_vs_trl.py --merge``: one table over the repetitions of runs split across calls
(a lent GPU machine runs at most 10 minutes a call), checked on committed CPU results."""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))

import bench_vs_trl  # noqa: E402

RUN_A = BENCH / "results" / "58m-float32-20261123-032138.json"
RUN_B = BENCH / "results" / "58m-float32-20261123-072321.json"
OTHER_CONFIG = BENCH / "results" / "long-prompt-float32-20261123-030025.json"


def test_merge_takes_every_repetition_and_the_highest_peak(tmp_path):
    merged = bench_vs_trl.merge_results([RUN_A, RUN_B])
    a, b = (json.loads(p.read_text()) for p in (RUN_A, RUN_B))
    assert len(merged["reps"]) == len(a["reps"]) + len(b["reps"]) == 6
    assert merged["merged_from"] == [RUN_A.name, RUN_B.name]
    for name in a["peaks"]:
        assert merged["peaks"][name] == max(a["peaks"][name], b["peaks"][name])
    # The table's cache row is the median over all six repetitions, computed here from the raw figures.
    dpo = statistics.median(r["dpo_build"]["tokens_per_s"] for r in a["reps"] + b["reps"])
    trl = statistics.median(r["trl_precompute"]["tokens_per_s"] for r in a["reps"] + b["reps"])
    row = next(line for line in merged["markdown"].splitlines() if line.startswith("| cache tokens/s"))
    assert row == f"| cache tokens/s (prompt once) | {trl:,.0f} | {dpo:,.0f} | {dpo / trl:.2f}x |"
    assert "medians of 6" in merged["markdown"]

    assert bench_vs_trl.main(["--merge", str(RUN_A), str(RUN_B), "--out", str(tmp_path)]) == 0
    (written,) = tmp_path.glob("58m-float32-*-merged.json")
    assert len(json.loads(written.read_text())["reps"]) == 6


def test_merge_refuses_results_of_different_runs(tmp_path, capsys):
    with pytest.raises(ValueError, match="config 'long-prompt', not '58m'"):
        bench_vs_trl.merge_results([RUN_A, OTHER_CONFIG])
    changed = json.loads(RUN_B.read_text())
    changed["args"]["train_args"] = ["--compile", "on"]
    (tmp_path / "b.json").write_text(json.dumps(changed))
    assert bench_vs_trl.main(["--merge", str(RUN_A), str(tmp_path / "b.json"), "--out", str(tmp_path)]) == 2
    assert "--train-args ['--compile', 'on'], not []" in capsys.readouterr().err
    assert not list(tmp_path.glob("*-merged.json"))
    assert bench_vs_trl.main(["--merge", str(RUN_A), str(tmp_path / "missing.json"), "--out", str(tmp_path)]) == 2
    assert "missing.json: not a readable result" in capsys.readouterr().err
