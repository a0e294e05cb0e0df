"""Trackers beside metrics.jsonl: ``--report-to none|tensorboard|wandb`` (and the older
``train.tensorboard`` switch), each library imported only when asked for."""

from __future__ import annotations

import importlib.util
import sys

import pytest
from train_fixtures import base_model, flags, one_thread, run_training, train_jsonl  # noqa: F401

from dpocache.cli.entry import main as cli_main
from dpocache.config import ConfigError, build_config
from dpocache.training.metrics import MetricsWriter, read_metrics, trackers

HAS_TENSORBOARD = importlib.util.find_spec("tensorboard") is not None
HAS_WANDB = importlib.util.find_spec("wandb") is not None
ROWS = [{"step": 1, "loss": 0.69, "rewards/accuracies": 0.5},
        {"step": 2, "loss": 0.5, "note": "text", "nan": float("nan")}]


def test_trackers_asked_for():
    assert trackers("none") == ()
    assert trackers("none", tensorboard=True) == ("tensorboard",)  # the older switch still works
    assert trackers("tensorboard", tensorboard=True) == ("tensorboard",)
    assert trackers("tensorboard, wandb") == ("tensorboard", "wandb")


def test_report_to_is_validated_naming_the_flag():
    assert build_config(overrides=["--report-to", "wandb"]).validate().train.report_to == "wandb"
    with pytest.raises(ConfigError, match=r"^command line|--report-to") as e:
        build_config(overrides=["--report-to", "mlflow"]).validate()
    assert "--report-to" in str(e.value) and "'mlflow'" in str(e.value) and "\n" not in str(e.value)


def test_report_to_none_writes_metrics_jsonl_only(tmp_path):
    writer = MetricsWriter(tmp_path, report_to="none")
    for row in ROWS:
        writer.write(row)
    writer.close()
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl"]


def _tensorboard_scalars(log_dir) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir))
    acc.Reload()
    return {tag: [(e.step, round(e.value, 6)) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


@pytest.mark.skipif(not HAS_TENSORBOARD, reason="tensorboard is not installed")
@pytest.mark.parametrize("kwargs", [{"report_to": "tensorboard"}, {"tensorboard": True}])
def test_tensorboard_gets_every_finite_number(tmp_path, kwargs):
    writer = MetricsWriter(tmp_path, **kwargs)
    for row in ROWS:
        writer.write(row)
    writer.close()
    assert _tensorboard_scalars(tmp_path / "tensorboard") == {
        "loss": [(1, 0.69), (2, 0.5)], "rewards/accuracies": [(1, 0.5)],
    }


def test_a_missing_tracker_library_is_one_line_before_any_work(tmp_path, base_model, train_jsonl, monkeypatch,
                                                                capsys):
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` raises ImportError
    out = tmp_path / "run"
    assert cli_main(["train", *flags(base_model, train_jsonl, out, tmp_path / "cache", "--report-to", "wandb")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--report-to wandb" in err and "pip install 'dpocache[wandb]'" in err
    assert "Traceback" not in err
    # Nothing was tokenized, loaded or computed.
    assert not (out / "metrics.jsonl").exists() and not any(p.is_file() for p in (tmp_path / "cache").rglob("*"))


@pytest.mark.skipif(not HAS_WANDB, reason="wandb is not installed")
def test_wandb_offline_needs_no_network(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    writer = MetricsWriter(tmp_path, report_to="wandb", config={"loss": {"beta": 0.1}})
    for row in ROWS:
        writer.write(row)
    writer.close()
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and list(runs[0].glob("*.wandb"))


@pytest.mark.skipif(not HAS_TENSORBOARD, reason="tensorboard is not installed")
def test_training_reports_to_tensorboard(tmp_path, base_model, train_jsonl):
    out = tmp_path / "run"
    run_training(*flags(base_model, train_jsonl, out, tmp_path / "cache", "--max-steps", "2", "--logging-steps", "1",
                        "--report-to", "tensorboard"))
    scalars = _tensorboard_scalars(out / "tensorboard")
    assert [step for step, _ in scalars["loss"]] == [1, 2]
    train_loss = [round(r["loss"], 6) for r in read_metrics(out) if "loss" in r]
    assert [v for _, v in scalars["loss"]] == train_loss


@pytest.mark.skipif(not HAS_TENSORBOARD, reason="tensorboard is not installed")
def test_a_resumed_run_has_each_step_once_in_tensorboard(tmp_path, base_model, train_jsonl):
    """The killed attempt logged steps 5-8 after its step-4 checkpoint; the resumed run logs them
    again. TensorBoard shows each step once, with the resumed run's values (as metrics.jsonl)."""
    from train_fixtures import RESUME_STEPS, interrupted_then_resumed

    _, b = interrupted_then_resumed(tmp_path, base_model, train_jsonl, tmp_path / "cache", "--report-to",
                                    "tensorboard")
    scalars = _tensorboard_scalars(b / "tensorboard")
    assert [step for step, _ in scalars["loss"]] == list(range(1, RESUME_STEPS + 1))
    assert [v for _, v in scalars["loss"]] == [round(r["loss"], 6) for r in read_metrics(b) if "loss" in r]


class _FakeWandb:
    """What dpocache calls of ``wandb``: ``init`` (its keyword arguments recorded), a run's ``id``,
    ``log`` and ``finish``. W&B is an optional extra, not installed in CI."""

    def __init__(self):
        self.inits: list[dict] = []
        self.logged: dict[str, list[int]] = {}

    def init(self, **kwargs):
        self.inits.append(kwargs)
        run_id = kwargs.get("id") or f"run{len(self.inits)}"
        steps = self.logged.setdefault(run_id, [])
        fake = self

        class Run:
            id = run_id

            def log(self, scalars, step):
                if not steps or step > steps[-1]:  # W&B drops a step below the run's last
                    steps.append(step)

            def finish(self):
                fake.finished = True

        return Run()


def test_a_resumed_run_continues_its_wandb_run(tmp_path, base_model, train_jsonl, monkeypatch):
    """``--resume`` used to start a second W&B run: the curves of one training run split in two,
    the second starting at the checkpoint's step."""
    from train_fixtures import RESUME_STEPS, interrupted_then_resumed

    fake = _FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    monkeypatch.delenv("WANDB_RUN_ID", raising=False)
    _, b = interrupted_then_resumed(tmp_path, base_model, train_jsonl, tmp_path / "cache", "--report-to", "wandb")
    first, resumed = fake.inits
    assert "id" not in first and "resume" not in first
    assert resumed["id"] == "run1" and resumed["resume"] == "allow"
    assert fake.logged == {"run1": list(range(1, RESUME_STEPS + 1))}  # each step once, in one run
    assert (b / "wandb-run-id").read_text().strip() == "run1"

    fresh = tmp_path / "fresh"  # a run that does not resume starts a W&B run of its own
    run_training(*flags(base_model, train_jsonl, fresh, tmp_path / "cache", "--max-steps", "1",
                        "--report-to", "wandb"))
    assert "id" not in fake.inits[-1] and (fresh / "wandb-run-id").read_text().strip() == "run3"
