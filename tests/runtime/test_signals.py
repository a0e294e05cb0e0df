"""No signal loses work: SIGTERM and SIGINT stop ``cache build`` and ``train`` at a safe point
after saving what was computed (exit 143 / 130, one line); default runs save on a time interval;
a resumed run's history holds each row once.

The signals are sent deterministically: a small driver script runs ``dpocache`` in a
subprocess with a hook that makes the process signal itself once the build's progress passes a
fraction, or right after a given optimizer step. No test depends on timing.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
from train_fixtures import (  # noqa: F401  (fixtures are used by name; one_thread is autouse)
    base_model, eval_jsonl, flags, load_tensors, max_abs_diff, one_thread, records, run_json, run_training,
    train_jsonl, train_records,
)

from dpocache.cache import CacheStore, namespace_for_dir
from dpocache.cli.entry import main
from dpocache.data.rows import write_jsonl
from dpocache.models.checkpoint import STATE_FILE, checkpoints, latest_checkpoint, save_checkpoint
from dpocache.runtime.signals import Interrupted, stop_signals
from dpocache.training.metrics import MetricsWriter, read_metrics

# The process signals itself once the cache build's progress bar passes SIGNAL_AT_FRACTION of
# its pairs (on rank SIGNAL_RANK under torchrun), after writing how many pairs it had scored.
SIGNAL_AT_PROGRESS = r"""
import os, signal, sys
import dpocache.cache.build as build
from dpocache.cli.entry import main

class SignalAtProgress(build.tqdm):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.todo, self.seen, self.sent = kwargs["total"], 0, False

    def update(self, n=1):
        super().update(n)
        self.seen += n
        mine = os.environ.get("RANK", "0") == os.environ.get("SIGNAL_RANK", "0")
        if mine and not self.sent and self.seen > float(os.environ["SIGNAL_AT_FRACTION"]) * self.todo:
            self.sent = True
            with open(os.environ["SIGNAL_REPORT"], "w") as f:
                f.write(str(self.seen))
            os.kill(os.getpid(), getattr(signal, os.environ["SIGNAL_NAME"]))

build.tqdm = SignalAtProgress
raise SystemExit(main(sys.argv[1:]))
"""

# The process sends itself SIGNAL_NAME (default SIGTERM) right after optimizer step SIGNAL_AFTER_STEP
# (on rank SIGNAL_RANK).
SIGNAL_AFTER_STEP = r"""
import os, signal, sys
import dpocache.training.loop as train
from dpocache.cli.entry import main

one_step = train.train_step

def step_then_signal(run, window):
    one_step(run, window)
    mine = os.environ.get("RANK", "0") == os.environ.get("SIGNAL_RANK", "0")
    if mine and run.step == int(os.environ["SIGNAL_AFTER_STEP"]):
        os.kill(os.getpid(), getattr(signal, os.environ.get("SIGNAL_NAME", "SIGTERM")))

train.train_step = step_then_signal
raise SystemExit(main(sys.argv[1:]))
"""


# The process sends itself SIGTERM from inside an eval: after the first eval batch at optimizer
# step SIGNAL_IN_EVAL_STEP (on rank SIGNAL_RANK).
SIGNAL_IN_EVAL = r"""
import os, signal, sys
import dpocache.training.loop as train
from dpocache.cli.entry import main

one_batch = train.batch_losses

def batch_then_signal(run, *args, prefix="", **kwargs):
    out = one_batch(run, *args, prefix=prefix, **kwargs)
    mine = os.environ.get("RANK", "0") == os.environ.get("SIGNAL_RANK", "0")
    if mine and prefix == "eval/" and run.step == int(os.environ["SIGNAL_IN_EVAL_STEP"]):
        os.kill(os.getpid(), signal.SIGTERM)
    return out

train.batch_losses = batch_then_signal
raise SystemExit(main(sys.argv[1:]))
"""


def signalled(script: str, args: list, **env: str) -> subprocess.CompletedProcess:
    """``dpocache ARGS`` in a subprocess driven by ``script``; the hook's settings in ``env``."""
    full_env = dict(os.environ, HF_HUB_OFFLINE="1", **env)
    return subprocess.run([sys.executable, "-c", script, *map(str, args)], env=full_env, capture_output=True,
                          text=True, timeout=300)


def assert_one_line_stop(proc: subprocess.CompletedProcess, signame: str) -> str:
    """Exit 128 + signum; stderr ends with one ``dpocache: stopped by SIG...`` line, no traceback."""
    assert proc.returncode == 128 + getattr(signal, signame), (proc.returncode, proc.stderr[-3000:])
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(f"dpocache: stopped by {signame}: "), proc.stderr[-3000:]
    return last


# ------------------------------------------------------------------------------ signals.py


def test_stop_signals_defers_raises_and_restores_handlers():
    def mine(signum, frame):
        raise AssertionError("the handler inside the block must be the block's")

    before, before_int = signal.signal(signal.SIGTERM, mine), signal.getsignal(signal.SIGINT)
    try:
        with pytest.raises(Interrupted) as caught:
            with stop_signals() as stop:
                with stop.deferred():
                    os.kill(os.getpid(), signal.SIGTERM)
                    os.kill(os.getpid(), signal.SIGINT)  # a second signal does not escalate
                    assert stop.signum == signal.SIGTERM  # recorded, nothing raised yet
                # Acted on by nobody inside the block: raised on leaving it.
        assert caught.value.exit_code == 143
        assert str(caught.value) == ("stopped by SIGTERM: nothing computed was lost; run the same command again to "
                                     "go on")
        assert signal.getsignal(signal.SIGTERM) is mine

        with pytest.raises(Interrupted) as caught:
            with stop_signals():
                os.kill(os.getpid(), signal.SIGINT)  # outside a deferred block: at once
                raise AssertionError("not reached")
        assert caught.value.exit_code == 130 and str(caught.value).startswith("stopped by SIGINT: nothing computed")
        assert signal.getsignal(signal.SIGINT) is before_int
    finally:
        signal.signal(signal.SIGTERM, before)


# ------------------------------------------------------------------------------ cache build


def _cache_args(model_dir, data, cache, *extra):
    return [str(a) for a in ("cache", "build", "--model", model_dir, "--data", data, "--cache-dir", cache, "--dtype",
                             "float32", "--device", "cpu", *extra)]


def _stored_pairs(model_dir, cache) -> tuple[int, dict]:
    import torch

    store = CacheStore(cache, namespace_for_dir(model_dir, torch.float32, cache)).open()
    assert store.corrupt == []
    return len(store), json.loads((store.dir / "manifest.json").read_text())


def test_sigterm_then_sigint_during_build_keep_every_computed_pair(tmp_path, model_dir, make_rows, capsys):
    """SIGTERM once progress passes 30%, then SIGINT once the next build passes 60%: each exits
    with one line and 143 / 130, the manifest lists what it computed, and the final build
    reuses every pair computed before the signals (values equal to an uninterrupted build's)."""
    n = 40
    data = write_jsonl(make_rows(n, seed=5), tmp_path / "rows.jsonl")
    cache, report = tmp_path / "cache", tmp_path / "seen"
    # One pair per forward: every value is computed alone in every build (bit-for-bit comparable).
    args = _cache_args(model_dir, data, cache, "--max-tokens", "1")

    first = signalled(SIGNAL_AT_PROGRESS, args, SIGNAL_AT_FRACTION="0.3", SIGNAL_NAME="SIGTERM",
                      SIGNAL_REPORT=str(report))
    line = assert_one_line_stop(first, "SIGTERM")
    seen1 = int(report.read_text())
    assert seen1 == 13 and f"{seen1} of the {n} pairs" in line
    assert "run the same command again" in line  # train's reference pass says this too: not "the build"
    stored, manifest = _stored_pairs(model_dir, cache)
    assert stored == manifest["pairs"] == seen1

    second = signalled(SIGNAL_AT_PROGRESS, args, SIGNAL_AT_FRACTION="0.6", SIGNAL_NAME="SIGINT",
                       SIGNAL_REPORT=str(report))
    assert_one_line_stop(second, "SIGINT")
    seen2 = int(report.read_text())
    assert seen2 == 17  # 60% of the 27 the cache still lacked
    stored, manifest = _stored_pairs(model_dir, cache)
    assert stored == manifest["pairs"] == seen1 + seen2

    assert main([*args, "--json"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert (summary["reused"], summary["computed"]) == (seen1 + seen2, n - seen1 - seen2)

    fresh = tmp_path / "fresh"
    assert main(_cache_args(model_dir, data, fresh, "--max-tokens", "1")) == 0
    exports = []
    for c in (cache, fresh):
        out = tmp_path / f"{c.name}.jsonl"
        assert main(["cache", "export", *_cache_args(model_dir, data, c)[2:], "--out", str(out)]) == 0
        exports.append(out.read_text())
    assert exports[0] == exports[1]


def test_sigusr1_and_sighup_stop_a_build_safely(tmp_path, model_dir, make_rows, capsys):
    """Slurm's SIGUSR1 (``--signal=USR1@90``) and a closed SSH session's SIGHUP stop a build as
    SIGTERM does: what was computed is flushed, one line, exit 138 / 129; the next build reuses it."""
    n = 30
    data = write_jsonl(make_rows(n, seed=6), tmp_path / "rows.jsonl")
    cache, report = tmp_path / "cache", tmp_path / "seen"
    args = _cache_args(model_dir, data, cache, "--max-tokens", "1")
    seen = 0
    for name, fraction, extra in (("SIGUSR1", "0.3", []), ("SIGHUP", "0.5", ["--json"])):
        proc = signalled(SIGNAL_AT_PROGRESS, [*args, *extra], SIGNAL_AT_FRACTION=fraction, SIGNAL_NAME=name,
                         SIGNAL_REPORT=str(report))
        assert "run the same command again" in assert_one_line_stop(proc, name)
        if extra:  # --json: the JSON of what was done before the stop on stdout (it printed nothing)
            stopped = json.loads(proc.stdout)
            assert stopped["interrupted"] == signal.SIGHUP and stopped["computed"] == int(report.read_text())
            assert stopped["reused"] == seen
        seen += int(report.read_text())
        stored, manifest = _stored_pairs(model_dir, cache)
        assert stored == manifest["pairs"] == seen
    assert main([*args, "--json"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert (summary["reused"], summary["computed"]) == (seen, n - seen)


def test_sighup_checkpoints_a_training_step_and_resume_finishes(tmp_path, base_model, train_jsonl):
    """SIGHUP after step 2: checkpoint 2, exit 129 with one line; --resume runs steps 3 and 4 once."""
    out = tmp_path / "run"
    args = flags(base_model, train_jsonl, out, tmp_path / "cache", "--max-steps", "4")
    proc = signalled(SIGNAL_AFTER_STEP, ["train", *args], SIGNAL_AFTER_STEP="2", SIGNAL_NAME="SIGHUP")
    assert "step 2 of 4" in assert_one_line_stop(proc, "SIGHUP")
    assert [p.name for p in checkpoints(out)] == ["step-000002"]
    run_training(*args, "--resume")
    assert [r["step"] for r in train_records(out)] == [1, 2, 3, 4]


def test_an_ignored_sighup_stays_ignored():
    """``nohup`` starts a process with SIGHUP ignored: the run must not stop on it."""
    before = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        with stop_signals():
            assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
            assert signal.getsignal(signal.SIGUSR1) is not signal.SIG_IGN
    finally:
        signal.signal(signal.SIGHUP, before)


_LAUNCHER = """
import subprocess, sys, time
worker = subprocess.Popen([sys.executable, "-c", sys.argv[1], sys.argv[2]])
print(worker.pid, flush=True)
time.sleep(120)
"""

_WORKER = """
import sys, time
from pathlib import Path
from dpocache.runtime.signals import stop_signals, stop_with_the_launcher
with stop_signals() as stop:
    stop_with_the_launcher()
    with stop.deferred():
        Path(sys.argv[1]).write_text("ready")
        deadline = time.monotonic() + 60
        while not stop and time.monotonic() < deadline:
            time.sleep(0.01)
        Path(sys.argv[1]).write_text(f"stopped by {stop.signum}")
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl(PR_SET_PDEATHSIG) is Linux's")
def test_a_torchrun_worker_stops_when_its_launcher_ends(tmp_path):
    """torchrun's agent killed outright (a SIGUSR1 it was not told to handle ends it at once):
    its worker gets SIGTERM and stops at its safe point, where it trained on unsupervised, to
    the end, writing to the output directory of a job that looked finished."""
    said = tmp_path / "worker.txt"
    launcher = subprocess.Popen([sys.executable, "-c", _LAUNCHER, _WORKER, str(said)], stdout=subprocess.PIPE,
                                text=True, env=dict(os.environ, TORCHELASTIC_RUN_ID="test"))
    worker = int(launcher.stdout.readline())
    deadline = time.monotonic() + 60
    while not said.exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    launcher.kill()
    launcher.wait()
    while said.read_text() == "ready" and time.monotonic() < deadline:
        time.sleep(0.01)
    assert said.read_text() == f"stopped by {int(signal.SIGTERM)}"
    with contextlib.suppress(ProcessLookupError):
        os.kill(worker, signal.SIGKILL)  # only where the test failed


# ------------------------------------------------------------------------------ training


@pytest.fixture(scope="module")
def finished(tmp_path_factory, base_model, train_jsonl, eval_jsonl):
    """A finished 4-step run with eval data and checkpoints at steps 2 and 4."""
    root = tmp_path_factory.mktemp("finished")
    run_training(*flags(base_model, train_jsonl, root / "run", root / "cache", "--eval-data", str(eval_jsonl),
                        "--max-steps", "4", "--save-steps", "2"))
    return root


def _resume_flags(base_model, train_jsonl, eval_jsonl, out, root, *extra):
    return flags(base_model, train_jsonl, out, root / "cache", "--eval-data", str(eval_jsonl), "--max-steps", "4",
                 "--save-steps", "2", "--resume", *extra)


def _history(out) -> list[tuple[int, str]]:
    return [(r["step"], "eval" if "eval/loss" in r else "train") for r in records(out)]


FULL_HISTORY = [(0, "eval"), (1, "train"), (2, "train"), (3, "train"), (4, "train"), (4, "eval")]


def test_default_settings_sigterm_saves_a_checkpoint_and_resume_continues_exactly(
        tmp_path, base_model, train_jsonl, eval_jsonl):
    """No --save-steps: SIGTERM after step 3 saves checkpoint 3 and exits 143 with one line;
    --resume continues from it to the same losses and weights as an uninterrupted run."""
    from dpocache.config import Config

    steps = ("--eval-data", str(eval_jsonl), "--max-steps", "6")
    whole, stopped = tmp_path / "whole", tmp_path / "stopped"
    run_training(*flags(base_model, train_jsonl, whole, tmp_path / "cache", *steps))
    proc = signalled(SIGNAL_AFTER_STEP,
                     ["train", *flags(base_model, train_jsonl, stopped, tmp_path / "cache", *steps)],
                     SIGNAL_AFTER_STEP="3")
    line = assert_one_line_stop(proc, "SIGTERM")
    assert "step 3 of 6" in line and "--resume" in line
    assert [p.name for p in checkpoints(stopped)] == ["step-000003"]
    assert json.loads((stopped / "checkpoints" / "step-000003" / STATE_FILE).read_text())["step"] == 3
    assert not (stopped / "final").exists()

    run_training(*flags(base_model, train_jsonl, stopped, tmp_path / "cache", *steps, "--resume"))
    want, got = train_records(whole), train_records(stopped)
    assert [r["step"] for r in got] == [r["step"] for r in want] == [1, 2, 3, 4, 5, 6]
    for x, y in zip(want, got):
        for key in ("loss", "grad_norm", "lr", "rewards/margins"):
            assert y[key] == pytest.approx(x[key], abs=1e-6, rel=0), (x["step"], key)
    assert abs(want[-1]["rewards/margins"]) > 1e-4  # training moved
    assert [r["step"] for r in records(stopped) if "eval/loss" in r] == [0, 6]
    wa, wb = load_tensors(whole / "final" / "model.safetensors"), load_tensors(stopped / "final" / "model.safetensors")
    assert max_abs_diff(wa, wb) <= 1e-6
    assert Config().train.save_minutes == 30  # what default settings save by, besides the signal


@pytest.mark.parametrize("eval_step", [2, 6], ids=["periodic-eval", "final-eval"])
def test_sigterm_inside_an_eval_stops_it_and_keeps_the_step(tmp_path, base_model, train_jsonl, eval_jsonl,
                                                             eval_step):
    """A signal during an eval (which can outlast torchrun's or Slurm's grace period) ends it
    after the batch in flight: the step is checkpointed, no partial eval row is logged, and
    --resume runs that eval first, to the history and weights of an uninterrupted run."""
    steps = ("--eval-data", str(eval_jsonl), "--max-steps", "6", "--eval-steps", "2",
             "--train.eval_batch_size", "1")
    whole, stopped = tmp_path / "whole", tmp_path / "stopped"
    run_training(*flags(base_model, train_jsonl, whole, tmp_path / "cache", *steps))
    proc = signalled(SIGNAL_IN_EVAL, ["train", *flags(base_model, train_jsonl, stopped, tmp_path / "cache", *steps)],
                     SIGNAL_IN_EVAL_STEP=str(eval_step))
    line = assert_one_line_stop(proc, "SIGTERM")
    assert f"step {eval_step} of 6" in line
    assert checkpoints(stopped)[-1].name == f"step-{eval_step:06d}" and not (stopped / "final").exists()
    assert [r["step"] for r in records(stopped) if "eval/loss" in r] == [0, 2, 4][:eval_step // 2]

    run_training(*flags(base_model, train_jsonl, stopped, tmp_path / "cache", *steps, "--resume"))
    assert _history(stopped) == _history(whole)
    assert [r["step"] for r in records(stopped) if "eval/loss" in r] == [0, 2, 4, 6]
    for x, y in zip(records(whole), records(stopped)):
        for key in ("loss", "eval/loss", "eval/rewards/accuracies"):
            if key in x:
                assert y[key] == pytest.approx(x[key], abs=1e-6, rel=0), (x["step"], key)
    wa, wb = load_tensors(whole / "final" / "model.safetensors"), load_tensors(stopped / "final" / "model.safetensors")
    assert max_abs_diff(wa, wb) <= 1e-6


def test_default_settings_save_on_a_time_interval(tmp_path, base_model, train_jsonl, monkeypatch):
    """Each step "takes" 11 minutes on rank 0's clock: the default 30-minute interval saves
    after steps 3 and 6, the end saves step 8, and the newest two are kept."""
    import dpocache.training.checkpoints as checkpoints_mod
    import dpocache.training.loop as train_mod

    now, saved = [0.0], []
    one_step, save = train_mod.train_step, checkpoints_mod.save_checkpoint

    def eleven_minute_step(run, window):
        one_step(run, window)
        now[0] += 11 * 60

    def recording_save(output_dir, step, *args):
        saved.append(step)
        return save(output_dir, step, *args)

    monkeypatch.setattr(train_mod, "_clock", lambda: now[0])
    monkeypatch.setattr(train_mod, "train_step", eleven_minute_step)
    monkeypatch.setattr(checkpoints_mod, "save_checkpoint", recording_save)
    out = tmp_path / "run"
    run_training(*flags(base_model, train_jsonl, out, tmp_path / "cache", "--max-steps", "8"))
    assert saved == [3, 6, 8]
    assert [p.name for p in checkpoints(out)] == ["step-000006", "step-000008"]


def test_resume_before_any_checkpoint_with_a_torn_line_relogs_nothing_twice(
        tmp_path, finished, base_model, train_jsonl, eval_jsonl):
    """A run killed before its first checkpoint, while writing a metrics line: --resume starts
    at step 0 and the history holds each row once (the dead run's rows and torn line dropped)."""
    out = tmp_path / "dead"
    shutil.copytree(finished / "run", out)
    shutil.rmtree(out / "checkpoints")
    shutil.rmtree(out / "final")
    with open(out / "metrics.jsonl", "a") as f:
        f.write('{"step": 5, "loss": 0.6')  # torn: no closing brace, no newline
    run_training(*_resume_flags(base_model, train_jsonl, eval_jsonl, out, finished))
    assert _history(out) == FULL_HISTORY


def test_resume_after_a_checkpoint_with_a_torn_line(tmp_path, finished, base_model, train_jsonl, eval_jsonl):
    """Killed after checkpoint 2 mid-write: the torn line is dropped, rows up to step 2 kept,
    steps 3-4 and the final eval logged once, to the same values as the uninterrupted run."""
    out = tmp_path / "dead"
    shutil.copytree(finished / "run", out)
    shutil.rmtree(out / "checkpoints" / "step-000004")
    shutil.rmtree(out / "final")
    with open(out / "metrics.jsonl", "a") as f:
        f.write('{"step": 5, "lo')
    run_training(*_resume_flags(base_model, train_jsonl, eval_jsonl, out, finished))
    assert _history(out) == FULL_HISTORY
    for x, y in zip(records(finished / "run"), records(out)):
        for key in ("loss", "eval/loss"):
            if key in x:
                assert y[key] == pytest.approx(x[key], abs=1e-6, rel=0), (x["step"], key)


def test_resuming_a_finished_run_adds_no_second_final_eval(tmp_path, finished, base_model, train_jsonl, eval_jsonl):
    out = tmp_path / "again"
    shutil.copytree(finished / "run", out)
    before = (out / "metrics.jsonl").read_text()
    info = run_training(*_resume_flags(base_model, train_jsonl, eval_jsonl, out, finished))
    assert (out / "metrics.jsonl").read_text() == before
    assert _history(out) == FULL_HISTORY
    final_eval = [r for r in records(out) if "eval/loss" in r][-1]
    assert info["final"]["eval"]["eval/loss"] == final_eval["eval/loss"]
    assert run_json(out)["final"]["step"] == 4


# ------------------------------------------------------------------------------ files


def test_metrics_reader_drops_a_torn_last_line_only(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 0, "eval/loss": 0.7}\n{"step": 1, "loss": 0.6}\n{"step": 2, "lo')
    assert [r["step"] for r in read_metrics(tmp_path)] == [0, 1]
    MetricsWriter(tmp_path).rewind(1)
    assert path.read_text() == '{"step": 0, "eval/loss": 0.7}\n{"step": 1, "loss": 0.6}\n'
    path.write_text('{"step": 0}\n{"step": 1, "lo\n{"step": 2}\n')  # damage before the last line is named
    with pytest.raises(ValueError, match="metrics.jsonl:2"):
        read_metrics(tmp_path)


class _Saveable:
    """Stands in for a model and a tokenizer: ``save_pretrained`` writes one file."""

    def save_pretrained(self, path):
        (path / "config.json").write_text("{}")


def test_checkpoints_sort_by_step_number(tmp_path):
    import torch

    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    for step in (999_998, 999_999, 1_000_000):
        save_checkpoint(tmp_path, step, _Saveable(), None, optimizer, scheduler, {}, keep=2)
    (tmp_path / "checkpoints" / "step-1000001.tmp").mkdir()  # a save killed before its rename
    assert latest_checkpoint(tmp_path).name == "step-1000000"
    # Pruning kept the newest two by number (by name, step-1000000 would have gone first).
    assert [p.name for p in checkpoints(tmp_path)] == ["step-999999", "step-1000000"]


def test_a_sigterm_under_torchrun_names_the_launcher_as_a_sender(monkeypatch, capsys):
    """torchrun ends the other ranks with SIGTERM when one exits (a rank refused the output
    directory): a rank's bare "stopped by SIGTERM" read as the scheduler's doing."""
    from dpocache.cli import train as train_cli
    from dpocache.runtime.signals import NOTHING_LOST, STOP_SIGNALS

    def stopped(*args, **kwargs):
        raise Interrupted(signal.SIGTERM, NOTHING_LOST)

    monkeypatch.setattr(train_cli, "run", stopped)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")
    handlers = {signum: signal.getsignal(signum) for signum in STOP_SIGNALS}
    try:  # main ignores the stop signals on its way out: this worker's tests need them back
        assert main(["train", "--model", "m", "--data", "d"]) == 143
        assert capsys.readouterr().err.strip() == (
            "dpocache (rank 1): stopped by SIGTERM: nothing computed was lost; run the same command again to go on; "
            "under torchrun a SIGTERM also comes when another rank exits: see its line")
        monkeypatch.delenv("TORCHELASTIC_RUN_ID")
        assert main(["train", "--model", "m", "--data", "d"]) == 143
        assert capsys.readouterr().err.strip().endswith("to go on")
    finally:
        for signum, handler in handlers.items():
            signal.signal(signum, handler)
