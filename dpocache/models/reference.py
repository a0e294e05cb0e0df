"""The reference model: frozen, inference only, with counters of its own work (the cache
build returns them in its summary).

Either a model of its own (``from_pretrained``: a model directory, optionally with a PEFT
adapter on, frozen) or the policy itself with its LoRA adapter disabled (``from_peft_policy``:
the reference of a fresh LoRA on a full model is that model, the adapter off).
"""

from __future__ import annotations

import contextlib
import logging
import time
from pathlib import Path
from typing import Sequence

import torch
from torch import nn

from dpocache.data.pairs import TokenizedPair
from dpocache.data.values import PairValues
from dpocache.models.hub_ids import resolve_model_path
from dpocache.models.kernels import KernelChoice, apply_kernels, kernels_for
from dpocache.models.loading import disable_dropout, load_causal_lm, load_for_storage, store_frozen_matrices_
from dpocache.models.streaming import StreamedLayers, move_resident_
from dpocache.runtime.preflight import check_model_dir
from dpocache.scoring import bf16_matmul
from dpocache.scoring.attention import choose_layout
from dpocache.scoring.bf16_matmul import cpu_has_amx_bf16
from dpocache.scoring.compiling import compile_layers, should_compile
from dpocache.scoring.layout_choice import COMPILES, LAYOUTS
from dpocache.scoring.layouts import LaidOut, lay_out, reference_row_width, run_laid_out
from dpocache.scoring.logprobs import CompletionLogProbs, autocast, decoder_layers, unwrap_causal_lm
from dpocache.scoring.shared import shared_prompt_logps

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(name: str, device: torch.device | str = "cpu") -> torch.dtype:
    """``auto`` → bfloat16 where it is faster than float32: CUDA devices with bf16, and CPUs
    with AMX tiles. CPUs with only AVX512-BF16 run bf16 matrix products *slower* than fp32
    (docs/benchmarks/levers-cpu-2core-20261123.md), so they get float32. An explicit bfloat16
    there runs its linear layers through the fp32 GEMM (``dpocache.scoring.bf16_matmul``), which
    still measured slower end to end than float32
    (docs/benchmarks/vs-trl-cpu-avx512-2core-20261122.md, round 3)."""
    if name == "auto":
        device = torch.device(device)
        if device.type == "cuda":
            # Native bf16 only (Ampere on): torch counts an older GPU's emulated bf16 as support,
            # and there bf16 runs slower than float32 and SDPA's fused kernels refuse it.
            return torch.bfloat16 if torch.cuda.is_bf16_supported(including_emulation=False) else torch.float32
        return torch.bfloat16 if cpu_has_amx_bf16() else torch.float32
    if name not in DTYPES:
        raise ValueError(f"dtype must be one of auto, {', '.join(DTYPES)}; got '{name}'")
    return DTYPES[name]


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def default_device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def _store_frozen_(model: nn.Module, dtype: torch.dtype) -> None:
    """A frozen reference of ours in its storage: under bf16 its fp32 weights are only ever used
    as bf16 values (rounded where they take the fp32 GEMM), and its matrices are stored in the
    compute dtype where no fp32 route needs them (``dpocache.models.loading``)."""
    if dtype == torch.bfloat16:
        bf16_matmul.round_frozen_weights_(model)
    store_frozen_matrices_(model, dtype)


class ReferenceModel:
    """Frozen log-prob scorer. ``logprobs`` runs under ``inference_mode`` and counts its work."""

    # (base directory, adapter directory or None) the weights were read from (``from_pretrained``):
    # a cache build checks them against the store's namespace. None: a model given in memory.
    source: tuple[Path, Path | None] | None = None

    def __init__(self, model: nn.Module, dtype: torch.dtype = torch.float32, compile: str = "off",
                 adapter_disabled: bool = False, layout: str = "auto", scorer: CompletionLogProbs | None = None,
                 attention: str | None = None, temperature: float = 1.0, kernels: KernelChoice | None = None):
        if layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {', '.join(LAYOUTS)}; got '{layout}'")
        if compile not in COMPILES:
            raise ValueError(f"compile must be one of {', '.join(COMPILES)}; got '{compile}'")
        self.model = model
        self.dtype = dtype
        self.device = next(model.parameters()).device
        self.adapter_disabled = adapter_disabled
        # The kernels the model runs (dpocache.models.kernels), applied before it came here: the layers
        # compile below. None: not chosen for this reference (the policy's own, adapter off).
        self.kernels = kernels
        if not adapter_disabled:
            model.eval()
            model.requires_grad_(False)
        if scorer is not None and temperature != 1.0:
            raise ValueError("a temperature other than 1 needs the reference's own scorer (not a sharded one)")
        # Given: sharded (distributed.sharded_reference). temperature: online RL's sampling temperature.
        self._scorer = scorer if scorer is not None else CompletionLogProbs(model, temperature=temperature)
        # How pairs are laid out for the forward (dpocache.scoring.layout_choice): "shared" runs each prompt
        # once for both completions; "padded" runs prompt + chosen and prompt + rejected rows.
        # Models whose attention takes no custom mask, or whose head is unknown, run "padded".
        # The attention backend first (dpocache.scoring.attention: auto | sdpa | flex; None: as loaded).
        self.layout_choice = choose_layout(unwrap_causal_lm(model), self._scorer, layout, attention)
        self.layout = self.layout_choice.used
        # Decoder layers compiled (dpocache.scoring.compiling): "on" now, "auto" once the pass's size is
        # known (``prepare``), "off" never.
        self.compile = compile
        self.compiled_layers = compile_layers(model) if compile == "on" else 0
        # The decoder layers streamed from host memory (dpocache.models.streaming; ``from_pretrained(stream=True)``).
        self.streamed: StreamedLayers | None = None
        self._run_shared = shared_prompt_logps  # a sharded reference wraps it (dpocache.distributed.sharded_reference)
        self.forward_passes = 0
        self.tokens = 0
        self.seconds = 0.0

    @classmethod
    def from_pretrained(cls, path: str | Path, dtype: str | torch.dtype = "float32",
                        device: str | torch.device | None = None,
                        compile: str = "off", layout: str = "auto",
                        adapter: str | Path | None = None, attention: str | None = None,
                        temperature: float = 1.0, kernels: str = "auto", stream: bool = False,
                        liger_rope: bool = True) -> "ReferenceModel":
        """The model in ``path``; with ``adapter`` (a PEFT adapter directory whose base is
        ``path``), that adapter on top, unmerged: the same layers the policy loaded from the
        adapter directory runs, so at step 0 both compute the same numbers. ``kernels``: Liger's
        kernels or the model's own (``dpocache.models.kernels``; ``liger`` where Liger cannot run
        is a ``ConfigError`` before the model loads; ``liger_rope=False``: without Liger's RoPE,
        which patches the whole process). ``stream``: the decoder layers stay in host
        memory and are copied to ``device`` one ahead of the layer that runs
        (``dpocache.models.streaming``; eager layers only)."""
        device = torch.device(device) if device is not None else default_device()
        if isinstance(dtype, str):
            dtype = resolve_dtype(dtype, device)
        path = resolve_model_path(str(path), "path")  # a Hub id: its snapshot in the local cache
        check_model_dir(path, "path", tokenizer=False)  # one line, not transformers' traceback
        if stream and compile == "on":
            raise ValueError("a streamed reference runs eager layers: compile must be auto or off")
        kernel_choice = kernels_for(kernels, device, path, liger_rope=liger_rope)
        # Off the CPU, the matrices are stored in the compute dtype (below) before the weights
        # move to the device, so the fp32 copy never takes device memory: on an H100 the 1.1B
        # bench model's fp32 weights alone would exceed the causal pass's whole peak at the 16384
        # budget, measured with this staging (docs/benchmarks/vs-trl-h100-20261123.md).
        staged = device.type != "cpu" and dtype != torch.float32
        # Staged, a checkpoint saved in the compute dtype is read in it (load_for_storage): the host
        # never holds its fp32 copy.
        # Streamed, the model is read to the host: its layers stay there.
        model = load_for_storage(path, dtype) if staged else load_causal_lm(path, "cpu" if stream else device)
        if adapter is not None:
            from peft import PeftModel

            model = PeftModel.from_pretrained(model, str(adapter), is_trainable=False).to(model.device)
            disable_dropout(model)
        if staged:
            store_frozen_matrices_(model, dtype)
        if stream:  # the layers stay on the host: the whole model never passes through the device
            model.requires_grad_(False)  # frozen (as the constructor makes it): what streams
            move_resident_(model, decoder_layers(model), device)
        elif staged:
            model.to(device)
        apply_kernels(model, kernel_choice)  # before the constructor compiles the layers (--compile on)
        streamed = None
        if stream:
            # Packed before the constructor, whose head probe runs a forward, and with what the
            # constructor and the storage give a resident model after it: the fp32-GEMM routing
            # (idempotent, the constructor's own), the rounding and the compute-dtype matrices.
            bf16_matmul.install(model)
            _store_frozen_(model, dtype)
            streamed = StreamedLayers(model, decoder_layers(model), device)
        reference = cls(model, dtype, "off" if stream else compile, layout=layout, attention=attention,
                        temperature=temperature, kernels=kernel_choice)
        if streamed is None:
            _store_frozen_(model, dtype)
        reference.streamed = streamed
        reference.source = (Path(path), Path(adapter) if adapter is not None else None)
        return reference

    @classmethod
    def from_peft_policy(cls, policy: nn.Module, dtype: torch.dtype = torch.float32,
                         temperature: float = 1.0) -> "ReferenceModel":
        """The policy's base weights, with every LoRA adapter disabled during each call."""
        if not hasattr(policy, "disable_adapter"):
            raise TypeError("from_peft_policy needs a PEFT model (with disable_adapter)")
        return cls(policy, dtype, adapter_disabled=True, temperature=temperature)

    @property
    def temperature(self) -> float:
        """What the logits are divided by before the log-softmax (1: the model's own values)."""
        return self._scorer.temperature

    def prepare(self, tokens: int) -> None:
        """Before a pass over ``tokens`` (each prompt once): compile the decoder layers if
        ``compile`` is ``auto`` and the pass is long enough to repay it (``dpocache.scoring.compiling``)."""
        if self.compile != "auto" or self.compiled_layers:
            return
        parameters = sum(p.numel() for p in self.model.parameters())
        if should_compile("auto", self.device.type, self.dtype, tokens, parameters):
            self.compiled_layers = compile_layers(self.model)
            log.info("compiled the reference's %d decoder layers for a pass of %d tokens", self.compiled_layers,
                     tokens)

    def _adapter_context(self):
        return self.model.disable_adapter() if self.adapter_disabled else contextlib.nullcontext()

    def logprobs(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, completion_mask: torch.Tensor,
                 scored: torch.Tensor | None = None) -> torch.Tensor:
        """``(N, T)`` inputs → ``(N, T)`` fp32 per-token log-probs, 0 at prompt and padding;
        ``scored``: ``scoring.logprobs.scored_positions`` of the mask, built on the host."""
        scored = None if scored is None else scored.to(self.device)
        return self._call(lambda: self._scorer(input_ids.to(self.device), attention_mask.to(self.device),
                                               completion_mask.to(self.device), scored=scored),
                          int(attention_mask.sum()))

    def shared_prompt_logprobs(self, batch) -> torch.Tensor:
        """``(M,)`` fp32 log-probs of the scored tokens of a ``dpocache.scoring.shared.SharedPromptBatch``
        (each prompt run once for both completions)."""
        return self._call(lambda: self._run_shared(self._scorer, batch.to(self.device)), batch.num_tokens)

    def score(self, pairs: Sequence[TokenizedPair], pad_id: int = 0, max_tokens: int | None = None,
              laid: LaidOut | None = None) -> PairValues:
        """Reference values of one batch of ``pairs`` ``(B,)``, per-token values included, on the
        CPU, in this reference's layout (``scoring.layouts``); ``max_tokens``: the budget the batch
        was planned under (packed FlexAttention rows are padded to it: ``reference_row_width``).
        ``laid``: ``lay_out(pairs, ...)`` done already (on a background thread)."""
        values, _ = run_laid_out(self, laid or self.lay_out(pairs, pad_id, max_tokens), per_token=True)
        return values

    def lay_out(self, pairs: Sequence[TokenizedPair], pad_id: int = 0, max_tokens: int | None = None) -> LaidOut:
        """``pairs`` laid out on the host as ``score`` runs them: pure host work, which the
        cache build does for the next batch while the device runs this one."""
        config = unwrap_causal_lm(self.model).config
        return lay_out(self.layout, pairs, pad_id, config, one_row=True, width=reference_row_width(self, max_tokens))

    def run_padded(self, batch) -> torch.Tensor:
        """``scoring.layouts.LayoutRunner``: a ``PairBatch`` → ``(2B, T)`` values on the CPU."""
        return self.logprobs(batch.input_ids, batch.attention_mask, batch.completion_mask, batch.scored).cpu()

    def run_shared(self, batch) -> torch.Tensor:
        """``scoring.layouts.LayoutRunner``: a ``SharedPromptBatch`` → ``(M,)`` values on the CPU."""
        return self.shared_prompt_logprobs(batch).cpu()

    def _call(self, fn, tokens: int) -> torch.Tensor:
        """Run ``fn`` frozen (eval, inference mode, autocast, adapter off) and count the pass."""
        start = time.perf_counter()
        was_training = self.model.training
        self.model.eval()  # an adapter-disabled policy may be in train mode
        try:
            with torch.inference_mode(), autocast(self.dtype, self.device), self._adapter_context():
                out = fn()
        finally:
            self.model.train(was_training)
        self.forward_passes += 1
        self.tokens += tokens
        self.seconds += time.perf_counter() - start
        return out
