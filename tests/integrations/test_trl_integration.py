"""``dpocache.integrations.trl.CachedDPOTrainer`` against TRL 1.16's own DPOTrainer on a tiny
model (fp32, CPU). Skipped when TRL is not installed (``pip install 'dpocache[trl]'``)."""

from __future__ import annotations

import json
import math
import os
import re

import pytest
import torch

pytest.importorskip("trl")

from train_fixtures import one_thread  # noqa: E402,F401

from dpocache.models import reference as reference_mod  # noqa: E402

ROWS = 12


@pytest.fixture(scope="module")
def setup(tmp_path_factory, model_dir, pref_rows):
    from datasets import Dataset

    return model_dir, Dataset.from_list(pref_rows[:ROWS]), tmp_path_factory.mktemp("trl")


def _args(out, **extra):
    from trl import DPOConfig

    settings = dict(output_dir=str(out), per_device_train_batch_size=4, max_steps=1, logging_steps=1,
                    report_to="none", use_cpu=True, max_length=24, learning_rate=1e-6, save_strategy="no",
                    bf16=False, fp16=False, seed=0, disable_tqdm=True)
    return DPOConfig(**{**settings, **extra})


def _trainer(cls, model_dir, dataset, out, bf16=False, **kwargs):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return cls(model=model, args=_args(out, precompute_ref_log_probs=True, bf16=bf16), train_dataset=dataset,
               processing_class=AutoTokenizer.from_pretrained(model_dir), **kwargs)


def test_reference_values_equal_trls_precompute(setup):
    from trl import DPOTrainer

    from dpocache.integrations.trl import CachedDPOTrainer

    model_dir, dataset, root = setup
    theirs = _trainer(DPOTrainer, model_dir, dataset, root / "trl").train_dataset
    ours = _trainer(CachedDPOTrainer, model_dir, dataset, root / "ours", cache_dir=root / "cache").train_dataset
    assert any(len(p) + len(c) > 24 for p, c in zip(ours["prompt_ids"], ours["chosen_ids"]))  # truncation applies
    for col in ("ref_chosen_logps", "ref_rejected_logps"):
        torch.testing.assert_close(torch.tensor(ours[col]), torch.tensor(theirs[col]), rtol=0, atol=1e-4)


def test_default_cache_dtype_follows_bf16_args_as_trls_precompute(setup, caplog):
    """DPOConfig's default bf16=True runs TRL's reference (and policy) under bf16 autocast: the
    cache follows args, so its values are TRL's own precompute's; an explicit other dtype warns."""
    from trl import DPOTrainer

    from dpocache.integrations.trl import CachedDPOTrainer

    model_dir, dataset, root = setup
    theirs = _trainer(DPOTrainer, model_dir, dataset, root / "trl-bf16", bf16=True).train_dataset
    with caplog.at_level("WARNING", logger="dpocache.integrations.trl"):
        ours = _trainer(CachedDPOTrainer, model_dir, dataset, root / "ours-bf16", bf16=True,
                        cache_dir=root / "cache-bf16")
    assert ours._cache_dtype == torch.bfloat16 and not caplog.records
    # The dtype itself is asserted above; float32 values differ by 7e-3 here. Under bf16 autocast
    # the two passes' kernels round apart by up to 1.9e-3 on sums of about 50 (transformers 5.24,
    # one value of eight, seen in two runs), within the 2.5e-3 allowed.
    for col in ("ref_chosen_logps", "ref_rejected_logps"):
        torch.testing.assert_close(torch.tensor(ours.train_dataset[col]), torch.tensor(theirs[col]),
                                   rtol=0, atol=2.5e-3)
    with caplog.at_level("WARNING", logger="dpocache.integrations.trl"):
        explicit = _trainer(CachedDPOTrainer, model_dir, dataset, root / "explicit", bf16=True,
                            cache_dir=root / "cache-bf16", cache_dtype="float32")
    assert explicit._cache_dtype == torch.float32
    [record] = caplog.records
    assert "cache_dtype='float32'" in record.getMessage() and "bf16=True" in record.getMessage()
    assert "\n" not in record.getMessage()


def test_step0_loss_is_log2_and_second_construction_runs_no_reference(setup, monkeypatch):
    from dpocache.integrations.trl import CachedDPOTrainer

    model_dir, dataset, root = setup
    first = _trainer(CachedDPOTrainer, model_dir, dataset, root / "first", cache_dir=root / "cache2")
    kept = len(first.train_dataset)  # TRL drops rows whose prompt alone fills max_length
    assert 0 < kept <= ROWS and first.cache_summaries["train"].computed == kept
    first.train()
    loss = next(r["loss"] for r in first.state.log_history if "loss" in r)
    assert loss == pytest.approx(math.log(2), abs=1e-4)  # policy = reference at step 0

    def refuse(*args, **kwargs):
        raise AssertionError("the reference model was loaded although the cache is complete")

    monkeypatch.setattr(reference_mod.ReferenceModel, "from_pretrained", refuse)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    calls = []
    model.register_forward_pre_hook(lambda *a: calls.append(1))
    shuffled = dataset.shuffle(seed=3)
    second = CachedDPOTrainer(model=model, args=_args(root / "second", precompute_ref_log_probs=True),
                              train_dataset=shuffled, processing_class=AutoTokenizer.from_pretrained(model_dir),
                              cache_dir=root / "cache2")
    assert calls == [] and second.cache_summaries["train"].computed == 0
    assert second.cache_summaries["train"].reused == kept


@pytest.fixture(scope="module")
def adapter_dir(setup):
    """A LoRA adapter on the model with non-zero B matrices (a trained one), saved."""
    from test_reference_initial import make_adapter

    model_dir, _, root = setup
    return make_adapter(model_dir, root / "sft-lora")


def _step0_loss(trainer):
    trainer.train()
    return next(r["loss"] for r in trainer.state.log_history if "loss" in r)


def test_model_changed_in_memory_is_refused(setup, adapter_dir):
    """TRL's reference is the model object; dpocache's, the files it came from: a merged adapter
    (name_or_path still the base) or a weight edited in memory is refused in one line."""
    from peft import AutoPeftModelForCausalLM
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dpocache.integrations.trl import CachedDPOTrainer

    model_dir, dataset, root = setup
    merged = AutoPeftModelForCausalLM.from_pretrained(str(adapter_dir), dtype=torch.float32).merge_and_unload()
    edited = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        edited.model.norm.weight.mul_(1.01)  # a 1-D tensor, 64 values: one change among few
    for model in (merged, edited):
        with pytest.raises(ValueError, match="model's weights differ from those in") as err:
            CachedDPOTrainer(model=model, args=_args(root / "changed"), train_dataset=dataset,
                             processing_class=AutoTokenizer.from_pretrained(model_dir), cache_dir=root / "c3")
        assert "save_pretrained" in str(err.value) and "\n" not in str(err.value)
        assert "ref_model=" in str(err.value)  # a reference that differs on purpose: TRL's own argument


def test_weight_check_reads_bin_checkpoints_too(setup, tmp_path):
    """pytorch_model.bin is compared memory-mapped as safetensors are; a legacy (pre-zipfile) one,
    which cannot be memory-mapped, is not compared (construction then warns) rather than loaded."""
    from transformers import AutoModelForCausalLM

    from dpocache.integrations.trl import _base_tensors, _differs

    model = AutoModelForCausalLM.from_pretrained(setup[0], dtype=torch.float32)
    torch.save(model.state_dict(), tmp_path / "new.bin")
    torch.save(model.state_dict(), tmp_path / "legacy.bin", _use_new_zipfile_serialization=False)
    assert _differs([tmp_path / "new.bin"], _base_tensors(model)) == (None, len(model.state_dict()))
    with torch.no_grad():
        model.model.layers[1].self_attn.o_proj.weight[-1, 3] += 1
    assert _differs([tmp_path / "new.bin"], _base_tensors(model))[0] == "model.layers.1.self_attn.o_proj.weight"
    assert _differs([tmp_path / "legacy.bin"], _base_tensors(model)) == (None, 0)


def test_trained_peft_adapter_needs_its_directory_and_then_starts_at_log2(setup, adapter_dir):
    """A PeftModel loaded from an adapter directory has name_or_path = the base, but TRL's
    reference is base + adapter: without cache_reference it is refused; with it, step 0 is log 2."""
    from peft import AutoPeftModelForCausalLM
    from transformers import AutoTokenizer

    from dpocache.integrations.trl import CachedDPOTrainer

    model_dir, dataset, root = setup

    def trainer(**kwargs):
        model = AutoPeftModelForCausalLM.from_pretrained(str(adapter_dir), dtype=torch.float32, is_trainable=True)
        return CachedDPOTrainer(model=model, args=_args(root / "peft"), train_dataset=dataset,
                                processing_class=AutoTokenizer.from_pretrained(model_dir), cache_dir=root / "c4",
                                **kwargs)

    with pytest.raises(ValueError, match="trained PEFT adapter.*pass cache_reference="):
        trainer()
    handled = trainer(cache_reference=adapter_dir)
    assert handled.cache_summaries["train"].computed == len(handled.train_dataset)
    assert _step0_loss(handled) == pytest.approx(math.log(2), abs=1e-4)


def test_fresh_lora_takes_the_base_as_reference(setup):
    """A fresh LoRA (peft_config=, or get_peft_model before the trainer) starts at its base."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dpocache.integrations.trl import CachedDPOTrainer

    model_dir, dataset, root = setup
    lora = LoraConfig(r=4, lora_alpha=16, target_modules="all-linear", task_type="CAUSAL_LM")
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32), lora)
    trainer = CachedDPOTrainer(model=model, args=_args(root / "fresh"), train_dataset=dataset,
                               processing_class=AutoTokenizer.from_pretrained(model_dir), cache_dir=root / "c5")
    assert _step0_loss(trainer) == pytest.approx(math.log(2), abs=1e-4)


def test_model_given_as_its_directory(setup):
    """TRL loads a model given as a path itself: that directory is the reference, unchecked."""
    from transformers import AutoTokenizer

    from dpocache.integrations.trl import CachedDPOTrainer

    model_dir, dataset, root = setup
    trainer = CachedDPOTrainer(model=model_dir, args=_args(root / "by-path"), train_dataset=dataset,
                               processing_class=AutoTokenizer.from_pretrained(model_dir), cache_dir=root / "c6")
    assert trainer.cache_summaries["train"].computed == len(trainer.train_dataset)
    with pytest.raises(ValueError, match="ref_model must be a loaded model"):
        CachedDPOTrainer(model=model_dir, ref_model=model_dir, args=_args(root / "by-path"), train_dataset=dataset,
                         processing_class=AutoTokenizer.from_pretrained(model_dir), cache_dir=root / "c6")


def test_the_reference_runs_the_models_own_kernels(setup, reference_kernels_asked):
    """Liger's kernels (``--kernels auto`` elsewhere, on a GPU) are never applied to the reference
    beside TRL's policy: its RoPE patch replaces the model module's function for the process."""
    from dpocache.integrations.trl import CachedDPOTrainer

    model_dir, dataset, root = setup
    _trainer(CachedDPOTrainer, model_dir, dataset, root / "kernels", cache_dir=root / "c-kernels")
    assert reference_kernels_asked == ["none"]


def test_callers_config_is_not_changed(setup):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dpocache.integrations.trl import CachedDPOTrainer

    model_dir, dataset, root = setup
    args = _args(root / "own-args")
    trainer = CachedDPOTrainer(model=AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32), args=args,
                               train_dataset=dataset, processing_class=AutoTokenizer.from_pretrained(model_dir),
                               cache_dir=root / "cache")
    assert args.precompute_ref_log_probs is False and trainer.args.precompute_ref_log_probs is True


def test_other_trl_versions_fail_clearly():
    from dpocache.integrations.trl import check_trl_version

    with pytest.raises(RuntimeError, match="supports TRL 1.16.x; found TRL 0.19.1") as err:
        check_trl_version("0.19.1")
    assert "pip install -e '.[trl]'" in str(err.value)  # the extra as a user of a clone installs it


def test_stock_dpotrainer_does_not_read_exported_columns(setup):
    """What the README says of `cache export` files and TRL 1.16: stock DPOTrainer ignores the
    columns without precompute (step-0 loss is log 2 although the columns are wrong) and refuses
    them with it (it recomputes, then finds the columns twice)."""
    from trl import DPOTrainer

    model_dir, dataset, root = setup
    wrong = dataset.add_column("ref_chosen_logps", [-50.0] * len(dataset))
    wrong = wrong.add_column("ref_rejected_logps", [0.0] * len(wrong))  # read, they would give a loss near 0
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ignored = DPOTrainer(model=AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
                         args=_args(root / "stock"), train_dataset=wrong,
                         processing_class=AutoTokenizer.from_pretrained(model_dir))
    ignored.train()
    loss = next(r["loss"] for r in ignored.state.log_history if "loss" in r)
    assert loss == pytest.approx(math.log(2), abs=1e-4)
    with pytest.raises(ValueError, match="duplicated columns"):
        _trainer(DPOTrainer, model_dir, wrong, root / "stock-pre")


def test_trainer_says_where_its_reference_values_came_from(setup, capsys, caplog):
    """Once per data set, on stderr and through the logger, in the CLI's words."""
    from dpocache.integrations.trl import CachedDPOTrainer

    model_dir, dataset, root = setup
    cache = root / "cache-report"
    with caplog.at_level("INFO", logger="dpocache.integrations.trl"):
        trainer = _trainer(CachedDPOTrainer, model_dir, dataset, root / "report-1", cache_dir=cache)
    first = capsys.readouterr().err
    _trainer(CachedDPOTrainer, model_dir, dataset, root / "report-2", cache_dir=cache)
    again = capsys.readouterr().err
    n, where = len(trainer.train_dataset), trainer.cache_summaries["train"].cache_dir
    assert where.startswith(str(cache))
    assert f"reference (train): {n} pairs from the cache ({n} computed, 0 reused) in {where}" in first
    assert f"reference (train): {n} pairs from the cache (0 computed, {n} reused) in {where}" in again
    assert first.count("reference (train)") == 1
    assert any("pairs from the cache" in r.getMessage() for r in caplog.records)


def test_what_a_fixed_cache_cannot_serve_is_refused_before_any_model_loads(setup, monkeypatch):
    """A synced reference (TR-DPO), a streamed data set and images: one line in dpocache's words,
    where TRL's own would tell the caller to set precompute_ref_log_probs=False, which this trainer
    sets itself; raised before TRL or the reference loads a model."""
    from datasets import Dataset, IterableDataset
    from trl import DPOTrainer

    from dpocache.integrations.trl import CachedDPOTrainer

    model_dir, dataset, root = setup
    monkeypatch.setattr(DPOTrainer, "__init__", lambda *a, **k: pytest.fail("TRL was reached"))
    streamed = IterableDataset.from_generator(lambda: iter([{"prompt": "a", "chosen": " b", "rejected": " c"}]))
    with_images = Dataset.from_list([{"prompt": "a", "chosen": " b", "rejected": " c", "images": [None]}])
    user = [{"role": "user", "content": "a"}]
    tulu = Dataset.from_list([{"prompt": "a", "chosen": user + [{"role": "assistant", "content": "b"}],
                               "rejected": user + [{"role": "assistant", "content": "c"}]}])
    cases = {
        "sync_ref_model=True would copy the policy into the reference during training \\(TR-DPO\\)":
            dict(args=_args(root / "x", sync_ref_model=True), train_dataset=dataset),
        "train_dataset is an IterableDataset, whose pairs cannot be keyed before training":
            dict(args=_args(root / "x"), train_dataset=streamed),
        "eval_dataset\\['held'\\] has images; the reference cache scores text only":
            dict(args=_args(root / "x"), train_dataset=dataset, eval_dataset={"held": with_images}),
        # TRL's own: "can only concatenate str (not "list") to str", deep in its tokenization
        "train_dataset gives the prompt as text and chosen as messages \\(as Tulu 3's preference mixtures do\\), "
        "which TRL's DPOTrainer cannot tokenize; take the prompt from the messages first: "
        "train_dataset.map\\(trl.maybe_extract_prompt\\)":
            dict(args=_args(root / "x"), train_dataset=tulu),
        # Each was found late: a device assert deep in torch once a value had to be computed, and a
        # "dtype must be one of" that did not say which argument.
        "cache_dtype must be one of auto, float32, bfloat16, float16 \\(None: the precision of args\\); got 'fp16'":
            dict(args=_args(root / "x"), train_dataset=dataset, cache_dtype="fp16"),
        "cache_max_tokens must be a whole number of at least 1; got 0":
            dict(args=_args(root / "x"), train_dataset=dataset, cache_max_tokens=0),
        "cache_device: 'gpu' is not a device \\(cpu, cuda, cuda:N\\)":
            dict(args=_args(root / "x"), train_dataset=dataset, cache_device="gpu"),
    }
    if not torch.cuda.is_available():
        cases["cache_device cuda: no CUDA device is available; use cpu"] = dict(
            args=_args(root / "x"), train_dataset=dataset, cache_device="cuda")
    for message, kwargs in cases.items():
        with pytest.raises(ValueError, match=f"^CachedDPOTrainer: ({message})") as e:
            CachedDPOTrainer(model=str(model_dir), **kwargs)
        assert "\n" not in str(e.value)


def test_pairs_the_reference_cannot_take_are_refused_in_one_line(setup, pref_rows):
    """A pair longer than the model's context after TRL's truncation (TRL's own reference would
    score positions the model never saw), and a token id past the model's vocabulary (TRL's
    forward: an IndexError), each refused with the dataset row and the fix, before the reference
    pass runs."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dpocache.integrations.trl import CachedDPOTrainer

    model_dir, _, root = setup
    rows = [dict(r) for r in pref_rows[:6]]
    rows[4]["chosen"] = " sort" * 600
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    passes = []
    for kwargs in ({}, {"max_length": 1024}):  # no max_length, and TRL's default 1024, past the context
        with pytest.raises(ValueError) as e:
            CachedDPOTrainer(model=AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
                             args=_args(root / "too-long", precompute_ref_log_probs=True, **{"max_length": None,
                                                                                              **kwargs}),
                             train_dataset=Dataset.from_list(rows), processing_class=tokenizer,
                             cache_dir=root / "cache-refused")
        passes.append(str(e.value))
        assert not (root / "cache-refused").exists()  # refused before the reference pass
    cut = " after truncation to max_length=1024"
    for message, truncated in zip(passes, ("", cut)):
        start = re.escape(repr(rows[4]["prompt"][:40]))  # the prompt's start, to find the row by
        expected = (f"CachedDPOTrainer: train dataset row 4 as TRL tokenized it \\(prompt {start}\\.\\.\\.\\): "
                    f"6\\d\\d tokens{truncated}, longer than the model's context \\(512 positions, from its "
                    "config.json\\); set args.max_length to 512 or less")
        assert re.fullmatch(expected, message), message
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.add_tokens(["zzzunknownzzz"])
    rows = [dict(r) for r in pref_rows[:6]]
    rows[2]["rejected"] = " zzzunknownzzz"
    with pytest.raises(ValueError, match=f"^CachedDPOTrainer: train dataset row 2 as TRL tokenized it .*: token id "
                                         f"{len(tokenizer) - 1} is outside the model's vocabulary \\(vocab_size "
                                         "5\\d\\d in config.json\\)"):
        CachedDPOTrainer(model=AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
                         args=_args(root / "unknown-token", precompute_ref_log_probs=True, max_length=None),
                         train_dataset=Dataset.from_list(rows), processing_class=tokenizer,
                         cache_dir=root / "cache-refused")


@pytest.mark.slow
def test_the_documented_snippet_runs_as_written(tmp_path, model_dir, pref_rows):
    """docs/trl.md's example, verbatim, in a folder holding ./sft-model and prefs.jsonl (a tiny
    model, a few rows), with ~ there: it trains on this CPU and says where its values came from."""
    import re
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[2] / "docs" / "trl.md").read_text()
    snippet = re.search(r"```python\n(.*?)```", doc, re.S).group(1)
    assert "CachedDPOTrainer(" in snippet and "trainer.train()" in snippet
    shutil.copytree(model_dir, tmp_path / "sft-model")
    (tmp_path / "prefs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in pref_rows[:8]))
    env = {**os.environ, "HOME": str(tmp_path), "WANDB_MODE": "disabled"}
    done = subprocess.run([sys.executable, "-c", snippet], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    assert re.search(r"reference \(train\): \d+ pairs from the cache \(\d+ computed, 0 reused\) in "
                     + re.escape(str(tmp_path / ".cache" / "dpocache")), done.stderr)
    assert (tmp_path / "runs" / "trl").is_dir()
