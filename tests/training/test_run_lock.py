"""One run per output directory: two runs started together into one directory (a job array or a
retried job reusing a run name) never both write there; one runs, the other stops at once with
one line, and metrics.jsonl holds each step once. A killed run leaves no stale lock."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from train_fixtures import base_model, flags, one_thread, train_jsonl  # noqa: F401 - fixtures

from dpocache.runtime.preflight import UsageError
from dpocache.runtime.run_lock import LOCK_FILE, check_output_dir_free, hold_output_dir


def test_a_held_directory_is_refused_naming_the_holder_and_freed_on_release(tmp_path):
    first = hold_output_dir(tmp_path / "run")
    with pytest.raises(UsageError, match=rf"--output-dir .*run: another dpocache run \(pid {os.getpid()}\)"):
        hold_output_dir(tmp_path / "run")
    first.release()
    hold_output_dir(tmp_path / "run").release()


def test_the_early_check_refuses_a_held_directory_and_holds_nothing(tmp_path):
    """The command line's check before its slow imports: refused while a run holds the
    directory, silent otherwise, and never in the way of the run's own hold."""
    check_output_dir_free(tmp_path / "never-used")  # no lock file: nothing to ask
    held = hold_output_dir(tmp_path / "run")
    with pytest.raises(UsageError, match=rf"another dpocache run \(pid {os.getpid()}\)"):
        check_output_dir_free(tmp_path / "run")
    held.release()
    check_output_dir_free(tmp_path / "run")
    hold_output_dir(tmp_path / "run").release()  # the check left no lock behind


def test_a_killed_holder_leaves_no_stale_lock(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time\n"
                               "from dpocache.runtime.run_lock import hold_output_dir\n"
                               f"hold_output_dir({str(tmp_path)!r}); print('held', flush=True); time.sleep(60)"],
                              stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    with pytest.raises(UsageError, match=rf"pid {holder.pid}"):
        hold_output_dir(tmp_path)
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    hold_output_dir(tmp_path).release()
    assert (tmp_path / LOCK_FILE).read_text().strip() == str(os.getpid())


def _together(args_a: list[str], args_b: list[str]) -> list[subprocess.CompletedProcess]:
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    procs = [subprocess.Popen([sys.executable, "-m", "dpocache", "train", *a], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for a in (args_a, args_b)]
    return [subprocess.CompletedProcess(p.args, p.wait(timeout=300), *p.communicate()) for p in procs]


def _one_ran_one_refused(procs: list[subprocess.CompletedProcess]) -> None:
    codes = sorted(p.returncode for p in procs)
    assert codes == [0, 2], [(p.returncode, p.stderr[-2000:]) for p in procs]
    refused = next(p for p in procs if p.returncode == 2)
    assert "Traceback" not in refused.stderr
    last = refused.stderr.strip().splitlines()[-1]
    # Started a little after the first ended, the second finds its outputs instead: refused too.
    assert "another dpocache run (pid" in last or "holds an earlier run" in last, last


def _steps(out) -> list[int]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r["step"] for r in rows if "loss" in r and "eval/loss" not in r]


# Each attempt is a fresh race of two processes; two of each kind keep the test near 40 s on two
# cores (four took 81-102 s in full suite runs), inside CI's 15 minutes, and every CI run
# races them again.
RACES = 2


@pytest.mark.slow
def test_two_runs_started_together_into_one_directory(tmp_path, base_model, train_jsonl):
    cache = tmp_path / "cache"
    assert subprocess.run([sys.executable, "-m", "dpocache", "train",
                           *flags(base_model, train_jsonl, tmp_path / "warm", cache, "--max-steps", "1")],
                          capture_output=True).returncode == 0  # the reference values, cached once
    for attempt in range(RACES):
        out = tmp_path / f"run{attempt}"
        started = time.monotonic()
        _one_ran_one_refused(_together(flags(base_model, train_jsonl, out, cache, "--max-steps", "2", "--lr", "1e-3"),
                                       flags(base_model, train_jsonl, out, cache, "--max-steps", "2", "--lr", "3e-3")))
        assert _steps(out) == [1, 2], attempt
        assert time.monotonic() - started < 300
    for attempt in range(RACES):  # two --resume at once of a run that ended at step 2: steps 3 and 4 once
        out = tmp_path / f"run{attempt}"
        lr = json.loads((out / "run.json").read_text())["config"]["optim"]["lr"]  # the run that won
        resume = flags(base_model, train_jsonl, out, cache, "--max-steps", "4", "--lr", str(lr), "--resume")
        procs = _together(resume, resume)
        codes = sorted(p.returncode for p in procs)
        assert codes in ([0, 0], [0, 2]), [(p.returncode, p.stderr[-2000:]) for p in procs]
        if codes == [0, 2]:
            assert "another dpocache run (pid" in next(p for p in procs if p.returncode == 2).stderr
        assert _steps(out) == [1, 2, 3, 4], attempt
