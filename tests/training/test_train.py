"""End-to-end training on the tiny model: step-0 rewards, the cache used (and shown to be used),
LoRA's reference, every loss, divergence, metrics, plotting and gradient accumulation."""

from __future__ import annotations

import json
import math

import pytest
import torch
from train_fixtures import (  # noqa: F401  (fixtures are used by name; one_thread is autouse)
    PNG_MAGIC, TRAIN_PAIRS, base_model, eval_jsonl, eval_records, flags, load_tensors, max_abs_diff, namespace_dirs,
    one_thread, records, run_json, run_training, train_jsonl, train_records,
)

from dpocache.cli.entry import main as cli_main
from dpocache.losses.registry import LOSSES
from dpocache.models import reference as reference_mod
from dpocache.training import loop as train_mod
from dpocache.training import objective as objective_mod
from dpocache.training import prefetch
from dpocache.training import setup as setup_mod

TRAIN_KEYS = {
    "step", "epoch", "lr", "loss", "grad_norm", "rewards/chosen", "rewards/rejected", "rewards/average",
    "rewards/accuracies", "rewards/margins", "logps/chosen", "logps/rejected", "tokens_per_s", "mfu",
}
EVAL_KEYS = {"eval/loss", "eval/rewards/chosen", "eval/rewards/rejected", "eval/rewards/average",
             "eval/rewards/accuracies", "eval/rewards/margins", "eval/logps/chosen", "eval/logps/rejected"}


def _forbid_reference_load(monkeypatch) -> None:
    def refuse(*args, **kwargs):
        raise AssertionError("the reference model was loaded although the cache is complete")

    monkeypatch.setattr(reference_mod.ReferenceModel, "from_pretrained", refuse)


def _count_reference_passes(monkeypatch) -> list[int]:
    """Every reference forward pass this process makes, counted here (not by dpocache)."""
    calls = []
    original = reference_mod.ReferenceModel._call

    def counting(self, fn, tokens):
        calls.append(tokens)
        return original(self, fn, tokens)

    monkeypatch.setattr(reference_mod.ReferenceModel, "_call", counting)
    return calls


# ------------------------------------------------------------------ one DPO run, through the CLI


@pytest.fixture(scope="module")
def dpo_run(tmp_path_factory, base_model, train_jsonl, eval_jsonl):
    """4 steps of sigmoid DPO with eval every 2 steps, run as ``dpocache train``."""
    root = tmp_path_factory.mktemp("dpo-run")
    out = root / "run"
    argv = flags(base_model, train_jsonl, out, root / "cache", "--eval-data", str(eval_jsonl), "--max-steps", "4",
                 "--eval-steps", "2", "--save-steps", "2")
    assert cli_main(["train", *argv]) == 0
    return out


def test_step0_rewards_are_zero_fp32(dpo_run):
    """The first step's forward runs at the initial weights, which are the reference: the cached
    values must be exactly what the policy computes (docs/ARCHITECTURE.md), so rewards and
    margins are 0 up to fp32 rounding from the different batch shapes."""
    first = train_records(dpo_run)[0]
    assert first["step"] == 1
    print(f"\nfp32 step-0 margin: {first['rewards/margins']:.3g}")
    assert abs(first["rewards/margins"]) <= 1e-6
    assert abs(first["rewards/chosen"]) <= 1e-6
    assert abs(first["rewards/rejected"]) <= 1e-6
    assert first["loss"] == pytest.approx(math.log(2), abs=1e-6)  # -log sigmoid(0)
    step0_eval = [r for r in records(dpo_run) if r["step"] == 0 and "eval/loss" in r]
    assert step0_eval and abs(step0_eval[0]["eval/rewards/margins"]) <= 1e-6


def test_step0_rewards_bf16(tmp_path, base_model, train_jsonl):
    """In bf16 the policy's and the cache's forward share one code path and one autocast, so the
    step-0 margin stays near 0 (TRL's bf16 precompute drifts from its training forward)."""
    out = tmp_path / "run"
    run_training(*flags(base_model, train_jsonl, out, tmp_path / "cache", "--dtype", "bfloat16", "--max-steps", "1"))
    first = train_records(out)[0]
    assert run_json(out)["reference"]["dtype"] == "bfloat16"
    print(f"\nbf16 step-0 margin: {first['rewards/margins']:.3g} (chosen {first['rewards/chosen']:.3g}, "
          f"rejected {first['rewards/rejected']:.3g})")
    assert abs(first["rewards/margins"]) < 0.5


def test_metrics_jsonl_has_the_documented_keys(dpo_run):
    recs = records(dpo_run)
    train = [r for r in recs if "loss" in r]
    assert [r["step"] for r in train] == [1, 2, 3, 4]
    for r in train:
        assert TRAIN_KEYS <= r.keys(), TRAIN_KEYS - r.keys()
        assert not any(k.startswith("eval/") for k in r)
        assert "sft_loss" not in r  # sigmoid has no NLL term
        assert all(math.isfinite(r[k]) for k in TRAIN_KEYS)
        assert r["tokens_per_s"] > 0 and 0 < r["mfu"] < 1
        assert r["lr"] > 0 and r["grad_norm"] > 0
        assert 0 <= r["rewards/accuracies"] <= 1
        assert r["rewards/average"] == pytest.approx((r["rewards/chosen"] + r["rewards/rejected"]) / 2, abs=1e-6)
        assert r["epoch"] == pytest.approx(r["step"] / (TRAIN_PAIRS // 4))
    evals = [r for r in recs if any(k.startswith("eval/") for k in r)]
    assert [r["step"] for r in evals] == [0, 2, 4]  # start, eval_steps, end
    for r in evals:
        assert EVAL_KEYS <= r.keys(), EVAL_KEYS - r.keys()
        assert set(r) - {"step", "epoch"} <= {k for k in r if k.startswith("eval/")}


def test_run_json_records_config_versions_reference(dpo_run, base_model):
    info = run_json(dpo_run)
    assert {"config", "versions", "reference", "final"} <= info.keys()
    assert info["config"]["model"]["path"] == str(base_model)
    assert info["config"]["train"]["max_steps"] == 4
    assert {"dpocache", "torch", "transformers", "peft", "python"} <= info["versions"].keys()
    assert info["versions"]["torch"] == torch.__version__
    ref = info["reference"]
    assert ref["source"] == "cache" and ref["dtype"] == "float32"
    assert ref["forward_passes_during_training"] == 0
    assert info["final"]["step"] == 4
    assert not any(k.startswith("_") for k in info)


def test_final_config_keeps_the_base_models_use_cache(dpo_run, base_model):
    # Training never reads the KV cache (every forward passes use_cache=False), so the saved model
    # keeps the base's setting: a final/ saying use_cache false made a plain forward return no cache.
    base = json.loads((base_model / "config.json").read_text())
    final = json.loads((dpo_run / "final" / "config.json").read_text())
    assert base.get("use_cache", True) is True
    assert final.get("use_cache", True) is True


def test_plot_writes_a_png(dpo_run, capsys):
    assert cli_main(["plot", str(dpo_run)]) == 0
    png = dpo_run / "curves.png"
    assert str(png) in capsys.readouterr().out
    assert png.read_bytes()[:8] == PNG_MAGIC


def test_a_series_of_one_point_is_drawn_as_a_marker(tmp_path, monkeypatch):
    """A 3-step run logging every 10 steps has one training row: a line of one point, invisible."""
    import matplotlib.axes

    (tmp_path / "metrics.jsonl").write_text('{"step": 0, "eval/loss": 0.69}\n{"step": 3, "loss": 0.68}\n'
                                            '{"step": 3, "eval/loss": 0.6}\n')
    styles = {}
    real = matplotlib.axes.Axes.plot

    def recorded(ax, x, y, fmt, label):
        styles[label] = fmt
        return real(ax, x, y, fmt, label=label)

    monkeypatch.setattr(matplotlib.axes.Axes, "plot", recorded)
    assert cli_main(["plot", str(tmp_path)]) == 0
    assert styles["train"] == "o" and styles["eval"] == "o--"


def test_plot_draws_chosen_and_rejected_together_and_eval_beside_train(dpo_run):
    from dpocache.training.metrics import read_metrics
    from dpocache.training.plot import panel_series

    records = read_metrics(dpo_run)
    panels = panel_series(records)
    logps = panels["log-probs of chosen and rejected"]
    assert set(logps) == {"train chosen", "train rejected", "eval chosen", "eval rejected"}
    steps, values = logps["eval rejected"]
    assert values == [r["eval/logps/rejected"] for r in records if "eval/logps/rejected" in r] and steps
    assert set(panels["loss"]) == {"train", "eval"}
    assert len(panels) == 4  # sigmoid logs no SFT term and no WPO weights: no empty panel for them
    # a loss with an SFT term and WPO's weighting: a panel each, train and eval (they were logged, never drawn)
    panels = panel_series([{"step": 1, "loss": 0.7, "sft_loss": 2.1, "wpo/weights": 0.5},
                           {"step": 2, "eval/loss": 0.6, "eval/sft_loss": 2.0}])
    assert set(panels["SFT term (chosen NLL per token)"]) == {"train", "eval"}
    assert set(panels["WPO weights"]) == {"train"}


@pytest.mark.parametrize("damage", ["{not json", "[1, 2]"])
def test_plot_of_a_damaged_metrics_file_is_one_line(tmp_path, capsys, damage):
    """A damaged line before the last (the last may be torn by a kill, and is dropped) is named
    with its line number; a traceback came instead."""
    (tmp_path / "metrics.jsonl").write_text(f'{{"step": 1, "loss": 0.7}}\n{damage}\n{{"step": 2, "loss": 0.6}}\n')
    assert cli_main(["plot", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{tmp_path / 'metrics.jsonl'}:2: not a JSON object" in err
    assert not (tmp_path / "curves.png").exists()


@pytest.mark.parametrize("case", ["metrics not UTF-8", "metrics a directory", "--out of an unknown format",
                                  "--out a directory", "no metrics", "no rows", "--out in no directory"])
def test_plot_mistake_is_one_line(tmp_path, capsys, case):
    """Each was a traceback with exit 1 (UnicodeDecodeError, IsADirectoryError, matplotlib's
    ValueError, FileNotFoundError naming no flag), or, for --out a directory, a PNG written beside
    it under another name, and for no rows blank axes, exit 0."""
    metrics, args, fragments = tmp_path / "metrics.jsonl", [], ["metrics.jsonl"]
    if case == "no metrics":
        fragments = [f"OUTPUT_DIR {tmp_path}: no metrics.jsonl in it"]
    elif case == "no rows":
        metrics.write_text("")
        fragments = [f"OUTPUT_DIR {tmp_path}: its metrics.jsonl has no rows yet"]
    elif case == "--out in no directory":
        metrics.write_text('{"step": 1, "loss": 0.7}\n')
        args, fragments = ["--out", str(tmp_path / "nodir" / "c.png")], [f"no directory {tmp_path / 'nodir'}"]
    elif case == "metrics not UTF-8":
        metrics.write_bytes(b'{"step": 1, "loss": 0.7}\n{"step": 2, "loss": "\xff"}\n{"step": 3, "loss": 0.6}\n')
        fragments = [f"{metrics}", "UTF-8", "0xff"]
    elif case == "metrics a directory":
        metrics.mkdir()
        fragments = [f"{metrics}", "not a file"]
    elif case.startswith("--out"):
        metrics.write_text('{"step": 1, "loss": 0.7}\n')
        out = tmp_path / ("curves.txt" if case == "--out of an unknown format" else "pngs")
        if case == "--out a directory":
            out.mkdir()
        args, fragments = ["--out", str(out)], [f"--out {out}"]
    assert cli_main(["plot", str(tmp_path), *args]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and all(f in err for f in fragments), err
    assert {p.name for p in tmp_path.iterdir()} <= {"metrics.jsonl", "pngs"}  # nothing drawn


# ------------------------------------------------------------------------- the cache, used


def test_complete_cache_loads_no_reference_model(tmp_path, base_model, train_jsonl, monkeypatch, capsys):
    cache = tmp_path / "cache"
    assert cli_main(["cache", "build", "--model", str(base_model), "--data", str(train_jsonl),
                     "--cache-dir", str(cache), "--max-length", "64", "--dtype", "float32", "--device", "cpu",
                     "--json"]) == 0
    built = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert built["computed"] == built["unique"] == TRAIN_PAIRS

    _forbid_reference_load(monkeypatch)
    passes = _count_reference_passes(monkeypatch)
    out = tmp_path / "run"
    run_training(*flags(base_model, train_jsonl, out, cache, "--max-steps", "2"))
    ref = run_json(out)["reference"]
    assert ref["source"] == "cache"
    assert ref["computed"] == 0
    assert ref["reused"] == TRAIN_PAIRS
    assert ref["forward_passes_during_training"] == 0
    assert ref["namespace"] == built["namespace"]
    assert ref["forward_passes"] == 0 and passes == []


def test_cache_built_for_ld_dpo_is_reused_whole(tmp_path, base_model, train_jsonl, monkeypatch, capsys):
    """``cache build --loss.ld_alpha`` stores the per-token values LD-DPO trains on (it stored
    sums only, and train recomputed every pair)."""
    cache = tmp_path / "cache"
    assert cli_main(["cache", "build", "--model", str(base_model), "--data", str(train_jsonl),
                     "--cache-dir", str(cache), "--max-length", "64", "--dtype", "float32", "--device", "cpu",
                     "--loss.ld_alpha", "0.5", "--json"]) == 0
    _forbid_reference_load(monkeypatch)
    out = tmp_path / "run"
    run_training(*flags(base_model, train_jsonl, out, cache, "--max-steps", "1", "--loss.ld_alpha", "0.5"))
    ref = run_json(out)["reference"]
    assert (ref["computed"], ref["reused"], ref["ld_alpha"]) == (0, TRAIN_PAIRS, 0.5)


def test_appended_rows_build_only_the_new_pairs(tmp_path, base_model, train_jsonl, monkeypatch):
    from dpocache.data.rows import write_jsonl
    from dpocache.training.demo import sorting_pairs

    cache = tmp_path / "cache"
    run_training(*flags(base_model, train_jsonl, tmp_path / "first", cache, "--max-steps", "1"))
    assert run_json(tmp_path / "first")["reference"]["computed"] == TRAIN_PAIRS

    old = [json.loads(line) for line in train_jsonl.read_text().splitlines()]
    seen = {json.dumps(r, sort_keys=True) for r in old}
    new = [r for r in sorting_pairs(7, seed=99) if json.dumps(r, sort_keys=True) not in seen]
    new_unique = len({json.dumps(r, sort_keys=True) for r in new})
    assert new_unique > 0
    grown = write_jsonl(old + new + new[:2], tmp_path / "grown.jsonl")  # duplicates count once
    out = tmp_path / "second"
    passes = _count_reference_passes(monkeypatch)
    run_training(*flags(base_model, grown, out, cache, "--max-steps", "1"))
    ref = run_json(out)["reference"]
    assert ref["computed"] == new_unique
    assert ref["reused"] == TRAIN_PAIRS
    assert ref["forward_passes_during_training"] == 0
    # Every pass this process made is one the build's summary counts: the new pairs were
    # scored before training, and training made none.
    assert ref["forward_passes"] == len(passes) > 0


# ----------------------------------------------------------------------------- LoRA reference


def _pair_sums(scorer, pairs, pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed completion log-probs ``(N,)`` of chosen and rejected under ``scorer`` (a ReferenceModel)."""
    from dpocache.scoring.padded import collate_pairs

    batch = collate_pairs(pairs, pad_id)
    sums = scorer.logprobs(batch.input_ids, batch.attention_mask, batch.completion_mask).sum(-1)  # (2N,)
    return sums[:len(pairs)], sums[len(pairs):]


def test_lora_reference_is_the_base_model(tmp_path, base_model, train_jsonl, monkeypatch):
    from peft import PeftModel

    from dpocache.cache import CacheStore, export_rows, namespace_for_dir
    from dpocache.data.pairs import load_preference_data
    from dpocache.models.loading import load_causal_lm, load_tokenizer
    from dpocache.models.reference import ReferenceModel

    cache, out = tmp_path / "cache", tmp_path / "lora"
    run_training(*flags(base_model, train_jsonl, out, cache, "--lora-r", "4", "--lr", "1e-2", "--max-steps", "6"))
    info = run_json(out)
    assert info["policy"]["trainable"] < info["policy"]["parameters"]
    assert info["reference"]["model"] == str(base_model.resolve())

    tokenizer = load_tokenizer(base_model)
    pairs = load_preference_data(train_jsonl, tokenizer, 64, show_progress=False).pairs
    store = CacheStore(cache, namespace_for_dir(base_model, torch.float32, cache)).open()
    rows = list(export_rows(store, pairs))
    cached_c = torch.tensor([r["chosen_logps"] for r in rows])
    cached_r = torch.tensor([r["rejected_logps"] for r in rows])
    pad = tokenizer.pad_token_id

    base_c, base_r = _pair_sums(ReferenceModel.from_pretrained(base_model, "float32", "cpu"), pairs, pad)
    assert torch.allclose(cached_c, base_c, atol=1e-4, rtol=0)
    assert torch.allclose(cached_r, base_r, atol=1e-4, rtol=0)

    trained = PeftModel.from_pretrained(load_causal_lm(base_model), str(out / "final"))
    on_c, on_r = _pair_sums(ReferenceModel(trained, torch.float32), pairs, pad)
    assert (on_c - cached_c).abs().max() > 1e-2, "training left the adapter-on model equal to the base"
    assert (on_r - cached_r).abs().max() > 1e-2
    off_c, off_r = _pair_sums(ReferenceModel.from_peft_policy(trained, torch.float32), pairs, pad)
    assert torch.allclose(off_c, cached_c, atol=1e-4, rtol=0)
    assert torch.allclose(off_r, cached_r, atol=1e-4, rtol=0)

    assert info["reference"]["step0_audit"]["ok"]  # a fresh LoRA starts at the base: the audit applies

    # Continuing from the adapter directory with --reference base: its reference is still the
    # base, served whole by the cache (no model load), and step 1 shows the adapter's non-zero
    # rewards (the default reference, base + adapter, is tested in test_reference_initial.py).
    _forbid_reference_load(monkeypatch)
    out2 = tmp_path / "continued"
    run_training(*flags(base_model, train_jsonl, out2, cache, "--model", str(out / "final"), "--max-steps", "1",
                        "--reference", "base"))
    ref2 = run_json(out2)["reference"]
    assert ref2["namespace"] == info["reference"]["namespace"]
    assert ref2["computed"] == 0 and ref2["reused"] == TRAIN_PAIRS
    first = train_records(out2)[0]
    assert max(abs(first["rewards/chosen"]), abs(first["rewards/rejected"])) > 1e-4


def test_an_adapter_trained_from_a_relative_model_path_loads_from_any_directory(tmp_path, base_model, train_jsonl,
                                                                                monkeypatch):
    """``--model ./sft``: PEFT records the base as given, relative to the working directory, where
    the adapter could not be found from any other; the saved adapter (checkpoints and final/) names
    the base's absolute path, and a run from another directory trains on from it."""
    work, elsewhere = tmp_path / "work", tmp_path / "elsewhere"
    work.mkdir(), elsewhere.mkdir()
    (work / "sft").symlink_to(base_model.resolve(), target_is_directory=True)
    monkeypatch.chdir(work)
    out = tmp_path / "lora"
    run_training(*flags("./sft", train_jsonl, out, tmp_path / "cache", "--lora-r", "4", "--max-steps", "1"))
    for saved in (out / "final", *out.glob("checkpoints/step-*")):
        named = json.loads((saved / "adapter_config.json").read_text())["base_model_name_or_path"]
        assert named == str(work.resolve() / "sft"), (saved, named)  # the link's name kept
    monkeypatch.chdir(elsewhere)
    out2 = tmp_path / "continued"
    run_training(*flags(base_model, train_jsonl, out2, tmp_path / "cache", "--model", str(out / "final"),
                        "--max-steps", "1"))
    assert train_records(out2)[0]["step"] == 1


# ---------------------------------------------------------------------------------- every loss


@pytest.fixture(scope="module")
def shared_cache(tmp_path_factory):
    """One cache for every reference-based loss: built by the first, reused by the rest."""
    return tmp_path_factory.mktemp("loss-cache")


def _train_two_steps(tmp_path, base_model, train_jsonl, cache, *extra):
    out = tmp_path / "run"
    run_training(*flags(base_model, train_jsonl, out, cache, "--max-steps", "2", *extra))
    recs = train_records(out)
    assert [r["step"] for r in recs] == [1, 2]
    assert all(math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) for r in recs)
    diff = max_abs_diff(load_tensors(out / "final" / "model.safetensors"),
                        load_tensors(base_model / "model.safetensors"))
    assert diff > 0, "the weights did not change"
    return out, recs


NLL_LOSSES = {"sft", "orpo"}


@pytest.mark.parametrize("name", list(LOSSES))
def test_every_loss_trains(name, tmp_path, base_model, train_jsonl, shared_cache):
    reference_free = not LOSSES[name].needs_reference
    cache = tmp_path / "empty-cache" if reference_free else shared_cache
    out, recs = _train_two_steps(tmp_path, base_model, train_jsonl, cache, "--loss", name)
    info = run_json(out)
    assert info["loss"] == f"{name}:1"
    if reference_free:
        assert info["reference"]["source"] == "none (reference-free loss)"
        assert namespace_dirs(cache) == [], "a reference-free loss created a cache namespace"
    else:
        assert info["reference"]["source"] == "cache"
        assert info["reference"]["forward_passes_during_training"] == 0
    assert ("sft_loss" in recs[0]) == (name in NLL_LOSSES)


def test_combined_loss_and_rpo(tmp_path, base_model, train_jsonl, shared_cache):
    out, recs = _train_two_steps(tmp_path / "combo", base_model, train_jsonl, shared_cache,
                                 "--loss", "sigmoid:1,sft:0.5")
    assert run_json(out)["loss"] == "sigmoid:1,sft:0.5"
    first = recs[0]
    assert "sft_loss" in first
    # Step 1 is at the reference: sigmoid contributes log 2, sft 0.5 * its NLL.
    assert first["loss"] == pytest.approx(math.log(2) + 0.5 * first["sft_loss"], abs=1e-5)

    out, recs = _train_two_steps(tmp_path / "rpo", base_model, train_jsonl, shared_cache, "--loss.rpo_alpha", "0.5")
    assert run_json(out)["config"]["loss"]["rpo_alpha"] == 0.5
    first = recs[0]
    assert first["loss"] == pytest.approx(math.log(2) + 0.5 * first["sft_loss"], abs=1e-5)


# ----------------------------------------------------------------------------------- divergence


def _nan_at_call(monkeypatch, n: int) -> None:
    real = objective_mod.preference_loss
    calls = {"n": 0}

    def wrapped(*args, **kwargs):
        calls["n"] += 1
        losses, rc, rr = real(*args, **kwargs)
        return (losses * float("nan") if calls["n"] == n else losses), rc, rr

    monkeypatch.setattr(objective_mod, "preference_loss", wrapped)


def test_nan_loss_stops_with_the_last_good_checkpoint(tmp_path, base_model, train_jsonl, monkeypatch):
    from dpocache.models.checkpoint import STATE_FILE

    _nan_at_call(monkeypatch, 3)
    out = tmp_path / "run"
    with pytest.raises(train_mod.TrainingDiverged) as err:
        run_training(*flags(base_model, train_jsonl, out, tmp_path / "cache", "--max-steps", "6", "--save-steps", "2"))
    ckpt = out / "checkpoints" / "step-000002"
    message = str(err.value)
    assert "step 3" in message and str(ckpt) in message
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-000002"]
    assert not (out / "final").exists()
    state = json.loads((ckpt / STATE_FILE).read_text())
    assert state["step"] == 2
    weights = load_tensors(ckpt / "model.safetensors")
    assert weights and all(torch.isfinite(t).all() for t in weights.values())
    assert [r["step"] for r in train_records(out)] == [1, 2]  # nothing logged for the bad step


def test_nan_loss_cli_exit_code(tmp_path, base_model, train_jsonl, monkeypatch, capsys):
    _nan_at_call(monkeypatch, 1)
    argv = flags(base_model, train_jsonl, tmp_path / "run", tmp_path / "cache", "--max-steps", "2")
    assert cli_main(["train", *argv]) == 1
    err = capsys.readouterr().err
    assert "step 1" in err and "not finite" in err and "no checkpoint" in err


# -------------------------------------------------------------------------- gradient accumulation


def test_grad_accum_matches_a_bigger_batch(tmp_path, base_model, train_jsonl):
    cache = tmp_path / "cache"
    firsts = []
    for name, bs, accum in (("big", "8", "1"), ("accum", "4", "2")):
        out = tmp_path / name
        run_training(*flags(base_model, train_jsonl, out, cache, "--batch-size", bs, "--grad-accum", accum,
                            "--max-steps", "1"))
        firsts.append(train_records(out)[0])
    big, accum = firsts
    for key in ("loss", "grad_norm", "rewards/margins", "logps/chosen", "logps/rejected"):
        assert accum[key] == pytest.approx(big[key], abs=1e-5, rel=1e-5), key


def test_moe_policy_adds_and_logs_its_router_loss(tmp_path, train_jsonl):
    """A mixture-of-experts policy: the step loss includes router_aux_loss_coef * aux_loss (the
    model's own load-balancing loss), and aux_loss is logged."""
    from dpocache.models.tiny import save_tiny_model

    model = save_tiny_model(tmp_path / "moe", "mixtral")
    out = tmp_path / "run"
    run_training(*flags(model, train_jsonl, out, tmp_path / "cache", "--max-steps", "2"))
    recs = train_records(out)
    assert all("aux_loss" in r and math.isfinite(r["aux_loss"]) and r["aux_loss"] > 0 for r in recs)
    # Step 1 runs at the reference: the preference loss is log 2 and the aux loss is logged
    # separately (the logged loss is the preference loss alone).
    assert recs[0]["loss"] == pytest.approx(math.log(2), abs=1e-5)
    assert abs(recs[0]["rewards/margins"]) <= 1e-6

    # The router loss reaches the gradient: with a 1000x coefficient step 1's grad norm differs
    # (at the default 0.001 the difference can be as small as 2e-7 relative on this tiny model).
    big_aux = save_tiny_model(tmp_path / "moe-big-aux", "mixtral", router_aux_loss_coef=1.0)
    out0 = tmp_path / "run-big-aux"
    run_training(*flags(big_aux, train_jsonl, out0, tmp_path / "cache", "--max-steps", "1"))
    assert train_records(out0)[0]["grad_norm"] != pytest.approx(recs[0]["grad_norm"], rel=1e-3)


def test_a_fresh_run_refuses_an_output_dir_with_an_earlier_run(tmp_path, base_model, train_jsonl, shared_cache):
    out = tmp_path / "run"
    args = flags(base_model, train_jsonl, out, shared_cache, "--max-steps", "2", "--save-steps", "1")
    run_training(*args)
    with pytest.raises(FileExistsError, match="--resume"):
        run_training(*args)
    assert cli_main(["train", *args]) == 2
    # --train.overwrite starts afresh: the earlier metrics and checkpoints are gone, not mixed in.
    run_training(*args, "--train.overwrite", "true", "--max-steps", "1")
    assert [r["step"] for r in train_records(out)] == [1]
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-000001"]


def test_an_output_dir_with_an_earlier_run_is_refused_before_any_model_loads(tmp_path, base_model, train_jsonl,
                                                                             shared_cache, monkeypatch, capsys):
    out = tmp_path / "run"
    run_training(*flags(base_model, train_jsonl, out, shared_cache, "--max-steps", "1"))
    capsys.readouterr()
    monkeypatch.setattr(setup_mod, "load_policy", lambda *a, **k: pytest.fail("the policy was loaded"))
    fresh_cache = tmp_path / "fresh-cache"  # a reference pass would write its shards here
    assert cli_main(["train", *flags(base_model, train_jsonl, out, fresh_cache, "--max-steps", "1")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--train.overwrite" in err
    assert not list(fresh_cache.rglob("*.safetensors"))


def test_overwrite_leaves_nothing_of_the_earlier_run(tmp_path, base_model, train_jsonl, shared_cache):
    """A LoRA run, then a full fine-tuning run over it with --train.overwrite: final/ holds the new
    model only (an adapter_config.json left beside it makes transformers load the old adapter)."""
    from transformers import AutoModelForCausalLM

    out = tmp_path / "run"
    run_training(*flags(base_model, train_jsonl, out, shared_cache, "--max-steps", "1", "--lora-r", "4"))
    (out / "tensorboard").mkdir()
    (out / "tensorboard" / "events.out.tfevents.earlier").write_bytes(b"")
    run_training(*flags(base_model, train_jsonl, out, shared_cache, "--max-steps", "2", "--train.overwrite", "true"))
    assert not (out / "final" / "adapter_config.json").exists() and not (out / "tensorboard").exists()
    loaded = AutoModelForCausalLM.from_pretrained(str(out / "final"))
    assert type(loaded).__name__ == "LlamaForCausalLM"
    saved = load_tensors(out / "checkpoints" / "step-000002" / "model.safetensors")
    assert max_abs_diff({k: v for k, v in loaded.state_dict().items() if k in saved}, saved) == 0
    assert run_json(out)["final"]["step"] == 2


def test_push_to_hub_fails_clearly_and_keeps_the_checkpoint(tmp_path, base_model, train_jsonl, shared_cache, capsys):
    """No Hub here (or no token): the run still writes everything, then exits 1 naming the repo
    and where the checkpoint is."""
    out = tmp_path / "run"
    args = flags(base_model, train_jsonl, out, shared_cache, "--max-steps", "1",
                 "--push-to-hub", "someone/dpocache-test")
    assert cli_main(["train", *args]) == 1
    err = capsys.readouterr().err
    assert "someone/dpocache-test" in err and str(out / "final") in err
    assert (out / "final" / "model.safetensors").exists() and (out / "run.json").exists()


@pytest.mark.parametrize("ratio, total, expected", [(0.05, 9, 1), (0.1, 25, 3), (0.1, 30, 3), (0, 10, 0), (1, 7, 7)])
def test_warmup_steps_round_up(ratio, total, expected):
    from dpocache.models.policy import warmup_steps

    assert warmup_steps(ratio, total) == expected


def test_linear_schedule_warms_up_then_decays_to_zero():
    from dpocache.models.policy import lr_multiplier

    got = [lr_multiplier(s, 6, 3, "linear") for s in range(6)]
    assert got == pytest.approx([1 / 3, 2 / 3, 1.0, 1.0, 2 / 3, 1 / 3])
    cosine = [lr_multiplier(s, 10, 2, "cosine") for s in range(10)]
    assert cosine[:2] == pytest.approx([0.5, 1.0])
    assert cosine[2:] == pytest.approx([0.5 * (1 + math.cos(math.pi * (s - 2) / 8)) for s in range(2, 10)])


@pytest.mark.parametrize("pairs, batch", [(15, 8), (16, 8), (17, 4), (5, 5), (9, 6)])
def test_every_epoch_covers_every_pair_in_whole_batches(pairs, batch):
    from dpocache.data.order import epoch_order, steps_per_epoch, training_order

    for epoch in range(3):
        order = epoch_order(pairs, 42, epoch, batch)
        assert len(order) == steps_per_epoch(pairs, batch) * batch and len(order) - pairs < batch
        assert sorted(set(order)) == list(range(pairs))
        assert order[:pairs] == training_order(pairs, 42, epoch)  # the permutation, then its first pairs again
        assert order[pairs:] == order[:len(order) - pairs]


def test_an_epoch_trains_on_every_pair(tmp_path, base_model, train_jsonl, monkeypatch):
    """24 pairs in batches of 5: 5 steps, the last filled up with one pair (the remainder of 4
    was dropped before, untrained in every epoch)."""
    seen = []
    real = prefetch.step_indices

    def recording(run, step, micro):
        seen.append(real(run, step, micro))
        return seen[-1]

    monkeypatch.setattr(prefetch, "step_indices", recording)
    out = tmp_path / "run"
    run_training(*flags(base_model, train_jsonl, out, tmp_path / "cache", "--batch-size", "5"))
    data = run_json(out)["data"]
    assert (data["train_pairs"], data["steps_per_epoch"], data["train_repeated_per_epoch"]) == (24, 5, 1)
    trained = [i for batch in seen for i in batch]
    assert len(trained) == 25 and sorted(set(trained)) == list(range(24))
    assert [r["step"] for r in train_records(out)] == [1, 2, 3, 4, 5]


def test_settings_a_run_cannot_act_on_are_named():
    from dpocache.config import build_config
    from dpocache.distributed.process_group import DistEnv

    one = DistEnv()
    cfg = build_config(None, ["--eval-steps", "5", "--fsdp"])
    notes = setup_mod.unused_settings(cfg, one)
    assert len(notes) == 2 and "--eval-steps (train.eval_steps) 5" in notes[0] and "--fsdp" in notes[1]
    assert setup_mod.unused_settings(build_config(None, ["--eval-steps", "5", "--eval-data", "e.jsonl"]), one) == []
    # a sweep's --ref-model carried over to a reference-free loss (it was silently unused)
    free = build_config(None, ["--loss", "simpo", "--ref-model", "sft2"])
    assert setup_mod.unused_settings(free, one) == ["--ref-model (model.ref_model) sft2 has no effect: the loss "
                                                    "'simpo' reads no reference"]
    assert setup_mod.unused_settings(build_config(None, ["--loss", "ipo", "--ref-model", "sft2"]), one) == []
    # a learning rate of 0 trains nothing (said, not refused: a run that only measures or logs)
    assert setup_mod.unused_settings(build_config(None, ["--lr", "0"]), one) == [
        "--lr (optim.lr) 0: no step changes the weights; the loss and rewards are the initial model's throughout"]
    assert setup_mod.unused_settings(build_config(None, ["--lr", "0", "--max-steps", "0"]), one) == []


def test_summary_shows_the_eval_before_and_after_and_where_a_run_resumed(tmp_path, base_model, train_jsonl,
                                                                          eval_jsonl, capsys):
    """The held-out set before the first update and at the end, and a resumed run's checkpoint, in
    the summary itself (they were in metrics.jsonl and among stderr's bars)."""
    out, cache = tmp_path / "run", tmp_path / "cache"
    common = flags(base_model, train_jsonl, out, cache, "--eval-data", str(eval_jsonl), "--save-steps", "2")
    assert cli_main(["train", *common, "--max-steps", "2"]) == 0
    first = capsys.readouterr().out
    assert cli_main(["train", *common, "--max-steps", "4", "--resume"]) == 0
    resumed = capsys.readouterr().out
    evals = eval_records(out)
    start, end = evals[0], evals[-1]
    assert start["step"] == 0 and end["step"] == 4

    def line(before, after):  # a figure that rounds to zero is 0.000 (it was -0.000 at step 0, if a hair below)
        return (f"eval: reward accuracy {before['eval/rewards/accuracies']:.3f} -> "
                f"{after['eval/rewards/accuracies']:.3f}, margin {before['eval/rewards/margins']:.3f} -> "
                f"{after['eval/rewards/margins']:.3f}").replace(" -0.000", " 0.000")

    assert line(start, evals[1]) in first and "resumed from" not in first and "-0.000" not in first
    held_out = len(eval_jsonl.read_text().splitlines())
    assert f"skipped); {held_out} held-out pairs\n" in first  # the data line counts them too
    assert line(start, end) in resumed  # the first attempt's step 0, kept in metrics.jsonl
    assert f"resumed from {out / 'checkpoints' / 'step-000002'} (step 2)" in resumed


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_models_checkpoints_and_exports_are_written_as_the_umask_allows(tmp_path, base_model, train_jsonl, lora):
    """Every file of final/, of a checkpoint and of a safetensors export has mode 0666 less the
    umask: safetensors created the weights and the optimizer state 0600, so a model trained on
    shared storage could not be read by the team (its config and tokenizer could)."""
    import os
    import stat

    out, cache, export = tmp_path / "run", tmp_path / "cache", tmp_path / "ref.safetensors"
    old = os.umask(0o027)  # a group that reads: 0640
    try:
        assert cli_main(["train", *flags(base_model, train_jsonl, out, cache, "--max-steps", "1",
                                         *(("--lora-r", "4") if lora else ()))]) == 0
        assert cli_main(["cache", "export", "--model", str(base_model), "--data", str(train_jsonl), "--cache-dir",
                         str(cache), "--out", str(export)]) == 0
    finally:
        os.umask(old)
    files = [f for f in [*(out / "final").iterdir(), *(out / "checkpoints").rglob("*"), export] if f.is_file()]
    weights = "adapter_model.safetensors" if lora else "model.safetensors"
    assert {weights, "optimizer.safetensors", "tokenizer.json"} <= {f.name for f in files}
    assert {f.name: oct(stat.S_IMODE(f.stat().st_mode)) for f in files} == {f.name: "0o640" for f in files}


def test_a_run_says_its_steps_and_global_batch_before_the_first(tmp_path, base_model, train_jsonl, capsys):
    """The global batch by its factors, before any step: a recipe for 64 processes run on 8
    trained at an eighth of its batch without a word (open-instruct's Tulu 3 is 128 pairs)."""
    from dpocache.config import build_config

    cfg = build_config(None, ["--batch-size", "1", "--grad-accum", "2"])
    assert setup_mod.describe_batch(cfg, 64, 2100, 2100) == (
        "train: 2,100 steps of 128 pairs (1 a device x 2 accumulated x 64 processes), 2,100 an epoch")
    assert cli_main(["train", *flags(base_model, train_jsonl, tmp_path / "run", tmp_path / "cache", "--max-steps", "1",
                                     "--batch-size", "2", "--grad-accum", "2")]) == 0
    pairs = len(train_jsonl.read_text().splitlines())
    assert (f"train: 1 step of 4 pairs (2 a device x 2 accumulated x 1 process), {-(-pairs // 4)} an epoch"
            in capsys.readouterr().err)


def test_a_run_of_no_step_evaluates_once_and_writes_no_model(tmp_path, base_model, train_jsonl, eval_jsonl,
                                                              capsys):
    """--max-steps 0: the held-out set evaluated once, or the reference pass alone; no checkpoint
    and no final/ (they were written, a copy of the initial model: an 8B model's 16 GB)."""
    out, cache = tmp_path / "run", tmp_path / "cache"
    assert cli_main(["train", *flags(base_model, train_jsonl, out, cache, "--eval-data", str(eval_jsonl)),
                     "--max-steps", "0"]) == 0
    printed = capsys.readouterr().out
    written = sorted(p.name for p in out.iterdir() if not p.name.startswith("."))  # .dpocache-run.lock stays
    assert written == ["metrics.jsonl", "run.json"]
    (row,) = eval_records(out)
    assert row["step"] == 0
    assert "done: 0 steps (--max-steps 0): the held-out set evaluated; no model written" in printed
    assert f"eval: reward accuracy {row['eval/rewards/accuracies']:.3f}, margin" in printed and "->" not in printed
    assert json.loads((out / "run.json").read_text())["final"]["output"] is None
    # without held-out data: the reference pass into the cache, and nothing else
    assert cli_main(["train", *flags(base_model, train_jsonl, tmp_path / "run2", tmp_path / "cache2"),
                     "--max-steps", "0"]) == 0
    assert "the reference log-probs in the cache; no model written" in capsys.readouterr().out
    assert [p.name for p in (tmp_path / "run2").iterdir() if not p.name.startswith(".")] == ["run.json"]
    assert any((tmp_path / "cache2").iterdir())
    from dpocache.config import ConfigError, build_config

    with pytest.raises(ConfigError, match="a run of no step writes no model to push"):
        build_config(None, ["--max-steps", "0", "--push-to-hub", "org/name"]).validate()


@pytest.mark.parametrize("evals", [True, False], ids=["with-evals", "no-eval"])
def test_every_module_trains_in_a_step_and_evaluates_in_an_eval(tmp_path, base_model, train_jsonl, eval_jsonl,
                                                              monkeypatch, evals):  # noqa: F811
    """Training mode is set once by setup (a loaded model comes in eval mode) and again only
    after an eval (train_step skips the walk over every module otherwise): each step's and each
    eval's forward finds every module of the scorer in its own mode, with evals at the start,
    between steps and at the end, and with none (the first step's mode is setup's alone); the
    parameters clipped and watched are the ones the optimizer steps."""
    seen, runs = [], []
    real = train_mod.batch_losses

    def watched(run, *args, **kwargs):
        runs.append(run)
        modes = {m.training for m in run.scorer.modules()}
        seen.append(("eval" if kwargs.get("prefix") == "eval/" else "train", modes))
        return real(run, *args, **kwargs)

    monkeypatch.setattr(train_mod, "batch_losses", watched)
    extra = ("--eval-data", str(eval_jsonl), "--eval-steps", "2") if evals else ()
    run_training(*flags(base_model, train_jsonl, tmp_path / "out", tmp_path / "cache", *extra, "--max-steps", "4",
                        "--lora-r", "4"))
    kinds = [kind for kind, _ in seen]
    assert kinds.count("train") == 4
    if evals:
        assert kinds[0] == kinds[-1] == "eval" and "eval" in kinds[kinds.index("train"):-1]  # and between steps
    else:
        assert set(kinds) == {"train"}
    assert all(modes == ({True} if kind == "train" else {False}) for kind, modes in seen), seen
    run = runs[0]
    stepped = [p for group in run.optimizer.param_groups for p in group["params"]]
    assert {id(p) for p in run.trainable} == {id(p) for p in stepped} and len(run.trainable) == len(stepped)
    assert [id(p) for p in run.trainable] == [id(p) for p in run.policy.parameters() if p.requires_grad]


def test_the_logged_learning_rate_is_the_windows_last_steps(tmp_path, base_model, train_jsonl):
    """A window of two steps logs the rate its last step trained at, as Hugging Face's Trainer
    logs the current one: the mean over the window hid a warm-up's peak (0.000375 logged where
    the step trained at 5e-4)."""
    out = tmp_path / "run"
    run_training(*flags(base_model, train_jsonl, out, tmp_path / "cache", "--max-steps", "4", "--logging-steps", "2",
                        "--optim.warmup_ratio", "0.5"))
    # warm-up over steps 1 and 2 at 1/2 and 2/2 of the peak, then linear decay to 0 at step 4
    # (step 3 at 1 - 0/2, step 4 at 1 - 1/2)
    assert [(r["step"], r["lr"]) for r in train_records(out)] == [(2, pytest.approx(1e-3)), (4, pytest.approx(5e-4))]
