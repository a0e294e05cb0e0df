"""``--kernels auto|liger|none`` (dpocache.models.kernels): which kernels run where, refused in one
line before any model loads where Liger cannot run, patched in through Liger's per-family function
(a stand-in for liger-kernel here: it is not installed on CPU machines), and recorded in run.json
and the cache build's summary. On a GPU with liger-kernel, the values with and without Liger's
kernels agree within bf16 rounding, each process apart (Liger's RoPE is process-wide)."""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
from train_fixtures import (  # noqa: F401 (fixtures are used by name; one_thread is autouse)
    base_model,
    flags,
    one_thread,
    run_json,
    run_training,
    train_jsonl,
    train_records,
)

from dpocache.config import LIGER_MISSING, Config, ConfigError
from dpocache.models.kernels import apply_kernels, choose_kernels, kernels_for, model_type_of

CPU_ONLY = "Liger's kernels run on CUDA only, and this run's device is cpu"
HAS_LIGER = importlib.util.find_spec("liger_kernel") is not None


# ------------------------------------------------------------------------------- the choice


@pytest.mark.parametrize("requested, device, model_type, installed, used, reason", [
    ("auto", "cpu", "llama", True, "none", CPU_ONLY),
    ("auto", torch.device("cpu"), "llama", None, "none", CPU_ONLY),
    ("none", "cpu", "llama", None, "none", "--kernels none"),
    ("none", "cuda", "llama", True, "none", "--kernels none"),
    ("auto", "cuda", "llama", False, "none", LIGER_MISSING),
    ("auto", "cuda:1", "llama", True, "liger", "llama on CUDA"),
    ("auto", torch.device("cuda", 0), "qwen2", True, "liger", "qwen2 on CUDA"),
    ("liger", "cuda", "gemma2", True, "liger", "gemma2 on CUDA"),
    ("auto", "cuda", "gpt2", True, "none", "Liger has no kernels for model type 'gpt2'"),
    ("auto", "cuda", None, True, "none", "names no model type"),
])
def test_choice(requested, device, model_type, installed, used, reason):
    choice = choose_kernels(requested, device, model_type, installed=installed)
    assert (choice.requested, choice.used) == (requested, used)
    assert reason in choice.reason, choice.reason
    assert choice.to_json() == {"requested": requested, "used": used, "reason": choice.reason, "applied": []}


@pytest.mark.parametrize("device, model_type, installed, reason", [
    ("cpu", "llama", True, CPU_ONLY),
    ("cuda", "llama", False, LIGER_MISSING),
    ("cuda", "gpt2", True, "Liger has no kernels for model type 'gpt2'"),
])
def test_liger_where_it_cannot_run_is_one_line_naming_the_flag(device, model_type, installed, reason):
    with pytest.raises(ConfigError) as e:
        choose_kernels("liger", device, model_type, installed=installed)
    line = str(e.value)
    assert "\n" not in line and line.startswith("--kernels (model.kernels) liger: ") and reason in line, line


def test_compiled_training_runs_the_models_own_code():
    """dynamo cannot trace Liger's autograd functions with gradients on (seen on an H200), so a
    policy trained with compiled layers gets the model's code, which inductor fuses itself."""
    choice = choose_kernels("auto", "cuda", "llama", installed=True, compiled_training=True)
    assert choice.used == "none" and "--compile on" in choice.reason, choice.reason
    assert choose_kernels("auto", "cuda", "llama", installed=True).used == "liger"  # a reference pass is not trained
    with pytest.raises(ConfigError, match=r"^--kernels \(model.kernels\) liger: the policy's decoder layers are "
                                          r"compiled \(--compile on\)"):
        choose_kernels("liger", "cuda", "llama", installed=True, compiled_training=True)


def test_training_with_compiled_layers_refuses_liger_before_any_model_loads(cli, monkeypatch, tmp_path, base_model,
                                                                           train_jsonl):
    """Where Liger could run (made so here on the CPU), ``--compile on`` training still refuses it."""
    import dpocache.config
    import dpocache.models.kernels

    _no_model_loads(monkeypatch)
    for module in (dpocache.config, dpocache.models.kernels):
        monkeypatch.setattr(module, "liger_unavailable", lambda *a, **k: None)
    rc, _, err = cli("train", "--output-dir", tmp_path / "run", "--model", base_model, "--data", train_jsonl,
                     "--cache-dir", tmp_path / "cache", "--device", "cpu", "--kernels", "liger", "--compile", "on")
    assert rc == 2 and err.count("\n") == 1, err
    assert "liger: the policy's decoder layers are compiled (--compile on)" in err, err
    assert not list(tmp_path.glob("cache/*/shard-*"))


def test_an_unknown_choice_is_refused():
    with pytest.raises(ConfigError, match=r"--kernels \(model.kernels\): must be one of auto, liger, none; got 'on'"):
        choose_kernels("on", "cuda", "llama", installed=True)


def test_without_the_package_on_cuda(monkeypatch):
    """Whether liger-kernel is installed is looked up, not imported."""
    real = importlib.util.find_spec

    def installed(yes: bool):
        spec = object() if yes else None
        monkeypatch.setattr(importlib.util, "find_spec",
                            lambda name, *a: spec if name == "liger_kernel" else real(name, *a))

    installed(False)
    assert choose_kernels("auto", "cuda", "llama").reason == LIGER_MISSING
    with pytest.raises(ConfigError, match=r"pip install 'dpocache\[liger\]'"):
        choose_kernels("liger", "cuda", "llama")
    installed(True)
    assert choose_kernels("auto", "cuda", "llama").used == "liger"


def test_validate_refuses_liger_on_a_cpu_and_takes_the_rest():
    for kernels in ("auto", "none"):
        cfg = Config()
        cfg.model.kernels, cfg.model.device = kernels, "cpu"
        cfg.validate()
    cfg = Config()
    cfg.model.kernels, cfg.model.device = "liger", "cpu"
    with pytest.raises(ConfigError, match=r"^--kernels \(model.kernels\) liger: Liger's kernels run on CUDA only"):
        cfg.validate()
    cfg.model.kernels = "bogus"
    with pytest.raises(ConfigError, match=r"--kernels \(model.kernels\): must be one of auto, liger, none"):
        cfg.validate()


def test_model_type_is_read_from_config_json(tmp_path, model_dir):
    assert model_type_of(model_dir) == "llama"
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": str(model_dir)}))
    assert model_type_of(adapter) == "llama"  # an adapter directory's base
    assert model_type_of(tmp_path / "nothing") is None
    assert kernels_for("auto", "cpu", model_dir).model_type == "llama"


# ------------------------------------------------------------------------------- applying


class FakeNorm(torch.nn.Module):
    pass


@pytest.fixture
def fake_liger(monkeypatch):
    """liger_kernel.transformers.monkey_patch with a llama function that does what Liger's does
    to a model (its modules patched, the family module's norm class and RoPE replaced) and
    records its arguments."""
    from transformers.models.llama import modeling_llama

    calls = []

    def apply_liger_kernel_to_llama(rope=True, cross_entropy=False, fused_linear_cross_entropy=True, rms_norm=True,
                                    swiglu=True, model=None):
        calls.append(dict(rope=rope, cross_entropy=cross_entropy, fused=fused_linear_cross_entropy,
                          rms_norm=rms_norm, swiglu=swiglu, model=model))
        modeling_llama.LlamaRMSNorm = FakeNorm
        if rope:
            modeling_llama.apply_rotary_pos_emb = fake_rope
        model.model.norm.liger = True

    def fake_rope(*args, **kwargs):
        raise AssertionError("not run here")

    monkeypatch.setattr(modeling_llama, "apply_rotary_pos_emb", modeling_llama.apply_rotary_pos_emb)  # restored after
    monkeypatch.setattr(modeling_llama, "LlamaRMSNorm", modeling_llama.LlamaRMSNorm)
    table = types.ModuleType("liger_kernel.transformers.monkey_patch")
    table.MODEL_TYPE_TO_APPLY_LIGER_FN = {"llama": apply_liger_kernel_to_llama}
    for name in ("liger_kernel", "liger_kernel.transformers"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers.monkey_patch", table)
    return types.SimpleNamespace(calls=calls, module=modeling_llama, rope=fake_rope, table=table)


def _llama(tokenizer, **overrides):
    from dpocache.models.tiny import build_model

    return build_model("llama", tokenizer, **overrides)


def test_apply_patches_the_lm_inside_peft_without_the_losses(fake_liger, tokenizer):
    from peft import LoraConfig, get_peft_model

    original_norm = fake_liger.module.LlamaRMSNorm
    lm = _llama(tokenizer)
    policy = get_peft_model(lm, LoraConfig(r=4, target_modules="all-linear"))
    choice = choose_kernels("auto", "cuda", "llama", installed=True)
    assert apply_kernels(policy, choice) == ["rms_norm", "rope", "swiglu"] == choice.applied
    (call,) = fake_liger.calls
    assert call.pop("model") is lm  # the causal LM itself, not PEFT's wrapper
    assert call == dict(rope=True, cross_entropy=False, fused=False, rms_norm=True, swiglu=True)
    assert lm.model.norm.liger
    # Models built later get the family's own classes; Liger's RoPE stays the module's (process-wide).
    assert fake_liger.module.LlamaRMSNorm is original_norm
    assert fake_liger.module.apply_rotary_pos_emb is fake_liger.rope
    assert choice.to_json()["applied"] == ["rms_norm", "rope", "swiglu"]


def test_beside_a_compiled_policy_the_reference_takes_liger_without_its_process_wide_rope(fake_liger, tokenizer):
    """Liger's RoPE replaces the family module's function for every model in the process: a
    policy compiled there would trace it (a graph break in each layer, seen on an H200)."""
    original_rope = fake_liger.module.apply_rotary_pos_emb
    choice = choose_kernels("auto", "cuda", "llama", installed=True, liger_rope=False)
    assert choice.used == "liger" and "its RoPE left out" in choice.reason, choice.reason
    assert apply_kernels(_llama(tokenizer), choice) == ["rms_norm", "swiglu"]
    assert fake_liger.calls[0]["rope"] is False and fake_liger.calls[0]["rms_norm"] is True
    assert fake_liger.module.apply_rotary_pos_emb is original_rope


def test_train_with_compiled_layers_builds_its_reference_without_ligers_rope(monkeypatch, fake_liger, tmp_path,
                                                                            base_model, train_jsonl):
    """Where Liger could run (made so here on the CPU), ``train --compile on`` builds the
    reference's values with Liger's kernels but its RoPE, which would reach the compiled policy
    (the stand-in's RoPE raises if it runs); the policy runs the model's own code."""
    import dpocache.config
    import dpocache.models.kernels
    import dpocache.models.reference
    import dpocache.training.setup

    for module in (dpocache.config, dpocache.models.kernels):
        monkeypatch.setattr(module, "liger_unavailable", lambda *a, **k: None)
    for module in (dpocache.training.setup, dpocache.models.reference):  # what is compiled is not the question here
        monkeypatch.setattr(module, "compile_layers", lambda model: 0)
    out = tmp_path / "run"
    run_training(*flags(base_model, train_jsonl, out, tmp_path / "cache", "--max-steps", "1", "--compile", "on"))
    info = run_json(out)
    assert info["reference"]["kernels"]["applied"] == ["rms_norm", "swiglu"], info["reference"]["kernels"]
    assert "its RoPE left out" in info["reference"]["kernels"]["reason"]
    assert info["policy"]["kernels"]["used"] == "none" and "--compile on" in info["policy"]["kernels"]["reason"]
    assert [call["rope"] for call in fake_liger.calls] == [False]


def test_no_swiglu_kernel_on_another_activation(fake_liger, tokenizer):
    """Liger's per-instance patch would run SiLU in a GELU MLP without a word."""
    choice = choose_kernels("liger", "cuda", "llama", installed=True)
    assert apply_kernels(_llama(tokenizer, hidden_act="gelu"), choice) == ["rms_norm", "rope"]
    assert fake_liger.calls[0]["swiglu"] is False


def test_none_applies_nothing_and_imports_nothing(monkeypatch, tokenizer):
    monkeypatch.setitem(sys.modules, "liger_kernel", None)  # an import would raise
    for choice in (choose_kernels("none", "cuda", "llama"), choose_kernels("auto", "cpu", "llama")):
        assert apply_kernels(_llama(tokenizer), choice) == [] and choice.applied == []


def test_a_family_the_installed_liger_lacks(fake_liger, tokenizer):
    del fake_liger.table.MODEL_TYPE_TO_APPLY_LIGER_FN["llama"]
    choice = choose_kernels("auto", "cuda", "llama", installed=True)
    assert apply_kernels(_llama(tokenizer), choice) == []
    assert choice.used == "none" and "installed liger-kernel has no kernels for model type 'llama'" in choice.reason
    with pytest.raises(ConfigError, match="^--kernels .* liger: the installed liger-kernel has no kernels"):
        apply_kernels(_llama(tokenizer), choose_kernels("liger", "cuda", "llama", installed=True))


def test_a_liger_that_cannot_be_imported(monkeypatch, tokenizer):
    monkeypatch.setitem(sys.modules, "liger_kernel", None)
    choice = choose_kernels("auto", "cuda", "llama", installed=True)
    assert apply_kernels(_llama(tokenizer), choice) == []
    assert choice.used == "none" and choice.reason.startswith("liger-kernel cannot be imported")


def test_reference_records_its_choice_and_refuses_before_loading(monkeypatch, model_dir):
    from dpocache.models import reference

    ref = reference.ReferenceModel.from_pretrained(model_dir, "float32", "cpu")
    assert ref.kernels.to_json() == {"requested": "auto", "used": "none", "reason": CPU_ONLY, "applied": []}
    monkeypatch.setattr(reference, "load_causal_lm", lambda *a, **k: pytest.fail("the model was loaded"))
    with pytest.raises(ConfigError, match="CUDA only"):
        reference.ReferenceModel.from_pretrained(model_dir, "float32", "cpu", kernels="liger")


# ------------------------------------------------------------------------------- the command line


def _no_model_loads(monkeypatch):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    for cls in (AutoModelForCausalLM, AutoTokenizer):
        monkeypatch.setattr(cls, "from_pretrained", lambda *a, **k: pytest.fail("loaded before refusing"))


@pytest.mark.parametrize("command", ["train", "build"])
def test_liger_on_a_cpu_stops_before_anything_loads(cli, monkeypatch, tmp_path, base_model, train_jsonl, command):
    _no_model_loads(monkeypatch)
    args = (["train", "--output-dir", tmp_path / "run"] if command == "train" else ["cache", "build"])
    rc, _, err = cli(*args, "--model", base_model, "--data", train_jsonl, "--cache-dir", tmp_path / "cache",
                     "--device", "cpu", "--kernels", "liger")
    assert rc == 2 and err.count("\n") == 1, err
    assert "--kernels (model.kernels) liger: Liger's kernels run on CUDA only" in err, err
    assert not (tmp_path / "run").exists() and not list(tmp_path.glob("cache/*/shard-*"))


def test_run_json_and_the_build_summary_name_the_kernels(cli, tmp_path, base_model, train_jsonl):
    rc, out, err = cli("cache", "build", "--model", base_model, "--data", train_jsonl, "--cache-dir",
                       tmp_path / "built", "--max-length", "64", "--dtype", "float32", "--device", "cpu",
                       "--kernels", "none", "--json")
    assert rc == 0, err
    summary = json.loads(out.strip().splitlines()[-1])
    own = "--kernels none: the model's own code"
    assert summary["kernels"] == {"requested": "none", "used": "none", "reason": own, "applied": []}

    out_dir = tmp_path / "run"
    run_training(*flags(base_model, train_jsonl, out_dir, tmp_path / "cache", "--max-steps", "1"))
    info = run_json(out_dir)
    auto = {"requested": "auto", "used": "none", "reason": CPU_ONLY, "applied": []}
    assert info["policy"]["kernels"] == auto
    assert info["reference"]["kernels"] == auto  # the reference pass training ran for its cache
    assert info["config"]["model"]["kernels"] == "auto"


@pytest.mark.skipif(not HAS_LIGER, reason="liger-kernel is not installed")
def test_the_families_are_in_the_installed_table():
    """The table choose_kernels reads without importing Liger is Liger's own (0.8.5's; an older
    liger-kernel that lacks a family is answered when its kernels are applied)."""
    from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN

    from dpocache.models.kernels import LIGER_FAMILIES

    common = {"llama", "mistral", "qwen2", "qwen3", "gemma2", "mixtral"}
    assert common <= LIGER_FAMILIES & set(MODEL_TYPE_TO_APPLY_LIGER_FN)


# ------------------------------------------------------------------------------- on a GPU, with Liger

needs_liger_gpu = pytest.mark.skipif(not (torch.cuda.is_available() and HAS_LIGER),
                                     reason="needs a CUDA device and liger-kernel (pip install 'dpocache[liger]')")

# One process per setting: Liger's RoPE, once applied, is the family's in the whole process.
REFERENCE_VALUES = """
import json, sys, torch
from dpocache.data.pairs import load_preference_data
from dpocache.models.loading import load_tokenizer
from dpocache.models.reference import ReferenceModel

dirs, kernels, dtypes, data, out = json.loads(sys.argv[1]), sys.argv[2], sys.argv[3].split(","), *sys.argv[4:6]
torch.manual_seed(0)
ids = torch.randint(3, 400, (4, 48))
attn = torch.ones_like(ids)
attn[2:, 40:] = 0  # right padding
comp = torch.zeros_like(ids)
comp[:, 20:] = 1
comp *= attn
results = {}
for arch, path in dirs.items():
    tokenizer = load_tokenizer(path)
    pairs = load_preference_data(data, tokenizer, 64, show_progress=False).pairs[:8]
    for dtype in dtypes:
        ref = ReferenceModel.from_pretrained(path, dtype, "cuda", kernels=kernels)  # the shared layout: scored below
        sums = ref.score(pairs, tokenizer.pad_token_id or 0)
        results[f"{arch}/{dtype}"] = {"tokens": ref.logprobs(ids, attn, comp).cpu(),
                                      "sums": torch.stack([sums.chosen_logps, sums.rejected_logps]).cpu(),
                                      "kernels": ref.kernels.to_json(), "layout": ref.layout}
        del ref
        torch.cuda.empty_cache()
torch.save(results, out)
"""


def _python(*args, cwd: Path, code: str | None = None) -> None:
    head = ["-c", code] if code else ["-m", "dpocache"]
    proc = subprocess.run([sys.executable, *head, *map(str, args)], cwd=cwd, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]


def _within_bf16_rounding(liger: torch.Tensor, none: torch.Tensor, fp32: torch.Tensor, what: str) -> None:
    """Liger's bf16 values are about as close to the fp32 values (the independent value) as the model's
    own bf16 values are, and as close to those as bf16 rounding allows: a bound set by the model's own
    bf16 error (three times it), with a floor of 0.2% of the values' size (bf16 keeps 8 bits: 0.4%)
    for an error that happens to be tiny."""
    own_error = float((none - fp32).abs().max())
    bound = 3 * own_error + 0.002 * float(fp32.abs().max())
    assert float((liger - none).abs().max()) <= bound, (what, liger, none, own_error)
    assert float((liger - fp32).abs().max()) <= bound, (what, liger, fp32, own_error)


@pytest.mark.gpu
@needs_liger_gpu
def test_reference_values_with_liger_within_bf16_rounding(tmp_path, train_jsonl):  # noqa: F811
    from dpocache.models.tiny import save_tiny_model

    archs = ("llama", "qwen2", "gemma2")
    dirs = {arch: str(save_tiny_model(tmp_path / arch, arch)) for arch in archs}
    _python(json.dumps(dirs), "none", "bfloat16,float32", train_jsonl, tmp_path / "none.pt", cwd=tmp_path,
            code=REFERENCE_VALUES)
    _python(json.dumps(dirs), "liger", "bfloat16", train_jsonl, tmp_path / "liger.pt", cwd=tmp_path,
            code=REFERENCE_VALUES)
    none, liger = torch.load(tmp_path / "none.pt"), torch.load(tmp_path / "liger.pt")
    for arch in archs:
        with_liger, own, fp32 = liger[f"{arch}/bfloat16"], none[f"{arch}/bfloat16"], none[f"{arch}/float32"]
        assert with_liger["kernels"]["used"] == "liger" and "rms_norm" in with_liger["kernels"]["applied"]
        assert "rope" in with_liger["kernels"]["applied"], with_liger["kernels"]
        assert own["kernels"]["used"] == "none"
        assert with_liger["layout"] == own["layout"]
        for key in ("tokens", "sums"):
            _within_bf16_rounding(with_liger[key], own[key], fp32[key], f"{arch} {key}")


@pytest.mark.gpu
@needs_liger_gpu
def test_training_steps_with_liger_within_bf16_rounding(tmp_path, base_model, train_jsonl):  # noqa: F811
    """Two steps (the first at the reference's own weights, where the loss is log 2 in every run;
    the second after an update): loss and gradient norm."""
    rows = {}
    for name, dtype, kernels in (("fp32", "float32", "none"), ("none", "bfloat16", "none"),
                                 ("liger", "bfloat16", "liger")):
        out = tmp_path / name
        # A cache of its own: each run's reference pass runs with its own kernels.
        _python("train", *flags(base_model, train_jsonl, out, tmp_path / f"cache-{name}", "--device", "cuda",
                                "--dtype", dtype, "--kernels", kernels, "--max-steps", "2"), cwd=tmp_path)
        info = run_json(out)
        assert info["policy"]["kernels"]["used"] == info["reference"]["kernels"]["used"] == kernels
        rows[name] = train_records(out)
    assert rows["liger"] and len(rows["liger"]) == len(rows["none"]) == len(rows["fp32"])
    for key in ("loss", "grad_norm"):
        values = {name: torch.tensor([r[key] for r in rows[name]], dtype=torch.float64) for name in rows}
        assert all(math.isfinite(v) for v in values["liger"].tolist())
        _within_bf16_rounding(values["liger"], values["none"], values["fp32"], key)
