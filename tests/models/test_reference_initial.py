"""The reference is the model the policy starts from: a PEFT adapter directory's reference is
its base with that adapter on (``--reference base``: the bare base), and its cache namespace
covers the adapter's weights and config."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from train_fixtures import (  # noqa: F401  (fixtures are used by name; one_thread is autouse)
    base_model, flags, namespace_dirs, one_thread, run_json, run_training, train_jsonl, train_records,
)

from dpocache.cache import namespace_for_dir
from dpocache.cli.entry import main as cli_main


def make_adapter(base: Path, out: Path, seed: int = 0, dropout: float = 0.0) -> Path:
    """A LoRA adapter on ``base`` whose B matrices are non-zero (PEFT starts them at 0, which
    would leave the outputs unchanged), saved with ``save_pretrained``."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    lora = LoraConfig(r=4, lora_alpha=16, lora_dropout=dropout, target_modules="all-linear", task_type="CAUSAL_LM")
    peft_model = get_peft_model(model, lora)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    peft_model.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def adapter_dir(tmp_path_factory, base_model) -> Path:
    return make_adapter(base_model, tmp_path_factory.mktemp("adapter") / "sft-lora")


def test_adapter_namespace_covers_the_adapter(tmp_path, base_model, adapter_dir):
    cache = tmp_path / "cache"
    base_ns = namespace_for_dir(base_model, torch.float32, cache)
    initial = namespace_for_dir(adapter_dir, torch.float32, cache)
    assert initial.id != base_ns.id and "adapter" in initial.model
    assert namespace_for_dir(adapter_dir, torch.float32, cache, "base").id == base_ns.id
    other = make_adapter(base_model, tmp_path / "other-lora", seed=1)  # same config, other weights
    assert namespace_for_dir(other, torch.float32, cache).id not in (initial.id, base_ns.id)
    with pytest.raises(ValueError, match="model.reference"):
        namespace_for_dir(adapter_dir, torch.float32, cache, "adapter-off")


def test_adapter_dir_step0_margins_are_zero(tmp_path, base_model, adapter_dir, train_jsonl):
    """The policy loaded from an adapter directory is base + adapter; so is its reference, so
    step-0 rewards are 0 within 1e-6 in fp32. With --reference base they are not."""
    cache = tmp_path / "cache"
    out = tmp_path / "initial"
    run_training(*flags(adapter_dir, train_jsonl, out, cache, "--max-steps", "1"))
    first = train_records(out)[0]
    print(f"\nadapter step-0: margin {first['rewards/margins']:.3g}, chosen {first['rewards/chosen']:.3g}")
    assert abs(first["rewards/margins"]) <= 1e-6
    assert abs(first["rewards/chosen"]) <= 1e-6 and abs(first["rewards/rejected"]) <= 1e-6
    ref = run_json(out)["reference"]
    assert ref["reference"] == "initial" and "adapter" in ref["model"]
    assert ref["namespace"] == namespace_for_dir(adapter_dir, torch.float32, cache).id
    assert ref["step0_audit"]["ok"] and ref["step0_audit"]["max_abs_drift"] <= 1e-4

    out_base = tmp_path / "base"
    run_training(*flags(adapter_dir, train_jsonl, out_base, cache, "--max-steps", "1", "--reference", "base"))
    first = train_records(out_base)[0]
    print(f"--reference base step-0: chosen {first['rewards/chosen']:.3g}, rejected {first['rewards/rejected']:.3g}")
    assert max(abs(first["rewards/chosen"]), abs(first["rewards/rejected"])) > 1e-4
    ref = run_json(out_base)["reference"]
    assert ref["namespace"] == namespace_for_dir(base_model, torch.float32, cache).id
    assert "skipped" in ref["step0_audit"]


def test_a_loaded_adapter_trains_with_the_runs_lora_dropout(tmp_path, base_model, train_jsonl):
    """An adapter saved with dropout 0.3 kept it in training (peft restores the saved rate): the
    policy's step-0 forward was random and the step-0 audit stopped the run, blaming the cache.
    The run's --lora.dropout (default 0) applies; with dropout on, the audit is skipped."""
    adapter = make_adapter(base_model, tmp_path / "dropout-lora", dropout=0.3)
    out, cache = tmp_path / "run", tmp_path / "cache"
    run_training(*flags(adapter, train_jsonl, out, cache, "--max-steps", "1"))
    assert abs(train_records(out)[0]["rewards/margins"]) <= 1e-6
    assert run_json(out)["reference"]["step0_audit"]["ok"]
    out = tmp_path / "with-dropout"
    run_training(*flags(adapter, train_jsonl, out, cache, "--max-steps", "1", "--lora.dropout", "0.3"))
    assert "--lora.dropout" in run_json(out)["reference"]["step0_audit"]["skipped"]


@pytest.mark.parametrize("extra, fragment", [
    (("--lora-r", "8"), "is a PEFT adapter, which trains with its own rank"),
    (("--lora.target_modules", "q_proj"), "is a PEFT adapter"),
])
def test_lora_shape_flags_on_an_adapter_dir_are_refused(tmp_path, adapter_dir, train_jsonl, capsys, extra, fragment):
    """They were ignored: the saved adapter trained as it was, while run.json recorded the flags."""
    assert cli_main(["train", *flags(adapter_dir, train_jsonl, tmp_path / "run", tmp_path / "cache"), *extra]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and fragment in err[0] and extra[0] in err[0], err


def test_lora_flags_without_a_rank_are_refused(tmp_path, base_model, train_jsonl, capsys):
    """--lora.alpha without --lora-r trained every weight of the model."""
    assert cli_main(["train", *flags(base_model, train_jsonl, tmp_path / "run", tmp_path / "cache"),
                     "--lora.alpha", "32"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--lora.alpha 32 set without --lora-r" in err[0], err


def test_cache_cli_reference_flag(tmp_path, base_model, adapter_dir, train_jsonl, capsys):
    """``cache build|export`` take --reference too, and agree with training's namespaces."""
    cache = tmp_path / "cache"
    common = ["--data", str(train_jsonl), "--cache-dir", str(cache), "--dtype", "float32", "--device", "cpu",
              "--max-length", "64"]
    assert cli_main(["cache", "build", "--model", str(adapter_dir), *common]) == 0
    assert cli_main(["cache", "build", "--model", str(adapter_dir), "--reference", "base", *common]) == 0
    names = {p.name for p in namespace_dirs(cache)}
    assert names == {namespace_for_dir(adapter_dir, torch.float32, cache).id,
                     namespace_for_dir(base_model, torch.float32, cache).id}
    rows = {}
    for ref in ("initial", "base"):
        out = tmp_path / f"{ref}.jsonl"
        assert cli_main(["cache", "export", "--model", str(adapter_dir), "--reference", ref, "--out", str(out),
                         *common]) == 0
        rows[ref] = out.read_text()
    assert rows["initial"] != rows["base"]
    capsys.readouterr()
    assert cli_main(["cache", "verify", "--model", str(adapter_dir), "--samples", "4", *common]) == 0
    assert "OK" in capsys.readouterr().out


def _naive_completion_logps(model, prompt: list[int], completion: list[int]) -> torch.Tensor:
    """``(C,)`` log-probs of ``completion`` after ``prompt`` from the model's own full logits."""
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1:-1].float()  # (C, V)
    return logits.log_softmax(-1).gather(-1, torch.tensor(completion)[:, None]).squeeze(-1)


def test_reference_service_of_an_adapter_dir_is_the_initial_policy(base_model, adapter_dir):
    """ReferenceService.from_pretrained follows the same rule as train and cache build: an
    adapter directory's reference is base + adapter; ``reference="base"`` the bare base."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from dpocache.service.reference_service import ReferenceService

    request = {"prompt_ids": [5, 17, 42, 9], "completion_ids": [[33, 8, 71], [12, 64]]}
    base = AutoModelForCausalLM.from_pretrained(str(base_model), dtype=torch.float32).eval()
    initial = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(base_model), dtype=torch.float32),
                                        str(adapter_dir)).eval()
    for reference, model in (("initial", initial), ("base", base)):
        service = ReferenceService.from_pretrained(adapter_dir, dtype="float32", device="cpu", reference=reference)
        (got,) = service.score([request])
        for completion, values in zip(request["completion_ids"], got):
            expected = _naive_completion_logps(model, request["prompt_ids"], completion)
            assert torch.allclose(values, expected, atol=1e-5), (reference, values, expected)
    # The two references differ: the adapter changes the values.
    assert not torch.allclose(_naive_completion_logps(initial, [5, 17, 42, 9], [33, 8, 71]),
                              _naive_completion_logps(base, [5, 17, 42, 9], [33, 8, 71]), atol=1e-3)
