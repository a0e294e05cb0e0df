"""Liger kernels (``--kernels auto|liger|none``, ``model.kernels``): Liger's Triton RMSNorm, RoPE
and SwiGLU (GEGLU in the Gemma families) in place of a model's own, in the reference pass and in
training's policy, on CUDA only (``pip install 'dpocache[liger]'``).

``choose_kernels`` decides from the request, the device and the model type (config.json's)
without importing Liger, so that a wrong request costs one line before any model loads:
``none`` runs the model's own code; ``auto`` applies Liger's kernels on CUDA where liger-kernel
is installed and has kernels for the model's family, and otherwise runs the model's own code and
says why (``KernelChoice.reason``); ``liger`` is refused with one line naming ``--kernels`` where
``auto`` would fall back. ``apply_kernels`` patches a loaded model (inside its PEFT and DDP
wrappers) through Liger's own function for its family, before any layer is compiled.

What stays dpocache's: the completion-only output head (``dpocache.scoring.logprobs``), so
Liger's cross entropy and fused linear cross entropy are never applied. Liger's values differ
from the model's own within bf16 rounding (tests/models/test_kernels.py, on a GPU). ``run.json``
and the cache build's summary carry the choice (``KernelChoice.to_json``).

Liger patches the model's modules in place, and one function of the family's transformers module,
``apply_rotary_pos_emb``, for the whole process: every model of that family in the process runs
Liger's RoPE from then on. The classes Liger also replaces in that module (so that models built
later would be patched too) are put back, so a model gets Liger's norms and MLPs only through
``apply_kernels``. Where a process also trains a policy with compiled layers (``train --compile
on``), its reference takes Liger's kernels without the RoPE (``liger_rope=False``): the compiled
layers would run Liger's RoPE too, which torch.compile cannot trace (a graph break in every layer).
"""

from __future__ import annotations

import contextlib
import inspect
import json
import logging
import sys
from dataclasses import dataclass, field
from pathlib import Path

from torch import nn

from dpocache.config import KERNELS, ConfigError, flag_name, liger_refused, liger_unavailable
from dpocache.models.directories import reference_weights_dir
from dpocache.scoring.logprobs import unwrap_causal_lm

log = logging.getLogger(__name__)

# The model types of liger-kernel 0.8.5's MODEL_TYPE_TO_APPLY_LIGER_FN whose function applies
# RMSNorm, RoPE or a gated MLP to the model it is given. Left out: llava, internvl and smolvlm
# (wrappers that hand their language model to another family's function) and nemotron (Liger
# has only its squared-ReLU activation).
LIGER_FAMILIES = frozenset({
    "deepseek_v2", "deepseek_v3", "deepseek_v4", "exaone4", "falcon_h1", "gemma", "gemma2", "gemma3", "gemma3_text",
    "gemma4", "gemma4_text", "glm4", "glm4v", "glm4v_moe", "gpt_oss", "granite", "hunyuan_v1_dense",
    "hunyuan_v1_moe", "llama", "llama4", "llama4_text", "ministral", "mistral", "mixtral", "mllama",
    "mllama_text_model", "muse_glimmer", "olmo2", "olmo3", "paligemma", "phi3", "pixtral", "qwen2", "qwen2_5_vl",
    "qwen2_5_vl_text", "qwen2_vl", "qwen2_vl_text", "qwen3", "qwen3_5", "qwen3_5_moe", "qwen3_5_moe_text",
    "qwen3_5_text", "qwen3_moe", "qwen3_next", "qwen3_vl", "qwen3_vl_moe", "qwen3_vl_moe_text", "qwen3_vl_text",
    "smollm3",
})
# The switches of Liger's per-family functions, each passed where the function takes it: the
# kernels --kernels promises as the function's own default has them (Liger leaves off what it
# cannot yet do for a family: Gemma 4's and GLM 4's RoPE, GPT-OSS's experts), the losses off
# (dpocache's head computes its own), and the vision towers' LayerNorm off.
ON = ("rms_norm", "rope", "swiglu", "geglu")
OFF = ("cross_entropy", "fused_linear_cross_entropy", "layer_norm")
# The activations Liger's gated-MLP kernels compute. Its per-instance patch does not check the
# model's (its class constructor does): a SwiGLU kernel on a GELU MLP would be silently wrong.
GATED_ACTIVATIONS = {"swiglu": ("silu", "swish"), "geglu": ("gelu_pytorch_tanh", "gelu_new")}
# A trained model's compiled layers cannot hold Liger's kernels: dynamo fails to trace Liger's
# autograd functions with gradients on (an AssertionError in LigerRMSNormFunction, torch 2.11 and
# liger-kernel 0.8.5 on an H200: docs/benchmarks/gpu-suite-h200-20261126.md), and inductor fuses
# the same norms and activations itself.
LIGER_UNDER_COMPILE = ("the policy's decoder layers are compiled (--compile on), and torch.compile cannot trace "
                       "Liger's kernels in training")
ROPE_LEFT_OUT = ("its RoPE left out: Liger's RoPE would reach the policy trained in this process, whose compiled "
                 "layers cannot trace it")


@dataclass
class KernelChoice:
    """Which kernels a model runs: ``requested`` (auto | liger | none), ``used`` (liger | none),
    ``reason`` (why, in words), ``applied`` (Liger's kernels patched in, set by ``apply_kernels``);
    ``rope``: whether Liger's RoPE, which patches every model of the family in the process, may be."""

    requested: str
    used: str
    reason: str
    model_type: str | None = None
    applied: list[str] = field(default_factory=list)
    rope: bool = True

    def to_json(self) -> dict:
        """What ``run.json`` and the cache build's summary record."""
        return {"requested": self.requested, "used": self.used, "reason": self.reason, "applied": list(self.applied)}


def choose_kernels(requested: str, device, model_type: str | None, installed: bool | None = None,
                   families: frozenset[str] = LIGER_FAMILIES, compiled_training: bool = False,
                   liger_rope: bool = True) -> KernelChoice:
    """The kernels a model of ``model_type`` runs on ``device`` (a ``torch.device`` or its name)
    for ``--kernels requested``; ``installed``: whether liger-kernel is (None: look, without
    importing it); ``compiled_training``: the model is trained with its decoder layers compiled
    (``--compile on``); ``liger_rope``: False where Liger's RoPE must not patch the process (its
    policy's layers are compiled). Pure: imports nothing, loads nothing. Raises ``ConfigError``,
    one line naming ``--kernels``, for ``liger`` where Liger cannot run."""
    if requested not in KERNELS:
        raise ConfigError(f"{flag_name('model.kernels')}: must be one of {', '.join(KERNELS)}; got {requested!r}")
    if requested == "none":
        return KernelChoice(requested, "none", "--kernels none: the model's own code", model_type)
    device_type = getattr(device, "type", None) or str(device).split(":", 1)[0]
    reason = liger_unavailable(device_type, installed)
    if reason is None and compiled_training:
        reason = LIGER_UNDER_COMPILE
    if reason is None and model_type not in families:
        reason = (f"Liger has no kernels for model type '{model_type}'" if model_type else
                  "the model's config.json names no model type")
    if reason is None:
        said = f"Liger's kernels for {model_type} on CUDA" + ("" if liger_rope else f", {ROPE_LEFT_OUT}")
        return KernelChoice(requested, "liger", said, model_type, rope=liger_rope)
    if requested == "liger":
        raise liger_refused(reason)
    return KernelChoice(requested, "none", reason, model_type)


def model_type_of(path: str | Path) -> str | None:
    """``model_type`` of the config.json of the model in ``path`` (an adapter directory's base),
    read without transformers; None where the file does not say."""
    try:
        config = json.loads((reference_weights_dir(path) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return config.get("model_type") if isinstance(config, dict) else None


def kernels_for(requested: str, device, path: str | Path, compiled_training: bool = False,
                liger_rope: bool = True) -> KernelChoice:
    """``choose_kernels`` for the model directory ``path``, before it loads."""
    return choose_kernels(requested, device, model_type_of(path), compiled_training=compiled_training,
                          liger_rope=liger_rope)


def apply_kernels(model: nn.Module, choice: KernelChoice) -> list[str]:
    """Patch Liger's kernels into ``model`` (the causal LM inside its PEFT and DDP wrappers) if
    ``choice`` uses them; returns what was applied (also ``choice.applied``). Before the decoder
    layers are compiled; after LoRA is added is fine (Liger's forwards call PEFT's layers).
    Where the installed liger-kernel lacks the family, ``auto`` falls back (``choice`` says so)."""
    if choice.used != "liger":
        return []
    try:
        from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN
    except ImportError as e:  # installed, but for other versions (liger-kernel 0.8 needs transformers 5)
        return _fall_back(choice, f"liger-kernel cannot be imported ({' '.join(str(e).split()) or type(e).__name__})")
    lm = unwrap_causal_lm(model)
    model_type = getattr(lm.config, "model_type", None)
    apply = MODEL_TYPE_TO_APPLY_LIGER_FN.get(model_type)
    if apply is None:
        return _fall_back(choice, f"the installed liger-kernel has no kernels for model type '{model_type}'")
    switches = _switches(inspect.signature(apply).parameters, lm.config)
    if not choice.rope and "rope" in switches:
        switches["rope"] = False
    with _family_classes_kept(lm):
        apply(model=lm, **switches)
    choice.applied = [name for name in ON if switches.get(name)]
    log.info("Liger kernels applied to the %s model: %s", model_type, ", ".join(choice.applied))
    return choice.applied


def _switches(params, config) -> dict[str, bool]:
    """The switches Liger's function for the family takes (each family names its MLP kernel):
    the kernels on that it applies by default, a gated-MLP kernel only for the activation it computes."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config  # a multimodal model's LM
    act = getattr(text, "hidden_activation", None) or getattr(text, "hidden_act", None)
    on = {name: params[name].default is True and act in GATED_ACTIVATIONS.get(name, (act,))
          for name in ON if name in params}
    return {**on, **{name: False for name in OFF if name in params}}


def _fall_back(choice: KernelChoice, reason: str) -> list[str]:
    """``auto`` runs the model's own code, saying why; ``liger`` stops with one line."""
    if choice.requested == "liger":
        raise liger_refused(reason)
    choice.used, choice.reason = "none", reason
    return []


@contextlib.contextmanager
def _family_classes_kept(lm: nn.Module):
    """Put back the classes Liger replaces in the model's transformers module (its norm and MLP
    classes, for models built later): this model's modules are patched in place, and a model
    loaded later with ``--kernels none`` must get the family's own."""
    module = sys.modules.get(type(lm).__module__)
    before = dict(vars(module)) if module is not None else {}
    try:
        yield
    finally:
        for name, value in before.items():
            if isinstance(value, type) and getattr(module, name, None) is not value:
                setattr(module, name, value)
