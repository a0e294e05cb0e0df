"""Resume: an interrupted run, continued with --resume, matches an uninterrupted one exactly
(losses step by step and the final weights), for full fine-tuning and for LoRA; a resume with
settings that change the training is refused before any model loads."""

from __future__ import annotations

import pytest
import torch
from train_fixtures import (  # noqa: F401  (fixtures are used by name; one_thread is autouse)
    RESUME_STEPS, base_model, flags, interrupted_then_resumed, load_tensors, max_abs_diff, one_thread, run_json,
    run_training, train_jsonl, train_records,
)

STEPS = RESUME_STEPS


def _assert_same_losses(a, b):
    ra, rb = train_records(a), train_records(b)
    assert [r["step"] for r in ra] == list(range(1, STEPS + 1))
    # The resumed run rewrote steps 5..8 (the lines the first attempt logged were dropped).
    assert [r["step"] for r in rb] == list(range(1, STEPS + 1))
    for x, y in zip(ra, rb):
        for key in ("loss", "grad_norm", "lr", "rewards/margins"):
            assert y[key] == pytest.approx(x[key], abs=1e-6, rel=0), (x["step"], key)
    # Training moved: a resume that silently restarted from the initial weights would not match.
    assert abs(ra[-1]["rewards/margins"]) > 1e-4


def test_resume_matches_an_uninterrupted_run(tmp_path, base_model, train_jsonl):
    a, b = interrupted_then_resumed(tmp_path, base_model, train_jsonl, tmp_path / "cache")
    _assert_same_losses(a, b)
    wa, wb = load_tensors(a / "final" / "model.safetensors"), load_tensors(b / "final" / "model.safetensors")
    assert max_abs_diff(wa, wb) <= 1e-6
    assert max_abs_diff(wa, load_tensors(base_model / "model.safetensors")) > 1e-4
    assert run_json(b)["final"]["step"] == STEPS
    # run.json describes the whole run: the resume, and the step-0 audit its first attempt ran.
    assert run_json(b)["resumed_from"] == {"checkpoint": str(b / "checkpoints" / "step-000004"), "step": 4}
    assert run_json(b)["reference"]["step0_audit"] == run_json(a)["reference"]["step0_audit"]
    assert run_json(b)["reference"]["step0_audit"]["ok"]


def test_lora_resume_matches_an_uninterrupted_run(tmp_path, base_model, train_jsonl):
    # With LoRA dropout: the resumed run's masks continue the uninterrupted run's random stream.
    a, b = interrupted_then_resumed(tmp_path, base_model, train_jsonl, tmp_path / "cache",
                                     "--lora-r", "4", "--lr", "1e-2", "--lora.dropout", "0.3")
    assert (b / "checkpoints" / "step-000004" / "adapter_model.safetensors").exists()
    _assert_same_losses(a, b)
    wa = load_tensors(a / "final" / "adapter_model.safetensors")
    wb = load_tensors(b / "final" / "adapter_model.safetensors")
    assert max_abs_diff(wa, wb) <= 1e-6


def test_a_checkpoint_between_logging_steps_loses_no_metrics_on_resume(tmp_path, base_model, train_jsonl):
    """Logged every 4 steps, saved every 2: a run killed after its step-2 checkpoint resumes
    there. Steps 1-2 were in no row yet (their window was in memory), so the step-4 row of the
    resumed run averaged steps 3-4 only, and steps 1-2 were in no row of the history."""
    import shutil

    common = ("--max-steps", "4", "--save-steps", "2", "--logging-steps", "4")
    a, b, cache = tmp_path / "a", tmp_path / "b", tmp_path / "cache"
    run_training(*flags(base_model, train_jsonl, a, cache, *common))
    shutil.copytree(a, b)  # B's first attempt is A's, killed after its step-2 checkpoint
    shutil.rmtree(b / "checkpoints" / "step-000004")
    shutil.rmtree(b / "final")
    run_training(*flags(base_model, train_jsonl, b, cache, *common, "--resume"))
    ra, rb = train_records(a), train_records(b)
    assert [r["step"] for r in rb] == [r["step"] for r in ra] == [2, 4]  # a checkpoint's steps are logged with it
    for x, y in zip(ra, rb):
        assert y["loss"] == pytest.approx(x["loss"], abs=1e-6, rel=0), x["step"]


def test_a_save_removes_what_failed_saves_left(tmp_path, base_model, train_jsonl):
    """A save that ran out of disk (or was killed) leaves step-N.tmp; a later save of another step
    left it there, holding the space, for good."""
    out = tmp_path / "run"
    unfinished = out / "checkpoints" / "step-000007.tmp"
    unfinished.mkdir(parents=True)
    (unfinished / "model.safetensors").write_bytes(b"partial")
    run_training(*flags(base_model, train_jsonl, out, tmp_path / "cache", "--max-steps", "1"))
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-000001"]


def test_a_checkpoint_copies_the_optimizer_state_to_the_host_after_the_weights_are_written(
        tmp_path, base_model, train_jsonl, monkeypatch):
    """On a GPU both the weights (``save_pretrained``) and AdamW's moments (twice the weights)
    are copied to the host to be written: one after the other, never both at once. The
    optimizer's copy is made once the weights' file is complete."""
    from dpocache.models import checkpoint as checkpoint_mod

    seen = []
    real = checkpoint_mod._optimizer_tensors

    def recorded(optimizer):
        seen.append(sorted(p.name for p in (tmp_path / "run" / "checkpoints").glob("*.tmp/model.safetensors")))
        return real(optimizer)

    monkeypatch.setattr(checkpoint_mod, "_optimizer_tensors", recorded)
    run_training(*flags(base_model, train_jsonl, tmp_path / "run", tmp_path / "cache", "--max-steps", "2",
                        "--save-steps", "1"))
    assert seen == [["model.safetensors"], ["model.safetensors"]]
    assert load_tensors(tmp_path / "run" / "checkpoints" / "step-000002" / "optimizer.safetensors")


def test_resume_without_a_checkpoint_starts_at_step_zero(tmp_path, base_model, train_jsonl, capsys):
    out = tmp_path / "run"
    run_training(*flags(base_model, train_jsonl, out, tmp_path / "cache", "--max-steps", "2", "--resume"))
    assert "starting from step 0" in capsys.readouterr().err
    assert [r["step"] for r in train_records(out)] == [1, 2]


def test_load_model_weights_reads_sharded_checkpoints(tmp_path, base_model):
    """Big models are saved as shards plus an index; resume must load those too."""
    from dpocache.models.checkpoint import load_model_weights
    from dpocache.models.loading import load_causal_lm

    trained = load_causal_lm(base_model)
    for p in trained.parameters():
        p.data.add_(0.01)
    trained.save_pretrained(tmp_path / "ckpt", max_shard_size="100KB")
    assert (tmp_path / "ckpt" / "model.safetensors.index.json").exists()
    assert not (tmp_path / "ckpt" / "model.safetensors").exists()

    fresh = load_causal_lm(base_model)
    load_model_weights(tmp_path / "ckpt", fresh)
    want, got = trained.state_dict(), fresh.state_dict()
    assert max(float((want[k] - got[k]).abs().max()) for k in want) == 0


@pytest.mark.parametrize("changed, fragment", [
    (("--loss", "ipo"), "--loss (loss.name) 'sigmoid' -> 'ipo'"),
    (("--lr", "0.1"), "--lr (optim.lr) 0.001 -> 0.1"),
    (("--beta", "0.5"), "--beta (loss.beta) 0.1 -> 0.5"),
    (("--max-length", "32"), "--max-length (data.max_length) 64 -> 32"),
    (("--lora-r", "4"), "--lora-r (lora.r) 0 -> 4"),
    (("--seed", "7"), "--seed (train.seed) 42 -> 7"),
])
def test_resume_with_other_settings_is_refused_before_loading(tmp_path, base_model, train_jsonl, monkeypatch,
                                                              capsys, changed, fragment):
    """Changing the loss, the learning rate, the data or the model under --resume made a
    different run that run.json described as the resumed one; more steps may still be asked."""
    import dpocache.models.loading
    from dpocache.cli.entry import main

    out, cache = tmp_path / "run", tmp_path / "cache"
    common = flags(base_model, train_jsonl, out, cache, "--max-steps", "2")
    run_training(*common)
    capsys.readouterr()

    def no_load(*args, **kwargs):
        raise AssertionError("a model was loaded")

    with monkeypatch.context() as m:
        m.setattr(dpocache.models.loading, "load_causal_lm", no_load)
        assert main(["train", *common, *changed, "--resume"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--resume:" in err and fragment in err, err
    run_training(*common, "--max-steps", "3", "--resume")  # the same training, further
    assert [r["step"] for r in train_records(out)] == [1, 2, 3]


def test_a_resume_under_another_global_batch_says_which_pairs_it_trains_again(tmp_path, base_model, train_jsonl,
                                                                              capsys):
    """Two steps of 4 pairs, resumed with batches of 2: the resume goes on from pair 4 of the
    order (step 2 x 2), so pairs 4 to 7 are trained again (seen in its first logged epoch);
    it said only that the steps "take different pairs"."""
    out, cache = tmp_path / "run", tmp_path / "cache"
    run_training(*flags(base_model, train_jsonl, out, cache, "--max-steps", "2", "--save-steps", "2"))
    capsys.readouterr()
    run_training(*flags(base_model, train_jsonl, out, cache, "--max-steps", "3", "--batch-size", "2", "--resume"))
    err = capsys.readouterr().err
    assert ("warning: the global batch was 4 and is now 2 (batch_size x grad_accum x world_size): the first run had "
            "trained 8 pairs by step 2, this one goes on from pair 4, so pairs 4 to 7 of the data's order are trained "
            "again, and its steps and learning-rate schedule are those of a batch of 2; keep the product at 4 to "
            "continue exactly") in err
    first, resumed = train_records(out)[1:3]
    assert resumed["epoch"] < first["epoch"]  # the data's position went back: 6 pairs in, after 8


def test_a_resume_with_more_steps_follows_the_new_schedule_from_its_first_step(tmp_path, base_model, train_jsonl,
                                                                             capsys):
    """Two steps of a 2-step run, resumed with --max-steps 4: steps 3 and 4 train at the rates a
    4-step run has there. The first resumed step trained at the rate the optimizer's state held
    (the old schedule's, 0 past its end) and the later ones jumped to the new one, unsaid."""
    out, fresh, cache = tmp_path / "run", tmp_path / "fresh", tmp_path / "cache"
    run_training(*flags(base_model, train_jsonl, fresh, cache, "--max-steps", "4"))
    run_training(*flags(base_model, train_jsonl, out, cache, "--max-steps", "2", "--save-steps", "2"))
    capsys.readouterr()
    run_training(*flags(base_model, train_jsonl, out, cache, "--max-steps", "4", "--resume"))
    err = capsys.readouterr().err
    lrs = {r["step"]: r["lr"] for r in train_records(fresh)}
    assert [r["lr"] for r in train_records(out)][2:] == [lrs[3], lrs[4]] and lrs[3] > 0
    assert (f"warning: the run had 2 steps and now has 4 (--max-steps, --epochs or the batch changed): the "
            f"learning-rate schedule is spread over 4 steps from here, so step 3 trains at {lrs[3]:.4g} where the "
            f"first run's would have trained at 0") in err, err


@pytest.mark.parametrize("rewrite", ["data rows", "data order", "model weights"])
def test_resume_on_inputs_rewritten_in_place_is_refused_before_training(tmp_path, base_model, train_jsonl,
                                                                          monkeypatch, capsys, rewrite):
    """The same --data path with other rows (or the same rows in another order), or the same
    --model path with other weights, passed every settings check: the resumed steps trained on
    other data, or against another reference, with exit 0."""
    import shutil

    import dpocache.models.loading
    from dpocache.cli.entry import main
    from dpocache.data.rows import read_rows, write_jsonl
    from dpocache.models.loading import load_causal_lm

    data, model = tmp_path / "data.jsonl", tmp_path / "model"
    shutil.copy(train_jsonl, data)
    shutil.copytree(base_model, model)
    out, cache = tmp_path / "run", tmp_path / "cache"
    common = flags(model, data, out, cache, "--max-steps", "2")
    run_training(*common)
    if rewrite == "model weights":
        edited = load_causal_lm(model)
        with torch.no_grad():
            next(edited.parameters()).add_(0.01)
        edited.save_pretrained(model)
        fragment, loads = "is not the one", True
    else:
        rows = [r.values for r in read_rows(data)[1]]
        rows = rows[::-1] if rewrite == "data order" else [{**r, "chosen": r["rejected"], "rejected": r["chosen"]}
                                                           for r in rows]
        write_jsonl(rows, data)
        fragment, loads = "holds other pairs", False
    capsys.readouterr()

    def no_load(*args, **kwargs):
        raise AssertionError("a model was loaded")

    with monkeypatch.context() as m:
        if not loads:  # the data is checked before any model; the model's hash needs no load either
            m.setattr(dpocache.models.loading, "load_causal_lm", no_load)
        assert main(["train", *common, "--max-steps", "3", "--resume"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--resume:" in err and fragment in err, err
    assert [r["step"] for r in train_records(out)] == [1, 2]


@pytest.mark.parametrize("damage", ["weights cut short", "state not JSON", "optimizer missing"])
def test_resume_from_a_damaged_checkpoint_is_one_line_naming_the_one_before(tmp_path, base_model, train_jsonl,
                                                                           capsys, damage):
    """A file of the newest checkpoint cut short, its state edited into bad JSON, or its
    optimizer state removed: a SafetensorError, JSONDecodeError or FileNotFoundError traceback
    before; now one line (exit 2) naming it and the checkpoint to resume from once it is moved
    away, and that resume continues."""
    import shutil

    from dpocache.cli.entry import main

    out, cache = tmp_path / "run", tmp_path / "cache"
    common = flags(base_model, train_jsonl, out, cache, "--max-steps", "4", "--save-steps", "2",
                   "--train.save_total_limit", "2")
    run_training(*common)
    newest = out / "checkpoints" / "step-000004"
    if damage == "weights cut short":
        weights = newest / "model.safetensors"
        weights.write_bytes(weights.read_bytes()[:5])
    elif damage == "state not JSON":
        (newest / "trainer_state.json").write_text('{"step": 4,')
    else:
        (newest / "optimizer.safetensors").unlink()
    capsys.readouterr()
    assert main(["train", *common, "--max-steps", "5", "--resume"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith(f"dpocache train: error: --resume: {newest} cannot be read (") and err.endswith(
        f"); move it out of {newest.parent} to resume from step-000002, the one before it"), err
    shutil.move(newest, tmp_path / "damaged")
    run_training(*common, "--max-steps", "5", "--resume")
    assert [r["step"] for r in train_records(out)] == [1, 2, 3, 4, 5]
